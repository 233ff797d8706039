"""KV blocks on demand against worst-case reservations: the same requests on the same pool.

Requests ask for ``--max-new-tokens`` (default 128) but stop much earlier, at a stop token
(the ``--stop-after``-th token of each request's own answer, default 16: ``max_new_tokens``
is 8x what they use), as OCR transcriptions with generous budgets do. Each runs through
:class:`dash_trt.serving.engine.GenerationEngine` twice, with ``kv_on_demand`` off (every
request reserves prompt + max_new_tokens at admission) and on (admitted on its prompt, grown
as it generates, preempted by recompute under pressure). Reported per policy: the most
requests running at once, the requests that had to wait, preemptions and recomputed tokens,
steps, wall time and generated tokens/s; every answer is checked against the request run
alone (the script exits 1 if one differs).

Model: the demo model (``--device cpu``, the default) or, with ``--config`` a model
config.json, random weights of that config (on ``--device cuda``, say). Writes a markdown
table, ``--json`` and ``--png`` (requests at once and tokens/s, by policy). Not a test:
nothing about speed is asserted.

    python bench/bench_kv_on_demand.py --json docs/kv_on_demand.json --png docs/kv_on_demand.png
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from dash_trt import model as M  # noqa: E402
from dash_trt.serving.engine import EngineConfig, GenerationEngine  # noqa: E402


def _model(args):
    if args.config:
        cfg = M.DashModelConfig.from_json(args.config)
        return M.random_model(cfg, device=args.device, dtype=getattr(torch, args.dtype))
    return M.demo_model(seed=0).to(args.device)


def _prompts(model, n: int, pages: int, images: int) -> list[list[int]]:
    cfg = model.config
    return [M.document_prompt([images] * pages, f"Read page {i}.", cfg, preamble=f"Doc {i}: ") for i in range(n)]


def _engine(model, args, on_demand: bool) -> GenerationEngine:
    return GenerationEngine(
        model,
        EngineConfig(
            num_blocks=args.num_blocks,
            kv_block_size=args.kv_block_size,
            max_num_seqs=args.max_num_seqs,
            max_batch_tokens=args.max_batch_tokens,
            prefill_chunk=args.prefill_chunk,
            max_new_tokens_limit=max(args.max_new_tokens, 1),
            kv_on_demand=on_demand,
            prefix_caching=False,
        ),
    )


def _alone(model, args, prompt, **options) -> list[int]:
    engine = _engine(model, args, True)
    req = engine.submit(prompt, args.max_new_tokens, stop_at_eos=False, **options)
    engine.run_until_idle()
    return req.result(0)


def run(args) -> dict:
    torch.manual_seed(0)
    model = _model(args)
    prompts = _prompts(model, args.requests, args.pages, args.images)
    stops, expected = [], []
    for p in prompts:
        free = _alone(model, args, p)
        tok = free[args.stop_after - 1]
        stops.append(tok)
        expected.append(free[: free.index(tok) + 1])
    out = {"policies": {}}
    for on_demand in (False, True):
        engine = _engine(model, args, on_demand)
        engine.warmup()
        t0 = time.perf_counter()
        reqs = [
            engine.submit(p, args.max_new_tokens, stop_at_eos=False, stop_token_ids=[s]) for p, s in zip(prompts, stops)
        ]
        engine.run_until_idle()
        wall = time.perf_counter() - t0
        answers = [r.result(0) for r in reqs]
        c = engine.counters
        pool = engine.scheduler.pool
        out["policies"]["on demand" if on_demand else "worst case"] = {
            "kv_on_demand": on_demand,
            "peak_running": c["peak_running"],
            "waited": c["waited"],
            "preempted": c["preempted"],
            "tokens_recomputed": c["tokens_recomputed"],
            "steps": c["steps"],
            "peak_blocks_in_use": c["peak_blocks_in_use"],
            "wall_s": wall,
            "generated_tokens": c["tokens_generated"],
            "tokens_per_s": c["tokens_generated"] / wall,
            "answers_equal_alone": answers == expected,
            "pool_free_after": pool.num_free_blocks == pool.num_blocks,
        }
    w, d = out["policies"]["worst case"], out["policies"]["on demand"]
    out["running_ratio"] = d["peak_running"] / w["peak_running"]
    out["setup"] = {
        "model": args.config or "demo model (dash_trt.model.demo_model)",
        "device": torch.cuda.get_device_name(0)
        if args.device.startswith("cuda")
        else f"CPU {platform.machine()}, {torch.get_num_threads()} threads",
        "torch_threads": torch.get_num_threads(),
        "requests": args.requests,
        "prompt_tokens": sorted({len(p) for p in prompts}),
        "max_new_tokens": args.max_new_tokens,
        "generated_per_request": sorted({len(e) for e in expected}),
        "num_blocks": args.num_blocks,
        "kv_block_size": args.kv_block_size,
        "max_num_seqs": args.max_num_seqs,
        "commit": _commit(),
        "date": time.strftime("%Y-%m-%d"),
    }
    return out


def _commit() -> str:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.run(
            ["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def table(result: dict) -> str:
    rows = [
        "| policy | requests at once (peak) | waited | preempted | tokens recomputed | steps | "
        "peak blocks in use | wall s | generated tokens/s | answers = alone |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, p in result["policies"].items():
        rows.append(
            f"| {name} | {p['peak_running']} | {p['waited']} | {p['preempted']} | {p['tokens_recomputed']} | "
            f"{p['steps']} | {p['peak_blocks_in_use']} | {p['wall_s']:.2f} | {p['tokens_per_s']:.0f} | "
            f"{'yes' if p['answers_equal_alone'] else 'NO'} |"
        )
    return "\n".join(rows)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["policies"])
    pol = result["policies"]
    s = result["setup"]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for ax, key, label in (
        (axes[0], "peak_running", "requests running at once (peak)"),
        (axes[1], "tokens_per_s", "generated tokens/s"),
    ):
        values = [pol[n][key] for n in names]
        bars = ax.bar(names, values, color=["#999999", "#2a7ab0"])
        ax.bar_label(bars, fmt="%.0f")
        ax.set_title(label, fontsize=10)
    fig.suptitle(
        f"KV on demand vs worst case: {s['requests']} requests, max_new_tokens {s['max_new_tokens']}, "
        f"~{max(s['generated_per_request'])} used; pool {s['num_blocks']} x {s['kv_block_size']} "
        f"({s['device']}, {s['commit']}, {s['date']})",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="a model config.json (random weights); default: the demo model")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--pages", type=int, default=1)
    p.add_argument("--images", type=int, default=8, help="image tokens per page (%(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--stop-after", type=int, default=16, help="each request stops at this token (%(default)s)")
    p.add_argument("--num-blocks", type=int, default=144)
    p.add_argument("--kv-block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-batch-tokens", type=int, default=2048)
    p.add_argument("--prefill-chunk", type=int, default=512)
    p.add_argument("--json")
    p.add_argument("--png")
    args = p.parse_args(argv)
    if not 1 <= args.stop_after <= args.max_new_tokens:
        p.error("--stop-after must be in 1..--max-new-tokens")
    result = run(args)
    print(table(result))
    print(f"\nrequests at once, on demand / worst case: {result['running_ratio']:.2f}x")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    if args.png:
        plot(result, args.png)
    ok = all(p["answers_equal_alone"] and p["pool_free_after"] for p in result["policies"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
