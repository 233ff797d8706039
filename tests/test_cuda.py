"""The CUDA kernels against the paged reference (the comparison rule of docs/spec.md), on a GPU.

Every case runs the same ragged batches (prefill chunks and decode tokens of several
sequences mixed in one call) through both implementations, each on its own copy of the
cache, and compares per-token outputs, the selected blocks and the final cache contents.
"""

import dataclasses

import pytest
import torch
from conftest import DTYPES, require_kernels

from dash_trt.attention.dash import paged as P
from dash_trt.attention.dash.config import DashConfig
from dash_trt.serving.block_pool import KVBlockPool
from dash_trt.testing import (
    CONFIG_VARIANTS,
    MAX_NEAR_TIE_SHARE,
    assert_caches_match,
    compare_outputs,
    fill_garbage,
    prefill_then_decode,
    random_config,
    random_sequences,
)

pytestmark = pytest.mark.gpu

from dash_trt.attention.dash import cuda  # noqa: E402

require_kernels(cuda.library_path())

HEAD_DIMS = [64, 128]
GQA = [(4, 4), (8, 2), (32, 8)]
KV_MULTIPLES = [1, 2, 4]
SEEDS = [0, 1]
#: Placements of the decode-only steps' folded write (Tuning.front_writer).
WRITERS = {"cta": 1, "route": 2}


@pytest.fixture(scope="module", autouse=True)
def _need_kernels():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if cuda.library_path() is None:
        pytest.skip("kernel library not built (pip install . with nvcc, or DASH_TRT_LIBRARY)")


def make_config(sbs=16, *, index_dim=64, **kw):
    """A layer config for these cases. Some were written for an earlier, withdrawn routing rule;
    its key ``sparse_topk_blocks`` maps to ``dash_topk_blocks`` (K is at most 16, so the
    "top-300" and "dense" cases route 16 blocks; they still exercise the tables of over a
    thousand blocks they were built for) and ``sparse_page_bias`` / ``sparse_dense_layers`` have
    no counterpart."""
    sp = {
        "sparse_block_size": sbs,
        "sparse_local_block": 1,
        "sparse_index_dim": index_dim,
        "dash_topk_blocks": 3,
        "sparse_rope_page_pairs": 2,
    }
    if "sparse_topk_blocks" in kw:
        kw["dash_topk_blocks"] = kw.pop("sparse_topk_blocks")
    kw.pop("sparse_page_bias", None)
    if kw.pop("sparse_dense_layers", None):
        kw["dash_topk_blocks"] = 16
    sp.update(kw)
    return DashConfig.from_dict(sp)


def with_index_dim(cfg, index_dim):
    """``cfg`` for sequences whose indexer is ``index_dim`` wide (the cases pick the width of
    their inputs; the routing value's scale depends on it)."""
    return dataclasses.replace(cfg, sparse_index_dim=index_dim)


def build_sequences(gen, n, **kw):
    return random_sequences(gen, n, device="cuda", **kw)


schedule = prefill_then_decode


