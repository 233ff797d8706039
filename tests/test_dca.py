"""Dual Chunk Attention's PyTorch reference (dash_trt.attention.dca.reference) against independent statements of
the function: dense causal attention with standard RoPE where DCA must reduce to it, a
loop-based per-(query, key) float64 formulation written here from the definition, and a
vLLM-shaped chunk loop whose three partial attentions are merged by log-sum-exp."""

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dash_trt.attention.dca.reference as dca
from dash_trt.attention.dca.reference import (
    DcaConfig,
    DcaConfigError,
    dca_positions,
    dual_chunk_attention,
    length_scale,
)

# chunk_size C, local_size W (c = C - W), heads H / Hkv, head dim D, rotary dim, RoPE base
CONFIGS = {
    # c = 8, W < c: GQA groups of 2, full rotary dim
    "c8": dict(C=12, W=4, H=4, Hkv=2, D=8, rd=8, theta=10000.0),
    # c = 7 (not a power of two): groups of 3, half the dims rotated, a small base so every pair turns
    "c7": dict(C=10, W=3, H=6, Hkv=2, D=8, rd=4, theta=50.0),
    # c = 4 <= W: the inter position is 2c - 1 < C; one query head per KV head
    "c4": dict(C=10, W=6, H=2, Hkv=2, D=6, rd=6, theta=30.0),
}
ATOL = RTOL = 2e-5  # float32 reference against float64 statements


def lengths(c):
    return [1, c - 1, c, c + 1, 2 * c, 2 * c + 3, 5 * c + 7]


def make_inputs(cfg, length, nq=None, seed=0, gain=1.5):
    g = torch.Generator().manual_seed(seed)
    nq = length if nq is None else nq
    q = gain * torch.randn(nq, cfg["H"], cfg["D"], generator=g)
    k = gain * torch.randn(length, cfg["Hkv"], cfg["D"], generator=g)
    v = torch.randn(length, cfg["Hkv"], cfg["D"], generator=g)
    return q, k, v


def run(cfg, q, k, v, **kw):
    return dual_chunk_attention(
        q, k, v, chunk_size=cfg["C"], local_size=cfg["W"], rope_theta=cfg["theta"], rotary_dim=cfg["rd"], **kw
    )


