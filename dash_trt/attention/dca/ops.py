"""Paged Dual Chunk Attention as PyTorch custom ops, in the two forms of :mod:`dash_trt.attention.dash.ops`:

- ``torch.ops.dash_trt.dual_chunk_attention`` (:func:`dual_chunk_attention_functional`):
  **functional, for export**. The two caches go in and updated copies come out (what an ONNX or
  TensorRT graph with caches as inputs and outputs needs; ``torch.export`` cannot hand a mutating
  custom op to the ONNX exporter, see :mod:`dash_trt.attention.dash.ops`).
- ``torch.ops.dash_trt.dual_chunk_attention_`` (:func:`dual_chunk_attention_inplace`): **in
  place, for serving**. The two caches are declared mutated (``Tensor(a!)``, ``Tensor(b!)``)
  and written where they are; only ``out`` is returned.

Both delegate to :func:`dash_trt.attention.dca.paged.paged_dual_chunk_attention` (docs/dca.md, "The paged form"), which
checks every input before writing anything; the functional form runs it on clones of the caches.

Schema (``T`` new tokens, ``B`` sequences; shapes as in docs/dca.md, "The paged form")::

    dash_trt::dual_chunk_attention(
        Tensor q, Tensor k, Tensor v, Tensor key_cache, Tensor value_cache,
        Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, Tensor prompt_lens,
        *, int chunk_size, int local_size, int original_max_position_embeddings,
        float rope_theta, int rotary_dim, float softmax_scale)
      -> (Tensor out, Tensor key_cache_out, Tensor value_cache_out)

    dash_trt::dual_chunk_attention_(
        <the same, key_cache as Tensor(a!) and value_cache as Tensor(b!)>) -> Tensor out

The configuration travels as scalars (:func:`encode` / :func:`decode`, :data:`ATTRIBUTES`), the
same names the ONNX node ``dash_trt.DualChunkAttention`` (:mod:`dash_trt.attention.dca.onnx`) carries as
attributes. Two sentinels: ``rotary_dim`` 0 means the head dim, ``softmax_scale`` 0.0 means
``head_dim ** -0.5``. ``prompt_lens`` is always a tensor: -1 for a sequence without one (allowed
only while the length scaling is off, ``original_max_position_embeddings`` 0).

Implementations: one for CPU and CUDA tensors (the PyTorch paged operator; on CUDA tensors the
Triton kernels of :mod:`dash_trt.attention.dca.kernels` where Triton is importable and the
dtype and head dim are theirs) and a fake (meta) one for tracing. :func:`register` defines and
registers everything once; it runs at import and does nothing when the ops already exist.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from . import kernels
from .paged import DcaKVCache, paged_dual_chunk_attention
from .reference import DcaConfig

__all__ = [
    "OP_NAMESPACE",
    "OP_NAME",
    "INPLACE_NAME",
    "TENSOR_INPUTS",
    "OUTPUTS",
    "ATTRIBUTES",
    "DcaAttributes",
    "encode",
    "decode",
    "register",
    "dual_chunk_attention_op",
    "dual_chunk_attention_inplace_op",
    "dual_chunk_attention_functional",
    "dual_chunk_attention_inplace",
]

OP_NAMESPACE = "dash_trt"
OP_NAME = "dual_chunk_attention"
QUALNAME = f"{OP_NAMESPACE}::{OP_NAME}"
INPLACE_NAME = OP_NAME + "_"
INPLACE_QUALNAME = f"{OP_NAMESPACE}::{INPLACE_NAME}"

#: Tensor inputs of the ops (and of the ONNX node), in order.
TENSOR_INPUTS = (
    "q",
    "k",
    "v",
    "key_cache",
    "value_cache",
    "block_tables",
    "seq_lens",
    "query_start_loc",
    "prompt_lens",
)
#: Outputs of the functional op (and of the ONNX node), in order.
OUTPUTS = ("out", "key_cache_out", "value_cache_out")

#: The scalar arguments: (name, torch schema type, ONNX attribute type, meaning).
ATTRIBUTES = (
    ("chunk_size", "int", "INT", "dual_chunk_attention_config.chunk_size (C)"),
    ("local_size", "int", "INT", "dual_chunk_attention_config.local_size (W); chunk length c = C - W"),
    (
        "original_max_position_embeddings",
        "int",
        "INT",
        "length scaling s(L) = max(1, 0.1 ln(L / this) + 1); 0 turns it off",
    ),
    ("rope_theta", "float", "FLOAT", "RoPE base"),
    ("rotary_dim", "int", "INT", "dims rotated (neox style, the first rotary_dim); 0 = head_dim"),
    ("softmax_scale", "float", "FLOAT", "logit scale; 0.0 = head_dim ** -0.5"),
)
ATTRIBUTE_NAMES = tuple(a[0] for a in ATTRIBUTES)

_SCALARS = ", ".join(f"{t} {n}" for n, t, _, _ in ATTRIBUTES)
_SCHEMA = "(" + ", ".join(f"Tensor {n}" for n in TENSOR_INPUTS) + ", *, " + _SCALARS + ") -> (Tensor, Tensor, Tensor)"
_MUTATED = {"key_cache": "a", "value_cache": "b"}
_INPLACE_SCHEMA = (
    "("
    + ", ".join(f"Tensor({_MUTATED[n]}!) {n}" if n in _MUTATED else f"Tensor {n}" for n in TENSOR_INPUTS)
    + ", *, "
    + _SCALARS
    + ") -> Tensor"
)


class DcaAttributes(NamedTuple):
    """The decoded scalars: the config and the keyword arguments of the paged operator."""

    cfg: DcaConfig
    rope_theta: float
    rotary_dim: int | None
    softmax_scale: float | None


def encode(
    cfg: DcaConfig, *, rope_theta: float = 10000.0, rotary_dim: int | None = None, softmax_scale: float | None = None
) -> dict[str, Any]:
    """The ops' scalar arguments (and the ONNX node's attributes) of a call; ``None`` becomes
    the sentinel 0. Values are checked by the paged operator when the op runs."""
    if not isinstance(cfg, DcaConfig):
        raise TypeError(f"cfg must be a DcaConfig, got {type(cfg).__name__}")
    return {
        "chunk_size": cfg.chunk_size,
        "local_size": cfg.local_size,
        "original_max_position_embeddings": cfg.original_max_position_embeddings,
        "rope_theta": float(rope_theta),
        "rotary_dim": 0 if rotary_dim is None else rotary_dim,
        "softmax_scale": 0.0 if softmax_scale is None else float(softmax_scale),
    }


def decode(attrs: dict[str, Any]) -> DcaAttributes:
    """:func:`encode`'s inverse (builds and so validates the :class:`DcaConfig`)."""
    missing = [n for n in ATTRIBUTE_NAMES if n not in attrs]
    if missing:
        raise ValueError(f"missing Dual Chunk Attention attribute(s): {', '.join(missing)}")
    cfg = DcaConfig(attrs["chunk_size"], attrs["local_size"], attrs["original_max_position_embeddings"])
    rd = attrs["rotary_dim"]
    sm = attrs["softmax_scale"]
    return DcaAttributes(cfg, attrs["rope_theta"], None if rd == 0 else rd, None if sm == 0.0 else sm)


