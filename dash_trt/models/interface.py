"""The model contract: what serving, export, compare and deploy ask of a model, declared once.

Two parts:

- :class:`ServedModel`, the methods the serving runtime and the generation loop call on any
  model (a DASH decoder, :class:`dash_trt.modeling.DashModel`, or the Qwen2 Dual Chunk Attention
  model): cache allocation, the paged forward, the prefix-cache hooks, the cache-free reference.
- :class:`ModelFamily`, what the tools ask beyond that, for one family of model classes: the
  check prompts (``dash-export``'s check, ``dash-compare``), how an ONNX file is told apart from
  the model, the checks the Triton server would otherwise run only when it loads the model, the
  checkpoint a Triton version folder holds, the backends the family does not run on (with
  why), which checkpoint folders are the family's and the family's own ``dash-export`` program.
  :func:`~dash_trt.models.families.family_of` finds a model's family in
  :data:`dash_trt.models.families.FAMILIES`,
  :func:`~dash_trt.models.families.family_of_checkpoint` a checkpoint's.

A tool asks the family, never the model's class: no module outside :mod:`dash_trt.models`
names a concrete model class.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TextIO, runtime_checkable

import torch

__all__ = [
    "ServedModel",
    "ModelFamily",
    "CheckPrompts",
    "ExportCommand",
    "CUDA_KERNELS",
    "TENSORRT",
    "DOCUMENTS",
]

#: Backend names of :attr:`ModelFamily.unsupported`: the CUDA kernels (``pytorch-cuda`` in
#: dash-compare), a TensorRT engine or ONNX model served by Triton, the document model.
CUDA_KERNELS, TENSORRT, DOCUMENTS = "pytorch-cuda", "tensorrt", "documents"

#: ``(prompts, image features per prompt or None)``.
CheckPrompts = tuple[list[list[int]], "list[torch.Tensor | None] | None"]

#: A family's ``dash-export`` program: ``(args, out, progress, fail, generate) -> exit code``.
#: ``args``: dash-export's parsed arguments; ``out``: the stream of results; ``progress``: the
#: step printer (:class:`dash_trt.export.Progress`: ``step(title)``, ``note(text)``);
#: ``fail(code, message)``: prints the error and returns the exit code
#: (:mod:`dash_trt.export_tools` holds the codes); ``generate``: the serving runtime's
#: :func:`dash_trt.serving.generate.generate`, handed in (the models stand below serving).
ExportCommand = Callable[[Any, TextIO, Any, Callable[[int, str], int], Callable], int]


@runtime_checkable
class ServedModel(Protocol):
    """What the serving runtime (:mod:`dash_trt.serving`) and the generation loop ask of a model."""

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def device(self) -> torch.device: ...

    def allocate_cache(self, *args: Any, **kwargs: Any) -> list: ...

    def forward_paged(self, *args: Any, **kwargs: Any) -> Any: ...

    def prefix_cacheable(self, kv_block_size: int) -> bool: ...

    def prefix_hash_seed(self, prompt_length: int) -> bytes: ...

    def cache_names(self, prefix: str) -> list[str]: ...

    def reference_logits(self, *args: Any, **kwargs: Any) -> torch.Tensor: ...


@dataclass(frozen=True)
class ModelFamily:
    """What the tools ask of one family of model classes (see the module's docstring).

    ``classes``: the model classes of the family (their subclasses too); ``label``: how messages
    name it; ``checkpoint_name``: the file or folder a Triton version folder holds the weights
    in; ``check_prompts(model, seed)``; ``onnx_mismatches(model, path, kv_block_size)``: every way
    a dash-export file is not this model (empty: it is); ``check_contract(model)``: raises what
    the server would find wrong only on loading; ``save(model, path, source)``: write the
    serving checkpoint at ``path`` (``source``: a checkpoint file the user named, copied as it
    is where the family's format allows); ``load(path, *, allow_pickle, model_class)``: the
    model of a checkpoint of the family (``allow_pickle``: whether a pickled checkpoint may be
    unpickled; ``model_class``: the class the user named, None if none); ``unsupported``: backend (:data:`CUDA_KERNELS`,
    :data:`TENSORRT`, :data:`DOCUMENTS`) to the reason the family does not run on it;
    ``claims(config)``: whether a checkpoint folder whose parsed ``config.json`` is ``config`` is
    the family's (None: the family of every checkpoint no other family claims);
    ``export_command``: the family's own ``dash-export`` program (:data:`ExportCommand`; None:
    dash-export's, the DASH decoders')."""

    label: str
    classes: tuple[type, ...]
    checkpoint_name: str
    check_prompts: Callable[[Any, int], CheckPrompts]
    onnx_mismatches: Callable[[Any, str | os.PathLike, int | None], list[str]]
    save: Callable[[Any, str, str | None], None]
    load: Callable[..., Any]
    check_contract: Callable[[Any], None] = lambda model: None
    unsupported: Mapping[str, str] = field(default_factory=dict)
    claims: Callable[[Mapping[str, Any]], bool] | None = None
    export_command: ExportCommand | None = None

    def owns(self, model: Any) -> bool:
        return isinstance(model, self.classes)

    def refuse(self, backends: Sequence[str]) -> str | None:
        """The reason (the first) the family does not run on one of ``backends``, or None."""
        for b in backends:
            if b in self.unsupported:
                return self.unsupported[b]
        return None
