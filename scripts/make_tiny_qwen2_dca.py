#!/usr/bin/env python3
"""Write a random-weight Qwen2 (or Qwen2-MoE) folder with Dual Chunk Attention in the Hugging Face
layout: a config.json carrying dual_chunk_attention_config, and model.safetensors.

    python3 scripts/make_tiny_qwen2_dca.py OUT [--moe] [--seed 0] [--chunk-size 32 --local-size 8]

Its sizes are small (hidden 64, 4 heads over 2 KV heads of 16, 2 layers, vocab 96) so every tool
runs it on a CPU in seconds: dash-export OUT --out dca.onnx --kv-block-size 8, dash-compare
dca.onnx --checkpoint OUT, dash-triton write OUT --out repo --kv-block-size 8, then dash-client
--ids 3,10,17 against the served model (a DCA model takes and returns token ids; it has no
tokenizer here, and no OCR). The weights are random: the tokens it generates mean nothing."""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dash_trt.models.qwen2_dca import write_tiny_qwen2_dca  # noqa: E402
from dash_trt.models.qwen2_dca.moe import write_tiny_qwen2_moe_dca  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="the folder to write (created; an earlier model there is replaced)")
    p.add_argument("--moe", action="store_true", help="Qwen2-MoE (routed and shared experts) instead of Qwen2")
    p.add_argument("--seed", type=int, default=0, help="weights seed (0)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers (2)")
    p.add_argument("--chunk-size", type=int, default=32, help="dual_chunk_attention_config.chunk_size (32)")
    p.add_argument("--local-size", type=int, default=8, help="dual_chunk_attention_config.local_size (8)")
    p.add_argument(
        "--original-max-position-embeddings",
        type=int,
        default=16,
        help="the trained length: turns the length scaling on (16; 0 off)",
    )
    p.add_argument("--rope-theta", type=float, default=1e6, help="RoPE base (1e6)")
    a = p.parse_args(argv)
    if a.layers < 1 or a.chunk_size < 1 or a.local_size < 1:
        p.error("--layers, --chunk-size and --local-size must be >= 1")
    if a.local_size >= a.chunk_size:
        p.error("--local-size must be smaller than --chunk-size")
    if a.original_max_position_embeddings < 0:
        p.error("--original-max-position-embeddings must be >= 0")
    section = {
        "chunk_size": a.chunk_size,
        "local_size": a.local_size,
        "original_max_position_embeddings": a.original_max_position_embeddings,
    }
    write = write_tiny_qwen2_moe_dca if a.moe else write_tiny_qwen2_dca
    try:
        files = write(
            a.out,
            seed=a.seed,
            num_hidden_layers=a.layers,
            rope_theta=a.rope_theta,
            dual_chunk_attention_config=section,
        )
    except ValueError as exc:  # a configuration the model refuses (DcaConfigError names the key)
        p.error(str(exc))
    kind = "Qwen2-MoE" if a.moe else "Qwen2"
    chunk = a.chunk_size - a.local_size
    print(
        f"wrote {a.out}: {kind} with Dual Chunk Attention ({', '.join(os.path.basename(f) for f in files)}); "
        f"a --kv-block-size for dash-export and dash-triton write must divide {chunk} (chunk_size - local_size)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
