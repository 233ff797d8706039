"""docs/spec.md property 6: the paged operator equals the reference on every sequence's
contiguous history, for any KV-block size, block-table permutation and mix of
prefill chunks and decode steps. Plus the cache contract and bad input."""

from dataclasses import dataclass

import pytest
import torch
from conftest import DTYPES
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dash_trt.attention.dash import paged as P
from dash_trt.attention.dash import reference as R
from dash_trt.attention.dash.config import DashConfig
from dash_trt.serving.block_pool import CacheFullError, KVBlockPool
from dash_trt.testing import compare_outputs, fill_garbage, random_config, random_inputs, random_roles

HEADS, KV_HEADS, D, DI = 4, 2, 16, 16
SHARED_HEAD_CLS = torch.randn(DI, generator=torch.Generator().manual_seed(99))


@dataclass
class Seq:
    x: object  # DashInputs
    coords: torch.Tensor
    prompt: int | None
    chunks: list[int]


def make_seq(
    gen, pages, response, prompt_mode, n_chunks, decode_from, dtype=torch.float32, max_images=12, head_cls=None
):
    """One random sequence; sequences of one batch share the layer's `head_cls`."""
    roles = random_roles(gen, pages, response=response, response_markers=min(2, response), max_images=max_images)
    if head_cls is None:
        head_cls = SHARED_HEAD_CLS
    x = random_inputs(
        gen, roles, heads=HEADS, kv_heads=KV_HEADS, head_dim=D, index_dim=DI, dtype=dtype, head_cls=head_cls.to(dtype)
    )
    s = x.length
    prompt_tokens = s - response
    prompt = {"none": None, "prompt": prompt_tokens, "short": max(0, prompt_tokens - 5)}[prompt_mode]
    # prefill the first `decode_from` tokens (default: the prompt) in n_chunks random
    # chunks, then decode one by one
    decode_from = prompt_tokens if decode_from is None else min(max(1, decode_from), s)
    cuts = sorted(set(torch.randint(1, max(2, decode_from), (n_chunks - 1,), generator=gen).tolist()))
    cuts = [c for c in cuts if 0 < c < decode_from]
    bounds = [0, *cuts, decode_from]
    chunks = [b - a for a, b in zip(bounds, bounds[1:]) if b > a] + [1] * (s - decode_from)
    return Seq(x, P.sequence_coords(roles), prompt, chunks)