# --------------------------------------------------------------------- independent statements
def oracle(cfg, q, k, v, *, l_orig=None, scale_length=None, key_scale_lengths=None):
    """DCA from the definition, one (query, key) pair at a time, in float64 Python arithmetic."""
    big_c, w, rd, theta = cfg["C"], cfg["W"], cfg["rd"], cfg["theta"]
    c = big_c - w
    nq, nh, hd = q.shape
    length, hkv, dv = v.shape
    group = nh // hkv
    qd, kd, vd = q.double().tolist(), k.double().tolist(), v.double().tolist()

    def rotate(vec, pos):  # neox: pair m is (m, m + rd/2), angle pos * theta^(-2m/rd)
        half, out = rd // 2, list(vec)
        for m in range(half):
            ang = pos * theta ** (-2.0 * m / rd)
            a, b = vec[m], vec[m + half]
            out[m] = a * math.cos(ang) - b * math.sin(ang)
            out[m + half] = b * math.cos(ang) + a * math.sin(ang)
        return out

    def s(n):
        return 1.0 if not l_orig else max(1.0, 0.1 * math.log(n / l_orig) + 1.0)

    scale_length = length if scale_length is None else scale_length
    s_q = s(scale_length)
    s_k = [s(scale_length if key_scale_lengths is None else int(key_scale_lengths[j])) for j in range(length)]
    keys = [[rotate(kd[j][h], j % c) for h in range(hkv)] for j in range(length)]
    out = torch.zeros(nq, nh, dv, dtype=torch.float64)
    for r in range(nq):
        i = length - nq + r
        for h in range(nh):
            rotated = {}
            logits = []
            for j in range(i + 1):
                if j // c == i // c:
                    pos = i % c  # intra
                elif j // c == i // c - 1:
                    pos = min(i % c + c, big_c)  # successive
                else:
                    pos = min(2 * c - 1, big_c)  # inter
                if pos not in rotated:
                    rotated[pos] = rotate(qd[r][h], pos)
                dot = sum(a * b for a, b in zip(rotated[pos], keys[j][h // group]))
                logits.append(dot * s_q * s_k[j] / math.sqrt(hd))
            top = max(logits)
            weights = [math.exp(x - top) for x in logits]
            total = sum(weights)
            for j, wgt in enumerate(weights):
                for d in range(dv):
                    out[r, h, d] += wgt / total * vd[j][h // group][d]
    return out


def rope_f64(x, pos, rd, theta):
    """Standard neox RoPE at absolute positions (vectorised, float64)."""
    half = rd // 2
    inv = theta ** (-torch.arange(half, dtype=torch.float64) * 2.0 / rd)
    ang = pos.double()[:, None] * inv[None, :]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x = x.double()
    x1, x2 = x[..., :half], x[..., half:rd]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rd:]), dim=-1)


def dense(cfg, q, k, v):
    """Dense causal attention with standard RoPE (query rows aligned to the last positions)."""
    nq, nh, hd = q.shape
    length, hkv, _ = k.shape
    qr = rope_f64(q, torch.arange(length - nq, length), cfg["rd"], cfg["theta"])
    kr = rope_f64(k, torch.arange(length), cfg["rd"], cfg["theta"]).repeat_interleave(nh // hkv, dim=1)
    vv = v.double().repeat_interleave(nh // hkv, dim=1)
    logits = torch.einsum("qhd,khd->hqk", qr, kr) / math.sqrt(hd)
    mask = torch.arange(length)[None, :] > torch.arange(length - nq, length)[:, None]
    probs = logits.masked_fill(mask, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, vv)


def chunk_loop_merge(cfg, q, k, v):
    """vLLM's prefill shape: query rows split at chunk boundaries, an attention per region
    (intra causal, successive and inter unmasked), partial results merged by log-sum-exp."""
    big_c, w, rd, theta = cfg["C"], cfg["W"], cfg["rd"], cfg["theta"]
    c = big_c - w
    nq, nh, hd = q.shape
    length, hkv, _ = k.shape
    kr = rope_f64(k, torch.arange(length) % c, rd, theta).repeat_interleave(nh // hkv, dim=1)
    vv = v.double().repeat_interleave(nh // hkv, dim=1)

    def attend(qx, keys, values, causal_from=None):
        logits = torch.einsum("qhd,khd->hqk", qx, keys) / math.sqrt(hd)
        if causal_from is not None:  # bottom-right aligned causal mask
            qpos = torch.arange(causal_from, causal_from + qx.shape[0])
            logits = logits.masked_fill(torch.arange(keys.shape[0])[None, :] > qpos[:, None], float("-inf"))
        lse = logits.logsumexp(-1)  # [H, Q]
        return torch.einsum("hqk,khd->qhd", (logits - lse[..., None]).exp(), values), lse

    outs, begin = [], length - nq
    while begin < length:
        start = begin // c * c
        end = min(start + c, length)
        rows = q[begin - (length - nq) : end - (length - nq)]
        pos = torch.arange(begin, end)
        parts = [attend(rope_f64(rows, pos % c, rd, theta), kr[start:end], vv[start:end], begin - start)]
        if start - c >= 0:
            q_succ = rope_f64(rows, torch.clamp(pos % c + c, max=big_c), rd, theta)
            parts.append(attend(q_succ, kr[start - c : start], vv[start - c : start]))
        if start - 2 * c >= 0:
            q_inter = rope_f64(rows, torch.full_like(pos, min(2 * c - 1, big_c)), rd, theta)
            parts.append(attend(q_inter, kr[: start - c], vv[: start - c]))
        lse = torch.stack([p[1] for p in parts])  # [R, H, Q]
        weights = (lse - lse.max(0).values).exp()
        weights = weights / weights.sum(0)
        outs.append(sum(p[0] * wgt.T[..., None] for p, wgt in zip(parts, weights)))
        begin = end
    return torch.cat(outs)


# --------------------------------------------------------------------- the position tables
def test_position_tables_qwen_style_example():
    # C = 24, W = 8, c = 16: successive positions run 16..23 then stay at C; inter is C
    t = dca_positions(torch.arange(40), chunk_size=24, local_size=8)
    expected_succ = list(range(16, 24)) + [24] * 8
    assert t.successive.tolist() == (expected_succ * 3)[:40]
    assert t.inter.tolist() == [24] * 40
    assert t.intra.tolist() == t.key.tolist() == [p % 16 for p in range(40)]
    assert all(x.dtype == torch.int64 for x in t)


@pytest.mark.parametrize("name", CONFIGS)
def test_position_tables_and_distance_bound(name):
    cfg = CONFIGS[name]
    big_c, w = cfg["C"], cfg["W"]
    c = big_c - w
    n = 5 * c + 7
    t = DcaConfig(big_c, w).positions(torch.arange(n))
    for p in range(n):
        assert int(t.intra[p]) == int(t.key[p]) == p % c
        assert int(t.successive[p]) == min(p % c + c, big_c)
        assert int(t.inter[p]) == min(2 * c - 1, big_c)
    reached = set()
    for i in range(n):
        for j in range(i + 1):
            back = i // c - j // c
            table = t.intra if back == 0 else t.successive if back == 1 else t.inter
            dist = int(table[i]) - int(t.key[j])
            assert 0 <= dist <= big_c, (i, j, dist)
            reached.add(dist)
            if back == 0:
                assert dist == i - j  # exact inside a chunk
            elif back == 1:
                # exact while the query is within W of its chunk's start, clamped to C after
                assert dist == (i - j if i % c <= w else i - j - (i % c - w))
            else:
                assert dist < i - j
    assert max(reached) == min(2 * c - 1, big_c)  # C itself once c > W


def test_position_tables_refuse_bad_positions():
    with pytest.raises(DcaConfigError, match="integer tensor"):
        dca_positions(torch.zeros(3), chunk_size=8, local_size=2)
    with pytest.raises(DcaConfigError, match=">= 0"):
        dca_positions(torch.tensor([0, -1]), chunk_size=8, local_size=2)


# --------------------------------------------------------------------- the function
@pytest.mark.parametrize("name", CONFIGS)
def test_short_sequences_are_dense_causal_rope(name):
    """Up to c tokens (and s = 1) DCA is dense causal attention with standard RoPE."""
    cfg = CONFIGS[name]
    c = cfg["C"] - cfg["W"]
    for length in range(1, c + 1):
        q, k, v = make_inputs(cfg, length, seed=length)
        torch.testing.assert_close(run(cfg, q, k, v).double(), dense(cfg, q, k, v), atol=ATOL, rtol=RTOL)
        # and with the length scaling configured but inactive (length <= original_max_position_embeddings)
        out = run(cfg, q, k, v, original_max_position_embeddings=length)
        assert torch.equal(out, run(cfg, q, k, v))


@pytest.mark.parametrize("name", CONFIGS)
def test_dense_until_the_first_clamp_or_inter_chunk(name):
    """The successive rotation is exact while i mod c <= W and the inter rotation starts at 2c:
    DCA equals dense attention exactly that far, and not one token further."""
    cfg = CONFIGS[name]
    c, w = cfg["C"] - cfg["W"], cfg["W"]
    last_dense = min(c + w + 1, 2 * c)
    q, k, v = make_inputs(cfg, last_dense, seed=7)
    torch.testing.assert_close(run(cfg, q, k, v).double(), dense(cfg, q, k, v), atol=ATOL, rtol=RTOL)
    q, k, v = make_inputs(cfg, last_dense + 1, nq=1, seed=7)
    assert (run(cfg, q, k, v).double() - dense(cfg, q, k, v)).abs().max() > 1e-3


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("queries", ["all", "last3"])
def test_matches_per_pair_float64_definition(name, queries):
    cfg = CONFIGS[name]
    c = cfg["C"] - cfg["W"]
    for length in lengths(c):
        nq = length if queries == "all" else min(3, length)
        q, k, v = make_inputs(cfg, length, nq=nq, seed=length)
        out = run(cfg, q, k, v)
        assert out.shape == (nq, cfg["H"], cfg["D"]) and out.dtype == torch.float32
        torch.testing.assert_close(out.double(), oracle(cfg, q, k, v), atol=ATOL, rtol=RTOL, msg=f"S={length}")


@pytest.mark.parametrize("name", CONFIGS)
def test_one_softmax_equals_vllm_chunk_loop_with_lse_merge(name):
    cfg = CONFIGS[name]
    c = cfg["C"] - cfg["W"]
    for length in lengths(c):
        for nq in {length, min(length, c + 2)}:  # a query block that may start mid-chunk
            q, k, v = make_inputs(cfg, length, nq=nq, seed=3 * length)
            got = run(cfg, q, k, v).double()
            torch.testing.assert_close(got, chunk_loop_merge(cfg, q, k, v), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("name", CONFIGS)
def test_token_by_token_equals_prefill_rows(name):
    cfg = CONFIGS[name]
    c = cfg["C"] - cfg["W"]
    length = 3 * c + 2
    q, k, v = make_inputs(cfg, length, seed=11)
    full = run(cfg, q, k, v)
    for n in range(1, length + 1):
        step = run(cfg, q[n - 1 : n], k[:n], v[:n])
        torch.testing.assert_close(step, full[n - 1 : n], atol=1e-5, rtol=1e-5, msg=f"length {n}")


def test_query_blocking_does_not_change_the_result(monkeypatch):
    cfg = CONFIGS["c7"]
    q, k, v = make_inputs(cfg, 40, seed=5)
    whole = run(cfg, q, k, v)
    monkeypatch.setattr(dca, "_BLOCK_BUDGET_BYTES", 1)  # one query row per block
    torch.testing.assert_close(run(cfg, q, k, v), whole, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_returns_q_dtype_computes_in_float32(dtype):
    cfg = CONFIGS["c8"]
    q, k, v = make_inputs(cfg, 20, nq=4, seed=2)
    out = run(cfg, q.to(dtype), k.to(dtype), v.to(dtype))
    assert out.dtype == dtype
    ref = run(cfg, q.to(dtype).float(), k.to(dtype).float(), v.to(dtype).float())
    torch.testing.assert_close(out.float(), ref.to(dtype).float(), atol=0, rtol=0)


# --------------------------------------------------------------------- length scaling
def test_length_scale_values():
    assert length_scale(1000, None) == length_scale(1000, 0) == 1.0
    assert length_scale(4096, 4096) == 1.0 and length_scale(10, 4096) == 1.0
    assert length_scale(8192, 4096) == pytest.approx(1.0 + 0.1 * math.log(2.0), abs=1e-15)
    # Qwen2.5-1M: original_max_position_embeddings 262144
    assert length_scale(524288, 262144) == pytest.approx(1.0693147, abs=1e-7)
    assert length_scale(1010000, 262144) == pytest.approx(1.1348812, abs=1e-7)
    cfg = DcaConfig(12, 4, 100)
    assert cfg.scaled and cfg.length_scale(300) == length_scale(300, 100)
    assert not DcaConfig(12, 4).scaled and DcaConfig(12, 4).length_scale(10**6) == 1.0
    with pytest.raises(DcaConfigError, match="length must be a positive int"):
        length_scale(0, 100)


def _scaled_inputs_check(cfg, q, k, v, l_orig, s_q, s_k, **kw):
    """The scaled call equals the unscaled one on s_q * q and s_k[j] * k_j."""
    got = run(cfg, q, k, v, original_max_position_embeddings=l_orig, **kw)
    want = run(cfg, q * s_q, k * s_k[:, None, None], v)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    return got


def test_prefill_scales_queries_and_keys_by_s_of_the_prompt_length():
    cfg = CONFIGS["c8"]
    length, l_orig = 2 * 8 + 3, 5
    q, k, v = make_inputs(cfg, length, seed=21)
    s = length_scale(length, l_orig)
    assert s > 1.1
    got = _scaled_inputs_check(cfg, q, k, v, l_orig, s, torch.full((length,), s))
    torch.testing.assert_close(got.double(), oracle(cfg, q, k, v, l_orig=l_orig), atol=ATOL, rtol=RTOL)
    assert (got - run(cfg, q, k, v)).abs().max() > 1e-3  # the scaling is not a no-op here


def test_chunked_prefill_scales_with_the_full_prompt_length():
    """A prefill chunk that ends at S < prompt length P is scaled by s(P), not s(S)."""
    cfg = CONFIGS["c7"]
    length, prompt, l_orig = 20, 33, 6
    q, k, v = make_inputs(cfg, length, nq=6, seed=22)
    s = length_scale(prompt, l_orig)
    got = _scaled_inputs_check(cfg, q, k, v, l_orig, s, torch.full((length,), s), scale_length=prompt)
    torch.testing.assert_close(
        got.double(), oracle(cfg, q, k, v, l_orig=l_orig, scale_length=prompt), atol=ATOL, rtol=RTOL
    )
    assert (got - run(cfg, q, k, v, original_max_position_embeddings=l_orig)).abs().max() > 1e-4


def test_decode_scales_query_by_current_length_and_keys_by_their_write_length():
    cfg = CONFIGS["c8"]
    prompt, total, l_orig = 10, 30, 4
    q, k, v = make_inputs(cfg, total, seed=23)
    written = torch.tensor([prompt] * prompt + list(range(prompt + 1, total + 1)))
    for n in range(prompt + 1, total + 1):
        kl = written[:n]
        s_k = torch.tensor([length_scale(int(x), l_orig) for x in kl])
        got = _scaled_inputs_check(
            cfg, q[n - 1 : n], k[:n], v[:n], l_orig, length_scale(n, l_orig), s_k, scale_length=n, key_scale_lengths=kl
        )
        want = oracle(cfg, q[n - 1 : n], k[:n], v[:n], l_orig=l_orig, scale_length=n, key_scale_lengths=kl)
        torch.testing.assert_close(got.double(), want, atol=ATOL, rtol=RTOL)
        # a recompute (one-shot prefill of n tokens) scales every key by s(n): not the decode result
        prefill_row = run(cfg, q[:n], k[:n], v[:n], original_max_position_embeddings=l_orig)[-1:]
        assert (got - prefill_row).abs().max() > 1e-5


def test_scale_arguments_refused():
    cfg = CONFIGS["c8"]
    q, k, v = make_inputs(cfg, 12, nq=2)
    with pytest.raises(DcaConfigError, match=r"scale_length \(11\) must be >= the number of keys \(12\)"):
        run(cfg, q, k, v, original_max_position_embeddings=4, scale_length=11)
    with pytest.raises(DcaConfigError, match=r"must lie in \[j \+ 1, scale_length=12\]"):
        run(cfg, q, k, v, original_max_position_embeddings=4, key_scale_lengths=torch.arange(12))  # key j at j
    with pytest.raises(DcaConfigError, match=r"must lie in \[j \+ 1, scale_length=12\]"):
        run(cfg, q, k, v, original_max_position_embeddings=4, key_scale_lengths=torch.full((12,), 13))
    with pytest.raises(DcaConfigError, match=r"integer tensor of shape \[12\]"):
        run(cfg, q, k, v, original_max_position_embeddings=4, key_scale_lengths=torch.full((11,), 12))


# --------------------------------------------------------------------- configuration
def test_config_derived_values():
    cfg = DcaConfig(12, 4)
    assert (cfg.chunk_len, cfg.inter_position, cfg.original_max_position_embeddings) == (8, 12, 0)
    assert DcaConfig(10, 6).inter_position == 7  # c = 4 <= W: 2c - 1 < C
    assert DcaConfig(12, 4, None).original_max_position_embeddings == 0
    assert DcaConfig(**DcaConfig(12, 4, 99).to_dict()) == DcaConfig(12, 4, 99)


@pytest.mark.parametrize(
    "args, message",
    [
        ((0, 1), r"chunk_size must be a positive int, got 0"),
        ((-8, 2), r"chunk_size must be a positive int, got -8"),
        ((8.0, 2), r"chunk_size must be a positive int, got 8.0"),
        ((True, 2), r"chunk_size must be a positive int, got True"),
        ((8, 0), r"local_size must be a positive int, got 0"),
        ((8, "2"), r"local_size must be a positive int, got '2'"),
        ((8, 8), r"local_size \(8\) must be smaller than chunk_size \(8\)"),
        ((8, 9), r"local_size \(9\) must be smaller than chunk_size \(8\)"),
        ((8, 2, -1), r"original_max_position_embeddings must be a non-negative int, got -1"),
        ((8, 2, 1.5), r"original_max_position_embeddings must be a non-negative int, got 1.5"),
    ],
)
def test_bad_configs_refused(args, message):
    with pytest.raises(DcaConfigError, match=message):
        DcaConfig(*args)
    q, k, v = make_inputs(CONFIGS["c8"], 4)
    with pytest.raises(DcaConfigError, match=message):
        dual_chunk_attention(
            q,
            k,
            v,
            chunk_size=args[0],
            local_size=args[1],
            original_max_position_embeddings=args[2] if len(args) > 2 else None,
        )


def test_kv_block_size_must_divide_the_chunk_length():
    cfg = DcaConfig(12, 4)  # c = 8
    for ok in (1, 2, 4, 8):
        cfg.check_kv_block_size(ok)
    for bad in (3, 5, 16):
        with pytest.raises(DcaConfigError, match=rf"12 - 4 = 8 must be a multiple of the KV block size {bad}"):
            cfg.check_kv_block_size(bad)
    for bad in (0, -4, 2.0):
        with pytest.raises(DcaConfigError, match="KV block size must be a positive int"):
            cfg.check_kv_block_size(bad)


QWEN_1M = {
    "architectures": ["Qwen2ForCausalLM"],
    "max_position_embeddings": 1010000,
    "rope_theta": 10000000.0,
    "dual_chunk_attention_config": {
        "chunk_size": 262144,
        "local_size": 8192,
        "original_max_position_embeddings": 262144,
    },
}


def test_from_model_config_dict_file_and_folder(tmp_path):
    cfg = DcaConfig.from_model_config(QWEN_1M)
    assert cfg == DcaConfig(262144, 8192, 262144) and cfg.chunk_len == 253952
    for block in (16, 64, 128, 256):
        cfg.check_kv_block_size(block)
    (tmp_path / "config.json").write_text(json.dumps(QWEN_1M))
    assert DcaConfig.from_model_config(tmp_path) == cfg
    assert DcaConfig.from_model_config(str(tmp_path / "config.json")) == cfg
    # original_max_position_embeddings is optional (0: no length scaling), other keys are ignored
    section = {"chunk_size": 64, "local_size": 16, "sparse_attention_threshold": 32768}
    assert DcaConfig.from_model_config({"dual_chunk_attention_config": section}) == DcaConfig(64, 16, 0)
    off = {"chunk_size": 64, "local_size": 16, "sparse_attention_enabled": False}
    assert DcaConfig.from_dict(off) == DcaConfig(64, 16)


def test_from_model_config_refusals(tmp_path):
    with pytest.raises(DcaConfigError, match="has no 'dual_chunk_attention_config': not a Dual Chunk Attention"):
        DcaConfig.from_model_config({"rope_theta": 1e6})
    with pytest.raises(DcaConfigError, match="missing required key\\(s\\): local_size"):
        DcaConfig.from_model_config({"dual_chunk_attention_config": {"chunk_size": 64}})
    with pytest.raises(DcaConfigError, match="must be a JSON object, got list"):
        DcaConfig.from_model_config({"dual_chunk_attention_config": [64, 16]})
    with pytest.raises(DcaConfigError, match="sparse \\(MInference vertical-slash\\) mode"):
        DcaConfig.from_dict({"chunk_size": 64, "local_size": 16, "sparse_attention_enabled": True})
    with pytest.raises(DcaConfigError, match="local_size \\(64\\) must be smaller"):
        DcaConfig.from_dict({"chunk_size": 64, "local_size": 64})
    with pytest.raises(DcaConfigError, match="model config not found"):
        DcaConfig.from_model_config(tmp_path / "absent.json")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(DcaConfigError, match="is not valid JSON"):
        DcaConfig.from_model_config(tmp_path)


#: An illustrative sparse_attention_config (upstream reads one entry per layer: head -> pattern).
SPARSE = [{"0": ["vertical_and_slash", 1000, 6096, 0.9]}]
SECTION = {"chunk_size": 64, "local_size": 16}


@pytest.mark.parametrize(
    "extra, sparse",
    [
        ({}, False),
        ({"sparse_attention_enabled": False, "sparse_attention_config": SPARSE}, False),  # refused before
        ({"sparse_attention_config": None, "sparse_attention_threshold": 100}, False),
        ({"sparse_attention_config": SPARSE}, True),
        ({"sparse_attention_config": {}}, True),  # upstream: `is not None`
        ({"sparse_attention_enabled": True}, True),
        ({"sparse_attention_enabled": True, "sparse_attention_config": SPARSE}, True),
    ],
)
def test_sparse_keys_follow_upstream_s_effective_flag(extra, sparse):
    """enabled = section.get("sparse_attention_enabled", <a sparse_attention_config is given>):
    refused exactly when upstream would run the sparse prefill; explicit false runs dense."""
    section = {**SECTION, **extra}
    assert dca.sparse_attention_enabled(section) is sparse
    if not sparse:
        assert DcaConfig.from_dict(section) == DcaConfig(64, 16)
        return
    with pytest.raises(DcaConfigError) as err:
        DcaConfig.from_dict(section)
    msg = str(err.value)
    assert "sparse (MInference vertical-slash) mode" in msg and "dense only" in msg and "\n" not in msg
    assert '"sparse_attention_enabled": false' in msg and "over 32768 tokens" in msg


def test_sparse_attention_config_json_beside_the_weights(tmp_path):
    """A folder's sparse_attention_config.json, which vLLM and SGLang merge into the section and
    enable unless sparse_attention_enabled is set: refused naming the file; with the key false it
    is ignored, and a warning says so; an empty one is ignored upstream and here."""
    (tmp_path / "config.json").write_text(json.dumps({"dual_chunk_attention_config": SECTION}))
    sparse_file = tmp_path / dca.SPARSE_CONFIG_FILE
    sparse_file.write_text(json.dumps(SPARSE))
    assert dca.sparse_attention_enabled(SECTION, folder=tmp_path)
    with pytest.raises(DcaConfigError) as err:
        DcaConfig.from_model_config(tmp_path)
    msg = str(err.value)
    assert msg.startswith(str(sparse_file) + ": vLLM and SGLang merge this file")
    assert "dense only" in msg and '"sparse_attention_enabled": false in dual_chunk_attention_config' in msg
    with pytest.raises(DcaConfigError, match="sparse_attention_config.json: vLLM"):
        DcaConfig.from_dict(SECTION, folder=tmp_path)
    # a parsed dict says nothing about a folder unless told which
    assert DcaConfig.from_model_config({"dual_chunk_attention_config": SECTION}) == DcaConfig(64, 16)
    with pytest.raises(DcaConfigError, match="sparse_attention_config.json: vLLM"):
        DcaConfig.from_model_config({"dual_chunk_attention_config": SECTION}, folder=tmp_path)
    off = {**SECTION, "sparse_attention_enabled": False}
    (tmp_path / "config.json").write_text(json.dumps({"dual_chunk_attention_config": off}))
    with pytest.warns(
        UserWarning, match="sparse_attention_config.json is ignored: .*sparse_attention_enabled is false"
    ):
        assert DcaConfig.from_model_config(tmp_path) == DcaConfig(64, 16)
    on = {**SECTION, "sparse_attention_enabled": True}
    with pytest.raises(DcaConfigError, match="sparse_attention_enabled is true"):
        DcaConfig.from_dict(on, folder=tmp_path)
    with pytest.raises(DcaConfigError, match="sparse_attention_enabled must be true or false, got 'false'"):
        DcaConfig.from_dict({**SECTION, "sparse_attention_enabled": "false"})
    sparse_file.write_text("{}")
    assert not dca.sparse_attention_enabled(SECTION, folder=tmp_path)
    assert DcaConfig.from_dict(SECTION, folder=tmp_path) == DcaConfig(64, 16)
    sparse_file.write_text("[{not json")
    with pytest.raises(DcaConfigError, match="sparse_attention_config.json cannot be read as JSON"):
        DcaConfig.from_dict(SECTION, folder=tmp_path)


def test_bad_inputs_refused():
    cfg = CONFIGS["c8"]
    q, k, v = make_inputs(cfg, 6)
    cases = [
        (dict(q=q[:, :3]), r"query heads \(3\) must be a multiple of KV heads \(2\)"),
        (dict(q=q[..., :6]), r"k's head_dim \(8\) must equal q's \(6\)"),
        (dict(v=v[:5]), r"v must have k's tokens and heads"),
        (dict(q=torch.randn(7, 4, 8)), r"queries \(7\) <= keys \(6\)"),
        (dict(q=q[0]), r"q must have 3 dims"),
        (dict(k=k.long()), r"k must be a floating tensor"),
        (dict(rotary_dim=3), r"rotary_dim must be an even int in \[2, head_dim=8\], got 3"),
        (dict(rotary_dim=10), r"rotary_dim must be an even int"),
        (dict(rope_theta=0.0), r"rope_theta must be a positive number"),
        (dict(softmax_scale=-1.0), r"softmax_scale must be None or a positive number"),
    ]
    for change, message in cases:
        args = dict(q=q, k=k, v=v, chunk_size=12, local_size=4) | change
        with pytest.raises(DcaConfigError, match=message):
            dual_chunk_attention(**args)


def test_softmax_scale_default_is_head_dim_rsqrt():
    cfg = CONFIGS["c8"]
    q, k, v = make_inputs(cfg, 19, nq=3)
    torch.testing.assert_close(run(cfg, q, k, v), run(cfg, q, k, v, softmax_scale=8**-0.5), atol=0, rtol=0)
    torch.testing.assert_close(run(cfg, q, k, v, softmax_scale=0.5), run(cfg, q * 0.5 * 8**0.5, k, v))


# --------------------------------------------------------------------- random configurations
@settings(max_examples=40, deadline=None)
@given(
    big_c=st.integers(2, 12),
    w_frac=st.floats(0.0, 1.0),
    chunks=st.floats(0.0, 4.5),
    hkv=st.integers(1, 2),
    group=st.integers(1, 3),
    half_dim=st.integers(1, 3),
    rot_frac=st.floats(0.0, 1.0),
    theta=st.sampled_from([7.0, 100.0, 10000.0]),
    nq_pick=st.integers(1, 5),
    l_orig=st.one_of(st.none(), st.integers(1, 40)),
    seed=st.integers(0, 2**16),
)
def test_random_configs_match_definition(
    big_c, w_frac, chunks, hkv, group, half_dim, rot_frac, theta, nq_pick, l_orig, seed
):
    w = 1 + int(w_frac * (big_c - 2))  # 1 <= W < C
    c = big_c - w
    length = max(1, int(chunks * c) + 1)
    hd = 2 * half_dim
    cfg = dict(C=big_c, W=w, H=hkv * group, Hkv=hkv, D=hd, rd=2 * max(1, round(rot_frac * half_dim)), theta=theta)
    q, k, v = make_inputs(cfg, length, nq=min(nq_pick, length), seed=seed)
    got = run(cfg, q, k, v, original_max_position_embeddings=l_orig)
    torch.testing.assert_close(got.double(), oracle(cfg, q, k, v, l_orig=l_orig), atol=ATOL, rtol=RTOL)
