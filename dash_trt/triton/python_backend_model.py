"""Triton Python-backend model: DASH greedy generation over a paged KV pool.

``dash-triton write`` copies this file to ``<repo>/<model>/1/model.py`` next to the
checkpoint ``model.pt``; it is not imported as part of the package (it needs Triton's
``triton_python_backend_utils``, which exists only inside the server's backend stub).
The Python that runs it needs ``dash-trt`` and ``torch`` installed.

How it works: :meth:`TritonPythonModel.initialize` loads the checkpoint and starts a
:class:`~dash_trt.serving.engine.GenerationEngine` with its own paged KV pool and an
:class:`~dash_trt.serving.engine.EngineRunner` thread. :meth:`execute` only validates
each request and hands it to the engine, then returns ``None`` at once; responses go
out through each request's response sender from the engine thread when the engine
reports them. Because ``execute`` never waits for generation, Triton keeps delivering
new requests while others are decoding, and the engine batches all of them.

- Unary model (``decoupled: false``, HTTP and gRPC): exactly one response per request,
  sent when it finishes (all ``output_ids``) or fails (an error).
- Streaming model (``decoupled: true``, gRPC streaming): a response per prefill chunk
  (``prompt_tokens_done``), one per new token (``output_ids`` = that token), then an
  empty response flagged final; or an error, flagged final.

Errors: an invalid request gets an ``INVALID_ARG`` error response at once (the others
are not affected); requests still queued at shutdown get ``UNAVAILABLE``; a failed model
step fails only the sequences in that step (``INTERNAL``).
"""

import hmac
import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils


def _check_tensor_interop(torch):
    """Tensors cross the backend stub through DLPack only, never numpy: the stub's pybind11
    (2.10 in the Triton 2.51 that nvidia-pytriton 0.7.0 ships) reads numpy's dtype descriptor
    with the numpy 1.x layout, so under numpy 2.x every item size reads as 0:
    ``Tensor.as_numpy()`` repeats the first element and ``pb_utils.Tensor(name, ndarray)``
    carries 0 bytes (BYTES tensors too, which is why this model has none). Raises if DLPack
    is broken as well; returns a note for the log when only numpy's side is."""
    want = torch.arange(1, 5, dtype=torch.int64)
    back = torch.utils.dlpack.from_dlpack(pb_utils.Tensor.from_dlpack("probe", want).to_dlpack()).tolist()
    if back != want.tolist():
        raise RuntimeError(f"the Triton Python backend stub corrupts DLPack tensors: {want.tolist()} -> {back}")
    got = pb_utils.Tensor.from_dlpack("probe", want).as_numpy().tolist()
    if got != want.tolist():
        return (
            f"the backend stub's numpy interop is broken with numpy {np.__version__} ({want.tolist()} -> {got}); "
            "this model exchanges tensors through DLPack, so requests are not affected"
        )
    return None


#: The most finalize waits for the engine thread (below the server's exit timeout).
FINALIZE_TIMEOUT_S = 8.0


