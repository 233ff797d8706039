"""The paged DASH operator as PyTorch custom ops, in two forms:

- ``torch.ops.dash_trt.paged_attention`` (:func:`paged_attention`): **functional, for
  export**. The caches go in and updated copies come out, which is what an ONNX or
  TensorRT graph with caches as inputs and outputs needs.
- ``torch.ops.dash_trt.paged_attention_`` (:func:`paged_attention_inplace`): **in place,
  for serving**. The six caches are declared mutated (``Tensor(a!)``) and written where
  they are; nothing is copied, so a step costs what its tokens cost, not the pool's size.
  It also takes the step's ``max_query_len``. :mod:`dash_trt.serving.runner` runs every model step
  through it.

Why a *functional* op (the cache tensors go in, updated copies come out) when the paged
operator (:func:`dash_trt.attention.dash.paged.paged_dash_attention`) writes the cache in place:
``torch.export`` rewrites a mutating custom op into ``auto_functionalized_v2(...)`` and
the ONNX exporter (torch 2.13, dynamo) has no translation for that wrapper, so export
fails ("Error when translating node %auto_functionalized_v2", measured). A functional
op exports as one node whose outputs are the new caches, which is also what an ONNX or
TensorRT graph with caches as inputs and outputs needs. The price in eager PyTorch is
a copy of the six cache tensors per call; serving code that wants the in-place form
calls :func:`dash_trt.attention.dash.paged.paged_dash_attention` (or the CUDA kernels) directly.

Schema (``T`` new tokens, ``B`` sequences; shapes and layouts as in ``docs/api.md``)::

    dash_trt::paged_attention(
        Tensor q, Tensor k, Tensor v, Tensor iq, Tensor ik, Tensor coords, Tensor head_cls,
        Tensor key_cache, Tensor value_cache, Tensor index_key_cache,
        Tensor image_page_cache, Tensor summary_cache, Tensor summary_pages_cache,
        Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, Tensor prompt_lens,
        *, <one scalar per entry of dash_trt.attention.dash.attributes.OP_ATTRIBUTES>)
      -> (Tensor out, Tensor key_cache, Tensor value_cache, Tensor index_key_cache,
          Tensor image_page_cache, Tensor summary_cache, Tensor summary_pages_cache)

The configuration travels as plain scalars (``int``, ``float``, ``str``, ``int[]``)
generated from :class:`~dash_trt.attention.dash.config.DashConfig` by :mod:`dash_trt.attention.dash.attributes`, the
same table the ONNX node and the TensorRT plugin creator use.

Implementations: a fake (meta) one for tracing (``torch.export``, ``torch.compile``,
the ONNX exporter), and one for CPU and CUDA tensors that clones the caches and runs the
paged PyTorch operator. CUDA kernels plug in through :func:`register_cuda_impl`.

fp8 caches (``kv_cache_dtype="fp8_e4m3"``, :mod:`dash_trt.attention.dash.kv_quant`): the ops'
schema has no ``k_scale``/``v_scale`` inputs (nor has the ONNX node or the TensorRT plugin), so
neither op takes an fp8 cache: both refuse it (:data:`FP8_REFUSAL`). The in-place front end
:func:`paged_attention_inplace` runs the PyTorch paged operator directly for an fp8 cache of CPU
tensors (the reference semantics) and refuses one of CUDA tensors (no kernels for it yet).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

from . import attributes as A
from .paged import BATCH_FIELDS, CACHE_FIELDS, TOKEN_FIELDS, DashBatch, DashKVCache, OperatorCall, paged_dash_attention

__all__ = [
    "OP_NAMESPACE",
    "OP_NAME",
    "CACHE_FIELDS",
    "TENSOR_INPUTS",
    "OUTPUTS",
    "paged_attention",
    "paged_attention_op",
    "paged_attention_inplace",
    "paged_attention_inplace_op",
    "register_cuda_impl",
    "cuda_impls",
]

OP_NAMESPACE = "dash_trt"
OP_NAME = "paged_attention"
QUALNAME = f"{OP_NAMESPACE}::{OP_NAME}"


#: Tensor inputs of the op (and of the ONNX node), in order.
TENSOR_INPUTS = (*TOKEN_FIELDS, *(f"{f}_cache" for f in CACHE_FIELDS), *BATCH_FIELDS)

#: Outputs of the op (and of the ONNX node), in order.
OUTPUTS = ("out", *(f"{f}_cache_out" for f in CACHE_FIELDS))

_SCHEMA = (
    "("
    + ", ".join(f"Tensor {n}" for n in TENSOR_INPUTS)
    + ", *, "
    + A.torch_schema_args()
    + ") -> ("
    + ", ".join("Tensor" for _ in OUTPUTS)
    + ")"
)

torch.library.define(QUALNAME, _SCHEMA)

#: The in-place op: same inputs, the caches mutated, only ``out`` returned.
INPLACE_NAME = OP_NAME + "_"
INPLACE_QUALNAME = f"{OP_NAMESPACE}::{INPLACE_NAME}"
_ALIASES = "abcdef"
_INPLACE_SCHEMA = (
    "("
    + ", ".join(
        f"Tensor({_ALIASES[TENSOR_INPUTS.index(n) - 7]}!) {n}" if n.endswith("_cache") else f"Tensor {n}"
        for n in TENSOR_INPUTS
    )
    + ", *, int max_query_len, "
    + A.torch_schema_args()
    + ") -> Tensor"
)
torch.library.define(INPLACE_QUALNAME, _INPLACE_SCHEMA)


#: Why the ops refuse an fp8 cache.
FP8_REFUSAL = (
    "an fp8 KV cache (kv_cache_dtype='fp8_e4m3') is supported by the PyTorch paged operator only "
    "(dash_trt.attention.dash.paged.paged_dash_attention, or paged_attention_inplace on CPU): the "
    "dash_trt::paged_attention ops, the ONNX node and the TensorRT plugin have no k_scale/v_scale "
    "inputs, and the CUDA kernels do not read fp8 yet"
)


def _refuse_fp8(*caches: torch.Tensor) -> None:
    if any(c.dtype == torch.float8_e4m3fn for c in caches):
        raise NotImplementedError(FP8_REFUSAL)


# --------------------------------------------------------------- CUDA kernel hook
#: The CUDA implementations (functional, in place), or None to run the PyTorch paged
#: operator on CUDA too.
_cuda_impl: Callable[..., tuple[torch.Tensor, ...]] | None = None
_cuda_inplace_impl: Callable[..., torch.Tensor] | None = None


def register_cuda_impl(
    fn: Callable[..., tuple[torch.Tensor, ...]] | None, inplace: Callable[..., torch.Tensor] | None = None
) -> None:
    """Plug the CUDA kernels into the op (``None`` restores the PyTorch fallback).

    ``fn(call)`` receives the op's arguments as a :class:`~dash_trt.attention.dash.paged.OperatorCall` (its
    tensors all on one CUDA device, layouts as in ``docs/api.md``; the decoded
    :class:`~dash_trt.attention.dash.config.DashConfig` and the layer index) and returns ``(out, key, value,
    index_key, image_page, summary, summary_pages)``. The returned caches must be new tensors
    (the op is functional: it may not return or modify its inputs); the usual kernel writes
    into clones.

    ``inplace(call, max_query_len)`` implements the in-place op: it writes the six caches where
    they are and returns ``out``; it must not synchronise the host (the runtime captures it in
    CUDA graphs). Without it, the in-place op runs the PyTorch paged operator on CUDA.

    A C++ binding that registers its own torch ops should use
    ``TORCH_LIBRARY_FRAGMENT(dash_trt, m)`` (this module defines ``dash_trt`` ops from
    Python) and op names other than ``paged_attention`` and ``paged_attention_``.
    """
    global _cuda_impl, _cuda_inplace_impl
    for f in (fn, inplace):
        if f is not None and not callable(f):
            raise TypeError(f"register_cuda_impl expects callables or None, got {type(f).__name__}")
    _cuda_impl = fn
    _cuda_inplace_impl = inplace


# ------------------------------------------------------------------ implementations
def cuda_impls() -> tuple[Callable | None, Callable | None]:
    """The registered CUDA implementations (functional, in place): what
    ``register_cuda_impl(*cuda_impls())`` restores."""
    return _cuda_impl, _cuda_inplace_impl


#: Why the kernel library was not registered at import (None: it was, or it is being tested
#: without it on purpose through register_cuda_impl(None)): the warning's text.
_kernels_missing: str | None = None
_warned_missing = False


def _warn_cuda_without_kernels() -> None:
    """Once per process, loudly: CUDA tensors are running the PyTorch paged operator because
    this installation has no kernel library."""
    global _warned_missing
    if _kernels_missing is None or _warned_missing:
        return
    _warned_missing = True
    import warnings

    warnings.warn(_kernels_missing, RuntimeWarning, stacklevel=4)


@torch.library.register_kernel(QUALNAME, ("cpu", "cuda"))
def _paged_attention_impl(*args: torch.Tensor, **attrs: Any) -> tuple[torch.Tensor, ...]:
    call = _call(args, attrs)
    if call.q.device.type == "cuda" and _cuda_impl is not None:
        return tuple(_cuda_impl(call))
    if call.q.device.type == "cuda":
        _warn_cuda_without_kernels()
    cache = call.cache.clone()
    out = paged_dash_attention(*dataclasses.replace(call, cache=cache).args())
    return (out, *cache.tensors().values())


@torch.library.register_kernel(INPLACE_QUALNAME, ("cpu", "cuda"))
def _paged_attention_inplace_impl(*args: torch.Tensor, max_query_len: int, **attrs: Any) -> torch.Tensor:
    call = _call(args, attrs, max_query_len)
    if call.q.device.type == "cuda" and _cuda_inplace_impl is not None:
        return _cuda_inplace_impl(call, max_query_len)
    if call.q.device.type == "cuda":
        _warn_cuda_without_kernels()
    return paged_dash_attention(*call.args())


@torch.library.register_fake(INPLACE_QUALNAME)
def _paged_attention_inplace_fake(*args: torch.Tensor, max_query_len: int, **attrs: Any) -> torch.Tensor:
    q = args[0]
    _refuse_fp8(*args[7:9])
    if q.dim() != 3:
        raise ValueError(f"{INPLACE_QUALNAME}: q must be [T, H, D], got {q.dim()} dims")
    return torch.empty_like(q)


@torch.library.register_fake(QUALNAME)
def _paged_attention_fake(*args: torch.Tensor, **attrs: Any) -> tuple[torch.Tensor, ...]:
    # Shapes only: the output has q's shape and dtype, each cache keeps its own.
    q, caches = args[0], args[7:13]
    _refuse_fp8(*caches[:2])
    if q.dim() != 3 or len(caches) != len(CACHE_FIELDS):
        raise ValueError(f"{QUALNAME}: q must be [T, H, D], got {q.dim()} dims")
    return (torch.empty_like(q), *(torch.empty_like(c) for c in caches))


# ------------------------------------------------------------------------ front ends
def paged_attention_op() -> torch._ops.OpOverload:
    """``torch.ops.dash_trt.paged_attention.default``."""
    return torch.ops.dash_trt.paged_attention.default


def paged_attention(*args, **kwargs) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Call the functional op with :func:`dash_trt.attention.dash.paged.paged_dash_attention`'s arguments
    (bound by :meth:`~dash_trt.attention.dash.paged.OperatorCall.bind`; the cache may also be its six
    tensors in :data:`CACHE_FIELDS` order); returns ``(out, new_cache_tensors)``: the cache
    returned updated instead of written in place."""
    call = OperatorCall.bind(*args, **kwargs)
    _refuse_fp8(call.cache.key, call.cache.value)
    res = paged_attention_op()(*_flat(call), **A.encode(call.cfg, call.layer_idx))
    return res[0], tuple(res[1:])


