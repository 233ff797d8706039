"""Dual Chunk Attention on the GPU: the paged operator's function in Triton kernels.

:func:`paged_dca` computes exactly what :func:`dash_trt.attention.dca.paged.paged_dual_chunk_attention`
computes (docs/dca.md, "The paged form"), for the same arguments, with every step on the device:

1. the new tokens' keys are rotated at ``p mod c``, multiplied by their length scale and written
   into the paged cache, their values beside them (PyTorch operations on the device);
2. each query's three rotations (intra, successive, inter) and its logit scale are computed once;
3. one kernel attends: a program takes a tile of query rows (tokens of one sequence and one
   chunk, times the query heads of one KV head: grouped-query heads share each key tile they
   load) and one of ``splits`` contiguous ranges of the keys. The keys a query sees fall into
   three contiguous ranges, each with one rotation of the query: chunks two or more back
   (inter), the previous chunk (successive), its own chunk up to itself (intra). The program
   runs one online softmax over its range, loading the query rotation a range needs once;
4. the splits' partial results are merged by their log-sum-exp (split-K, for decode steps whose
   few queries would leave most of the GPU idle). The result does not depend on ``splits``
   beyond float32 rounding.

Every launch's grid depends only on the batch's shapes, and a decode batch (one new token a
sequence, ``decode=True``) needs no value from the host, so a decode step can be captured in a
CUDA graph. A batch with prefill chunks builds its tile list on the host from
``query_start_loc`` (one small copy), as flash-attention's variable-length kernels are given
their tiles.

The kernels run wherever Triton runs a kernel: on a CUDA device, or on the CPU under Triton's
interpreter (``TRITON_INTERPRET=1`` before the first call), which is how the tests check them
against the reference on a machine without a GPU. 16-bit caches are read in their dtype and
multiplied with float32 accumulation (the query rotations are rounded to the cache dtype, as a
flash-attention kernel's inputs are); float32 caches multiply in IEEE float32, and so does the
interpreter for every dtype (its 16-bit products are not float32-accumulated: a bfloat16 product
came out wrong), so on the CPU the 16-bit tests check the kernels' logic, not their roundings.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
import sys

import torch

from .paged import DcaKVCache, _check_call, _scales
from .reference import DcaConfig, DcaConfigError, _rope_tables, _rotate

__all__ = ["DTYPES", "available", "decode_splits", "head_dim_ok", "paged_dca"]

#: The cache dtypes the kernels take.
DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_LOG2E = 1.4426950408889634

#: Query rows of a tile (tokens x padded query heads of one KV head) and keys of a key tile.
BLOCK_M = 64
BLOCK_N = 64


def available() -> bool:
    """Whether Triton can be imported (the kernels compile on first use)."""
    return _kernels(_interpreted()) is not None


def head_dim_ok(head_dim: int) -> bool:
    """Whether the kernels take this head dim (a power of two, at least 16)."""
    return head_dim >= 16 and not head_dim & (head_dim - 1)


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=2)
def _kernels(interpret: bool):
    """``(triton, attend kernel)``, or None without Triton. The kernels' module is loaded once
    per interpreter setting, as its own module (Triton reads TRITON_INTERPRET when a function is
    decorated, so a process may hold both)."""
    try:
        import triton
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(__file__), "_triton_kernels.py")
    name = f"{__name__}._triton_{'interpreted' if interpret else 'compiled'}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # Triton's interpreter finds a kernel's module by its name
    spec.loader.exec_module(module)
    return triton, module.dca_attend_kernel


def decode_splits(batch: int, kv_heads: int, longest: int, *, sms: int | None = None) -> int:
    """Key splits of a decode step: enough programs to fill the GPU twice over (``sms``
    multiprocessors; 132 when unknown), at least 2048 keys a split, at most 64 splits."""
    if sms is None:
        sms = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 132
    want = max(1, (2 * sms) // max(1, batch * kv_heads))
    return int(max(1, min(want, 64, -(-longest // 2048))))


def _tiles(starts: list[int], lens: list[int], c: int, tok: int) -> tuple[list[int], list[int]]:
    """Query tiles: up to ``tok`` consecutive new tokens of one sequence, never across a chunk
    boundary (so every row of a tile uses the same rotation against the same keys)."""
    seqs, rows = [], []
    for s, n in enumerate(lens):
        begin, end = starts[s], starts[s + 1]
        t = begin
        while t < end:
            pos = n - (end - t)
            stop = min(end, t + tok, t + (c - pos % c))
            seqs.append(s)
            rows.append(t)
            t = stop
    return seqs, rows


def _prepare(q, k, v, cache, block_tables, seq_lens, query_start_loc, cfg, rd, theta, prompt_lens, sm):
    """Steps 1 and 2 on the device: the cache write, the query rotations and their logit scales."""
    t, nh, hd = q.shape
    hkv = k.shape[1]
    device = q.device
    bsz, c = cache.block_size, cfg.chunk_len
    qsl = query_start_loc.to(device=device, dtype=torch.int64)
    lens = seq_lens.to(device=device, dtype=torch.int64)
    rows = torch.arange(t, device=device)
    seq_idx = torch.searchsorted(qsl[1:], rows, right=True)
    pos = lens[seq_idx] - (qsl[1:][seq_idx] - rows)
    if prompt_lens is None:
        prompt = torch.full_like(pos, -1)
    else:
        prompt = prompt_lens.to(device=device, dtype=torch.int64)[seq_idx]
    scale_len = torch.where((prompt >= 1) & (pos < prompt), prompt, pos + 1)  # token_scale_lengths, batched
    tok_scale = _scales(cfg, scale_len)
    tables = block_tables.to(device=device, dtype=torch.int64)
    slots = tables[seq_idx, pos // bsz] * bsz + pos % bsz
    local = pos % c  # cfg.positions' tables, without its host-side checks (graph capture)
    kcos, ksin = _rope_tables(local, rd, theta)
    k_rot = _rotate(k.float(), kcos, ksin, rd) * tok_scale.float()[:, None, None]
    cache.key.view(-1, hkv, hd).index_copy_(0, slots, k_rot.to(cache.key.dtype))
    cache.value.view(-1, hkv, hd).index_copy_(0, slots, v.to(cache.value.dtype))
    qf = q.float()
    q_rot = torch.empty((3, t, nh, hd), dtype=torch.float32 if cache.key.dtype == torch.float32 else cache.key.dtype,
                        device=device)  # fmt: skip
    tables_q = (local, torch.clamp(local + c, max=cfg.chunk_size), torch.full_like(local, cfg.inter_position))
    for i, table in enumerate(tables_q):
        cos, sin = _rope_tables(table, rd, theta)
        q_rot[i] = _rotate(qf, cos, sin, rd)
    scale = hd**-0.5 if sm is None else float(sm)
    qmult = (tok_scale * (scale * _LOG2E)).float()
    return q_rot, qmult, qsl


def paged_dca(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: DcaKVCache,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    cfg: DcaConfig,
    *,
    rope_theta: float = 10000.0,
    rotary_dim: int | None = None,
    prompt_lens: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    decode: bool = False,
    splits: int = 1,
    check: bool = True,
) -> torch.Tensor:
    """:func:`~dash_trt.attention.dca.paged.paged_dual_chunk_attention` in Triton kernels (same
    arguments, same result within float32 rounding; the cache written in place).

    ``decode``: every sequence has exactly one new token (a decode step): the tiles are the
    sequences, nothing is read back to the host, and the call can be captured in a CUDA graph.
    ``splits``: contiguous key ranges per tile, merged by log-sum-exp (:func:`decode_splits`
    picks a decode step's). ``check``: validate every input first, as the PyTorch operator does
    (reads the metadata on the host; off for graph capture, where the caller vouches for it).
    """
    if isinstance(splits, bool) or not isinstance(splits, int) or splits < 1:
        raise DcaConfigError(f"splits must be a positive int, got {splits!r}")
    rd = q.shape[-1] if rotary_dim is None and isinstance(q, torch.Tensor) and q.ndim == 3 else rotary_dim
    if check:
        starts, lens, _ = _check_call(
            q, k, v, cache, block_tables, seq_lens, query_start_loc, prompt_lens, cfg, rd, rope_theta, softmax_scale
        )
        if decode and any(b - a != 1 for a, b in zip(starts, starts[1:])):
            raise DcaConfigError("decode=True needs exactly one new token in every sequence")
    if cache.key.dtype not in DTYPES:
        raise DcaConfigError(f"the kernels take float32, float16 or bfloat16 caches, got {cache.key.dtype}")
    kern = _kernels(_interpreted())
    if kern is None:
        raise DcaConfigError("the Dual Chunk Attention kernels need Triton (pip install triton)")
    triton, attend = kern
    t, nh, hd = q.shape
    hkv = k.shape[1]
    if t == 0:
        return q.new_zeros((0, nh, hd))
    if not head_dim_ok(hd):
        raise DcaConfigError(f"the kernels take a power-of-two head_dim >= 16, got {hd}")
    group = nh // hkv
    gp = triton.next_power_of_2(group)
    block_m = max(16, gp) if decode else max(BLOCK_M, gp)
    tok = block_m // gp
    q_rot, qmult, qsl = _prepare(
        q, k, v, cache, block_tables, seq_lens, query_start_loc, cfg, rd, rope_theta, prompt_lens, softmax_scale
    )
    device = q.device
    b, width = block_tables.shape
    if decode:
        tile_seq = torch.arange(b, device=device, dtype=torch.int32)
        tile_row = qsl[:-1].to(torch.int32)
        longest = width * cache.block_size
    else:
        if not check:
            starts = [int(x) for x in query_start_loc.tolist()]
            lens = [int(x) for x in seq_lens.tolist()]
        seqs, rows = _tiles(starts, lens, cfg.chunk_len, tok)
        tile_seq = torch.tensor(seqs, dtype=torch.int32, device=device)
        tile_row = torch.tensor(rows, dtype=torch.int32, device=device)
        longest = max(lens)
    per_split = -(-max(1, longest) // (splits * BLOCK_N)) * BLOCK_N
    # one split: the kernel writes the answer in q's dtype; several: float32 partials to merge
    o = torch.empty((splits, t, nh, hd), dtype=torch.float32 if splits > 1 else q.dtype, device=device)
    lse = torch.empty((splits, t, nh), dtype=torch.float32, device=device)
    grid = (tile_seq.numel(), hkv, splits)
    attend[grid](
        q_rot, qmult, cache.key, cache.value, block_tables.to(torch.int32), seq_lens.to(torch.int32),
        qsl.to(torch.int32), tile_seq, tile_row, o, lse, t, nh, width, per_split,
        C_LEN=cfg.chunk_len, G=group, GP=gp, TOK=tok, BSZ=cache.block_size, HKV=hkv, D=hd,
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, IEEE=cache.key.dtype == torch.float32 or _interpreted(),
    )  # fmt: skip
    if splits == 1:
        return o[0]
    top = lse.amax(dim=0)
    w = torch.exp2(lse - torch.where(torch.isinf(top), torch.zeros_like(top), top))  # 0 for an empty split
    out = (o * w[..., None]).sum(dim=0) / w.sum(dim=0).clamp(min=math.ldexp(1.0, -126))[..., None]
    return out.to(q.dtype)
