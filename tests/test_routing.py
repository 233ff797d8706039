"""Unlimited-OCR-2's routing (docs/spec.md step 4): entmax-1.5 and ``route_blocks`` against
independent float64 formulations and hand-derived cases, and the whole function against
outputs of vLLM 0.34.0's own module (golden vectors, tests/data/vllm_dash_golden.npz, made by
scripts/vllm_golden.py; vLLM is not needed to run these tests)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dash_trt.attention.dash import paged as P
from dash_trt.attention.dash import reference as R
from dash_trt.attention.dash.config import DashConfig, DashConfigError

GOLDEN = Path(__file__).resolve().parent / "data" / "vllm_dash_golden.npz"
NOT_CANDIDATE = -1e4


# ============================================================ independent float64 formulations
def entmax15_bisect(x: list[float]) -> list[float]:
    """entmax-1.5 by its definition: p_i = max(x_i / 2 - tau, 0)^2, sum p = 1, tau by bisection."""
    z = [v / 2 for v in x]
    lo, hi = max(z) - 1.0, max(z)
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(max(v - mid, 0.0) ** 2 for v in z) >= 1.0 else (lo, mid)
    return [max(v - lo, 0.0) ** 2 for v in z]


def route_row(
    scores: list[float], candidate: list[bool], *, di: int, topk: int, sigma: float, scale: float, floor: float
) -> tuple[list[int], list[float], list[bool]]:
    """One query's routing from docs/spec.md in plain Python (float64)."""
    n = len(scores)
    remote = [s > -5e8 for s in scores]
    own = [c and r for c, r in zip(candidate, remote)]
    cand = own if any(own) else remote
    x = []
    for b in range(n):
        v = scores[b] * scale / math.sqrt(di) if cand[b] else NOT_CANDIDATE
        x.append(NOT_CANDIDATE if not math.isfinite(v) else v)
    m = min(16, n)
    top = sorted(range(n), key=lambda b: (-x[b], b))[:m]
    prior = entmax15_bisect([x[b] for b in top])
    k = min(topk, m)
    kept, prior = top[:k], prior[:k]
    valid = [cand[b] for b in kept]
    logs = [math.log(max(p, floor)) for p in prior]
    mean = sum(lg for lg, v in zip(logs, valid) if v) / max(sum(valid), 1)
    bias = [(lg - mean) / sigma if v else 0.0 for lg, v in zip(logs, valid)]
    return kept, bias, valid


def _cfg(**kw) -> DashConfig:
    return DashConfig.from_dict({"sparse_block_size": 4, "sparse_local_block": 1, "sparse_index_dim": 4, **kw})


# ================================================================================ entmax
@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(-30, 30, allow_nan=False, width=32), min_size=1, max_size=16), st.integers(0, 5))
def test_entmax15_equals_its_definition(values, n_low):
    """The closed form over sorted values against bisection, with -1e4 entries (blocks a query
    may not select) and ties mixed in."""
    values = values + [NOT_CANDIDATE] * min(n_low, 16 - len(values))
    got = R.entmax15(torch.tensor([values], dtype=torch.float32))[0].double().tolist()
    want = entmax15_bisect(values)
    assert sum(got) == pytest.approx(1.0, abs=1e-5)
    assert got == pytest.approx(want, abs=2e-6)


def test_entmax15_hand_values():
    """Two values 1 and 0: halved and shifted, 0 and -0.5, both in the support; tau solves
    (-tau)^2 + (-0.5 - tau)^2 = 1: tau = (-1 - sqrt(7)) / 4."""
    tau = (-1 - math.sqrt(7)) / 4
    got = R.entmax15(torch.tensor([[1.0, 0.0]]))[0].tolist()
    assert got == pytest.approx([tau**2, (-0.5 - tau) ** 2], abs=1e-6)
    # far apart: the top value takes everything; equal values share equally
    assert R.entmax15(torch.tensor([[5.0, 0.0, -3.0]]))[0].tolist() == [1.0, 0.0, 0.0]
    assert R.entmax15(torch.tensor([[NOT_CANDIDATE] * 4]))[0].tolist() == pytest.approx([0.25] * 4)


