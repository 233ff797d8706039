"""The Triton models behind the front door, through tritonclient's asyncio gRPC client:
:class:`TritonBackend` (generation, unary and streaming, and the document model) and
:func:`triton_error` (a Triton or gRPC failure as OpenAI's error object).

A backend is anything with this class's methods (``start``, ``close``, ``ready``, ``generate``,
``stream``, ``document``) and attributes (``config``, ``tokenizer``, ``has_documents``; optionally
``max_prompt_tokens`` and ``max_token_chars``, the prompt bound checked before tokenizing):
:func:`~dash_trt.frontdoor.app.create_app` takes another for embedding and tests.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import numpy as np

from .. import triton_protocol as P
from .models import APIError
from .settings import FrontDoorSettings

__all__ = ["TritonBackend", "end_stream", "triton_error"]


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
        #: the most prompt tokens the model can admit (its engine config's longest request)
        self.max_prompt_tokens: int | None = None
        #: the longest text one token stands for (the tokenizer's longest token): a prompt of
        #: more than max_prompt_tokens times this many characters is too long before tokenizing
        self.max_token_chars: int | None = None
        self.has_documents = False

    async def start(self) -> None:
        from ..documents.tokenizer import ByteTokenizer, load_tokenizer
        from ..models.config import DashModelConfig
        from ..serving.limits import longest_request

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
        try:
            self.has_documents = await self.client.is_model_ready(self.s.model + P.DOCUMENT_SUFFIX)
        except Exception:  # noqa: BLE001 - no document model: documents are refused
            self.has_documents = False
        if self.has_documents and not self.s.tokenizer:
            # dash-triton write adds a document model only from a checkpoint folder with its
            # tokenizer.json: the demo's byte tokenizer would turn text into the wrong tokens
            raise RuntimeError(
                f"model '{self.s.model}' has a document model ('{self.s.model}{P.DOCUMENT_SUFFIX}'), so it was "
                "written from a checkpoint with its own tokenizer: pass --tokenizer FOLDER (that checkpoint "
                "folder); the demo model's byte tokenizer would encode text into the wrong tokens"
            )
        self.tokenizer = load_tokenizer(self.s.tokenizer) if self.s.tokenizer else ByteTokenizer(self.config)
        if P.PARAM_ENGINE in params:
            self.max_prompt_tokens = longest_request(params[P.PARAM_ENGINE])
        self.max_token_chars = self.tokenizer.max_token_chars

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
        answered = False  # the request has had its last answer: the stream is left to end itself
        try:
            async for result, error in it:
                if error is not None:
                    answered = True  # the generation models flag every error they send final
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
                    answered = True
                    return
        finally:
            if answered:
                await end_stream(it)
            else:  # abandoned mid-request (the client went away, a timeout): Triton stops it
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


#: How long :func:`end_stream` waits for Triton to close a stream that has had its last answer.
STREAM_END_TIMEOUT_S = 5.0


async def end_stream(it, timeout: float = STREAM_END_TIMEOUT_S) -> None:
    """Let a gRPC stream whose request has had its final answer end with Triton's status instead
    of cancelling it (``it``: tritonclient's ``stream_infer`` iterator, whose request iterator is
    exhausted, so Triton closes the stream once that answer is written).

    A cancel that reaches Triton 2.51 after it wrote the final answer but before it finished the
    stream leaks the stream's state in its gRPC front end (the state waits, CANCELLATION_ISSUED,
    for a response callback that already ran), and with it the inference request, which holds
    the model: on shutdown the decoupled model then never unloads, its ``finalize`` never runs,
    and tritonserver exits 1 at its exit timeout (issue 67 D2 / 68 D3). Cancelled only if the
    stream has not ended within ``timeout`` or this task is cancelled while waiting."""
    import asyncio

    async def rest():
        async for _ in it:  # nothing more is expected: the server's status ends it
            pass

    try:
        await asyncio.wait_for(rest(), timeout)
    except asyncio.CancelledError:
        it.cancel()
        raise
    except Exception:  # noqa: BLE001 - a timeout or the stream's own error: the answer is already out
        it.cancel()


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