def _run(args: tuple, attrs: dict[str, Any], cache: DcaKVCache) -> torch.Tensor:
    q, k, v, _, _, block_tables, seq_lens, query_start_loc, prompt_lens = args
    d = decode(attrs)
    if q.is_cuda and kernels.available() and q.dtype in kernels.DTYPES and kernels.head_dim_ok(q.shape[-1]):
        # the Triton kernels (same function; a decode batch splits its keys across the GPU)
        new = query_start_loc.diff()
        one_each = bool((new == 1).all()) and new.numel() > 0
        splits = kernels.decode_splits(new.numel(), k.shape[1], int(seq_lens.max())) if one_each else 1
        return kernels.paged_dca(
            q, k, v, cache, block_tables, seq_lens, query_start_loc, d.cfg, rope_theta=d.rope_theta,
            rotary_dim=d.rotary_dim, prompt_lens=prompt_lens, softmax_scale=d.softmax_scale, decode=one_each,
            splits=splits,
        )  # fmt: skip
    return paged_dual_chunk_attention(
        q,
        k,
        v,
        cache,
        block_tables,
        seq_lens,
        query_start_loc,
        d.cfg,
        rope_theta=d.rope_theta,
        rotary_dim=d.rotary_dim,
        prompt_lens=prompt_lens,
        softmax_scale=d.softmax_scale,
    )