def paged_attention_inplace_op() -> torch._ops.OpOverload:
    """``torch.ops.dash_trt.paged_attention_.default``."""
    return torch.ops.dash_trt.paged_attention_.default


def paged_attention_inplace(*args, attrs: Mapping[str, Any] | None = None, **kwargs) -> torch.Tensor:
    """The in-place op with :func:`dash_trt.attention.dash.paged.paged_dash_attention`'s arguments (the
    batch as the step's :class:`~dash_trt.attention.dash.paged.DashBatch`, the same object for every layer):
    writes the new tokens into the cache and returns ``out`` [T, H, D]. ``attrs``
    (``dash_trt.attention.dash.attributes.encode(sp, layer_idx)``) may be passed in to skip encoding the
    config on every call."""
    call = OperatorCall.bind(*args, **kwargs)
    if call.cache.quantized:
        if call.q.device.type != "cpu":
            raise NotImplementedError(FP8_REFUSAL)
        return paged_dash_attention(*call.args())
    most = call.batch.max_query_len if call.batch.max_query_len is not None else call.q.shape[0]
    attrs = attrs if attrs is not None else A.encode(call.cfg, call.layer_idx)
    return paged_attention_inplace_op()(*_flat(call), max_query_len=int(most), **attrs)


def _flat(call: OperatorCall) -> tuple[torch.Tensor, ...]:
    """The op's 17 tensors (:data:`TENSOR_INPUTS` order) of a call."""
    return (*call.token_tensors(), *call.cache.tensors().values(), *call.batch.tensors())


