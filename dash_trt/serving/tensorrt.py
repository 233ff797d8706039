"""A TensorRT engine as the serving runtime's backend: the engine runs each step, the runtime
owns the paged KV pool, and every ``present.*`` output is bound to the buffer of its
``past.*`` input, so the plugin writes the cache in place (no copy of the pool per step).

    backend = TensorRTBackend("model.plan", "build/plugins/trt/libdash_trt_plugin.so")
    engine = GenerationEngine(model, EngineConfig(...), backend=backend)   # or PagedRuntime(...)

``model`` there supplies the configuration and the cache layout (its weights are not used:
keep it on the CPU); the caches live on the engine's GPU. The plan must be built by
``dash-build`` from the same export (aliased plugin I/O on: ``present.*`` may then share
``past.*``'s memory, which is what is bound here).

Unverified: this module has never run against a TensorRT runtime. The
binding logic (names, shapes, addresses) is tested against a stand-in of the ``tensorrt``
module (tests/test_trt_runtime.py); the calls are the TensorRT 10 Python API
(``IExecutionContext.set_input_shape``, ``set_tensor_address``, ``execute_async_v3``). Steps
run eagerly (no CUDA graph capture of the engine yet).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..attention.dash.ops import CACHE_FIELDS
from ..attention.dash.paged import DashKVCache
from ..modeling import IMAGE_INPUTS, MODEL_INPUTS
from .backends import ModelStep

__all__ = ["TensorRTNotFound", "TensorRTBackendError", "TensorRTBackend"]

_NP_INT = {"int32": torch.int32, "int64": torch.int64}


class TensorRTNotFound(ImportError):
    """The ``tensorrt`` Python package is not installed."""


class TensorRTBackendError(RuntimeError):
    """The engine does not fit the model, or TensorRT refused a step."""


def check_aliases(aliases: dict[str, str | None] | None, present: list[str]) -> None:
    """The engine's report of its aliased outputs (:func:`dash_trt.build.engine_aliases`) against
    the binding this backend makes, ``present.*`` on its ``past.*`` buffer: an output the engine
    aliases to any other input is an error. An output it reports no alias for (TensorRT copies
    around a plugin's aliased output, or a ``--no-aliasing`` build) is bound in place all the
    same: the plugin writes the cache in place either way."""
    if aliases is None:
        return
    wrong = [(o, aliases[o]) for o in present if aliases.get(o) and aliases[o] != "past." + o[len("present.") :]]
    if wrong:
        o, i = wrong[0]
        raise TensorRTBackendError(
            f"the engine aliases {o} to {i}, not to past.{o[len('present.') :]}: it is not an engine of this "
            "model's export (build it with dash-build)"
        )


class TensorRTBackend:
    """Runs the serving runtime's steps on a TensorRT engine of the exported graph."""

    def __init__(self, engine_path: str, plugin_path: str, *, device: str | torch.device = "cuda"):
        try:
            import tensorrt as trt
        except ImportError:
            raise TensorRTNotFound(
                "TensorRT not found: install the 'tensorrt' Python package (>= 10.8) to run a "
                "plan; the PyTorch runtime (no backend) needs no TensorRT"
            ) from None
        from ..build import load_plugin_library

        self.trt = trt
        self.device = torch.device(device)
        self.logger = trt.Logger(trt.Logger.WARNING)
        problem = load_plugin_library(trt.get_plugin_registry(), str(plugin_path))
        if problem:
            raise TensorRTBackendError(problem)
        with open(engine_path, "rb") as fh:
            data = fh.read()
        self.runtime = trt.Runtime(self.logger)
        self.engine = self.runtime.deserialize_cuda_engine(data)
        if self.engine is None:
            raise TensorRTBackendError(
                f"{engine_path}: TensorRT could not deserialize the engine (built by another "
                f"TensorRT version, or without the DashAttention plugin loaded?)"
            )
        self.context = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        mode = trt.TensorIOMode.INPUT
        self.inputs = [n for n in names if self.engine.get_tensor_mode(n) == mode]
        self.outputs = [n for n in names if self.engine.get_tensor_mode(n) != mode]
        self._index_types: dict[str, torch.dtype] = {}
        for n in self.inputs:
            dt = str(self.engine.get_tensor_dtype(n)).rsplit(".", 1)[-1].lower()
            if dt in _NP_INT:
                self._index_types[n] = _NP_INT[dt]
        self._checked = False

    def _check(self, layers: int) -> None:
        """The engine's interface is the model's: its inputs, one past/present pair per cache."""
        past = [f"past.{i}.{f}" for i in range(layers) for f in CACHE_FIELDS]
        present = [f"present.{i}.{f}" for i in range(layers) for f in CACHE_FIELDS]
        missing = [n for n in (*MODEL_INPUTS, *past) if n not in self.inputs]
        missing += [n for n in ("logits", *present) if n not in self.outputs]
        if missing:
            raise TensorRTBackendError(
                f"the engine does not match the model ({layers} layers): it has no "
                f"{', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''} (build it from "
                f"this model's export with dash-build)"
            )
        from ..build import engine_aliases

        check_aliases(engine_aliases(self.engine), present)
        self._checked = True

    def run(self, step: ModelStep, caches: list[DashKVCache]) -> torch.Tensor:
        """One step: bind every tensor (caches in place) and execute; returns the logits [N, V].
        For an engine of a model that takes image features, ``step.images`` are bound too."""
        if not self._checked:
            self._check(len(caches))
        dev = self.device
        host = step.host
        values = {
            "input_ids": torch.from_numpy(np.ascontiguousarray(step.ids)),
            "coords": torch.from_numpy(np.ascontiguousarray(step.coords)),
            "block_tables": torch.from_numpy(host.block_tables),
            "seq_lens": torch.from_numpy(host.seq_lens),
            "query_start_loc": torch.from_numpy(host.query_start_loc),
            "prompt_lens": torch.from_numpy(host.prompt_lens),
            "logits_indices": torch.from_numpy(np.ascontiguousarray(step.rows)),
        }
        names = list(MODEL_INPUTS)
        if step.images is not None:
            missing = [n for n in IMAGE_INPUTS if n not in self.inputs]
            if missing:
                raise TensorRTBackendError(
                    f"the engine has no {', '.join(missing)} input: it was built from an export "
                    f"of a model without image features"
                )
            values.update(zip(IMAGE_INPUTS, step.images))
            names += IMAGE_INPUTS
        keep = {}
        for name in names:
            t = values[name]
            want = self._index_types.get(name)
            if want is not None and t.dtype != want:
                t = t.to(want)
            keep[name] = t.to(dev).contiguous()
        ctx = self.context
        for name, t in keep.items():
            if not ctx.set_input_shape(name, tuple(t.shape)):
                raise TensorRTBackendError(f"the engine's profile does not allow {name} of shape {tuple(t.shape)}")
            ctx.set_tensor_address(name, t.data_ptr())
        for i, cache in enumerate(caches):
            for f in CACHE_FIELDS:
                t = getattr(cache, f)
                if not ctx.set_input_shape(f"past.{i}.{f}", tuple(t.shape)):
                    raise TensorRTBackendError(
                        f"the engine's profile does not allow past.{i}.{f} of shape "
                        f"{tuple(t.shape)} (a pool of {t.shape[0]} blocks)"
                    )
                # The cache is updated in place: present.* is the past.* buffer.
                ctx.set_tensor_address(f"past.{i}.{f}", t.data_ptr())
                ctx.set_tensor_address(f"present.{i}.{f}", t.data_ptr())
        logits = torch.empty(len(step.rows), step.vocab_size, dtype=torch.float32, device=dev)
        ctx.set_tensor_address("logits", logits.data_ptr())
        stream = torch.cuda.current_stream(dev).cuda_stream if dev.type == "cuda" else 0
        if not ctx.execute_async_v3(stream):
            raise TensorRTBackendError("TensorRT failed to run the step (see the TensorRT log)")
        self._keep = keep  # alive until the stream has used them (the step reads its tokens next)
        return logits

    def describe(self) -> dict[str, Any]:
        return {"inputs": list(self.inputs), "outputs": list(self.outputs)}
