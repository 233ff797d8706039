"""Top SASS instructions by warp-stall samples from `ncu --page source --csv` output.

    ncu_source_top.py SOURCE.csv [N]

Nsight Compute's source page lists every instruction with its sampled stall reasons; this
prints the N instructions with the most samples and, for each, its three largest reasons, then
(where the page has the column) the warp instructions executed: in all, and by opcode."""

import csv
import sys


def number(text):
    try:
        return float(str(text).replace(",", ""))
    except ValueError:
        return 0.0


def main(path, n=30):
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    # The report may hold several kernels: each starts with its own header row.
    starts = [i for i, r in enumerate(rows) if any("Warp Stall Sampling (All" in c for c in r)]
    if not starts:
        print("no 'Warp Stall Sampling' column; header:", rows[0][:12] if rows else "empty file")
        return 1
    for k, s in enumerate(starts):
        header, body = rows[s], rows[s + 1 : starts[k + 1] if k + 1 < len(starts) else len(rows)]
        if s > 0 and len(rows[s - 1]) <= 2:
            print("##", " ".join(rows[s - 1]))
        col = next(i for i, c in enumerate(header) if "Warp Stall Sampling (All" in c)
        src = next((i for i, c in enumerate(header) if c.strip() == "Source"), 1)
        reasons = [
            i
            for i, c in enumerate(header)
            if c.startswith("stall_")
            or "Stall" in c
            and i != col
            and "Not-issued" not in c
            and "Warp Stall Sampling" not in c
        ]
        body = [r for r in body if len(r) == len(header)]
        total = sum(number(r[col]) for r in body) or 1.0
        print(f"kernel {k}: {len(body)} instructions, {total:.0f} samples")
        for r in sorted(body, key=lambda r: -number(r[col]))[:n]:
            top = sorted(((number(r[i]), header[i]) for i in reasons), reverse=True)[:3]
            why = ", ".join(f"{name} {v:.0f}" for v, name in top if v > 0)
            print(f"{100 * number(r[col]) / total:5.1f}%  {r[src][:70]:70s}  {why}")
        ex = next((i for i, c in enumerate(header) if c.strip() == "Instructions Executed"), None)
        if ex is not None:
            per_op = {}
            for r in body:
                op = r[src].split()[0] if r[src].split() else "?"
                if op.startswith("@"):  # predicated: the opcode follows the guard
                    op = r[src].split()[1] if len(r[src].split()) > 1 else op
                op = op.split(".")[0]
                per_op[op] = per_op.get(op, 0.0) + number(r[ex])
            done = sum(per_op.values()) or 1.0
            print(f"kernel {k}: {done:.4g} warp instructions executed; by opcode:")
            print(
                "  "
                + ", ".join(
                    f"{op} {100 * v / done:.1f}%" for op, v in sorted(per_op.items(), key=lambda kv: -kv[1])[:16]
                )
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 30))
