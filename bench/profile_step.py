"""One decode step (32 sequences, 32k context unless given; real top-k routing) or one prefill
(8k tokens unless given), eagerly, for profilers (ncu / nsys):
profile_step.py [decode [CONTEXT] | prefill [TOKENS]]."""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import bench_dash as B  # noqa: E402

gen = torch.Generator(device="cuda").manual_seed(0)
which = sys.argv[1] if len(sys.argv) > 1 else "decode"
if which == "decode":
    fn, _ = B.decode_step(32, int(sys.argv[2]) if len(sys.argv) > 2 else 32768, gen)
else:
    fn, *_ = B.prefill_step(int(sys.argv[2]) if len(sys.argv) > 2 else 8192, gen)
fn()
torch.cuda.synchronize()
