"""DRAM bytes of one DASH call, kernel by kernel, counted by Nsight Compute.

    # a decode step, against the benchmark's byte count
    ncu --clock-control none --kernel-name-base demangled --kernel-name regex:dash:: \\
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum --print-units base --csv \\
        python3 bench/profile_step.py decode 32768 > ncu_dram.csv
    python3 bench/ncu_dram.py ncu_dram.csv 32 32768

    # a prefill call: every kernel's time, bytes, DRAM and issue rates, and the bytes' floor
    ncu --clock-control none --kernel-name-base demangled --kernel-name regex:dash:: \\
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,\\
dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__inst_issued.avg.pct_of_peak_sustained_active,\\
sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active --print-units base --csv \\
        python3 bench/profile_step.py prefill 16384 > ncu16k.csv
    python3 bench/ncu_dram.py --kernels ncu16k.csv --read-gbs 4276

ncu's ``--kernel-name regex:dash::`` keeps the kernels of the ``dash::`` namespace (the call's
setup kernels, random fills and the like, are left out); every kernel in the file is summed.
Decode (the default): the sums beside ``bench_dash.decode_traffic`` for the same shape (32
sequences at 32768 tokens unless given), a check that the bandwidth figures of
docs/performance.md count the bytes the hardware moves. ``--kernels``: a markdown table of the
kernels and the call's totals (no torch needed); with ``--read-gbs`` (a streaming-read rate, as
bench_dash.py prints it) also the time those bytes take at that rate, the call's DRAM floor if
every byte streamed like a read. Nsight Compute empties the caches before each kernel, so a
kernel's reads of what the one before it left in L2 count as DRAM reads here.
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import sys

sys.path.insert(0, os.path.dirname(__file__))

#: metric -> (column, scale, format) of the --kernels table
COLUMNS = {
    "gpu__time_duration.sum": ("us", 1e-3, "{:.1f}"),
    "dram__bytes_read.sum": ("DRAM read MB", 1e-6, "{:.1f}"),
    "dram__bytes_write.sum": ("DRAM write MB", 1e-6, "{:.1f}"),
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": ("DRAM % of peak", 1.0, "{:.0f}%"),
    "sm__inst_issued.avg.pct_of_peak_sustained_active": ("issue slots busy", 1.0, "{:.0f}%"),
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active": ("tensor pipe", 1.0, "{:.0f}%"),
}


def short_name(kernel: str) -> str:
    """``void dash::<unnamed>::qm_attend_kernel<__nv_bfloat16, 128, 1>(DashParams, ...)`` ->
    ``qm_attend_kernel<__nv_bfloat16, 128, 1>``: the function and its template arguments."""
    head = kernel.split("(")[0] if "(" in kernel else kernel
    m = re.search(r"(\w+(<.*>)?)\s*$", head)
    return m.group(1) if m else head.strip()


def read_kernels(path: str) -> list[tuple[int, str, dict[str, float]]]:
    """Each kernel launch of an ``ncu --csv`` file: (ID, name, {metric: value in base units})."""
    with open(path, newline="") as fh:
        lines = [line for line in fh if line.startswith('"')]  # ncu's own log lines are not CSV
    launches: dict[int, tuple[str, dict[str, float]]] = {}
    for row in csv.DictReader(lines):
        try:
            value = float(row["Metric Value"].replace(",", ""))
            kid = int(row["ID"])
        except (KeyError, ValueError, AttributeError):  # not a metric row of ncu's --csv
            continue
        launches.setdefault(kid, (short_name(row.get("Kernel Name", "")), {}))[1][row["Metric Name"]] = value
    return [(kid, name, metrics) for kid, (name, metrics) in sorted(launches.items())]


def total(kernels, metric: str) -> float:
    """A metric summed over the launches (0 where ncu did not report it)."""
    return sum(k[2].get(metric, 0.0) for k in kernels)


def kernels_table(kernels, read_gbs: float | None) -> str:
    shown = [m for m in COLUMNS if any(m in k[2] for k in kernels)]
    out = [
        "| kernel | " + " | ".join(COLUMNS[m][0] for m in shown) + " |",
        "| --- | " + " | ".join("---:" for _ in shown) + " |",
    ]
    for kid, name, metrics in kernels:
        cells = [COLUMNS[m][2].format(metrics[m] * COLUMNS[m][1]) if m in metrics else "" for m in shown]
        out.append(f"| {kid}: {name} | " + " | ".join(cells) + " |")
    read, write = total(kernels, "dram__bytes_read.sum"), total(kernels, "dram__bytes_write.sum")
    out.append("")
    line = f"{len(kernels)} kernel launches"
    if any("gpu__time_duration.sum" in k[2] for k in kernels):
        line += f", {total(kernels, 'gpu__time_duration.sum') / 1e3:.1f} us"
    line += f"; DRAM read {read / 1e9:.3f} GB, written {write / 1e9:.3f} GB, {(read + write) / 1e9:.3f} GB in all" + (
        f" ({write / (read + write):.0%} writes)" if read + write > 0 else ""
    )
    out.append(line)
    if read_gbs:
        out.append(
            f"at {read_gbs:.0f} GB/s (every byte as fast as a streaming read): {(read + write) / read_gbs / 1e6:.3f} ms"
        )
    return "\n".join(out)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", help="ncu --csv output")
    ap.add_argument("nseq", nargs="?", type=int, default=32, help="decode: sequences (%(default)s)")
    ap.add_argument("ctx", nargs="?", type=int, default=32768, help="decode: context (%(default)s)")
    ap.add_argument(
        "--kernels", action="store_true", help="the per-kernel table and totals instead of the decode count"
    )
    ap.add_argument("--read-gbs", type=float, default=None, help="with --kernels: a streaming-read rate in GB/s")
    a = ap.parse_args(argv)
    if a.read_gbs is not None and not a.read_gbs > 0:
        ap.error(f"--read-gbs must be a positive rate in GB/s, got {a.read_gbs}")
    try:
        kernels = read_kernels(a.csv)
    except OSError as e:
        print(f"ncu_dram: cannot read {a.csv}: {e.strerror}", file=sys.stderr)
        return 2
    except UnicodeDecodeError:
        print(f"ncu_dram: {a.csv} is not text (expected the output of ncu --csv)", file=sys.stderr)
        return 2
    if not kernels:
        print(f"ncu_dram: no kernel metrics in {a.csv}", file=sys.stderr)
        return 1
    if a.kernels:
        print(kernels_table(kernels, a.read_gbs))
        return 0
    import bench_dash as B  # torch is only needed here

    want = B.decode_traffic([a.ctx] * a.nseq)
    read, write = total(kernels, "dram__bytes_read.sum"), total(kernels, "dram__bytes_write.sum")
    print(
        f"{len(kernels)} DASH kernel launches: DRAM read {read / 1e6:.1f} MB, written {write / 1e6:.1f} MB; "
        f"the benchmark counts {want['bytes'] / 1e6:.1f} MB (K/V {want['kv_bytes'] / 1e6:.1f}, routing "
        f"{want['route_bytes'] / 1e6:.1f}, inputs/outputs {want['io_bytes'] / 1e6:.1f}); measured / counted "
        f"{(read + write) / want['bytes']:.2f}"
    )
    for kid, name, _ in kernels:
        print(f"  {kid}: {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
