"""One decode step (32 sequences, 32k context unless given) or one prefill (8k tokens unless
given), eagerly, for profilers (ncu / nsys): profile_step.py [decode [CONTEXT] | prefill [TOKENS]]."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import bench_dash as B  # noqa: E402

gen = torch.Generator(device="cuda").manual_seed(0)
which = sys.argv[1] if len(sys.argv) > 1 else "decode"
if which == "decode":
    B.time_ms = lambda fn, iters=20, warmup=3: (fn(), torch.cuda.synchronize(), 1.0)[-1]  # run once
    B.graph_of = lambda fn: type("G", (), {"replay": staticmethod(fn)})
    B.decode_case(32, int(sys.argv[2]) if len(sys.argv) > 2 else 32768, False, gen)
else:
    B.time_ms = lambda fn, iters=20, warmup=3: (fn(), torch.cuda.synchronize(), 1.0)[-1]
    B.prefill_case(int(sys.argv[2]) if len(sys.argv) > 2 else 8192, False, gen)
