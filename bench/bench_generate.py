"""End to end: the serving runtime against a dense peer on the same weights, on one GPU.

Model: export/configs/benchmark.json (hidden 4096, 32 heads, 8 KV heads of 128, indexer 128,
sparse blocks of 64, top-16, one local block) with ``--layers`` decoder layers (default 8),
bf16, random weights built on the GPU. Cases (``--cases``, default ``32x32768,8x131072``):
B document prompts of L tokens each (pages of 1023 image tokens and a question), greedy, no
EOS stop; ``--new-tokens`` (32) decode steps of the whole batch are measured.

- **DASH, the serving path**: :class:`dash_trt.serving.engine.GenerationEngine`'s step loop
  (the Triton service's engine) over one paged pool of KV blocks of 64 tokens: prefill in
  chunks of ``--prefill-chunk`` tokens (one step each, with the decode tokens of the
  sequences already prefilled: continuous batching), decode steps replayed from the
  runtime's CUDA graphs. Every step reads its tokens back to the host, as serving does.
  Requests ask for as many extra tokens as there are prefill steps, so that after the last
  prefill the whole batch decodes together for ``--new-tokens`` steps: those are measured.
- **Dense peer**: the same modules with causal SDPA (the flash backend, pinned: the run
  fails rather than fall back) over a contiguous cache [B, Hkv, L, D]: each prompt prefilled
  in one call (KV heads repeated), every decode step one CUDA graph (one per context
  length, all sequences at the same length), its tokens read back each step too.

The DASH path runs without the prefix cache here (the dense peer has none, and these prompts
share their pages); ``--prefix-questions N`` measures the cache instead: N questions over one
document of ``--prefix-length`` tokens (default 65536), the first alone, then the others
together, with and without the cache (same tokens checked).

Both paths first run one prefill of a whole chunk (the first calls at those sizes) and are
then measured. Reported per case and path: time to first token (mean over the B requests,
and the last one, which is the whole batch's prefill), decode ms/step (median of the decode steps' wall
times), decode tokens/s (B / that), and the GPU time of one captured decode step (median of
20 replays timed with CUDA events); for DASH also the ratio of the step's wall time to its
GPU time. Writes a markdown table, JSON (``--json``) and a PNG (``--png``: decode tokens/s
and time to first token against context length, DASH beside dense). ``--device cpu
--quick`` smoke-tests the script on a CPU (no graphs). Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from dash_trt import model as M  # noqa: E402
from dash_trt.attention.dash.paged import PageCoordState, sequence_coords  # noqa: E402
from dash_trt.attention.dash.reference import ROLE_PAGE, ROLE_TEXT, page_rope  # noqa: E402
from dash_trt.serving.engine import EngineConfig, GenerationEngine  # noqa: E402

CONFIG = os.path.join(os.path.dirname(__file__), "..", "export", "configs", "benchmark.json")
KV_BLOCK = 64
IMAGES_PER_PAGE = 1023


def document(length: int, cfg, question: str = "What is the total on the last page?") -> list[int]:
    """A prompt of exactly ``length`` tokens: pages of <PAGE> + 1023 image tokens, a question."""
    q = M.tokenize(question, cfg)
    body = length - len(q)
    pages = [IMAGES_PER_PAGE] * (body // (IMAGES_PER_PAGE + 1))
    rest = body - len(pages) * (IMAGES_PER_PAGE + 1)
    if rest > 1:
        pages.append(rest - 1)
    ids = M.document_prompt(pages, "", cfg)
    ids += [ord(" ")] * (body - len(ids)) + q
    assert len(ids) == length, (len(ids), length)
    return ids


class Clock:
    """Wall clock that waits for the device first (CUDA), and CUDA-event timing of a call."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def gpu_ms(self, fn, iters: int = 20) -> float:
        if not self.cuda:
            return statistics.median(self._wall(fn) for _ in range(iters))
        fn()  # warm-up
        torch.cuda.synchronize()
        times = []
        for _ in range(iters):  # each call alone between CUDA events, the median of them
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        return statistics.median(times)

    def _wall(self, fn) -> float:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3


