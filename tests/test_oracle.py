"""An independent oracle of DASH attention, written from docs/spec.md alone, against the reference
and the paged operator.

The paged operator imports the reference's stages (RoPE, summaries, scores, routing, attention), so
"paged equals reference" cannot see a bug in a shared stage. The oracle below re-derives the whole
function from the written definition with plain Python loops over tokens, heads and blocks (float64
arithmetic, torch only for small vector math); it imports nothing from ``dash_trt.attention.dash.reference`` or
``dash_trt.attention.dash.paged`` except the role constants and the public entry points under test.

What this file proves:

1. hand-derived cases (routing sets written out by hand, not computed): page coordinates, score
   ties, the own-page restriction and its fallback to every remote block, ``prompt_length`` with
   K 1 and 2, every block kept, the local window, and two attention outputs from a closed formula
   (one with the entmax prior's bias worked out by hand); each checked on the oracle, the
   reference and the paged operator;
2. the oracle equals ``dash_attention`` on random problems over random configurations: every
   block's score, the selected sets and their biases (only genuine near-ties may differ) and the
   output within float32 tolerances;
3. the same against ``paged_dash_attention`` driven over a ``KVBlockPool`` (sequences interleaved,
   chunked prefill then decode), with page coordinates from the oracle, not from the package.

Readings of docs/spec.md where the text admits two (the oracle takes the first, as the reference
does; see ``test_coordinates_run_continues_across_the_prompt_boundary`` and
``test_own_page_by_an_image_token_past_prompt_length``):

- ``tok``: "its run of equal page" is a run of the whole sequence, so a response run that
  continues the prompt's last run (one page, no text after its images, the response starting with
  ``<PAGE>``) is offset from the run's start in the prompt *and* shifted by the prompt count;
- a block's image pages are those of all its image tokens, also those past ``prompt_length``
  (vLLM 0.34.0's module reads it so too).

The oracle's entmax-1.5 is its definition solved by bisection in float64 (``p_i = max(x_i / 2 -
tau, 0) ** 2`` summing to 1), not the closed form the package uses.

Step 3's edge case is part of the definition and of the oracle: a token of a block that does not
count (past ``prompt_length``, or past the sequence's end, whose padded index key has logit 0) still
enters ``exp(logit - max)``; where that overflows float32 the summary is ``inf * 0 = nan``, hence 0
(``test_an_uncounted_token_far_above_the_counted_ones_zeroes_the_summary``).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from dash_trt.attention.dash.config import DashConfig
from dash_trt.attention.dash.paged import DashKVCache, paged_dash_attention, sequence_coords
from dash_trt.attention.dash.reference import ROLE_IMAGE, ROLE_PAGE, ROLE_TEXT, dash_attention
from dash_trt.serving.block_pool import KVBlockPool
from dash_trt.testing import random_config, random_inputs, random_roles

NOT_REMOTE = -1e9  # docs/spec.md step 4: the score of a block that is not remote
CLAMP = 1e4
ATOL = RTOL = 2e-5  # float32 outputs against the float64 oracle
SCORE_TOL = 1e-4  # float32 scores against the oracle's
TIE_TOL = 1e-4  # blocks whose routing values are this close (relative) to the K-th may swap
BIAS_TOL = 1e-3  # float32 biases against the oracle's (the log prior amplifies score rounding)
TOP_M = 16  # blocks ranked before the prior (docs/spec.md step 4)
NOT_CANDIDATE = -1e4
FLOAT32_EXP_MAX = math.log(float(np.finfo(np.float32).max))  # exp above this is inf in float32

T, I, P = ROLE_TEXT, ROLE_IMAGE, ROLE_PAGE  # noqa: E741 - the roles, one letter each


# =============================================================================== the oracle
def oracle_coordinates(roles) -> tuple[list[int], list[int], list[int], list[int]]:
    """docs/spec.md step 1: (tok, page, image_page, query_page) of every position."""
    roles = [int(r) for r in roles]
    n = len(roles)
    images = [i for i, r in enumerate(roles) if r == ROLE_IMAGE]
    if not images:
        raise ValueError("no image token")
    cum, seen = [], 0
    for r in roles:
        seen += r == ROLE_PAGE
        cum.append(seen)
    if any(cum[i] == 0 for i in images):
        raise ValueError("an image token before the first <PAGE>")
    last = images[-1]  # the prompt ends at its last image token
    pages = cum[last]
    # response tokens count only response markers, never more than the prompt's pages
    page = [cum[i] if i <= last else min(cum[i] - pages, pages) for i in range(n)]
    prompt_count = [0] * (pages + 1)
    for i in range(last + 1):
        prompt_count[page[i]] += 1
    tok, run_start, last_marker = [], 0, -1
    for i in range(n):
        if i == 0 or page[i] != page[i - 1]:
            run_start = i
        if i <= last:
            tok.append(i - run_start)
            continue
        if roles[i] == ROLE_PAGE:
            last_marker = i
        if cum[i] - pages > pages:  # a response marker past the last page restarts the count
            tok.append(prompt_count[pages] + i - last_marker)
        else:
            tok.append(prompt_count[page[i]] + i - run_start)
    image_page = [cum[i] - 1 if roles[i] == ROLE_IMAGE else -1 for i in range(n)]
    query_page = [cum[i] - 1 if i <= last else cum[i] - pages - 1 for i in range(n)]
    return tok, page, image_page, query_page


def _round(values: list[float], dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64).to(dtype).double()


def oracle_rope(x: torch.Tensor, tok, page, cfg: DashConfig, *, main: bool) -> torch.Tensor:
    """docs/spec.md step 2 on ``x`` [S, ..., dim], one token at a time; float64 result rounded
    to ``x``'s dtype."""
    dim = x.shape[-1]
    half, p = dim // 2, cfg.sparse_rope_page_pairs
    assert half > p
    mode = cfg.sparse_main_rope_tok_freq_mode if main else cfg.sparse_rope_tok_freq_mode
    n = half if mode == "truncate" else half - p
    out = torch.empty(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        pg = page[t] % cfg.sparse_rope_page_mod if cfg.sparse_rope_page_mod > 0 else page[t]
        angles = []
        for i in range(half):
            if i < half - p:
                a = tok[t] / cfg.sparse_rope_tok_theta ** (i / n)
            else:
                a = pg / cfg.sparse_rope_page_theta ** ((i - (half - p)) / p)
            angles.append(float(np.float32(a)))  # float32 angles
        cos = _round([math.cos(a) for a in angles], x.dtype)
        sin = _round([math.sin(a) for a in angles], x.dtype)
        row = x[t].double()
        lo, hi = row[..., :half], row[..., half:]
        out[t, ..., :half] = lo * cos - hi * sin
        out[t, ..., half:] = hi * cos + lo * sin
    return out.to(x.dtype).double()


def oracle_index_rope(x, tok, page, cfg) -> torch.Tensor:
    """Rotated iq/ik taken to float32, non-finite values set to 0 (float64 result)."""
    r = oracle_rope(x, tok, page, cfg, main=False).float()
    r[~torch.isfinite(r)] = 0.0
    return r.double()


def oracle_entmax15(values: list[float]) -> list[float]:
    """entmax-1.5 by its definition: ``p_i = max(x_i / 2 - tau, 0) ** 2`` with the ``tau`` that
    makes the ``p`` sum to 1, found by bisection in float64 (the sum falls from >= 1 at
    ``max / 2 - 1`` to 0 at ``max / 2``)."""
    z = [v / 2 for v in values]
    lo, hi = max(z) - 1.0, max(z)
    for _ in range(200):
        mid = (lo + hi) / 2
        if sum(max(x - mid, 0.0) ** 2 for x in z) >= 1.0:
            lo = mid
        else:
            hi = mid
    return [max(x - lo, 0.0) ** 2 for x in z]


def _clamp(x: float) -> float:
    return min(max(x, -CLAMP), CLAMP)


@dataclass
class OracleResult:
    """The oracle's answer for the last Q positions of one sequence."""

    out: torch.Tensor  # [Q, H, D] float64
    selected: list[set[int]]  # selected blocks of each query that it reads (valid)
    bias: list[dict[int, float]]  # the bias of each of them
    scores: list[list[float]]  # every block's score, NOT_REMOTE when not remote
    values: list[list[float]] = field(default_factory=list)  # routing values, NOT_CANDIDATE where not selectable
    coords: list[tuple[int, int, int, int]] = field(default_factory=list)  # every position


def oracle(
    q, k, v, iq, ik, roles, head_cls, cfg: DashConfig, layer: int, prompt_length: int | None = None
) -> OracleResult:
    """DASH attention of docs/spec.md, steps 1-5, for the queries ``q`` [Q, H, D] (the last Q
    positions) against ``k``/``v`` [S, Hkv, D]."""
    s, nq = len(roles), q.shape[0]
    bs, lb = cfg.sparse_block_size, cfg.sparse_local_block
    window = lb * bs
    tok, page, image_page, query_page = oracle_coordinates(roles)
    first = s - nq
    q_rot = oracle_rope(q, tok[first:], page[first:], cfg, main=True)
    k_rot = oracle_rope(k, tok, page, cfg, main=True)
    iq_rot = oracle_index_rope(iq, tok[first:], page[first:], cfg)
    ik_rot = oracle_index_rope(ik, tok, page, cfg)
    vv = v.double()
    hc = head_cls.double()
    di, d = ik.shape[-1], q.shape[-1]

    # step 3: block summaries over the tokens that count
    nblk = -(-s // bs)
    summaries, block_pages = [], []
    for b in range(nblk):
        members = range(b * bs, min((b + 1) * bs, s))
        block_pages.append({image_page[t] for t in members if roles[t] == ROLE_IMAGE})
        counted = [t for t in members if prompt_length is None or t < prompt_length]
        summ = torch.zeros(di, dtype=torch.float64)
        if counted:
            logits = [_clamp(float(ik_rot[t] @ hc) / math.sqrt(di)) for t in counted]
            top = max(logits)
            e = [math.exp(lg - top) for lg in logits]
            z = max(sum(e), 1e-6)
            for t, et in zip(counted, e):
                summ += (et / z) * ik_rot[t]
            # The tokens that do not count (past prompt_length; past the sequence, whose padded
            # key has logit 0) enter exp(logit - max) too before being zeroed: where that
            # overflows float32, inf * 0 makes the summary nan, hence 0.
            others = [_clamp(float(ik_rot[t] @ hc) / math.sqrt(di)) for t in members if t not in counted]
            others += [0.0] * (bs - len(members))
            if any(lg - top > FLOAT32_EXP_MAX for lg in others):
                summ = torch.full((di,), math.nan, dtype=torch.float64)
        summ = summ.float()
        summ[~torch.isfinite(summ)] = 0.0
        summaries.append(summ.double())

    # step 4: the layer's routing values (its slot in the layer map indexes the per-layer lists)
    freq = cfg.sparse_attention_freq
    slot = layer if freq is None else sum(1 for f in freq[:layer] if f)
    scale = cfg.dash_scale_per_layer[slot] if cfg.dash_scale_per_layer else cfg.dash_scaling_factor
    floor = cfg.dash_floor_per_layer[slot] if cfg.dash_floor_per_layer else cfg.dash_prior_floor
    m = min(TOP_M, nblk)
    kk = min(cfg.dash_topk_blocks, m)

    nh, hkv = q.shape[1], k.shape[1]
    group = nh // hkv
    out = torch.empty(nq, nh, d, dtype=torch.float64)
    res = OracleResult(out, [], [], [], [], list(zip(tok, page, image_page, query_page)))
    for j in range(nq):
        pos = first + j
        qp = query_page[pos]
        remote = [b <= pos // bs - lb and (prompt_length is None or b * bs < prompt_length) for b in range(nblk)]
        scores = [
            _clamp(float(iq_rot[j] @ summaries[b]) / math.sqrt(di)) if remote[b] else NOT_REMOTE for b in range(nblk)
        ]
        own = [remote[b] and qp in block_pages[b] for b in range(nblk)]
        cand = own if any(own) else remote  # own-page image blocks only, if the page has any remote
        values = [scores[b] * scale / math.sqrt(di) if cand[b] else NOT_CANDIDATE for b in range(nblk)]
        top = sorted(range(nblk), key=lambda b: (-values[b], b))[:m]
        prior = oracle_entmax15([values[b] for b in top])
        kept = [(b, p) for b, p in zip(top[:kk], prior[:kk]) if cand[b]]
        logs = {b: math.log(max(p, floor)) for b, p in kept}
        mean = sum(logs.values()) / max(len(logs), 1)
        bias_of = {b: (lg - mean) / cfg.dash_sigma for b, lg in logs.items()}
        res.selected.append(set(bias_of))
        res.bias.append(bias_of)
        res.scores.append(scores)
        res.values.append(values)

        # step 5: keys of the selected blocks before the window, then the window
        keys, bias = [], []
        for b, bias_b in bias_of.items():
            for p in range(b * bs, (b + 1) * bs):
                if p <= pos - window and (prompt_length is None or p < prompt_length):
                    keys.append(p)
                    bias.append(bias_b)
        for p in range(pos - window + 1, pos + 1):
            if p >= 0:
                keys.append(p)
                bias.append(0.0)
        bias_t = torch.tensor(bias, dtype=torch.float64)
        for h in range(nh):
            kh = h // group  # GQA
            logits = k_rot[keys, kh] @ q_rot[j, h] / math.sqrt(d) + bias_t
            w = torch.softmax(logits, 0)
            out[j, h] = w @ vv[keys, kh]
    return res


# ====================================================================== drivers and checks
@dataclass
class Got:
    """An implementation's answer for some tokens, in the oracle's terms."""

    out: torch.Tensor
    selected: list[set[int]]
    bias: list[dict[int, float]]
    scores: list[list[float]]


def _routing_rows(routing, rows) -> tuple[list[set[int]], list[dict[int, float]], list[list[float]]]:
    sel, bias, scores = [], [], []
    for r in rows:
        s, bs = routing.selected[r].tolist(), routing.bias[r].tolist()
        sel.append({b for b in s if b >= 0})
        bias.append({b: x for b, x in zip(s, bs) if b >= 0})
        scores.append(routing.scores[r].tolist())
    return sel, bias, scores


def run_reference(x, cfg, layer, prompt_length=None, nq=None) -> Got:
    nq = x.length if nq is None else nq
    out, routing = dash_attention(
        x.q[-nq:], x.k, x.v, x.iq[-nq:], x.ik, x.roles, x.head_cls, cfg, layer, prompt_length, return_routing=True
    )
    return Got(out, *_routing_rows(routing, range(nq)))


def run_oracle(x, cfg, layer, prompt_length=None, nq=None) -> OracleResult:
    nq = x.length if nq is None else nq
    return oracle(x.q[-nq:], x.k, x.v, x.iq[-nq:], x.ik, x.roles.tolist(), x.head_cls, cfg, layer, prompt_length)


def run_paged(seqs, cfg, layer, kv_block_size, plans, gen) -> list[Got]:
    """Every sequence of ``seqs`` = [(inputs, prompt_length, coords [S, 4]), ...] through
    ``paged_dash_attention`` over one pool: each step takes the next chunk of ``plans[i]`` of a
    random subset of the live sequences, in random order (their blocks interleave in the pool).
    The cache starts as garbage: nothing may read an unwritten slot."""
    hkv, d = seqs[0][0].k.shape[1:]
    di = seqs[0][0].ik.shape[1]
    num_blocks = sum(-(-x.length // kv_block_size) for x, _, _ in seqs) + 2
    pool = KVBlockPool(num_blocks, kv_block_size)
    cache = DashKVCache.allocate(num_blocks, kv_block_size, hkv, d, di, cfg.sparse_block_size)
    for t in cache.tensors().values():
        if t.dtype.is_floating_point:
            t.copy_(torch.randn(t.shape, generator=gen) * 100.0)
    for i, (_, prompt_length, _) in enumerate(seqs):
        pool.add(i, prompt_length=prompt_length)
    plans = [list(p) for p in plans]
    for (x, _, _), plan in zip(seqs, plans):
        assert sum(plan) == x.length
    done = [0] * len(seqs)
    outs = [[] for _ in seqs]
    got = [Got(None, [], [], []) for _ in seqs]
    while any(plans):
        live = [i for i in range(len(seqs)) if plans[i]]
        pick = [i for i in live if float(torch.rand(1, generator=gen)) < 0.7] or live[:1]
        pick = [pick[j] for j in torch.randperm(len(pick), generator=gen).tolist()]
        step = [(i, plans[i].pop(0)) for i in pick]
        batch = pool.schedule(step)
        rows = [(i, done[i], done[i] + n) for i, n in step]

        def cat(get, rows=rows):
            return torch.cat([get(i)[a:b] for i, a, b in rows])

        out, routing = paged_dash_attention(
            cat(lambda i: seqs[i][0].q),
            cat(lambda i: seqs[i][0].k),
            cat(lambda i: seqs[i][0].v),
            cat(lambda i: seqs[i][0].iq),
            cat(lambda i: seqs[i][0].ik),
            cat(lambda i: seqs[i][2]),
            seqs[0][0].head_cls,
            cache,
            **batch.kwargs(),
            sp=cfg,
            layer_idx=layer,
            return_routing=True,
        )
        qsl = batch.query_start_loc.tolist()
        for j, (i, _, b) in enumerate(rows):
            outs[i].append(out[qsl[j] : qsl[j + 1]])
            sel, bias, scores = _routing_rows(routing, range(qsl[j], qsl[j + 1]))
            got[i].selected += sel
            got[i].bias += bias
            got[i].scores += scores
            done[i] = b
    for i in range(len(seqs)):
        pool.free(i)
        got[i].out = torch.cat(outs[i])
    assert pool.num_free_blocks == num_blocks
    return got


def oracle_coords_tensor(roles) -> torch.Tensor:
    """``coords`` [S, 4] (tok, page, image_page, query_page) for the paged operator, from the
    oracle's step 1."""
    return torch.tensor(list(zip(*oracle_coordinates(roles.tolist()))), dtype=torch.int32)


def assert_matches(
    name: str, got: Got, want: OracleResult, *, first_pos: int = 0, max_tie_fraction: float = 0.05
) -> int:
    """Every remote block's score, the selected sets and their biases, then the outputs of the
    tokens whose sets agree. A set may differ only in blocks whose routing values are within
    TIE_TOL of the oracle's K-th selected one; a token whose 16th and 17th routing values are
    that close is a near tie too (the prior's 16 inputs may differ). Returns the number of
    near ties."""
    nq = len(want.selected)
    assert got.out.shape == want.out.shape, (name, got.out.shape, want.out.shape)
    assert got.out.dtype == torch.float32, f"{name}: output dtype {got.out.dtype}, q's is float32"
    assert len(got.selected) == nq
    agree, ties = [], []
    for j in range(nq):
        pos = first_pos + j
        g_scores, w_scores = got.scores[j], want.scores[j]
        for b, ws in enumerate(w_scores):
            if ws == NOT_REMOTE:
                assert b >= len(g_scores) or g_scores[b] == NOT_REMOTE, (
                    f"{name}: position {pos}, block {b} is not remote but scores {g_scores[b]}"
                )
            else:
                assert b < len(g_scores), f"{name}: position {pos}, remote block {b} has no score"
                assert abs(g_scores[b] - ws) <= SCORE_TOL * (1 + abs(ws)), (
                    f"{name}: position {pos}, block {b} scores {g_scores[b]}, the oracle {ws}"
                )
        gs, ws_set = got.selected[j], want.selected[j]
        values = want.values[j]
        ranked = sorted(values, reverse=True)
        m_tie = (
            len(ranked) > TOP_M
            and ranked[TOP_M] > NOT_CANDIDATE
            and abs(ranked[TOP_M] - ranked[TOP_M - 1]) <= TIE_TOL * (1 + abs(ranked[TOP_M - 1]))
        )
        if gs == ws_set and not m_tie:
            for b in gs:
                assert abs(got.bias[j][b] - want.bias[j][b]) <= BIAS_TOL * (1 + abs(want.bias[j][b])), (
                    f"{name}: position {pos}, block {b} has bias {got.bias[j][b]}, the oracle {want.bias[j][b]}"
                )
            agree.append(j)
            continue
        if gs != ws_set:
            boundary = min(values[b] for b in ws_set) if ws_set else math.inf
            diff = gs ^ ws_set
            near = len(gs) == len(ws_set) and all(
                b < len(values)
                and values[b] > NOT_CANDIDATE
                and abs(values[b] - boundary) <= TIE_TOL * (1 + abs(boundary))
                for b in diff
            )
            assert near, (
                f"{name}: position {pos} selects {sorted(gs)}, the oracle {sorted(ws_set)}; routing values of "
                f"the differing blocks { {b: values[b] for b in sorted(diff) if b < len(values)} }, K-th {boundary}"
            )
        ties.append(j)
    assert len(ties) <= max(1, int(max_tie_fraction * nq)), f"{name}: {len(ties)} near-ties of {nq}"
    assert agree, f"{name}: no token to compare"
    g = got.out.double()[agree]
    w = want.out[agree]
    bad = ((g - w).abs() > ATOL + RTOL * w.abs()).flatten(1).any(1)
    if bool(bad.any()):
        j = agree[int(bad.nonzero()[0])]
        err = float((got.out.double()[j] - want.out[j]).abs().max())
        raise AssertionError(
            f"{name}: output of position {first_pos + j} off by {err:.3e} "
            f"({int(bad.sum())} of {len(agree)} tokens out of tolerance)"
        )
    return len(ties)


# ==================================================================== 1. hand-derived cases
def test_coordinates_hand_example():
    """Step 1 by hand: pages, offsets shifted by the prompt counts, image and query pages."""
    roles = [P, I, I, I, P, I, I, T, P, I, I, I, T, P, T, T]
    want = (
        [0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 4, 5, 6],  # tok: page 1 has 4 prompt tokens
        [1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 0, 1, 1, 1],  # page
        [-1, 0, 0, 0, -1, 1, 1, -1, -1, 2, 2, 2, -1, -1, -1, -1],  # image_page
        [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, -1, 0, 0, 0],  # query_page
    )
    assert oracle_coordinates(roles) == want
    assert sequence_coords(torch.tensor(roles)).T.tolist() == list(map(list, want))


def test_coordinates_markers_past_the_last_page():
    """Response markers beyond the prompt's page count stay on the last page and restart its count
    at the page's prompt token count; the query page keeps climbing (and prefers nothing)."""
    roles = [T, P, I, I, T, P, T, P, T, T, P, T]  # prompt 0..3: page 0 has 1 token, page 1 has 3
    want = (
        [0, 0, 1, 2, 1, 3, 4, 3, 4, 5, 3, 4],
        [0, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1],
        [-1, -1, 0, 0, -1, -1, -1, -1, -1, -1, -1, -1],
        [-1, 0, 0, 0, -1, 0, 0, 1, 1, 1, 2, 2],
    )
    assert oracle_coordinates(roles) == want
    assert sequence_coords(torch.tensor(roles)).T.tolist() == list(map(list, want))


def test_coordinates_run_continues_across_the_prompt_boundary():
    """Spec ambiguity, pinned to the literal reading (the reference's): one page, no text after
    its images, the response opens with <PAGE>: the run of page 1 spans the boundary, so the
    response's offset counts from the run's start in the prompt and is then shifted by the
    prompt's 2 tokens of page 1 (4, 5; "continues after them" alone would give 2, 3)."""
    roles = [P, I, P, T]
    want = ([0, 1, 4, 5], [1, 1, 1, 1], [-1, 0, -1, -1], [0, 0, 0, 0])
    assert oracle_coordinates(roles) == want
    assert sequence_coords(torch.tensor(roles)).T.tolist() == list(map(list, want))


def test_coordinates_refuse_prompts_without_pages():
    """The oracle refuses what step 1 refuses: no image token, an image before the first <PAGE>."""
    with pytest.raises(ValueError):
        oracle_coordinates([T, P, T])
    with pytest.raises(ValueError):
        oracle_coordinates([I, P, I])


def test_oracle_rope_closed_form():
    """Step 2 on one vector: token pairs by tok / theta**(i/n), page pairs by page mod m."""
    cfg = DashConfig.from_dict(
        {
            "sparse_block_size": 2,
            "sparse_local_block": 1,
            "sparse_index_dim": 6,
            "sparse_rope_page_pairs": 1,
            "sparse_rope_tok_theta": 100.0,
            "sparse_rope_page_theta": 4.0,
            "sparse_rope_page_mod": 3,
            "sparse_main_rope_tok_freq_mode": "truncate",
        }
    )
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]])
    got = oracle_rope(x, [2], [4], cfg, main=True)
    # half 3, p 1: pairs 0, 1 by tok 2 with n = 3 (truncate); pair 2 by 4 mod 3 = 1
    for i, ang in enumerate([2.0, 2.0 / 100.0 ** (1 / 3), 1.0]):
        lo, hi = float(x[0, i]), float(x[0, i + 3])
        assert float(got[0, i]) == pytest.approx(lo * math.cos(ang) - hi * math.sin(ang), abs=1e-6)
        assert float(got[0, i + 3]) == pytest.approx(hi * math.cos(ang) + lo * math.sin(ang), abs=1e-6)
    # the indexer's mode is the other key: n = half - p = 2
    ang = 2.0 / 100.0 ** (1 / 2)
    assert float(oracle_rope(x, [2], [4], cfg, main=False)[0, 1]) == pytest.approx(
        2.0 * math.cos(ang) - 5.0 * math.sin(ang), abs=1e-6
    )


# Hand problems: 16 tokens in sparse blocks of 2. RoPE leaves the indexer exactly alone: D = Di = 8
# with 3 page pairs and page modulo 1 (the page angle is 0), iq and ik only in element 1 (a page
# pair), head_cls 0 (equal weights). So a block's summary is the mean of its tokens' element-1
# values and its score that mean / sqrt(8). With sparse_index_dim 8 and a routing scale of 8 a
# block's routing value x = score * 8 / sqrt(8) is that mean itself.
#
#  pos   0 1 | 2 3 | 4 5 | 6 7 | 8 9 | 10 11 | 12 13 | 14 15
#  role  P I | I I | P I | I T | P I |  I  I |  T  P |  T  T      prompt = 0..11 (3 pages)
#  block   0 |   1 |   2 |   3 |   4 |     5 |     6 |     7
#  image pages {0} {0}  {1}  {1}  {2}    {2}     {}      {}
#  query_page 0..3: 0, 4..7: 1, 8..11: 2, 12: -1 (no response marker yet), 13..15: 0
HAND_ROLES = [P, I, I, I, P, I, I, T, P, I, I, I, T, P, T, T]
HAND_BASE = {
    "sparse_block_size": 2,
    "sparse_local_block": 1,
    "sparse_index_dim": 8,
    "sparse_rope_page_pairs": 3,
    "sparse_rope_page_mod": 1,
    "dash_scaling_factor": 8.0,
}
C_TIES = [1.0, 1.0, 1.0, 0.5, 0.0, 0.0, 0.0, 0.0]
C_SPREAD = [0.25, 1.0, 0.5, 0.75, -1.0, 2.0, 4.0, 4.0]
# prompt_length 5 keeps token 4 (-0.5) of block 2 and drops token 5 (+4): mean -0.5, not 1.75
C_PROMPT = [0.25, 0.125, None, 3.0, 3.0, 3.0, 3.0, 3.0]


# A page without images: blocks of 4, block 1 holds images of pages 0 and 2 but none of page 1.
#  pos    0 1 2 3 | 4 5 6 7 | 8 9 10 11 | 12 13 14 15 | 16 17 18 19 | 20 21 22 23
#  role   P I I I | I P P I | P I  I  I |  I  I  T  T |  T  P  T  P |  T  T  T  T
#  image pages {0} | {0, 2} |      {3}  |     {3}     |     {}      |     {}       prompt 0..13
#  query_page 8..13: 3, response 14..16: -1, 17..18: 0, 19..23: 1 (no images: prefers nothing)
GAP_ROLES = [P, I, I, I, I, P, P, I, P, I, I, I, I, I, T, T, T, P, T, P, T, T, T, T]
C_GAP = [0.5, -1.0, 0.25, 0.75, 0.125, 2.0]


def hand_inputs(block_values, zero_q=(), roles=HAND_ROLES, bs=2):
    """A hand problem: element 1 of every ik = its block's value (``None``: block 2 of the blocks
    of 2 with tokens -0.5 and 4.0), iq = e_1, head_cls 0; q, k, v random (q zero at ``zero_q``)."""
    roles = torch.tensor(roles)
    s = roles.numel()
    x = random_inputs(torch.Generator().manual_seed(20), roles, heads=4, kv_heads=2, head_dim=8, index_dim=8)
    ik = torch.zeros(s, 8)
    for b, c in enumerate(block_values):
        ik[bs * b : bs * b + bs, 1] = torch.tensor([-0.5, 4.0]) if c is None else c
    x.ik, x.iq, x.head_cls = ik, torch.zeros(s, 8), torch.zeros(8)
    x.iq[:, 1] = 1.0
    for p in zero_q:
        x.q[p] = 0.0
    return x


HAND_CASES = {
    # name: (block values, config overrides, layer, prompt_length, {position: selected blocks})
    # A query reads only its own page's remote image blocks when its page has any; otherwise
    # every remote block competes (docs/spec.md step 4).
    "ties_to_lower_index": (
        C_TIES,
        {"dash_topk_blocks": 2},
        0,
        None,
        {
            9: {0, 1},  # page 2 has no remote block yet: all of 0..3 compete (1, 1, 1, .5): lowest two of the tie
            7: {2},  # page 1's block 2 is remote: the only candidate (the second kept entry is no candidate)
            12: {0, 1},  # query page -1: all of 0..5
            3: {0},  # remote 0 only, a page-0 block
            1: set(),  # nothing remote yet
        },
    ),
    "own_page_top1": (
        C_SPREAD,
        {"dash_topk_blocks": 1},
        0,
        None,
        {
            11: {4},  # page 2's block 4 is remote: read despite the lowest value (-1)
            9: {1},  # block 4 not remote yet: best of 0..3
            7: {2},  # page 1's block 2 over block 1 (1.0 > 0.5)
            12: {5},  # query page -1: best of 0..5
            13: {1},  # query page 0: blocks 0 and 1, the better one
            15: {1},  # remote 0..6: block 6 (4.0) is not on page 0
        },
    ),
    "own_page_top2": (
        C_SPREAD,
        {"dash_topk_blocks": 2},
        0,
        None,
        {
            11: {4},
            9: {1, 3},
            7: {2},
            12: {5, 1},
            15: {0, 1},
            5: {0, 1},
            3: {0},
        },
    ),
    "prompt_length_top1": (
        C_PROMPT,
        {"dash_topk_blocks": 1},
        0,
        5,
        {
            12: {0},  # remote 0..2 only (2*b < 5); block 2's summary is token 4's -0.5
            15: {0},  # query page 0: blocks 0 (.25) and 1 (.125)
            7: {2},  # page 1: block 2 by its image at 5, past prompt_length (literal reading)
            4: {0},  # remote 0..1, page 1 has none of them
        },
    ),
    "prompt_length_top2": (
        C_PROMPT,
        {"dash_topk_blocks": 2},
        0,
        5,
        {
            12: {0, 1},
            14: {0, 1},
            9: {0, 1},
            7: {2},
        },
    ),
    "prompt_length_at_a_block_edge": (
        [-0.25, -0.5, -0.125, 3.0, 3.0, 3.0, 3.0, 3.0],
        {"dash_topk_blocks": 1},
        0,
        6,
        {
            12: {2},  # remote 0..2 (2*b < 6): block 3 starts at prompt_length, so it is not
            9: {2},
            15: {0},  # query page 0: block 0 (-.25) over block 1 (-.5)
            7: {2},  # query page 1: block 2
        },
    ),
    "keep_all": (
        C_SPREAD,
        {"dash_topk_blocks": 16},
        0,
        None,
        {
            11: {4},
            15: {0, 1},
            12: {0, 1, 2, 3, 4, 5},
            9: {0, 1, 2, 3},
            3: {0},
            1: set(),
        },
    ),
    "keep_all_prompt_length": (
        C_PROMPT,
        {"dash_topk_blocks": 16},
        0,
        5,
        {
            15: {0, 1},
            12: {0, 1, 2},
            11: {0, 1, 2},
            5: {0, 1},
        },
    ),
    "per_layer_lists": (
        C_TIES,
        {
            "dash_topk_blocks": 3,
            "sparse_attention_freq": [1, 0, 1],
            "dash_scale_per_layer": [8.0, 0.5],
            "dash_floor_per_layer": [1e-4, 0.2],
        },
        2,
        None,
        {
            12: {0, 1, 2},
            9: {0, 1, 2},
            7: {2},
        },
    ),
    "local_window_of_2_blocks": (
        C_SPREAD,
        {"dash_topk_blocks": 2, "sparse_local_block": 2},
        0,
        None,
        {
            11: {1, 3},  # remote 0..3 (11 // 2 - 2): block 4 is in the window, so page 2 has none
            10: {1, 3},
            12: {1, 3},  # remote 0..4, query page -1
            15: {0, 1},  # remote 0..5, page 0's blocks
            5: {0},  # remote 0 only: fewer remote blocks than K
            3: set(),
        },
    ),
    "page_without_images": (
        C_GAP,
        {"sparse_block_size": 4, "dash_topk_blocks": 1},
        0,
        None,
        {
            23: {3},  # query page 1 has no image: block 1 (pages 0 and 2) is no candidate; all compete
            21: {3},
            18: {0},  # query page 0: blocks 0 and 1, block 0 scores higher
            13: {2},  # query page 3: block 2
            11: {0},  # remote 0..1, page 3 not among them
            15: {0},  # response, query page -1: remote 0..2
            16: {3},
        },
    ),
}
HAND_ROLES_OF = {"page_without_images": (GAP_ROLES, 4)}


@pytest.mark.parametrize("case", sorted(HAND_CASES))
def test_hand_routing(case):
    """Hand-derived selected sets on the oracle, the reference and the paged operator; outputs of
    the three agree."""
    values, overrides, layer, prompt_length, want = HAND_CASES[case]
    roles, bs = HAND_ROLES_OF.get(case, (HAND_ROLES, 2))
    cfg = DashConfig.from_dict({**HAND_BASE, **overrides})
    x = hand_inputs(values, roles=roles, bs=bs)
    ref = run_reference(x, cfg, layer, prompt_length)
    orc = run_oracle(x, cfg, layer, prompt_length)
    paged = run_paged(
        [(x, prompt_length, oracle_coords_tensor(x.roles))],
        cfg,
        layer,
        4,
        [[5, 3] + [1] * (x.length - 8)],
        torch.Generator().manual_seed(3),
    )[0]
    for pos, blocks in want.items():
        for name, got in (("oracle", orc), ("reference", ref), ("paged", paged)):
            assert got.selected[pos] == blocks, f"{name}, position {pos}: {sorted(got.selected[pos])}"
    assert assert_matches("reference", ref, orc) == 0
    assert assert_matches("paged", paged, orc) == 0


def _entmax_tau(z: list[float]) -> float:
    """tau of entmax-1.5 for halved values ``z`` that are all in the support: the root of
    sum (z_i - tau)^2 = 1 below them, r tau^2 - 2 S tau + (S2 - 1) = 0."""
    r, s1, s2 = len(z), sum(z), sum(v * v for v in z)
    return (s1 - math.sqrt(s1 * s1 - r * (s2 - 1))) / r


def test_hand_attention_prior_bias():
    """Steps 4 and 5 by hand: q = 0 at position 12 leaves only the bias in the logits. Query page
    -1: every remote block 0..5 competes with values .25, 1, .5, .75, -1, 2 (blocks 6, 7 not
    remote: -1e4). Halved and shifted by the top (2): 0, -.5, -.625, -.75, -.875, -1.5; the
    support is the first five (tau ~ -0.8798 lies above -1.5, below -.875). K = 2 keeps block
    5 (p ~ .7740) and block 1 (p ~ .1442); centred logs give them bias +-(log p5 - log p1) / 2 ~
    +-0.8400. Block 5's key 11 lies in the window (11, 12), so it adds key 10 only; block 1
    keys 2 and 3."""
    cfg = DashConfig.from_dict({**HAND_BASE, "dash_topk_blocks": 2})
    x = hand_inputs(C_SPREAD, zero_q=(12,))
    tau = _entmax_tau([0.0, -0.5, -0.625, -0.75, -0.875])
    assert -1.5 < tau < -0.875
    p5, p1 = tau**2, (-0.5 - tau) ** 2
    b = (math.log(p5) - math.log(p1)) / 2
    assert b == pytest.approx(0.8400, abs=1e-4)
    e, f = math.exp(b), math.exp(-b)
    v = x.v.double()
    want = (e * v[10] + f * (v[2] + v[3]) + v[11] + v[12]) / (e + 2 * f + 2)  # [Hkv, D]
    want = want.repeat_interleave(2, 0)  # query head h reads KV head h // 2
    paged = run_paged([(x, None, oracle_coords_tensor(x.roles))], cfg, 0, 4, [[16]], torch.Generator().manual_seed(0))[
        0
    ]
    for name, got in (("oracle", run_oracle(x, cfg, 0)), ("reference", run_reference(x, cfg, 0)), ("paged", paged)):
        assert got.bias[12] == pytest.approx({5: b, 1: -b}, abs=1e-5), name
        torch.testing.assert_close(got.out[12].double(), want, atol=1e-6, rtol=1e-6, msg=name)


def test_hand_bias_floor_and_sigma():
    """The floor bites: position 15 (query page 0) keeps blocks 1 and 0 (K = 16: only page 0's
    are candidates) with values 4 and 0.25 here; halved and shifted: 0, -1.875, outside the
    support (tau = -1 alone), so p = 1, 0 and the logs are 0 and log(floor). Centred over the
    two and divided by sigma: +-log(floor) / (2 sigma)."""
    values = [0.25, 4.0, 0.5, 0.75, -1.0, 2.0, 4.0, 4.0]
    for floor, sigma in ((1e-4, 1.0), (1e-2, 0.5), (0.3, 2.0)):
        cfg = DashConfig.from_dict(
            {**HAND_BASE, "dash_topk_blocks": 16, "dash_prior_floor": floor, "dash_sigma": sigma}
        )
        x = hand_inputs(values)
        want = {1: -math.log(floor) / (2 * sigma), 0: math.log(floor) / (2 * sigma)}
        for name, got in (("oracle", run_oracle(x, cfg, 0)), ("reference", run_reference(x, cfg, 0))):
            assert got.bias[15] == pytest.approx(want, abs=1e-5), (name, floor, sigma)


def test_hand_attention_prompt_length():
    """prompt_length 5, q = 0 at position 7: page 1's block 2 alone (bias 0: one valid block)
    contributes key 4 only (key 5 is past the prompt); the window 6, 7 is read although it is
    past the prompt."""
    cfg = DashConfig.from_dict({**HAND_BASE, "dash_topk_blocks": 1})
    x = hand_inputs(C_PROMPT, zero_q=(7,))
    v = x.v.double()
    want = ((v[4] + v[6] + v[7]) / 3).repeat_interleave(2, 0)
    paged = run_paged(
        [(x, 5, oracle_coords_tensor(x.roles))], cfg, 0, 2, [[3, 3, 1, 1, 8]], torch.Generator().manual_seed(0)
    )[0]
    for name, got in (
        ("oracle", run_oracle(x, cfg, 0, 5)),
        ("reference", run_reference(x, cfg, 0, 5)),
        ("paged", paged),
    ):
        assert got.bias[7] == {2: 0.0}, name
        torch.testing.assert_close(got.out[7].double(), want, atol=1e-6, rtol=1e-6, msg=name)


def test_own_page_by_an_image_token_past_prompt_length():
    """Spec reading: a block's image pages are all its image tokens', also those past prompt_length
    (block 2's only image, at 5, is past prompt_length 5 and still makes it page 1's candidate)."""
    cfg = DashConfig.from_dict({**HAND_BASE, "dash_topk_blocks": 3})
    x = hand_inputs(C_PROMPT)
    for got in (run_oracle(x, cfg, 0, 5), run_reference(x, cfg, 0, 5)):
        assert got.selected[7] == {2} and got.selected[6] == {2}


@pytest.mark.parametrize("far, want", [(400.0, 0.0), (40.0, 0.5 / math.sqrt(8))])
def test_an_uncounted_token_far_above_the_counted_ones_zeroes_the_summary(far, want):
    """Block 2 = tokens 4 (counted, element 1 = 0.5) and 5 (past prompt_length 5, element 1 =
    ``far``), head_cls = e_1. Step 3 lets token 5 into exp(logit - max) before zeroing it: at 400
    its logit is ~141 above the counted one, exp overflows float32, inf * 0 = nan, and the summary
    (so the score) is 0; at 40 (~14 above) the summary is token 4's key, score 0.5 / sqrt(8). The
    oracle, the reference and the paged operator all read step 3 so (vLLM's own module does)."""
    cfg = DashConfig.from_dict({**HAND_BASE, "dash_topk_blocks": 1})
    x = hand_inputs([0.25, 0.125, 0.0, 3.0, 3.0, 3.0, 3.0, 3.0])
    x.ik[4, 1], x.ik[5, 1] = 0.5, far
    x.head_cls[1] = 1.0
    paged = run_paged(
        [(x, 5, oracle_coords_tensor(x.roles))], cfg, 0, 4, [[6, 2] + [1] * 8], torch.Generator().manual_seed(0)
    )[0]
    for name, got in (
        ("oracle", run_oracle(x, cfg, 0, 5)),
        ("reference", run_reference(x, cfg, 0, 5)),
        ("paged", paged),
    ):
        assert got.scores[12][2] == pytest.approx(want, abs=1e-6), name


# ================================================================ 2. oracle vs reference
def random_problem(seed: int, **cfg_overrides):
    """A random configuration, document and inputs; prompt_length none, the prompt, or shorter."""
    gen = torch.Generator().manual_seed(seed)
    cfg = random_config(gen, **cfg_overrides)
    pages = int(torch.randint(1, 6, (1,), generator=gen))
    response = int(torch.randint(0, 17, (1,), generator=gen))
    roles = random_roles(gen, pages, max_images=3 * cfg.sparse_block_size, response=response, response_markers=2)
    x = random_inputs(gen, roles, heads=4, kv_heads=2, head_dim=16, index_dim=16)
    prompt_tokens = max(i for i, r in enumerate(roles.tolist()) if r == ROLE_IMAGE) + 1
    mode = seed % 3
    prompt_length = [None, prompt_tokens, max(0, prompt_tokens - 7)][mode]
    layer = int(torch.randint(0, 2, (1,), generator=gen))
    return gen, cfg, x, prompt_length, layer


REF_SEEDS = list(range(16))


@pytest.mark.parametrize("seed", REF_SEEDS)
def test_oracle_equals_reference(seed):
    """Random configuration (random_config), document and inputs: scores, selected sets, biases
    and outputs of every query position agree with ``dash_attention``; half the seeds run a query
    suffix only."""
    overrides = {"dash_topk_blocks": 20} if seed % 4 == 3 else {}
    gen, cfg, x, prompt_length, layer = random_problem(seed, **overrides)
    nq = None if seed % 2 == 0 else max(1, x.length - int(torch.randint(1, x.length, (1,), generator=gen)))
    want = run_oracle(x, cfg, layer, prompt_length, nq)
    assert any(want.selected), "a problem where no query reads a remote block proves little"
    got = run_reference(x, cfg, layer, prompt_length, nq)
    assert_matches(f"reference (seed {seed})", got, want, first_pos=x.length - len(want.selected))


def test_oracle_equals_reference_long_document():
    """A longer document (8 pages, blocks of 4, K 2, more than 16 blocks, pages spanning several
    blocks)."""
    gen = torch.Generator().manual_seed(1234)
    cfg = random_config(gen, sparse_block_size=4, dash_topk_blocks=2, dash_scaling_factor=16.0, index_dim=8)
    roles = random_roles(gen, 8, max_images=20, response=16, response_markers=3)
    x = random_inputs(gen, roles, heads=4, kv_heads=1, head_dim=16, index_dim=8)
    want = run_oracle(x, cfg, 0)
    assert sum(len(b) == 2 for b in want.bias) > x.length // 2  # most queries keep two blocks
    assert_matches("reference (long)", run_reference(x, cfg, 0), want)


def test_sequence_coords_equal_oracle_coordinates():
    """The paged operator's coords helper agrees with the oracle's step 1 on random documents."""
    gen = torch.Generator().manual_seed(77)
    for _ in range(200):
        pages = int(torch.randint(1, 6, (1,), generator=gen))
        response = int(torch.randint(0, 12, (1,), generator=gen))
        roles = random_roles(
            gen,
            pages,
            max_images=5,
            max_text=3,
            response=response,
            response_markers=int(torch.randint(0, 9, (1,), generator=gen)),
        )
        assert torch.equal(sequence_coords(roles), oracle_coords_tensor(roles)), roles.tolist()


# ================================================================== 3. oracle vs paged
PAGED_CASES = [
    # (seed, KV block size, config overrides)
    (0, 8, {"sparse_block_size": 4}),
    (1, 16, {"sparse_block_size": 8}),
    (2, 4, {"sparse_block_size": 4, "dash_topk_blocks": 1}),
    (
        3,
        12,
        {
            "sparse_block_size": 4,
            "dash_topk_blocks": 16,
            "sparse_attention_freq": [1, 1],
            "dash_scale_per_layer": [64.0, 8.0],
            "dash_floor_per_layer": [1e-3, 1e-4],
        },
    ),
    (4, 6, {"sparse_block_size": 4, "dash_sigma": 0.5}),
    (5, 16, {"sparse_block_size": 16, "sparse_local_block": 1}),
]


@pytest.mark.parametrize("seed, kv_block_size, overrides", PAGED_CASES)
def test_oracle_equals_paged(seed, kv_block_size, overrides):
    """Three random sequences through the paged operator over one KVBlockPool, interleaved, each
    prefilled in 1-3 random chunks and then decoded token by token (coords from the oracle):
    every token's scores, selected sets, biases and output equal the oracle on its history."""
    gen = torch.Generator().manual_seed(100 + seed)
    cfg = random_config(gen, **overrides)
    layer = int(torch.randint(0, 2, (1,), generator=gen))
    head_cls = torch.randn(16, generator=gen)
    seqs, plans = [], []
    for i in range(3):
        pages = int(torch.randint(1, 5, (1,), generator=gen))
        response = int(torch.randint(1, 14, (1,), generator=gen))
        roles = random_roles(
            gen, pages, max_images=2 * cfg.sparse_block_size + 4, response=response, response_markers=2
        )
        x = random_inputs(gen, roles, heads=4, kv_heads=2, head_dim=16, index_dim=16, head_cls=head_cls)
        prompt_tokens = max(j for j, r in enumerate(roles.tolist()) if r == ROLE_IMAGE) + 1
        prompt_length = [None, prompt_tokens, max(0, prompt_tokens - 6)][(seed + i) % 3]
        decode_from = int(torch.randint(1, x.length, (1,), generator=gen))
        cuts = sorted(set(torch.randint(1, max(2, decode_from), (2,), generator=gen).tolist()) - {0})
        bounds = [0, *[c for c in cuts if c < decode_from], decode_from]
        plans.append([b - a for a, b in itertools.pairwise(bounds)] + [1] * (x.length - decode_from))
        seqs.append((x, prompt_length, oracle_coords_tensor(roles)))
    got = run_paged(seqs, cfg, layer, kv_block_size, plans, gen)
    reads = 0
    for i, ((x, prompt_length, _), g) in enumerate(zip(seqs, got)):
        want = run_oracle(x, cfg, layer, prompt_length)
        reads += sum(map(len, want.selected))
        assert_matches(f"paged (seed {seed}, sequence {i})", g, want)
    assert reads, "no query read a remote block: the case proves little"
