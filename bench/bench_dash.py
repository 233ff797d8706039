"""DASH kernels vs dense SDPA vs the PyTorch reference, on one GPU.

Shape (issue "CUDA kernels"): H=32, Hkv=8, D=128, Di=128, sparse blocks of 64, local window of
one block, top-16, bf16, KV block = sparse block = 64.

  decode : 32 sequences, one new token each, at 8k / 32k / 128k context (CUDA-graph replay;
           max_query_len=1, so the write and summary stages ride in later launches unless
           --tuning fused_front=-1)
  prefill: one sequence of 16k / 64k tokens in one call

Prints a markdown table (medians of CUDA-event timings) with bytes moved, achieved bandwidth,
its fraction of the measured device-to-device copy bandwidth, and FLOPs for prefill; writes
the same as JSON with --json. Not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from dash_trt import cuda as dcuda  # noqa: E402,I001
from dash_trt import paged as P  # noqa: E402
from dash_trt.config import DashConfig  # noqa: E402

H, HKV, D, DI, SBS, TOPK = 32, 8, 128, 128, 64, 16
DT = torch.bfloat16
CFG = DashConfig.from_dict({"sparse_block_size": SBS, "sparse_local_block": 1, "sparse_topk_blocks": TOPK,
                            "sparse_page_bias": 0.5})
#: The kernels' tuning knobs for every DASH call (--tuning; None: the library's defaults).
TUNING = None


def time_ms(fn, iters=20, warmup=3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (GB/s)."""
    n = 1 << 30
    x = torch.empty(n, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = time_ms(lambda: y.copy_(x), iters=20)
    return 2 * n / ms / 1e6


def new_tokens(t: int, gen):
    """Random q, k, v, iq, ik for ``t`` new tokens, and the layer's head_cls."""
    def rnd(*shape):
        return torch.randn(*shape, device="cuda", generator=gen).to(DT)

    return rnd(t, H, D), rnd(t, HKV, D), rnd(t, HKV, D), rnd(t, DI), rnd(t, DI), rnd(DI)


def graph_of(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def decode_step(nseq: int, ctx: int, gen, mid_block: bool = False, max_query_len: int | None = 1):
    """The inputs of one decode step of ``nseq`` sequences at ``ctx`` context and the DASH call
    over them: ``(dash, cache, batch, q, k, v, iq, ik, coords, head_cls, length)``."""
    length = ctx - 32 if mid_block else ctx
    nb_per = ctx // SBS
    nb = nseq * nb_per
    cache = P.DashKVCache.allocate(nb, SBS, HKV, D, DI, SBS, DT, "cuda")
    cache.key.normal_(generator=gen)
    cache.value.normal_(generator=gen)
    cache.index_key.normal_(generator=gen)
    cache.summary.normal_(generator=gen)
    # 16 sparse blocks per document page; image pages are block ranges.
    pages = (torch.arange(nb, device="cuda") % nb_per) // 16
    cache.summary_pages[:, 0, 0] = pages.int()
    cache.summary_pages[:, 0, 1] = pages.int()
    cache.summary_pages[:, 0, 2] = 1
    tables = torch.arange(nb, dtype=torch.int32, device="cuda").view(nseq, nb_per)
    batch = dict(block_tables=tables, seq_lens=torch.full((nseq,), length, dtype=torch.int32, device="cuda"),
                 query_start_loc=torch.arange(nseq + 1, dtype=torch.int32, device="cuda"),
                 prompt_lens=torch.full((nseq,), -1, dtype=torch.int32, device="cuda"))
    q, k, v, iq, ik, head_cls = new_tokens(nseq, gen)
    coords = torch.stack([torch.full((nseq,), length - 1), torch.full((nseq,), 3), torch.full((nseq,), -1),
                          torch.full((nseq,), 2)], -1).int().cuda()

    def dash():  # a decode step: one new token per sequence (vLLM's max_query_len == 1)
        return dcuda.paged_dash_attention_cuda(q, k, v, iq, ik, coords, head_cls, cache, **batch, sp=CFG,
                                               layer_idx=0, validate=False, max_query_len=max_query_len,
                                               tuning=TUNING)

    return dash, cache, batch, q, k, v, iq, ik, coords, head_cls, length


def decode_case(nseq: int, ctx: int, run_reference: bool, gen, mid_block: bool = False) -> dict:
    """One decode step of ``nseq`` sequences. The new token completes a sparse block (its
    summary is taken in this step: 1 step in 64) unless ``mid_block``, where it lands 32
    positions earlier, in the middle of a block (the other 63 steps)."""
    dash, cache, batch, q, k, v, iq, ik, coords, head_cls, length = decode_step(nseq, ctx, gen, mid_block)
    g = graph_of(dash)
    dash_ms = time_ms(g.replay, iters=50)
    # Dense SDPA over the same cache (the identity block table makes it one strided view). The G
    # query heads of a KV head become G query rows, as GQA decode kernels do.
    kd = cache.key.view(nseq, ctx, HKV, D).transpose(1, 2)[:, :, :length]
    vd = cache.value.view(nseq, ctx, HKV, D).transpose(1, 2)[:, :, :length]
    qd = q.view(nseq, HKV, H // HKV, D)
    sdpa_ms = time_ms(lambda: F.scaled_dot_product_attention(qd, kd, vd), iters=20)
    ref_ms = None
    if run_reference:
        t0 = time.perf_counter()
        P.paged_dash_attention(q, k, v, iq, ik, coords, head_cls, cache.clone() if ctx <= 8192 else cache, **batch,
                               sp=CFG, layer_idx=0)
        torch.cuda.synchronize()
        ref_ms = (time.perf_counter() - t0) * 1e3
    n_remote = length // SBS - 1
    kv_tokens = TOPK * SBS + SBS
    bytes_kv = nseq * HKV * kv_tokens * D * 2 * 2
    bytes_route = nseq * n_remote * (DI * 4 + 12)
    bytes_io = nseq * ((H * D * 2) * 2 + HKV * D * 2 * 2 * 2 + DI * 2 * 2 * 2)
    total = bytes_kv + bytes_route + bytes_io
    return dict(case=f"decode {nseq} x {ctx // 1024}k" + (" mid-block" if mid_block else ""), dash_ms=dash_ms, sdpa_ms=sdpa_ms, ref_ms=ref_ms,
                bytes=total, route_bytes=bytes_route)


def prefill_case(seq: int, run_reference: bool, gen, tuning=None, label: str = "") -> dict:
    """One ``seq``-token prompt of 64 document pages in one call. The indexer queries are
    independent noise, so beyond its page's forced blocks a token's selection shares little
    with its neighbours' (the hard case for the query-major tiles). ``tuning``: the kernel
    knobs for this case (default: the command line's)."""
    tuning = TUNING if tuning is None else tuning
    nb = seq // SBS + 1
    cache = P.DashKVCache.allocate(nb, SBS, HKV, D, DI, SBS, DT, "cuda")
    pages = 64
    per = seq // pages
    roles = torch.zeros(seq, dtype=torch.long)
    for p_ in range(pages):
        roles[p_ * per] = 2
        roles[p_ * per + 1:(p_ + 1) * per - 4] = 1
    coords = P.sequence_coords(roles).cuda()
    tables = torch.arange(nb, dtype=torch.int32, device="cuda")[None]
    batch = dict(block_tables=tables, seq_lens=torch.tensor([seq], dtype=torch.int32, device="cuda"),
                 query_start_loc=torch.tensor([0, seq], dtype=torch.int32, device="cuda"),
                 prompt_lens=torch.tensor([-1], dtype=torch.int32, device="cuda"))
    q, k, v, iq, ik, head_cls = new_tokens(seq, gen)

    def dash():
        return dcuda.paged_dash_attention_cuda(q, k, v, iq, ik, coords, head_cls, cache, **batch, sp=CFG,
                                               layer_idx=0, validate=False, tuning=tuning)

    dash_ms = time_ms(dash, iters=5, warmup=1)
    qd = q.transpose(0, 1)[None]
    kd = k.transpose(0, 1)[None].repeat_interleave(H // HKV, 1)
    vd = v.transpose(0, 1)[None].repeat_interleave(H // HKV, 1)
    sdpa_ms = time_ms(lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True), iters=5, warmup=1)
    ref_ms = None
    if run_reference:
        t0 = time.perf_counter()
        P.paged_dash_attention(q, k, v, iq, ik, coords, head_cls, cache.clone(), **batch, sp=CFG, layer_idx=0)
        torch.cuda.synchronize()
        ref_ms = (time.perf_counter() - t0) * 1e3
    # FLOPs DASH must do: QK and PV over each token's keys, plus block scoring.
    pos = torch.arange(seq, dtype=torch.float64)
    n_remote = (pos // SBS - 1 + 1).clamp(min=0)
    keys = n_remote.clamp(max=TOPK) * SBS + (pos + 1).clamp(max=SBS)
    flops = float((4 * H * D * keys).sum() + (2 * DI * n_remote).sum())
    # Bytes if every token read its own keys from memory once (no reuse): what a token-major
    # kernel would gather (JSON only; the block-major path reads each block once per pass).
    kv_bytes = float((keys * HKV * D * 2 * 2).sum())
    name = f"prefill 1 x {seq // 1024}k" + label
    return dict(case=name, dash_ms=dash_ms, sdpa_ms=sdpa_ms, ref_ms=ref_ms,
                flops=flops, gather_bytes=kv_bytes)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--quick", action="store_true", help="smaller cases (smoke test)")
    ap.add_argument("--no-reference", action="store_true")
    ap.add_argument("--decode-only", action="store_true", help="skip the prefill cases")
    ap.add_argument("--prefill-only", action="store_true", help="skip the decode cases")
    ap.add_argument("--ab-tiles", action="store_true",
                    help="each prefill case also without the query-major tiles (tile_share_min=-1)")
    ap.add_argument("--tuning", default="", help="kernel knobs, e.g. front_writer=1,attend_ctas=128 (dash_trt.cuda.Tuning)")
    a = ap.parse_args()
    global TUNING
    TUNING = dcuda.Tuning.parse(a.tuning) if a.tuning else None
    if not torch.cuda.is_available():
        print("bench_dash: needs a CUDA GPU", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    bw = copy_bandwidth()
    print(f"device: {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}; "
          f"copy bandwidth {bw:.0f} GB/s; commit {os.environ.get('DASH_COMMIT', 'unknown')}")
    rows = []
    decode = [] if a.prefill_only else [(32, 8192), (32, 32768), (32, 131072)] if not a.quick else [(4, 8192)]
    prefill = [] if a.decode_only else [16384, 65536] if not a.quick else [4096]
    for nseq, ctx in decode:
        rows.append(decode_case(nseq, ctx, not a.no_reference, gen))
        rows.append(decode_case(nseq, ctx, False, gen, mid_block=True))
        torch.cuda.empty_cache()
    no_tiles = dataclasses.replace(TUNING or dcuda.Tuning(), tile_share_min=-1)
    for s in prefill:
        rows.append(prefill_case(s, not a.no_reference and s <= 16384, gen))
        if a.ab_tiles:
            rows.append(prefill_case(s, False, gen, tuning=no_tiles, label=" (block-major only)"))
        torch.cuda.empty_cache()
    print()
    print("| case | DASH kernels ms | dense SDPA ms | speed-up vs SDPA | reference ms | bytes moved | "
          "GB/s | % of copy BW | TFLOP/s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        ref = f"{r['ref_ms']:.1f}" if r["ref_ms"] is not None else "not run"
        if "flops" in r:  # prefill: compute figures; its traffic is not the gather estimate
            traffic = f"- | - | - | {r['flops'] / r['dash_ms'] / 1e9:.1f}"
        else:
            gbs = r["bytes"] / r["dash_ms"] / 1e6
            traffic = f"{r['bytes'] / 1e6:.1f} MB | {gbs:.0f} | {100 * gbs / bw:.0f}% | -"
        print(f"| {r['case']} | {r['dash_ms']:.3f} | {r['sdpa_ms']:.3f} | {r['sdpa_ms'] / r['dash_ms']:.1f}x | "
              f"{ref} | {traffic} |")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"device": props.name, "copy_gbs": bw, "rows": rows,
                       "commit": os.environ.get("DASH_COMMIT")}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