def _call(args: tuple, attrs: Mapping[str, Any], max_query_len: int | None = None) -> OperatorCall:
    """The call of the op's 17 tensors and encoded attributes."""
    cfg, layer_idx = A.decode(attrs)
    tokens, caches, batch = args[:7], args[7:13], args[13:]
    _refuse_fp8(*caches[:2])
    cache = DashKVCache.of(caches, cfg.sparse_block_size)
    return OperatorCall(*tokens, cache, DashBatch(*batch, max_query_len=max_query_len), cfg, layer_idx)


def _register_kernels_if_built() -> None:
    """Eager PyTorch users get the CUDA kernels whenever the kernel library was built
    (``pip install .`` with nvcc); CPU tensors keep the PyTorch paged operator."""
    from . import cuda as _cuda  # no import cycle: cuda does not import ops

    global _kernels_missing
    if _cuda.library_path() is not None:
        register_cuda_impl(_cuda.op_impl, _cuda.op_impl_inplace)
    else:
        _kernels_missing = (
            f"DASH CUDA kernels not found ({_cuda.LIBRARY_NAME} is not in this installation): CUDA tensors run "
            "the PyTorch paged operator, many times slower and not graph-capturable. Install a dash-trt wheel, "
            "or reinstall from source with nvcc on PATH; 'dash-trt info' shows what was found"
        )


_register_kernels_if_built()
