"""``dash-triton openai``: an OpenAI-style completions endpoint in front of the Triton
generation models.

Why a thin server of our own and not Triton's OpenAI frontend: that frontend runs Triton
in-process through the ``tritonserver`` Python bindings (shipped in NVIDIA's containers, not
in the ``nvidia-pytriton`` wheel), tokenizes with a Hugging Face tokenizer, and builds
requests for the vLLM and TensorRT-LLM backends' input schemas only; the DASH models have
their own inputs (``input_ids``, sampling, stop ids, image features) and tokenizer. This
server speaks the OpenAI protocol on one side and :class:`~dash_trt.triton.client.DashClient`
on the other, so it works with any Triton that serves the repository (the one of
``dash-triton serve`` or a production one) and adds no dependency.

Endpoints (bound to 127.0.0.1 by default):

- ``GET /v1/models``: the generation model;
- ``POST /v1/completions``: ``prompt`` (text with ``<PAGE>``/``<image*N>`` markup, or token ids),
  ``max_tokens`` (default 16), ``temperature`` (default 1, as OpenAI; 0 is greedy and matches
  offline generation), ``top_p``, ``seed``, ``stream`` (server-sent events, through the
  streaming model over gRPC), and the vLLM-style extensions ``top_k``, ``stop_token_ids``,
  ``ignore_eos``, plus ``image_features`` (a list of rows, one per ``<image>`` token);
- ``GET /health``: 200 when the Triton model is ready.

Not supported, refused with a 400 error that says so: ``n`` > 1, ``best_of``, ``echo``,
``logprobs``, ``suffix``, text ``stop`` sequences (use ``stop_token_ids``), chat completions.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TextIO

from ..cliutil import EXIT_CODES_NOTE, VERBOSE_HELP
from . import protocol as P
from .client import DashClient, DashClientError

__all__ = ["OpenAIServer", "CompletionError", "completion_request", "openai_main"]

#: Request fields this server reads; anything else is refused (a typo must not pass silently).
KNOWN_FIELDS = {
    "model",
    "prompt",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stream",
    "stop_token_ids",
    "ignore_eos",
    "image_features",
    "user",
    "n",
    "best_of",
    "echo",
    "logprobs",
    "suffix",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "stream_options",
}
UNSUPPORTED = {
    "best_of": None,
    "echo": False,
    "logprobs": None,
    "suffix": None,
    "stop": None,
    "presence_penalty": 0,
    "frequency_penalty": 0,
}


class CompletionError(Exception):
    """A request this server refuses (OpenAI's error object; ``status`` is the HTTP status)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.param, self.status, self.kind = param, status, kind

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": None}}


def completion_request(body: Any, model_name: str) -> dict:
    """Check an OpenAI completions body; returns the DashClient arguments (prompt, max_tokens,
    stop_at_eos, stop_token_ids, sampling, image_features, stream)."""
    if not isinstance(body, dict):
        raise CompletionError("the request body must be a JSON object")
    unknown = sorted(set(body) - KNOWN_FIELDS)
    if unknown:
        raise CompletionError(f"unknown field(s): {', '.join(unknown)}", unknown[0])
    if body.get("model", model_name) != model_name:
        raise CompletionError(
            f"model {body.get('model')!r} is not served here (this endpoint serves {model_name!r})",
            "model",
            404,
            "not_found_error",
        )
    for name, neutral in UNSUPPORTED.items():
        if name in body and body[name] not in (neutral, None):
            hint = " (use stop_token_ids)" if name == "stop" else ""
            raise CompletionError(f"{name} is not supported by this server{hint}", name)
    if body.get("n", 1) != 1:
        raise CompletionError("n must be 1 (one completion per request)", "n")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise CompletionError(
                "prompt must be a string or a non-empty list of token ids (one prompt per request)", "prompt"
            )
    elif not isinstance(prompt, str) or not prompt:
        raise CompletionError("prompt must be a non-empty string or a list of token ids", "prompt")

    def number(name, kind, default, lo=None, hi=None):
        value = body.get(name, default)
        if value is None:
            return default
        ok = isinstance(value, (int, float)) if kind is float else isinstance(value, int)
        if not ok or isinstance(value, bool) or (lo is not None and value < lo) or (hi is not None and value > hi):
            bounds = f" in {lo}..{hi}" if hi is not None else (f" >= {lo}" if lo is not None else "")
            raise CompletionError(
                f"{name} must be a{'n integer' if kind is int else ' number'}{bounds}, got {value!r}", name
            )
        return kind(value)

    sampling = {
        "temperature": number("temperature", float, 1.0, 0.0, 100.0),
        "top_p": number("top_p", float, 1.0, 0.0, 1.0),
        "top_k": number("top_k", int, 0, 0),
        "seed": number("seed", int, None),
    }
    stops = body.get("stop_token_ids")
    if stops is not None and not (isinstance(stops, list) and all(isinstance(t, int) for t in stops)):
        raise CompletionError("stop_token_ids must be a list of token ids", "stop_token_ids")
    feats = body.get("image_features")
    if feats is not None:
        import numpy as np

        try:
            feats = np.asarray(feats, dtype=np.float32)
        except (TypeError, ValueError):
            raise CompletionError("image_features must be a list of rows of numbers", "image_features") from None
        if feats.ndim != 2:
            raise CompletionError("image_features must be a list of rows (one per <image> token)", "image_features")
    return {
        "prompt": prompt,
        "max_tokens": number("max_tokens", int, 16, 1),
        "stop_at_eos": not bool(body.get("ignore_eos", False)),
        "stop_token_ids": stops,
        "sampling": {k: v for k, v in sampling.items() if v is not None},
        "image_features": feats,
        "stream": bool(body.get("stream", False)),
    }


def _finish_reason(tokens: list[int], req: dict, eos: int | None) -> str:
    if tokens and ((req["stop_at_eos"] and tokens[-1] == eos) or tokens[-1] in (req["stop_token_ids"] or ())):
        return "stop"
    return "length" if len(tokens) >= req["max_tokens"] else "stop"


class OpenAIServer:
    """The HTTP server (``ThreadingHTTPServer``): one thread per connection, each with its own
    Triton clients (tritonclient's are not shared across threads)."""

    def __init__(
        self,
        triton_http: str,
        triton_grpc: str | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 9000,
        model: str = P.DEFAULT_NAME,
        timeout: float = 600.0,
    ):
        self.triton_http, self.triton_grpc = triton_http, triton_grpc
        self.model, self.timeout = model, timeout
        probe = DashClient(triton_http, protocol="http", model=model, timeout=timeout)
        try:
            self.config = probe.model_config()  # also: the Triton model exists and is a DASH model
        finally:
            probe.close()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, fmt, *args):  # quiet: errors are in the responses
                pass

            def do_GET(self):
                owner._get(self)

            def do_POST(self):
                owner._post(self)

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://{host}:{self.port}"

    @contextlib.contextmanager
    def _client(self, protocol: str):
        """A Triton client for one request, closed after it: no connection outlives its request,
        so the Triton server's shutdown never waits on this proxy."""
        url = self.triton_http if protocol == "http" else self.triton_grpc
        client = DashClient(url, protocol=protocol, model=self.model, timeout=self.timeout)
        client._config = self.config
        try:
            yield client
        finally:
            client.close()

    # ------------------------------------------------------------------ HTTP
    @staticmethod
    def _send(h, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def _get(self, h) -> None:
        if h.path == "/v1/models":
            self._send(
                h,
                200,
                {
                    "object": "list",
                    "data": [{"id": self.model, "object": "model", "created": 0, "owned_by": "dash-trt"}],
                },
            )
        elif h.path == "/health":
            try:
                with self._client("http") as c:
                    ready = c.client.is_model_ready(self.model)
            except Exception:  # noqa: BLE001 - unreachable server: not healthy
                ready = False
            self._send(h, 200 if ready else 503, {"ready": bool(ready)})
        else:
            self._send(h, 404, CompletionError(f"no route {h.path}", status=404, kind="not_found_error").body())

    def _post(self, h) -> None:
        if h.path != "/v1/completions":
            hint = " (chat completions are not served: use /v1/completions)" if "chat" in h.path else ""
            self._send(h, 404, CompletionError(f"no route {h.path}{hint}", status=404, kind="not_found_error").body())
            return
        try:
            length = int(h.headers.get("Content-Length") or 0)
            if length > 256 * 2**20:
                raise CompletionError("request body over 256 MiB", status=413)
            try:
                body = json.loads(h.rfile.read(length) or b"null")
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise CompletionError(f"the body is not valid JSON: {exc}") from None
            req = completion_request(body, self.model)
            if req["stream"]:
                if self.triton_grpc is None:
                    raise CompletionError("stream needs the Triton gRPC endpoint (dash-triton openai --grpc-url)")
                self._stream(h, req)
                return
            self._send(h, 200, self._complete(req))
        except CompletionError as exc:
            self._send(h, exc.status, exc.body())
        except DashClientError as exc:
            status = 400 if (exc.status or "") in ("400", "StatusCode.INVALID_ARGUMENT") else 503
            self._send(
                h,
                status,
                CompletionError(
                    str(exc), status=status, kind="invalid_request_error" if status == 400 else "service_unavailable"
                ).body(),
            )

    def _response(self, rid: str, text: str, finish: str | None, usage: dict | None = None) -> dict:
        out = {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
        }
        if usage is not None:
            out["usage"] = usage
        return out

    def _complete(self, req: dict) -> dict:
        with self._client("http") as c:
            g = c.generate(
                req["prompt"],
                req["max_tokens"],
                stop_at_eos=req["stop_at_eos"],
                stop_token_ids=req["stop_token_ids"],
                sampling=req["sampling"],
                image_features=req["image_features"],
            )
        usage = {
            "prompt_tokens": g.prompt_tokens,
            "completion_tokens": len(g.tokens),
            "total_tokens": g.prompt_tokens + len(g.tokens),
            "prompt_tokens_details": {"cached_tokens": g.cached_tokens},
        }
        return self._response(
            f"cmpl-{uuid.uuid4().hex}",
            c.decode(g.tokens),
            _finish_reason(g.tokens, req, self.config.eos_token_id),
            usage,
        )

    def _stream(self, h, req: dict) -> None:
        with self._client("grpc") as c:
            self._stream_with(c, h, req)

    def _stream_with(self, c: DashClient, h, req: dict) -> None:
        rid = f"cmpl-{uuid.uuid4().hex}"
        started = False

        def event(payload: str) -> None:
            nonlocal started
            if not started:
                h.send_response(200)
                h.send_header("Content-Type", "text/event-stream")
                h.send_header("Cache-Control", "no-cache")
                h.send_header("Connection", "close")
                h.end_headers()
                started = True
            h.wfile.write(f"data: {payload}\n\n".encode())
            h.wfile.flush()

        tokens: list[int] = []
        sent = [""]

        def delta(final: bool) -> str:
            # Byte-level tokens: a character may span tokens. Hold text back while it ends in an
            # incomplete UTF-8 sequence (decoded as U+FFFD), so the deltas join to the full text.
            text = c.decode(tokens)
            if not final and text.endswith("\ufffd"):
                return ""
            out, sent[0] = text[len(sent[0]) :], text
            return out

        def on_token(t: int) -> None:
            tokens.append(t)
            piece = delta(False)
            if piece:
                event(json.dumps(self._response(rid, piece, None)))

        try:
            g = c.stream(
                req["prompt"],
                req["max_tokens"],
                stop_at_eos=req["stop_at_eos"],
                stop_token_ids=req["stop_token_ids"],
                sampling=req["sampling"],
                image_features=req["image_features"],
                on_token=on_token,
            )
        except DashClientError as exc:
            if not started:
                raise
            event(json.dumps(CompletionError(str(exc), status=503, kind="service_unavailable").body()))
            h.close_connection = True
            return
        event(
            json.dumps(
                self._response(
                    rid,
                    delta(True),
                    _finish_reason(g.tokens, req, self.config.eos_token_id),
                    {
                        "prompt_tokens": g.prompt_tokens,
                        "completion_tokens": len(g.tokens),
                        "total_tokens": g.prompt_tokens + len(g.tokens),
                        "prompt_tokens_details": {"cached_tokens": g.cached_tokens},
                    },
                )
            )
        )
        event("[DONE]")
        h.close_connection = True

    def serve_forever(self) -> None:
        self.httpd.serve_forever()

    def start(self) -> OpenAIServer:
        """Serve on a background thread (tests, embedding)."""
        threading.Thread(target=self.httpd.serve_forever, name="dash-openai", daemon=True).start()
        return self

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def add_parser(sub) -> argparse.ArgumentParser:
    o = sub.add_parser(
        "openai",
        epilog="Exit codes: 0 stopped (Ctrl-C), 2 the Triton model cannot be reached or the port cannot be bound, "
        + EXIT_CODES_NOTE,
        help="serve an OpenAI-style /v1/completions endpoint in front of a Triton server",
        description="An OpenAI-style completions endpoint (POST /v1/completions, GET /v1/models, GET /health) "
        "that forwards to the DASH generation model on a running Triton server.",
    )
    o.add_argument("--url", default="127.0.0.1:8000", help="Triton's HTTP endpoint (%(default)s)")
    o.add_argument("--grpc-url", default="127.0.0.1:8001", help="Triton's gRPC endpoint, for stream=true (%(default)s)")
    o.add_argument("--model", default=P.DEFAULT_NAME, help="the generation model's name (%(default)s)")
    o.add_argument("--host", default="127.0.0.1", help="address to bind (%(default)s)")
    o.add_argument("--port", type=int, default=9000, help="port to bind (%(default)s)")
    o.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    return o


def openai_main(a, out: TextIO, err: TextIO) -> int:
    if not 0 < a.port <= 65535:
        print(f"dash-triton openai: error: --port must be 1..65535, got {a.port}", file=err)
        return 2
    try:
        server = OpenAIServer(a.url, a.grpc_url, host=a.host, port=a.port, model=a.model)
    except DashClientError as exc:
        print(f"dash-triton openai: error: {exc}", file=err)
        return 2
    except OSError as exc:
        print(f"dash-triton openai: error: cannot bind {a.host}:{a.port}: {exc.strerror or exc}", file=err)
        return 2
    print(
        f"OpenAI-style endpoint for '{a.model}' on {server.url}/v1/completions (Triton {a.url}); Ctrl-C stops",
        file=out,
        flush=True,
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.httpd.server_close()
    return 0


if __name__ == "__main__":  # pragma: no cover
    print("run it as: dash-triton openai --url HOST:PORT", file=sys.stderr)
    sys.exit(2)