# =========================================================================== route_blocks
@settings(max_examples=120, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    nq=st.integers(1, 5),
    n=st.integers(1, 40),
    topk=st.integers(1, 20),
    integer_scores=st.booleans(),
    sigma=st.sampled_from([1.0, 0.5, 3.0]),
    scale=st.sampled_from([128.0, 8.0, 0.5]),
    floor=st.sampled_from([1e-4, 1e-2, 0.5]),
)
def test_route_blocks_equals_its_definition(seed, nq, n, topk, integer_scores, sigma, scale, floor):
    """Random scores (integers: many ties) and candidates, some blocks not remote: the
    selection equals the float64 definition's exactly, validity too, and the bias within
    float32 rounding of the routing values."""
    gen = torch.Generator().manual_seed(seed)
    if integer_scores:
        scores = torch.randint(-3, 4, (nq, n), generator=gen).float()
    else:
        scores = torch.randn(nq, n, generator=gen) * 2
    scores[torch.rand(nq, n, generator=gen) < 0.3] = R.NOT_REMOTE
    candidate = torch.rand(nq, n, generator=gen) < 0.3
    cfg = _cfg(dash_topk_blocks=topk, dash_sigma=sigma, dash_scaling_factor=scale, dash_prior_floor=floor)
    sel, bias, valid = R.route_blocks(scores, candidate, cfg, 0)
    assert sel.dtype == torch.int64 and bias.dtype == torch.float32 and valid.dtype == torch.bool
    assert sel.shape == (nq, min(topk, 16, n))
    for i in range(nq):
        kept, want_bias, want_valid = route_row(
            scores[i].tolist(), candidate[i].tolist(), di=4, topk=topk, sigma=sigma, scale=scale, floor=floor
        )
        assert sel[i].tolist() == kept
        assert valid[i].tolist() == want_valid
        assert bias[i].tolist() == pytest.approx(want_bias, abs=1e-4 + 1e-5 * scale)


def _hand(scores, candidate, **cfg):
    sel, bias, valid = R.route_blocks(torch.tensor([scores]), torch.tensor([candidate]), _cfg(**cfg), 0)
    return sel[0].tolist(), bias[0].tolist(), valid[0].tolist()


# sparse_index_dim 4 and scale 2: the routing value x of a candidate is its score.
X = {"dash_scaling_factor": 2.0}
NR = R.NOT_REMOTE


def test_fewer_candidates_than_k():
    """Blocks 2 and 4 are the page's remote image blocks (scores 1 and 0); K = 4 keeps them and two
    blocks the query may not select (value -1e4, lowest index first: 0 and 1), invalid. The
    prior: halved and shifted, 0 and -0.5; tau = (-1 - sqrt 7) / 4; bias +-(log p2 - log p4) / 2."""
    sel, bias, valid = _hand(
        [5.0, 9.0, 1.0, NR, 0.0, 3.0], [False, True, True, True, True, False], dash_topk_blocks=4, **X
    )
    # block 1 is on the page but scores 9 ... and it is remote: the candidates are 1, 2, 4
    assert sel[:3] == [1, 2, 4] and valid == [True, True, True, False]
    sel, bias, valid = _hand(
        [5.0, 9.0, 1.0, NR, 0.0, 3.0], [False, False, True, True, True, False], dash_topk_blocks=4, **X
    )
    assert sel == [2, 4, 0, 1] and valid == [True, True, False, False]
    tau = (-1 - math.sqrt(7)) / 4
    b = (math.log(tau**2) - math.log((-0.5 - tau) ** 2)) / 2
    assert bias == pytest.approx([b, -b, 0.0, 0.0], abs=1e-5)


def test_no_candidate_falls_back_to_every_remote_block():
    """The query's page has no remote image block (block 3 is its page's but not remote): every
    remote block competes, K = 2 keeps the two best."""
    sel, bias, valid = _hand([0.25, 2.0, 1.0, NR], [False, False, False, True], dash_topk_blocks=2, **X)
    assert sel == [1, 2] and valid == [True, True]
    assert bias[0] == pytest.approx(-bias[1]) and bias[0] > 0
    # nothing remote at all: nothing valid, no bias
    sel, bias, valid = _hand([NR, NR, NR], [True, False, True], dash_topk_blocks=2, **X)
    assert valid == [False, False] and bias == [0.0, 0.0]


