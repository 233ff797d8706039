"""Make tests/data/vllm_dash_golden.npz: DASH attention outputs computed by vLLM 0.34.0's own
module, for the tests to check dash-trt's reference against (tests/test_routing.py).

How the file was made (once; rerun it to check or to regenerate):

    pip download vllm==0.34.0 --no-deps -d /tmp/vllm && cd /tmp/vllm && unzip -q vllm-0.34.0-*.whl
    python scripts/vllm_golden.py --vllm-root /tmp/vllm --out tests/data/vllm_dash_golden.npz

The script reads ``vllm/model_executor/layers/dash_attention.py`` from that unpacked wheel and
executes only its torch part (the classes and functions from ``RouterNorm`` up to the serving
layer, which need torch alone), so neither vLLM nor its dependencies are installed or
imported; dash-trt itself never uses vLLM. Each case is a random document (several pages,
a response with ``<PAGE>`` markers, GQA), a random ``sparse_attention_config`` (block size 16
or 32, per-layer scale and floor lists over a layer map with a non-DASH layer, K above and
below 16), a layer and a ``prompt_length`` (set or not). Inputs are drawn in float32 and
rounded to float16 so that the file stores them exactly at half the size; the outputs are
float32, for the last ``nq`` positions.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch

ROLE_TEXT, ROLE_IMAGE, ROLE_PAGE = 0, 1, 2

#: (seed, pages, heads, kv_heads, head_dim, sparse_attention_config, layer, prompt length?, queries)
CASES = [
    (0, 4, 4, 2, 16, {"sparse_block_size": 16, "sparse_local_block": 2, "dash_topk_blocks": 12}, 0, False, 128),
    (
        1,
        5,
        4,
        1,
        16,
        {
            "sparse_block_size": 16,
            "sparse_local_block": 1,
            "dash_topk_blocks": 12,
            "sparse_attention_freq": [1, 0, 1, 1],
            "dash_scale_per_layer": [128.0, 40.0, 9.0],
            "dash_floor_per_layer": [1e-4, 1e-3, 3e-2],
            "dash_sigma": 0.7,
        },
        3,
        True,
        128,
    ),
    (
        2,
        3,
        6,
        3,
        16,
        {"sparse_block_size": 32, "sparse_local_block": 1, "dash_topk_blocks": 4, "dash_scaling_factor": 64.0},
        1,
        True,
        96,
    ),
    (
        3,
        6,
        4,
        2,
        16,
        {
            "sparse_block_size": 16,
            "sparse_local_block": 1,
            "dash_topk_blocks": 20,
            "dash_prior_floor": 1e-3,
            "dash_sigma": 2.0,
        },
        0,
        False,
        128,
    ),
    (
        4,
        4,
        4,
        2,
        16,
        {
            "sparse_block_size": 32,
            "sparse_local_block": 2,
            "dash_topk_blocks": 12,
            "sparse_rope_page_pairs": 2,
            "sparse_main_rope_tok_freq_mode": "truncate",
        },
        0,
        False,
        96,
    ),
    (
        5,
        8,
        4,
        2,
        16,
        {
            "sparse_block_size": 16,
            "sparse_local_block": 1,
            "dash_topk_blocks": 12,
            "sparse_rope_page_mod": 3,
            "sparse_rope_tok_freq_mode": "truncate",
        },
        2,
        True,
        128,
    ),
]


def load_vllm_dash(root: Path) -> dict:
    """The torch part of vLLM's DASH layer module, executed from the unpacked wheel."""
    path = root / "vllm" / "model_executor" / "layers" / "dash_attention.py"
    if not path.is_file():
        raise SystemExit(f"{path} not found: unpack the vLLM 0.34.0 wheel and pass its folder as --vllm-root")
    source = path.read_text(encoding="utf-8")
    body = source[source.index("class RouterNorm") : source.index("TOKEN_ROLES_KEY")]
    namespace = {"math": math, "torch": torch, "F": torch.nn.functional, "nn": torch.nn}
    exec(compile(body, str(path), "exec"), namespace)  # noqa: S102 - a maintainer's check, never at run time
    return namespace


def document(gen: torch.Generator, pages: int) -> list[int]:
    """Leading text, ``pages`` pages of <PAGE> + 30..90 image tokens + a little text, then a
    response of text with a <PAGE> marker per page at random places."""

    def rint(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    roles = [ROLE_TEXT] * rint(0, 6)
    for _ in range(pages):
        roles += [ROLE_PAGE] + [ROLE_IMAGE] * rint(30, 90) + [ROLE_TEXT] * rint(0, 5)
    response = [ROLE_TEXT] * rint(40, 80)
    for _ in range(pages):
        response[rint(0, len(response) - 1)] = ROLE_PAGE
    return roles + response


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-root", type=Path, required=True, help="folder holding the unpacked vllm-0.34.0 wheel")
    ap.add_argument("--out", type=Path, default=Path("tests/data/vllm_dash_golden.npz"))
    args = ap.parse_args(argv)
    vllm = load_vllm_dash(args.vllm_root)
    arrays, manifest = {}, []
    for seed, pages, heads, kv_heads, dim, overrides, layer, with_prompt, nq in CASES:
        gen = torch.Generator().manual_seed(1000 + seed)
        roles = torch.tensor(document(gen, pages))
        s = roles.numel()
        sp = {
            "sparse_index_dim": dim,
            "image_token_id": 7,
            "page_token_id": 8,
            "sparse_attention_freq": [1] * 4,
            **overrides,
        }

        def rnd(*shape, gen=gen):
            return torch.randn(*shape, generator=gen).half().float()

        q, k, v = rnd(s, heads, dim), rnd(s, kv_heads, dim), rnd(s, kv_heads, dim)
        iq, ik, head_cls = rnd(s, dim), rnd(s, dim), rnd(dim)
        prompt_length = int((roles == ROLE_IMAGE).nonzero().max()) + 1 if with_prompt else None
        nq = s if nq is None else nq
        out = vllm["dash_attention"](q[-nq:], k, v, iq[-nq:], ik, roles, head_cls, sp, layer, prompt_length)
        name = f"case{len(manifest)}"
        arrays.update(
            {
                f"{name}.roles": roles.numpy().astype(np.int8),
                f"{name}.q": q[-nq:].half().numpy(),
                f"{name}.k": k.half().numpy(),
                f"{name}.v": v.half().numpy(),
                f"{name}.iq": iq[-nq:].half().numpy(),
                f"{name}.ik": ik.half().numpy(),
                f"{name}.head_cls": head_cls.half().numpy(),
                f"{name}.out": out.numpy(),
            }
        )
        manifest.append(
            {"name": name, "sp": sp, "layer": layer, "prompt_length": prompt_length, "length": s, "queries": nq}
        )
        print(f"{name}: {s} tokens, {nq} queries, layer {layer}, prompt_length {prompt_length}", file=sys.stderr)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, manifest=np.frombuffer(json.dumps(manifest).encode(), dtype=np.uint8), **arrays)
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
