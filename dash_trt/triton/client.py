"""``dash-client``: send a document prompt to the DASH generation service on Triton
and print the generated tokens (tritonclient, HTTP or gRPC).

Python API::

    from dash_trt.triton.client import DashClient
    with DashClient("127.0.0.1:8000") as c:               # or protocol="grpc", url ":8001"
        ids = c.encode("<PAGE><image*64>What is the title?")
        out = c.generate(ids, max_new_tokens=16)          # Generation: tokens, text, seconds
        out = c.stream(ids, 16, on_progress=print)        # gRPC + the *_stream model: progress, tokens

The client reads the model's ``config.json`` from the server (the
``dash_model_config`` parameter of the model's config.pbtxt), so it tokenizes with
exactly :func:`dash_trt.model.tokenize` and needs no local files.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

import numpy as np

from .. import triton_protocol as P
from ..cliutil import EXIT_CODES_NOTE, VERBOSE_HELP, cli_main
from ..models.config import DashModelConfig, ModelConfigError, TokenIdModelError
from ..models.prompts import detokenize, document_prompt, tokenize
from ..versions import version_line as _version_line

__all__ = ["DashClient", "DashClientError", "TokenIdModel", "Generation", "main"]

PROTOCOLS = ("http", "grpc")
DEFAULT_URLS = {"http": "127.0.0.1:8000", "grpc": "127.0.0.1:8001"}


class DashClientError(RuntimeError):
    """The server refused or failed a request (``status``: HTTP status or gRPC code, if known),
    or could not be reached."""

    def __init__(self, message: str, status: str | None = None):
        super().__init__(message)
        self.status = status


class TokenIdModel(DashClientError):
    """The served model takes and returns token ids only (a Dual Chunk Attention text model): the
    client has no tokenizer and no page marker for it, so text prompts and ``--pages`` are refused
    and token ids are sent as they are."""


@dataclass
class Generation:
    prompt_tokens: int
    tokens: list[int]
    text: str
    seconds: float
    cached_tokens: int = 0  #: prompt tokens the server found in its prefix cache


def _cached(result) -> int:
    """``prompt_tokens_cached`` of a response (0 from a server without the output)."""
    try:
        arr = result.as_numpy(P.PROMPT_TOKENS_CACHED)
    except Exception:  # noqa: BLE001 - an older repository's model has no such output
        return 0
    return int(arr.reshape(-1)[0]) if arr is not None and arr.size else 0


def _module(protocol: str):
    if protocol == "http":
        import tritonclient.http as mod
    elif protocol == "grpc":
        import tritonclient.grpc as mod
    else:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
    return mod


def _error(exc: Exception) -> DashClientError:
    from tritonclient.utils import InferenceServerException

    if isinstance(exc, InferenceServerException):
        message, status = exc.message() or str(exc), exc.status()
        if status is None:  # a streamed error: its code is in the message
            message, status = P.split_stream_code(message)
        return DashClientError(message, status)
    return DashClientError(f"{type(exc).__name__}: {exc}")


class DashClient:
    """One connection to a Triton server holding the DASH generation models."""

    def __init__(
        self,
        url: str | None = None,
        *,
        protocol: str = "http",
        model: str = P.DEFAULT_NAME,
        stream_model: str | None = None,
        timeout: float = 600.0,
        concurrency: int = 1,
        admin_key: str | None = None,
    ):
        self.protocol = protocol
        self.mod = _module(protocol)
        self.url = url or DEFAULT_URLS[protocol]
        self.model = model
        self.stream_model = stream_model or model + P.STREAM_SUFFIX
        self.timeout = timeout
        try:
            if protocol == "http":
                self.client = self.mod.InferenceServerClient(
                    self.url, concurrency=concurrency, connection_timeout=timeout, network_timeout=timeout
                )
            else:
                self.client = self.mod.InferenceServerClient(self.url)
        except Exception as exc:
            raise _error(exc) from None
        if admin_key:  # a server whose HTTP inference needs it (dash-triton serve --key-http-inference)
            from .server import admin_key_plugin

            self.client.register_plugin(admin_key_plugin(admin_key))
        self._config: DashModelConfig | None = None
        self._token_ids_only: TokenIdModel | None = None

    # ------------------------------------------------------------- server info
    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.client.is_server_ready() and self.client.is_model_ready(self.model):
                    return
            except Exception:
                pass
            if time.monotonic() > deadline:
                raise DashClientError(f"model '{self.model}' not ready at {self.url} after {timeout:.0f} s")
            time.sleep(0.2)

    def model_config(self) -> DashModelConfig:
        """The served model's config.json (cached)."""
        if self._token_ids_only is not None:
            raise self._token_ids_only
        if self._config is None:
            try:
                raw = self.client.get_model_config(self.model, **({"as_json": True} if self.protocol == "grpc" else {}))
            except Exception as exc:
                raise _error(exc) from None
            raw = raw.get("config", raw)
            params = raw.get("parameters", {})
            if P.PARAM_MODEL_CONFIG not in params:
                raise DashClientError(
                    f"model '{self.model}' at {self.url} is not a DASH generation model "
                    f"(no '{P.PARAM_MODEL_CONFIG}' parameter)"
                )
            text = params[P.PARAM_MODEL_CONFIG].get("string_value", params[P.PARAM_MODEL_CONFIG].get("stringValue"))
            try:
                self._config = DashModelConfig.from_dict(json.loads(text), source=f"model '{self.model}'")
            except TokenIdModelError:  # a served text model (Dual Chunk Attention): token ids only
                self._token_ids_only = TokenIdModel(
                    f"model '{self.model}' at {self.url} is a Dual Chunk Attention text model: it takes token "
                    f"ids only (dash-client --ids 1,2,3), and this client has no tokenizer for its text"
                )
                raise self._token_ids_only from None
            except ModelConfigError as exc:
                raise DashClientError(
                    f"model '{self.model}' at {self.url} is not a DASH document model, so this client has no "
                    f"tokenizer for it (send token ids): {exc}"
                ) from None
        return self._config

    def takes_token_ids_only(self) -> bool:
        """Whether the served model is a token-id text model (:class:`TokenIdModel`): no tokenizer,
        no pages (other errors reading its config are raised)."""
        try:
            self.model_config()
        except TokenIdModel:
            return True
        return False

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a prompt: text with ``<PAGE>``, ``<image>``, ``<image*N>`` (see
        :func:`dash_trt.model.tokenize`), or ids as they are."""
        if isinstance(prompt, str):
            return tokenize(prompt, self.model_config())
        return [int(i) for i in prompt]

    def decode(self, ids: Sequence[int]) -> str:
        return detokenize(ids, self.model_config())

    def stats(self) -> dict[str, Any]:
        """The engine's pool and queue statistics (see ``GenerationEngine.stats``)."""
        return self._stats_of(self._inputs([], None, None, stats=True))

    def control(self, action: str) -> dict[str, Any]:
        """``pause`` or ``resume`` the engine's model steps (a model written with
        ``dash-triton write --allow-engine-control``); returns the statistics after it."""
        if action not in P.CONTROL_ACTIONS:
            raise DashClientError(f"engine control must be one of {', '.join(P.CONTROL_ACTIONS)}, got {action!r}")
        inputs = self._inputs([], None, None)
        raw = np.frombuffer(action.encode(), dtype=np.uint8)
        c = self.mod.InferInput(P.ENGINE_CONTROL, [raw.size], "UINT8")
        c.set_data_from_numpy(raw)
        inputs.append(c)
        return self._stats_of(inputs)

    def _stats_of(self, inputs) -> dict[str, Any]:
        try:
            res = self.client.infer(self.model, inputs, **self._timeout_kw())
        except Exception as exc:
            raise _error(exc) from None
        arr = res.as_numpy(P.STATS)
        if arr is None or arr.size == 0:
            raise DashClientError(f"model '{self.model}' sent no statistics")
        return json.loads(arr.astype(np.uint8).tobytes().decode())

    # -------------------------------------------------------------- generation
    def _timeout_kw(self) -> dict:
        return {"client_timeout": self.timeout} if self.protocol == "grpc" else {}

    def _inputs(
        self,
        ids,
        max_new_tokens,
        stop_at_eos,
        *,
        stats=False,
        ids_dtype="INT64",
        stop_token_ids=None,
        sampling=None,
        image_features=None,
    ):
        mod = self.mod
        arr = np.asarray(ids, dtype=np.int64 if ids_dtype == "INT64" else None)
        if arr.ndim == 1 and arr.size == 0:
            arr = arr.astype(np.int64)
        x = mod.InferInput(P.INPUT_IDS, list(arr.shape), ids_dtype)
        x.set_data_from_numpy(arr)
        inputs = [x]
        if max_new_tokens is not None:
            m = mod.InferInput(P.MAX_NEW_TOKENS, [1], "INT32")
            m.set_data_from_numpy(np.array([max_new_tokens], dtype=np.int32))
            inputs.append(m)
        if stop_at_eos is not None:
            s = mod.InferInput(P.STOP_AT_EOS, [1], "BOOL")
            s.set_data_from_numpy(np.array([bool(stop_at_eos)]))
            inputs.append(s)
        if stop_token_ids is not None:
            ids_arr = np.asarray(list(stop_token_ids), dtype=np.int64)
            s = mod.InferInput(P.STOP_TOKEN_IDS, [ids_arr.size], "INT64")
            s.set_data_from_numpy(ids_arr)
            inputs.append(s)
        if sampling is not None:
            fields = sampling if isinstance(sampling, dict) else dataclasses.asdict(sampling)
            unknown = sorted(set(fields) - set(P.SAMPLING_INPUTS))
            if unknown:
                raise DashClientError(f"unknown sampling parameter(s): {', '.join(unknown)}")
            for field, value in fields.items():
                if value is None:
                    continue
                name, dtype = P.SAMPLING_INPUTS[field]
                np_dtype = {"TYPE_FP32": np.float32, "TYPE_INT32": np.int32, "TYPE_INT64": np.int64}[dtype]
                x = mod.InferInput(name, [1], dtype.removeprefix("TYPE_"))
                x.set_data_from_numpy(np.array([value], dtype=np_dtype))
                inputs.append(x)
        if image_features is not None:
            feats = np.ascontiguousarray(np.asarray(image_features, dtype=np.float32))
            if feats.ndim != 2:
                raise DashClientError(f"image_features must be [image tokens, feature dim], got {list(feats.shape)}")
            f = mod.InferInput(P.IMAGE_FEATURES, list(feats.shape), "FP32")
            f.set_data_from_numpy(feats)
            inputs.append(f)
        if stats:
            g = mod.InferInput(P.GET_STATS, [1], "BOOL")
            g.set_data_from_numpy(np.array([True]))
            inputs.append(g)
        return inputs

    def ocr(
        self,
        document: bytes | list[tuple[str, bytes]],
        name: str = "document",
        *,
        model: str | None = None,
        instruction: str | None = None,
        crop: bool | None = None,
        max_page_image_tokens: int | None = None,
        max_new_tokens: int | None = None,
        rules: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """A document's file (PDF or image bytes; or several ``(name, bytes)`` files whose pages form
        one document) to the document model (``<model>_document``): its JSON answer,
        ``{"pages": [{"page", "source", "text"}, ...], "prompt_tokens", ...}``.
        ``crop``: None (upstream's default: tiles for every page), False, True; ``rules``: decoding-rule overrides
        (``page_guard``, ``max_page_tokens``, ``no_repeat_ngram``, ``no_repeat_window``)."""
        mod = self.mod
        inputs = []

        def add(iname, arr, dtype):
            x = mod.InferInput(iname, list(arr.shape), dtype)
            x.set_data_from_numpy(arr)
            inputs.append(x)

        files = [(name, bytes(document))] if isinstance(document, (bytes, bytearray, memoryview)) else list(document)
        if not files:
            raise DashClientError("a document needs at least one file")
        empty = [n for n, data in files if not data]
        if empty:  # named here: the server sees only bytes, and would not say which file
            raise DashClientError(f"{empty[0]}: the file is empty")
        add(P.DOCUMENT, np.frombuffer(b"".join(data for _, data in files), dtype=np.uint8), "UINT8")
        add(P.DOCUMENT_SIZES, np.array([len(data) for _, data in files], dtype=np.int64), "INT64")
        names = "\n".join(n.replace("\n", " ") for n, _ in files)
        add(P.DOCUMENT_NAME, np.frombuffer(names.encode("utf-8"), dtype=np.uint8), "UINT8")
        if instruction is not None:
            add(P.INSTRUCTION, np.frombuffer(instruction.encode("utf-8"), dtype=np.uint8), "UINT8")
        if crop is not None:
            add(P.CROP_MODE, np.array([int(bool(crop))], dtype=np.int32), "INT32")
        if max_page_image_tokens is not None:
            add(P.MAX_PAGE_IMAGE_TOKENS, np.array([max_page_image_tokens], dtype=np.int32), "INT32")
        if max_new_tokens is not None:
            add(P.MAX_NEW_TOKENS, np.array([max_new_tokens], dtype=np.int32), "INT32")
        for field, value in (rules or {}).items():
            if field not in P.RULE_INPUTS:
                raise DashClientError(f"unknown decoding rule {field!r} (known: {', '.join(P.RULE_INPUTS)})")
            if value is None:
                continue
            iname, dtype = P.RULE_INPUTS[field]
            if dtype == "TYPE_BOOL":
                add(iname, np.array([bool(value)]), "BOOL")
            else:
                add(iname, np.array([int(value)], dtype=np.int32), "INT32")
        try:
            res = self.client.infer(
                model or self.model + P.DOCUMENT_SUFFIX,
                inputs,
                outputs=[mod.InferRequestedOutput(P.RESULT)],
                **self._timeout_kw(),
            )
        except Exception as exc:
            raise _error(exc) from None
        return json.loads(np.ascontiguousarray(res.as_numpy(P.RESULT), dtype=np.uint8).tobytes().decode("utf-8"))

    def _outputs(self):
        return [
            self.mod.InferRequestedOutput(P.OUTPUT_IDS),
            self.mod.InferRequestedOutput(P.PROMPT_TOKENS_DONE),
            self.mod.InferRequestedOutput(P.PROMPT_TOKENS_CACHED),
        ]

    def generate(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int | None = None,
        *,
        stop_at_eos: bool | None = None,
        stop_token_ids: Sequence[int] | None = None,
        sampling: Any = None,
        image_features: Any = None,
    ) -> Generation:
        """One request to the unary model; blocks until the tokens come back. ``sampling``: a
        ``dash_trt.serving.sampling.SamplingParams`` or a dict of its fields (temperature, top_k,
        top_p, seed); default greedy. ``image_features``: [image tokens, image_feature_dim]
        float32, one row per ``<image>`` token of the prompt (models that take them)."""
        ids = self.encode(prompt)
        t0 = time.perf_counter()
        try:
            res = self.client.infer(
                self.model,
                self._inputs(
                    ids,
                    max_new_tokens,
                    stop_at_eos,
                    stop_token_ids=stop_token_ids,
                    sampling=sampling,
                    image_features=image_features,
                ),
                outputs=self._outputs(),
                **self._timeout_kw(),
            )
        except Exception as exc:
            raise _error(exc) from None
        tokens = [int(t) for t in res.as_numpy(P.OUTPUT_IDS).reshape(-1)]
        return Generation(len(ids), tokens, self._text(tokens), time.perf_counter() - t0, _cached(res))

    def generate_async(
        self,
        ids: Sequence[int],
        max_new_tokens: int | None,
        callback: Callable[[Any], None],
        *,
        stop_at_eos: bool | None = None,
        stop_token_ids: Sequence[int] | None = None,
        sampling: Any = None,
    ) -> None:
        """gRPC only: send without waiting; ``callback(Generation | DashClientError)``
        runs on the client's thread when the answer arrives (used by the load test)."""
        if self.protocol != "grpc":
            raise DashClientError("generate_async needs protocol='grpc'")
        ids = [int(i) for i in ids]
        t0 = time.perf_counter()

        def done(result, error):
            dt = time.perf_counter() - t0
            if error is not None:
                callback(_error(error))
            else:
                tokens = [int(t) for t in result.as_numpy(P.OUTPUT_IDS).reshape(-1)]
                callback(Generation(len(ids), tokens, "", dt, _cached(result)))

        try:
            self.client.async_infer(
                self.model,
                self._inputs(ids, max_new_tokens, stop_at_eos, stop_token_ids=stop_token_ids, sampling=sampling),
                done,
                outputs=self._outputs(),
                client_timeout=self.timeout,
            )
        except Exception as exc:
            raise _error(exc) from None

    def stream(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int | None = None,
        *,
        stop_at_eos: bool | None = None,
        on_progress: Callable[[int, int], None] | None = None,
        on_token: Callable[[int], None] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        sampling: Any = None,
        image_features: Any = None,
    ) -> Generation:
        """gRPC streaming through the decoupled model: ``on_progress(done, total)`` after each
        prefill chunk, ``on_token(id)`` for each new token; returns when the final response
        arrives."""
        if self.protocol != "grpc":
            raise DashClientError(
                "streaming needs protocol='grpc' (Triton's HTTP endpoint does not serve decoupled models)"
            )
        ids = self.encode(prompt)
        answers: queue.Queue = queue.Queue()
        t0 = time.perf_counter()
        try:
            self.client.start_stream(
                callback=lambda result, error: answers.put((result, error)), stream_timeout=self.timeout
            )
        except Exception as exc:
            raise _error(exc) from None
        tokens: list[int] = []
        cached = 0
        try:
            self.client.async_stream_infer(
                self.stream_model,
                self._inputs(
                    ids,
                    max_new_tokens,
                    stop_at_eos,
                    stop_token_ids=stop_token_ids,
                    sampling=sampling,
                    image_features=image_features,
                ),
                outputs=self._outputs(),
                enable_empty_final_response=True,
            )
            while True:
                try:
                    result, error = answers.get(timeout=self.timeout)
                except queue.Empty:
                    raise DashClientError(f"no answer from '{self.stream_model}' in {self.timeout:.0f} s") from None
                if error is not None:
                    raise _error(error)
                response = result.get_response()
                new = result.as_numpy(P.OUTPUT_IDS)
                done = result.as_numpy(P.PROMPT_TOKENS_DONE)
                cached = _cached(result) or cached
                if done is not None and on_progress is not None and (new is None or new.size == 0):
                    on_progress(int(done.reshape(-1)[0]), len(ids))
                if new is not None:
                    for t in new.reshape(-1).tolist():
                        tokens.append(int(t))
                        if on_token is not None:
                            on_token(int(t))
                final = response.parameters.get("triton_final_response")
                if final is not None and final.bool_param:
                    break
        except DashClientError:
            raise
        except Exception as exc:
            raise _error(exc) from None
        finally:
            self.client.stop_stream()
        return Generation(len(ids), tokens, self._text(tokens), time.perf_counter() - t0, cached)

    def _text(self, tokens: Sequence[int]) -> str:
        try:
            return self.decode(tokens)
        except DashClientError:
            return ""

    def close(self) -> None:
        try:
            self.client.close()
        except Exception:
            pass

    def __enter__(self) -> DashClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ----------------------------------------------------------------------- CLI
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dash-client",
        description="Send a document prompt to the DASH generation model on a Triton server and print the "
        "generated tokens.",
        epilog="Prompt text: bytes, <PAGE> (a page marker), <image> or <image*N> (N image tokens), e.g. "
        "'<PAGE><image*64>Title?'. Exit codes: 0 ok, 1 the server refused or failed the request, "
        "2 bad arguments (or tritonclient not installed), 3 server not reachable, " + EXIT_CODES_NOTE,
    )
    p.add_argument("--version", action="version", version=_version_line())
    p.add_argument("--url", help="host:port (default 127.0.0.1:8001 for grpc, 127.0.0.1:8000 for http)")
    p.add_argument(
        "--protocol",
        choices=PROTOCOLS,
        default="grpc",
        help="%(default)s (default; dash-triton serve keys Triton's HTTP inference: over http, pass --admin-key-file)",
    )
    p.add_argument("--model", default=P.DEFAULT_NAME, help="generation model name (default %(default)s)")
    p.add_argument(
        "--stream",
        action="store_true",
        help="stream prefill progress and tokens from the decoupled MODEL_stream model (implies grpc)",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text with <PAGE> and <image*N> tokens")
    src.add_argument("--pages", help="comma-separated image tokens per page, e.g. 64,64,32 (with --question)")
    src.add_argument("--ids", help="comma-separated token ids")
    p.add_argument("--question", default="", help="text after the pages (with --pages)")
    p.add_argument("--preamble", default="", help="text before the pages (with --pages)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: the model's")
    p.add_argument("--no-stop-at-eos", action="store_true", help="generate max-new-tokens even past EOS")
    p.add_argument("--stop-token-ids", help="comma-separated token ids that end the generation (kept in the output)")
    p.add_argument("--temperature", type=float, default=None, help="sample at this temperature (default 0: greedy)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="sample within this much probability (nucleus)")
    p.add_argument("--seed", type=int, default=None, help="the request's sampling seed (reproducible tokens)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--stats", action="store_true", help="print the engine's pool statistics and exit")
    p.add_argument(
        "--engine-control",
        choices=P.CONTROL_ACTIONS,
        help="pause or resume the engine's model steps (a model written with --allow-engine-control), "
        "print the statistics and exit",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for an answer")
    p.add_argument(
        "--admin-key-file",
        metavar="PATH",
        help="send the admin key that dash-triton serve --admin-key-file wrote (needed over HTTP unless the server "
        "was started with --open-http-inference)",
    )
    p.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    p.add_argument(
        "--wait",
        type=float,
        default=0.0,
        help="first wait up to this many seconds for the server and model to be ready (a server "
        "just started takes a while to load the models)",
    )
    p.add_argument(
        "--progress-threshold",
        type=int,
        default=512,
        help="prompts of at least this many tokens show progress while waiting (default %(default)s)",
    )
    return p


class _Ticker:
    """Prints 'waiting' lines on a long unary request (the unary model answers once)."""

    def __init__(self, stream: TextIO, n_tokens: int, every: float = 2.0):
        self.stream, self.n, self.every = stream, n_tokens, every
        self._stop = threading.Event()
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        print(
            f"  waiting for the answer to a {self.n}-token prompt (the unary model answers once; --stream shows "
            f"prefill progress)",
            file=self.stream,
            flush=True,
        )
        while not self._stop.wait(self.every):
            print(
                f"  ... {time.perf_counter() - self._t0:.0f} s, prompt of {self.n} tokens being processed",
                file=self.stream,
                flush=True,
            )

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


@cli_main("dash-client")
def main(argv: Sequence[str] | None = None, *, stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    a = _parser().parse_args(argv)
    out = stdout if stdout is not None else sys.stdout
    err = stderr if stderr is not None else sys.stderr
    protocol = "grpc" if a.stream else a.protocol
    try:
        _module(protocol)
    except ImportError as exc:
        print(f"dash-client: error: tritonclient is not installed ({exc}): pip install 'dash-trt[triton]'", file=err)
        return 2
    if a.max_new_tokens is not None and not 1 <= a.max_new_tokens <= 2**31 - 1:
        print(f"dash-client: error: --max-new-tokens must be 1..{2**31 - 1}, got {a.max_new_tokens}", file=err)
        return 2
    key = None
    if a.admin_key_file:
        from .server import read_admin_key

        try:
            key = read_admin_key(a.admin_key_file)
        except (OSError, ValueError) as exc:
            print(f"dash-client: error: --admin-key-file: {exc}", file=err)
            return 2
    try:
        client = DashClient(a.url, protocol=protocol, model=a.model, timeout=a.timeout, admin_key=key)
    except DashClientError as exc:
        print(f"dash-client: error: cannot connect: {exc}", file=err)
        return 3
    with client:
        if a.wait > 0:
            try:
                client.wait_ready(a.wait)
            except DashClientError as exc:
                print(f"dash-client: error: {exc}", file=err)
                return 3
        try:
            ready = client.client.is_server_live()
        except Exception as exc:
            print(f"dash-client: error: no Triton server at {client.url} ({protocol}): {_error(exc)}", file=err)
            return 3
        if not ready:
            print(f"dash-client: error: the server at {client.url} is not live", file=err)
            return 3
        try:
            if a.stats or a.engine_control:
                stats = client.control(a.engine_control) if a.engine_control else client.stats()
                print(json.dumps(stats, indent=None if a.json else 2), file=out)
                return 0
            if a.ids:
                try:
                    ids = [int(x) for x in a.ids.split(",") if x.strip()]
                except ValueError:
                    print(f"dash-client: error: --ids must be comma-separated integers, got {a.ids!r}", file=err)
                    return 2
            elif a.pages:
                try:
                    pages = [int(x) for x in a.pages.split(",") if x.strip()]
                except ValueError:
                    print(f"dash-client: error: --pages must be comma-separated integers, got {a.pages!r}", file=err)
                    return 2
                ids = document_prompt(pages, a.question, client.model_config(), preamble=a.preamble)
            elif a.prompt is not None:
                ids = client.encode(a.prompt)
            else:
                print("dash-client: error: give --prompt, --pages or --ids", file=err)
                return 2
            stop = False if a.no_stop_at_eos else None
            try:
                stop_ids = (
                    None if a.stop_token_ids is None else [int(x) for x in a.stop_token_ids.split(",") if x.strip()]
                )
            except ValueError:
                print(
                    f"dash-client: error: --stop-token-ids must be comma-separated integers, got {a.stop_token_ids!r}",
                    file=err,
                )
                return 2
            sampling = {
                k: v
                for k, v in (("temperature", a.temperature), ("top_k", a.top_k), ("top_p", a.top_p), ("seed", a.seed))
                if v is not None
            } or None
            opts = {"stop_token_ids": stop_ids, "sampling": sampling}
            # a token-id model (Dual Chunk Attention) has no pages and no tokenizer: ids only
            has_tokenizer = not client.takes_token_ids_only()
            pages = ""
            if has_tokenizer:
                cfg = client.model_config()
                pages = f", {sum(1 for i in ids if i == cfg.page_token_id)} page(s)"
            served_by = client.stream_model if a.stream else client.model
            print(
                f"prompt: {len(ids)} tokens{pages}; model '{served_by}' at {client.url} ({protocol})",
                file=err,
                flush=True,
            )
            if a.stream:
                state = {"last": -1, "first": True}

                def progress(done, total):
                    pct = 100 * done // max(total, 1)
                    if pct != state["last"]:
                        state["last"] = pct
                        print(f"  prefill {done}/{total} tokens ({pct}%)", file=err, flush=True)

                def token(t):
                    if not a.json:
                        if state["first"]:
                            print("tokens:", end="", file=out)
                            state["first"] = False
                        print(f" {t}", end="", file=out, flush=True)

                gen = client.stream(
                    ids, a.max_new_tokens, stop_at_eos=stop, on_progress=progress, on_token=token, **opts
                )
                if not a.json:
                    print(file=out)
            elif len(ids) >= a.progress_threshold:
                with _Ticker(err, len(ids)):
                    gen = client.generate(ids, a.max_new_tokens, stop_at_eos=stop, **opts)
            else:
                gen = client.generate(ids, a.max_new_tokens, stop_at_eos=stop, **opts)
        except DashClientError as exc:
            hint = ""
            if "is restricted" in str(exc) and not key:
                hint = " (the server wants its admin key: --admin-key-file, or use --protocol grpc)"
            print(f"dash-client: error: {exc}{hint}", file=err)
            return 1
    if a.json:
        print(
            json.dumps(
                {
                    "prompt_tokens": gen.prompt_tokens,
                    "tokens": gen.tokens,
                    "text": gen.text if has_tokenizer else None,
                    "seconds": round(gen.seconds, 4),
                }
            ),
            file=out,
        )
    else:
        if not a.stream:
            print("tokens: " + " ".join(map(str, gen.tokens)), file=out)
        if has_tokenizer:
            print(f"text: {gen.text!r}", file=out)
        rate = len(gen.tokens) / gen.seconds if gen.seconds > 0 else 0.0
        print(f"{len(gen.tokens)} tokens in {gen.seconds:.2f} s ({rate:.1f} tokens/s)", file=err)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
