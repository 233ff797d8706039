"""DASH kernels against pinned dense SDPA peers, timed alike, on realistic and cold data.

Shapes (``--shape``, :data:`SHAPES`): ``published`` is one Unlimited-OCR-2 decoder layer as its
checkpoint configures DASH (10 heads of 128 with 10 KV heads, index dim 128, sparse blocks of 32 in
KV blocks of 64, one local block, keep 12 of the top 16 with the published routing scale and prior
floor); ``legacy`` (the default, the shape of the figures before the real routing) is H=32, Hkv=8,
D=128, Di=128, sparse blocks of 64 (= KV blocks), every one of the top 16 kept. bf16 throughout.

What is measured, and how (docs/performance.md quotes this):

- **Peers.** Dense SDPA through ``torch.nn.attention.sdpa_kernel`` with one backend at a time
  (flash, cuDNN, efficient; each that runs on the shape is timed), named with the versions of
  torch, CUDA and cuDNN. The fastest one on a case is "the dense peer" of that case.
- **Timing alike.** Both sides are CUDA graphs (DASH's call and each peer's SDPA call captured
  alike). Each round times, for both, ``--reps`` back-to-back replays (warm: what a model's
  steady state sees for the attention alone) and isolated cold calls (the L2 flushed by a write
  of twice its size before each, outside the timed region). Rounds alternate DASH and the peers,
  ``--rounds`` of them (default 7); the table gives the median over rounds with the spread
  (IQR, min, max) of every time and of the ratio.
- **Decode data.** Sequences of the given context with shuffled block tables (a random
  permutation of the pool: no two neighbouring blocks of a sequence are neighbours in memory);
  pages of 16 sparse blocks, random keys, values, index keys and summaries. The query token is
  a response token with no document page ("real top-k": no forced block, all 16 selections are
  top-k over the sequence's remote blocks) unless ``forced`` gives it a page with that many
  image blocks; the sweep covers 0, 4, 8 and 16 forced blocks. The old degenerate case (16
  forced blocks, routing decided by the page alone) is the ``forced 16`` row.
  "block-completing": the new token ends a sparse block (its summary is computed in the step,
  1 step in 64); "mid-block": the other 63.
- **Prefill data.** One prompt of 64 document pages; independent random indexer queries (no two
  tokens route alike: the hardest case for sharing loads), and at 16k and 64k also
  page-correlated ones (a page's tokens share a random query plus 10% noise, as a trained
  indexer's tokens of one page would), so that neighbouring tokens select largely the same blocks.
- **Bytes and FLOPs** come from :func:`decode_traffic` and :func:`prefill_flops` (one place):
  decode reads, per sequence and KV head, K + 1 sparse blocks of K and V (K kept + the local one),
  the summaries and page ranges of every remote block (routing), and its own inputs and outputs.
  Roofline: against a measured streaming read of 4 GiB (``torch.sum``) and the H200's 4.8 TB/s
  datasheet figure; prefill TFLOP/s on DASH's FLOPs beside the dense peer's achieved rate on
  its own (causal) FLOPs.
- **Provenance:** commit and dirty flag (``DASH_COMMIT``, ``DASH_DIRTY`` where the checkout
  has no git), torch / CUDA / cuDNN / driver versions, the GPU's clocks and power limit.

Prints markdown tables; ``--json`` writes every number, ``--png`` draws the speed-ups. A
correctness check of the real-top-k decode step against the paged PyTorch operator runs first
(``--no-check`` skips it). ``--ab 'KNOBS;KNOBS'`` adds, to every prefill and mixed case, a graph
of the same call with other kernel knobs (``dash_trt.attention.dash.cuda.Tuning`` names), timed in the same
rounds as the default, and an A/B table of each variant's time over the default's; ``--only``
picks the kinds of case. Not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from dash_trt.attention.dash import cuda as dcuda  # noqa: E402,I001
from dash_trt.attention.dash import paged as P  # noqa: E402
from dash_trt.attention.dash.config import DashConfig  # noqa: E402

#: The attention shapes a run can take (``--shape``): heads, KV heads, head and index width, sparse
#: block, KV block, and the DASH keys of the configuration. ``legacy``: the shape of the figures
#: before the real routing (GQA 32/8, blocks of 64, every one of the top 16 kept, no per-layer
#: scale); ``published``: one Unlimited-OCR-2 decoder layer (10 heads of 128, MHA, blocks of 32 in
#: KV blocks of 64 as the serving runtime allocates them, keep 12 of the top 16, routing scale 32,
#: prior floor 1e-4: the published ``sparse_attention_config``).
SHAPES = {
    "legacy": dict(heads=32, kv_heads=8, head_dim=128, kv_block=64, sparse={"dash_topk_blocks": 16}),
    "published": dict(
        heads=10,
        kv_heads=10,
        head_dim=128,
        kv_block=64,
        sparse={
            "sparse_block_size": 32,
            "dash_topk_blocks": 12,
            "dash_scale_per_layer": [32.0],
            "dash_floor_per_layer": [1e-4],
        },
    ),
}
DT = torch.bfloat16
BLOCKS_PER_PAGE = 16
TOP_M = 16  #: blocks routing scores before it keeps K of them (the kernels' ROUTE_TOP_M)


def use_shape(name: str) -> None:
    """Set the module's shape (``H``, ``HKV``, ``G``, ``D``, ``DI``, ``SBS``, ``KVB``, ``KEEP``,
    ``CFG``) to one of :data:`SHAPES`; every case and peer reads these."""
    global H, HKV, G, D, DI, SBS, KVB, KEEP, CFG, SHAPE
    s = SHAPES[name]
    sparse = {"sparse_block_size": 64, "sparse_local_block": 1, "sparse_index_dim": s["head_dim"], **s["sparse"]}
    CFG = DashConfig.from_dict(sparse)
    H, HKV, D, KVB = s["heads"], s["kv_heads"], s["head_dim"], s["kv_block"]
    G, DI, SBS, KEEP = H // HKV, CFG.sparse_index_dim, CFG.sparse_block_size, CFG.dash_topk_blocks
    SHAPE = name


use_shape("legacy")


def shape_label() -> str:
    return f"{SHAPE}: H={H}, Hkv={HKV}, D={D}, keep {KEEP} of top {TOP_M} {SBS}-token blocks, KV blocks of {KVB}"


SPEC_BANDWIDTH_GBS = 4800.0  #: H200 datasheet HBM3e bandwidth
#: The kernels' tuning knobs for every DASH call (--tuning; None: the library's defaults).
TUNING = None
AB: list = []  # --ab: (knobs as given, dash_trt.attention.dash.cuda.Tuning) of each variant
AB_PREFIX = "ab:"
#: The SDPA backends timed as peers (--peers).
PEERS = ("flash", "cudnn", "efficient")


# ----------------------------------------------------------------------------- timing
def stats(values: list[float]) -> dict:
    v = sorted(values)
    q = statistics.quantiles(v, n=4, method="inclusive") if len(v) > 1 else [v[0]] * 3
    return {"median": statistics.median(v), "q1": q[0], "q3": q[2], "min": v[0], "max": v[-1], "n": len(v)}


class Captured:
    """A CUDA graph and the function it was captured from. A graph records raw device pointers
    and does not keep its inputs alive: the function (its closure holds them) lives as long as
    the graph, or the caching allocator could hand their memory back to the driver (every later
    capture empties the cache) and a replay would read unmapped memory."""

    def __init__(self, graph, fn):
        self.graph, self.fn = graph, fn

    def replay(self):
        self.graph.replay()


def graph_of(fn) -> Captured:
    """``fn`` captured as a CUDA graph (after one warm-up call on a side stream)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return Captured(g, fn)


