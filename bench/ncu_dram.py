"""DRAM bytes of one DASH decode step, counted by Nsight Compute, against the benchmark's count.

    ncu --clock-control none --metrics dram__bytes_read.sum,dram__bytes_write.sum --print-units base --csv \
        python3 bench/profile_step.py decode 32768 > ncu_dram.csv
    python3 bench/ncu_dram.py ncu_dram.csv 32 32768

Sums the metrics over the kernels of the ``dash::`` namespace (the step's setup kernels, random
fills and the like, are left out) and prints them beside ``bench_dash.decode_traffic`` for the
same shape (32 sequences at 32768 tokens unless given): a check that the bandwidth figures of
docs/performance.md count the bytes the hardware moves.
"""
from __future__ import annotations

import csv
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    path, nseq, ctx = argv[0], int(argv[1]) if len(argv) > 1 else 32, int(argv[2]) if len(argv) > 2 else 32768
    with open(path, newline="") as fh:
        lines = [line for line in fh if line.startswith('"')]  # ncu's own log lines are not CSV
    totals: dict[str, float] = {}
    kernels = set()
    for row in csv.DictReader(lines):
        if "dash::" not in row.get("Kernel Name", ""):
            continue
        kernels.add((row["ID"], row["Kernel Name"].split("(")[0]))
        value = float(row["Metric Value"].replace(",", ""))
        totals[row["Metric Name"]] = totals.get(row["Metric Name"], 0.0) + value
    if not kernels:
        print(f"ncu_dram: no dash:: kernel in {path}", file=sys.stderr)
        return 1
    import bench_dash as B  # torch is only needed here

    want = B.decode_traffic([ctx] * nseq)
    read, write = totals.get("dram__bytes_read.sum", 0.0), totals.get("dram__bytes_write.sum", 0.0)
    print(f"{len(kernels)} DASH kernel launches: DRAM read {read / 1e6:.1f} MB, written {write / 1e6:.1f} MB; "
          f"the benchmark counts {want['bytes'] / 1e6:.1f} MB (K/V {want['kv_bytes'] / 1e6:.1f}, routing "
          f"{want['route_bytes'] / 1e6:.1f}, inputs/outputs {want['io_bytes'] / 1e6:.1f}); measured / counted "
          f"{(read + write) / want['bytes']:.2f}")
    for kid, name in sorted(kernels, key=lambda k: int(k[0])):
        print(f"  {kid}: {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