def _functional_impl(*args: torch.Tensor, **attrs: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cache = DcaKVCache(key=args[3].clone(), value=args[4].clone())
    out = _run(args, attrs, cache)
    return out, cache.key, cache.value


def _inplace_impl(*args: torch.Tensor, **attrs: Any) -> torch.Tensor:
    return _run(args, attrs, DcaKVCache(key=args[3], value=args[4]))


def _check_fake(qualname: str, args: tuple) -> None:
    q, k, key_cache, value_cache = args[0], args[1], args[3], args[4]
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"{qualname}: q and k must be [T, heads, D], got {q.dim()} and {k.dim()} dims")
    if key_cache.dim() != 4 or value_cache.shape != key_cache.shape:
        raise ValueError(f"{qualname}: the caches must be [num_blocks, block_size, Hkv, D] of one shape")


def _functional_fake(*args: torch.Tensor, **attrs: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_fake(QUALNAME, args)
    return torch.empty_like(args[0]), torch.empty_like(args[3]), torch.empty_like(args[4])


def _inplace_fake(*args: torch.Tensor, **attrs: Any) -> torch.Tensor:
    _check_fake(INPLACE_QUALNAME, args)
    return torch.empty_like(args[0])


def _defined(name: str) -> bool:
    return hasattr(getattr(torch.ops, OP_NAMESPACE), name)


def register() -> None:
    """Define both ops and register their implementations and fakes; idempotent (a second call,
    or an op already defined in this process, changes nothing)."""
    for qualname, name, schema, impl, fake in (
        (QUALNAME, OP_NAME, _SCHEMA, _functional_impl, _functional_fake),
        (INPLACE_QUALNAME, INPLACE_NAME, _INPLACE_SCHEMA, _inplace_impl, _inplace_fake),
    ):
        if _defined(name):
            continue
        torch.library.define(qualname, schema)
        torch.library.register_kernel(qualname, ("cpu", "cuda"), impl)
        torch.library.register_fake(qualname, fake)


register()


# ------------------------------------------------------------------------ front ends
def dual_chunk_attention_op() -> torch._ops.OpOverload:
    """``torch.ops.dash_trt.dual_chunk_attention.default`` (functional)."""
    return torch.ops.dash_trt.dual_chunk_attention.default


def dual_chunk_attention_inplace_op() -> torch._ops.OpOverload:
    """``torch.ops.dash_trt.dual_chunk_attention_.default`` (in place)."""
    return torch.ops.dash_trt.dual_chunk_attention_.default


def _tensors(q, k, v, cache, block_tables, seq_lens, query_start_loc, prompt_lens):
    if not isinstance(cache, DcaKVCache):
        key, value = cache
        cache = DcaKVCache(key=key, value=value)
    if prompt_lens is None:
        prompt_lens = torch.full_like(seq_lens, -1)
    return (q, k, v, cache.key, cache.value, block_tables, seq_lens, query_start_loc, prompt_lens)


def dual_chunk_attention_functional(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: DcaKVCache | tuple[torch.Tensor, torch.Tensor],
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    cfg: DcaConfig,
    *,
    rope_theta: float = 10000.0,
    rotary_dim: int | None = None,
    prompt_lens: torch.Tensor | None = None,
    softmax_scale: float | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """The functional op with :func:`~dash_trt.attention.dca.paged.paged_dual_chunk_attention`'s
    arguments (the cache a :class:`DcaKVCache` or its ``(key, value)``); returns ``(out,
    (key_cache, value_cache))``, the caches updated copies, the inputs untouched."""
    args = _tensors(q, k, v, cache, block_tables, seq_lens, query_start_loc, prompt_lens)
    attrs = encode(cfg, rope_theta=rope_theta, rotary_dim=rotary_dim, softmax_scale=softmax_scale)
    out, key, value = dual_chunk_attention_op()(*args, **attrs)
    return out, (key, value)


def dual_chunk_attention_inplace(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: DcaKVCache | tuple[torch.Tensor, torch.Tensor],
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    cfg: DcaConfig,
    *,
    rope_theta: float = 10000.0,
    rotary_dim: int | None = None,
    prompt_lens: torch.Tensor | None = None,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """The in-place op with the paged operator's arguments: writes the new tokens into the
    cache where it is and returns ``out`` [T, H, D]."""
    args = _tensors(q, k, v, cache, block_tables, seq_lens, query_start_loc, prompt_lens)
    attrs = encode(cfg, rope_theta=rope_theta, rotary_dim=rotary_dim, softmax_scale=softmax_scale)
    return dual_chunk_attention_inplace_op()(*args, **attrs)
