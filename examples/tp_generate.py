"""Tensor-parallel greedy generation, one process per GPU (dash_trt.parallel):

    torchrun --nproc-per-node 2 examples/tp_generate.py --checkpoint model.pt --check

Every rank holds its shard (its attention heads, KV heads and MLP slice) and prints the same
tokens. ``--check`` also generates with the whole model on rank 0's device and exits 1 if the
tokens differ. ``--gloo`` uses gloo instead of NCCL (CPUs, or ``--one-gpu``: every rank on
cuda:0, to try the split on a machine with one GPU; gloo collectives cannot be captured, so
decode steps then run without CUDA graphs).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from dash_trt import model as M
from dash_trt import parallel
from dash_trt.cliutil import cli_main


@cli_main("tp_generate")
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="model.pt or a Hugging Face folder")
    src.add_argument("--random-init", metavar="CONFIG_JSON", help="random weights of this config.json")
    src.add_argument("--demo", action="store_true", help="the built-in demo model")
    ap.add_argument("--layers", type=int, help="with --random-init: override num_hidden_layers")
    ap.add_argument("--dtype", choices=sorted(M.DTYPES), help="default: the checkpoint's")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--kv-block-size", type=int, help="default: the sparse block size (what the CUDA kernels take)")
    ap.add_argument("--check", action="store_true", help="compare with the unsharded model's tokens")
    ap.add_argument("--gloo", action="store_true", help="gloo instead of NCCL")
    ap.add_argument("--one-gpu", action="store_true", help="every rank on cuda:0 (with --gloo)")
    a = ap.parse_args(argv)
    for flag, path in (("--checkpoint", a.checkpoint), ("--random-init", a.random_init)):
        if path and not os.path.exists(path):
            ap.error(f"{flag} {path}: no such file or folder")
    if a.one_gpu and not a.gloo:
        ap.error("--one-gpu needs --gloo (NCCL refuses two ranks on one GPU)")
    rank, world, device = parallel.init_from_env("gloo" if a.gloo else None)
    if a.one_gpu:
        device = torch.device("cuda", 0)
    dtype = M.DTYPES[a.dtype] if a.dtype else None
    if a.checkpoint:
        model = M.load_checkpoint(a.checkpoint)
        model = model.to(dtype) if dtype else model
    elif a.demo:
        model = M.demo_model(dtype=dtype or torch.float32)
    else:
        import json

        with open(a.random_init) as fh:
            cfg = json.load(fh)
        if a.layers:
            cfg["num_hidden_layers"] = a.layers
        model = M.random_model(cfg, dtype=dtype)
    prompts, _ = M.check_prompts(model)
    graphs = False if a.gloo and device.type == "cuda" else None  # gloo collectives cannot be captured
    shard = parallel.shard_model(model, rank, world).to(device)
    kv = a.kv_block_size or model.config.dash.sparse_block_size
    got = M.generate(shard, prompts, a.new_tokens, cuda_graphs=graphs, keep_logits=False, kv_block_size=kv).tokens
    print(f"rank {rank}/{world} on {device}: {got}", flush=True)
    if a.check and rank == 0:
        want = M.generate(
            model.to(device), prompts, a.new_tokens, cuda_graphs=graphs, keep_logits=False, kv_block_size=kv
        ).tokens
        same = got == want
        print(f"TP={world} tokens {'equal' if same else 'DIFFER FROM'} the unsharded model's", flush=True)
        if not same:
            print(f"unsharded: {want}", flush=True)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
