"""What runs the model in a serving step: one interface, three backends.

The runtime (:class:`~dash_trt.serving.runner.PagedRuntime`) plans a step on the host: the
new tokens, their page coordinates, the block tables and lengths (a
:class:`~dash_trt.attention.dash.paged.BatchHost` from the block pool) and the rows whose logits are
wanted. That plan is a :class:`ModelStep`; a backend runs the model on it over the
runtime's caches, written in place, and returns the logits:

    logits = backend.run(step, caches)     # [len(step.rows), vocab] on the runtime's device

- :class:`TorchBackend`: the model in PyTorch, each layer calling the in-place paged op
  (the CUDA kernels on a GPU, the PyTorch paged operator elsewhere). The decode CUDA graphs
  capture its :meth:`TorchBackend.forward`.
- :class:`FunctionalBackend`: a functional ``forward(inputs, caches) -> (logits,
  new_caches)`` (ONNX Runtime in the export check and dash-compare); the new caches replace
  the old ones.
- :class:`~dash_trt.serving.tensorrt.TensorRTBackend`: a TensorRT engine whose ``present.*``
  outputs are bound to the ``past.*`` buffers.

A backend of one's own only needs ``run(step, caches) -> logits``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from ..attention.dash.paged import BatchHost, DashBatch, DashKVCache, assign_flat_cache_tensors, flat_cache_tensors
from ..modeling import IMAGE_INPUTS, MODEL_INPUTS

__all__ = ["ModelStep", "ModelBackend", "TorchBackend", "FunctionalBackend", "ForwardFn"]

#: forward(inputs: dict of MODEL_INPUTS, caches: list) -> (logits [N, V], new caches): a
#: functional backend (the exported graph's interface).
ForwardFn = Callable[[dict, list], tuple[torch.Tensor, Sequence[torch.Tensor]]]


@dataclass
class ModelStep:
    """One step's inputs, on the host (the exported graph's inputs, in its order)."""

    ids: np.ndarray  #: [T] int64: the new tokens of every sequence, in plan order
    coords: np.ndarray  #: [T, 4] int32: their page coordinates
    host: BatchHost  #: block tables, lengths, query starts, prompt lengths
    rows: np.ndarray  #: [R] int64: the rows of ``ids`` whose logits are returned
    max_query_len: int  #: the most new tokens of one sequence
    vocab_size: int  #: the logits' width
    #: ``(image_features [M, F], image_feature_index [T])`` on the device, for models that
    #: take image features (None otherwise)
    images: tuple[torch.Tensor, torch.Tensor] | None = None


class ModelBackend(Protocol):
    def run(self, step: ModelStep, caches: list[DashKVCache]) -> torch.Tensor:
        """Run the model on ``step``, writing ``caches`` in place; the logits [R, vocab]."""
        ...


class TorchBackend:
    """The model in PyTorch on ``device`` (its own)."""

    def __init__(self, model, device: torch.device):
        self.model = model
        self.device = device

    def run(self, step: ModelStep, caches: list[DashKVCache]) -> torch.Tensor:
        t = step.ids.shape[0]
        # The step's token inputs in one host-to-device copy.
        packed = np.concatenate([step.ids.astype(np.int32), step.coords.ravel(), step.rows.astype(np.int32)])
        packed_t = torch.from_numpy(packed)
        if self.device.type != "cpu":
            packed_t = packed_t.pin_memory().to(self.device, non_blocking=True)
        batch = DashBatch.from_host(step.host, self.device, max_query_len=step.max_query_len)
        return self.forward(packed_t[:t], packed_t[t : 5 * t].view(t, 4), batch, caches, packed_t[5 * t :], step.images)

    def forward(self, ids, coords, batch: DashBatch, caches, rows, images=None) -> torch.Tensor:
        """The model over device tensors (what a decode CUDA graph captures)."""
        with torch.no_grad():
            return self.model.forward_paged(ids, coords, batch, caches, rows, *(images or ()))


class FunctionalBackend:
    """A functional ``forward`` (:data:`ForwardFn`) on ``device``: it takes the caches and
    returns new ones, which replace the runtime's."""

    def __init__(self, forward: ForwardFn, device: torch.device):
        self.forward = forward
        self.device = device

    def run(self, step: ModelStep, caches: list[DashKVCache]) -> torch.Tensor:
        dev = self.device
        batch = DashBatch.from_host(step.host, dev, max_query_len=step.max_query_len)
        values = [
            torch.from_numpy(step.ids).to(dev),
            torch.from_numpy(np.ascontiguousarray(step.coords)).to(dev),
            *batch.tensors(),
            torch.from_numpy(step.rows).to(device=dev, dtype=torch.long),
        ]
        inputs = dict(zip(MODEL_INPUTS, values))
        if step.images is not None:
            inputs.update(zip(IMAGE_INPUTS, step.images))
        logits, new = self.forward(inputs, flat_cache_tensors(caches))
        assign_flat_cache_tensors(caches, list(new))
        return logits