def permuted_tables(gen, seqs, block_size, extra_blocks, spare_columns):
    """Block tables over a random permutation of the needed physical blocks plus
    ``extra_blocks``, -1 padded, ``spare_columns`` wider than the longest sequence needs.
    Returns (tables [B, W] int32, number of physical blocks)."""
    needs = [-(-s.x.length // block_size) for s in seqs]
    num_blocks = sum(needs) + extra_blocks
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, off = torch.full((len(seqs), max(needs) + spare_columns), -1, dtype=torch.int32), 0
    for i, n in enumerate(needs):
        tables[i, :n] = torch.tensor(perm[off : off + n], dtype=torch.int32)
        off += n
    return tables, num_blocks


def ragged_steps(gen, seqs):
    """Random ragged batches over the sequences' chunks: each step takes the next chunk of a
    random subset of the live sequences (at least one), in random order. Yields
    (pick, rows, qsl, lens, prompts): rows are (sequence, start, end) token ranges, qsl the
    query start locations, lens the lengths after the step, prompts -1 for none."""
    done, step_of = [0] * len(seqs), [0] * len(seqs)
    while any(step_of[i] < len(s.chunks) for i, s in enumerate(seqs)):
        live = [i for i, s in enumerate(seqs) if step_of[i] < len(s.chunks)]
        pick = [i for i in live if bool(torch.rand(1, generator=gen) < 0.7)] or live[:1]
        pick = [pick[j] for j in torch.randperm(len(pick), generator=gen).tolist()]
        rows, qsl, lens, prompts = [], [0], [], []
        for i in pick:
            n = seqs[i].chunks[step_of[i]]
            rows.append((i, done[i], done[i] + n))
            qsl.append(qsl[-1] + n)
            lens.append(done[i] + n)
            prompts.append(-1 if seqs[i].prompt is None else seqs[i].prompt)
        yield pick, rows, qsl, lens, prompts
        for i, _, b in rows:
            done[i] = b
            step_of[i] += 1


def run_paged(seqs, cfg, layer, block_size, gen, extra_blocks=3):
    """Run all sequences through the paged operator, interleaving them step by step
    with a random permutation of physical blocks. Returns per-sequence outputs and
    routing rows."""
    sbs = cfg.sparse_block_size
    tables, num_blocks = permuted_tables(gen, seqs, block_size, extra_blocks, spare_columns=1)
    dtype = seqs[0].x.q.dtype
    assert all(torch.equal(s.x.head_cls, seqs[0].x.head_cls) for s in seqs), "head_cls is per layer"
    cache = P.DashKVCache.allocate(num_blocks, block_size, KV_HEADS, D, DI, sbs, dtype=dtype)
    fill_garbage(cache, gen, scale=100.0)  # nothing may depend on unwritten slots
    outs = [[] for _ in seqs]
    routes = [[] for _ in seqs]
    for pick, rows, qsl, lens, prompts in ragged_steps(gen, seqs):

        def cat(name, rows=rows):
            return torch.cat([getattr(seqs[i].x, name)[a:b] for i, a, b in rows])

        out, routing = P.paged_dash_attention(
            cat("q"),
            cat("k"),
            cat("v"),
            cat("iq"),
            cat("ik"),
            torch.cat([seqs[i].coords[a:b] for i, a, b in rows]),
            seqs[0].x.head_cls,
            cache,
            tables[pick],
            torch.tensor(lens, dtype=torch.int32),
            torch.tensor(qsl, dtype=torch.int32),
            torch.tensor(prompts, dtype=torch.int32),
            cfg,
            layer,
            return_routing=True,
        )
        for j, (i, _, _) in enumerate(rows):
            outs[i].append(out[qsl[j] : qsl[j + 1]])
            routes[i].append(routing.selected[qsl[j] : qsl[j + 1]])
    return outs, routes, cache, tables


def check_against_reference(seqs, outs, routes, cfg, layer):
    for s, o, r in zip(seqs, outs, routes):
        x = s.x
        want, want_r = R.dash_attention(
            x.q, x.k, x.v, x.iq, x.ik, x.roles, x.head_cls, cfg, layer, s.prompt, return_routing=True
        )
        got = torch.cat(o)
        width = max(t.shape[1] for t in r)
        sel = torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1]), value=-1) for t in r])
        report = compare_outputs(got, want, R.Routing(sel), want_r)
        assert report.ok, str(report)
        assert report.near_ties == 0 or report.near_ties < x.length // 10


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**31 - 1),
    sbs=st.sampled_from([4, 8]),
    block_size=st.sampled_from([1, 3, 4, 5, 8, 12, 16]),
    nseq=st.integers(1, 3),
    layer=st.sampled_from([0, 1]),
)
def test_paged_equals_reference_random_batches(seed, sbs, block_size, nseq, layer):
    gen = torch.Generator().manual_seed(seed)
    cfg = random_config(gen, sparse_block_size=sbs)
    seqs = []
    for _ in range(nseq):
        pages = int(torch.randint(1, 5, (1,), generator=gen))
        response = int(torch.randint(0, 20, (1,), generator=gen))
        mode = ["none", "prompt", "short"][int(torch.randint(3, (1,), generator=gen))]
        n_chunks = int(torch.randint(1, 4, (1,), generator=gen))
        decode_from = int(torch.randint(1, 120, (1,), generator=gen))
        seqs.append(make_seq(gen, pages, response, mode, n_chunks, decode_from))
    outs, routes, _, _ = run_paged(seqs, cfg, layer, block_size, gen)
    check_against_reference(seqs, outs, routes, cfg, layer)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [8, 16, 24])