def test_ties_at_the_kth_and_16th_rank_go_to_the_lower_index():
    """20 remote blocks, every one a candidate (fallback). Values 10 for blocks 0..13, 5 for 14..19:
    rank 16 and 17 tie (blocks 15, 16): the 16 the prior sees are 0..15; K = 15 keeps 0..14
    (ties at rank 15 too: block 14 before 15)."""
    scores = [10.0] * 14 + [5.0] * 6
    sel, bias, valid = _hand(scores, [False] * 20, dash_topk_blocks=15, **X)
    assert sel == list(range(15)) and all(valid)
    sel16, _, _ = _hand(scores, [False] * 20, dash_topk_blocks=16, **X)
    assert sel16 == list(range(16))
    # the 14 equal top values share the prior; the 5s are outside its support (gap 2.5 > 1)
    assert bias[:14] == pytest.approx([bias[0]] * 14) and bias[14] < bias[0]


def test_floor_bites_and_sigma_divides():
    """Values 5, 0, -3: halved and shifted 0, -2.5, -4: the support is the top alone, p = 1, 0, 0.
    The logs are 0, log f, log f; centred and divided by sigma."""
    for floor, sigma in ((1e-4, 1.0), (1e-2, 0.5)):
        sel, bias, valid = _hand(
            [5.0, 0.0, -3.0], [False] * 3, dash_topk_blocks=3, dash_prior_floor=floor, dash_sigma=sigma, **X
        )
        lf = math.log(floor)
        mean = 2 * lf / 3
        assert sel == [0, 1, 2]
        assert bias == pytest.approx([-mean / sigma, (lf - mean) / sigma, (lf - mean) / sigma], abs=1e-5)


def test_one_valid_block_has_bias_zero():
    sel, bias, valid = _hand([3.0, 1.0, 2.0], [False, True, False], dash_topk_blocks=12, **X)
    assert sel[0] == 1 and valid == [True, False, False] and bias == [0.0, 0.0, 0.0]


def test_non_finite_scores_are_not_selectable():
    sel, bias, valid = _hand([math.nan, 1.0, math.inf, 0.5], [False] * 4, dash_topk_blocks=4, **X)
    # NaN and inf become -1e4: they sort after the finite values, ties by index
    assert sel == [1, 3, 0, 2]


def test_per_layer_values_are_indexed_by_slot():
    """sparse_attention_freq [1, 0, 1, 1]: layers 0, 2, 3 are DASH layers, slots 0, 1, 2. Layer 2
    routes with the second entries of the lists, the same as a config with those scalars."""
    gen = torch.Generator().manual_seed(0)
    scores, cand = torch.randn(6, 24, generator=gen) * 3, torch.rand(6, 24, generator=gen) < 0.2
    lists = _cfg(
        sparse_attention_freq=[1, 0, 1, 1],
        dash_scale_per_layer=[128.0, 7.0, 30.0],
        dash_floor_per_layer=[1e-4, 0.05, 1e-3],
    )
    for layer, (scale, floor) in ((0, (128.0, 1e-4)), (2, (7.0, 0.05)), (3, (30.0, 1e-3))):
        got = R.route_blocks(scores, cand, lists, layer)
        want = R.route_blocks(scores, cand, _cfg(dash_scaling_factor=scale, dash_prior_floor=floor), 0)
        for g, w in zip(got, want):
            assert torch.equal(g, w), layer
    assert lists.routing(2) == (12, 1.0, 7.0, 0.05)
    assert lists.for_layer(3).routing(0) == lists.routing(3)
    with pytest.raises(DashConfigError, match="layer 1 is not a DASH layer"):
        R.route_blocks(scores, cand, lists, 1)
    with pytest.raises(DashConfigError, match="lists 4 layers, no entry for layer 4"):
        R.route_blocks(scores, cand, lists, 4)
    short = _cfg(dash_scale_per_layer=[1.0])
    with pytest.raises(DashConfigError, match="dash_scale_per_layer lists 1 DASH layers, no entry for layer 1"):
        R.route_blocks(scores, cand, short, 1)


