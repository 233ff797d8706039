"""Where a decode step's time goes inside the routing and attention launches: per-CTA phase
timestamps from a kernel library built with ``-DDASH_TRACE=ON`` (``scripts/gpu_check.sh trace``).

  DASH_TRT_LIBRARY=build-trace/plugins/libdash_trt_kernels.so python3 bench/trace_step.py [--ctx 8192 131072]

Each case is the benchmark's decode step (32 sequences, one new token each, ``max_query_len=1``)
replayed from a CUDA graph; the last replay's marks are read back. Times are in microseconds
from the first routing CTA's start (global timer); phase lengths inside a CTA come from its SM
clock, converted with the clock rate measured over the same CTAs. Not a test: nothing here
asserts a time, and the marks themselves cost a few instructions per CTA.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import bench_dash as B  # noqa: E402

from dash_trt.attention.dash import cuda as dcuda  # noqa: E402

SLOTS = 8  # marks per CTA (plugins/kernels/common.cuh: kTraceSlots); the clocks follow them
ROUTE_MARKS = (
    "entry",
    "token found, iq rotated",
    "rows scored",
    "candidates counted / own selection",
    "merged selection",
    "writer: token_seq",
    "writer: done",
    "exit",
)
ATTEND_MARKS = (
    "entry",
    "first-round reads landed",
    "pieces in shared memory",
    "queries and angles landed",
    "queries rotated, K/V stored",
    "first units issued",
    "loop done",
    "exit",
)


def read(lib, kernel: int) -> list[list[int]]:
    """The last launch's marks of one kernel (0 routing, 1 attention), a row per CTA."""
    count = ctypes.c_int64(0)
    status = lib.dash_debug_trace(kernel, None, ctypes.byref(count))
    buf = (ctypes.c_ulonglong * count.value)() if status == 0 else None
    if status != 0 or lib.dash_debug_trace(kernel, buf, ctypes.byref(count)) != 0:
        raise RuntimeError(f"dash_debug_trace({kernel}) failed: {lib.dash_last_error_message().decode()}")
    row = 2 * SLOTS
    return [list(buf[c * row : (c + 1) * row]) for c in range(count.value // row)]


def q(xs: list[float]) -> str:
    if not xs:
        return "-"
    xs = sorted(xs)
    return f"{xs[0]:6.2f} {statistics.median(xs):6.2f} {xs[-1]:6.2f}"


def report(title: str, route: list[list[int]], attend: list[list[int]]) -> None:
    route = [r for r in route if r[0]]
    attend = [a for a in attend if a[0]]
    if not route or not attend:
        print(f"## {title}: no marks (was the library built with DASH_TRACE?)")
        return
    t0 = min(r[0] for r in route)
    # SM clock per ns, from CTAs long enough for the global timer's granularity not to matter.
    rates = [(r[SLOTS + 7] - r[SLOTS]) / (r[7] - r[0]) for r in route if r[7] and r[7] - r[0] > 4000]
    ghz = statistics.median(rates) if rates else 1.98
    us = lambda ns: (ns - t0) / 1e3  # noqa: E731
    print(f"\n## {title}: {len(route)} routing CTAs, {len(attend)} attention CTAs, SM clock {ghz:.2f} GHz")
    print("\nat (us from the first routing CTA's start; min / median / max over the CTAs that reach it):\n")
    print("| kernel | mark | CTAs | min | median | max |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for name, rows, marks in (("route", route, ROUTE_MARKS), ("attend", attend, ATTEND_MARKS)):
        for i, m in enumerate(marks):
            xs = [us(r[i]) for r in rows if r[i]]
            if xs:
                print(f"| {name} | {i} {m} | {len(xs)} | " + " | ".join(q(xs).split()) + " |")
    print("\nphase lengths inside a CTA (us, SM clock; min / median / max):\n")
    print("| kernel | from -> to | CTAs | min | median | max |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for name, rows, marks in (("route", route, ROUTE_MARKS), ("attend", attend, ATTEND_MARKS)):
        # Marks taken in time order inside each CTA, not in slot order (a CTA may reach them in
        # another order, e.g. the routing's writer marks 5-6 after the candidates' mark 3);
        # ones a CTA never reaches are skipped.
        phases: dict[tuple[int, int], list[float]] = {}
        for r in rows:
            reached = sorted((r[SLOTS + k], k) for k in range(len(marks)) if r[k])
            for (c0, i), (c1, j) in zip(reached, reached[1:]):
                phases.setdefault((i, j), []).append((c1 - c0) / ghz / 1e3)
        for (i, j), xs in sorted(phases.items()):
            print(f"| {name} | {i} -> {j} | {len(xs)} | " + " | ".join(q(xs).split()) + " |")
    route_end = max(max(x for x in r[:SLOTS] if x) for r in route)
    att_start = min(a[0] for a in attend)
    att_end = max(max(x for x in a[:SLOTS] if x) for a in attend)
    print(
        f"\nrouting: first start 0, last mark {us(route_end):.2f} us; attention: first start "
        f"{us(att_start):.2f} us (gap {(att_start - route_end) / 1e3:+.2f} us), last mark {us(att_end):.2f} us"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ctx", type=int, nargs="*", default=[8192, 131072])
    a = ap.parse_args()
    bad = [c for c in a.ctx if c < 2 * B.SBS or c % B.SBS]
    if bad:
        ap.error(f"--ctx values must be multiples of {B.SBS}, at least {2 * B.SBS}; got {bad}")
    if not torch.cuda.is_available():
        print("trace_step: needs a CUDA GPU", file=sys.stderr)
        return 2
    lib = dcuda._library()
    if not hasattr(lib, "dash_debug_trace"):
        print(f"trace_step: {dcuda.library_path()} was not built with -DDASH_TRACE=ON", file=sys.stderr)
        return 2
    lib.dash_debug_trace.restype = ctypes.c_int
    lib.dash_debug_trace.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_ulonglong), ctypes.POINTER(ctypes.c_int64)]
    lib.dash_last_error_message.restype = ctypes.c_char_p
    gen = torch.Generator(device="cuda").manual_seed(0)
    for ctx in a.ctx:
        for mid in (False, True):
            dash = B.decode_step(32, ctx, gen, mid)[0]
            g = B.graph_of(dash)
            for _ in range(5):
                g.replay()
            torch.cuda.synchronize()
            read(lib, 0), read(lib, 1)  # clear
            g.replay()
            torch.cuda.synchronize()
            report(f"decode 32 x {ctx // 1024}k" + (" mid-block" if mid else ""), read(lib, 0), read(lib, 1))
            del g, dash
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