def test_paged_dtypes_and_block_sizes(dtype, block_size):
    gen = torch.Generator().manual_seed(block_size)
    cfg = random_config(gen, sparse_block_size=8, dash_topk_blocks=3)
    seqs = [make_seq(gen, 3, 12, "prompt", 2, 60, dtype=dtype), make_seq(gen, 2, 5, "none", 1, 200, dtype=dtype)]
    outs, routes, _, _ = run_paged(seqs, cfg, 0, block_size, gen)
    for o in outs:
        assert all(t.dtype == dtype for t in o)
    check_against_reference(seqs, outs, routes, cfg, 0)


def test_paged_long_sequences_mixed_prefill_and_decode():
    """A few thousand tokens per sequence, prefill chunks and decode steps mixed in one batch."""
    gen = torch.Generator().manual_seed(7)
    cfg = random_config(gen, sparse_block_size=16, sparse_local_block=1, dash_topk_blocks=12, dash_query_chunk=512)
    seqs = [
        make_seq(gen, 40, 24, "prompt", 4, None, max_images=120),
        make_seq(gen, 25, 16, "none", 3, None, max_images=120),
    ]
    assert min(s.x.length for s in seqs) > 1000
    assert all(s.chunks[-16:] == [1] * 16 and max(s.chunks) > 100 for s in seqs)
    outs, routes, _, _ = run_paged(seqs, cfg, 0, 32, gen)
    check_against_reference(seqs, outs, routes, cfg, 0)