# ======================================================================= vLLM golden vectors
def _golden_cases():
    data = np.load(GOLDEN)
    manifest = json.loads(bytes(data["manifest"]).decode())
    return data, manifest


def _case(data, c):
    def t(field):
        return torch.from_numpy(data[f"{c['name']}.{field}"].astype(np.float32))

    roles = torch.from_numpy(data[f"{c['name']}.roles"].astype(np.int64))
    return roles, t("q"), t("k"), t("v"), t("iq"), t("ik"), t("head_cls"), t("out")


@pytest.mark.parametrize("index", range(6))
def test_reference_equals_vllm_dash_attention(index):
    """The reference on each golden case (random documents, GQA, prompt_length set and not,
    per-layer lists over a layer map with a non-DASH layer, block sizes 16 and 32, K above and
    below 16) equals vLLM 0.34.0's dash_attention within 1e-5."""
    data, manifest = _golden_cases()
    c = manifest[index]
    roles, q, k, v, iq, ik, head_cls, want = _case(data, c)
    got = R.dash_attention(
        q, k, v, iq, ik, roles, head_cls, DashConfig.from_dict(c["sp"]), c["layer"], c["prompt_length"]
    )
    assert float((got - want).abs().max()) <= 1e-5


@pytest.mark.parametrize("index", range(6))
def test_paged_operator_equals_vllm_dash_attention(index):
    """The paged operator, prompt in three chunks then one token at a time over a shuffled block
    table of KV blocks of 32, gives vLLM's outputs for the golden queries within 1e-5."""
    data, manifest = _golden_cases()
    c = manifest[index]
    roles, q, k, v, iq, ik, head_cls, want = _case(data, c)
    cfg = DashConfig.from_dict(c["sp"])
    s, nq = c["length"], c["queries"]
    kv_block = 32 if 32 % cfg.sparse_block_size == 0 else cfg.sparse_block_size
    nb = -(-s // kv_block)
    gen = torch.Generator().manual_seed(index)
    table = torch.randperm(nb + 3, generator=gen)[:nb].to(torch.int32)[None]
    cache = P.DashKVCache.allocate(nb + 3, kv_block, k.shape[1], k.shape[2], ik.shape[1], cfg.sparse_block_size)
    coords = P.sequence_coords(roles)
    prompt = -1 if c["prompt_length"] is None else c["prompt_length"]
    qfull = torch.cat([torch.zeros(s - nq, *q.shape[1:]), q])  # earlier queries' outputs are not checked
    iqfull = torch.cat([torch.zeros(s - nq, iq.shape[1]), iq])
    first = s - nq
    steps = [first // 3, first // 3, first - 2 * (first // 3)] + [1] * nq
    outs, done = [], 0
    for n in filter(None, steps):
        rows = slice(done, done + n)
        out = P.paged_dash_attention(
            qfull[rows],
            k[rows],
            v[rows],
            iqfull[rows],
            ik[rows],
            coords[rows],
            head_cls,
            cache,
            table,
            torch.tensor([done + n], dtype=torch.int32),
            torch.tensor([0, n], dtype=torch.int32),
            torch.tensor([prompt], dtype=torch.int32),
            cfg,
            c["layer"],
        )
        outs.append(out)
        done += n
    got = torch.cat(outs)[first:]
    assert float((got - want).abs().max()) <= 1e-5


def test_golden_file_is_what_the_script_describes():
    """The cases cover what docs/spec.md asks of the check: several pages, GQA, both
    prompt_length modes, per-layer lists, block sizes 16 and 32, more than 16 blocks."""
    data, manifest = _golden_cases()
    assert len(manifest) == 6
    assert {c["sp"]["sparse_block_size"] for c in manifest} == {16, 32}
    assert {c["prompt_length"] is None for c in manifest} == {True, False}
    assert any("dash_scale_per_layer" in c["sp"] for c in manifest)
    assert any(c["length"] // c["sp"]["sparse_block_size"] > 16 for c in manifest)
    for c in manifest:
        roles = data[f"{c['name']}.roles"]
        assert (roles == 2).sum() >= 4 and data[f"{c['name']}.q"].shape[1] > data[f"{c['name']}.k"].shape[1]