class Flusher:
    """Evicts the L2: a write of twice its size."""

    def __init__(self):
        l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20) or (50 << 20)
        self.buf = torch.empty(2 * l2, dtype=torch.uint8, device="cuda")

    def __call__(self):
        self.buf.fill_(1)


def warm_ms(g, reps: int) -> float:
    """Per-call time of ``reps`` back-to-back replays."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    g.replay()
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / reps


def cold_ms(g, flush: Flusher, calls: int = 3) -> float:
    """Median of ``calls`` isolated replays, each after an L2 flush (outside the events)."""
    times = []
    for _ in range(calls):
        flush()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def interleaved(graphs: dict[str, object], rounds: int, reps: int, flush: Flusher) -> dict:
    """Every graph timed warm and cold in each round, in alternating order; returns per name
    ``{"warm": [...], "cold": [...]}`` (one value per round)."""
    out = {name: {"warm": [], "cold": []} for name in graphs}
    names = list(graphs)
    for r in range(rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            if os.environ.get("DASH_BENCH_DEBUG"):
                print(f"  round {r}: {name}", flush=True)
            out[name]["warm"].append(warm_ms(graphs[name], reps))
        for name in order:
            out[name]["cold"].append(cold_ms(graphs[name], flush))
    return out


# ------------------------------------------------------------------------- the peers
def sdpa_backends() -> dict[str, object]:
    from torch.nn.attention import SDPBackend

    return {
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
    }


def peer_graphs(q, k, v, causal, only=None) -> tuple[dict[str, object], dict[str, str]]:
    """One CUDA graph per SDPA backend that runs on these tensors (or lists of tensors: one call
    each, all in one graph); and why the others did not. ``causal``: False, True (square,
    ``is_causal``) or ``"lower_right"`` (a chunk's queries are the last rows of its keys: the
    mask FlashAttention and vLLM use for chunked prefill), one value or one per call; ``only``:
    ``(backends, why the others are left out)``."""
    from torch.nn.attention import sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    graphs, skipped = {}, {}
    many = isinstance(q, list)
    qs, ks, vs = (q, k, v) if many else ([q], [k], [v])
    masks = causal if isinstance(causal, list) else [causal] * len(qs)
    kwargs = [
        dict(attn_mask=causal_lower_right(a.shape[-2], b.shape[-2])) if m == "lower_right" else dict(is_causal=bool(m))
        for a, b, m in zip(qs, ks, masks)
    ]
    for name, backend in sdpa_backends().items():
        if name not in PEERS:
            skipped[name] = "left out (--peers)"
            continue
        if only is not None and name not in only[0]:
            skipped[name] = only[1]
            continue

        def call(backend=backend):
            with sdpa_kernel([backend]):
                return [F.scaled_dot_product_attention(a, b, c, **kw) for a, b, c, kw in zip(qs, ks, vs, kwargs)]

        try:
            call()
            torch.cuda.synchronize()
            graphs[name] = graph_of(call)
        except Exception as exc:  # noqa: BLE001 - a backend that does not take this shape
            skipped[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            torch.cuda.synchronize()
    return graphs, skipped


# ------------------------------------------------------------------- bytes and FLOPs
def decode_traffic(lengths: list[int]) -> dict:
    """Fewest bytes one decode step over sequences of these lengths must move (each read once):
    K and V of the blocks each (sequence, KV head) attends (K selected + the local one), the
    routing's summaries and page ranges of every remote block, and the step's own inputs and
    outputs."""
    kv = route = io = 0
    for length in lengths:
        n_remote = max(length // SBS - 1, 0)
        kv += HKV * (min(KEEP, n_remote) + 1) * SBS * D * 2 * 2
        route += n_remote * (DI * 4 + 12)
        io += (H * D * 2) * 2 + HKV * D * 2 * 2 * 2 + DI * 2 * 2 * 2
    return {"kv_bytes": kv, "route_bytes": route, "io_bytes": io, "bytes": kv + route + io}


def dense_decode_bytes(lengths: list[int]) -> int:
    return sum(HKV * length * D * 2 * 2 + H * D * 2 * 2 for length in lengths)


def prefill_flops(seq: int) -> tuple[float, float]:
    """(DASH's FLOPs, dense causal attention's FLOPs) of one ``seq``-token prompt: QK and PV over
    each token's keys (DASH: its K kept remote blocks and its local window), plus block scoring."""
    pos = torch.arange(seq, dtype=torch.float64)
    n_remote = (pos // SBS).clamp(min=0)
    keys = n_remote.clamp(max=KEEP) * SBS + (pos % SBS + 1)
    dash = float((4 * H * D * keys).sum() + (2 * DI * n_remote).sum())
    dense = float((4 * H * D * (pos + 1)).sum())
    return dash, dense


# ----------------------------------------------------------------------------- cases
def rnd(gen, *shape):
    return torch.randn(*shape, device="cuda", generator=gen).to(DT)


def decode_inputs(nseq: int, ctx: int, gen, *, forced: int, mid_block: bool, lengths: list[int] | None = None):
    """A decode step's inputs over a shuffled pool: ``(args, cache, batch, lengths)``. ``lengths``:
    each sequence's context (default: all ``ctx``, or ``ctx - 32`` with ``mid_block``);
    ``forced``: image blocks of the query token's own page (0: a response token, no page)."""
    if lengths is None:
        lengths = [ctx - 32 if mid_block else ctx] * nseq
    blocks = [-(-n // KVB) for n in lengths]
    width = max(blocks)
    nb = sum(blocks)
    per = KVB // SBS  # sparse blocks per KV block
    cache = P.DashKVCache.allocate(nb, KVB, HKV, D, DI, SBS, DT, "cuda")
    for t in (cache.key, cache.value, cache.index_key, cache.summary):
        t.normal_(generator=gen)
    perm = torch.randperm(nb, device="cuda", generator=gen).to(torch.int32)
    tables = torch.full((nseq, width), -1, dtype=torch.int32, device="cuda")
    # page of each logical sparse block: the first `forced` blocks are page 0 (the query's page
    # when forced > 0), then pages of 16 blocks
    logical = torch.arange(width * per, device="cuda")
    page_of = torch.where(logical < forced, 0, 1 + (logical - forced) // BLOCKS_PER_PAGE).int().view(width, per)
    phys_page = torch.empty(nb, per, dtype=torch.int32, device="cuda")
    start = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = perm[start : start + n]
        phys_page[perm[start : start + n].long()] = page_of[:n]
        start += n
    cache.summary_pages[:, :, 0] = phys_page
    cache.summary_pages[:, :, 1] = phys_page
    cache.summary_pages[:, :, 2] = 1
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    batch = dict(
        block_tables=tables,
        seq_lens=seq_lens,
        query_start_loc=torch.arange(nseq + 1, dtype=torch.int32, device="cuda"),
        prompt_lens=torch.full((nseq,), -1, dtype=torch.int32, device="cuda"),
    )
    q, k, v, iq, ik, head_cls = (
        rnd(gen, nseq, H, D),
        rnd(gen, nseq, HKV, D),
        rnd(gen, nseq, HKV, D),
        rnd(gen, nseq, DI),
        rnd(gen, nseq, DI),
        rnd(gen, DI),
    )
    # (token, page, image page, query page): a response token (no page of its own) or, with
    # forced blocks, a token of page 0, whose image blocks routing must take first
    query_page = 0 if forced > 0 else -1
    coords = torch.stack(
        [
            seq_lens - 1,
            torch.zeros_like(seq_lens),
            torch.full_like(seq_lens, -1),
            torch.full_like(seq_lens, query_page),
        ],
        -1,
    ).int()
    return (q, k, v, iq, ik, coords, head_cls), cache, batch, lengths


def dash_call(args, cache, batch, max_query_len=1, tuning=None):
    knobs = TUNING if tuning is None else tuning

    def call():
        return dcuda.paged_dash_attention_cuda(
            *args, cache, **batch, sp=CFG, layer_idx=0, validate=False, max_query_len=max_query_len, tuning=knobs
        )

    return call


def ab_graphs(make) -> dict:
    """``--ab``: a graph of ``make(tuning)`` for each variant, named ``ab:<knobs>``, timed in the same
    rounds as DASH's default (a variant's ratio is then its time over the default's)."""
    return {AB_PREFIX + spec: graph_of(make(tuning)) for spec, tuning in AB}


def decode_step(nseq: int, ctx: int, gen, mid_block: bool = False, forced: int = 0, lengths=None):
    """The DASH call of one decode step and what it holds: ``(fn, (args, cache, batch, lengths))``
    (bench/breakdown.py, trace_step.py and profile_step.py profile ``fn``)."""
    args, cache, batch, lengths = decode_inputs(nseq, ctx, gen, forced=forced, mid_block=mid_block, lengths=lengths)
    return dash_call(args, cache, batch), (args, cache, batch, lengths)


def dense_decode_peers(args, cache, batch, lengths):
    """Dense SDPA over the same sequences, K and V contiguous ([nseq, Hkv, length, D], SDPA's
    layout; a KV head's G query heads as G query rows, as GQA decode kernels do): one batched
    call for equal lengths, one call per sequence (in one graph) for mixed ones."""
    nseq = len(lengths)
    tables = batch["block_tables"].long()
    q = args[0].view(nseq, HKV, G, D)
    if len(set(lengths)) == 1:
        length = lengths[0]
        k = cache.key[tables].reshape(nseq, -1, HKV, D)[:, :length].transpose(1, 2).contiguous()
        v = cache.value[tables].reshape(nseq, -1, HKV, D)[:, :length].transpose(1, 2).contiguous()
        return peer_graphs(q, k, v, causal=False)
    ks, vs = [], []
    for i, length in enumerate(lengths):
        rows = tables[i, : -(-length // KVB)]
        ks.append(cache.key[rows].reshape(-1, HKV, D)[:length].transpose(0, 1)[None].contiguous())
        vs.append(cache.value[rows].reshape(-1, HKV, D)[:length].transpose(0, 1)[None].contiguous())
    return peer_graphs([q[i : i + 1] for i in range(nseq)], ks, vs, causal=False)


def same_sparsity_peers(args, cache, batch, lengths):
    """The same-sparsity peer: dense SDPA over just the sparse blocks DASH attends (its K selected
    and the local one, gathered once, outside the timing): what a dense kernel takes for the same
    keys, without routing. Peers are named ``same-<backend>``. Every sequence here has at least K
    remote blocks and the kernels keep exactly K (checked: a padded selection would make the
    peer read blocks DASH does not)."""
    nseq = len(lengths)
    _, sel = dcuda.paged_dash_attention_cuda(
        *args, cache, **batch, sp=CFG, layer_idx=0, max_query_len=1, tuning=TUNING, return_selected=True
    )
    sel = sel.sort(1, descending=True).values[:, :KEEP]
    if bool((sel < 0).any()):
        raise SystemExit(f"bench_dash: a decode token kept fewer than {KEEP} blocks; the same-sparsity peer needs K")
    local = torch.tensor([(n - 1) // SBS for n in lengths], device="cuda")[:, None]
    blocks = torch.cat([sel, local], 1)  # logical sparse blocks [nseq, K + 1]
    phys = batch["block_tables"].long().gather(1, blocks // (KVB // SBS))
    rows = (blocks % (KVB // SBS))[..., None] * SBS + torch.arange(SBS, device="cuda")  # [nseq, K + 1, SBS]
    gathered = (t[phys[..., None], rows] for t in (cache.key, cache.value))  # [nseq, K + 1, SBS, HKV, D]
    k, v = (t.reshape(nseq, -1, HKV, D).transpose(1, 2).contiguous() for t in gathered)
    graphs, skipped = peer_graphs(args[0].view(nseq, HKV, G, D), k, v, causal=False)
    return {f"same-{n}": g for n, g in graphs.items()}, {f"same-{n}": w for n, w in skipped.items()}


def against_reference(args, cache, batch, max_query_len: int):
    """One call on the kernels and on the paged PyTorch operator (each on its own copy of the
    cache), compared by ``compare_outputs``: ``(report, the reference's routing)``."""
    from dash_trt.testing import compare_outputs

    ref_cache = cache.clone()
    out, sel = dcuda.paged_dash_attention_cuda(
        *args, cache, **batch, sp=CFG, layer_idx=0, max_query_len=max_query_len, tuning=TUNING, return_selected=True
    )
    ref, ref_r = P.paged_dash_attention(*args, ref_cache, **batch, sp=CFG, layer_idx=0, return_routing=True)
    report = compare_outputs(
        out,
        ref,
        P.Routing(sel.cpu()),
        P.Routing(ref_r.selected.cpu(), ref_r.bias.cpu(), ref_r.values.cpu(), ref_r.scores.cpu()),
        dtype=DT,
    )
    return report, ref_r


def check_decode(gen) -> str:
    """The real-top-k decode step on the kernels against the paged PyTorch operator."""
    args, cache, batch, _ = decode_inputs(4, 8192, gen, forced=0, mid_block=False)
    report, ref_r = against_reference(args, cache, batch, 1)
    chosen = (ref_r.selected >= 0).sum(1).tolist()
    if not report.ok or chosen != [KEEP] * len(chosen):
        raise SystemExit(
            f"bench_dash: the real-top-k decode step is wrong or not real top-k ({report}; selected per token {chosen})"
        )
    return str(report)


def summarize(times: dict, dash: str = "dash") -> dict:
    """Medians and spreads of each timing and of each peer's time over DASH's, per round."""
    out = {}
    for name, t in times.items():
        out[name] = {kind: stats(vals) for kind, vals in t.items()}
        if name != dash:
            out[name]["ratio"] = {
                kind: stats([p / d for p, d in zip(vals, times[dash][kind])]) for kind, vals in t.items()
            }
    peers = [n for n in times if n != dash and not n.startswith(("same-", AB_PREFIX))]
    if peers:
        out["peer"] = min(peers, key=lambda n: out[n]["warm"]["median"])
    same = [n for n in times if n.startswith("same-")]
    if same:
        out["same"] = min(same, key=lambda n: out[n]["warm"]["median"])
    return out


def decode_case(nseq, ctx, gen, flush, a, *, forced=0, mid_block=False, lengths=None, label="") -> dict:
    fn, (args, cache, batch, lengths) = decode_step(nseq, ctx, gen, mid_block, forced, lengths)
    graphs = {"dash": graph_of(fn)}
    peers, skipped = dense_decode_peers(args, cache, batch, lengths)
    graphs.update(peers)
    if not a.no_same:
        same, same_skipped = same_sparsity_peers(args, cache, batch, lengths)
        graphs.update(same)
        skipped.update(same_skipped)
    times = interleaved(graphs, a.rounds, a.reps, flush)
    row = dict(
        kind="decode",
        nseq=nseq,
        ctx=ctx,
        lengths=lengths,
        forced=forced,
        mid_block=mid_block,
        label=label,
        times=times,
        summary=summarize(times),
        skipped=skipped,
        **decode_traffic(lengths),
        dense_bytes=dense_decode_bytes(lengths),
    )
    del graphs
    torch.cuda.empty_cache()
    return row


def mixed_inputs(ndec: int, ctx: int, chunk: int, gen):
    """A mixed step on the non-fused path: ``ndec`` sequences decoding one token at ``ctx`` and one
    more sequence of ``ctx`` whose last ``chunk`` tokens are prefilled in the same call (a text
    chunk after a document: real top-k for every token, as vLLM's chunked prefill batches them).
    ``(args, cache, batch, lengths)``; the chunk's sequence is the last."""
    (_, _, _, _, _, _, head_cls), cache, batch, lengths = decode_inputs(ndec + 1, ctx, gen, forced=0, mid_block=False)
    t = ndec + chunk
    q, k, v, iq, ik = rnd(gen, t, H, D), rnd(gen, t, HKV, D), rnd(gen, t, HKV, D), rnd(gen, t, DI), rnd(gen, t, DI)
    pos = torch.cat([torch.full((ndec,), ctx - 1), torch.arange(ctx - chunk, ctx)]).to("cuda")
    coords = torch.stack([pos, torch.zeros_like(pos), torch.full_like(pos, -1), torch.full_like(pos, -1)], -1).int()
    batch["query_start_loc"] = torch.tensor(list(range(ndec + 1)) + [t], dtype=torch.int32, device="cuda")
    return (q, k, v, iq, ik, coords, head_cls), cache, batch, lengths


def check_mixed(gen) -> str:
    """A small mixed step (3 decode tokens and a 192-token chunk) on the kernels against the
    paged PyTorch operator."""
    args, cache, batch, _ = mixed_inputs(3, 4096, 192, gen)
    report, _ = against_reference(args, cache, batch, 192)
    if not report.ok:
        raise SystemExit(f"bench_dash: the mixed prefill + decode step is wrong ({report})")
    return str(report)


def mixed_case(ndec, ctx, chunk, gen, flush, a) -> dict:
    """DASH's mixed step against one graph of two dense calls: the decode tokens batched, the
    chunk with the lower-right causal mask over its whole sequence (GQA heads repeated, as the
    prefill peer)."""
    args, cache, batch, lengths = mixed_inputs(ndec, ctx, chunk, gen)
    graphs = {"dash": graph_of(dash_call(args, cache, batch, max_query_len=chunk))}
    graphs.update(ab_graphs(lambda t: dash_call(args, cache, batch, max_query_len=chunk, tuning=t)))
    tables = batch["block_tables"].long()
    kv = [
        t[tables].reshape(ndec + 1, -1, HKV, D)[:, :ctx].transpose(1, 2).contiguous() for t in (cache.key, cache.value)
    ]
    qd = args[0][:ndec].view(ndec, HKV, G, D)
    qc = args[0][ndec:].transpose(0, 1)[None]
    kc, vc = (t[ndec:].repeat_interleave(G, 1) for t in kv)
    peers, skipped = peer_graphs(
        [qd, qc],
        [kv[0][:ndec], kc],
        [kv[1][:ndec], vc],
        causal=[False, "lower_right"],
        only=(
            ("flash", "efficient"),
            "torch dispatches a lower-right causal mask to flash or efficient attention only",
        ),
    )
    graphs.update(peers)
    times = interleaved(graphs, a.rounds, a.reps, flush)
    row = dict(
        kind="mixed",
        ndec=ndec,
        ctx=ctx,
        chunk=chunk,
        label=f"{ndec} decode + {chunk}-token chunk at {ctx // 1024}k",
        times=times,
        summary=summarize(times),
        skipped=skipped,
    )
    del graphs
    torch.cuda.empty_cache()
    return row


def prefill_step(seq: int, gen, tuning=None, correlated: bool = False):
    """The DASH call of one ``seq``-token prompt of 64 document pages and its inputs:
    ``(fn, (q, k, v), with_knobs)``, ``with_knobs(tuning)`` the same call with other knobs (the
    same inputs and cache). ``correlated``: the indexer queries of a page's tokens are one random
    vector of the page plus a tenth of its size in per-token noise (what a trained indexer does
    for tokens that read alike), instead of independent for every token."""
    nb = seq // KVB + 1
    cache = P.DashKVCache.allocate(nb, KVB, HKV, D, DI, SBS, DT, "cuda")
    pages = 64
    per = seq // pages
    roles = torch.zeros(seq, dtype=torch.long)
    for p_ in range(pages):
        roles[p_ * per] = 2
        roles[p_ * per + 1 : (p_ + 1) * per - 4] = 1
    coords = P.sequence_coords(roles).cuda()
    batch = dict(
        block_tables=torch.arange(nb, dtype=torch.int32, device="cuda")[None],
        seq_lens=torch.tensor([seq], dtype=torch.int32, device="cuda"),
        query_start_loc=torch.tensor([0, seq], dtype=torch.int32, device="cuda"),
        prompt_lens=torch.tensor([-1], dtype=torch.int32, device="cuda"),
    )
    q, k, v, iq, ik, head_cls = (
        rnd(gen, seq, H, D),
        rnd(gen, seq, HKV, D),
        rnd(gen, seq, HKV, D),
        rnd(gen, seq, DI),
        rnd(gen, seq, DI),
        rnd(gen, DI),
    )
    if correlated:
        page_of = (torch.arange(seq, device="cuda") // per).clamp(max=pages - 1)
        iq = (rnd(gen, pages, DI).float()[page_of] + 0.1 * iq.float()).to(DT)

    def with_knobs(knobs):
        def dash():
            return dcuda.paged_dash_attention_cuda(
                q, k, v, iq, ik, coords, head_cls, cache, **batch, sp=CFG, layer_idx=0, validate=False, tuning=knobs
            )

        return dash

    return with_knobs(TUNING if tuning is None else tuning), (q, k, v), with_knobs


def prefill_case(seq, gen, flush, a, tuning=None, label="", correlated=False) -> dict:
    dash, (q, k, v), with_knobs = prefill_step(seq, gen, tuning, correlated)
    graphs = {"dash": graph_of(dash)}
    if tuning is None:
        graphs.update(ab_graphs(with_knobs))
    qd = q.transpose(0, 1)[None]
    kd = k.transpose(0, 1)[None].repeat_interleave(G, 1)
    vd = v.transpose(0, 1)[None].repeat_interleave(G, 1)
    peers, skipped = peer_graphs(qd, kd, vd, causal=True)
    graphs.update(peers)
    reps = max(2, a.reps // 4)
    times = interleaved(graphs, a.rounds, reps, flush)
    dash_flops, dense_flops = prefill_flops(seq)
    row = dict(
        kind="prefill",
        seq=seq,
        label=label,
        times=times,
        summary=summarize(times),
        skipped=skipped,
        flops=dash_flops,
        dense_flops=dense_flops,
    )
    del graphs
    torch.cuda.empty_cache()
    return row


# ------------------------------------------------------------------------ provenance
def streaming_read_gbs() -> float:
    x = torch.ones(2 << 30, dtype=DT, device="cuda")  # 4 GiB
    g = graph_of(lambda: x.sum(dtype=torch.float32))
    ms = statistics.median(warm_ms(g, 10) for _ in range(5))
    return x.numel() * 2 / ms / 1e6


def copy_gbs() -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    g = graph_of(lambda: y.copy_(x))
    ms = statistics.median(warm_ms(g, 10) for _ in range(5))
    return 2 * x.numel() / ms / 1e6


def provenance() -> dict:
    props = torch.cuda.get_device_properties(0)
    info = {
        "device": props.name,
        "sms": props.multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "commit": os.environ.get("DASH_COMMIT") or _git("rev-parse", "--short", "HEAD") or "unknown",
        "dirty": os.environ.get("DASH_DIRTY") or ("yes" if _git("status", "--porcelain") else "no"),
        "l2_bytes": getattr(props, "L2_cache_size", None),
    }
    try:
        q = "driver_version,clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem,power.limit,power.draw,temperature.gpu"
        line = (
            subprocess.run(
                ["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
            )
            .stdout.strip()
            .splitlines()[0]
        )
        info.update(dict(zip(q.split(","), [s.strip() for s in line.split(",")])))
    except (OSError, IndexError, subprocess.SubprocessError):
        info["nvidia_smi"] = "not available"
    return info


def _git(*args) -> str:
    try:
        return subprocess.run(
            ["git", *args], capture_output=True, text=True, timeout=10, cwd=os.path.dirname(os.path.abspath(__file__))
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


# ---------------------------------------------------------------------------- output
def fmt(s: dict, unit: str = "") -> str:
    return f"{s['median']:.3f}{unit} [{s['q1']:.3f}-{s['q3']:.3f}]"


def ratio_fmt(s: dict) -> str:
    return f"{s['median']:.2f}x ({s['min']:.2f}-{s['max']:.2f})"


def print_tables(rows, env, out=sys.stdout) -> None:
    print(
        f"\ndevice {env['device']}; torch {env['torch']}, CUDA {env['cuda']}, cuDNN {env['cudnn']}, driver "
        f"{env.get('driver_version', '?')}; SM clock {env.get('clocks.sm', '?')} "
        f"(max {env.get('clocks.max.sm', '?')}), "
        f"power limit {env.get('power.limit', '?')}; commit {env['commit']} (dirty: {env['dirty']})",
        file=out,
    )
    print(
        f"streaming read {env['read_gbs']:.0f} GB/s, copy (read+write) {env['copy_gbs']:.0f} GB/s, datasheet "
        f"{SPEC_BANDWIDTH_GBS:.0f} GB/s",
        file=out,
    )
    print(f"shape {env.get('shape', '?')}", file=out)
    print("\nDecode (ms per step; median over rounds [IQR]; speed-up = dense peer / DASH, median (min-max)):", file=out)
    print(
        "| case | forced | DASH warm | DASH cold | dense peer | peer warm | peer cold | speed-up warm | "
        "speed-up cold | same-sparsity SDPA cold | its time / DASH's (cold) | DASH MB | % of read BW (cold) | "
        "% of datasheet (cold) |",
        file=out,
    )
    print("| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |", file=out)
    for r in rows:
        if r["kind"] != "decode":
            continue
        s, peer = r["summary"], r["summary"].get("peer")
        name = (
            (f"{r['nseq']} x {r['ctx'] // 1024}k" + (" mid-block" if r["mid_block"] else ""))
            if not r["label"]
            else f"{r['nseq']} x {r['label']}"
        )
        cold_gbs = r["bytes"] / s["dash"]["cold"]["median"] / 1e6
        cells = [name, str(r["forced"]), fmt(s["dash"]["warm"]), fmt(s["dash"]["cold"])]
        if peer:
            cells += [
                peer,
                fmt(s[peer]["warm"]),
                fmt(s[peer]["cold"]),
                ratio_fmt(s[peer]["ratio"]["warm"]),
                ratio_fmt(s[peer]["ratio"]["cold"]),
            ]
        else:
            cells += ["-"] * 5
        same = s.get("same")
        cells += [f"{same[5:]} {fmt(s[same]['cold'])}", ratio_fmt(s[same]["ratio"]["cold"])] if same else ["-", "-"]
        cells += [
            f"{r['bytes'] / 1e6:.1f}",
            f"{100 * cold_gbs / env['read_gbs']:.0f}%",
            f"{100 * cold_gbs / SPEC_BANDWIDTH_GBS:.0f}%",
        ]
        print("| " + " | ".join(cells) + " |", file=out)
    mixed = [r for r in rows if r["kind"] == "mixed"]
    if mixed:
        print("\nMixed prefill + decode in one call (the non-fused path; ms per call):", file=out)
        print(
            "| case | DASH warm | DASH cold | dense peer | peer warm | peer cold | speed-up warm | speed-up cold |",
            file=out,
        )
        print("| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |", file=out)
        for r in mixed:
            s, peer = r["summary"], r["summary"].get("peer")
            cells = [r["label"], fmt(s["dash"]["warm"]), fmt(s["dash"]["cold"])]
            cells += (
                [
                    peer,
                    fmt(s[peer]["warm"]),
                    fmt(s[peer]["cold"]),
                    ratio_fmt(s[peer]["ratio"]["warm"]),
                    ratio_fmt(s[peer]["ratio"]["cold"]),
                ]
                if peer
                else ["-"] * 5
            )
            print("| " + " | ".join(cells) + " |", file=out)
    print("\nPrefill (ms per call; TFLOP/s on DASH's FLOPs, and the peer's on dense causal FLOPs):", file=out)
    print(
        "| case | DASH warm | DASH cold | dense peer | peer warm | speed-up warm | speed-up cold | DASH TFLOP/s | "
        "peer TFLOP/s |",
        file=out,
    )
    print("| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |", file=out)
    for r in rows:
        if r["kind"] != "prefill":
            continue
        s, peer = r["summary"], r["summary"]["peer"]
        d = s["dash"]["warm"]["median"]
        p = s[peer]["warm"]["median"]
        print(
            f"| 1 x {r['seq'] // 1024}k{r['label']} | {fmt(s['dash']['warm'])} | {fmt(s['dash']['cold'])} | {peer} | "
            f"{fmt(s[peer]['warm'])} | {ratio_fmt(s[peer]['ratio']['warm'])} | {ratio_fmt(s[peer]['ratio']['cold'])} | "
            f"{r['flops'] / d / 1e9:.0f} | {r['dense_flops'] / p / 1e9:.0f} |",
            file=out,
        )
    ab = [(r, n) for r in rows for n in r["summary"] if n.startswith(AB_PREFIX)]
    if ab:
        print(
            "\nA/B (--ab): each variant in the same rounds as the default knobs; ratio = variant / default, "
            "median (min-max) over rounds:",
            file=out,
        )
        print("| case | variant | default cold | variant cold | ratio cold | ratio warm |", file=out)
        print("| --- | --- | ---: | ---: | ---: | ---: |", file=out)
        for r, n in ab:
            s = r["summary"]
            case = r["label"] if r["kind"] == "mixed" else f"1 x {r['seq'] // 1024}k{r['label']}"
            print(
                f"| {case} | {n[len(AB_PREFIX) :]} | {fmt(s['dash']['cold'])} | {fmt(s[n]['cold'])} | "
                f"{ratio_fmt(s[n]['ratio']['cold'])} | {ratio_fmt(s[n]['ratio']['warm'])} |",
                file=out,
            )
    skipped = {(r["kind"], n): why for r in rows for n, why in r["skipped"].items()}
    for (kind, name), why in sorted(skipped.items()):
        print(f"not run: SDPA {name} on {kind}: {why}", file=out)


def draw(rows, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    by_batch: dict[int, list] = {}
    for r in rows:
        if (
            r["kind"] == "decode"
            and r["forced"] == 0
            and not r["mid_block"]
            and not r["label"]
            and r["summary"].get("peer")
        ):
            by_batch.setdefault(r["nseq"], []).append(r)
    for nseq, rs in sorted(by_batch.items()):
        rs.sort(key=lambda r: r["ctx"])
        x = [r["ctx"] // 1024 for r in rs]
        med = [r["summary"][r["summary"]["peer"]]["ratio"]["cold"]["median"] for r in rs]
        lo = [m - r["summary"][r["summary"]["peer"]]["ratio"]["cold"]["min"] for m, r in zip(med, rs)]
        hi = [r["summary"][r["summary"]["peer"]]["ratio"]["cold"]["max"] - m for m, r in zip(med, rs)]
        ax1.errorbar(x, med, yerr=[lo, hi], marker="o", capsize=3, label=f"batch {nseq}")
    ax1.axhline(1.0, color="gray", lw=0.8, ls="--", label="dense peer")
    ax1.set(
        xscale="log",
        yscale="log",
        xlabel="context (k tokens)",
        ylabel="dense peer time / DASH time",
        title="Decode, real top-k, cold L2",
    )
    ax1.legend(fontsize=8)
    pre = sorted((r for r in rows if r["kind"] == "prefill" and not r["label"]), key=lambda r: r["seq"])
    if pre:
        x = [r["seq"] // 1024 for r in pre]
        med = [r["summary"][r["summary"]["peer"]]["ratio"]["warm"]["median"] for r in pre]
        ax2.plot(x, med, marker="o", label="DASH prefill (independent indexer queries)")
        cor = sorted((r for r in rows if r["kind"] == "prefill" and "correlated" in r["label"]), key=lambda r: r["seq"])
        if cor:
            ax2.plot(
                [r["seq"] // 1024 for r in cor],
                [r["summary"][r["summary"]["peer"]]["ratio"]["warm"]["median"] for r in cor],
                marker="s",
                label="DASH prefill (page-correlated)",
            )
        ax2.axhline(1.0, color="gray", lw=0.8, ls="--", label="dense peer (causal SDPA)")
        ax2.set(
            xscale="log", xlabel="prompt (k tokens)", ylabel="dense peer time / DASH time", title="Prefill, one prompt"
        )
        ax2.legend(fontsize=8)
    fig.suptitle(
        f"DASH kernels vs the fastest pinned dense SDPA backend ({shape_label()}, bf16)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


class Rows(list):
    """The table's rows; ``add`` runs a case unless ``budget`` seconds have passed since the
    start, in which case it counts the case as skipped (a run that must end by a deadline keeps
    what it measured)."""

    def __init__(self, budget: float | None):
        super().__init__()
        self.start, self.budget, self.skipped = time.perf_counter(), budget, 0

    def add(self, case, *args, **kwargs) -> None:
        if self.budget is not None and time.perf_counter() - self.start > self.budget:
            self.skipped += 1
            print("(next case skipped: --time-budget spent)", flush=True)
            return
        self.append(case(*args, **kwargs))


def main() -> int:
    global TUNING, PEERS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write every number here")
    ap.add_argument("--png", help="draw the speed-ups here")
    ap.add_argument("--quick", action="store_true", help="small cases, 3 rounds (smoke test)")
    ap.add_argument(
        "--shape", choices=sorted(SHAPES), default="legacy", help="attention shape (default %(default)s; see above)"
    )
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default %(default)s)")
    ap.add_argument("--reps", type=int, default=20, help="back-to-back replays per warm timing (%(default)s)")
    ap.add_argument("--decode-only", action="store_true", help="skip the prefill cases")
    ap.add_argument("--prefill-only", action="store_true", help="skip the decode cases")
    ap.add_argument(
        "--only",
        default="",
        metavar="KIND[,KIND]",
        help="only these kinds of case: decode, mixed (prefill chunk + decode in one call), prefill",
    )
    ap.add_argument(
        "--time-budget",
        type=float,
        default=None,
        metavar="S",
        help="start no case after S seconds; the cases left are counted as skipped",
    )
    ap.add_argument("--no-sweep", action="store_true", help="only the headline decode cases (32 x 8k/32k/128k)")
    ap.add_argument("--no-same", action="store_true", help="leave out the same-sparsity peer")
    ap.add_argument("--peers", default=",".join(PEERS), help="SDPA backends to time (default %(default)s)")
    ap.add_argument("--no-check", action="store_true", help="skip the correctness check of the decode step")
    ap.add_argument(
        "--ab-tiles",
        action="store_true",
        help="each prefill case also without the query-major tiles (tile_share_min=-1)",
    )
    ap.add_argument(
        "--ab-mma",
        nargs="?",
        const="-1",
        default="",
        metavar="V[,V]",
        help="each prefill case also with warpgroup_mma=V for each V given (alone: -1, the mma.sync "
        "tiles; 1: warpgroup block-major tiles only; 2: warpgroup query-major tiles only; "
        "differs on sm_90 only)",
    )
    ap.add_argument("--tuning", default="", help="kernel knobs, e.g. attend_ctas=128 (attention.dash.cuda.Tuning)")
    ap.add_argument(
        "--ab",
        default="",
        metavar="KNOBS[;KNOBS]",
        help="each prefill and mixed case also with these knobs (over --tuning), e.g. "
        "'block_major_warpgroups=1;block_major_warpgroups=2', timed in the same rounds as the "
        "default: the A/B table gives each variant's time over the default's",
    )
    a = ap.parse_args()
    use_shape(a.shape)
    try:
        mma_ab = [int(v) for v in a.ab_mma.split(",") if v.strip()]
    except ValueError:
        ap.error(f"--ab-mma: comma-separated integers, got {a.ab_mma!r}")
    try:
        TUNING = dcuda.Tuning.parse(a.tuning) if a.tuning else None
        AB[:] = [
            (spec, dcuda.Tuning.parse(f"{a.tuning},{spec}")) for spec in (x.strip() for x in a.ab.split(";")) if spec
        ]
    except ValueError as e:
        ap.error(f"--tuning / --ab: {e}")
    kinds = {"prefill"} if a.prefill_only else {"decode", "mixed"} if a.decode_only else {"decode", "mixed", "prefill"}
    if a.only:
        kinds = {k.strip() for k in a.only.split(",") if k.strip()}
        if not kinds or kinds - {"decode", "mixed", "prefill"}:
            ap.error(f"--only: choose from decode, mixed, prefill, got {a.only!r}")
    PEERS = tuple(p.strip() for p in a.peers.split(",") if p.strip())
    if not PEERS or set(PEERS) - set(sdpa_backends()):
        ap.error(f"--peers: choose from {', '.join(sdpa_backends())}, got {a.peers!r}")
    if not torch.cuda.is_available():
        print("bench_dash: needs a CUDA GPU", file=sys.stderr)
        return 2
    if a.quick:
        a.rounds = min(a.rounds, 3)
    gen = torch.Generator(device="cuda").manual_seed(0)
    env = provenance()
    env["shape"] = shape_label()
    env["read_gbs"], env["copy_gbs"] = streaming_read_gbs(), copy_gbs()
    torch.cuda.empty_cache()
    if not a.no_check and "decode" in kinds:
        print(f"check: real-top-k decode step vs the paged operator: {check_decode(gen)}", flush=True)
    if not a.no_check and "mixed" in kinds:
        print(f"check: mixed prefill + decode step vs the paged operator: {check_mixed(gen)}", flush=True)
    flush = Flusher()
    rows = Rows(a.time_budget)
    if "decode" in kinds:
        headline = [(4, 8192)] if a.quick else [(32, 8192), (32, 32768), (32, 131072)]
        for nseq, ctx in headline:
            for mid in (False, True):
                rows.add(decode_case, nseq, ctx, gen, flush, a, mid_block=mid)
                print(f"decode {nseq} x {ctx // 1024}k{' mid' if mid else ''} done", flush=True)
            for forced in (4, 8, 16):
                rows.add(decode_case, nseq, ctx, gen, flush, a, forced=forced)
        if not a.quick:
            # mixed lengths: 32 sequences of 4k-128k (block-completing), one graph of per-sequence
            # dense calls as the peer
            mixed = sorted(
                int(x) * KVB
                for x in torch.randint(
                    4096 // KVB, 131072 // KVB + 1, (32,), generator=torch.Generator().manual_seed(1)
                )
            )
            rows.add(decode_case, 32, max(mixed), gen, flush, a, lengths=mixed, label="mixed 4k-128k")
            print("decode 32 x mixed done", flush=True)
    if "mixed" in kinds:
        for ndec, ctx, chunk in [(3, 8192, 512)] if a.quick else [(31, 32768, 2048), (31, 131072, 2048)]:
            rows.add(mixed_case, ndec, ctx, chunk, gen, flush, a)
            print(f"mixed {ndec} decode + {chunk} chunk at {ctx // 1024}k done", flush=True)
    if "decode" in kinds:
        if not a.no_sweep and not a.quick:
            for nseq in (1, 8, 32, 64, 128):
                for ctx in (4096, 8192, 32768, 131072):
                    if nseq == 32 and ctx != 4096:
                        continue  # the headline rows above
                    if nseq * ctx <= 32 * 131072:
                        rows.add(decode_case, nseq, ctx, gen, flush, a)
                        print(f"decode {nseq} x {ctx // 1024}k done", flush=True)
    if "prefill" in kinds:
        no_tiles = dataclasses.replace(TUNING or dcuda.Tuning(), tile_share_min=-1)
        mma_label = {
            -1: " (mma.sync tiles)",
            1: " (warpgroup block-major tiles only)",
            2: " (warpgroup query-major tiles only)",
        }
        for seq in [4096] if a.quick else [4096, 16384, 65536, 131072]:
            rows.add(prefill_case, seq, gen, flush, a)
            print(f"prefill {seq // 1024}k done", flush=True)
            if a.ab_tiles:
                rows.add(prefill_case, seq, gen, flush, a, tuning=no_tiles, label=" (block-major only)")
            for v in mma_ab:
                rows.add(
                    prefill_case,
                    seq,
                    gen,
                    flush,
                    a,
                    tuning=dataclasses.replace(TUNING or dcuda.Tuning(), warpgroup_mma=v),
                    label=mma_label.get(v, f" (warpgroup_mma={v})"),
                )
        for seq in [] if a.quick else [16384, 65536]:
            rows.add(prefill_case, seq, gen, flush, a, label=" page-correlated indexer", correlated=True)
            print(f"prefill {seq // 1024}k page-correlated done", flush=True)
    env["skipped_cases"] = rows.skipped
    print_tables(rows, env)
    if rows.skipped:
        print(f"\n{rows.skipped} case(s) not run: --time-budget {a.time_budget:.0f} s spent")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"env": env, "rows": list(rows)}, fh, indent=1)
    if a.png:
        draw(rows, a.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
