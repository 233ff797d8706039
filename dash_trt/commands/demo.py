"""``dash-demo``: the paged DASH operator on random prompts, checked against the reference."""

from __future__ import annotations

import argparse
import sys
import time

import torch

from ..attention.dash.config import DashConfig
from ..attention.dash.paged import DashKVCache, paged_dash_attention, sequence_coords
from ..attention.dash.reference import Routing, dash_attention
from ..cliutil import EXIT_CODES_NOTE, VERBOSE_HELP, cli_main
from ..serving.block_pool import KVBlockPool, blocks_for
from ..testing import compare_outputs, random_inputs, random_roles
from ..versions import version_line as _version_line

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

#: The demonstration's configuration: the benchmark's routing shape, scaled down.
DEMO_CONFIG = {
    "sparse_block_size": 16,
    "sparse_local_block": 1,
    "sparse_index_dim": 32,
    "dash_topk_blocks": 4,
    "dash_scaling_factor": 16.0,
    "sparse_rope_page_pairs": 1,
}


def run_demo(
    *,
    seed: int = 0,
    sequences: int = 3,
    pages: int = 6,
    kv_block_size: int = 32,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    decode_steps: int = 24,
    stream=None,
) -> bool:
    """Random prompts -> paged operator (chunked prefill + decode, sequences
    interleaved in one batch) -> compared with the reference. Returns success."""
    stream = stream or sys.stdout
    gen = torch.Generator().manual_seed(seed)
    cfg = DashConfig.from_dict(DEMO_CONFIG)
    heads, kv_heads, head_dim, index_dim = 8, 2, 64, 32
    head_cls = torch.randn(index_dim, generator=gen).to(dtype)
    seqs = []
    for _ in range(sequences):
        roles = random_roles(gen, pages, max_images=64, response=decode_steps, response_markers=2)
        x = random_inputs(
            gen,
            roles,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            index_dim=index_dim,
            dtype=dtype,
            head_cls=head_cls,
        )
        seqs.append((x, sequence_coords(roles)))
    total = sum(x.length for x, _ in seqs)
    num_blocks = sum(blocks_for(x.length, kv_block_size) for x, _ in seqs) + 4
    print(
        f"DASH demo: {sequences} sequences, {total} tokens, H={heads} Hkv={kv_heads} D={head_dim} "
        f"Di={index_dim}, {dtype}, {device}",
        file=stream,
    )
    print(f"config: {cfg.to_dict()}", file=stream)
    print(f"paged cache: {num_blocks} KV blocks of {kv_block_size} tokens", file=stream)

    pool = KVBlockPool(num_blocks, kv_block_size)
    cache = DashKVCache.allocate(
        num_blocks, kv_block_size, kv_heads, head_dim, index_dim, cfg.sparse_block_size, dtype=dtype, device=device
    )
    # Each sequence: prompt in chunks of up to 96 tokens, then one token per step.
    plans = []
    for i, (x, _) in enumerate(seqs):
        prompt = x.length - decode_steps
        chunks = [min(96, prompt - a) for a in range(0, prompt, 96)] + [1] * decode_steps
        plans.append(chunks)
        pool.add(i, prompt_length=prompt)
    done, outs, routes = [0] * sequences, [[] for _ in seqs], [[] for _ in seqs]
    step = 0
    t0 = time.perf_counter()
    while any(plans):
        live = [i for i in range(sequences) if plans[i]]
        batch_plan = [(i, plans[i].pop(0)) for i in live]
        batch = pool.schedule(batch_plan, device=device)
        rows = [(i, done[i], done[i] + n) for i, n in batch_plan]

        def cat(t, rows=rows):
            return torch.cat([t(i)[a:b] for i, a, b in rows]).to(device)

        out, routing = paged_dash_attention(
            cat(lambda i: seqs[i][0].q),
            cat(lambda i: seqs[i][0].k),
            cat(lambda i: seqs[i][0].v),
            cat(lambda i: seqs[i][0].iq),
            cat(lambda i: seqs[i][0].ik),
            cat(lambda i: seqs[i][1]),
            head_cls.to(device),
            cache,
            **batch.kwargs(),
            sp=cfg,
            layer_idx=0,
            return_routing=True,
        )
        qsl = batch.query_start_loc.tolist()
        for j, (i, _, b) in enumerate(rows):
            outs[i].append(out[qsl[j] : qsl[j + 1]].cpu())
            routes[i].append(routing.selected[qsl[j] : qsl[j + 1]].cpu())
            done[i] = b
        step += 1
        kinds = ", ".join(f"seq{i}:{'prefill' if n > 1 else 'decode'} {n}" for i, n in batch_plan)
        if step <= 4 or not any(plans):
            print(f"  step {step:3d}: {kinds}", file=stream)
        elif step == 5:
            print("  ...", file=stream)
    paged_s = time.perf_counter() - t0
    ok = True
    for i, (x, _) in enumerate(seqs):
        want, want_r = dash_attention(
            x.q, x.k, x.v, x.iq, x.ik, x.roles, x.head_cls, cfg, 0, x.length - decode_steps, return_routing=True
        )
        width = max(r.shape[1] for r in routes[i])
        sel = torch.cat([torch.nn.functional.pad(r, (0, width - r.shape[1]), value=-1) for r in routes[i]])
        report = compare_outputs(torch.cat(outs[i]), want, Routing(sel), want_r)
        ok &= report.ok
        print(f"sequence {i}: {report} -> {'OK' if report.ok else 'MISMATCH'}", file=stream)
    print(
        f"paged operator: {step} steps in {paged_s:.2f} s; free KV blocks after the run: "
        f"{pool.num_free_blocks} of {num_blocks}",
        file=stream,
    )
    for i in range(sequences):
        pool.free(i)
    assert pool.num_free_blocks == num_blocks
    print("RESULT: paged operator " + ("matches" if ok else "DOES NOT match") + " the reference", file=stream)
    return ok


@cli_main("dash-demo")
def demo_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="dash-demo",
        epilog="Exit codes: 0 the paged operator matches the reference, 1 a mismatch, 2 bad arguments, "
        + EXIT_CODES_NOTE,
        description="Run the paged DASH operator on random prompts (chunked prefill and decode "
        "in mixed batches) and check it against the PyTorch reference.",
    )
    p.add_argument("--version", action="version", version=_version_line())
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sequences", type=int, default=3)
    p.add_argument("--pages", type=int, default=6, help="document pages per prompt")
    p.add_argument("--decode-steps", type=int, default=24)
    p.add_argument("--kv-block-size", type=int, default=32)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    a = p.parse_args(argv)
    if a.sequences < 1 or a.pages < 1 or a.decode_steps < 0 or a.kv_block_size < 1:
        p.error("--sequences, --pages and --kv-block-size must be >= 1, --decode-steps >= 0")
    try:
        device = torch.device(a.device)
    except (RuntimeError, ValueError):
        p.error(f"--device {a.device!r} is not a device (cpu, cuda, cuda:N)")
    if device.type not in ("cpu", "cuda"):
        p.error(f"--device {a.device}: only cpu and cuda are supported")
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {a.device}: no CUDA device is visible to torch")
    ok = run_demo(
        seed=a.seed,
        sequences=a.sequences,
        pages=a.pages,
        kv_block_size=a.kv_block_size,
        dtype=DTYPES[a.dtype],
        device=a.device,
        decode_steps=a.decode_steps,
    )
    return 0 if ok else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(demo_main())
