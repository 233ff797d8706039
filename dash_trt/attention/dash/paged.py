"""The paged-KV form of DASH attention: the contract every kernel and the plugin
implement.

Layout (per layer), for ``num_blocks`` KV blocks of ``block_size`` tokens:

====================  ==========================================  ==============
tensor                shape                                       dtype
====================  ==========================================  ==============
``key``               [num_blocks, block_size, Hkv, D]            q dtype or fp8
``value``             [num_blocks, block_size, Hkv, D]            q dtype or fp8
``index_key``         [num_blocks, block_size, Di]                q dtype
``image_page``        [num_blocks, block_size]                    int32
``summary``           [num_blocks, summaries_per_block, Di]       float32
``summary_pages``     [num_blocks, summaries_per_block, 3]        int32
====================  ==========================================  ==============

``key`` and ``index_key`` hold keys *after* page RoPE (index keys also with
non-finite values zeroed), so nothing is rotated twice. ``image_page`` is each
token's image page (-1 for non-image tokens).

An fp8 cache (``kv_cache_dtype="fp8_e4m3"``) stores ``key`` and ``value`` as
``torch.float8_e4m3fn`` with per-KV-head float32 scales ``k_scale`` and ``v_scale`` [Hkv]
(fields of :class:`DashKVCache`, not among the six tensors): written as
``e4m3(clamp(x / scale, -448, 448))``, read as ``x8 * scale`` in q's dtype
(:mod:`~dash_trt.attention.dash.kv_quant`). The other four tensors keep their dtypes.

A *sparse block* (the routing unit, ``sparse_block_size`` tokens) is summarised
once, when its last token is written; summaries of complete blocks never change,
so decode reads one summary per block instead of every index key. The summary of
sparse block ``b`` of a sequence lives in the KV block holding its first token,
``block_table[(b * sbs) // block_size]``, at sub-slot
``((b * sbs) % block_size) // sbs``; ``summaries_per_block = ceil(block_size /
sbs)``. This works for any KV block size; the CUDA kernels accept only KV blocks
that are whole multiples of the sparse block. ``summary_pages`` holds, per sparse
block, the lowest and highest image page among its tokens (-1, -1 if none) and a
flag that is 1 when every page between them has an image token in the block; the
rare block where that flag is 0 is resolved from ``image_page``.

Batch metadata (vLLM-style, one row per sequence, ``B`` sequences, ``T`` new
tokens in total):

- ``block_tables`` [B, W] int32: physical KV block of each logical block, -1 pad;
- ``seq_lens`` [B] int32: tokens of each sequence *after* this call;
- ``query_start_loc`` [B+1] int32: new tokens of sequence ``i`` are rows
  ``query_start_loc[i]:query_start_loc[i+1]`` of q/k/v/iq/ik/coords, and are its
  last ``n_i`` positions;
- ``prompt_lens`` [B] int32: the ``prompt_length`` of each sequence, -1 for none.
  It must not change over a sequence's life (summaries are taken once).

``coords`` [T, 4] int32/int64 carries each new token's page coordinates, columns
:data:`COORD_TOK`, :data:`COORD_PAGE`, :data:`COORD_IMAGE_PAGE`,
:data:`COORD_QUERY_PAGE`: the four outputs of
:func:`dash_trt.attention.dash.reference.page_coordinates` for the whole sequence (see
:func:`sequence_coords`). With them, the output for every token equals
``dash_attention`` on the sequence's contiguous history (docs/spec.md, property 6).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .config import DashConfig, as_config
from .kv_quant import (
    FP8_DTYPE,
    check_scale,
    dequantize_fp8,
    is_fp8,
    kv_cache_dtype_name,
    kv_storage_dtype,
    quantize_fp8,
)
from .reference import (
    FLOAT_DTYPES,
    ROLE_IMAGE,
    ROLE_PAGE,
    Routing,
    block_summaries,
    check_heads,
    check_shape,
    page_coordinates,
    page_rope,
    query_chunk_size,
    route_chunk,
    routed_width,
    routing_rows,
    sparse_attend,
    stack_routing,
)

__all__ = [
    "COORD_TOK",
    "COORD_PAGE",
    "COORD_IMAGE_PAGE",
    "COORD_QUERY_PAGE",
    "NUM_COORDS",
    "DashKVCache",
    "CACHE_FIELDS",
    "DashBatch",
    "BatchHost",
    "BATCH_FIELDS",
    "PageCoordState",
    "TextCoordState",
    "flat_cache_tensors",
    "assign_flat_cache_tensors",
    "sequence_coords",
    "slot_mapping",
    "paged_dash_attention",
    "check_paged_inputs",
    "OperatorCall",
    "TOKEN_FIELDS",
    "OPERATOR_ARGS",
]

#: Columns of ``coords``.
COORD_TOK, COORD_PAGE, COORD_IMAGE_PAGE, COORD_QUERY_PAGE = 0, 1, 2, 3
NUM_COORDS = 4
#: Columns of ``summary_pages``.
PAGE_LO, PAGE_HI, PAGE_DENSE = 0, 1, 2

INDEX_DTYPES = (torch.int32, torch.int64)


def sequence_coords(roles: torch.Tensor) -> torch.Tensor:
    """``coords`` [S, 4] int32 for a whole sequence from its roles [S]."""
    return torch.stack(page_coordinates(roles), -1).to(torch.int32)


class TextCoordState:
    """The coordinates of a model without document pages (a text decoder such as
    :mod:`dash_trt.models.qwen2_dca`): every token is text at its position, on no page. The
    same interface as :class:`PageCoordState`, so the serving runtime keeps one kind of state."""

    __slots__ = ("_i",)

    def __init__(self, i: int):
        self._i = int(i)

    @classmethod
    def from_length(cls, n: int) -> tuple[TextCoordState, torch.Tensor]:
        """The state after a prompt of ``n`` tokens and its coords [n, 4] int32."""
        coords = torch.zeros(n, NUM_COORDS, dtype=torch.int32)
        coords[:, COORD_TOK] = torch.arange(n, dtype=torch.int32)
        coords[:, COORD_IMAGE_PAGE] = coords[:, COORD_QUERY_PAGE] = -1
        return cls(n), coords

    def next(self, role: int) -> tuple[int, int, int, int]:
        i = self._i
        self._i += 1
        return (i, 0, -1, -1)


class PageCoordState:
    """Page coordinates of a growing sequence, one new token at a time in O(1).

    :func:`sequence_coords` needs the whole sequence (the prompt's last image token splits
    it into prompt and response). Generated tokens are never image tokens, so once the
    prompt is known the coordinates of every later token follow from a few counters:
    ``next(role)`` returns the row ``sequence_coords(roles + [role])[-1]`` would give,
    without recomputing the sequence. ``from_prompt`` also returns the prompt's own rows.
    """

    __slots__ = ("_i", "_cum", "_pages", "_counts", "_prev_page", "_run_start", "_last_marker")

    def __init__(
        self,
        i: int,
        cum: int,
        num_pages: int,
        prompt_counts: list[int],
        prev_page: int,
        run_start: int,
        last_marker: int,
    ):
        self._i, self._cum, self._pages, self._counts = i, cum, num_pages, prompt_counts
        self._prev_page, self._run_start, self._last_marker = prev_page, run_start, last_marker

    @classmethod
    def from_prompt(cls, roles: torch.Tensor) -> tuple[PageCoordState, torch.Tensor]:
        """The state after ``roles`` (a whole prompt, [S]) and its coords [S, 4] int32."""
        coords = sequence_coords(roles)  # validates the prompt (pages, image tokens)
        r = roles.long().cpu()
        n = int(r.numel())
        ar = torch.arange(n)
        last_image = int(torch.where(r == ROLE_IMAGE, ar, -1).max())
        marker = r == ROLE_PAGE
        cum = int(marker.sum())
        num_pages = int(marker[: last_image + 1].sum())
        page = coords[:, COORD_PAGE].long()
        counts = torch.bincount(page[: last_image + 1], minlength=num_pages + 1).tolist()
        changes = torch.nonzero(page[1:] != page[:-1]).flatten()
        run_start = int(changes[-1]) + 1 if changes.numel() else 0
        late = torch.nonzero(marker & (ar > last_image)).flatten()
        last_marker = int(late[-1]) if late.numel() else 0
        return cls(n, cum, num_pages, counts, int(page[-1]), run_start, last_marker), coords

    def next(self, role: int) -> tuple[int, int, int, int]:
        """Coordinates (tok, page, image_page, query_page) of the next token, whose role is
        text (0) or ``<PAGE>`` (2); advances the state."""
        if role == ROLE_IMAGE:
            raise ValueError(
                "an image token after the prompt: its position would move the prompt/response "
                "boundary of the whole sequence (generated tokens are never image tokens)"
            )
        i = self._i
        if role == ROLE_PAGE:
            self._cum += 1
            self._last_marker = i
        raw = max(self._cum - self._pages, 0)
        page = min(raw, self._pages)
        if page != self._prev_page:
            self._run_start = i
        base = self._counts[page]
        tok = base + (i - self._last_marker if raw > self._pages else i - self._run_start)
        self._prev_page, self._i = page, i + 1
        return tok, page, -1, self._cum - self._pages - 1


# ------------------------------------------------------------------------ the cache
#: The six cache tensors, in operator argument order (``DashKVCache`` field names; the kernels'
#: ``<name>_cache`` fields and the ONNX node's ``<name>_cache`` inputs).
CACHE_FIELDS = ("key", "value", "index_key", "image_page", "summary", "summary_pages")


@dataclass
class DashKVCache:
    """One layer's paged DASH cache (see the module docstring for the layout).

    ``k_scale`` and ``v_scale`` ([Hkv] float32) belong to an fp8 cache only (``key`` and
    ``value`` of dtype ``torch.float8_e4m3fn``): the per-KV-head scales its keys and values are
    stored with. A cache in the model dtype has none."""

    key: torch.Tensor
    value: torch.Tensor
    index_key: torch.Tensor
    image_page: torch.Tensor
    summary: torch.Tensor
    summary_pages: torch.Tensor
    sparse_block_size: int
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @classmethod
    def allocate(
        cls,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        index_dim: int,
        sparse_block_size: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        kv_cache_dtype: str | torch.dtype | None = None,
        k_scale: float | torch.Tensor | None = None,
        v_scale: float | torch.Tensor | None = None,
    ) -> DashKVCache:
        """A zeroed cache. ``dtype`` is the model's (index keys, and keys and values unless
        quantised); ``kv_cache_dtype`` ("auto" = None, "fp8_e4m3"/"fp8", or
        ``torch.float8_e4m3fn``) picks the storage of keys and values. An fp8 cache takes
        ``k_scale`` and ``v_scale`` (a number for every KV head, or a tensor [Hkv]; default 1.0,
        vLLM's default without calibrated scales)."""
        for name, val in (
            ("num_blocks", num_blocks),
            ("block_size", block_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("index_dim", index_dim),
            ("sparse_block_size", sparse_block_size),
        ):
            if int(val) <= 0:
                raise ValueError(f"{name} must be positive, got {val}")
        if dtype not in FLOAT_DTYPES:
            raise ValueError(f"cache dtype must be one of {FLOAT_DTYPES}, got {dtype}")
        kv_dtype = kv_storage_dtype(kv_cache_dtype, dtype)
        scales = {}
        if is_fp8(kv_dtype):
            for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
                s = 1.0 if s is None else s
                if not isinstance(s, torch.Tensor):
                    s = torch.full((num_kv_heads,), float(s))
                scales[name] = s.to(device=device, dtype=torch.float32)
                check_scale(name, scales[name], num_kv_heads)
        elif k_scale is not None or v_scale is not None:
            raise ValueError(
                f"k_scale and v_scale belong to an fp8 cache (kv_cache_dtype='fp8_e4m3'), not a {kv_dtype} one"
            )
        per = summaries_per_block(block_size, sparse_block_size)
        return cls(
            key=torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=kv_dtype, device=device),
            value=torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=kv_dtype, device=device),
            index_key=torch.zeros(num_blocks, block_size, index_dim, dtype=dtype, device=device),
            image_page=torch.full((num_blocks, block_size), -1, dtype=torch.int32, device=device),
            summary=torch.zeros(num_blocks, per, index_dim, dtype=torch.float32, device=device),
            summary_pages=torch.full((num_blocks, per, 3), -1, dtype=torch.int32, device=device),
            sparse_block_size=int(sparse_block_size),
            **scales,
        )

    @classmethod
    def of(
        cls,
        tensors: Sequence[torch.Tensor],
        sparse_block_size: int,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> DashKVCache:
        """A cache of its six tensors in :data:`CACHE_FIELDS` order (and an fp8 cache's scales)."""
        tensors = tuple(tensors)
        if len(tensors) != len(CACHE_FIELDS):
            raise ValueError(
                f"a cache holds {len(CACHE_FIELDS)} tensors ({', '.join(CACHE_FIELDS)}), got {len(tensors)}"
            )
        return cls(
            **dict(zip(CACHE_FIELDS, tensors)),
            sparse_block_size=int(sparse_block_size),
            k_scale=k_scale,
            v_scale=v_scale,
        )

    @property
    def num_blocks(self) -> int:
        return self.key.shape[0]

    @property
    def block_size(self) -> int:
        return self.key.shape[1]

    @property
    def quantized(self) -> bool:
        """Whether keys and values are stored in fp8 (e4m3) with per-head scales."""
        return is_fp8(self.key.dtype)

    @property
    def kv_cache_dtype(self) -> str:
        """``"fp8_e4m3"`` for an fp8 cache, ``"auto"`` (the model dtype) otherwise."""
        return kv_cache_dtype_name(self.key.dtype)

    @property
    def model_dtype(self) -> torch.dtype:
        """The dtype the operator computes in and reads keys and values as (q's)."""
        return self.index_key.dtype

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f: getattr(self, f) for f in CACHE_FIELDS}

    def clone(self) -> DashKVCache:
        scales = {n: getattr(self, n) for n in ("k_scale", "v_scale") if getattr(self, n) is not None}
        return DashKVCache(
            **{k: v.clone() for k, v in self.tensors().items()},
            sparse_block_size=self.sparse_block_size,
            **{n: s.clone() for n, s in scales.items()},
        )

    def write_kv(self, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store rotated keys and values [T, Hkv, D] (q's dtype) at flat ``slots`` [T]: as they
        are, or quantised to fp8 with the cache's scales."""
        k_flat = self.key.view(-1, *self.key.shape[2:])
        v_flat = self.value.view(-1, *self.value.shape[2:])
        if self.quantized:
            k_flat[slots] = quantize_fp8(key, self.k_scale)
            v_flat[slots] = quantize_fp8(value, self.v_scale)
        else:
            k_flat[slots] = key
            v_flat[slots] = value

    def read_kv(self, flat: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at flat slots ``flat`` [...] as [..., Hkv, D]: as stored, or
        dequantised (``x8 * scale``) to ``dtype``."""
        keys = self.key.view(-1, *self.key.shape[2:])[flat]
        values = self.value.view(-1, *self.value.shape[2:])[flat]
        if self.quantized:
            return dequantize_fp8(keys, self.k_scale, dtype), dequantize_fp8(values, self.v_scale, dtype)
        return keys, values

    def validate(self) -> None:
        """Check the six tensors agree with each other (shapes, dtypes, device), and an fp8
        cache's scales."""
        nb, bsz = self.key.shape[:2]
        if self.quantized:
            check_shape("cache.key", self.key, (nb, bsz, None, None), (FP8_DTYPE,))
            check_scale("cache.k_scale", self.k_scale, self.key.shape[2])
            check_scale("cache.v_scale", self.v_scale, self.key.shape[2])
            model_dtypes = FLOAT_DTYPES
        else:
            check_shape("cache.key", self.key, (nb, bsz, None, None), FLOAT_DTYPES)
            if self.k_scale is not None or self.v_scale is not None:
                raise ValueError(f"cache has k_scale/v_scale but stores keys in {self.key.dtype}: scales are for fp8")
            model_dtypes = (self.key.dtype,)
        hkv, d = self.key.shape[2:]
        check_shape("cache.value", self.value, (nb, bsz, hkv, d), (self.key.dtype,))
        check_shape("cache.index_key", self.index_key, (nb, bsz, None), model_dtypes)
        di = self.index_key.shape[2]
        per = summaries_per_block(bsz, self.sparse_block_size)
        check_shape("cache.image_page", self.image_page, (nb, bsz), (torch.int32,))
        check_shape("cache.summary", self.summary, (nb, per, di), (torch.float32,))
        check_shape("cache.summary_pages", self.summary_pages, (nb, per, 3), (torch.int32,))
        devices = {t.device for t in self.tensors().values()}
        devices |= {s.device for s in (self.k_scale, self.v_scale) if s is not None}
        if len(devices) != 1:
            raise ValueError(f"cache tensors live on different devices: {sorted(map(str, devices))}")


def flat_cache_tensors(caches: Sequence[DashKVCache]) -> list[torch.Tensor]:
    """Every layer's cache tensors (a :class:`DashKVCache`'s six, or any cache with a
    ``tensors()`` dict), flat, ``(layer, field)`` order: the exported graph's ``past.*`` inputs."""
    return [t for c in caches for t in c.tensors().values()]


def assign_flat_cache_tensors(caches: Sequence[DashKVCache], tensors: Sequence[torch.Tensor]) -> None:
    """Put ``tensors`` (:func:`flat_cache_tensors` order; a functional step's ``present.*``) into
    ``caches``."""
    names = [list(c.tensors()) for c in caches]
    if len(tensors) != sum(map(len, names)):
        raise ValueError(f"expected {sum(map(len, names))} cache tensors, got {len(tensors)}")
    values = iter(tensors)
    for c, fields_ in zip(caches, names):
        for name in fields_:
            setattr(c, name, next(values))


def summaries_per_block(block_size: int, sparse_block_size: int) -> int:
    return -(-int(block_size) // int(sparse_block_size))


# ---------------------------------------------------------------------- batch state
#: The batch metadata tensors of one call, in op argument order (every list of them derives
#: from this tuple).
BATCH_FIELDS = ("block_tables", "seq_lens", "query_start_loc", "prompt_lens")


@dataclass
class BatchHost:
    """Host (numpy) copies of a :class:`DashBatch`'s metadata: what the host needs during a
    step (row ranges, lengths) without reading the device."""

    block_tables: np.ndarray  #: [B, W] int32
    seq_lens: np.ndarray  #: [B] int32
    query_start_loc: np.ndarray  #: [B+1] int32
    prompt_lens: np.ndarray  #: [B] int32


@dataclass
class DashBatch:
    """Metadata of one call (see the module docstring): the plan of one step, built once by
    :meth:`dash_trt.serving.block_pool.KVBlockPool.schedule` and handed unchanged to every layer.

    ``max_query_len`` is the most new tokens of any one sequence (vLLM's name; 1 for a
    decode-only step, which lets the kernels fold the cache write into later launches;
    ``None``: not known, treated as the number of tokens). ``host`` holds numpy copies when
    the batch was built on the host.
    """

    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    prompt_lens: torch.Tensor
    max_query_len: int | None = None
    host: BatchHost | None = None

    def kwargs(self) -> dict[str, torch.Tensor]:
        """The four metadata tensors by name (:data:`BATCH_FIELDS` order)."""
        return {f: getattr(self, f) for f in BATCH_FIELDS}

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, f) for f in BATCH_FIELDS)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    def to(self, device) -> DashBatch:
        return DashBatch(
            **{k: v.to(device) for k, v in self.kwargs().items()}, max_query_len=self.max_query_len, host=self.host
        )

    @classmethod
    def from_host(
        cls, host: BatchHost, device: str | torch.device = "cpu", max_query_len: int | None = None
    ) -> DashBatch:
        """Device tensors of ``host`` in one host-to-device copy (one packed int32 buffer)."""
        arrays = [np.ascontiguousarray(getattr(host, f), dtype=np.int32) for f in BATCH_FIELDS]
        packed = torch.from_numpy(np.concatenate([a.ravel() for a in arrays]))
        if torch.device(device).type != "cpu":
            packed = packed.to(device)
        views, off = [], 0
        for a in arrays:
            views.append(packed[off : off + a.size].view(a.shape))
            off += a.size
        return cls(*views, max_query_len=max_query_len, host=host)


def slot_mapping(
    block_tables: torch.Tensor, seq_idx: torch.Tensor, positions: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Flat cache slot (``block * block_size + offset``) of each (sequence, position)."""
    blocks = block_tables[seq_idx, positions // block_size].long()
    return blocks * block_size + positions % block_size


# ----------------------------------------------------------------------- operator
#: The new tokens' tensors of one call, in argument order.
TOKEN_FIELDS = ("q", "k", "v", "iq", "ik", "coords", "head_cls")
#: The arguments every front end of the operator takes: :func:`paged_dash_attention`'s.
OPERATOR_ARGS = (*TOKEN_FIELDS, "cache", *BATCH_FIELDS, "sp", "layer_idx")


@dataclass
class OperatorCall:
    """The arguments of one call of the paged operator, bound once: the new tokens' tensors
    (:data:`TOKEN_FIELDS`), the cache, the batch and the layer's config. Every front end
    (:func:`paged_dash_attention`, the CUDA binding, the torch ops) takes the operator's
    arguments as :func:`paged_dash_attention` declares them and reads them through
    :meth:`bind`, so the list is written once."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    iq: torch.Tensor
    ik: torch.Tensor
    coords: torch.Tensor
    head_cls: torch.Tensor
    cache: DashKVCache
    batch: DashBatch
    cfg: DashConfig
    layer_idx: int

    @classmethod
    def bind(cls, *args, **kwargs) -> OperatorCall:
        """:data:`OPERATOR_ARGS`, positional or by name; the four batch tensors may also come
        as one :class:`DashBatch` (positional in their place, or ``batch=``)."""
        args, batch = list(args), kwargs.pop("batch", None)
        if len(args) > 8 and isinstance(args[8], DashBatch):  # (..., cache, batch, sp, layer_idx)
            batch = args[8]
            args[8:9] = batch.tensors()
        elif batch is not None:
            twice = [f for f in BATCH_FIELDS if f in kwargs]
            if twice:
                raise TypeError(f"argument(s) {', '.join(twice)} given twice (by name and in batch=)")
            kwargs.update(batch.kwargs())
        if len(args) > len(OPERATOR_ARGS):
            raise TypeError(f"the operator takes {len(OPERATOR_ARGS)} arguments, got {len(args)}")
        values = dict(zip(OPERATOR_ARGS, args))
        for name, value in kwargs.items():
            if name not in OPERATOR_ARGS:
                raise TypeError(f"the operator has no argument {name!r} (it takes {', '.join(OPERATOR_ARGS)})")
            if name in values:
                raise TypeError(f"argument {name!r} given twice")
            values[name] = value
        missing = [n for n in OPERATOR_ARGS if n not in values]
        if missing:
            raise TypeError(f"the operator's argument(s) {', '.join(missing)} are missing")
        cfg = as_config(values["sp"])
        if batch is None:
            batch = DashBatch(*(values[f] for f in BATCH_FIELDS))
        cache = values["cache"]
        if not isinstance(cache, DashKVCache):  # its six tensors, in field order
            cache = DashKVCache.of(cache, cfg.sparse_block_size)
        return cls(*(values[f] for f in TOKEN_FIELDS), cache, batch, cfg, values["layer_idx"])

    def token_tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, f) for f in TOKEN_FIELDS)

    def check(self) -> tuple[list[int], list[int], list[int]]:
        """Check every argument once (shapes, dtypes, the cache's layout, the batch metadata against
        the cache); return (query starts, sequence lengths, prompt lengths) as Python lists."""
        return check_paged_inputs(*self.args()[:-1])

    def args(self) -> tuple:
        """The positional arguments of :func:`paged_dash_attention` for this call."""
        return (*self.token_tensors(), self.cache, *self.batch.tensors(), self.cfg, self.layer_idx)


def paged_dash_attention(*args, return_routing: bool = False, attend_routing: Routing | None = None, **kwargs):
    """DASH attention for a ragged batch of new tokens over a paged cache.

    Arguments (:data:`OPERATOR_ARGS`, positional or by name): ``q`` [T, H, D], ``k``/``v``
    [T, Hkv, D], ``iq``/``ik`` [T, Di] (unrotated), ``coords`` [T, 4], ``head_cls`` [Di],
    ``cache`` (a :class:`DashKVCache`), the batch metadata ``block_tables``, ``seq_lens``,
    ``query_start_loc``, ``prompt_lens`` as in the module docstring (or one :class:`DashBatch`
    in their place), ``sp`` (a :class:`DashConfig` or its dict) and ``layer_idx``. Writes the
    new tokens' keys, values, index keys and image pages into ``cache`` in place, summarises the
    sparse blocks they complete, and returns the attention output [T, H, D] in ``q.dtype``
    (and a :class:`Routing` if asked).

    ``attend_routing`` (a :class:`Routing` of T rows, such as a kernel's): attend each token's
    blocks and biases from it instead of the ones routed here (-1 ids unused). For checking an
    implementation's attention apart from its routing; the returned routing is still this one's.

    Stages, the same as the kernels': write (with page RoPE), summarise completed
    sparse blocks, score and route, attend.
    """
    call = OperatorCall.bind(*args, **kwargs)
    q, k, v, iq, ik, coords, head_cls = call.token_tensors()
    cache, cfg, layer_idx = call.cache, call.cfg, call.layer_idx
    block_tables, seq_lens, query_start_loc, prompt_lens = call.batch.tensors()
    starts, lens, prompts = call.check()
    bsz, sbs = cache.block_size, cfg.sparse_block_size
    device = q.device
    coords = coords.long()
    tok, page = coords[:, COORD_TOK], coords[:, COORD_PAGE]

    # Stage 1: write rotated keys, values, index keys and image pages in place.
    seq_idx = torch.repeat_interleave(
        torch.arange(len(lens), device=device),
        (query_start_loc[1:] - query_start_loc[:-1]).long(),
    )
    new_pos = _new_positions(starts, lens, device)
    slots = slot_mapping(block_tables, seq_idx, new_pos, bsz)
    k_rot = page_rope(k, tok, page, cfg, main=True)
    ik_rot = torch.nan_to_num(page_rope(ik, tok, page, cfg, main=False), nan=0.0, posinf=0.0, neginf=0.0)
    cache.write_kv(slots, k_rot, v)
    cache.index_key.view(-1, cache.index_key.shape[-1])[slots] = ik_rot
    cache.image_page.view(-1)[slots] = coords[:, COORD_IMAGE_PAGE].to(torch.int32)

    q_rot = page_rope(q, tok, page, cfg, main=True)
    iq_rot = torch.nan_to_num(page_rope(iq, tok, page, cfg, main=False).float(), nan=0.0, posinf=0.0, neginf=0.0)
    output = torch.empty_like(q)
    parts = []
    k_width_all = 0
    n_max = max((-(-length // sbs) for length in lens), default=0)
    table_rows = block_tables.long()
    for s, (start, length) in enumerate(zip(starts, lens)):
        n_new = int(query_start_loc[s + 1]) - start
        prompt = prompts[s]
        table = table_rows[s]
        # Stage 2: summarise the sparse blocks this call completes.
        _summarise_completed(cache, table, length - n_new, length, prompt, head_cls, sbs)
        # Stage 3 + 4: route over the sequence's blocks, attend selected + local window.
        n_blk = -(-length // sbs)
        summary, pages = _block_state(cache, table, length // sbs, n_blk, sbs)
        k_width = routed_width(cfg, layer_idx, n_blk)
        k_width_all = max(k_width_all, k_width)
        chunk = query_chunk_size(cfg, k_width * sbs + cfg.local_window, q.shape[1], k.shape[1], q.shape[2])

        def gather_kv(idx: torch.Tensor, table=table) -> tuple[torch.Tensor, torch.Tensor]:
            flat = table[idx // bsz] * bsz + idx % bsz
            return cache.read_kv(flat, q.dtype)

        for c0 in range(0, n_new, chunk):
            c1 = min(c0 + chunk, n_new)
            rows = slice(start + c0, start + c1)
            pos = torch.arange(length - n_new + c0, length - n_new + c1, device=device)
            qp = coords[rows, COORD_QUERY_PAGE]
            candidate = _candidates(cache, table, pages, qp, sbs)
            scores, selected, bias, valid, values = route_chunk(
                iq_rot[rows], summary, pos, candidate, cfg, layer_idx, prompt
            )
            if attend_routing is None:
                out = sparse_attend(q_rot[rows], pos, selected, bias, valid, gather_kv, length, prompt, cfg)
            else:
                given = attend_routing.selected[rows].to(device).long()
                out = sparse_attend(
                    q_rot[rows],
                    pos,
                    given.clamp(min=0),
                    attend_routing.bias[rows].to(device).float(),
                    given >= 0,
                    gather_kv,
                    length,
                    prompt,
                    cfg,
                )
            output[rows] = out.to(q.dtype)
            if return_routing:
                parts.append(routing_rows(scores, selected, bias, valid, values, n_max))
    if return_routing:
        routing = (
            stack_routing(parts, k_width_all)
            if parts
            else Routing(torch.empty(0, 0, dtype=torch.long), torch.empty(0, 0), torch.empty(0, 0), torch.empty(0, 0))
        )
        return output, routing
    return output


def _new_positions(query_start_loc: list[int], lens: list[int], device) -> torch.Tensor:
    """Positions of the new tokens, sequence by sequence (token-major order): the
    last ``n_i`` positions of each sequence."""
    parts = [
        torch.arange(length - (query_start_loc[s + 1] - query_start_loc[s]), length, device=device)
        for s, length in enumerate(lens)
    ]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=device)


def _summary_location(table: torch.Tensor, blocks: torch.Tensor, sbs: int, bsz: int):
    first = blocks * sbs
    return table[first // bsz], (first % bsz) // sbs


def _summarise_completed(cache, table, old_len, new_len, prompt, head_cls, sbs) -> None:
    """Stage 2: summaries and page ranges of sparse blocks completed by this call."""
    first, last = old_len // sbs, new_len // sbs
    if last <= first:
        return
    device = table.device
    bsz = cache.block_size
    blocks = torch.arange(first, last, device=device)
    pos = blocks[:, None] * sbs + torch.arange(sbs, device=device)
    flat = table[pos // bsz] * bsz + pos % bsz
    keys = cache.index_key.view(-1, cache.index_key.shape[-1])[flat].float()
    real = torch.ones_like(pos, dtype=torch.bool) if prompt is None else pos < prompt
    phys, sub = _summary_location(table, blocks, sbs, bsz)
    cache.summary[phys, sub] = block_summaries(keys, real, head_cls)
    img = cache.image_page.view(-1)[flat].long()
    has = img >= 0
    big = torch.iinfo(torch.int64).max
    lo = torch.where(has, img, big).amin(-1)
    hi = torch.where(has, img, -1).amax(-1)
    srt = torch.where(has, img, -1).sort(-1).values
    distinct = (srt[:, :1] >= 0).sum(-1) + ((srt[:, 1:] != srt[:, :-1]) & (srt[:, 1:] >= 0)).sum(-1)
    any_img = has.any(-1)
    lo = torch.where(any_img, lo, -1)
    dense = (distinct == hi - lo + 1) | ~any_img
    cache.summary_pages[phys, sub] = torch.stack((lo, hi, dense.long()), -1).to(torch.int32)


def _block_state(cache, table, n_complete, n_blk, sbs):
    """Summaries [N, Di] and page ranges [N, 3] of a sequence's ``n_blk`` sparse blocks: its
    ``n_complete`` complete ones from the cache, then the partial last one (if any) as a zero
    summary with no pages. A partial block is never remote (it holds the newest token, inside
    every local window), so it only keeps N equal to the reference's ceil(length / sbs)."""
    blocks = torch.arange(n_complete, device=table.device)
    phys, sub = _summary_location(table, blocks, sbs, cache.block_size)
    summary, pages = cache.summary[phys, sub], cache.summary_pages[phys, sub].long()
    if n_blk > n_complete:
        summary = torch.cat([summary, summary.new_zeros(n_blk - n_complete, summary.shape[1])])
        pages = torch.cat([pages, pages.new_full((n_blk - n_complete, 3), -1)])
    return summary, pages


def _candidates(cache, table, pages, qp, sbs) -> torch.Tensor:
    """[c, N] bool: block holds an image token of the query's page."""
    lo, hi, dense = pages[:, PAGE_LO], pages[:, PAGE_HI], pages[:, PAGE_DENSE].bool()
    qp = qp[:, None]
    inside = (qp >= 0) & (lo[None] <= qp) & (qp <= hi[None])
    cand = inside & (dense[None] | (qp == lo[None]) | (qp == hi[None]))
    # A page strictly inside a block's range may have no image token there (a page
    # without images): look at the block's tokens for those rare pairs only.
    unsure = (inside & ~cand).nonzero()
    if unsure.numel():
        qi, b = unsure[:, 0], unsure[:, 1]
        bsz = cache.block_size
        pos = b[:, None] * sbs + torch.arange(sbs, device=table.device)
        img = cache.image_page.view(-1)[table[pos // bsz] * bsz + pos % bsz].long()
        cand[qi, b] = (img == qp[qi]).any(-1)
    return cand


# --------------------------------------------------------------------- validation
def check_paged_inputs(
    q, k, v, iq, ik, coords, head_cls, cache, block_tables, seq_lens, query_start_loc, prompt_lens, cfg: DashConfig
):
    """Check every input once; return (starts, lens, prompts) as Python lists."""
    check_shape("q", q, (None, None, None), FLOAT_DTYPES)
    t, _, d = q.shape
    check_shape("k", k, (t, None, d), (q.dtype,))
    hkv = k.shape[1]
    check_shape("v", v, (t, hkv, d), (q.dtype,))
    check_shape("iq", iq, (t, None), (q.dtype,))
    di = iq.shape[1]
    check_shape("ik", ik, (t, di), (q.dtype,))
    check_shape("coords", coords, (t, NUM_COORDS), INDEX_DTYPES)
    check_shape("head_cls", head_cls, (di,), FLOAT_DTYPES)
    check_heads(cfg, q, k, iq)
    if not isinstance(cache, DashKVCache):
        raise ValueError(f"cache must be a DashKVCache, got {type(cache).__name__}")
    cache.validate()
    if cache.sparse_block_size != cfg.sparse_block_size:
        raise ValueError(
            f"cache was laid out for sparse blocks of {cache.sparse_block_size}, config says {cfg.sparse_block_size}"
        )
    nb, bsz, chkv, cd = cache.key.shape
    if (chkv, cd) != (hkv, d):
        raise ValueError(f"cache.key holds [*, *, {chkv}, {cd}] heads/dim, k has [{hkv}, {d}]")
    if cache.index_key.shape[-1] != di:
        raise ValueError(f"cache.index_key has dim {cache.index_key.shape[-1]}, ik has {di}")
    if cache.model_dtype != q.dtype:
        raise ValueError(f"cache dtype {cache.model_dtype} differs from q dtype {q.dtype}")
    if cache.key.device != q.device:
        raise ValueError(f"cache is on {cache.key.device}, inputs on {q.device}")
    check_shape("block_tables", block_tables, (None, None), INDEX_DTYPES)
    b, width = block_tables.shape
    check_shape("seq_lens", seq_lens, (b,), INDEX_DTYPES)
    check_shape("query_start_loc", query_start_loc, (b + 1,), INDEX_DTYPES)
    check_shape("prompt_lens", prompt_lens, (b,), INDEX_DTYPES)
    qsl = query_start_loc.tolist()
    lens = [int(x) for x in seq_lens.tolist()]
    prompts = [None if int(p) == -1 else int(p) for p in prompt_lens.tolist()]
    if qsl[0] != 0 or qsl[-1] != t or any(a > b_ for a, b_ in zip(qsl, qsl[1:])):
        raise ValueError(f"query_start_loc must rise from 0 to the number of new tokens ({t}), got {qsl}")
    for s in range(b):
        n_new = qsl[s + 1] - qsl[s]
        if n_new > lens[s]:
            raise ValueError(f"sequence {s}: {n_new} new tokens but seq_lens is {lens[s]}")
        if lens[s] > width * bsz:
            raise ValueError(
                f"sequence {s}: context of {lens[s]} tokens is longer than its block table "
                f"holds ({width} blocks of {bsz})"
            )
        if int(prompt_lens[s]) < -1:
            raise ValueError(f"prompt_lens[{s}] must be -1 (none) or >= 0, got {int(prompt_lens[s])}")
        used = block_tables[s, : -(-lens[s] // bsz)]
        bad = (used < 0) | (used >= nb)
        if bool(bad.any()):
            j = int(bad.nonzero()[0])
            raise ValueError(f"block_tables[{s}, {j}] = {int(used[j])} is outside the cache (0..{nb - 1})")
    if t:
        seq_idx = torch.repeat_interleave(torch.arange(b), torch.tensor(qsl[1:]) - torch.tensor(qsl[:-1]))
        pos = _new_positions(qsl, lens, "cpu")
        slots = slot_mapping(block_tables.cpu(), seq_idx, pos, bsz)
        if slots.unique().numel() != t:
            raise ValueError("two new tokens map to the same cache slot: block tables overlap")
    return qsl, lens, prompts
