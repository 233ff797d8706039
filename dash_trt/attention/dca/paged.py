"""The paged form of Dual Chunk Attention: a ragged batch of prefill chunks and decode tokens
over a paged KV cache, equal to :func:`dash_trt.attention.dca.reference.dual_chunk_attention` (docs/dca.md states
the function and, in "The paged form", this form).

Layout (per layer), for ``num_blocks`` KV blocks of ``block_size`` tokens:

=========  ==================================  ========
tensor     shape                               dtype
=========  ==================================  ========
``key``    [num_blocks, block_size, Hkv, D]    q dtype
``value``  [num_blocks, block_size, Hkv, D]    q dtype
=========  ==================================  ========

``key`` holds each key as it is attended: rotated (neox RoPE over the first ``rotary_dim``
dims) at ``p mod c`` and multiplied by the length scale ``s`` it was written with, then rounded
to the cache dtype. The scale is folded into the key, so the cache needs no other per-token
field, and a key is never rotated or scaled again. ``value`` holds the values unchanged.

Batch metadata, the conventions of :mod:`dash_trt.attention.dash.paged` (``B`` sequences, ``T`` new tokens):

- ``block_tables`` [B, W] int32/int64: physical KV block of each logical block, -1 pad;
- ``seq_lens`` [B]: tokens of each sequence *after* this call;
- ``query_start_loc`` [B+1]: the new tokens of sequence ``i`` are rows
  ``query_start_loc[i]:query_start_loc[i+1]`` of q/k/v, and are its last ``n_i`` positions;
- ``prompt_lens`` [B] (optional while the length scaling is off): each sequence's prompt
  length, constant over its life (:class:`dash_trt.serving.block_pool.KVBlockPool` hands out
  the ``prompt_length`` a sequence was added with; -1 for none).

Scaling (vLLM's semantics, as :func:`dash_trt.attention.dca.reference.dual_chunk_attention` documents them), per
token at position ``t`` of a sequence whose prompt holds ``P`` tokens:

- ``t < P`` (a prompt token, in a one-shot or a chunked prefill): its query and its key are
  multiplied by ``s(P)``, the full prompt length, in every chunk;
- ``t >= P`` (a generated token, decoded): its query and its key by ``s(t + 1)``, the length
  of the sequence including it.

A call may hold several generated tokens of a sequence; each is scaled as if it were decoded
alone, so the result equals decoding them one at a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .reference import DcaConfig, DcaConfigError, _rope_tables, _rotate

__all__ = ["DcaKVCache", "paged_dual_chunk_attention", "token_scale_lengths"]

#: Floating dtypes of the cache and the new tokens.
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)

#: Bytes of float32 logits one block of query rows may hold (three rotations).
_BLOCK_BUDGET_BYTES = 128 << 20


def _check_shape(name: str, t, shape: tuple, dtypes: tuple) -> None:
    """Raise ``DcaConfigError`` unless ``t`` is a tensor of ``shape`` (``None`` = any size)."""
    if not isinstance(t, torch.Tensor):
        raise DcaConfigError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.ndim != len(shape) or any(e is not None and e != a for e, a in zip(shape, t.shape)):
        want = "[" + ", ".join("*" if e is None else str(e) for e in shape) + "]"
        raise DcaConfigError(f"{name} must have shape {want}, got {list(t.shape)}")
    if t.dtype not in dtypes:
        raise DcaConfigError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")


@dataclass
class DcaKVCache:
    """One layer's paged DCA cache (see the module docstring for the layout)."""

    key: torch.Tensor
    value: torch.Tensor

    @classmethod
    def allocate(
        cls,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> DcaKVCache:
        """A zeroed cache of ``num_blocks`` blocks of ``block_size`` tokens."""
        for name, val in (
            ("num_blocks", num_blocks),
            ("block_size", block_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
                raise DcaConfigError(f"{name} must be a positive int, got {val!r}")
        if dtype not in FLOAT_DTYPES:
            raise DcaConfigError(f"cache dtype must be one of {[str(d) for d in FLOAT_DTYPES]}, got {dtype}")
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        return cls(
            key=torch.zeros(shape, dtype=dtype, device=device),
            value=torch.zeros(shape, dtype=dtype, device=device),
        )

    @property
    def num_blocks(self) -> int:
        return self.key.shape[0]

    @property
    def block_size(self) -> int:
        return self.key.shape[1]

    def tensors(self) -> dict[str, torch.Tensor]:
        """The cache's tensors by name (the serving runtime's flat cache order)."""
        return {"key": self.key, "value": self.value}

    def clone(self) -> DcaKVCache:
        return DcaKVCache(key=self.key.clone(), value=self.value.clone())

    def validate(self) -> None:
        """Check the two tensors agree with each other (shape, dtype, device)."""
        _check_shape("cache.key", self.key, (None, None, None, None), FLOAT_DTYPES)
        _check_shape("cache.value", self.value, tuple(self.key.shape), (self.key.dtype,))
        if self.value.device != self.key.device:
            raise DcaConfigError(f"cache.key is on {self.key.device}, cache.value on {self.value.device}")
        if 0 in self.key.shape:
            raise DcaConfigError(f"cache tensors must not be empty, got shape {list(self.key.shape)}")


def token_scale_lengths(positions: torch.Tensor, prompt_len: int | None) -> torch.Tensor:
    """The length ``L`` each token at ``positions`` (of one sequence) is scaled with, ``s(L)``
    multiplying its query and its key: the prompt length for prompt tokens, ``t + 1`` for a
    generated token at position ``t``. ``prompt_len`` None (no prompt known): ``t + 1``."""
    pos = positions.to(torch.int64)
    if prompt_len is None:
        return pos + 1
    return torch.where(pos < prompt_len, torch.full_like(pos, prompt_len), pos + 1)


def _scales(cfg: DcaConfig, lengths: torch.Tensor) -> torch.Tensor:
    """``s(L)`` of int64 ``lengths``, float64 (exactly 1 while scaling is off or ``L <= L_orig``)."""
    if not cfg.scaled:
        return torch.ones(lengths.shape, dtype=torch.float64, device=lengths.device)
    ratio = lengths.to(torch.float64) / cfg.original_max_position_embeddings
    return (0.1 * torch.log(ratio) + 1.0).clamp(min=1.0)


def _check_call(q, k, v, cache, block_tables, seq_lens, query_start_loc, prompt_lens, cfg, rd, theta, sm):
    """Check every input once; return (query starts, lengths, prompts) as Python lists."""
    if not isinstance(cfg, DcaConfig):
        raise DcaConfigError(f"cfg must be a DcaConfig, got {type(cfg).__name__}")
    _check_shape("q", q, (None, None, None), FLOAT_DTYPES)
    t, nh, d = q.shape
    _check_shape("k", k, (t, None, d), (q.dtype,))
    hkv = k.shape[1]
    _check_shape("v", v, (t, hkv, d), (q.dtype,))
    if hkv == 0 or nh % hkv:
        raise DcaConfigError(f"query heads ({nh}) must be a multiple of KV heads ({hkv}) for grouped-query attention")
    if isinstance(rd, bool) or not isinstance(rd, int) or rd <= 0 or rd > d or rd % 2:
        raise DcaConfigError(f"rotary_dim must be an even int in [2, head_dim={d}], got {rd!r}")
    if not (isinstance(theta, (int, float)) and not isinstance(theta, bool) and theta > 0 and math.isfinite(theta)):
        raise DcaConfigError(f"rope_theta must be a positive number, got {theta!r}")
    if sm is not None and not (
        isinstance(sm, (int, float)) and not isinstance(sm, bool) and sm > 0 and math.isfinite(sm)
    ):
        raise DcaConfigError(f"softmax_scale must be None or a positive number, got {sm!r}")
    if not isinstance(cache, DcaKVCache):
        raise DcaConfigError(f"cache must be a DcaKVCache, got {type(cache).__name__}")
    cache.validate()
    nb, bsz, chkv, cd = cache.key.shape
    if (chkv, cd) != (hkv, d):
        raise DcaConfigError(f"cache holds [*, *, {chkv}, {cd}] (KV heads, head dim), k has [{hkv}, {d}]")
    if cache.key.dtype != q.dtype:
        raise DcaConfigError(f"cache dtype {cache.key.dtype} differs from q dtype {q.dtype}")
    if cache.key.device != q.device:
        raise DcaConfigError(f"cache is on {cache.key.device}, inputs on {q.device}")
    cfg.check_kv_block_size(bsz)

    _check_shape("block_tables", block_tables, (None, None), INDEX_DTYPES)
    b, width = block_tables.shape
    _check_shape("seq_lens", seq_lens, (b,), INDEX_DTYPES)
    _check_shape("query_start_loc", query_start_loc, (b + 1,), INDEX_DTYPES)
    if prompt_lens is not None:
        _check_shape("prompt_lens", prompt_lens, (b,), INDEX_DTYPES)
    qsl = [int(x) for x in query_start_loc.tolist()]
    lens = [int(x) for x in seq_lens.tolist()]
    raw_prompts = [-1] * b if prompt_lens is None else [int(x) for x in prompt_lens.tolist()]
    if qsl[0] != 0 or qsl[-1] != t or any(a > c for a, c in zip(qsl, qsl[1:])):
        raise DcaConfigError(f"query_start_loc must rise from 0 to the number of new tokens ({t}), got {qsl}")
    tables = block_tables.cpu().long()
    prompts: list[int | None] = []
    for s in range(b):
        n_new = qsl[s + 1] - qsl[s]
        if lens[s] < 0:
            raise DcaConfigError(f"seq_lens[{s}] must be >= 0, got {lens[s]}")
        if n_new > lens[s]:
            raise DcaConfigError(f"sequence {s}: {n_new} new tokens but seq_lens is {lens[s]}")
        if lens[s] > width * bsz:
            raise DcaConfigError(
                f"sequence {s}: context of {lens[s]} tokens is longer than its block table holds "
                f"({width} blocks of {bsz})"
            )
        p = raw_prompts[s]
        if p < -1:
            raise DcaConfigError(f"prompt_lens[{s}] must be -1 (none) or >= 0, got {p}")
        if cfg.scaled and n_new and p < 1:
            what = "no prompt_lens given" if prompt_lens is None else f"prompt_lens[{s}] is {p}"
            raise DcaConfigError(
                f"sequence {s}: with length scaling on (original_max_position_embeddings="
                f"{cfg.original_max_position_embeddings}) every sequence needs its prompt length (>= 1); {what}"
            )
        prompts.append(p if p >= 1 else None)
        used = tables[s, : -(-lens[s] // bsz)]
        bad = (used < 0) | (used >= nb)
        if bool(bad.any()):
            j = int(bad.nonzero()[0])
            raise DcaConfigError(f"block_tables[{s}, {j}] = {int(used[j])} is outside the cache (0..{nb - 1})")
        if used.unique().numel() != used.numel():
            raise DcaConfigError(f"block_tables[{s}] holds a KV block twice among its first {used.numel()} blocks")
    if t:
        pos = _new_positions(qsl, lens, torch.device("cpu"))
        counts = torch.tensor(qsl[1:], dtype=torch.int64) - torch.tensor(qsl[:-1], dtype=torch.int64)
        seq_idx = torch.repeat_interleave(torch.arange(b), counts)
        slots = tables[seq_idx, pos // bsz] * bsz + pos % bsz
        if slots.unique().numel() != t:
            raise DcaConfigError("two new tokens map to the same cache slot: block tables overlap")
    return qsl, lens, prompts


def _new_positions(qsl: list[int], lens: list[int], device) -> torch.Tensor:
    """Positions of the new tokens, sequence by sequence: the last ``n_i`` of each."""
    parts = [torch.arange(n - (qsl[s + 1] - qsl[s]), n, device=device) for s, n in enumerate(lens)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=device)


def paged_dual_chunk_attention(
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
) -> torch.Tensor:
    """Dual Chunk Attention for a ragged batch of new tokens over a paged cache.

    ``q`` [T, H, D], ``k``/``v`` [T, Hkv, D] are the new tokens of every sequence, unrotated,
    concatenated in ``query_start_loc`` order; ``cache`` a :class:`DcaKVCache` of q's dtype
    whose block size divides the chunk length (:meth:`DcaConfig.check_kv_block_size`); the
    batch metadata as in the module docstring. ``prompt_lens`` may be omitted only while the
    length scaling is off (``cfg.original_max_position_embeddings == 0``).

    Writes the new tokens' keys (rotated at ``p mod c``, multiplied by their length scale,
    rounded to the cache dtype) and values into ``cache`` in place, then attends each new token
    over its sequence's cached keys and values (its own call's included, as read back from the
    cache). Returns [T, H, D] in q's dtype, computed in float32 (RoPE angles in float64).
    """
    rd = q.shape[-1] if rotary_dim is None and isinstance(q, torch.Tensor) and q.ndim == 3 else rotary_dim
    starts, lens, prompts = _check_call(
        q, k, v, cache, block_tables, seq_lens, query_start_loc, prompt_lens, cfg, rd, rope_theta, softmax_scale
    )
    t, nh, hd = q.shape
    hkv = k.shape[1]
    group = nh // hkv
    device = q.device
    if t == 0:
        return q.new_zeros((0, nh, hd))
    bsz, c = cache.block_size, cfg.chunk_len
    scale = hd**-0.5 if softmax_scale is None else float(softmax_scale)
    key_flat = cache.key.view(-1, hkv, hd)
    value_flat = cache.value.view(-1, hkv, hd)
    tables = block_tables.to(device=device, dtype=torch.int64)

    # 1. the scale length of every new token (its query's and its key's), and the cache write
    pos = _new_positions(starts, lens, device)
    scale_len = torch.cat([token_scale_lengths(pos[starts[s] : starts[s + 1]], prompts[s]) for s in range(len(lens))])
    tok_scale = _scales(cfg, scale_len)  # [T] float64
    counts = torch.tensor([starts[s + 1] - starts[s] for s in range(len(lens))], dtype=torch.int64, device=device)
    seq_idx = torch.repeat_interleave(torch.arange(len(lens), device=device), counts)
    slots = tables[seq_idx, pos // bsz] * bsz + pos % bsz
    kcos, ksin = _rope_tables(cfg.positions(pos).key, rd, rope_theta)
    k_rot = _rotate(k.float(), kcos, ksin, rd) * tok_scale.float()[:, None, None]
    key_flat[slots] = k_rot.to(cache.key.dtype)
    value_flat[slots] = v.to(cache.value.dtype)

    # 2. the three query rotations of every new token, scaled by its own s (with the softmax scale)
    qpos = cfg.positions(pos)
    qf = q.float()
    q_rot = []
    for table in (qpos.intra, qpos.successive, qpos.inter):
        cos, sin = _rope_tables(table, rd, rope_theta)
        q_rot.append(_rotate(qf, cos, sin, rd))
    q_mult = (tok_scale * scale).float()  # per row, applied to the logits

    # 3. attend, sequence by sequence, over the keys and values read back from the cache
    out = torch.empty((t, nh, hd), dtype=torch.float32, device=device)
    for s, length in enumerate(lens):
        r_begin, r_end = starts[s], starts[s + 1]
        if r_end == r_begin:
            continue
        pos_k = torch.arange(length, device=device)
        kslots = tables[s, pos_k // bsz] * bsz + pos_k % bsz
        kh = key_flat[kslots].float().permute(1, 2, 0)  # [Hkv, D, S]
        vh = value_flat[kslots].float().permute(1, 0, 2)  # [Hkv, S, D]
        chunk_k = pos_k // c
        rows = max(1, _BLOCK_BUDGET_BYTES // max(1, 4 * 4 * nh * length))
        for r0 in range(r_begin, r_end, rows):
            r1 = min(r_end, r0 + rows)
            n = r1 - r0
            pq = pos[r0:r1]
            back = (pq // c)[:, None] - chunk_k[None, :]  # chunks between query and key [R, S]
            visible = pos_k[None, :] <= pq[:, None]
            parts = []
            for qr in q_rot:
                qh = qr[r0:r1].reshape(n, hkv, group, hd).permute(1, 2, 0, 3).reshape(hkv, group * n, hd)
                parts.append(torch.bmm(qh, kh).reshape(hkv, group, n, length))
            intra, successive, inter = parts
            logits = torch.where(back >= 2, inter, torch.where(back == 1, successive, intra))
            logits = (logits * q_mult[r0:r1, None]).masked_fill(~visible, float("-inf"))
            probs = torch.softmax(logits, dim=-1)  # one softmax over the union of the regions
            o = torch.bmm(probs.reshape(hkv, group * n, length), vh)
            out[r0:r1] = o.reshape(hkv, group, n, hd).permute(2, 0, 1, 3).reshape(n, nh, hd)
    return out.to(q.dtype)
