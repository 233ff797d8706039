"""Per-kernel GPU time of one DASH call, from torch.profiler (CUPTI): where the time goes.

  python3 bench/breakdown.py [decode|prefill]... [--ctx 131072] [--seq 65536]

decode: one step of 32 sequences at --ctx context (the benchmark's decode case, real top-k unless --forced, eagerly);
prefill: one --seq-token prompt (--correlated: the benchmark's page-correlated indexer queries,
whose tokens of a page select largely the same blocks). Prints each kernel's total time and share, and for decode the
routing stages' share (summaries, scoring, top-k), which the performance issue bounds at 15%.
Not a test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import bench_dash as B  # noqa: E402

ROUTING = ("summar", "route", "score", "select", "topk")


def profile(fn) -> list[tuple[str, float]]:
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = collections.defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            name = ev.name.replace("(anonymous namespace)::", "").replace("void ", "").replace("dash::", "")
            name = name.split("<")[0].split("(")[0]
            totals[name[:60]] += ev.device_time_total / 1e3 if hasattr(ev, "device_time_total") else ev.cuda_time / 1e3
    return sorted(totals.items(), key=lambda kv: -kv[1])


def report(title: str, rows: list[tuple[str, float]]) -> None:
    total = sum(ms for _, ms in rows)
    print(f"\n## {title}: {total:.3f} ms of kernels\n")
    print("| kernel | ms | share |")
    print("| --- | ---: | ---: |")
    for name, ms in rows:
        print(f"| {name} | {ms:.4f} | {100 * ms / total:.1f}% |")
    route = sum(ms for name, ms in rows if any(k in name.lower() for k in ROUTING))
    print(
        f"\nrouting stages (summaries, scoring, top-k; on decode-only calls the routing launch also "
        f"writes the token): {route:.4f} ms = {100 * route / total:.1f}%"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("which", nargs="*", default=["decode", "prefill"])
    ap.add_argument("--ctx", type=int, default=131072)
    ap.add_argument("--seq", type=int, default=65536)
    ap.add_argument("--forced", type=int, default=0, help="forced blocks of the decode token's page (0: real top-k)")
    ap.add_argument(
        "--correlated",
        action="store_true",
        help="prefill: a page's tokens share one indexer query plus noise (bench_dash's page-correlated case)",
    )
    ap.add_argument("--tuning", default="", help="kernel knobs, e.g. attend_ctas=128 (attention.dash.cuda.Tuning)")
    a = ap.parse_args()
    B.TUNING = B.dcuda.Tuning.parse(a.tuning) if a.tuning else None
    if any(w not in ("decode", "prefill") for w in a.which):
        ap.error(f"cases are decode and prefill, got {a.which}")
    if a.correlated and "prefill" not in a.which:
        ap.error("--correlated applies to the prefill case only")
    if a.ctx < 2 * B.SBS or a.ctx % B.SBS or a.seq < B.SBS * 64:
        ap.error(f"--ctx must be a multiple of {B.SBS} (>= {2 * B.SBS}) and --seq at least {64 * B.SBS}")
    if not torch.cuda.is_available():
        print("breakdown: needs a CUDA GPU", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    for which in a.which:
        if which == "decode":
            for mid in (False, True):
                fn, _ = B.decode_step(32, a.ctx, gen, mid_block=mid, forced=a.forced)
                report(
                    f"decode 32 x {a.ctx // 1024}k" + (" mid-block" if mid else "") + f", {a.forced} forced",
                    profile(fn),
                )
                del fn
        else:
            fn, *_ = B.prefill_step(a.seq, gen, correlated=a.correlated)
            report(f"prefill 1 x {a.seq // 1024}k" + (", page-correlated indexer" if a.correlated else ""), profile(fn))
            del fn
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
