#!/usr/bin/env python3
"""Write a random-weight Unlimited-OCR-2 checkpoint folder in the published layout: a nested
config.json (language_config with DeepSeek-V2's MoE keys, sparse_attention_config, vision and
projector sections), the decoder and a small vision tower in sharded safetensors with their
index under the checkpoint's tensor names, and a trained byte-level BPE tokenizer.

    python3 scripts/make_tiny_unlimited_ocr2.py OUT [--layers 2] [--experts 8] [--seed 0]

Its sizes are small (hidden 128, 4 heads of 32; views of 256 and 160 pixels) so every tool runs
it on a CPU in seconds: dash-export OUT --out model.onnx, dash-compare, dash-triton write OUT,
dash-trt info OUT, dash-trt ocr. The weights are random: the text it generates means nothing."""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dash_trt.models.tiny import write_tiny_checkpoint  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="the folder to write (created; an earlier checkpoint there is replaced)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers (2; layer 0 dense, the rest MoE)")
    p.add_argument("--experts", type=int, default=8, help="routed experts (8)")
    p.add_argument("--experts-per-token", type=int, default=2, help="experts a token (2)")
    p.add_argument("--shared-experts", type=int, default=2, help="shared experts (2)")
    p.add_argument("--seed", type=int, default=0, help="weights seed (0)")
    p.add_argument("--shard-bytes", type=int, default=400_000, help="largest shard (400000: several shards)")
    a = p.parse_args(argv)
    for name in ("layers", "experts", "experts_per_token", "shard_bytes"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.experts_per_token > a.experts:
        p.error("--experts-per-token must be at most --experts")
    files = write_tiny_checkpoint(
        a.out,
        seed=a.seed,
        max_shard_bytes=a.shard_bytes,
        layers=a.layers,
        experts=a.experts,
        experts_per_token=a.experts_per_token,
        shared_experts=a.shared_experts,
    )
    print(f"wrote {a.out}: {len(files)} files ({', '.join(files[-4:])}, ...)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
