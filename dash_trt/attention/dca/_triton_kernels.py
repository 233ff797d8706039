"""The Triton kernels of :mod:`dash_trt.attention.dca.kernels` (which documents them).

Loaded by :func:`dash_trt.attention.dca.kernels._kernels` as a fresh module per setting of
``TRITON_INTERPRET`` (Triton reads it when a function is decorated, and resolves the kernels'
calls to each other through this module's globals). Importing it needs Triton.
"""

import triton
import triton.language as tl


@triton.jit
def _attend(
    acc, m_i, l_i, q, lo, hi, rowpos, qmult,
    key_ptr, value_ptr, bt_ptr, bt_row, kvh,
    BSZ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """One online softmax over keys [lo, hi) with one query rotation ``q`` [M, D]."""
    d = tl.arange(0, D)
    for start in range(lo, hi, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        kin = kpos < hi
        blk = tl.load(bt_ptr + bt_row + kpos // BSZ, mask=kin, other=0).to(tl.int64)
        slot = blk * BSZ + kpos % BSZ
        base = slot * (HKV * D) + kvh * D
        kt = tl.load(key_ptr + base[None, :] + d[:, None], mask=kin[None, :], other=0.0)  # [D, N]
        if IEEE:
            s = tl.dot(q.to(tl.float32), kt.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, kt)
        s = s * qmult[:, None]
        visible = kin[None, :] & (kpos[None, :] <= rowpos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(value_ptr + base[:, None] + d[None, :], mask=kin[:, None], other=0.0)  # [N, D]
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def dca_attend_kernel(
    q_ptr, qmult_ptr, key_ptr, value_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, tile_seq_ptr, tile_row_ptr,
    o_ptr, lse_ptr, T, H, bt_stride, per_split,
    C_LEN: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, TOK: tl.constexpr, BSZ: tl.constexpr,
    HKV: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(tile_seq_ptr + tile)
    row0 = tl.load(tile_row_ptr + tile)
    tok_end = tl.load(qsl_ptr + seq + 1)
    seq_len = tl.load(seq_lens_ptr + seq)
    r = tl.arange(0, BLOCK_M)
    tok = row0 + r // GP
    hg = r % GP
    valid = (hg < G) & (tok < tok_end) & (r // GP < TOK)
    head = kvh * G + hg
    rowpos = seq_len - tok_end + tok  # each row's position in its sequence
    d = tl.arange(0, D)
    qoff = (tok.to(tl.int64) * H + head) * D
    qmult = tl.load(qmult_ptr + tok, mask=valid, other=0.0)
    # the tile's tokens lie in one chunk (the host's tiling); the keys it sees end at its last token
    first = seq_len - tok_end + row0
    last = seq_len - tok_end + tl.minimum(row0 + TOK, tok_end) - 1
    qc = first // C_LEN
    lo = split * per_split
    hi = tl.minimum(lo + per_split, last + 1)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    bt_row = seq.to(tl.int64) * bt_stride
    plane = T.to(tl.int64) * H * D
    qmask = valid[:, None]
    # inter: chunks qc-2 and before
    i_hi = tl.minimum(hi, tl.maximum(qc - 1, 0) * C_LEN)
    if lo < i_hi:
        q = tl.load(q_ptr + 2 * plane + qoff[:, None] + d[None, :], mask=qmask, other=0.0)
        acc, m_i, l_i = _attend(acc, m_i, l_i, q, lo, i_hi, rowpos, qmult, key_ptr, value_ptr, bt_ptr, bt_row,
                                kvh, BSZ, HKV, D, BLOCK_N, IEEE)  # fmt: skip
    # successive: chunk qc-1
    s_lo = tl.maximum(lo, tl.maximum(qc - 1, 0) * C_LEN)
    s_hi = tl.minimum(hi, qc * C_LEN)
    if s_lo < s_hi:
        q = tl.load(q_ptr + plane + qoff[:, None] + d[None, :], mask=qmask, other=0.0)
        acc, m_i, l_i = _attend(acc, m_i, l_i, q, s_lo, s_hi, rowpos, qmult, key_ptr, value_ptr, bt_ptr, bt_row,
                                kvh, BSZ, HKV, D, BLOCK_N, IEEE)  # fmt: skip
    # intra: its own chunk, up to the tile's last token (the causal mask inside)
    a_lo = tl.maximum(lo, qc * C_LEN)
    if a_lo < hi:
        q = tl.load(q_ptr + qoff[:, None] + d[None, :], mask=qmask, other=0.0)
        acc, m_i, l_i = _attend(acc, m_i, l_i, q, a_lo, hi, rowpos, qmult, key_ptr, value_ptr, bt_ptr, bt_row,
                                kvh, BSZ, HKV, D, BLOCK_N, IEEE)  # fmt: skip
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))
    ooff = (split.to(tl.int64) * T + tok) * H + head
    tl.store(o_ptr + ooff[:, None] * D + d[None, :], out.to(o_ptr.dtype.element_ty), mask=qmask)
    tl.store(lse_ptr + ooff, lse, mask=valid)
