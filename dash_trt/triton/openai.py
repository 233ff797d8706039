"""``dash-triton openai``: the OpenAI front door in front of a Triton server serving the DASH
repository, on FastAPI, uvicorn and pydantic.

Endpoints (``/v1/*`` need ``Authorization: Bearer KEY`` when a key is set):

- ``GET /v1/models``, ``GET /v1/models/{id}``;
- ``POST /v1/completions``: ``prompt`` as text, token ids, or a list of either (one completion
  each, ``choices[i]``); greedy at ``temperature`` 0 (the same tokens as offline generation),
  sampling otherwise; ``stream`` as server-sent events, with ``stream_options.include_usage`` a
  final chunk of usage; vLLM's ``top_k``, ``stop_token_ids``, ``ignore_eos``; ``image_features``;
- ``POST /v1/chat/completions``: the messages through the checkpoint's chat template (sandboxed
  jinja2); content parts ``text``, ``image_url`` and ``file`` (a PDF): a message with images or
  files is a document, answered by the repository's document model (one section a page, each
  under a ``<!-- page N: ... -->`` comment), its text the instruction;
- ``POST /v1/ocr``: uploaded PDFs and images (``multipart/form-data``, field ``file``, one or
  more) as one document: one section per page (JSON);
- ``GET /health`` (200 when the Triton models are ready), ``GET /metrics`` (Prometheus).

The HTTP layer is uvicorn's (h11): chunked bodies, bad ``Content-Length`` and pipelining are
handled as HTTP says. On top of it: a listen backlog of 2048; bodies larger than
``--max-body-mb`` answered 413 before they are read; a request whose headers do not arrive
within ``--header-timeout`` seconds, or whose body stalls past ``--body-timeout``, is closed
(a slow client holds no worker); JSON endpoints take ``application/json`` only (a form post
from a web page cannot drive the server); refusals are 4xx on the streaming path too (the first
answer from Triton is awaited before the event stream starts), 5xx only for outages; a client
that disconnects cancels its Triton request (the engine frees its blocks).

Image and file URLs: ``data:`` URLs (base64); ``file://`` only under ``--allow-file-root``;
``http(s)://`` only for the hosts of ``--allow-url-host``, never to a private, loopback or
link-local address, at most ``--fetch-max-mb`` and ``--fetch-timeout`` seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import hmac
import ipaddress
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, TextIO
from urllib.parse import unquote, urlsplit

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from ..cliutil import EXIT_CODES_NOTE, VERBOSE_HELP
from . import protocol as P
from .openai_models import APIError, ChatCompletionRequest, CompletionRequest, validation_error

__all__ = ["FrontDoor", "FrontDoorSettings", "OpenAIServer", "create_app", "openai_main", "add_parser"]

API_KEY_ENV = "DASH_TRT_API_KEY"
#: The chat template of a checkpoint that has none (the demo model's).
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


@dataclass
class FrontDoorSettings:
    triton_grpc: str = "127.0.0.1:8001"
    model: str = P.DEFAULT_NAME
    api_key: str | None = None
    tokenizer: str | None = None  #: a checkpoint folder with tokenizer.json (default: the demo's byte tokenizer)
    max_body_bytes: int = 64 * 2**20
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    request_timeout: float = 3600.0
    allow_file_root: str | None = None
    allow_url_hosts: tuple[str, ...] = ()
    fetch_max_bytes: int = 32 * 2**20
    fetch_timeout: float = 10.0
    default_max_tokens: int = 2048  #: chat completions without max_tokens
    #: with an API key, /metrics answers without it too (a Prometheus scraper without the key)
    public_metrics: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def _keyed(path: str, s: FrontDoorSettings) -> bool:
    """Whether ``path`` needs the API key (when one is set): everything but ``/health`` (a load
    balancer's probe), and ``/metrics`` with ``public_metrics``."""
    return path != "/health" and not (path == "/metrics" and s.public_metrics)


# ------------------------------------------------------------------------------ backend
class TritonBackend:
    """The Triton models behind the front door, through tritonclient's asyncio gRPC client:
    generation (unary and streaming) and documents."""

    def __init__(self, settings: FrontDoorSettings):
        import tritonclient.grpc.aio as aio

        self.s = settings
        self.aio = aio
        self.client = None  # made in start(): gRPC's asyncio channel belongs to the loop it is made in
        self.config = None
        self.tokenizer = None
        self.has_documents = False

    async def start(self) -> None:
        from ..documents.tokenizer import ByteTokenizer, load_tokenizer
        from ..models.config import DashModelConfig

        self.client = self.aio.InferenceServerClient(self.s.triton_grpc)
        try:
            cfg = await self.client.get_model_config(self.s.model, as_json=True)
        except Exception as exc:
            raise RuntimeError(
                f"cannot read model '{self.s.model}' from Triton at {self.s.triton_grpc}: {exc}"
            ) from None
        params = {k: v.get("string_value", "") for k, v in cfg["config"].get("parameters", {}).items()}
        if P.PARAM_MODEL_CONFIG not in params:
            raise RuntimeError(f"model '{self.s.model}' is not a DASH generation model (no {P.PARAM_MODEL_CONFIG})")
        self.config = DashModelConfig.from_dict(json.loads(params[P.PARAM_MODEL_CONFIG]))
        self.tokenizer = load_tokenizer(self.s.tokenizer) if self.s.tokenizer else ByteTokenizer(self.config)
        try:
            self.has_documents = await self.client.is_model_ready(self.s.model + P.DOCUMENT_SUFFIX)
        except Exception:  # noqa: BLE001 - no document model: documents are refused
            self.has_documents = False

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()

    async def ready(self) -> bool:
        try:
            return bool(await self.client.is_server_ready() and await self.client.is_model_ready(self.s.model))
        except Exception:  # noqa: BLE001 - unreachable: not ready
            return False

    # ----------------------------------------------------------------- requests
    def _adder(self, out: list):
        """``add(name, array, dtype)``: one Triton input of ``array`` appended to ``out``."""

        def add(name, arr, dtype):
            x = self.aio.InferInput(name, list(arr.shape), dtype)
            x.set_data_from_numpy(arr)
            out.append(x)

        return add

    def _inputs(self, ids, max_tokens, stop_at_eos, stop_ids, sampling, features=None) -> list:
        out = []
        add = self._adder(out)
        add(P.INPUT_IDS, np.asarray(ids, dtype=np.int64), "INT64")
        add(P.MAX_NEW_TOKENS, np.array([max_tokens], dtype=np.int32), "INT32")
        add(P.STOP_AT_EOS, np.array([bool(stop_at_eos)]), "BOOL")
        if stop_ids:
            add(P.STOP_TOKEN_IDS, np.asarray(stop_ids, dtype=np.int64), "INT64")
        for fname, value in sampling.items():
            name, dtype = P.SAMPLING_INPUTS[fname]
            np_dtype = {"TYPE_FP32": np.float32, "TYPE_INT32": np.int32, "TYPE_INT64": np.int64}[dtype]
            add(name, np.array([value], dtype=np_dtype), dtype.removeprefix("TYPE_"))
        if features is not None:
            add(P.IMAGE_FEATURES, np.ascontiguousarray(features, dtype=np.float32), "FP32")
        return out

    async def generate(self, ids, max_tokens, stop_at_eos, stop_ids, sampling, features=None) -> tuple[list[int], int]:
        res = await self.client.infer(
            self.s.model,
            self._inputs(ids, max_tokens, stop_at_eos, stop_ids, sampling, features),
            outputs=[
                self.aio.InferRequestedOutput(P.OUTPUT_IDS),
                self.aio.InferRequestedOutput(P.PROMPT_TOKENS_CACHED),
            ],
            client_timeout=self.s.request_timeout,
        )
        tokens = [int(t) for t in res.as_numpy(P.OUTPUT_IDS).reshape(-1)]
        cached = res.as_numpy(P.PROMPT_TOKENS_CACHED)
        return tokens, int(cached.reshape(-1)[0]) if cached is not None and cached.size else 0

    async def stream(self, ids, max_tokens, stop_at_eos, stop_ids, sampling, features=None) -> AsyncIterator:
        """Yields ``("token", id)`` and ``("cached", n)``; raises the Triton error."""
        inputs = self._inputs(ids, max_tokens, stop_at_eos, stop_ids, sampling, features)

        async def requests():
            yield {"model_name": self.s.model + P.STREAM_SUFFIX, "inputs": inputs, "enable_empty_final_response": True}

        it = self.client.stream_infer(requests(), stream_timeout=self.s.request_timeout)
        try:
            async for result, error in it:
                if error is not None:
                    raise error
                final = result.get_response().parameters.get("triton_final_response")
                ids_out = result.as_numpy(P.OUTPUT_IDS)
                if ids_out is not None:
                    for t in ids_out.reshape(-1):
                        yield ("token", int(t))
                cached = result.as_numpy(P.PROMPT_TOKENS_CACHED)
                if cached is not None and cached.size:
                    yield ("cached", int(cached.reshape(-1)[0]))
                if final is not None and final.bool_param:
                    return
        finally:
            it.cancel()

    async def document(self, files, instruction, max_tokens, crop, rules) -> dict:
        inputs = []
        add = self._adder(inputs)
        add(P.DOCUMENT, np.frombuffer(b"".join(d for _, d in files), dtype=np.uint8), "UINT8")
        add(P.DOCUMENT_SIZES, np.array([len(d) for _, d in files], dtype=np.int64), "INT64")
        names = "\n".join(n.replace("\n", " ") for n, _ in files)
        add(P.DOCUMENT_NAME, np.frombuffer(names.encode(), dtype=np.uint8), "UINT8")
        if instruction:
            add(P.INSTRUCTION, np.frombuffer(instruction.encode(), dtype=np.uint8), "UINT8")
        if crop is not None:
            add(P.CROP_MODE, np.array([int(crop)], dtype=np.int32), "INT32")
        if max_tokens is not None:
            add(P.MAX_NEW_TOKENS, np.array([max_tokens], dtype=np.int32), "INT32")
        for fname, value in (rules or {}).items():
            name, dtype = P.RULE_INPUTS[fname]
            add(name, np.array([value], dtype=bool if dtype == "TYPE_BOOL" else np.int32), dtype.removeprefix("TYPE_"))
        res = await self.client.infer(
            self.s.model + P.DOCUMENT_SUFFIX,
            inputs,
            outputs=[self.aio.InferRequestedOutput(P.RESULT)],
            client_timeout=self.s.request_timeout,
        )
        return json.loads(np.ascontiguousarray(res.as_numpy(P.RESULT), dtype=np.uint8).tobytes().decode("utf-8"))


def triton_error(exc: Exception, where: str | None = None) -> APIError:
    """A Triton / gRPC failure as an OpenAI error: a refusal (INVALID_ARGUMENT) is a 400, a
    cancelled or unavailable request a 503 (naming ``where``, Triton's address), anything else a
    502."""
    status = getattr(exc, "status", lambda: None)() if callable(getattr(exc, "status", None)) else None
    message = getattr(exc, "message", lambda: str(exc))() if callable(getattr(exc, "message", None)) else str(exc)
    message = message or str(exc)
    if status is None and callable(getattr(exc, "code", None)) and callable(getattr(exc, "details", None)):
        status, message = exc.code(), exc.details() or message  # a gRPC error raised as it is (grpc.aio)
    if status is None:  # a streamed error: its code is in the message
        message, status = P.split_stream_code(message)
    status = str(status or "")
    text = f"{status} {message}"
    if "INVALID_ARG" in text or "InvalidArgument" in text:
        return APIError(message, status=400, code="invalid_value")
    if "UNAVAILABLE" in text or "CANCELLED" in text or "DEADLINE" in text:
        if where and "UNAVAILABLE" in status:
            message = f"Triton at {where} is unavailable: {message}"
        return APIError(message, status=503, kind="server_error", code="service_unavailable")
    return APIError(message, status=502, kind="server_error", code="upstream_error")


# ------------------------------------------------------------------------------ attachments
def _private(host: str) -> bool:
    """The host resolves to a private, loopback, link-local or reserved address."""
    try:
        infos = socket.getaddrinfo(host, None)
    except socket.gaierror:
        return True
    for info in infos:
        ip = ipaddress.ip_address(info[4][0])
        if ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_reserved or ip.is_multicast:
            return True
    return False


async def fetch_attachment(url: str, settings: FrontDoorSettings, param: str) -> bytes:
    """The bytes an ``image_url`` / ``file_data`` names (module docstring for what is allowed)."""
    if url.startswith("data:"):
        head, _, data = url.partition(",")
        if ";base64" not in head:
            raise APIError("data URLs must be base64 (data:<type>;base64,...)", param=param)
        if len(data) * 3 // 4 > settings.fetch_max_bytes:
            raise APIError(f"the attachment is over {settings.fetch_max_bytes // 2**20} MiB", param=param)
        try:
            return base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise APIError("the data URL is not valid base64", param=param) from None
    parts = urlsplit(url)
    if parts.scheme == "file":
        root = settings.allow_file_root
        if root is None:
            raise APIError("file:// URLs are not allowed on this server (see --allow-file-root)", param=param)
        raw_path = unquote(parts.path)
        if "\x00" in raw_path:
            raise APIError("a file:// URL's path holds a NUL byte (%00)", param=param)
        path = os.path.realpath(raw_path)
        if os.path.commonpath([path, os.path.realpath(root)]) != os.path.realpath(root):
            raise APIError(f"{parts.path} is outside the allowed folder", param=param)
        if not os.path.isfile(path):
            raise APIError(f"{parts.path}: no such file", param=param)
        if os.path.getsize(path) > settings.fetch_max_bytes:
            raise APIError(f"{parts.path} is over {settings.fetch_max_bytes // 2**20} MiB", param=param)
        with open(path, "rb") as fh:
            return fh.read()
    if parts.scheme in ("http", "https"):
        host = parts.hostname or ""
        if host not in settings.allow_url_hosts:
            raise APIError(f"fetching from {host or 'that URL'} is not allowed (see --allow-url-host)", param=param)
        if await asyncio.to_thread(_private, host):
            raise APIError(f"{host} resolves to a private address", param=param)
        import httpx

        try:
            async with httpx.AsyncClient(timeout=settings.fetch_timeout, follow_redirects=False) as client:
                async with client.stream("GET", url) as res:
                    if res.status_code != 200:
                        raise APIError(f"fetching {url} gave HTTP {res.status_code}", param=param)
                    chunks, size = [], 0
                    async for chunk in res.aiter_bytes():
                        size += len(chunk)
                        if size > settings.fetch_max_bytes:
                            raise APIError(f"{url} is over {settings.fetch_max_bytes // 2**20} MiB", param=param)
                        chunks.append(chunk)
                    return b"".join(chunks)
        except httpx.HTTPError as exc:
            raise APIError(f"fetching {url} failed: {type(exc).__name__}", param=param) from None
    raise APIError(f"unsupported URL scheme {parts.scheme!r} (data:, file:// or http(s)://)", param=param)


# ------------------------------------------------------------------------------ the app
class Metrics:
    """The front door's own Prometheus metrics (a registry of its own)."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self.requests = Counter(
            "dash_frontdoor_requests", "HTTP requests answered", ["endpoint", "status"], registry=self.registry
        )
        self.tokens = Counter("dash_frontdoor_tokens", "tokens", ["kind"], registry=self.registry)
        self.pages = Counter("dash_frontdoor_pages", "document pages transcribed", registry=self.registry)
        self.in_flight = Gauge("dash_frontdoor_in_flight", "requests being answered", registry=self.registry)
        self.seconds = Histogram(
            "dash_frontdoor_request_seconds", "time to the whole answer", ["endpoint"], registry=self.registry
        )


def _json_error(exc: APIError):
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


class GuardMiddleware:
    """API key on /v1/*, JSON content type on JSON posts, the body's size cap and read timeout
    (pure ASGI: the body is counted as it arrives, never buffered here)."""

    def __init__(self, app, settings: FrontDoorSettings, metrics: Metrics):
        self.app, self.s, self.metrics = app, settings, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, method = scope["path"], scope["method"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            if self.s.api_key and _keyed(path, self.s):
                auth = headers.get("authorization", "")
                # compared in constant time: the time to refuse says nothing of the key
                if not auth.startswith("Bearer ") or not hmac.compare_digest(
                    auth[7:].encode("utf-8", "surrogateescape"), self.s.api_key.encode("utf-8")
                ):
                    raise APIError(
                        "invalid or missing API key (Authorization: Bearer KEY)",
                        status=401,
                        code="invalid_api_key",
                    )
            length = headers.get("content-length")
            if length is not None and (not length.isdigit() or int(length) > self.s.max_body_bytes):
                if not length.isdigit():
                    raise APIError("Content-Length is not a number", status=400)
                raise APIError(
                    f"the request body is over {self.s.max_body_bytes // 2**20} MiB", status=413, code="too_large"
                )
            if method == "POST" and path != "/v1/ocr":
                ctype = headers.get("content-type", "").split(";")[0].strip().lower()
                if ctype != "application/json":
                    raise APIError(
                        f"Content-Type must be application/json, got {ctype or 'none'}",
                        status=415,
                        code="unsupported_media_type",
                    )
        except APIError as exc:
            return await _json_error(exc)(scope, receive, self._counted(send, path))

        seen = 0
        limit, timeout = self.s.max_body_bytes, self.s.body_timeout
        body_done = method in ("GET", "HEAD")

        async def guarded_receive():
            nonlocal seen, body_done
            if body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), timeout)
            except asyncio.TimeoutError:
                raise _BodyTimeout() from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise _BodyTooLarge()
                if not message.get("more_body", False):
                    body_done = True
            return message

        # a body over the cap or stalled raises in the app, whose handlers answer 413 / 408
        await self.app(scope, guarded_receive, self._counted(send, path))

    def _counted(self, send, path: str):
        """``send`` that counts every response by endpoint and status (``/metrics``)."""
        endpoint = path if path in ENDPOINTS else ("/v1/models" if path.startswith("/v1/models/") else "other")

        async def counting(message):
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        return counting


#: The endpoints ``/metrics`` counts by name (others as "other").
ENDPOINTS = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/ocr", "/health", "/metrics")


class _BodyTooLarge(Exception):
    pass


class _BodyTimeout(Exception):
    pass


def create_app(settings: FrontDoorSettings, backend: TritonBackend | None = None):
    """The FastAPI application (``backend`` replaces the Triton one, for embedding)."""
    from contextlib import asynccontextmanager

    metrics = Metrics()
    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(app):
        b = backend or TritonBackend(settings)
        await b.start()
        state["backend"] = b
        try:
            yield
        finally:
            await b.close()

    app = FastAPI(title="dash-trt OpenAI front door", lifespan=lifespan, docs_url=None, redoc_url=None)

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return _json_error(exc)

    @app.exception_handler(_BodyTooLarge)
    async def _too_large(request, exc):
        limit = settings.max_body_bytes // 2**20
        return _json_error(APIError(f"the request body is over {limit} MiB", status=413, code="too_large"))

    @app.exception_handler(_BodyTimeout)
    async def _stalled(request, exc):
        return _json_error(
            APIError(f"the request body stalled for {settings.body_timeout:g} s", status=408, code="timeout")
        )

    @app.exception_handler(RequestValidationError)
    async def _validation(request, exc):
        return _json_error(APIError(f"invalid request: {exc.errors()[0].get('msg')}"))

    async def drained(request) -> None:
        """Read (and drop) a refused request's body, so the connection stays in step for the next
        request (keep-alive); the middleware bounds it."""
        try:
            await request.body()
        except Exception:  # noqa: BLE001 - a body that cannot be read: the connection closes anyway
            pass

    @app.exception_handler(404)
    async def _not_found(request, exc):
        await drained(request)
        return _json_error(APIError(f"no route {request.url.path}", status=404, kind="not_found_error", code=None))

    @app.exception_handler(405)
    async def _method(request, exc):
        await drained(request)
        return _json_error(APIError(f"{request.method} is not allowed on {request.url.path}", status=405, code=None))

    def be() -> TritonBackend:
        return state["backend"]

    def check_model(name: str | None) -> None:
        if name not in (None, settings.model):
            raise APIError(
                f"model {name!r} is not served here (this endpoint serves {settings.model!r})",
                status=404,
                param="model",
                kind="not_found_error",
                code="model_not_found",
            )

    async def read_json(request: Request, model_cls):
        raw = await request.body()
        try:
            body = json.loads(raw or b"null")
            # a lone UTF-16 surrogate ("\ud800") parses as JSON but is no text: refused here,
            # not as a 500 wherever it is first encoded
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise APIError("the body holds a lone UTF-16 surrogate (\\ud800-\\udfff): not valid text") from None
        except (ValueError, UnicodeDecodeError) as exc:  # JSON errors; an integer of over 4300 digits
            raise APIError(f"the body is not valid JSON: {exc}") from None
        except RecursionError:
            raise APIError("the body is nested too deeply") from None
        if not isinstance(body, dict):
            raise APIError("the request body must be a JSON object")
        try:
            return model_cls.model_validate(body)
        except ValidationError as exc:
            raise validation_error(exc) from None

    async def until_disconnected(request: Request) -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    async def guarded(request: Request, coro):
        """``coro``'s result, or its cancellation when the client disconnects."""
        task = asyncio.ensure_future(coro)
        gone = asyncio.ensure_future(until_disconnected(request))
        try:
            done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
            if task not in done:
                task.cancel()
                raise APIError("the client disconnected", status=499, code="client_disconnected")
            return task.result()
        finally:
            gone.cancel()

    def model_card() -> dict:
        return {"id": settings.model, "object": "model", "created": 0, "owned_by": "dash-trt"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        check_model(model_id)
        return model_card()

    @app.get("/health")
    async def health():
        ok = await be().ready()
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def usage(prompt: int, completion: int, cached: int = 0, images: int | None = None, pages: int | None = None):
        details: dict[str, int] = {"cached_tokens": cached}
        if images is not None:
            details["image_tokens"] = images
        if pages is not None:
            details["pages"] = pages
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": details,
        }

    def finish(tokens: list[int], max_tokens: int, stop_at_eos: bool, stops) -> str:
        eos = be().config.eos_token_id
        if tokens and ((stop_at_eos and tokens[-1] == eos) or tokens[-1] in (stops or ())):
            return "stop"
        return "length" if len(tokens) >= max_tokens else "stop"

    def encode(prompt) -> list[int]:
        if isinstance(prompt, str):
            try:
                ids = be().tokenizer.encode(prompt)
            except ValueError as exc:
                raise APIError(str(exc), param="prompt") from None
            bos = be().tokenizer.bos_id
            return ([bos] if bos is not None else []) + ids
        return list(prompt)

    def decode(tokens: list[int]) -> str:
        """A checkpoint tokenizer's text without its special tokens (as vLLM answers); the demo's
        byte tokenizer shows every token (``<PAGE>``, ``<id>``), as dash-client does."""
        from ..documents.tokenizer import TextTokenizer

        tok = be().tokenizer
        return tok.decode(tokens, skip_special_tokens=isinstance(tok, TextTokenizer))

    def features_of(req) -> np.ndarray | None:
        if req.image_features is None:
            return None
        try:
            arr = np.asarray(req.image_features, dtype=np.float32)
        except ValueError:  # rows of different lengths
            raise APIError("image_features rows must all have the same length", param="image_features") from None
        if arr.ndim != 2:
            raise APIError("image_features must be a list of rows (one per <image> token)", param="image_features")
        return arr

    # ---------------------------------------------------------------- completions
    @app.post("/v1/completions")
    async def completions(request: Request):
        t0 = time.perf_counter()
        req: CompletionRequest = await read_json(request, CompletionRequest)
        check_model(req.model)
        prompts = [encode(p) for p in req.prompts()]
        feats = features_of(req)
        if feats is not None and len(prompts) > 1:
            raise APIError("image_features go with a single prompt", param="image_features")
        args = (req.max_tokens, not req.ignore_eos, req.stop_token_ids, req.sampling())
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(index: int, text: str, reason: str | None) -> dict:
            return {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": settings.model,
                "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": reason}],
            }

        if req.stream:
            return await stream_response(request, prompts, args, feats, req.include_usage, chunk, "/v1/completions")
        metrics.in_flight.inc()
        try:
            results = await guarded(
                request, asyncio.gather(*(be().generate(p, *args, feats) for p in prompts), return_exceptions=True)
            )
        finally:
            metrics.in_flight.dec()
        choices, total_p, total_c, total_cached = [], 0, 0, 0
        for i, (p, r) in enumerate(zip(prompts, results)):
            if isinstance(r, BaseException):
                raise triton_error(r, settings.triton_grpc)
            tokens, cached = r
            choices.append(
                {
                    "index": i,
                    "text": decode(tokens),
                    "logprobs": None,
                    "finish_reason": finish(tokens, req.max_tokens, not req.ignore_eos, req.stop_token_ids),
                }
            )
            total_p, total_c, total_cached = total_p + len(p), total_c + len(tokens), total_cached + cached
        metrics.tokens.labels("prompt").inc(total_p)
        metrics.tokens.labels("completion").inc(total_c)
        metrics.seconds.labels("/v1/completions").observe(time.perf_counter() - t0)
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": settings.model,
            "choices": choices,
            "usage": usage(total_p, total_c, total_cached),
        }

    async def stream_response(request, prompts, args, feats, include_usage, chunk, endpoint, first_chunk=None):
        """Server-sent events of several prompts' token streams, interleaved. The first answer of
        each stream is awaited before the response starts: a refusal is a 4xx JSON answer."""
        from ..documents.tokenizer import IncrementalDecoder

        streams = [be().stream(p, *args, feats).__aiter__() for p in prompts]
        firsts = []
        try:
            for s in streams:
                firsts.append(await anext(s, None))
        except Exception as exc:  # the refusal arrives as the stream's first answer
            for s in streams:
                await s.aclose()
            raise triton_error(exc, settings.triton_grpc) from None
        metrics.in_flight.inc()
        max_tokens, stop_at_eos, stops, _ = args

        async def events():
            queue: asyncio.Queue = asyncio.Queue()
            counts = [0] * len(prompts)
            cached = [0] * len(prompts)
            tokens: list[list[int]] = [[] for _ in prompts]
            from ..documents.tokenizer import TextTokenizer

            skip = isinstance(be().tokenizer, TextTokenizer)
            decoders = [IncrementalDecoder(be().tokenizer, skip_special_tokens=skip) for _ in prompts]

            async def pump(i, s, first):
                try:
                    item = first
                    while item is not None:
                        await queue.put((i, item))
                        item = await anext(s, None)
                except Exception as exc:  # noqa: BLE001 - sent as an error event
                    await queue.put((i, ("error", exc)))
                finally:
                    await queue.put((i, None))

            tasks = [asyncio.ensure_future(pump(i, s, f)) for i, (s, f) in enumerate(zip(streams, firsts))]
            open_streams = len(tasks)
            try:
                if first_chunk is not None:
                    yield f"data: {json.dumps(first_chunk)}\n\n"
                while open_streams:
                    i, item = await queue.get()
                    if item is None:
                        open_streams -= 1
                        tail = decoders[i].flush()
                        reason = finish(tokens[i], max_tokens, stop_at_eos, stops)
                        yield f"data: {json.dumps(chunk(i, tail, reason))}\n\n"
                        continue
                    kind, value = item
                    if kind == "error":
                        err = triton_error(value, settings.triton_grpc)
                        yield f"data: {json.dumps(err.body())}\n\n"
                        continue
                    if kind == "cached":
                        cached[i] = value
                        continue
                    tokens[i].append(value)
                    counts[i] += 1
                    piece = decoders[i].push(value)
                    if piece:
                        yield f"data: {json.dumps(chunk(i, piece, None))}\n\n"
                if include_usage:
                    c = chunk(0, "", None)
                    c["choices"] = []
                    c["usage"] = usage(sum(len(p) for p in prompts), sum(counts), sum(cached))
                    yield f"data: {json.dumps(c)}\n\n"
                yield "data: [DONE]\n\n"
                metrics.tokens.labels("prompt").inc(sum(len(p) for p in prompts))
                metrics.tokens.labels("completion").inc(sum(counts))
            finally:  # also when the client disconnects: the streams are cancelled in Triton
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                for s in streams:
                    await s.aclose()
                metrics.in_flight.dec()

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    # ---------------------------------------------------------------- chat
    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        t0 = time.perf_counter()
        req: ChatCompletionRequest = await read_json(request, ChatCompletionRequest)
        check_model(req.model)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        max_tokens = req.limit(settings.default_max_tokens)
        has_files = any(m.attachments() for m in req.messages)

        def chunk(index: int, text: str, reason: str | None, role: bool = False) -> dict:
            delta: dict[str, Any] = {"content": text} if text or not role else {}
            if role:
                delta = {"role": "assistant", "content": ""}
            return {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": settings.model,
                "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}],
            }

        def answer(text: str, reason: str, use: dict) -> dict:
            return {
                "id": rid,
                "object": "chat.completion",
                "created": created,
                "model": settings.model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "logprobs": None,
                        "finish_reason": reason,
                    }
                ],
                "usage": use,
            }

        if has_files:
            text, reason, use = await chat_document(request, req, max_tokens)
            metrics.seconds.labels("/v1/chat/completions").observe(time.perf_counter() - t0)
            if not req.stream:
                return answer(text, reason, use)

            async def events():
                yield f"data: {json.dumps(chunk(0, '', None, role=True))}\n\n"
                yield f"data: {json.dumps(chunk(0, text, None))}\n\n"
                yield f"data: {json.dumps(chunk(0, '', reason))}\n\n"
                if req.include_usage:
                    c = chunk(0, "", None)
                    c["choices"], c["usage"] = [], use
                    yield f"data: {json.dumps(c)}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

        ids = chat_prompt(req)
        args = (max_tokens, not req.ignore_eos, req.stop_token_ids, req.sampling())
        if req.stream:
            return await stream_response(
                request, [ids], args, None, req.include_usage, chunk, "/v1/chat/completions", chunk(0, "", None, True)
            )
        metrics.in_flight.inc()
        try:
            tokens, cached = await guarded(request, be().generate(ids, *args))
        except APIError:
            raise
        except Exception as exc:
            raise triton_error(exc, settings.triton_grpc) from None
        finally:
            metrics.in_flight.dec()
        metrics.tokens.labels("prompt").inc(len(ids))
        metrics.tokens.labels("completion").inc(len(tokens))
        metrics.seconds.labels("/v1/chat/completions").observe(time.perf_counter() - t0)
        text = decode(tokens)
        return answer(
            text,
            finish(tokens, max_tokens, not req.ignore_eos, req.stop_token_ids),
            usage(len(ids), len(tokens), cached),
        )

    def chat_prompt(req: ChatCompletionRequest) -> list[int]:
        from ..documents.prompt import PromptError

        tok = be().tokenizer
        template = getattr(tok, "chat_template", None) or DEFAULT_CHAT_TEMPLATE
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        special = {k: getattr(tok, k, None) for k in ("bos_token", "eos_token")}
        try:
            text = _render(template, messages, special)
        except PromptError as exc:
            raise APIError(str(exc), param="messages") from None
        try:
            ids = tok.encode(text)
        except ValueError as exc:
            raise APIError(str(exc), param="messages") from None
        if not ids:
            raise APIError("the messages render to an empty prompt", param="messages")
        return ids

    async def chat_document(request, req: ChatCompletionRequest, max_tokens: int) -> tuple[str, str, dict]:
        """A conversation whose last user message holds images or files: a document."""
        if not be().has_documents:
            raise APIError(
                f"images and files need the document model ({settings.model}{P.DOCUMENT_SUFFIX}), which this "
                "Triton does not serve (write the repository from a checkpoint folder with a vision tower)",
                param="messages",
            )
        last = req.messages[-1]
        if last.role != "user" or not last.attachments():
            raise APIError("images and files must be in the last message, a user message", param="messages")
        # A document is transcribed greedily under the document rules: a sampling field set to
        # anything else would be silently ignored, so it is refused.
        greedy = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None, "stop_token_ids": None}
        greedy["ignore_eos"] = False
        for name, neutral in greedy.items():
            value = getattr(req, name)
            if name in req.model_fields_set and value != neutral and not (name == "stop_token_ids" and value == []):
                raise APIError(
                    f"{name} is not supported with images or files: a document is transcribed greedily "
                    f"(with the page-count guard and no-repeat rules); leave {name} out",
                    param=name,
                )
        if any(m.attachments() for m in req.messages[:-1]):
            raise APIError("a document is answered in one turn: only the last message may hold images or files")
        files = []
        for i, part in enumerate(last.attachments()):
            param = f"messages[{len(req.messages) - 1}].content[{i}]"
            if part.type == "image_url":
                url, name = part.image_url.url, f"image {i + 1}"
            else:
                spec = part.file if part.type == "file" else part
                if spec.file_id is not None or spec.file_data is None:
                    raise APIError("files are sent inline (file_data); file ids are not supported", param=param)
                url, name = spec.file_data, spec.filename or f"file {i + 1}"
                if not url.startswith("data:"):
                    url = "data:application/octet-stream;base64," + url  # bare base64, as OpenAI accepts
            files.append((name, await fetch_attachment(url, settings, param)))
        system = "\n".join(m.text() for m in req.messages[:-1] if m.role in ("system", "developer") and m.text())
        instruction = "\n".join(x for x in (system, last.text()) if x) or None
        crop = {"auto": None, "on": True, "off": False, None: None}[req.crop]
        metrics.in_flight.inc()
        try:
            result = await guarded(request, be().document(files, instruction, max_tokens, crop, None))
        except APIError:
            raise
        except Exception as exc:
            raise triton_error(exc, settings.triton_grpc) from None
        finally:
            metrics.in_flight.dec()
        pages = result["pages"]
        text = "\n\n".join(
            f"<!-- page {p['page']}: {p['source']} -->\n\n{p['text'].strip()}" if len(pages) > 1 else p["text"]
            for p in pages
        )
        metrics.pages.inc(len(pages))
        metrics.tokens.labels("prompt").inc(result["prompt_tokens"])
        metrics.tokens.labels("completion").inc(result["generated_tokens"])
        use = usage(
            result["prompt_tokens"],
            result["generated_tokens"],
            images=result.get("image_tokens"),
            pages=len(pages),
        )
        return text, result.get("finish_reason", "stop"), use

    # ---------------------------------------------------------------- ocr
    @app.post("/v1/ocr")
    async def ocr(request: Request):
        t0 = time.perf_counter()
        ctype = request.headers.get("content-type", "")
        if not ctype.startswith("multipart/form-data"):
            raise APIError("POST the files as multipart/form-data (field 'file', one or more)", status=415)
        if not be().has_documents:
            raise APIError(f"this Triton does not serve {settings.model}{P.DOCUMENT_SUFFIX}", status=404)
        form = await request.form(max_files=P.MAX_DOCUMENT_FILES, max_fields=32)
        uploads = form.getlist("file")
        if not uploads:
            raise APIError("no file: send the document as the form field 'file'", param="file")
        files = []
        for up in uploads:
            if isinstance(up, str):
                raise APIError("the 'file' field must be a file upload", param="file")
            files.append((up.filename or "document", await up.read()))
        unknown = sorted(set(form) - {"file", "prompt", "crop", "max_tokens", "model"})
        if unknown:
            raise APIError(f"unknown field(s): {', '.join(unknown)}", param=unknown[0], code="unknown_parameter")
        check_model(form.get("model") or None)
        crop_text = form.get("crop", "auto")
        if crop_text not in ("auto", "on", "off"):
            raise APIError("crop must be auto, on or off", param="crop")
        max_tokens = form.get("max_tokens")
        if max_tokens is not None and (not str(max_tokens).isdigit() or not 1 <= int(max_tokens) <= 1 << 20):
            raise APIError("max_tokens must be an integer in 1..1048576", param="max_tokens")
        crop = {"auto": None, "on": True, "off": False}[crop_text]
        metrics.in_flight.inc()
        try:
            result = await guarded(
                request,
                be().document(files, form.get("prompt") or None, int(max_tokens) if max_tokens else None, crop, None),
            )
        except APIError:
            raise
        except Exception as exc:
            raise triton_error(exc, settings.triton_grpc) from None
        finally:
            metrics.in_flight.dec()
        metrics.pages.inc(len(result["pages"]))
        metrics.seconds.labels("/v1/ocr").observe(time.perf_counter() - t0)
        return {
            "id": f"ocr-{uuid.uuid4().hex}",
            "object": "ocr.result",
            "model": settings.model,
            "pages": result["pages"],
            "usage": usage(
                result["prompt_tokens"],
                result["generated_tokens"],
                images=result.get("image_tokens"),
                pages=len(result["pages"]),
            ),
        }

    app.state.metrics = metrics
    app.state.backend_state = state
    return GuardMiddleware(app, settings, metrics)


def _render(template: str, messages: list[dict], special: dict) -> str:
    """A chat template over every message (jinja2's immutable sandbox, as the document prompt)."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from ..documents.prompt import PromptError

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(
            messages=messages, add_generation_prompt=True, **{k: v for k, v in special.items() if v is not None}
        )
    except TemplateError as exc:
        raise PromptError(f"the chat template failed: {exc}") from None


# ------------------------------------------------------------------------------ the server
def guarded_protocol(header_timeout: float):
    """uvicorn's h11 protocol, closing a connection whose request headers do not arrive within
    ``header_timeout`` seconds of its first byte (or of the connection): a slow client cannot
    hold a socket open forever (uvicorn's own keep-alive timeout starts only after a response)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        _deadline = None

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm()

        def _arm(self):
            self._disarm()
            self._deadline = self.loop.call_later(header_timeout, self._expired)

        def _disarm(self):
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _waiting(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def data_received(self, data):
            if self._waiting() and self._deadline is None:
                self._arm()
            super().data_received(data)
            if not self._waiting():
                self._disarm()

        def on_response_complete(self):
            super().on_response_complete()

        def _expired(self):
            self._deadline = None
            if self._waiting() and not self.transport.is_closing():
                self.transport.close()

        def connection_lost(self, exc):
            self._disarm()
            super().connection_lost(exc)

    return GuardedH11Protocol


class FrontDoor:
    """The front door as a server object: ``start()`` serves on a background thread (tests,
    embedding), ``serve()`` in the calling thread (the CLI)."""

    def __init__(self, settings: FrontDoorSettings, *, host: str = "127.0.0.1", port: int = 9000, backend=None):
        import uvicorn

        self.settings = settings
        self.app = create_app(settings, backend)
        self.config = uvicorn.Config(
            self.app,
            host=host,
            port=port,
            http=guarded_protocol(settings.header_timeout),
            backlog=2048,
            timeout_keep_alive=5,
            log_level="warning",
            access_log=False,
            lifespan="on",
            h11_max_incomplete_event_size=64 * 1024,
        )
        self.server = uvicorn.Server(self.config)
        self.host = host
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        servers = getattr(self.server, "servers", None) or []
        for s in servers:
            for sock in s.sockets:
                return sock.getsockname()[1]
        return self.config.port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def serve(self) -> None:
        self.server.run()

    def start(self, timeout: float = 60.0) -> FrontDoor:
        self._thread = threading.Thread(target=self.server.run, name="dash-frontdoor", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the front door failed to start (see the log above)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the front door did not start within {timeout:g} s")
            time.sleep(0.05)
        return self

    def close(self) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30)


def OpenAIServer(
    triton_http: str, triton_grpc: str | None = None, *, host="127.0.0.1", port=9000, model=P.DEFAULT_NAME, **kw
):
    """The front door for the Triton at ``triton_grpc`` (``triton_http`` is kept for older callers)."""
    settings = FrontDoorSettings(triton_grpc=triton_grpc or "127.0.0.1:8001", model=model, **kw)
    return FrontDoor(settings, host=host, port=port)


def add_parser(sub) -> argparse.ArgumentParser:
    o = sub.add_parser(
        "openai",
        epilog="Exit codes: 0 stopped (Ctrl-C), 2 the Triton model cannot be reached or the port cannot be bound, "
        + EXIT_CODES_NOTE,
        help="serve the OpenAI API (completions, chat completions with images and PDFs, OCR) in front of Triton",
        description=__doc__.split("\n\n")[0],
    )
    d = FrontDoorSettings()
    o.add_argument("--url", default="127.0.0.1:8000", help="Triton's HTTP endpoint (not used; kept for scripts)")
    o.add_argument("--grpc-url", default=d.triton_grpc, help="Triton's gRPC endpoint (%(default)s)")
    o.add_argument("--model", default=d.model, help="the generation model's name (%(default)s)")
    o.add_argument("--host", default="127.0.0.1", help="address to bind (%(default)s)")
    o.add_argument("--port", type=int, default=9000, help="port to bind (%(default)s)")
    o.add_argument("--api-key", help=f"the key clients send as 'Authorization: Bearer KEY' (or ${API_KEY_ENV})")
    o.add_argument(
        "--public-metrics",
        action="store_true",
        help="with an API key: /metrics answers without it (/health always does)",
    )
    o.add_argument("--tokenizer", help="a checkpoint folder with tokenizer.json (default: the demo model's bytes)")
    o.add_argument("--max-body-mb", type=float, default=d.max_body_bytes / 2**20, help="(%(default)g)")
    o.add_argument("--header-timeout", type=float, default=d.header_timeout, help="seconds (%(default)g)")
    o.add_argument("--body-timeout", type=float, default=d.body_timeout, help="seconds a body may stall (%(default)g)")
    o.add_argument("--allow-file-root", help="file:// attachments are read only under this folder (default: none)")
    o.add_argument(
        "--allow-url-host", action="append", default=[], help="a host http(s) attachments may come from (repeatable)"
    )
    o.add_argument("--fetch-max-mb", type=float, default=d.fetch_max_bytes / 2**20, help="(%(default)g)")
    o.add_argument("--fetch-timeout", type=float, default=d.fetch_timeout, help="seconds (%(default)g)")
    o.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    return o


def openai_main(a, out: TextIO, err: TextIO) -> int:
    if not 0 < a.port <= 65535:
        print(f"dash-triton openai: error: --port must be 1..65535, got {a.port}", file=err)
        return 2
    for name in ("max_body_mb", "header_timeout", "body_timeout", "fetch_max_mb", "fetch_timeout"):
        if getattr(a, name) <= 0:
            print(f"dash-triton openai: error: --{name.replace('_', '-')} must be positive", file=err)
            return 2
    settings = FrontDoorSettings(
        triton_grpc=a.grpc_url,
        model=a.model,
        api_key=a.api_key or os.environ.get(API_KEY_ENV) or None,
        public_metrics=a.public_metrics,
        tokenizer=a.tokenizer,
        max_body_bytes=int(a.max_body_mb * 2**20),
        header_timeout=a.header_timeout,
        body_timeout=a.body_timeout,
        allow_file_root=a.allow_file_root,
        allow_url_hosts=tuple(a.allow_url_host),
        fetch_max_bytes=int(a.fetch_max_mb * 2**20),
        fetch_timeout=a.fetch_timeout,
    )
    try:
        probe = TritonBackend(settings)
        asyncio.run(_probe(probe))
    except Exception as exc:  # noqa: BLE001 - one line: the model cannot be reached
        print(f"dash-triton openai: error: {exc}", file=err)
        return 2
    door = FrontDoor(settings, host=a.host, port=a.port)
    try:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((a.host, a.port))
        sock.close()
    except OSError as exc:
        print(f"dash-triton openai: error: cannot bind {a.host}:{a.port}: {exc.strerror or exc}", file=err)
        return 2
    print(
        f"OpenAI API for '{a.model}' on http://{a.host}:{a.port}/v1 (Triton gRPC {a.grpc_url}"
        + ("; API key required" if settings.api_key else "")
        + "); Ctrl-C stops",
        file=out,
        flush=True,
    )
    door.serve()
    return 0


async def _probe(backend: TritonBackend) -> None:
    try:
        await backend.start()
    finally:
        await backend.close()