def test_cache_holds_rotated_keys_values_and_index_keys():
    gen = torch.Generator().manual_seed(11)
    cfg = random_config(gen, sparse_block_size=4)
    seq = make_seq(gen, 2, 6, "none", 2, 30)
    _, _, cache, tables = run_paged([seq], cfg, 0, 8, gen)
    x, s = seq.x, seq.x.length
    tok, page, image_page, _ = R.page_coordinates(x.roles)
    pos = torch.arange(s)
    slots = P.slot_mapping(tables, torch.zeros(s, dtype=torch.long), pos, 8)
    flat = lambda t: t.view(-1, *t.shape[2:])  # noqa: E731
    torch.testing.assert_close(flat(cache.key)[slots], R.page_rope(x.k, tok, page, cfg, main=True), atol=0, rtol=0)
    torch.testing.assert_close(flat(cache.value)[slots], x.v, atol=0, rtol=0)
    torch.testing.assert_close(
        flat(cache.index_key)[slots], R.page_rope(x.ik, tok, page, cfg, main=False), atol=0, rtol=0
    )
    assert torch.equal(cache.image_page.view(-1)[slots].long(), image_page)
    # summaries of complete blocks equal the reference's block summaries
    n = s // 4
    ik = R.page_rope(x.ik, tok, page, cfg, main=False).float()[: n * 4].view(n, 4, -1)
    want = R.block_summaries(ik, torch.ones(n, 4, dtype=torch.bool), x.head_cls)
    got, pages = P._block_state(cache, tables[0].long(), n, n, 4)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_decode_reads_summaries_not_index_keys():
    """After prefill, overwrite the index keys of every complete sparse block with
    large random values: decode must be unaffected, since it reads only the stored
    summaries (and the index keys of the block it is completing)."""
    gen = torch.Generator().manual_seed(5)
    cfg = random_config(gen, sparse_block_size=8, dash_topk_blocks=2)
    seq = make_seq(gen, 4, 0, "none", 1, 10_000)
    x, s = seq.x, seq.x.length
    prefill = s - 12
    pool = KVBlockPool(64, 16)
    cache = P.DashKVCache.allocate(64, 16, KV_HEADS, D, DI, 8)
    pool.add(0)

    def step(a, b):
        batch = pool.schedule([(0, b - a)])
        return P.paged_dash_attention(
            x.q[a:b],
            x.k[a:b],
            x.v[a:b],
            x.iq[a:b],
            x.ik[a:b],
            seq.coords[a:b],
            x.head_cls,
            cache,
            **batch.kwargs(),
            sp=cfg,
            layer_idx=0,
        )

    outs = [step(0, prefill)]
    complete = (prefill // 8) * 8
    table = torch.tensor(pool.blocks(0))
    slots = P.slot_mapping(table[None], torch.zeros(complete, dtype=torch.long), torch.arange(complete), 16)
    poison = torch.randn(complete, DI, generator=gen) * 50
    cache.index_key.view(-1, DI)[slots] = poison
    for p in range(prefill, s):
        outs.append(step(p, p + 1))
    want = R.dash_attention(x.q, x.k, x.v, x.iq, x.ik, x.roles, x.head_cls, cfg, 0)
    torch.testing.assert_close(torch.cat(outs), want, atol=2e-5, rtol=2e-5)
    # The poison would have changed the answer had decode re-read those index keys.
    tok, page, _, _ = R.page_coordinates(x.roles)
    y_ik = x.ik.clone()
    y_ik[:complete] = poison  # (unrotated is fine: any large change moves the summaries)
    poisoned = R.dash_attention(x.q, x.k, x.v, x.iq, x.ik.clone().copy_(y_ik), x.roles, x.head_cls, cfg, 0)
    assert (poisoned[prefill:] - want[prefill:]).abs().max() > 1e-3


# ---------------------------------------------------------------------- the pool
def test_pool_allocates_atomically_and_frees():
    pool = KVBlockPool(num_blocks=6, block_size=4)
    pool.add("a", prompt_length=5)
    pool.add("b")
    batch = pool.schedule([("a", 9), ("b", 4)])  # a: 3 blocks, b: 1 block
    assert batch.seq_lens.tolist() == [9, 4]
    assert batch.query_start_loc.tolist() == [0, 9, 13]
    assert batch.prompt_lens.tolist() == [5, -1]
    assert batch.block_tables.tolist() == [[0, 1, 2], [3, -1, -1]]
    assert pool.num_free_blocks == 2
    with pytest.raises(CacheFullError, match="needs 3 more KV blocks, only 2"):
        pool.schedule([("a", 4), ("b", 5)])  # a needs 1, b needs 2
    assert pool.num_free_blocks == 2 and pool.length("a") == 9 and pool.length("b") == 4
    pool.free("a")
    assert pool.num_free_blocks == 5 and "a" not in pool
    batch = pool.schedule([("b", 5)], table_width=4)
    assert batch.block_tables.tolist() == [[3, 0, 1, -1]]
    with pytest.raises(KeyError, match="unknown sequence 'a'"):
        pool.schedule([("a", 1)])
    with pytest.raises(ValueError, match="already exists"):
        pool.add("b")
    with pytest.raises(ValueError, match="only once per step"):
        pool.schedule([("b", 1), ("b", 1)])
    with pytest.raises(ValueError, match="must be positive"):
        pool.schedule([("b", 0)])


# ---------------------------------------------------------------------- bad input
def _one_step(**change):
    return P.paged_dash_attention(**_one_step_args(**change))


def _one_step_args(**change):
    gen = torch.Generator().manual_seed(0)
    cfg = random_config(gen, sparse_block_size=4)
    seq = make_seq(gen, 2, 0, "none", 1, 1000)
    x, s = seq.x, seq.x.length
    nb = -(-s // 8)
    cache = P.DashKVCache.allocate(nb, 8, KV_HEADS, D, DI, 4)
    table = torch.arange(nb, dtype=torch.int32)[None]
    args = dict(
        q=x.q,
        k=x.k,
        v=x.v,
        iq=x.iq,
        ik=x.ik,
        coords=seq.coords,
        head_cls=x.head_cls,
        cache=cache,
        block_tables=table,
        seq_lens=torch.tensor([s], dtype=torch.int32),
        query_start_loc=torch.tensor([0, s], dtype=torch.int32),
        prompt_lens=torch.tensor([-1], dtype=torch.int32),
        sp=cfg,
        layer_idx=0,
    )
    args.update({k: (v(args) if callable(v) else v) for k, v in change.items()})
    return args


def test_one_step_baseline_runs():
    assert _one_step().shape[1:] == (HEADS, D)


def test_the_batch_may_come_as_one_dash_batch():
    """The four batch tensors by name, one DashBatch in their place (positional or ``batch=``),
    or every argument positional: the same output."""
    base = _one_step()
    fields, tokens = P.BATCH_FIELDS, P.TOKEN_FIELDS

    def as_batch(a):
        return P.DashBatch(*(a.pop(f) for f in fields))

    def positional(a, middle):
        return [*(a[n] for n in tokens), a["cache"], *middle, a["sp"], a["layer_idx"]]

    a = _one_step_args()
    assert torch.equal(P.paged_dash_attention(**a, batch=as_batch(a)), base)
    a = _one_step_args()
    assert torch.equal(P.paged_dash_attention(*positional(a, [as_batch(a)])), base)
    a = _one_step_args()
    assert torch.equal(P.paged_dash_attention(*positional(a, [a[f] for f in fields])), base)
    a = _one_step_args()
    with pytest.raises(TypeError, match="given twice"):
        P.paged_dash_attention(**a, batch=P.DashBatch(*(a[f] for f in fields)))
    a = _one_step_args()
    a["block_table"] = a.pop("block_tables")
    with pytest.raises(TypeError, match="no argument 'block_table'"):
        P.paged_dash_attention(**a)


def test_attend_routing_replaces_the_routed_blocks_and_biases():
    """``attend_routing``: the operator's own routing given back gives the same output; a
    changed bias or a dropped block changes exactly the tokens it touches."""
    out, routing = P.paged_dash_attention(**_one_step_args(), return_routing=True)
    sel, bias = routing.selected, routing.bias
    same = P.paged_dash_attention(**_one_step_args(), attend_routing=P.Routing(sel, bias))
    assert torch.equal(same, out)
    rows = (sel[:, 0] >= 0).nonzero().flatten()
    assert len(rows) > 2
    t = int(rows[len(rows) // 2])
    bias2 = bias.clone()
    bias2[t, 0] += 3.0
    sel2 = sel.clone()
    sel2[int(rows[-1]), 0] = -1
    changed = P.paged_dash_attention(**_one_step_args(), attend_routing=P.Routing(sel2, bias2))
    differs = (changed != out).flatten(1).any(1).nonzero().flatten().tolist()
    assert differs == sorted({t, int(rows[-1])})


@pytest.mark.parametrize(
    "change, match",
    [
        ({"block_tables": lambda a: a["block_tables"] + 1}, "outside the cache"),
        ({"block_tables": lambda a: a["block_tables"] - 1}, "outside the cache"),
        ({"block_tables": lambda a: a["block_tables"][:, :-1]}, "longer than its block table holds"),
        ({"seq_lens": lambda a: a["seq_lens"] - 1}, "new tokens but seq_lens"),
        ({"query_start_loc": lambda a: a["query_start_loc"] - 1}, "query_start_loc must rise"),
        ({"k": lambda a: a["k"][:, :1]}, "v must have shape"),
        ({"coords": lambda a: a["coords"][:, :3]}, "coords must have shape"),
        ({"coords": lambda a: a["coords"].float()}, "coords must have dtype"),
        ({"iq": lambda a: a["iq"].half()}, "iq must have dtype"),
        ({"head_cls": lambda a: a["head_cls"][:3]}, "head_cls must have shape"),
        ({"prompt_lens": lambda a: a["prompt_lens"] - 5}, "prompt_lens\\[0\\] must be -1"),
        (
            {
                "cache": lambda a: P.DashKVCache.allocate(
                    a["cache"].num_blocks, 8, KV_HEADS, D, DI, 4, dtype=torch.float16
                )
            },
            "cache dtype",
        ),
        ({"cache": lambda a: P.DashKVCache.allocate(a["cache"].num_blocks, 8, 1, D, DI, 4)}, "heads/dim"),
        (
            {"cache": lambda a: P.DashKVCache.allocate(a["cache"].num_blocks, 8, KV_HEADS, D, DI, 2)},
            "sparse blocks of 2",
        ),
        ({"block_tables": lambda a: torch.zeros_like(a["block_tables"])}, "same cache slot"),
    ],
)
def test_paged_bad_input(change, match):
    with pytest.raises(ValueError, match=match):
        _one_step(**change)


def test_paged_head_dim_and_config_checks():
    with pytest.raises(ValueError, match="multiple of KV heads"):
        _one_step(q=lambda a: a["q"][:, :3].contiguous())
    with pytest.raises(ValueError, match="too small"):
        _one_step(sp=lambda a: DashConfig.from_dict({**a["sp"].to_dict(), "sparse_rope_page_pairs": 8}))


def page_gap_case():
    """Pages 0, 1 (no image) and 2 packed in the first sparse block of 8, then filler pages; the
    response's markers walk the query page through 0, 1, 2, ... Prompt in one chunk, then
    decode. Returns (generator, config, Seq, prompt length)."""
    prompt = [2, 1, 1, 2, 0, 2, 1, 1] + [2] + [1] * 7 + [2] + [1] * 7 + [0] * 4
    response = [0, 2, 0, 0, 2, 0, 0, 2, 0, 0, 2, 0, 0]
    roles = torch.tensor(prompt + response)
    gen = torch.Generator().manual_seed(1)
    cfg = DashConfig.from_dict(
        {"sparse_block_size": 8, "sparse_local_block": 1, "sparse_index_dim": DI, "dash_topk_blocks": 1}
    )
    x = random_inputs(gen, roles, heads=HEADS, kv_heads=KV_HEADS, head_dim=D, index_dim=DI, head_cls=SHARED_HEAD_CLS)
    return gen, cfg, Seq(x, P.sequence_coords(roles), None, [len(prompt)] + [1] * len(response)), len(prompt)


@pytest.mark.parametrize("block_size", [8, 16])
def test_page_without_images_inside_a_block_is_not_a_candidate(block_size):
    """A block holding images of pages 0 and 2 is no candidate for page 1 (which has
    no image): the block's page range alone would say it is."""
    gen, cfg, seq, prompt_len = page_gap_case()
    x = seq.x
    qp = seq.coords[:, P.COORD_QUERY_PAGE]
    assert 1 in qp[prompt_len:].tolist()
    outs, routes, cache, tables = run_paged([seq], cfg, 0, block_size, gen)
    _, pages = P._block_state(cache, tables[0].long(), 1, 1, 8)
    assert pages[0].tolist() == [0, 2, 0]  # range 0..2, page 1 missing
    check_against_reference([seq], outs, routes, cfg, 0)
    # and the rule matters here: page-1 queries with blocks 0 and 1 remote fall back to every
    # remote block; were block 0 page 1's candidate, it would be the only one they could select
    _, want_r = R.dash_attention(x.q, x.k, x.v, x.iq, x.ik, x.roles, x.head_cls, cfg, 0, return_routing=True)
    page1 = (qp == 1).nonzero().flatten()
    page1 = page1[page1 >= 24]
    assert page1.numel() and bool(((want_r.values[page1, :2] > R.NOT_CANDIDATE).sum(-1) == 2).all())
