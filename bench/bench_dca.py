"""Dual Chunk Attention beside its peers: prefill and decode at 32k-1M tokens.

The paths (``--paths``), at one attention layer of a Qwen2-7B-like model (28 query heads, 4 KV
heads of 128, RoPE base 1e7; Qwen2.5-7B-Instruct-1M's DCA section: chunk 262,144, local 8,192,
``original_max_position_embeddings`` 262,144; ``--chunk-size`` / ``--local-size`` change it):

* ``seed``: the brute-force approach that seed 002 and vLLM's ``DUAL_CHUNK_FLASH_ATTN`` backend
  use: for every query chunk three flash-attention calls (its own chunk, causal; the previous
  chunk; every earlier chunk), each with its own query rotation, merged by their log-sum-exps;
  eager, as upstream must run it (the number of calls follows the length).
* ``dense``: the same layer without DCA: standard RoPE at absolute positions and one causal
  flash-attention call (what the model costs when it does not need DCA).
* ``torch``: dash-trt's reference (:func:`dash_trt.attention.dca.reference.dual_chunk_attention`,
  float32, three rotations over every key): the function, not a fast path; timed only up to
  ``--torch-max`` tokens.

* ``dash-trt``: dash-trt's DCA kernels (:mod:`dash_trt.attention.dca.kernels`, Triton): one
  kernel over a paged cache (blocks of 64 tokens), one online softmax per query tile with the
  rotation picked per key range; decode splits the keys across the GPU. Its time includes what
  the call does beyond the others: writing the new keys (rotated, scaled) and values into the
  cache (every key, for a prefill) and the three query rotations.

Prefill calls of the seed and dense paths use
PyTorch's flash-attention operator (its log-sum-exp output; GQA by repeating the KV heads once,
outside the timing); decode (one sequence, one query) uses the same batched-matmul form for every
path, so the decode figures compare the regions' structure, not two kernels. Keys are rotated
(the KV cache write) outside the timing for every path; query rotations are inside it.

Before timing, ``seed`` and ``dense`` are checked against the reference at small sizes in
float32 (``seed`` with several chunks; ``dense`` against DCA with one chunk, which is standard
RoPE attention); a path that disagrees fails the run. ``--device cpu`` runs everything at toy
sizes (the CPU smoke test); figures are only meaningful on a GPU.

    python bench/bench_dca.py --json out.json --png out.png            # GPU
    python bench/bench_dca.py --device cpu --lengths 96 --chunk-size 32 --local-size 8 \\
        --heads 4 --kv-heads 2 --head-dim 16 --dtype float32           # CPU smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_dash import stats  # noqa: E402,I001

from dash_trt.attention.dca import kernels  # noqa: E402
from dash_trt.attention.dca.paged import DcaKVCache  # noqa: E402
from dash_trt.attention.dca.reference import DcaConfig, dual_chunk_attention  # noqa: E402

#: Qwen2.5-7B-Instruct-1M (config.json): heads, KV heads, head dim, RoPE base, DCA section.
SHAPE = {"heads": 28, "kv_heads": 4, "head_dim": 128, "rope_theta": 1e7}
DCA = {"chunk_size": 262144, "local_size": 8192, "original_max_position_embeddings": 262144}
LENGTHS = (32768, 131072, 262144, 524288, 1048576)
PATHS = ("seed", "dense", "dash-trt", "torch")
#: tokens per KV block of the dash-trt path's paged cache (its gcd with the chunk length c)
KV_BLOCK = 64
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


# ---------------------------------------------------------------------------- RoPE
def rope(x: torch.Tensor, pos: torch.Tensor, theta: float, rows: int = 65536) -> torch.Tensor:
    """Neox-style RoPE of x [N, H, D] at positions pos [N] (angles in float64, as the
    reference), in x's dtype; ``rows`` at a time, so a million tokens need no float32 copy."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64, device=x.device) / d))
    out = torch.empty_like(x)
    for r0 in range(0, x.shape[0], rows):
        ang = pos[r0 : r0 + rows].to(torch.float64)[:, None] * inv[None, :]
        cos, sin = ang.cos().float()[:, None, :], ang.sin().float()[:, None, :]
        xf = x[r0 : r0 + rows].float()
        x1, x2 = xf[..., : d // 2], xf[..., d // 2 :]
        out[r0 : r0 + rows] = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out


# ------------------------------------------------------------------- one attention call
def flash(q, k, v, causal: bool, scale: float):
    """(out, lse) of q [L, H, D] over k, v [S, H, D] (heads already matched): PyTorch's
    flash-attention operator (its CPU form on a CPU). out [L, H, D], lse [H, L] float32."""
    args = (q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], 0.0, causal)
    if q.is_cuda and q.dtype == torch.float32:  # the checks: flash takes only 16-bit inputs
        logits = torch.einsum("lhd,shd->hls", q, k) * scale
        if causal:
            logits = logits.masked_fill(torch.ones_like(logits[0], dtype=torch.bool).triu(1), float("-inf"))
        lse = torch.logsumexp(logits, dim=-1)
        return torch.einsum("hls,shd->lhd", torch.exp(logits - lse[..., None]), v), lse
    if q.is_cuda:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(*args, False, scale=scale)[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(*args, scale=scale)[:2]
    return out[0].transpose(0, 1), lse[0]


def matmul_attend(q, k, v, scale: float):
    """(out, lse) of one query, q [H, D] over k, v [Hkv, S, D] (grouped heads), by two batched
    matmuls in the inputs' dtype with the softmax in float32: out [H, D], lse [H]."""
    h, d = q.shape
    hkv = k.shape[0]
    logits = torch.matmul(q.reshape(hkv, h // hkv, d), k.transpose(1, 2)).float() * scale  # [Hkv, G, S]
    lse = torch.logsumexp(logits, dim=-1)
    out = torch.matmul(torch.exp(logits - lse[..., None]).to(v.dtype), v)  # [Hkv, G, D]
    return out.reshape(h, -1), lse.reshape(h)


def merge(parts):
    """Outputs of attention over disjoint key sets merged by their log-sum-exps (the
    brute-force approach's step after its three calls). parts: (out [..., H, D], lse
    broadcastable to out[..., 0])."""
    lse = torch.stack([p[1] for p in parts])
    top = lse.max(dim=0).values
    w = torch.exp(lse - top)
    total = w.sum(dim=0)
    out = sum(p[0].float() * (wi / total)[..., None] for p, wi in zip(parts, w))
    return out


# ---------------------------------------------------------------------------- the paths
class Layer:
    """The inputs of one layer: q, k, v [S, H(kv), D] unrotated, and the keys as each path
    caches them (rotated and scaled), in the layouts the calls take: repeated to H heads for
    the flash calls, [Hkv, S, D] for the decode matmuls. Each is made once, on first use,
    outside any timing."""

    def __init__(self, length: int, cfg: DcaConfig, shape: dict, dtype, device, seed: int = 0):
        g = torch.Generator(device=device).manual_seed(seed)  # on the device: a million tokens in moments
        h, hkv, d = shape["heads"], shape["kv_heads"], shape["head_dim"]
        self.cfg, self.theta, self.length, self.group = cfg, shape["rope_theta"], length, h // hkv
        self.q = torch.randn(length, h, d, generator=g, device=device, dtype=dtype)
        self.k = torch.randn(length, hkv, d, generator=g, device=device, dtype=dtype)
        self.v = torch.randn(length, hkv, d, generator=g, device=device, dtype=dtype)
        self.s = cfg.length_scale(length)
        self.scale = d**-0.5
        self._made: dict[str, torch.Tensor] = {}

    def keys(self, form: str) -> torch.Tensor:
        """``dca`` (at p mod c, times s(S)) or ``abs`` (at p) keys, ``v``; suffix ``/heads``:
        repeated to the query heads [S, H, D]; ``/decode``: [Hkv, S, D]."""
        if form not in self._made:
            base, _, layout = form.partition("/")
            pos = torch.arange(self.length, device=self.q.device)
            if base == "dca":
                t = (rope(self.k, self.cfg.positions(pos).key, self.theta).float() * self.s).to(self.k.dtype)
            else:
                t = rope(self.k, pos, self.theta) if base == "abs" else self.v
            if layout == "heads":
                t = t.repeat_interleave(self.group, dim=1)
            elif layout == "decode":
                t = t.permute(1, 0, 2).contiguous()
            self._made[form] = t
        return self._made[form]

    def paged(self, kind: str) -> tuple:
        """The dash-trt path's inputs: a paged cache of blocks of :data:`KV_BLOCK` tokens (for
        decode already holding every key but the last, rotated and scaled as the kernels write
        them) and the batch metadata of one sequence whose prompt is the whole layer."""
        if ("paged", kind) not in self._made:
            dev, s = self.q.device, self.length
            bsz = math.gcd(KV_BLOCK, self.cfg.chunk_len)
            blocks = -(-s // bsz)
            cache = DcaKVCache.allocate(blocks, bsz, self.k.shape[1], self.k.shape[2], self.k.dtype, dev)
            if kind == "decode":
                flat = s - 1
                cache.key.view(-1, *self.k.shape[1:])[:flat] = self.keys("dca")[:flat]
                cache.value.view(-1, *self.v.shape[1:])[:flat] = self.v[:flat]
            tables = torch.arange(blocks, device=dev, dtype=torch.int32)[None]
            new = s if kind == "prefill" else 1
            meta = (
                tables,
                torch.tensor([s], device=dev, dtype=torch.int32),
                torch.tensor([0, new], device=dev, dtype=torch.int32),
                torch.tensor([s], device=dev, dtype=torch.int32),
            )
            self._made[("paged", kind)] = (cache, *meta)
        return self._made[("paged", kind)]

    def prepare(self, kind: str, path: str) -> None:
        layout = "heads" if kind == "prefill" else "decode"
        for base in {"seed": ("dca", "v"), "dense": ("abs", "v")}.get(path, ()):
            self.keys(f"{base}/{layout}")
        if path == "dash-trt":
            self.paged(kind)


def seed_prefill(x: Layer):
    """The brute-force DCA prefill: per query chunk, three flash calls and a merge."""
    cfg, c, n = x.cfg, x.cfg.chunk_len, x.length
    k, v = x.keys("dca/heads"), x.keys("v/heads")
    sc = x.scale * x.s
    out = torch.empty(x.q.shape, dtype=x.q.dtype, device=x.q.device)
    for j0 in range(0, n, c):
        j1 = min(n, j0 + c)
        pos = cfg.positions(torch.arange(j0, j1, device=x.q.device))
        q = x.q[j0:j1]
        parts = [flash(rope(q, pos.intra, x.theta), k[j0:j1], v[j0:j1], True, sc)]
        if j0 >= c:
            parts.append(flash(rope(q, pos.successive, x.theta), k[j0 - c : j0], v[j0 - c : j0], False, sc))
        if j0 >= 2 * c:
            parts.append(flash(rope(q, pos.inter, x.theta), k[: j0 - c], v[: j0 - c], False, sc))
        parts = [(o, lse.transpose(0, 1)) for o, lse in parts]  # lse [L, H]
        out[j0:j1] = merge(parts).to(out.dtype) if len(parts) > 1 else parts[0][0]
    return out


def dense_prefill(x: Layer):
    """Standard RoPE at absolute positions, one causal flash call."""
    q = rope(x.q, torch.arange(x.length, device=x.q.device), x.theta)
    return flash(q, x.keys("abs/heads"), x.keys("v/heads"), True, x.scale)[0]


def torch_prefill(x: Layer):
    c = x.cfg
    return dual_chunk_attention(
        x.q, x.k, x.v, chunk_size=c.chunk_size, local_size=c.local_size, rope_theta=x.theta,
        original_max_position_embeddings=c.original_max_position_embeddings or None,
    )  # fmt: skip


def seed_decode(x: Layer):
    """The brute-force DCA decode of the last position: attention over the current, the
    previous and the earlier chunks, each with its query rotation, merged."""
    cfg, c, n = x.cfg, x.cfg.chunk_len, x.length
    j0 = (n - 1) // c * c
    pos = cfg.positions(torch.tensor([n - 1], device=x.q.device))
    q1 = x.q[n - 1 :]
    k, v = x.keys("dca/decode"), x.keys("v/decode")
    sc = x.scale * x.s
    regions = [(pos.intra, j0, n)]
    if j0 >= c:
        regions.append((pos.successive, j0 - c, j0))
    if j0 >= 2 * c:
        regions.append((pos.inter, 0, j0 - c))
    parts = [matmul_attend(rope(q1, p, x.theta)[0], k[:, a:b], v[:, a:b], sc) for p, a, b in regions]
    return merge(parts) if len(parts) > 1 else parts[0][0]


def dense_decode(x: Layer):
    q = rope(x.q[x.length - 1 :], torch.tensor([x.length - 1], device=x.q.device), x.theta)[0]
    return matmul_attend(q, x.keys("abs/decode"), x.keys("v/decode"), x.scale)[0]


def torch_decode(x: Layer):
    c = x.cfg
    return dual_chunk_attention(
        x.q[x.length - 1 :], x.k, x.v, chunk_size=c.chunk_size, local_size=c.local_size, rope_theta=x.theta,
        original_max_position_embeddings=c.original_max_position_embeddings or None,
    )[0]  # fmt: skip


def _kernels(x: Layer, kind: str, splits: int):
    cache, tables, seq_lens, qsl, prompts = x.paged(kind)
    rows = slice(0, x.length) if kind == "prefill" else slice(x.length - 1, x.length)
    out = kernels.paged_dca(
        x.q[rows], x.k[rows], x.v[rows], cache, tables, seq_lens, qsl, x.cfg, rope_theta=x.theta,
        prompt_lens=prompts, decode=kind == "decode", splits=splits, check=False,
    )  # fmt: skip
    return out if kind == "prefill" else out[0]


def kernels_prefill(x: Layer):
    """dash-trt's DCA kernels (:mod:`dash_trt.attention.dca.kernels`): the whole prompt as one
    prefill chunk over a paged cache; the call writes the keys (rotated, scaled) and values."""
    return _kernels(x, "prefill", 1)


def kernels_decode(x: Layer):
    """dash-trt's DCA kernels, one decode token (the call writes its key and value), the keys
    split across the GPU (:func:`dash_trt.attention.dca.kernels.decode_splits`)."""
    sms = torch.cuda.get_device_properties(x.q.device).multi_processor_count if x.q.is_cuda else 4
    return _kernels(x, "decode", kernels.decode_splits(1, x.k.shape[1], x.length, sms=sms))


PREFILL = {"seed": seed_prefill, "dense": dense_prefill, "dash-trt": kernels_prefill, "torch": torch_prefill}
DECODE = {"seed": seed_decode, "dense": dense_decode, "dash-trt": kernels_decode, "torch": torch_decode}


# ----------------------------------------------------------------------------- checks
def check(device, tol: float = 1e-4) -> dict:
    """``seed`` against the reference with four chunks (prefill and decode), ``dense``
    against DCA with a single chunk (standard RoPE attention), float32, small sizes. Returns
    the max abs errors; raises AssertionError past ``tol``."""
    shape = {"heads": 4, "kv_heads": 2, "head_dim": 16, "rope_theta": 1e4}
    errs = {}
    many = Layer(96, DcaConfig(32, 8, 64), shape, torch.float32, device, seed=1)  # c = 24: 4 chunks, s(96) > 1
    ref = torch_prefill(many)
    errs["seed prefill"] = (seed_prefill(many).float() - ref.float()).abs().max().item()
    errs["seed decode"] = (seed_decode(many).float() - ref[-1].float()).abs().max().item()
    if kernels.available():
        errs["dash-trt prefill"] = (kernels_prefill(many).float() - ref.float()).abs().max().item()
        errs["dash-trt decode"] = (kernels_decode(many).float() - ref[-1].float()).abs().max().item()
    one = Layer(40, DcaConfig(64, 8), shape, torch.float32, device, seed=2)  # c = 56 > 40: one chunk
    ref1 = torch_prefill(one)
    errs["dense prefill"] = (dense_prefill(one).float() - ref1.float()).abs().max().item()
    errs["dense decode"] = (dense_decode(one).float() - ref1[-1].float()).abs().max().item()
    bad = {k: e for k, e in errs.items() if not e <= tol}
    assert not bad, f"paths disagree with dash-trt's reference (max abs error > {tol}): {bad}"
    return errs


# ----------------------------------------------------------------------------- timing
def time_ms(fn, device, reps: int) -> float:
    """Per-call time of ``reps`` calls after one warm-up (CUDA events on a GPU)."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / reps
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) * 1e3 / reps


def prefill_flops(x: Layer) -> float:
    """Causal attention FLOPs of the layer (QK^T and PV, half the square)."""
    return 2 * 2 * x.q.shape[1] * x.q.shape[2] * x.length * (x.length + 1) / 2


def run_case(kind: str, x: Layer, paths, a, device) -> dict:
    row = {"kind": kind, "length": x.length, "chunks": math.ceil(x.length / x.cfg.chunk_len), "paths": {}}
    for name in paths:
        if name == "torch" and x.length > a.torch_max:
            row["paths"][name] = {"skipped": f"longer than --torch-max {a.torch_max}"}
            continue
        if name == "dash-trt" and not kernels.available():
            row["paths"][name] = {"skipped": "no Triton (pip install triton)"}
            continue
        fn = (lambda n=name: PREFILL[n](x)) if kind == "prefill" else (lambda n=name: DECODE[n](x))
        try:
            x.prepare(kind, name)
            times = [time_ms(fn, device, a.reps) for _ in range(a.rounds)]
        except torch.OutOfMemoryError as exc:
            row["paths"][name] = {"skipped": f"out of memory: {str(exc).splitlines()[0]}"}
            torch.cuda.empty_cache()
            continue
        r = {"ms": stats(times)}
        if kind == "prefill":
            r["tflops"] = prefill_flops(x) / (r["ms"]["median"] * 1e-3) / 1e12
        else:
            r["tokens_per_s"] = 1e3 / r["ms"]["median"]
        row["paths"][name] = r
    seed, dense = row["paths"].get("seed", {}), row["paths"].get("dense", {})
    if "ms" in seed and "ms" in dense:
        row["seed_over_dense"] = seed["ms"]["median"] / dense["ms"]["median"]
    mine = row["paths"].get("dash-trt", {})
    if "ms" in mine and "ms" in seed:
        row["seed_over_dash_trt"] = seed["ms"]["median"] / mine["ms"]["median"]
    if "ms" in mine and "ms" in dense:
        row["dash_trt_over_dense"] = mine["ms"]["median"] / dense["ms"]["median"]
    return row


# ----------------------------------------------------------------------------- output
def table(rows, out=sys.stdout) -> None:
    for kind in ("prefill", "decode"):
        sel = [r for r in rows if r["kind"] == kind]
        if not sel:
            continue
        names = list(sel[0]["paths"])
        ratios = (("seed_over_dense", "seed / dense"), ("seed_over_dash_trt", "seed / dash-trt"),
                  ("dash_trt_over_dense", "dash-trt / dense"))  # fmt: skip
        print(f"\n{kind} (ms per layer call, median [q1-q3]; time ratios)", file=out)
        print("| tokens | chunks | " + " | ".join(names + [h for _, h in ratios]) + " |", file=out)
        print("|---:|---:|" + "---:|" * (len(names) + len(ratios)), file=out)
        for r in sel:
            cells = []
            for n in names:
                p = r["paths"][n]
                cells.append(
                    p["skipped"]
                    if "skipped" in p
                    else f"{p['ms']['median']:.3f} [{p['ms']['q1']:.3f}-{p['ms']['q3']:.3f}]"
                )
            cells += [f"{r[k]:.2f}x" if k in r else "-" for k, _ in ratios]
            print(f"| {r['length']:,} | {r['chunks']} | " + " | ".join(cells) + " |", file=out)


def draw(rows, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, kind in zip(axes, ("prefill", "decode")):
        sel = [r for r in rows if r["kind"] == kind]
        for name in PATHS:
            pts = [(r["length"], r["paths"][name]["ms"]["median"]) for r in sel if "ms" in r["paths"].get(name, {})]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens")
        ax.set_ylabel("ms per layer call")
        ax.set_title(kind)
        ax.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def environment(device) -> dict:
    if device.type == "cuda":
        from bench_dash import provenance

        return provenance()
    from bench_dash import _git

    return {
        "device": "cpu",
        "torch": torch.__version__,
        "commit": os.environ.get("DASH_COMMIT") or _git("rev-parse", "--short", "HEAD") or "unknown",
    }


# ----------------------------------------------------------------------------- main
def parse(argv):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (toy sizes only)")
    p.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="comma-separated token counts")
    p.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, of {', '.join(PATHS)}")
    p.add_argument("--modes", default="prefill,decode")
    p.add_argument("--heads", type=int, default=SHAPE["heads"])
    p.add_argument("--kv-heads", type=int, default=SHAPE["kv_heads"])
    p.add_argument("--head-dim", type=int, default=SHAPE["head_dim"])
    p.add_argument("--rope-theta", type=float, default=SHAPE["rope_theta"])
    p.add_argument("--chunk-size", type=int, default=DCA["chunk_size"])
    p.add_argument("--local-size", type=int, default=DCA["local_size"])
    p.add_argument("--original-max-position-embeddings", type=int, default=DCA["original_max_position_embeddings"])
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--reps", type=int, default=3, help="timed calls per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--torch-max", type=int, default=32768, help="longest length the float32 reference is timed at")
    p.add_argument("--time-budget", type=float, default=0, help="seconds; cases left after it are skipped (0: none)")
    p.add_argument("--json")
    p.add_argument("--png")
    a = p.parse_args(argv)
    try:
        a.lengths = [int(s) for s in a.lengths.split(",") if s]
        a.paths = [s for s in a.paths.split(",") if s]
        a.modes = [s for s in a.modes.split(",") if s]
        a.cfg = DcaConfig(a.chunk_size, a.local_size, a.original_max_position_embeddings)
    except ValueError as exc:
        p.error(str(exc))
    bad = [s for s in a.paths if s not in PATHS] + [m for m in a.modes if m not in ("prefill", "decode")]
    if bad or not a.lengths or min(a.lengths) < 1 or a.heads % a.kv_heads or min(a.reps, a.rounds) < 1:
        p.error(f"bad --paths/--modes ({bad}), --lengths, --heads/--kv-heads or counts")
    return a


def main(argv=None) -> int:
    a = parse(argv)
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu for the smoke test", file=sys.stderr)
        return 2
    shape = {"heads": a.heads, "kv_heads": a.kv_heads, "head_dim": a.head_dim, "rope_theta": a.rope_theta}
    env = environment(device)
    errs = check(device)
    print(f"{env['device']} @ {env['commit']}: paths equal dash-trt's reference (max abs err {max(errs.values()):.1e})")
    t0, rows, skipped = time.monotonic(), [], []
    for n in a.lengths:
        if a.time_budget and time.monotonic() - t0 > a.time_budget:
            skipped.append(f"{n}")
            continue
        x = Layer(n, a.cfg, shape, DTYPES[a.dtype], device)
        for kind in a.modes:
            if a.time_budget and time.monotonic() - t0 > a.time_budget:
                skipped.append(f"{kind} {n}")
                continue
            rows.append(run_case(kind, x, a.paths, a, device))
            print(
                f"  {kind} {n:,}: "
                + ", ".join(f"{k} {v['ms']['median']:.3f} ms" for k, v in rows[-1]["paths"].items() if "ms" in v),
                flush=True,
            )
        del x
        if device.type == "cuda":
            torch.cuda.empty_cache()
    table(rows)
    if skipped:
        print(f"\nskipped past --time-budget {a.time_budget:g} s: {skipped}")
    result = {"env": env, "check": errs, "shape": shape, "dca": dataclasses.asdict(a.cfg),
              "dtype": a.dtype, "rows": rows, "skipped": skipped}  # fmt: skip
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(result, fh, indent=1, default=str)
    if a.png:
        title = f"DCA layer, {a.heads}/{a.kv_heads} heads x {a.head_dim}, chunk {a.chunk_size}, local {a.local_size}"
        draw(rows, a.png, f"{title}, {a.dtype}: {env['device']} @ {env['commit']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