def run_both(
    cfg, layer, seqs, plans, block_size, prompt_lens, gen, dtype, table_width=None, exact_max_query=True, tuning=None
):
    """Run the same steps through the reference and the kernels; return per-step results: the
    kernels' output and routing, the reference's output over the kernels' routing, the
    reference's routing.

    ``exact_max_query``: tell the kernels each step's largest per-sequence token count, as a
    vLLM-style caller does (decode-only steps then take the fused write path,
    Plan::fused_front); False leaves it at T (the separate write and summary launches).
    ``tuning``: the kernels' knobs (cuda.Tuning) for every call."""
    num_blocks = sum(-(-x.length // block_size) for x, _ in seqs) + 2
    hkv, d = seqs[0][0].k.shape[1:]
    di = seqs[0][0].ik.shape[1]
    cfg = with_index_dim(cfg, di)
    ref_cache = P.DashKVCache.allocate(num_blocks, block_size, hkv, d, di, cfg.sparse_block_size, dtype, "cuda")
    fill_garbage(ref_cache, gen)  # garbage in unwritten slots must not matter
    ker_cache = ref_cache.clone()
    pool = KVBlockPool(num_blocks, block_size)
    # scatter the free list so block tables are not the identity
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    pool._free = perm
    for i, pl in enumerate(prompt_lens):
        pool.add(i, prompt_length=pl)
    done = [0] * len(seqs)
    plans = [list(p) for p in plans]
    steps = []
    while any(plans):
        live = [i for i in range(len(seqs)) if plans[i]]
        step = [(i, plans[i].pop(0)) for i in live]
        batch = pool.schedule(step, device="cuda", table_width=table_width)
        rows = [(i, done[i], done[i] + n) for i, n in step]

        def cat(attr, rows=rows):
            return torch.cat([getattr(seqs[i][0], attr)[a:b] for i, a, b in rows])

        args = (
            cat("q"),
            cat("k"),
            cat("v"),
            cat("iq"),
            cat("ik"),
            torch.cat([seqs[i][1][a:b] for i, a, b in rows]),
            seqs[0][0].head_cls,
        )
        ref, ref_r = P.paged_dash_attention(
            *args, ref_cache, **batch.kwargs(), sp=cfg, layer_idx=layer, return_routing=True
        )
        out, sel = cuda.paged_dash_attention_cuda(
            *args,
            ker_cache,
            **batch.kwargs(),
            sp=cfg,
            layer_idx=layer,
            return_routing=True,
            tuning=tuning,
            max_query_len=max(n for _, n in step) if exact_max_query else None,
        )
        # The reference's attention over the kernels' own blocks and biases: outputs are compared
        # against it, the routing against the reference's routing (compare_outputs), so a
        # routing bias that bf16 inputs leave uncertain (see BIAS_WEIGHT_TOL) does not spill into
        # the output check, and a near-tie swap's output is still checked.
        ref_given = P.paged_dash_attention(
            *args,
            ref_cache,
            **batch.kwargs(),
            sp=cfg,
            layer_idx=layer,
            attend_routing=P.Routing(sel.selected.to(ref.device), sel.bias.to(ref.device)),
        )
        steps.append((out, sel, ref_given, ref_r))
        for i, _, b in rows:
            done[i] = b
    return steps, ref_cache, ker_cache


def check(steps, ref_cache, ker_cache, dtype, max_tie_share=MAX_NEAR_TIE_SHARE):
    """Every step by compare_outputs; the near ties bounded over the whole case (a step of two
    decode tokens would otherwise allow one)."""
    worst = 0.0
    ties = tokens = 0
    for out, sel, ref, ref_r in steps:
        assert out.dtype == ref.dtype
        report = compare_outputs(
            out,
            ref,
            P.Routing(sel.selected.cpu(), sel.bias.cpu()),
            P.Routing(ref_r.selected.cpu(), ref_r.bias.cpu(), ref_r.values.cpu(), ref_r.scores.cpu()),
            dtype=dtype,
        )
        assert report.routing_mismatch == 0 and not report.bad_tokens, str(report)
        ties, tokens = ties + report.near_ties, tokens + report.tokens
        worst = max(worst, report.max_abs_err)
    assert ties <= max(1, int(max_tie_share * tokens)), f"{ties} near ties in {tokens} tokens"
    assert_caches_match(ker_cache, ref_cache, dtype)  # the cache is part of the contract
    return worst


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("heads, kv_heads", GQA)
@pytest.mark.parametrize("kv_multiple", KV_MULTIPLES)
def test_kernels_match_reference(dtype, head_dim, heads, kv_heads, kv_multiple):
    gen = torch.Generator().manual_seed(head_dim + heads + kv_multiple)
    cfg = make_config(16)
    seqs = build_sequences(gen, 3, heads=heads, kv_heads=kv_heads, head_dim=head_dim, index_dim=64, dtype=dtype)
    plans = schedule(gen, seqs, 12)
    steps, rc, kc = run_both(cfg, 0, seqs, plans, 16 * kv_multiple, [None, None, None], gen, dtype)
    check(steps, rc, kc, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("variant", ["prompt_length", "per_layer_lists", "keep_all_16", "truncate_mod", "local2"])
def test_kernels_config_variants(dtype, seed, variant):
    gen = torch.Generator().manual_seed(seed)
    kw, layer, prompts = {}, 0, [None, None]
    if variant in CONFIG_VARIANTS:
        kw, layer = CONFIG_VARIANTS[variant]
    elif variant == "local2":
        kw = {"sparse_local_block": 2, "sparse_topk_blocks": 4}
    cfg = make_config(8, **kw)
    seqs = build_sequences(gen, 2, heads=8, kv_heads=2, head_dim=64, index_dim=32, dtype=dtype, response=20)
    if variant == "prompt_length":
        prompts = [seqs[0][0].length - 20, seqs[1][0].length - 27]  # second: mid-prompt
    plans = schedule(gen, seqs, 20)
    steps, rc, kc = run_both(cfg, layer, seqs, plans, 32, prompts, gen, dtype)
    check(steps, rc, kc, dtype)


RANDOM_CASES = 100


@pytest.mark.parametrize("dtype", DTYPES)
def test_random_ragged_batches_match_the_reference(dtype):
    """RANDOM_CASES random cases a dtype, each against the reference by the comparison rule of
    docs/spec.md (selection, bias weights, outputs, and the cache after every step): a random
    configuration (random_config: every key, per-layer routing lists, routing scales that
    spread the entmax prior), head dim 64 / 128 / 256, GQA groups 1-8, KV blocks 1-4 sparse
    blocks long, 1-4 documents of 1-4 pages with a prompt_length or not, each prefilled in 1-3
    random chunks and then decoded, the sequences' steps mixed in one call; decode-only calls
    told so (the fused write) or not."""
    failures = []
    for case in range(RANDOM_CASES):
        gen = torch.Generator().manual_seed(1000 + case)

        def pick(options, gen=gen):
            return options[int(torch.randint(len(options), (1,), generator=gen))]

        index_dim = pick([16, 32, 64])
        cfg = random_config(gen, index_dim=index_dim)
        layer = pick([0, 1]) if cfg.dash_scale_per_layer else 0
        heads, kv_heads = pick([(4, 4), (8, 2), (8, 1), (6, 3)])
        head_dim = pick([64, 128, 256])
        response = int(torch.randint(1, 7, (1,), generator=gen))
        n = int(torch.randint(1, 5, (1,), generator=gen))
        seqs = build_sequences(
            gen,
            n,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            index_dim=index_dim,
            dtype=dtype,
            pages=(1, 4),
            max_images=40,
            response=response,
        )
        prompts = [pick([None, x.length - response]) for x, _ in seqs]
        plans = schedule(gen, seqs, response)
        block_size = cfg.sparse_block_size * pick([1, 2, 4])
        try:
            steps, rc, kc = run_both(
                cfg, layer, seqs, plans, block_size, prompts, gen, dtype, exact_max_query=pick([True, False])
            )
            # Small routing scales (random_config's 2-16) give flat priors whose 16th and 17th
            # values often lie within the half-precision tie tolerance: those tokens' outputs
            # are not compared (their selections still are), so allow a fifth of them.
            check(steps, rc, kc, dtype, max_tie_share=0.2 if dtype != torch.float32 else MAX_NEAR_TIE_SHARE)
        except AssertionError as exc:
            failures.append(f"case {case} ({cfg.sparse_block_size=}, {head_dim=}, {heads}/{kv_heads}): {exc}")
    assert not failures, f"{len(failures)} of {RANDOM_CASES} cases failed: " + " | ".join(failures[:3])


@pytest.mark.parametrize("exact_max_query", [True, False], ids=["fused-write", "separate-write"])
def test_long_sequences_and_split_k(exact_max_query):
    """Over a thousand tokens per sequence; decode-only steps exercise split-K, with the write
    and summary stages fused into the routing and attention launches or launched on their own."""
    gen = torch.Generator().manual_seed(9)
    cfg = make_config(64, sparse_topk_blocks=16, sparse_page_bias=0.5)
    dtype = torch.bfloat16
    seqs = build_sequences(
        gen,
        2,
        heads=32,
        kv_heads=8,
        head_dim=128,
        index_dim=128,
        dtype=dtype,
        pages=(10, 14),
        max_images=200,
        response=8,
    )
    assert min(x.length for x, _ in seqs) > 1000
    plans = schedule(gen, seqs, 8)
    steps, rc, kc = run_both(
        cfg, 0, seqs, plans, 64, [seqs[0][0].length - 8, None], gen, dtype, exact_max_query=exact_max_query
    )
    check(steps, rc, kc, dtype)


def test_split_routing_over_a_wide_table():
    """Decode steps whose block table allows more sparse blocks than one routing CTA scores
    (320 > 256) go through the split routing (one launch: scoring CTAs, the last one selects);
    prefill steps through the fused routing."""
    gen = torch.Generator().manual_seed(13)
    cfg = make_config(16, sparse_topk_blocks=6)
    dtype = torch.bfloat16
    seqs = build_sequences(gen, 2, heads=8, kv_heads=2, head_dim=64, index_dim=64, dtype=dtype, response=10)
    plans = schedule(gen, seqs, 10)
    steps, rc, kc = run_both(cfg, 0, seqs, plans, 16, [None, None], gen, dtype, table_width=320)
    assert any(out.shape[0] <= 2 for out, *_ in steps)  # decode steps: split routing (320 blocks)
    check(steps, rc, kc, dtype)


@pytest.mark.parametrize("writer", ["cta", "route"])
@pytest.mark.parametrize("topk", [6, 300])
def test_split_routing_merges_many_ctas(topk, writer):
    """Decode tokens with over a thousand remote blocks: 4-6 routing CTAs each keep their best
    min(topk, 256) keys and the last one merges them. top-6 merges by rank; top-300 reaches
    1024 candidates (rank) for one sequence and 1536 (select_topk's warp lists) for the other.
    The decode-only steps' writer runs in a CTA of its own or in the first routing CTA."""
    tuning = cuda.Tuning(front_writer=WRITERS[writer])
    gen = torch.Generator().manual_seed(21)
    cfg = make_config(4, sparse_topk_blocks=topk)
    dtype = torch.bfloat16
    seqs = build_sequences(
        gen, 2, heads=8, kv_heads=2, head_dim=64, index_dim=64, dtype=dtype, pages=(30, 30), max_images=300, response=4
    )
    assert sorted(x.length // 4 for x, _ in seqs) == [1013, 1324]  # remote blocks: > 3 and > 5 CTAs' worth
    plans = schedule(gen, seqs, 4)
    steps, rc, kc = run_both(cfg, 0, seqs, plans, 16, [None, None], gen, dtype, tuning=tuning)
    assert sum(out.shape[0] == 2 for out, *_ in steps) == 4  # the decode steps
    check(steps, rc, kc, dtype)


@pytest.mark.parametrize(
    "case, index_dim",
    [
        ("short", 128),
        ("chunks-top6", 128),
        ("chunks-top40", 128),
        ("chunks-top300", 128),
        ("chunks-dense", 128),
        ("chunks-top6", 10),
        ("chunks-top6", 200),
    ],
)
def test_fused_and_split_routing_select_the_same_blocks(case, index_dim):
    """The same 300 tokens routed as one call (fused routing: T >= 264) and as calls of 200 and
    100 (split routing: fewer tokens, a table wider than 256 blocks) select exactly the same
    blocks in the same order: both launches score a (token, block) pair with the same chain of
    multiply-adds. "short": 125 blocks or fewer, one chunk of the fused routing; "chunks-*": over
    a thousand blocks, scored 512 (top-6, top-40) or 1216 (top-300) at a time and merged into the
    running top-k by rank (few keys above the k-th best), by warp_topk (many), or written as they
    come (dense layer). Index dims: 128 (the fused routing's compiled-in size), 10 (not a
    multiple of 4: rows staged element by element) and 200 (a last slice of 8 elements)."""
    gen = torch.Generator().manual_seed(5)
    layer = 0
    if case == "short":
        sbs, table, pages, images, kw = 16, 320, (10, 10), 200, {"sparse_topk_blocks": 6}
    else:
        sbs, table, pages, images = 4, 1400, (30, 30), 300
        kw = (
            {"sparse_topk_blocks": int(case.removeprefix("chunks-top"))}
            if "top" in case
            else {"sparse_dense_layers": [1], "sparse_page_bias": 0.0}
        )
        layer = 1 if case == "chunks-dense" else 0
    cfg = make_config(sbs, **kw)
    dtype = torch.bfloat16
    seqs = build_sequences(
        gen,
        1,
        heads=8,
        kv_heads=2,
        head_dim=64,
        index_dim=index_dim,
        dtype=dtype,
        pages=pages,
        max_images=images,
        response=300,
    )
    prompt = seqs[0][0].length - 300
    assert (prompt // sbs > 1000) == (case != "short")
    runs = []
    for plan in ([prompt, 300], [prompt, 200, 100]):
        steps, rc, kc = run_both(
            cfg, layer, seqs, [plan], 16, [None], torch.Generator().manual_seed(7), dtype, table_width=table
        )
        check(steps, rc, kc, dtype)
        runs.append(
            (torch.cat([r.selected for _, r, _, _ in steps[1:]]), torch.cat([r.bias for _, r, _, _ in steps[1:]]))
        )
    assert runs[0][0].shape[0] == 300 and bool((runs[0][0] >= 0).any())
    assert torch.equal(runs[0][0], runs[1][0])
    assert torch.equal(runs[0][1], runs[1][1])  # the same keys give the same prior, bit for bit


@pytest.mark.parametrize("inputs", ["random", "zero-queries", "one-loud-block"])
def test_fused_and_split_routing_agree_on_ties_and_extreme_summaries(inputs):
    """The fused routing (a call of 305 tokens) and the split routing (calls of 205 and 100)
    select the same blocks for two sequences of 900+ blocks, the second with 5 tokens in the fused
    call (a tile shared by two sequences). "zero-queries": every score is 0, so the selection is
    the forced blocks, then the lowest-numbered ones, over several merges of the running top-k;
    "one-loud-block": one block's index keys x 1000 (scores far from the others', up to the clamp
    of the index logits)."""
    gen = torch.Generator().manual_seed(11)
    cfg = make_config(4, sparse_topk_blocks=6)
    dtype = torch.bfloat16
    seqs = build_sequences(
        gen,
        2,
        heads=8,
        kv_heads=2,
        head_dim=64,
        index_dim=128,
        dtype=dtype,
        pages=(30, 30),
        max_images=300,
        response=300,
    )
    for x, _ in seqs:
        if inputs == "zero-queries":
            x.iq.zero_()
        elif inputs == "one-loud-block":
            x.ik[400:404] *= 1000
    prompts = [x.length - 300 for x, _ in seqs]
    assert min(prompts) // 4 > 900  # blocks: more than one chunk of the fused routing
    runs = []
    for plans in ([[prompts[0], 300], [prompts[1] + 295, 5]], [[prompts[0], 200, 100], [prompts[1] + 295, 5]]):
        steps, rc, kc = run_both(
            cfg, 0, seqs, plans, 16, [None, None], torch.Generator().manual_seed(7), dtype, table_width=1500
        )
        if inputs == "random":
            check(steps, rc, kc, dtype)
        rows = [[] for _ in plans]  # each sequence's selections after its first step, in order
        for s, (_, r, _, _) in enumerate(steps[1:], start=1):
            at = 0
            for i, plan in enumerate(plans):
                if s < len(plan):
                    rows[i].append(torch.cat((r.selected, r.bias.view(torch.int32).long()), 1)[at : at + plan[s]])
                    at += plan[s]
        runs.append(torch.cat([torch.cat(r) for r in rows]))
    assert runs[0].shape[0] == 305 and bool((runs[0] >= 0).any())
    assert torch.equal(runs[0], runs[1])  # the selections and their bias, bit for bit


def capture(call, warm_cache, graph_cache):
    """``call(cache)`` run once on a side stream outside capture (warm-up, on ``warm_cache``), then
    captured into a CUDA graph on ``graph_cache``: (graph, the captured call's output)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call(warm_cache)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call(graph_cache)
    return graph, out


def test_cuda_graph_replay_matches_eager():
    gen = torch.Generator().manual_seed(4)
    dtype = torch.float16
    cfg = make_config(16)
    seqs = build_sequences(gen, 2, heads=8, kv_heads=2, head_dim=64, index_dim=64, dtype=dtype, response=4)
    x0, c0 = seqs[0]
    x1, c1 = seqs[1]
    num_blocks = 64
    cache = P.DashKVCache.allocate(num_blocks, 32, 2, 64, 64, 16, dtype, "cuda")
    pool = KVBlockPool(num_blocks, 32)
    pool.add(0), pool.add(1)
    n0, n1 = x0.length - 4, x1.length - 4
    batch = pool.schedule([(0, n0), (1, n1)], device="cuda")
    cat = lambda a, b, s0, s1: torch.cat([a[s0], b[s1]])  # noqa: E731
    args = [cat(getattr(x0, n), getattr(x1, n), slice(0, n0), slice(0, n1)) for n in ("q", "k", "v", "iq", "ik")]
    cuda.paged_dash_attention_cuda(
        *args, cat(c0, c1, slice(0, n0), slice(0, n1)), x0.head_cls, cache, **batch.kwargs(), sp=cfg, layer_idx=0
    )
    # One mixed decode step for both sequences, captured once and replayed.
    batch = pool.schedule([(0, 1), (1, 1)], device="cuda")
    dargs = [
        cat(getattr(x0, n), getattr(x1, n), slice(n0, n0 + 1), slice(n1, n1 + 1)) for n in ("q", "k", "v", "iq", "ik")
    ]
    dcoords = cat(c0, c1, slice(n0, n0 + 1), slice(n1, n1 + 1))
    eager_cache = cache.clone()
    eager = cuda.paged_dash_attention_cuda(
        *dargs, dcoords, x0.head_cls, eager_cache, **batch.kwargs(), sp=cfg, layer_idx=0
    )
    static = batch.to("cuda")
    graph_cache = cache.clone()
    graph, captured = capture(
        lambda c: cuda.paged_dash_attention_cuda(
            *dargs, dcoords, x0.head_cls, c, **static.kwargs(), sp=cfg, layer_idx=0, validate=False
        ),
        cache.clone(),
        graph_cache,
    )
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
    assert torch.equal(graph_cache.key, eager_cache.key)
    assert torch.equal(graph_cache.summary, eager_cache.summary)


def _small_call(**change):
    gen = torch.Generator().manual_seed(0)
    cfg = make_config(16, index_dim=32)
    ((x, coords),) = build_sequences(
        gen, 1, heads=4, kv_heads=2, head_dim=64, index_dim=32, dtype=torch.float16, response=0
    )
    cache = P.DashKVCache.allocate(16, 32, 2, 64, 32, 16, torch.float16, "cuda")
    pool = KVBlockPool(16, 32)
    pool.add(0)
    batch = pool.schedule([(0, x.length)], device="cuda")
    args = dict(
        q=x.q,
        k=x.k,
        v=x.v,
        iq=x.iq,
        ik=x.ik,
        coords=coords,
        head_cls=x.head_cls,
        cache=cache,
        **batch.kwargs(),
        sp=cfg,
        layer_idx=0,
    )
    args.update({k: (v(args) if callable(v) else v) for k, v in change.items()})
    return cuda.paged_dash_attention_cuda(**args)


def test_unsupported_sizes_are_refused_clearly():
    with pytest.raises(cuda.DashKernelError, match="unsupported head dim: 96"):
        _small_call(
            q=lambda a: torch.randn(a["q"].shape[0], 4, 96, device="cuda", dtype=torch.float16),
            k=lambda a: torch.randn(a["q"].shape[0], 2, 96, device="cuda", dtype=torch.float16),
            v=lambda a: torch.randn(a["q"].shape[0], 2, 96, device="cuda", dtype=torch.float16),
            cache=P.DashKVCache.allocate(16, 32, 2, 96, 32, 16, torch.float16, "cuda"),
        )
    with pytest.raises(cuda.DashKernelError, match="not a whole multiple of the sparse block size"):
        _small_call(
            cache=P.DashKVCache.allocate(16, 24, 2, 64, 32, 16, torch.float16, "cuda"),
            block_tables=lambda a: torch.arange(16, dtype=torch.int32, device="cuda")[None],
        )


def test_bad_block_table_is_flagged_not_read():
    """With host validation off (as under graph capture), a table entry outside the cache is
    skipped by the kernels and reported through the data-error flag."""

    def bad_table(a):
        t = a["block_tables"].clone()
        t[0, 0] = 10_000
        return t

    with pytest.raises(cuda.DashKernelError, match="outside the cache"):
        _small_call(block_tables=bad_table, validate=False, check_errors=True)
    with pytest.raises(ValueError, match="outside the cache"):
        _small_call(block_tables=bad_table)


def _garbage_int32(gen, shape, small):
    """Random int32: a mix of in-range-looking values (0..small), negatives and extremes."""
    x = torch.randint(-(2**31), 2**31 - 1, shape, generator=gen, dtype=torch.int64)
    near = torch.randint(-3, small + 3, shape, generator=gen, dtype=torch.int64)
    pick = torch.randint(0, 3, shape, generator=gen)
    return torch.where(pick == 0, x, near).to(torch.int32)


@pytest.mark.parametrize("case", ["decode", "mixed", "prefill", "block-major"])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_arbitrary_metadata_is_never_read_out_of_bounds(case, seed):
    """TensorRT times a plugin during the build on buffers it fills itself: block tables,
    lengths, query starts, prompt lengths and coordinates may hold anything. The kernels must
    then skip the bad accesses (and flag them), never read or write out of bounds:
    scripts/gpu_check.sh runs this under compute-sanitizer memcheck."""
    gen = torch.Generator().manual_seed(100 + seed)
    t, b, w, most = {
        "decode": (24, 24, 40, 1),
        "mixed": (300, 6, 40, 300),
        "prefill": (700, 2, 30, 700),
        "block-major": (1100, 3, 24, 1100),
    }[case]
    sbs = 64 if case == "block-major" else 16
    cfg = make_config(sbs, sparse_topk_blocks=4)
    nb, bsz, h, hkv, d, di = 48, sbs * 2, 8, 2, 128, 64
    dtype = torch.bfloat16
    cache = P.DashKVCache.allocate(nb, bsz, hkv, d, di, sbs, dtype, "cuda")
    fill_garbage(cache, gen)  # TensorRT's timing buffers: the caches are garbage too
    cache.image_page.copy_(_garbage_int32(gen, tuple(cache.image_page.shape), 40))
    cache.summary_pages.copy_(_garbage_int32(gen, tuple(cache.summary_pages.shape), 40))

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).cuda()

    meta = dict(
        block_tables=_garbage_int32(gen, (b, w), nb),
        seq_lens=_garbage_int32(gen, (b,), w * bsz),
        query_start_loc=_garbage_int32(gen, (b + 1,), t),
        prompt_lens=_garbage_int32(gen, (b,), w * bsz),
    )
    if seed % 2:  # half the cases: only the tables are garbage, the lengths consistent
        counts = torch.full((b,), t // b, dtype=torch.int32)
        counts[-1] += t - int(counts.sum())
        meta["query_start_loc"] = torch.cat([torch.zeros(1, dtype=torch.int32), counts.cumsum(0).int()])
        meta["seq_lens"] = counts + torch.randint(0, w * bsz // 2, (b,), generator=gen, dtype=torch.int32)
    coords = _garbage_int32(gen, (t, 4), 40)
    meta = {k: v.cuda() for k, v in meta.items()}
    tuning = cuda.Tuning(block_major_min_tokens=1024) if case == "block-major" else None
    out = cuda.paged_dash_attention_cuda(
        rnd(t, h, d),
        rnd(t, hkv, d),
        rnd(t, hkv, d),
        rnd(t, di),
        rnd(t, di),
        coords.cuda(),
        rnd(di),
        cache,
        **meta,
        sp=cfg,
        layer_idx=0,
        validate=False,
        check_errors=False,
        max_query_len=most,
        tuning=tuning,
    )
    torch.cuda.synchronize()  # a fault would surface here (and memcheck reports it)
    assert out.shape == (t, h, d)


def test_max_query_len_below_a_sequences_tokens_is_refused():
    """max_query_len promises at most that many new tokens per sequence: a prompt of many tokens
    with max_query_len=1 is refused on the host, or skipped and flagged by the kernels."""
    with pytest.raises(ValueError, match="max_query_len=1, but a sequence has"):
        _small_call(max_query_len=1)
    with pytest.raises(cuda.DashKernelError, match="inconsistent"):
        _small_call(max_query_len=1, validate=False, check_errors=True)
    with pytest.raises(ValueError, match="positive int"):
        _small_call(max_query_len=0)


@pytest.mark.parametrize("writer", ["cta", "route"])
def test_decode_only_steps_write_the_cache_like_separate_launches(writer):
    """A decode-only step (max_query_len=1: the write and summary stages fused into the routing
    and attention launches) leaves the same output and the same cache, bit for bit, as the
    separate launches, on steps that complete a sparse block and steps that do not; with the
    writer in a CTA of its own and in the token's first routing CTA (the plan picks one by the
    grid's size; the tuning knob forces it)."""
    tuning = cuda.Tuning(front_writer=WRITERS[writer])
    gen = torch.Generator().manual_seed(31)
    dtype = torch.bfloat16
    cfg = make_config(16, sparse_topk_blocks=4)
    seqs = build_sequences(gen, 3, heads=8, kv_heads=2, head_dim=128, index_dim=64, dtype=dtype, response=20)
    results = []
    for exact in (True, False):
        plans = [[x.length - 20] + [1] * 20 for x, _ in seqs]
        steps, rc, kc = run_both(
            cfg,
            0,
            seqs,
            plans,
            32,
            [None, None, None],
            torch.Generator().manual_seed(3),
            dtype,
            exact_max_query=exact,
            tuning=tuning,
        )
        check(steps, rc, kc, dtype)
        results.append((steps, kc))
    (fused, kf), (sep, ks) = results
    for a, b in zip(fused, sep):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1].selected, b[1].selected)
        assert torch.equal(a[1].bias, b[1].bias)
    for name, tensor in kf.tensors().items():
        assert torch.equal(tensor, ks.tensors()[name]), name


def prompts_written(gen, n, cfg, dtype):
    """n random sequences (8 heads, 2 KV heads, D 128, Di 64) whose prompts, all but their last
    token, are in a fresh cache of 32-token KV blocks, one kernel call each:
    (seqs, cache, pool, prompt lengths)."""
    seqs = build_sequences(gen, n, heads=8, kv_heads=2, head_dim=128, index_dim=64, dtype=dtype, response=1)
    num_blocks = sum(-(-x.length // 32) for x, _ in seqs) + 2
    cache = P.DashKVCache.allocate(num_blocks, 32, 2, 128, 64, 16, dtype, "cuda")
    pool = KVBlockPool(num_blocks, 32)
    lens = [x.length - 1 for x, _ in seqs]
    for i, (x, c) in enumerate(seqs):
        pool.add(i)
        batch = pool.schedule([(i, lens[i])], device="cuda")
        cuda.paged_dash_attention_cuda(
            x.q[: lens[i]],
            x.k[: lens[i]],
            x.v[: lens[i]],
            x.iq[: lens[i]],
            x.ik[: lens[i]],
            c[: lens[i]],
            x.head_cls,
            cache,
            **batch.kwargs(),
            sp=cfg,
            layer_idx=0,
        )
    return seqs, cache, pool, lens


def test_decode_only_graph_replays_match_eager():
    """A decode-only step (max_query_len=1: the write and summary stages folded into the routing
    and attention launches) of 24 sequences, captured in a CUDA graph and replayed 30 times,
    gives the eager call's output and cache every time."""
    gen = torch.Generator().manual_seed(8)
    dtype = torch.bfloat16
    cfg = make_config(16, sparse_topk_blocks=4)
    n = 24
    seqs, cache, pool, lens = prompts_written(gen, n, cfg, dtype)
    batch = pool.schedule([(i, 1) for i in range(n)], device="cuda")
    args = [torch.cat([getattr(seqs[i][0], a)[lens[i] :] for i in range(n)]) for a in ("q", "k", "v", "iq", "ik")]
    args.append(torch.cat([seqs[i][1][lens[i] :] for i in range(n)]))
    args.append(seqs[0][0].head_cls)
    eager_cache = cache.clone()
    eager = cuda.paged_dash_attention_cuda(*args, eager_cache, **batch.kwargs(), sp=cfg, layer_idx=0, max_query_len=1)
    static = batch.to("cuda")
    graph_cache = cache.clone()
    graph, captured = capture(
        lambda c: cuda.paged_dash_attention_cuda(
            *args, c, **static.kwargs(), sp=cfg, layer_idx=0, max_query_len=1, validate=False
        ),
        cache.clone(),
        graph_cache,
    )
    for _ in range(30):  # each replay writes the same token's K, V and summary again
        captured.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager)
        for name, tensor in eager_cache.tensors().items():
            assert torch.equal(graph_cache.tensors()[name], tensor), name


def test_decode_only_call_with_an_idle_sequence():
    """The kernels look a decode-only call's token t up as sequence t first (one token per
    sequence, in order) and search otherwise: a batch whose middle sequence has no new token
    (query_start_loc [0, 1, 1, 2]) gives the same outputs and cache, bit for bit, as the same two
    tokens in a batch of their two sequences."""
    gen = torch.Generator().manual_seed(12)
    dtype = torch.bfloat16
    cfg = make_config(16, sparse_topk_blocks=4)
    seqs, cache, pool, lens = prompts_written(gen, 3, cfg, dtype)
    pair = pool.schedule([(0, 1), (2, 1)], device="cuda")
    width = pair.block_tables.shape[1]
    row1 = torch.full((1, width), -1, dtype=torch.int32)
    used = pool.blocks(1)
    row1[0, : len(used)] = torch.tensor(used[:width], dtype=torch.int32)
    idle = P.DashBatch(
        block_tables=torch.cat([pair.block_tables[:1], row1.to(pair.block_tables.device), pair.block_tables[1:]]),
        seq_lens=torch.tensor([lens[0] + 1, lens[1], lens[2] + 1], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 1, 1, 2], dtype=torch.int32),
        prompt_lens=torch.tensor([-1, -1, -1], dtype=torch.int32),
    ).to("cuda")
    assert torch.equal(pair.prompt_lens.cpu(), torch.tensor([-1, -1], dtype=torch.int32))
    args = [torch.cat([getattr(seqs[i][0], a)[lens[i] :] for i in (0, 2)]) for a in ("q", "k", "v", "iq", "ik")]
    args += [torch.cat([seqs[i][1][lens[i] :] for i in (0, 2)]), seqs[0][0].head_cls]
    results = []
    for batch in (pair, idle):
        c = cache.clone()
        out, sel = cuda.paged_dash_attention_cuda(
            *args, c, **batch.kwargs(), sp=cfg, layer_idx=0, max_query_len=1, return_selected=True
        )
        results.append((out, sel, c))
    (a, sa, ca), (b, sb, cb) = results
    assert torch.equal(a, b) and torch.equal(sa, sb)
    for name, tensor in ca.tensors().items():
        assert torch.equal(tensor, cb.tensors()[name]), name


def test_queries_at_an_unaligned_address_give_the_same_result():
    """The tensor-core attention stages the queries by 16-byte copies where q's address allows
    and loads them one by one otherwise: a q that starts 2 bytes into its storage gives the same
    outputs and cache, bit for bit, on a prompt step and on decode-only steps (fused write)."""
    gen = torch.Generator().manual_seed(17)
    dtype = torch.bfloat16
    cfg = make_config(16)
    seqs = build_sequences(gen, 2, heads=8, kv_heads=2, head_dim=128, index_dim=64, dtype=dtype, response=3)

    def unaligned(x):
        buf = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)
        view = buf[1:].view_as(x)
        view.copy_(x)
        assert view.is_contiguous() and view.data_ptr() % 16 != 0
        return view

    results = []
    for shift in (False, True):
        plans = [[x.length - 3, 1, 1, 1] for x, _ in seqs]
        num_blocks = sum(-(-x.length // 32) for x, _ in seqs) + 2
        cache = P.DashKVCache.allocate(num_blocks, 32, 2, 128, 64, 16, dtype, "cuda")
        pool = KVBlockPool(num_blocks, 32)
        for i in range(len(seqs)):
            pool.add(i)
        done, outs = [0] * len(seqs), []
        while any(plans):
            step = [(i, plans[i].pop(0)) for i in range(len(seqs)) if plans[i]]
            batch = pool.schedule(step, device="cuda")
            rows = [(i, done[i], done[i] + n) for i, n in step]
            q, k, v, iq, ik = (
                torch.cat([getattr(seqs[i][0], a)[lo:hi] for i, lo, hi in rows]) for a in ("q", "k", "v", "iq", "ik")
            )
            coords = torch.cat([seqs[i][1][lo:hi] for i, lo, hi in rows])
            outs.append(
                cuda.paged_dash_attention_cuda(
                    unaligned(q) if shift else q,
                    k,
                    v,
                    iq,
                    ik,
                    coords,
                    seqs[0][0].head_cls,
                    cache,
                    **batch.kwargs(),
                    sp=cfg,
                    layer_idx=0,
                    max_query_len=max(n for _, n in step),
                )
            )
            for i, _, hi in rows:
                done[i] = hi
        results.append((outs, cache))
    (aligned, ca), (shifted, cs) = results
    assert len(aligned) == 4
    for a, b in zip(aligned, shifted):
        assert torch.equal(a, b)
    for name, tensor in ca.tensors().items():
        assert torch.equal(tensor, cs.tensors()[name]), name


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim, heads, kv_heads", [(128, 8, 2), (64, 4, 4), (128, 32, 8), (256, 8, 2), (64, 16, 1)])
@pytest.mark.parametrize("prompt_mode", ["none", "prompt"])
@pytest.mark.parametrize("local_blocks", [1, 2])
def test_block_major_prefill_path(dtype, head_dim, heads, kv_heads, prompt_mode, local_blocks):
    """Prefill attention by block (count, scan, fill, tensor-core tiles over the selected and
    the local-window blocks, combine), forced on small inputs and split into several passes;
    mixed with decode tokens of another sequence."""
    tuning = cuda.Tuning(block_major_min_tokens=64, block_major_chunk=300)
    gen = torch.Generator().manual_seed(head_dim + heads + local_blocks)
    cfg = make_config(64, sparse_topk_blocks=4, sparse_page_bias=0.5, sparse_local_block=local_blocks)
    seqs = build_sequences(
        gen,
        3,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        index_dim=64,
        dtype=dtype,
        pages=(6, 9),
        max_images=120,
        response=6,
    )
    plans = schedule(gen, seqs, 6)
    prompts = [None] * 3 if prompt_mode == "none" else [x.length - 6 - 40 * i for i, (x, _) in enumerate(seqs)]
    steps, rc, kc = run_both(cfg, 0, seqs, plans, 128, prompts, gen, dtype, tuning=tuning)
    assert any(out.shape[0] >= 300 for out, *_ in steps)  # several block-major passes happened
    check(steps, rc, kc, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim, heads, kv_heads", [(128, 8, 2), (64, 4, 4), (64, 16, 1)])
@pytest.mark.parametrize("share_min", [1, 0, -1])
def test_query_major_tiles(dtype, head_dim, heads, kv_heads, share_min):
    """The block-major prefill's query-major tiles (tiles of 128 / G tokens reading the blocks
    they share: local windows, and blocks read by share_min of their tokens; 0: the default
    5/8; 1: every block any token reads; -1: none) on pages of up to 11 sparse blocks, so that
    forced page blocks are shared, and more than top-k of them compete; several passes, tiles
    that straddle two sequences, decode tokens of other sequences in the same calls."""
    tuning = cuda.Tuning(block_major_min_tokens=64, block_major_chunk=300, tile_share_min=share_min)
    run_tile_case(dtype, heads, kv_heads, head_dim, tuning, head_dim + heads + share_min, (2, 4), 700)


def run_tile_case(dtype, heads, kv_heads, head_dim, tuning, seed, pages, max_images):
    """Three sequences of document pages (the second with a prompt_length 100 tokens before its
    end), top-4 of 64-token blocks with a one-block window, prefilled in several block-major
    passes of 300 tokens, then decoded, through the reference and the kernels: the results
    checked against the reference; returns the kernels' outputs of every step."""
    gen = torch.Generator().manual_seed(seed)
    cfg = make_config(64, sparse_topk_blocks=4, sparse_page_bias=0.5, sparse_local_block=1)
    seqs = build_sequences(
        gen,
        3,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        index_dim=64,
        dtype=dtype,
        pages=pages,
        max_images=max_images,
        response=6,
    )
    plans = schedule(gen, seqs, 6)
    prompts = [None, seqs[1][0].length - 100, None]
    steps, rc, kc = run_both(cfg, 0, seqs, plans, 128, prompts, gen, dtype, tuning=tuning)
    assert any(out.shape[0] >= 300 for out, *_ in steps)
    check(steps, rc, kc, dtype)
    return [out for out, *_ in steps]


@pytest.mark.parametrize("head_dim, topk", [(64, 20), (128, 36)])
def test_query_major_tiles_too_many_slots_to_merge(head_dim, topk):
    """A top-k so large that a query-major tile cannot list its rows' block-major slots in its
    shared memory (over 18 slots at head dim 64, 34 at 128): the tiles write partials and the
    combine merges every token, as before the tiles merged their own."""
    dtype = torch.bfloat16
    tuning = cuda.Tuning(block_major_min_tokens=64, block_major_chunk=600)
    gen = torch.Generator().manual_seed(topk)
    cfg = make_config(64, sparse_topk_blocks=topk, sparse_page_bias=0.5, sparse_local_block=1)
    seqs = build_sequences(
        gen,
        2,
        heads=8,
        kv_heads=2,
        head_dim=head_dim,
        index_dim=64,
        dtype=dtype,
        pages=(6, 8),
        max_images=1200,
        response=6,
    )
    plans = schedule(gen, seqs, 6)
    steps, rc, kc = run_both(cfg, 0, seqs, plans, 128, [None, None], gen, dtype, tuning=tuning)
    assert any(out.shape[0] >= 600 for out, *_ in steps)
    assert max(x.length for x, _ in seqs) > (topk + 2) * 64  # more remote blocks than the top-k
    check(steps, rc, kc, dtype)


@pytest.mark.parametrize(
    "heads, kv_heads, share_min, correlated", [(8, 2, 0, True), (32, 8, 0, True), (4, 4, 1, False), (8, 2, 1, True)]
)
def test_query_major_tiles_read_far_blocks(heads, kv_heads, share_min, correlated):
    """Query-major tiles list the blocks enough of their tokens select anywhere before them, not
    only near their own: one sequence of over 9,000 tokens (more sparse blocks than the 128 a
    tile lists). ``correlated``: a page's tokens share one random indexer query plus a tenth of
    it in noise, so that they select the same far blocks (as a trained indexer's would);
    otherwise independent queries with share_min 1 at G 1, so that a tile's 128 tokens select
    more distinct blocks than its list holds and the rest stay block-major."""
    import dataclasses

    from dash_trt.testing import ROLE_PAGE

    dtype = torch.bfloat16
    tuning = cuda.Tuning(block_major_min_tokens=64, block_major_chunk=1000, tile_share_min=share_min)
    gen = torch.Generator().manual_seed(heads * 10 + kv_heads + share_min)
    cfg = make_config(64, sparse_topk_blocks=8, sparse_page_bias=0.5, sparse_local_block=1)
    seqs = build_sequences(
        gen,
        1,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=128,
        index_dim=64,
        dtype=dtype,
        pages=(64, 64),
        max_images=330,
        response=6,
    )
    x, coords = seqs[0]
    assert x.length > (128 + 16) * 64
    if correlated:
        page_of = torch.cumsum((x.roles == ROLE_PAGE).long(), 0).clamp(min=1) - 1  # the response's markers too
        shared = torch.randn(int(page_of.max()) + 1, x.iq.shape[1], generator=gen).to(x.iq.device)
        x = dataclasses.replace(x, iq=(shared[page_of.to(x.iq.device)] + 0.1 * x.iq.float()).to(dtype))
        seqs = [(x, coords)]
    plans = schedule(gen, seqs, 6)
    steps, rc, kc = run_both(cfg, 0, seqs, plans, 128, [None], gen, dtype, tuning=tuning)
    assert any(out.shape[0] >= 1000 for out, *_ in steps)
    check(steps, rc, kc, dtype)
    # The case is what it claims, by the reference's selections on the kernels' tile grid.
    far, widest = far_tile_stats(
        [r.selected.cpu() for *_, r in steps],
        plans[0],
        128 // (heads // kv_heads),
        1000,
        64,
        max(1, share_min) if share_min else (128 // (heads // kv_heads)) * 5 // 8,
    )
    if correlated:
        assert far > 0  # tiles that serve a block more than 128 blocks back
    else:
        assert widest > 128 - 4  # more distinct selected blocks than the list holds beside the local ones


def far_tile_stats(selections, chunks, tile, chunk, sbs, share):
    """Over the query-major tiles of a single sequence's calls (``selections[i]``: call i's
    [tokens, k] selected blocks, ``chunks[i]`` its token count; passes of ``chunk`` tokens, tiles
    of ``tile``): how many tiles have a block more than 128 blocks before their last token's that
    ``share`` of their tokens select, and the most distinct blocks one tile selects. Calls of
    fewer than 64 tokens are left out (they stay token-major in the test's tuning)."""
    far = widest = 0
    start = 0
    for sel, n in zip(selections, chunks):
        for p0 in range(0, n if n >= 64 else 0, chunk):  # block-major calls (block_major_min_tokens=64)
            for a in range(p0, min(p0 + chunk, n), tile):
                b = min(a + tile, p0 + chunk, n)
                base = (start + b - 1) // sbs
                rows = sel[a:b]
                blocks, counts = torch.unique(rows[rows >= 0], return_counts=True)
                widest = max(widest, blocks.numel())
                far += int(((blocks <= base - 128) & (counts >= share)).any())
        start += n
    return far, widest


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, share_min", [(8, 2, 0), (32, 8, 0), (8, 2, -1), (16, 1, 1)])
def test_warpgroup_tiles_match_the_mma_sync_tiles(dtype, heads, kv_heads, share_min):
    """Head dim 128 on an sm_90 GPU: the block-major and query-major tiles as warpgroup MMAs (the
    default where the library carries sm_90a code: warpgroup_mma=0), either kind alone (1: the
    block-major ones, 2: the query-major ones) and the mma.sync tiles (-1) all match the
    reference, and each other to rounding (fp32 accumulation in a different order); elsewhere
    every run takes the mma.sync tiles and they must agree bit for bit. The warpgroup block-major
    tiles in CTAs of one and of two warpgroups (block_major_warpgroups 1, 2) compute every 64-row
    tile alike: bit for bit the same output."""
    outs = []
    for wg, bm_wg in ((0, 0), (0, 1), (0, 2), (1, 0), (2, 0), (-1, 0)):
        tuning = cuda.Tuning(
            block_major_min_tokens=64,
            block_major_chunk=300,
            tile_share_min=share_min,
            warpgroup_mma=wg,
            block_major_warpgroups=bm_wg,
        )
        steps = run_tile_case(dtype, heads, kv_heads, 128, tuning, heads + kv_heads + share_min, (2, 6), 500)
        outs.append([out.float() for out in steps])
    cap = torch.cuda.get_device_capability()
    hopper = cap == (9, 0) and any(a == "sm_90a" for a in (cuda.compiled_architectures() or ()))
    for a, b in zip(outs[1], outs[2]):
        assert torch.equal(a, b)
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            if hopper:
                torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
            else:
                assert torch.equal(a, b)


@pytest.mark.parametrize(
    "head_dim, heads, kv_heads, wg", [(128, 8, 2, 0), (128, 32, 8, 0), (128, 8, 2, -1), (64, 16, 1, 0)]
)
def test_block_major_ctas_serving_many_work_items_match_one_each(head_dim, heads, kv_heads, wg):
    """The block-major CTAs serve work items in turn (CTA x of a KV head: items x, x + CTAs,
    ...), the next item's entry records copied while the current one's tiles run: with one CTA
    per KV head serving every item, and with three, the output is bit for bit that of the
    default grid (one CTA a work item), and the reference's (run_tile_case)."""
    outs = []
    for ctas in (0, 1, 3):
        tuning = cuda.Tuning(block_major_min_tokens=64, block_major_chunk=300, warpgroup_mma=wg, block_major_ctas=ctas)
        outs.append(
            run_tile_case(torch.bfloat16, heads, kv_heads, head_dim, tuning, heads + kv_heads + head_dim, (2, 6), 500)
        )
    for other in outs[1:]:
        assert len(other) == len(outs[0])
        for a, b in zip(outs[0], other):
            assert torch.equal(a, b)


@pytest.mark.parametrize(
    "head_dim, heads, kv_heads, topk", [(128, 8, 2, 4), (128, 32, 8, 4), (64, 16, 1, 4), (128, 8, 2, 36)]
)
def test_overlapped_query_major_tiles_match_serialized_ones(head_dim, heads, kv_heads, topk):
    """tune_tile_overlap: the query-major tiles start while the block-major tiles run (on sm_90
    and later) and wait for them only before merging their partials; top-k 36 at head dim 128
    is too many slots for the tiles to merge (they write partials for the combine instead). With
    one block-major CTA per KV head serving every work item, the tiles' main loops surely run
    before the partials are complete, so a merge that did not wait would read unfinished ones.
    Every step's output is bit for bit the serialized launches' and within the reference's
    tolerance."""
    dtype = torch.bfloat16
    outs = []
    for overlap, ctas in ((-1, 0), (0, 0), (0, 1)):
        tuning = cuda.Tuning(
            block_major_min_tokens=64, block_major_chunk=600, tile_overlap=overlap, block_major_ctas=ctas
        )
        gen = torch.Generator().manual_seed(head_dim + heads + topk)
        cfg = make_config(64, sparse_topk_blocks=topk, sparse_page_bias=0.5, sparse_local_block=1)
        seqs = build_sequences(
            gen,
            2,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            index_dim=64,
            dtype=dtype,
            pages=(6, 8),
            max_images=1200,
            response=4,
        )
        plans = schedule(gen, seqs, 4)
        steps, rc, kc = run_both(cfg, 0, seqs, plans, 128, [None, None], gen, dtype, tuning=tuning)
        assert any(out.shape[0] >= 600 for out, *_ in steps)
        check(steps, rc, kc, dtype)
        outs.append([out for out, *_ in steps])
    for other in outs[1:]:
        assert len(other) == len(outs[0])
        for a, b in zip(outs[0], other):
            assert torch.equal(a, b)


def test_block_major_prefill_graph_replays_match_eager():
    """A block-major prefill (query-major tiles, overlapped with the block-major ones where the
    GPU allows, one block-major CTA per KV head so that they surely overlap) captured in a CUDA
    graph and replayed: the output and the cache bit for bit the eager call's."""
    gen = torch.Generator().manual_seed(29)
    dtype = torch.bfloat16
    cfg = make_config(64, sparse_topk_blocks=4, sparse_page_bias=0.5, sparse_local_block=1)
    ((x, coords),) = build_sequences(
        gen, 1, heads=8, kv_heads=2, head_dim=128, index_dim=64, dtype=dtype, pages=(8, 8), max_images=1200, response=0
    )
    tuning = cuda.Tuning(block_major_min_tokens=64, block_major_chunk=1024, block_major_ctas=1)
    cache = P.DashKVCache.allocate(-(-x.length // 128) + 1, 128, 2, 128, 64, 64, dtype, "cuda")
    fill_garbage(cache, gen)
    pool = KVBlockPool(cache.key.shape[0], 128)
    pool.add(0)
    batch = pool.schedule([(0, x.length)], device="cuda")
    assert x.length > 2 * 1024  # several passes
    args = (x.q, x.k, x.v, x.iq, x.ik, coords, x.head_cls)
    eager_cache = cache.clone()
    eager = cuda.paged_dash_attention_cuda(*args, eager_cache, **batch.kwargs(), sp=cfg, layer_idx=0, tuning=tuning)
    static = batch.to("cuda")
    graph_cache = cache.clone()
    graph, captured = capture(
        lambda c: cuda.paged_dash_attention_cuda(
            *args, c, **static.kwargs(), sp=cfg, layer_idx=0, validate=False, tuning=tuning
        ),
        cache.clone(),
        graph_cache,
    )
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager)
    assert torch.equal(graph_cache.key, eager_cache.key)
    assert torch.equal(graph_cache.summary, eager_cache.summary)


def test_block_major_prefill_under_the_split_routing():
    """Block-major calls of fewer tokens than the fused routing takes (64 to 263) over a block
    table of more than 256 sparse blocks go through the split routing, which leaves the queries'
    rotation to a kernel a pass at a time (the fused routing rotates each token's queries into
    the output buffer itself, Plan::rope_routed): both ways must give the reference's output."""
    tuning = cuda.Tuning(block_major_min_tokens=64, block_major_chunk=100)
    gen = torch.Generator().manual_seed(23)
    dtype = torch.bfloat16
    cfg = make_config(64, sparse_topk_blocks=4, sparse_page_bias=0.5)
    seqs = build_sequences(
        gen, 2, heads=8, kv_heads=2, head_dim=128, index_dim=64, dtype=dtype, pages=(6, 9), max_images=120, response=2
    )
    plans = []
    for x, _ in seqs:
        prompt = x.length - 2
        plans.append([100] * (prompt // 100) + ([prompt % 100] if prompt % 100 else []) + [1, 1])
    steps, rc, kc = run_both(cfg, 0, seqs, plans, 64, [None, None], gen, dtype, table_width=300, tuning=tuning)
    assert any(64 <= out.shape[0] < 264 for out, *_ in steps)  # block-major, split routing (300 > 256 blocks)
    check(steps, rc, kc, dtype)


def test_block_major_decode_only_steps_still_write_the_cache():
    """Decode-only steps forced onto the block-major attention (its threshold below T) keep the
    separate write stage: the block-major kernels write no K and V, so the fused decode write
    (Plan::fused_front) must not be chosen with them."""
    tuning = cuda.Tuning(block_major_min_tokens=2)
    gen = torch.Generator().manual_seed(17)
    dtype = torch.bfloat16
    cfg = make_config(64, sparse_topk_blocks=4, sparse_page_bias=0.5)
    seqs = build_sequences(
        gen, 3, heads=8, kv_heads=2, head_dim=128, index_dim=64, dtype=dtype, pages=(6, 9), max_images=120, response=6
    )
    plans = schedule(gen, seqs, 6)
    steps, rc, kc = run_both(cfg, 0, seqs, plans, 128, [None] * 3, gen, dtype, tuning=tuning)
    assert any(out.shape[0] == 3 for out, *_ in steps)  # decode-only steps of 3 tokens (>= 2)
    check(steps, rc, kc, dtype)


def test_torch_op_runs_the_kernels_on_cuda():
    """dash_trt.attention.dash.ops on CUDA tensors goes through the kernels (registered at import when the
    library is built) and returns updated caches without touching its inputs."""
    from dash_trt.attention.dash import ops

    assert ops.cuda_impls() == (cuda.op_impl, cuda.op_impl_inplace)
    gen = torch.Generator().manual_seed(21)
    dtype = torch.bfloat16
    cfg = make_config(16)
    ((x, coords),) = build_sequences(gen, 1, heads=8, kv_heads=2, head_dim=128, index_dim=64, dtype=dtype, response=0)
    cache = P.DashKVCache.allocate(32, 32, 2, 128, 64, 16, dtype, "cuda")
    pool = KVBlockPool(32, 32)
    pool.add(0)
    batch = pool.schedule([(0, x.length)], device="cuda")
    before = cache.clone()
    out, new = ops.paged_attention(
        x.q, x.k, x.v, x.iq, x.ik, coords, x.head_cls, cache, *batch.kwargs().values(), cfg, 0
    )
    assert torch.equal(cache.key, before.key)  # functional: inputs untouched
    ref_cache = before.clone()
    ref, ref_r = P.paged_dash_attention(
        x.q,
        x.k,
        x.v,
        x.iq,
        x.ik,
        coords,
        x.head_cls,
        ref_cache,
        **batch.kwargs(),
        sp=cfg,
        layer_idx=0,
        return_routing=True,
    )
    report = compare_outputs(out, ref, None, None, dtype=dtype)
    assert report.ok, str(report)
    torch.testing.assert_close(new[1], ref_cache.value, atol=0, rtol=0)