# ------------------------------------------------------------------ the DASH serving path
def run_dash(model, prompts, new_tokens: int, chunk: int, clock: Clock, prefix_caching: bool = False) -> dict:
    b, length = len(prompts), len(prompts[0])
    # The engine decodes the sequences prefilled first while it prefills the others
    # (continuous batching), so each request asks for as many more tokens as there are prefill
    # steps: after the last prefill, the whole batch decodes together for new_tokens steps,
    # which are the decode steps measured.
    max_new = new_tokens + -(-b * length // chunk) + 2
    reserve = length + max_new - 1
    blocks = b * -(-reserve // KV_BLOCK) + 1
    engine = GenerationEngine(
        model,
        EngineConfig(
            num_blocks=blocks,
            kv_block_size=KV_BLOCK,
            prefill_chunk=chunk,
            max_batch_tokens=chunk,
            max_num_seqs=b,
            max_model_len=reserve,
            default_max_new_tokens=max_new,
            max_new_tokens_limit=max_new,
            prefix_caching=prefix_caching,
        ),
    )
    engine.warmup()  # the op's first call, the decode graphs' capture
    # ... and one prefill step of a whole chunk (cuBLAS' first calls at that size), so the
    # figures are the steady state; the dense peer warms up the same way.
    engine.generate([document(min(chunk, length), model.config)], 1, stop_at_eos=False)
    engine.reset_counters()
    rt = engine.runtime
    t0 = clock.now()
    reqs = [engine.submit(p, max_new, stop_at_eos=False) for p in prompts]
    decode_walls, other_steps = [], 0  # other: prefill, mixed, and decode steps of part of the batch
    while True:
        seqs = rt.sequences()
        decoding = len(seqs) == b and all(s.fed >= s.prompt_len for s in seqs)
        a = time.perf_counter()
        if not engine.step():
            break
        wall = time.perf_counter() - a  # the step read its tokens back: the device is done
        if decoding:
            decode_walls.append(wall)
        else:
            other_steps += 1
    total = clock.now() - t0
    ttft = [r.t_first_token - t0 for r in reqs]
    st = rt._static[rt._bucket(b)] if rt.cuda_graphs else None
    gpu = clock.gpu_ms(st.graph.replay) if st is not None else float("nan")
    step_ms = statistics.median(decode_walls) * 1e3 if decode_walls else float("nan")
    out = {
        "ttft_mean_s": statistics.mean(ttft),
        "ttft_last_s": max(ttft),
        "decode_ms": step_ms,
        "decode_ms_min": min(decode_walls) * 1e3 if decode_walls else float("nan"),
        "decode_tok_s": b / step_ms * 1e3,
        "graph_gpu_ms": gpu,
        "wall_over_gpu": step_ms / gpu,
        "decode_steps": len(decode_walls),
        "other_steps": other_steps,
        "total_s": total,
        "tokens": [r.result(0) for r in reqs],
        "pool_blocks": blocks,
    }
    del engine, rt, st
    return out


def run_prefix(
    model, length: int, questions: int, new_tokens: int, chunk: int, clock: Clock, prefix_caching: bool
) -> dict:
    """One document of ``length`` tokens asked ``questions`` questions through the engine: the
    first question alone (the document read once), then the others submitted together. Times
    to first token and the total, with the prefix cache on or off."""
    cfg = model.config
    base = document(length, cfg, "")[:-1]  # the pages (the question follows)
    prompts = [
        base + M.tokenize(f" Question {i}: what is the total on page {i % 7 + 1}?", cfg) for i in range(questions)
    ]
    longest = max(map(len, prompts))
    reserve = longest + new_tokens - 1
    blocks = questions * -(-reserve // KV_BLOCK) + 1
    engine = GenerationEngine(
        model,
        EngineConfig(
            num_blocks=blocks,
            kv_block_size=KV_BLOCK,
            prefill_chunk=chunk,
            max_batch_tokens=chunk,
            max_num_seqs=questions,
            max_model_len=reserve,
            default_max_new_tokens=new_tokens,
            max_new_tokens_limit=new_tokens,
            prefix_caching=prefix_caching,
        ),
    )
    engine.warmup()
    engine.generate([document(min(chunk, length), cfg, "Warm-up?")], 1, stop_at_eos=False)
    engine.scheduler.pool.clear_cache()  # the warm-up's blocks are not the document's
    engine.reset_counters()
    t0 = clock.now()
    first = engine.submit(prompts[0], new_tokens, stop_at_eos=False)
    engine.run_until_idle()
    t1 = clock.now()
    rest = [engine.submit(p, new_tokens, stop_at_eos=False) for p in prompts[1:]]
    engine.run_until_idle()
    total = clock.now() - t0
    stats = engine.stats()
    out = {
        "ttft_first_s": first.t_first_token - t0,
        "first_total_s": t1 - t0,
        "ttft_rest_mean_s": statistics.mean(r.t_first_token - t1 for r in rest),
        "ttft_rest_max_s": max(r.t_first_token - t1 for r in rest),
        "total_s": total,
        "rest_total_s": total - (t1 - t0),
        "prompt_tokens_computed": stats["prompt_tokens_computed"],
        "prompt_tokens_cached": stats["prompt_tokens_cached"],
        "prompt_tokens": sum(map(len, prompts)),
        "tokens": [first.result(0)] + [r.result(0) for r in rest],
    }
    del engine
    return out


# ------------------------------------------------------------------------- the dense peer
class DensePeer:
    """The model's own modules with dense causal attention over a contiguous cache."""

    def __init__(self, model, batch: int, max_len: int, backend):
        c = model.config
        self.model, self.cfg, self.backend = model, c, backend
        shape = (batch, c.num_key_value_heads, max_len, c.head_dim)
        dev, dt = model.device, model.dtype
        self.k = [torch.empty(shape, dtype=dt, device=dev) for _ in model.layers]
        self.v = [torch.empty(shape, dtype=dt, device=dev) for _ in model.layers]
        self.group = c.num_attention_heads // c.num_key_value_heads

    def _sdpa(self, q, k, v, causal):
        if self.backend is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        from torch.nn.attention import sdpa_kernel

        with sdpa_kernel(self.backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def _layer(self, layer, x, tok, page, attend):
        a = layer.self_attn
        h = layer.input_layernorm(x)
        q, k, v, _, _ = a.project(h)
        q = page_rope(q, tok, page, self.cfg.dash, main=True)
        k = page_rope(k, tok, page, self.cfg.dash, main=True)
        o = attend(q, k, v)
        x = x + a.o_proj(o.reshape(x.shape[0], -1))
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def prefill(self, row: int, ids: torch.Tensor, coords: torch.Tensor) -> torch.Tensor:
        """One whole prompt (sequence ``row``); returns the last token's logits [1, V]."""
        s = ids.shape[0]
        tok, page = coords[:, 0].long(), coords[:, 1].long()
        x = self.model.embed_tokens(ids)
        for i, layer in enumerate(self.model.layers):

            def attend(q, k, v, i=i):
                self.k[i][row, :, :s] = k.transpose(0, 1)
                self.v[i][row, :, :s] = v.transpose(0, 1)
                kk = k.transpose(0, 1).repeat_interleave(self.group, 0)[None]
                vv = v.transpose(0, 1).repeat_interleave(self.group, 0)[None]
                return self._sdpa(q.transpose(0, 1)[None], kk, vv, True)[0].transpose(0, 1)

            x = self._layer(layer, x, tok, page, attend)
        return self.model.logits(x, torch.tensor([s - 1], device=x.device))

    def decode(self, ids: torch.Tensor, coords: torch.Tensor, pos: int) -> torch.Tensor:
        """One decode step of every sequence, each at position ``pos``; returns tokens [B]."""
        b = ids.shape[0]
        tok, page = coords[:, 0].long(), coords[:, 1].long()
        hkv, d = self.cfg.num_key_value_heads, self.cfg.head_dim
        x = self.model.embed_tokens(ids)
        for i, layer in enumerate(self.model.layers):

            def attend(q, k, v, i=i):
                self.k[i][:, :, pos] = k
                self.v[i][:, :, pos] = v
                qg = q.view(b, hkv, self.group, d)  # the G query heads of a KV head as G rows
                return self._sdpa(qg, self.k[i][:, :, : pos + 1], self.v[i][:, :, : pos + 1], False)

            x = self._layer(layer, x, tok, page, attend)
        logits = self.model.logits(x, torch.arange(b, device=x.device))
        return logits.argmax(-1)


def _next_coords(states, tokens, cfg, dev) -> torch.Tensor:
    rows = [st.next(ROLE_PAGE if t == cfg.page_token_id else ROLE_TEXT) for st, t in zip(states, tokens)]
    return torch.tensor(rows, dtype=torch.int32, device=dev)


def run_dense(model, prompts, new_tokens: int, clock: Clock, backend) -> dict:
    b, length = len(prompts), len(prompts[0])
    dev = model.device
    peer = DensePeer(model, b, length + new_tokens, backend)
    cfg = model.config
    roles = [M.token_roles(p, cfg) for p in prompts]
    firsts, ttft = [], []
    with torch.no_grad():
        # warm-up: one whole prefill (overwritten below), as the serving path warms up
        peer.prefill(0, torch.tensor(prompts[0], device=dev), sequence_coords(roles[0]).to(dev))
        t0 = clock.now()
        for row, p in enumerate(prompts):
            coords = sequence_coords(roles[row]).to(dev)
            logits = peer.prefill(row, torch.tensor(p, device=dev), coords)
            firsts.append(int(logits.argmax(-1)))  # read back, as the serving path does
            ttft.append(clock.now() - t0)
        # decode: all sequences at the same position; each keeps its page-coordinate state
        states = [PageCoordState.from_prompt(r)[0] for r in roles]
        ids = torch.tensor(firsts, device=dev)
        coords = _next_coords(states, firsts, cfg, dev)
        graphs, walls = {}, []
        cuda = dev.type == "cuda"
        static_ids, static_coords = ids.clone(), coords.clone()
        out_tokens = {}
        if cuda:  # capture every step's graph first (one per context length); warm-up once
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                peer.decode(static_ids, static_coords, length)
            torch.cuda.current_stream().wait_stream(s)
            for step in range(new_tokens - 1):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    out_tokens[step] = peer.decode(static_ids, static_coords, length + step)
                graphs[step] = g
        for step in range(new_tokens - 1):
            a = time.perf_counter()
            static_coords.copy_(coords)
            static_ids.copy_(ids)
            if cuda:
                graphs[step].replay()
                toks = out_tokens[step]
            else:
                toks = peer.decode(static_ids, static_coords, length + step)
            new = toks.tolist()  # the step's one read
            ids = toks.clone()
            coords = _next_coords(states, new, cfg, dev)
            walls.append(time.perf_counter() - a)
        gpu = clock.gpu_ms(graphs[0].replay) if cuda else float("nan")
    step_ms = statistics.median(walls) * 1e3
    del peer, graphs
    return {
        "ttft_mean_s": statistics.mean(ttft),
        "ttft_last_s": max(ttft),
        "decode_ms": step_ms,
        "decode_tok_s": b / step_ms * 1e3,
        "graph_gpu_ms": gpu,
        "decode_steps": len(walls),
    }


GEMM_NAMES = ("gemm", "nvjet", "xmma", "cutlass", "matmul")
DASH_NAMES = ("dash", "route", "attend", "summar", "write_kernel", "items_kernel", "combine", "bm_")


def profile_prefill(model, length: int) -> list[tuple[str, float]]:
    """GPU time of one serving prefill step of ``length`` tokens (one sequence), by kind of
    kernel: the projections' and MLP's GEMMs, the DASH attention kernels, the rest."""
    from dash_trt.serving.runner import PagedRuntime

    rt = PagedRuntime(
        model, -(-length // KV_BLOCK) + 2, KV_BLOCK, max_model_len=length, max_num_seqs=1, cuda_graphs=False
    )
    warm = document(1024, model.config)
    rt.add("warm", warm, len(warm))
    rt.step([("warm", len(warm))])
    rt.free("warm")
    prompt = document(length, model.config)
    rt.add(0, prompt, len(prompt))
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        rt.step([(0, len(prompt))])
        torch.cuda.synchronize()
    kinds = {
        "GEMM (projections, MLP, lm_head)": 0.0,
        "DASH attention kernels": 0.0,
        "other (norms, elementwise, copies)": 0.0,
    }
    names = list(kinds)
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        ms = (ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time) / 1e3
        low = ev.name.lower()
        key = (
            names[0]
            if any(k in low for k in GEMM_NAMES)
            else names[1]
            if any(k in low for k in DASH_NAMES)
            else names[2]
        )
        kinds[key] += ms
    return list(kinds.items())


def _plot(results: list[dict], path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: no plot"
    labels = [f"{r['batch']} x {r['length'] // 1024}k" for r in results]
    xs = range(len(results))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    w = 0.38
    for ax, key, title in (
        (a1, "decode_tok_s", "decode tokens/s (higher is better)"),
        (a2, "ttft_last_s", "time to first token of the batch, s (lower is better)"),
    ):
        d = [r["dash"][key] for r in results]
        n = [r["dense"][key] for r in results]
        ax.bar([x - w / 2 for x in xs], d, w, label="DASH (serving runtime)")
        ax.bar([x + w / 2 for x in xs], n, w, label="dense SDPA (flash)")
        for x, dv, nv in zip(xs, d, n):
            ax.annotate(
                f"{dv / nv:.2f}x" if key == "decode_tok_s" else f"{nv / dv:.2f}x",
                (x - w / 2, dv),
                ha="center",
                va="bottom",
                fontsize=9,
            )
        ax.set_xticks(list(xs), labels)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    fig.suptitle(results[0]["title"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return None


def bench_config(layers: int, dtype: str, *, quick: bool = False) -> dict:
    """The benchmark model's config.json: export/configs/benchmark.json with ``layers`` decoder
    layers (2 and a narrower model with ``quick``), DASH in every one of them."""
    with open(CONFIG, encoding="utf-8") as fh:
        conf = json.load(fh)
    conf["num_hidden_layers"] = layers
    conf["torch_dtype"] = dtype
    if quick:
        conf.update(num_hidden_layers=2, hidden_size=1024, intermediate_size=2048)
    # the per-layer list follows the layer count
    conf["sparse_attention_config"]["sparse_attention_freq"] = [1] * conf["num_hidden_layers"]
    return conf


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--cases", default=None, help="BxL, comma-separated (default 32x32768,8x131072)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prefill-chunk", type=int, default=32768, help="prompt tokens per serving step")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(M.DTYPES))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="2 layers, hidden 1024 (cases 4x4096 and 2x8192 unless given)")
    ap.add_argument("--no-dense", action="store_true")
    ap.add_argument(
        "--profile-prefill",
        type=int,
        metavar="TOKENS",
        help="only profile one serving prefill step of TOKENS tokens: GPU time by kind of kernel",
    )
    ap.add_argument(
        "--prefix-questions",
        type=int,
        metavar="N",
        help="only the prefix-cache case: N questions over one document of --prefix-length tokens, "
        "with and without the cache",
    )
    ap.add_argument("--prefix-length", type=int, default=65536)
    ap.add_argument("--json")
    ap.add_argument("--png")
    a = ap.parse_args()
    conf = bench_config(a.layers, a.dtype, quick=a.quick)
    spec = a.cases or ("4x4096,2x8192" if a.quick else "32x32768,8x131072")
    cases = [tuple(int(v) for v in c.split("x")) for c in spec.split(",")]
    dev = torch.device(a.device)
    model = M.random_model(conf, seed=0, dtype=M.DTYPES[a.dtype], device=dev)
    clock = Clock(dev)
    backend = None
    if dev.type == "cuda":
        from torch.nn.attention import SDPBackend

        backend = SDPBackend.FLASH_ATTENTION
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    commit = os.environ.get("DASH_COMMIT", "unknown")
    title = (
        f"{name}, torch {torch.__version__}, {a.layers if not a.quick else 2} layers, {a.dtype}, "
        f"{a.new_tokens} new tokens, commit {commit}"
    )
    print(f"# bench_generate: {title}; dense peer SDPA backend: {backend}", flush=True)
    if a.profile_prefill:
        rows = profile_prefill(model, a.profile_prefill)
        total = sum(ms for _, ms in rows)
        print(f"\none serving prefill step of {a.profile_prefill} tokens: {total:.1f} ms of kernels\n")
        print("| kernels | ms | share |\n| --- | ---: | ---: |")
        for name, ms in rows:
            print(f"| {name} | {ms:.1f} | {100 * ms / total:.0f}% |")
        return 0
    if a.prefix_questions:
        runs = {}
        for caching in (True, False):
            runs[caching] = run_prefix(
                model,
                a.prefix_length,
                a.prefix_questions,
                a.new_tokens,
                min(a.prefill_chunk, a.prefix_length),
                clock,
                caching,
            )
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        on, off = runs[True], runs[False]
        same = on.pop("tokens") == off.pop("tokens")
        print(
            f"\n{a.prefix_questions} questions over one {a.prefix_length}-token document ({a.new_tokens} new "
            f"tokens each): the first alone, then the other {a.prefix_questions - 1} together; same tokens with "
            f"and without the cache: {'yes' if same else 'NO'}\n"
        )
        print(
            "| prefix cache | TTFT first (s) | TTFT others mean (s) | TTFT others max (s) | others total (s) | "
            "total (s) | prompt tokens computed | cached |"
        )
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for label, r in (("on", on), ("off", off)):
            print(
                f"| {label} | {r['ttft_first_s']:.3f} | {r['ttft_rest_mean_s']:.3f} | {r['ttft_rest_max_s']:.3f} | "
                f"{r['rest_total_s']:.2f} | {r['total_s']:.2f} | {r['prompt_tokens_computed']} | "
                f"{r['prompt_tokens_cached']} |"
            )
        print(
            f"\nspeed-up with the cache: TTFT of the others {off['ttft_rest_mean_s'] / on['ttft_rest_mean_s']:.1f}x "
            f"(mean), {off['ttft_rest_max_s'] / on['ttft_rest_max_s']:.1f}x (max); "
            f"total {off['total_s'] / on['total_s']:.1f}x"
        )
        if a.json:
            with open(a.json, "w", encoding="utf-8") as fh:
                json.dump(
                    {"title": title, "commit": commit, "prefix": {"on": on, "off": off, "same_tokens": same}},
                    fh,
                    indent=1,
                )
        return 0 if same else 1
    results = []
    for b, length in cases:
        cfg = model.config
        prompts = [document(length, cfg, f"Question {i}: what is the total on page {i % 7 + 1}?") for i in range(b)]
        print(f"## {b} x {length}", flush=True)
        dash = run_dash(model, prompts, a.new_tokens, min(a.prefill_chunk, length), clock)
        print(
            f"  dash : ttft {dash['ttft_last_s']:.2f} s (mean {dash['ttft_mean_s']:.2f}), decode "
            f"{dash['decode_ms']:.3f} ms/step (graph GPU {dash['graph_gpu_ms']:.3f} ms, x{dash['wall_over_gpu']:.2f})",
            flush=True,
        )
        dense = None
        if not a.no_dense:
            torch.cuda.empty_cache() if dev.type == "cuda" else None
            dense = run_dense(model, prompts, a.new_tokens, clock, backend)
            print(
                f"  dense: ttft {dense['ttft_last_s']:.2f} s (mean {dense['ttft_mean_s']:.2f}), decode "
                f"{dense['decode_ms']:.3f} ms/step (graph GPU {dense['graph_gpu_ms']:.3f} ms)",
                flush=True,
            )
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        dash.pop("tokens")
        results.append({"batch": b, "length": length, "dash": dash, "dense": dense, "title": title})
    print()
    print(
        "| case | path | TTFT batch (s) | TTFT mean (s) | decode ms/step | decode tokens/s | captured step GPU ms |"
        " wall / GPU | decode speed-up | TTFT speed-up |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        d, n = r["dash"], r["dense"]
        case = f"{r['batch']} x {r['length'] // 1024}k"
        up = f"{d['decode_tok_s'] / n['decode_tok_s']:.2f}x" if n else "-"
        tt = f"{n['ttft_last_s'] / d['ttft_last_s']:.2f}x" if n else "-"
        print(
            f"| {case} | DASH serving | {d['ttft_last_s']:.2f} | {d['ttft_mean_s']:.2f} | {d['decode_ms']:.3f} | "
            f"{d['decode_tok_s']:.0f} | {d['graph_gpu_ms']:.3f} | {d['wall_over_gpu']:.2f} | {up} | {tt} |"
        )
        if n:
            print(
                f"| {case} | dense SDPA | {n['ttft_last_s']:.2f} | {n['ttft_mean_s']:.2f} | {n['decode_ms']:.3f} | "
                f"{n['decode_tok_s']:.0f} | {n['graph_gpu_ms']:.3f} | - | | |"
            )
    if a.json:
        with open(a.json, "w", encoding="utf-8") as fh:
            json.dump({"title": title, "commit": commit, "results": results}, fh, indent=1)
    if a.png and not a.no_dense:
        note = _plot(results, a.png)
        if note:
            print(note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