class TritonPythonModel:
    def initialize(self, args):
        import torch

        from dash_trt import triton_protocol as P
        from dash_trt.models.loader import load_model
        from dash_trt.serving.engine import (
            CANCELLED,
            INTERNAL,
            INVALID_ARGUMENT,
            UNAVAILABLE,
            EngineConfig,
            EngineRunner,
            GenerationEngine,
            RequestError,
        )

        self.P = P
        self.torch = torch
        self.RequestError = RequestError
        note = _check_tensor_interop(torch)
        if note:
            pb_utils.Logger.log_warn(f"{args.get('model_name', 'dash')}: {note}")
        self.codes = {
            INVALID_ARGUMENT: pb_utils.TritonError.INVALID_ARG,
            UNAVAILABLE: pb_utils.TritonError.UNAVAILABLE,
            CANCELLED: pb_utils.TritonError.CANCELLED,
            INTERNAL: pb_utils.TritonError.INTERNAL,
        }
        self.grpc_status = {
            INVALID_ARGUMENT: "StatusCode.INVALID_ARGUMENT",
            UNAVAILABLE: "StatusCode.UNAVAILABLE",
            CANCELLED: "StatusCode.CANCELLED",
            INTERNAL: "StatusCode.INTERNAL",
        }
        config = json.loads(args["model_config"])
        self.name = config["name"]
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        self.allow_control = params.get(P.PARAM_ALLOW_CONTROL, "false") == "true"
        threads = int(params.get(P.PARAM_TORCH_THREADS, "0") or 0)
        if threads > 0:
            torch.set_num_threads(threads)

        device = params.get(P.PARAM_DEVICE, "cpu")
        if args.get("model_instance_kind") == "GPU":
            device = f"cuda:{args['model_instance_device_id']}"
        elif device == "cuda":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        version_dir = os.path.join(args["model_repository"], args["model_version"])
        checkpoint = os.path.join(version_dir, params.get(P.PARAM_CHECKPOINT, "model.pt"))
        model_class = params.get(P.PARAM_MODEL_CLASS, "") or None
        if model_class and not model_class.startswith(("/", ".")) and ".py:" in model_class:
            model_class = os.path.join(version_dir, model_class)  # a file copied into the version folder
        model = load_model(checkpoint, model_class=model_class).to(device)
        engine_config = EngineConfig.from_json(params[P.PARAM_ENGINE]) if P.PARAM_ENGINE in params else EngineConfig()
        self.engine = GenerationEngine(model, engine_config)
        if params.get(P.PARAM_WARMUP, "true") == "true":
            # The first call of the op imports torch's compile machinery (seconds), and the
            # decode graphs are captured: pay it before the model reports ready.
            self.engine.warmup()
        # Generation metrics on Triton's metrics endpoint (dash_trt.triton.metrics), where this
        # Triton's Python backend has custom metrics.
        self.metrics = None
        if hasattr(pb_utils, "MetricFamily"):
            from dash_trt.triton.metrics import GenerationMetrics

            self.metrics = GenerationMetrics(pb_utils, self.name)
            self.metrics.state(self.engine.stats())
        self.runner = EngineRunner(self.engine, name=f"{self.name}-engine").start()
        pb_utils.Logger.log_info(
            f"{self.name}: {'decoupled' if self.decoupled else 'unary'} generation "
            f"({type(model).__name__}) on {device}; "
            f"KV pool {engine_config.num_blocks} blocks x {engine_config.kv_block_size} tokens; "
            f"torch {torch.__version__}, {torch.get_num_threads()} threads"
        )

    # ------------------------------------------------------------------ requests
    def execute(self, requests):
        P = self.P
        for request in requests:
            sender = request.get_response_sender()
            try:
                control = self._optional(request, P.ENGINE_CONTROL)
                if control is not None:
                    self._control(control)
                if control is not None or self._flag(request, P.GET_STATS, False):
                    stats = dict(self.engine.stats(), engine_alive=self.runner.alive)
                    blob = bytearray(json.dumps(stats).encode())
                    sender.send(
                        pb_utils.InferenceResponse(
                            [pb_utils.Tensor.from_dlpack(P.STATS, self.torch.frombuffer(blob, dtype=self.torch.uint8))]
                        ),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
                    )
                    continue
                ids = self._optional(request, P.INPUT_IDS)
                if ids is None:
                    raise self.RequestError(f"{P.INPUT_IDS} is required (the prompt's token ids, INT64 [n])")
                max_new = self._optional(request, P.MAX_NEW_TOKENS)
                self.engine.submit(
                    ids,
                    max_new,
                    stop_at_eos=self._flag(request, P.STOP_AT_EOS, True),
                    on_event=self._on_event,
                    is_cancelled=request.is_cancelled,
                    tag=sender,
                    stop_token_ids=self._optional(request, P.STOP_TOKEN_IDS),
                    sampling=self._sampling(request),
                    image_features=self._optional(request, P.IMAGE_FEATURES),
                    rules=self._scalars(request, P.RULE_INPUTS),
                )
            except self.RequestError as exc:
                self._send_error(sender, str(exc), exc.code)
            except Exception as exc:  # never let one request take the model down
                self._send_error(sender, f"{type(exc).__name__}: {exc}", "internal")
        return None

    def _control(self, arr):
        P = self.P
        action = arr.astype(np.uint8).tobytes().decode("utf-8", "replace")
        words = action.split()
        token = os.environ.get(P.DRAIN_TOKEN_ENV, "")
        if len(words) == 3 and words[0] == P.DRAIN_ACTION:  # from dash-triton serve, with its token
            if not token or not hmac.compare_digest(words[1], token):
                raise self.RequestError(
                    f"{P.ENGINE_CONTROL}: drain is reserved for the process that started the server"
                )
            try:
                grace = float(words[2])
            except ValueError:
                raise self.RequestError(f"{P.ENGINE_CONTROL}: drain needs a grace in seconds") from None
            failed = self.engine.drain(f"{self.name} is shutting down", grace)
            pb_utils.Logger.log_info(
                f"{self.name}: draining for shutdown ({failed} queued request(s) answered "
                f"UNAVAILABLE, {grace:g} s for the running ones)"
            )
            return
        if not self.allow_control:
            raise self.RequestError(
                f"{P.ENGINE_CONTROL} is disabled for this model (write the repository with "
                f"dash-triton write --allow-engine-control to enable it)"
            )
        if action == "pause":
            self.engine.pause()
        elif action == "resume":
            self.engine.resume()
        else:
            raise self.RequestError(
                f"{P.ENGINE_CONTROL} must be one of {', '.join(P.CONTROL_ACTIONS)}, got {action[:40]!r}"
            )
        pb_utils.Logger.log_info(f"{self.name}: engine {action}d by a request")

    def _read(self, tensor):
        # DLPack, not as_numpy() (see _check_tensor_interop); a copy, since the engine keeps
        # it past the request's lifetime
        return self.torch.utils.dlpack.from_dlpack(tensor.to_dlpack()).cpu().numpy().copy()

    def _optional(self, request, name):
        t = pb_utils.get_input_tensor_by_name(request, name)
        return None if t is None else self._read(t)

    def _sampling(self, request):
        """The request's sampling inputs as SamplingParams fields (None: all absent, greedy)."""
        return self._scalars(request, self.P.SAMPLING_INPUTS)

    def _scalars(self, request, inputs):
        """The request's one-value inputs of ``inputs`` (field -> (input name, Triton type)) as a
        dict of fields (None: all absent)."""
        values = {}
        for field, (name, dtype) in inputs.items():
            arr = self._optional(request, name)
            if arr is None:
                continue
            if arr.size != 1:
                raise self.RequestError(f"{name} must hold one value, got shape {list(arr.shape)}")
            value = arr.reshape(-1)[0]
            if dtype == "TYPE_FP32":
                values[field] = float(value)
            elif dtype == "TYPE_BOOL":
                values[field] = bool(value)
            else:
                values[field] = int(value)
        return values or None

    def _flag(self, request, name, default):
        arr = self._optional(request, name)
        if arr is None:
            return default
        if arr.size != 1:
            raise self.RequestError(f"{name} must hold one boolean, got shape {list(arr.shape)}")
        return bool(arr.reshape(-1)[0])

    # -------------------------------------------------------------- responses
    def _outputs(self, tokens, req):
        P, torch = self.P, self.torch
        # torch tensors through DLPack (never a numpy array: the stub renames the capsule,
        # which numpy's destructor rejects)
        return [
            pb_utils.Tensor.from_dlpack(P.OUTPUT_IDS, torch.tensor(list(tokens), dtype=torch.int64)),
            pb_utils.Tensor.from_dlpack(P.PROMPT_TOKENS_DONE, torch.tensor([req.prompt_done], dtype=torch.int64)),
            pb_utils.Tensor.from_dlpack(P.PROMPT_TOKENS_CACHED, torch.tensor([req.prompt_cached], dtype=torch.int64)),
        ]

    def _send_error(self, sender, message, code):
        text = f"{self.name}: {message}"
        if self.decoupled:  # the gRPC stream drops the code: carry it in the message
            text = self.P.STREAM_CODE_FORMAT.format(
                message=text, code=self.grpc_status.get(code, "StatusCode.INTERNAL")
            )
        error = pb_utils.TritonError(text, self.codes.get(code, pb_utils.TritonError.INTERNAL))
        sender.send(pb_utils.InferenceResponse(error=error), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _on_event(self, event):
        """Runs on the engine thread."""
        req, sender = event.request, event.request.tag
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        if self.metrics is not None and event.kind != "token":
            try:
                if event.kind in ("done", "error"):
                    self.metrics.finished(req, ok=event.kind == "done")
                self.metrics.state(self.engine.stats())
            except Exception as exc:  # metrics must never cost a response
                pb_utils.Logger.log_warn(f"{self.name}: metrics not updated: {type(exc).__name__}: {exc}")
        if event.kind == "error":
            self._send_error(sender, event.error, event.code)
        elif not self.decoupled:
            if event.kind == "done":
                sender.send(pb_utils.InferenceResponse(self._outputs(event.tokens, req)), flags=final)
        elif event.kind == "progress":
            sender.send(pb_utils.InferenceResponse(self._outputs([], req)))
        elif event.kind == "token":
            sender.send(pb_utils.InferenceResponse(self._outputs(event.tokens, req)))
        elif event.kind == "done":
            sender.send(flags=final)

    def finalize(self):
        # Within Triton's exit timeout (dash-triton serve gives 20 s): an engine thread that does
        # not end in time (seen rarely in tests under load, in the streaming model; its cause is
        # not known) must not keep the model loaded past it, which makes tritonserver exit 1.
        failed = self.runner.stop(f"{self.name} is shutting down", timeout=FINALIZE_TIMEOUT_S)
        if self.runner.alive:
            pb_utils.Logger.log_warn(
                f"{self.name}: the engine thread did not stop within {FINALIZE_TIMEOUT_S:g} s; "
                "unloading without it (its requests are dropped with the worker)"
            )
        else:
            pb_utils.Logger.log_info(f"{self.name}: engine stopped ({failed} unfinished request(s) failed)")
