"""Pages per second: Unlimited-OCR-2 at its published shape on one GPU, its attention computed
three ways on the same model, the same steps and the same driver.

Model (:func:`published_config`): the published decoder shape (DeepSeek-OCR's language model:
hidden 1280, 12 layers, 10 heads of 128, MoE with 64 routed + 2 shared experts of 896, 6 a
token, the first layer a dense MLP of 6848, vocab 129280) with DASH in every layer (blocks of
32, one local block, keep 12 of the top 16, index dim 128; vLLM's default R-SWA window, so
generated tokens read the prompt's blocks and the local window), random bf16 weights, built on
the GPU. The MoE runs as grouped GEMMs (``MoE.form``'s default on sm_90 bf16).

Documents: P pages of ``--page-tokens`` image tokens each (903: an A4 page, 1240 x 1754 px,
as the document processor cuts it: 2 x 3 tiles of 640 and the 1024 global view), then the
multi-page instruction; the answer is ``--answer-per-page`` tokens a page (1,000), EOS never
stops it. Image rows are embedded from the token table (the tower's features would cost one
gather more); the vision tower's own time is measured apart (:func:`bench_tower`, real views
through the batched tower) and added per page.

Attention paths (``--paths``):

- ``dash``: dash-trt's serving runtime (:class:`dash_trt.serving.runner.PagedRuntime`, the
  engine's step function) on the CUDA kernels, KV blocks of 64, decode steps replayed from its
  CUDA graphs;
- ``vllm``: vLLM 0.34.0's DASH ops from its wheel (``bench/vllm_peer.py``, ``--vllm``): its
  ``paged_dash_prefill`` per sequence chunk, its ``paged_dash_decode`` in a CUDA graph of the
  whole decode step (vLLM's default ``FULL_DECODE_ONLY`` graphs for this model), its own KV
  layout (blocks of 16), segments through vLLM's FlashAttention 3, or PyTorch's FlashAttention 2
  where vLLM's library does not load (the results name which);
- ``dense``: causal FlashAttention 2 (PyTorch's ``aten::_flash_attention_forward``, varlen,
  ``seqused_k``) over a contiguous cache per sequence, page RoPE applied as in DASH, decode in a
  CUDA graph (PyTorch's FA2 has no split-KV: at batch 1 a decode step runs on one block per head);
- ``dense-fa3``: the same over vLLM's FlashAttention 3 library (``--vllm``): the decode with a
  block table of 16-token pages and FA3's split-KV heuristic, as vLLM serves a dense model on
  Hopper; the prefill causal varlen. "vs best dense" takes the faster of the two.

The driver is the same for every path: the B documents of a case are added, prefilled in steps
of at most ``--prefill-chunk`` tokens (time to first token: when each document's first answer
token is read back), then the whole batch decodes, every step reading its tokens back. Per case
and path: TTFT, the decode step at the answer's start (median of ``--steps`` steps) and, with
``--answer-end``, at its end (the documents' prompts plus their whole answer prefilled as a
preempted request's recomputation, then ``--steps`` steps), decode tokens/s, the GPU memory the
path held, and pages/s: B x P pages over the tower's time for them, the prefill, and the answer's
decode steps (a full run with ``--full``; otherwise the steps at the answer's start and end,
linear between: DASH's step hardly grows with the answer, dense attention's grows linearly).

Also (``--parts``): the MoE layer alone (grouped GEMMs against the per-expert loop and the dense
form, batch 64 and a prefill chunk), the vision tower alone (pages/s at batch sizes), and the
share of one decode step's kernel time spent in attention, experts and the rest (profiler,
eager step, ``record_function`` ranges around each module).

``--device cpu --quick`` runs every path that can run on a CPU (dash through the PyTorch paged
operator; vllm only where Triton's interpreter is on, ``TRITON_INTERPRET=1``; dense through a
float32 loop) on a small model: a smoke test of the script, not a measurement. Writes a markdown
table, JSON (``--json``) and a PNG (``--png``). Not a test: nothing is asserted on timings; the
paths' answers are checked against each other on a short run first (``--check``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from dash_trt import model as M  # noqa: E402
from dash_trt.attention.dash.reference import page_rope  # noqa: E402
from dash_trt.modeling import PAGED, DashContext, prompt_coordinates, token_roles  # noqa: E402
from dash_trt.models import unlimited_ocr2 as U  # noqa: E402
from dash_trt.serving.runner import PagedRuntime, greedy_tokens  # noqa: E402

KV_BLOCK = 64
PAGE_TOKENS = 903
INSTRUCTION = "Multi page parsing."


# ------------------------------------------------------------------------------ the model
def published_config(layers: int = 12, *, quick: bool = False) -> dict:
    """The published shape's config.json (module docstring) with random-weight-friendly token
    ids; ``quick``: the same layout at toy sizes (head dim 64, 8 experts), for the CPU."""
    if quick:
        lang = dict(hidden_size=256, heads=4, experts=8, experts_per_token=2, shared_experts=2, vocab_size=512)
        conf = U.tiny_config(2, **lang, overrides={"moe_intermediate_size": 64, "intermediate_size": 512})
        sp = conf["sparse_attention_config"]
        sp.update(sparse_block_size=32, dash_topk_blocks=12, sparse_index_dim=64)
        conf["rswa_window"] = 32  # the local window, set (vLLM reads unset as 128)
        return conf
    conf = U.tiny_config(
        layers,
        hidden_size=1280,
        heads=10,
        experts=64,
        experts_per_token=6,
        shared_experts=2,
        vocab_size=129280,
        overrides={
            "intermediate_size": 6848,
            "moe_intermediate_size": 896,
            "max_position_embeddings": 32768,
            "torch_dtype": "bfloat16",
        },
    )
    conf["torch_dtype"] = "bfloat16"
    conf["vision_config"] = {}  # the published tower (DeepEncoder's defaults)
    conf["projector_config"] = {"projector_type": "linear", "input_dim": 2048, "n_embed": 1280}
    conf["candidate_resolutions"] = [[1024, 1024]]
    sp = conf["sparse_attention_config"]
    sp.update(
        sparse_block_size=32,
        sparse_local_block=1,
        sparse_index_dim=128,
        dash_topk_blocks=12,
        dash_scale_per_layer=[32.0] * layers,
        dash_floor_per_layer=[1e-4] * layers,
        sparse_attention_freq=[1] * layers,
        page_token_id=128816,
        image_token_id=128815,
    )
    conf["rswa_window"] = 32  # vLLM's R-SWA: the local window, set (vLLM reads unset as 128)
    return conf


def document(pages: int, page_tokens: int, cfg) -> list[int]:
    """BOS, ``pages`` x (``<PAGE>``, ``page_tokens`` image tokens), the multi-page instruction."""
    return [0] + M.document_prompt([page_tokens] * pages, INSTRUCTION, cfg)  # id 0: DeepSeek's BOS


def answer(pages: int, per_page: int, cfg, seed: int) -> list[int]:
    """A stand-in answer: each page's section a ``<PAGE>`` marker and text tokens (what the
    model emits; random ids, for the recomputed-answer measurement)."""
    g = np.random.default_rng(seed)
    out: list[int] = []
    for _ in range(pages):
        out.append(cfg.page_token_id)
        out += [int(t) for t in g.integers(32, 127, per_page - 1)]
    return out


# ------------------------------------------------------------------------------ timing
class Clock:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


def _memory_reset(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_gib(dev) -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else float("nan")


# ------------------------------------------------------------------------------ the paths
class DashPath:
    """dash-trt's serving runtime (module docstring)."""

    name = "dash"

    def __init__(self, model, batch: int, max_len: int, chunk: int):
        blocks = batch * -(-max_len // KV_BLOCK) + 1
        self.rt = PagedRuntime(
            model,
            blocks,
            KV_BLOCK,
            max_model_len=max_len,
            max_num_seqs=batch,
            graph_batch_sizes=[batch],
        )
        self.chunk = chunk
        self.rt.capture_decode_graphs()  # before the clock (the serving engine does it at warm-up)
        self.segments = "dash-trt kernels" if self.rt.kernels else f"PyTorch paged operator ({self.rt.kernels_reason})"

    def add(self, seq: int, prompt: list[int], forced: list[int], reserve: int) -> None:
        self.rt.add(seq, prompt, reserve)
        if forced:
            self.rt.append_tokens(seq, forced)

    def step(self, plan: list[tuple[int, int]]) -> dict[int, int]:
        return self.rt.step(plan).tokens

    def pending(self, seq: int) -> int:
        return self.rt.seq(seq).pending

    def free(self, seq: int) -> None:
        self.rt.free(seq)

    def cache_gib(self) -> float:
        return sum(t.numel() * t.element_size() for t in self.rt.tensors()) / 2**30


class _PeerContext(DashContext):
    def __init__(self, num_layers: int, attend):
        super().__init__(PAGED, num_layers)
        self._attend = attend

    def attend(self, module, q, k, v, iq, ik, head_cls):
        self.called[module.layer_idx] = True
        return self._attend(module, q, k, v, iq, ik, head_cls)


class PeerPath:
    """The driver of the two peers: sequences' tokens and coordinates on the host, prefill
    chunks run eagerly, decode steps of the whole batch replayed from one CUDA graph (eager on
    a CPU). Subclasses implement ``prefill_attend`` and ``decode_attend``."""

    def __init__(self, model, batch: int, max_len: int, chunk: int):
        self.model, self.cfg = model, model.config
        self.batch, self.max_len, self.chunk = batch, max_len, chunk
        self.dev = model.device
        self.seqs: dict[int, dict] = {}
        self.graph = None
        self._tokens = None
        pin = self.dev.type == "cuda"
        self.h_ids = torch.zeros(batch, dtype=torch.int64, pin_memory=pin)
        self.h_coords = torch.zeros(batch, 4, dtype=torch.int32, pin_memory=pin)
        self.h_lens = torch.ones(batch, dtype=torch.int32, pin_memory=pin)
        self.h_prompt = torch.ones(batch, dtype=torch.int32, pin_memory=pin)
        self.ids = self.h_ids.to(self.dev)
        self.coords = self.h_coords.to(self.dev)
        self.lens = self.h_lens.to(self.dev)
        self.prompt_lens = self.h_prompt.to(self.dev)

    # sequences ---------------------------------------------------------------------------
    def add(self, seq: int, prompt: list[int], forced: list[int], reserve: int) -> None:
        if len(self.seqs) >= self.batch or not 0 <= seq < self.batch:
            raise ValueError(f"sequence slot {seq}: the path holds {self.batch}")
        tokens = list(prompt) + list(forced)
        state, coords = prompt_coordinates(prompt, self.cfg)
        rows = [coords]
        for t in forced:
            rows.append(torch.tensor([state.next(int(token_roles([t], self.cfg)[0]))], dtype=torch.int32))
        self.seqs[seq] = dict(tokens=tokens, prompt_len=len(prompt), fed=0, coords=torch.cat(rows), state=state)

    def pending(self, seq: int) -> int:
        s = self.seqs[seq]
        return len(s["tokens"]) - s["fed"]

    def free(self, seq: int) -> None:
        self.seqs.pop(seq, None)

    def _append(self, s: dict, token: int) -> None:
        row = s["state"].next(int(token_roles([token], self.cfg)[0]))
        s["coords"] = torch.cat([s["coords"], torch.tensor([row], dtype=torch.int32)])
        s["tokens"].append(int(token))

    # steps -------------------------------------------------------------------------------
    def step(self, plan: list[tuple[int, int]]) -> dict[int, int]:
        if all(n == 1 for _, n in plan) and all(self.seqs[i]["fed"] >= self.seqs[i]["prompt_len"] for i, _ in plan):
            return self._decode(plan)
        out = {}
        for seq, n in plan:  # prefill: one sequence's chunk a call (as vLLM's DASH layer loops)
            s = self.seqs[seq]
            a, b = s["fed"], s["fed"] + n
            ids = torch.tensor(s["tokens"][a:b], device=self.dev)
            with torch.no_grad():
                x = self.model.embed_input_ids(ids)
                ctx = _PeerContext(self.cfg.num_hidden_layers, self._prefill_attend(seq, s, a, b))
                hidden = self.model(x, ctx)
                s["fed"] = b
                if b == len(s["tokens"]):
                    logits = self.model.logits(hidden, torch.tensor([n - 1], device=self.dev))
                    tok = int(greedy_tokens(logits, self.cfg.image_token_id)[0])
                    self._append(s, tok)
                    out[seq] = tok
        return out

    def _decode(self, plan) -> dict[int, int]:
        order = [seq for seq, _ in plan]
        if sorted(order) != list(range(self.batch)):
            raise ValueError("the peers decode the whole batch, in slot order")
        for seq in order:
            s = self.seqs[seq]
            pos = s["fed"]
            self.h_ids[seq] = s["tokens"][pos]
            self.h_coords[seq] = s["coords"][pos]
            self.h_lens[seq] = pos + 1
            self.h_prompt[seq] = s["prompt_len"]
        self._stage_decode(order)
        self.ids.copy_(self.h_ids, non_blocking=True)
        self.coords.copy_(self.h_coords, non_blocking=True)
        self.lens.copy_(self.h_lens, non_blocking=True)
        self.prompt_lens.copy_(self.h_prompt, non_blocking=True)
        if self.dev.type == "cuda" and self.graph is None:
            self._capture()
        if self.graph is not None:
            self.graph.replay()
            tokens = self._tokens
        else:
            tokens = self._decode_body()
        chosen = tokens.tolist()
        out = {}
        for seq in order:
            s = self.seqs[seq]
            s["fed"] += 1
            self._append(s, chosen[seq])
            out[seq] = chosen[seq]
        return out

    def _decode_body(self) -> torch.Tensor:
        with torch.no_grad():
            x = self.model.embed_input_ids(self.ids)
            hidden = self.model(x, _PeerContext(self.cfg.num_hidden_layers, self._decode_attend))
            logits = self.model.logits(hidden, torch.arange(self.batch, device=self.dev))
            return greedy_tokens(logits, self.cfg.image_token_id)

    def _capture(self) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up: the ops' first calls, cached launch metadata
            for _ in range(2):
                self._decode_body()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._tokens = self._decode_body()

    def _stage_decode(self, order) -> None:
        pass

    def cache_gib(self) -> float:
        raise NotImplementedError


class DensePath(PeerPath):
    """Dense causal FlashAttention over a contiguous cache per sequence (module docstring)."""

    name = "dense"
    segments = "FA2 (PyTorch), dense"

    def __init__(self, model, batch: int, max_len: int, chunk: int):
        super().__init__(model, batch, max_len, chunk)
        c = self.cfg
        shape = (batch * max_len, c.num_key_value_heads, c.head_dim)
        self.k = [torch.zeros(shape, dtype=model.dtype, device=self.dev) for _ in range(c.num_hidden_layers)]
        self.v = [torch.zeros(shape, dtype=model.dtype, device=self.dev) for _ in range(c.num_hidden_layers)]
        self.cu_q = torch.arange(batch + 1, dtype=torch.int32, device=self.dev)
        self.cu_k = self.cu_q * max_len
        self.rows = torch.zeros(batch, dtype=torch.int64, device=self.dev)

    def cache_gib(self) -> float:
        return 2 * sum(t.numel() * t.element_size() for t in self.k) / 2**30

    def _rope(self, module, q, k, coords):
        tok, page = coords[:, 0].long(), coords[:, 1].long()
        return page_rope(q, tok, page, module.dash, main=True), page_rope(k, tok, page, module.dash, main=True)

    def _prefill_attend(self, seq, s, a, b):
        coords = s["coords"][a:b].to(self.dev)
        base = seq * self.max_len

        def attend(module, q, k, v, iq, ik, head_cls):
            i = module.layer_idx
            q, k = self._rope(module, q, k, coords)
            self.k[i][base + a : base + b] = k
            self.v[i][base + a : base + b] = v
            return self._prefill_flash(q, self.k[i][base : base + b], self.v[i][base : base + b])

        return attend

    def _decode_attend(self, module, q, k, v, iq, ik, head_cls):
        i = module.layer_idx
        q, k = self._rope(module, q, k, self.coords)
        rows = self.cu_k[:-1].long() + self.lens.long() - 1
        self.k[i].index_copy_(0, rows, k)
        self.v[i].index_copy_(0, rows, v)
        return self._decode_flash(q, self.k[i], self.v[i])

    def _prefill_flash(self, q, k, v):
        """One sequence's chunk (its last ``len(q)`` keys are the queries'), causal."""
        return _flash(q, k, v, None, None, k.shape[0], True)

    def _decode_flash(self, q, k, v):
        """One query row per sequence over its ``lens`` keys of the contiguous cache."""
        return _flash(q, k, v, (self.cu_q, self.cu_k), self.lens, self.max_len, False)


class DenseFa3Path(DensePath):
    """Dense attention as vLLM serves a dense model on Hopper: its FlashAttention 3 library
    (``--vllm``'s ``vllm_flash_attn``), the decode over the cache as pages of 16 with a block
    table and FA3's own split-KV heuristic (``num_splits=0``), the prefill causal varlen. The
    driver, the cache and its writes are :class:`DensePath`'s."""

    name = "dense-fa3"
    segments = "vLLM FA3, dense"
    page = 16

    def __init__(self, model, batch: int, max_len: int, chunk: int, vllm):
        if vllm is None or vllm.fa_unavailable is not None or vllm.fa3 is None:
            why = "no --vllm" if vllm is None else (vllm.fa_unavailable or "no FlashAttention 3")
            raise PathUnavailable(f"dense-fa3 needs vLLM's FlashAttention 3 library ({why})")
        max_len = -(-max_len // self.page) * self.page
        super().__init__(model, batch, max_len, chunk)
        self.fa3 = vllm.fa3
        width = max_len // self.page
        self.block_table = torch.arange(batch * width, dtype=torch.int32, device=self.dev).view(batch, width)

    def _prefill_flash(self, q, k, v):
        n, m = q.shape[0], k.shape[0]
        cu_q = torch.tensor([0, n], dtype=torch.int32, device=self.dev)
        cu_k = torch.tensor([0, m], dtype=torch.int32, device=self.dev)
        return self.fa3(
            q, k, v, max_seqlen_q=n, cu_seqlens_q=cu_q, max_seqlen_k=m, cu_seqlens_k=cu_k,
            softmax_scale=q.shape[-1] ** -0.5, causal=True, fa_version=3,
        )  # fmt: skip

    def _decode_flash(self, q, k, v):
        kc = k.view(-1, self.page, *k.shape[1:])  # the contiguous cache as pages of 16
        vc = v.view(-1, self.page, *v.shape[1:])
        return self.fa3(
            q, kc, vc, max_seqlen_q=1, cu_seqlens_q=self.cu_q, max_seqlen_k=self.max_len, seqused_k=self.lens,
            softmax_scale=q.shape[-1] ** -0.5, causal=True, block_table=self.block_table, num_splits=0, fa_version=3,
        )  # fmt: skip


DENSE_PATHS = ("dense", "dense-fa3")


class PathUnavailable(RuntimeError):
    """A path that cannot run on this machine (its library missing): reported, not fatal."""


def _flash(q, k, v, cu, used, max_k, causal):
    """FlashAttention 2 (varlen) through PyTorch; on a CPU the same attention in float32."""
    n = q.shape[0]
    scale = q.shape[-1] ** -0.5
    if not q.is_cuda:
        return _math_attention(q, k, v, cu, used, causal, scale)
    if cu is None:
        cu = (
            torch.tensor([0, n], dtype=torch.int32, device=q.device),
            torch.tensor([0, k.shape[0]], dtype=torch.int32, device=q.device),
        )
    if used is not None and not _HAS_SEQUSED:
        # this torch's FA2 takes no per-sequence key counts: the same attention over the padded
        # cache with a mask (memory-efficient SDPA)
        b, h, d = q.shape
        kk = k.view(b, max_k, -1, d).transpose(1, 2)
        vv = v.view(b, max_k, -1, d).transpose(1, 2)
        mask = (torch.arange(max_k, device=q.device)[None, :] < used[:, None])[:, None, None, :]
        out = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, None], kk, vv, attn_mask=mask, scale=scale, enable_gqa=kk.shape[1] != h
        )
        return out[:, :, 0]
    out, *_ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu[0], cu[1], n if used is None else 1, max_k, 0.0, causal, False, scale=scale, seqused_k=used
    )
    return out


_HAS_SEQUSED = "seqused_k" in str(torch.ops.aten._flash_attention_forward.default._schema)


def _math_attention(q, k, v, cu, used, causal, scale):
    g = q.shape[1] // k.shape[1]
    if cu is None:  # one sequence's chunk: the last n of its keys are the queries', causal
        n, m = q.shape[0], k.shape[0]
        logits = torch.einsum("qhd,khd->hqk", q.float(), k.float().repeat_interleave(g, 1)) * scale
        mask = torch.arange(m)[None, :] <= torch.arange(m - n, m)[:, None]
        p = logits.masked_fill(~mask, -float("inf")).softmax(-1)
        return torch.einsum("hqk,khd->qhd", p, v.float().repeat_interleave(g, 1)).to(q.dtype)
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        lo = int(cu[1][b])
        out[b : b + 1] = _math_attention(
            q[b : b + 1], k[lo : lo + int(used[b])], v[lo : lo + int(used[b])], None, None, True, scale
        )
    return out


class VllmPath(PeerPath):
    """vLLM 0.34.0's DASH ops (``bench/vllm_peer.py``)."""

    name = "vllm"

    def __init__(self, model, batch: int, max_len: int, chunk: int, vllm, max_model_len: int):
        super().__init__(model, batch, max_len, chunk)
        from vllm_peer import VllmCaches

        self.vllm = vllm
        self.segments = vllm.segments
        self.sp = self.cfg.dash.to_dict()
        self.vc = VllmCaches(model, batch, max_len)
        self.max_model_len = max_model_len
        pin = self.dev.type == "cuda"
        self.h_slots = torch.zeros(batch, dtype=torch.int64, pin_memory=pin)
        self.slots = self.h_slots.to(self.dev)
        self.tables = self.vc.tables
        self.positions = torch.zeros(4, batch, dtype=torch.int64, device=self.dev)
        self._positions: dict[int, torch.Tensor] = {}

    def cache_gib(self) -> float:
        return self.vc.nbytes() / 2**30

    def add(self, seq, prompt, forced, reserve):
        super().add(seq, prompt, forced, reserve)
        tokens = self.seqs[seq]["tokens"]
        pos = self.vllm.layers.prompt_page_positions(tokens, self.sp)
        self._positions[seq] = pos.to(self.dev)

    def _prefill_attend(self, seq, s, a, b):
        ids = torch.tensor(s["tokens"][a:b], device=self.dev)
        roles = token_roles(ids.cpu(), self.cfg).to(self.dev)
        step = dict(
            kind="prefill",
            seq=seq,
            roles=roles,
            positions=self._positions[seq][:, a:b],
            length=b,
            prefix_lens=torch.tensor([s["prompt_len"]], dtype=torch.int32, device=self.dev),
        )
        return self._ctx_attend(step)

    def _ctx_attend(self, step):
        from vllm_peer import VllmContext

        ctx = VllmContext(self.vllm, self.vc, self.sp, self.max_model_len, step, self.cfg.num_hidden_layers)
        return ctx.attend

    def _stage_decode(self, order) -> None:
        for seq in order:
            pos = int(self.h_lens[seq]) - 1
            self.h_slots[seq] = (seq * self.vc.width + pos // self.vc.block) * self.vc.block + pos % self.vc.block
        self.slots.copy_(self.h_slots, non_blocking=True)

    def _decode_attend(self, module, q, k, v, iq, ik, head_cls):
        cfg = self.cfg
        roles = (self.ids == cfg.image_token_id).long() + 2 * (self.ids == cfg.page_token_id).long()
        # vLLM's decode positions: the sequence position in every row (>= 0: not a recomputation)
        positions = (self.lens.long() - 1).expand(4, -1)
        step = dict(
            kind="decode",
            roles=roles,
            seq_lens=self.lens,
            slots=self.slots,
            positions=positions,
            prefix_lens=self.prompt_lens,
            tables=self.tables,
        )
        return self._ctx_attend(step)(module, q, k, v, iq, ik, head_cls)


# ------------------------------------------------------------------------------ a case
def run_case(path, prompts, forced, steps: int, full: int, clock: Clock) -> dict:
    """Add the documents (with ``forced`` answer tokens, recomputed like a preempted request's),
    prefill them, decode ``steps`` steps (or ``full``: that many); times and tokens."""
    b = len(prompts)
    for i, p in enumerate(prompts):
        path.add(i, p, forced[i] if forced else [], len(p) + (len(forced[i]) if forced else 0) + max(steps, full) + 2)
    t0 = clock.now()
    first, ttft = {}, {}
    while len(first) < b:  # prefill: the pending prompts in steps of at most `chunk` tokens
        budget, plan = path.chunk, []
        for i in range(b):
            n = min(path.pending(i), budget) if i not in first else 0
            if n > 0:
                plan.append((i, n))
                budget -= n
            if budget == 0:
                break
        for i, tok in path.step(plan).items():
            if i not in first:
                first[i], ttft[i] = tok, time.perf_counter() - t0
    prefill_s = clock.now() - t0
    tokens = {i: [first[i]] for i in range(b)}
    walls = []
    for _ in range(max(steps, full)):
        a = time.perf_counter()
        out = path.step([(i, 1) for i in range(b)])
        walls.append(time.perf_counter() - a)  # the step read its tokens back
        for i, t in out.items():
            tokens[i].append(t)
    decode_s = sum(walls)
    for i in range(b):
        path.free(i)
    return {
        "prefill_s": prefill_s,
        "ttft_mean_s": statistics.mean(ttft.values()),
        "ttft_last_s": max(ttft.values()),
        "step_ms": statistics.median(walls[1:] or walls) * 1e3,
        "decode_s": decode_s,
        "tokens": tokens,
    }


def make_path(name, model, batch, max_len, chunk, vllm, max_model_len):
    if name == "dash":
        return DashPath(model, batch, max_len, chunk)
    if name == "dense":
        return DensePath(model, batch, max_len, chunk)
    if name == "dense-fa3":
        return DenseFa3Path(model, batch, max_len, chunk, vllm)
    if name == "vllm":
        if vllm is None:
            raise SystemExit("--paths vllm needs --vllm (vLLM 0.34.0's DASH files: bench/vllm_peer.py)")
        return VllmPath(model, batch, max_len, chunk, vllm, max_model_len)
    raise SystemExit(f"unknown path {name!r}: dash, vllm, dense, dense-fa3")


# ------------------------------------------------------------------------------ the parts
def bench_moe(model, dev, clock: Clock) -> list[dict]:
    """One MoE layer alone: grouped GEMMs, the per-expert loop, the dense form (ms a call)."""
    moe = next(m for m in model.modules() if isinstance(m, U.MoE))
    rows = []
    for tokens in (64, 8192):
        x = torch.randn(tokens, model.config.hidden_size, device=dev, dtype=model.dtype)
        for form in U.EXPERT_FORMS:
            if form == "dense" and tokens > 512:
                continue  # [E, T, I] for 8192 tokens: 64x the routed work, not a serving path
            moe.form = form
            # grouped and dense in a CUDA graph, as the decode graphs run them (grouped only where
            # it is one kernel); the loop eagerly, as it must run (its host reads)
            graph = dev.type == "cuda" and (form == "dense" or (form == "grouped" and U.grouped_native(x)))
            with torch.no_grad():
                out = moe(x)
                ms = _time_call(lambda: moe(x), dev, graph=graph)  # noqa: B023 - called at once
            rows.append({"tokens": tokens, "form": form, "ms": ms, "out": out, "graph": graph})
        moe.form = None
    for r in rows:  # every form against the per-expert loop on the same tokens
        loop = next(q for q in rows if q["tokens"] == r["tokens"] and q["form"] == "sparse")
        err = (r["out"].float() - loop["out"].float()).norm() / loop["out"].float().norm()
        r["rel_err_vs_loop"] = float(err)
    for r in rows:
        r.pop("out")
    return rows


def _time_call(fn, dev, graph: bool, iters: int = 20) -> float:
    if dev.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(3):
            fn()
        return (time.perf_counter() - t0) / 3 * 1e3
    if graph:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        run = g.replay
    else:
        fn()
        run = fn
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def bench_tower(config: dict, dev, dtype, pages: int, quick: bool) -> dict:
    """The vision tower alone on real page views (a rendered A4 page's: 2 x 3 tiles and the
    global view), batched over ``pages`` pages: ms and pages/s, and its features' check
    against float32."""
    from dash_trt.documents.views import ViewSpec, page_views
    from dash_trt.models.deepencoder import DeepEncoderConfig, VisionTower

    cfg = DeepEncoderConfig.from_config(config)
    torch.manual_seed(0)
    with torch.device(dev):
        tower = VisionTower(cfg)
    with torch.no_grad():
        for p in tower.parameters():
            p.normal_(0, 0.02)
    tower = tower.to(dtype).eval()
    from PIL import Image

    rng = np.random.default_rng(0)
    size = (248, 350) if quick else (1240, 1754)
    img = Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))
    views = page_views(img, ViewSpec.from_config(config), crop=True)
    batch = [views] * pages
    times = []
    with torch.no_grad():
        # The first call at a batch size picks its kernels (cuBLAS/cuDNN heuristics, SDPA
        # backends, resized position tables): warm up at this size, then the median of 3.
        tower.encode_pages(batch)
        for _ in range(1 if quick else 3):
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            feats = tower.encode_pages(batch)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
    ms = sorted(times)[len(times) // 2]
    return {
        "pages": pages,
        "tokens_per_page": int(feats[0].shape[0]),
        "ms": ms,
        "pages_per_s": pages / ms * 1e3,
        "grid": list(views.grid),
    }


def busy_ms(prof) -> float:
    """Time the device was busy in a profile: the union of its kernel and copy intervals (ms)."""
    spans = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
    )
    total, end = 0.0, float("-inf")
    for a, b in spans:
        if a > end:
            total, end = total + (b - a), b
        elif b > end:
            total, end = total + (b - end), b
    return total / 1e3


def step_busy(path: DashPath, prompts, dev, steps: int = 8) -> dict:
    """Wall time of a decode step as the engine runs it (CUDA graphs on) beside the time the GPU
    is busy in it: the host work the step does not hide. ``wall_ms``: median of ``steps`` steps
    without the profiler; ``gpu_ms``: the device's busy time of ``steps`` more steps under the
    profiler, per step (None on a CPU)."""
    from torch.profiler import ProfilerActivity, profile

    rt = path.rt
    for i, p in enumerate(prompts):
        rt.add(i, p, len(p) + 2 * steps + 4)
    try:
        while any(rt.seq(i).fed < rt.seq(i).prompt_len for i in range(len(prompts))):
            rt.step([(i, rt.seq(i).pending) for i in range(len(prompts)) if rt.seq(i).fed < rt.seq(i).prompt_len])
        plan = [(i, 1) for i in range(len(prompts))]
        rt.step(plan)  # the first decode step captures its graph
        walls = []
        for _ in range(steps):
            t = time.perf_counter()
            rt.step(plan)  # returns after reading the step's tokens back
            walls.append(time.perf_counter() - t)
        gpu = None
        if dev.type == "cuda":
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(steps):
                    rt.step(plan)
                torch.cuda.synchronize()
            gpu = busy_ms(prof) / steps
    finally:
        for i in range(len(prompts)):
            rt.free(i)
    wall = statistics.median(walls) * 1e3
    return {"wall_ms": wall, "gpu_ms": gpu, "wall_over_gpu": wall / gpu if gpu else None, "steps": steps}


def step_shares(path: DashPath, model, prompts, dev) -> dict:
    """The share of one eager decode step's kernel time in attention, the experts (every MoE
    layer: gate, routed and shared experts), and the rest (profiler ranges around modules)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    ranges, hooks = {}, []

    def wrap(mod, label):
        def pre(m, args):
            r = record_function(label)
            r.__enter__()
            ranges.setdefault(id(m), []).append(r)

        def post(m, args, out):
            ranges[id(m)].pop().__exit__(None, None, None)

        hooks.append(mod.register_forward_pre_hook(pre))
        hooks.append(mod.register_forward_hook(post))

    for layer in model.layers:
        wrap(layer.self_attn.attn, "bench.attention")
        if isinstance(layer.mlp, U.MoE):
            wrap(layer.mlp, "bench.experts")
    rt = path.rt
    for i, p in enumerate(prompts):
        rt.add(i, p, len(p) + 8)
    while any(rt.seq(i).pending > 1 or rt.seq(i).fed < rt.seq(i).prompt_len for i in range(len(prompts))):
        plan = [(i, rt.seq(i).pending) for i in range(len(prompts)) if rt.seq(i).fed < rt.seq(i).prompt_len]
        rt.step(plan)
    graphs, rt.cuda_graphs = rt.cuda_graphs, False  # an eager step: its kernels one by one
    try:
        rt.step([(i, 1) for i in range(len(prompts))])
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        with profile(activities=acts) as prof, record_function("bench.step"):
            res = rt.step([(i, 1) for i in range(len(prompts))])
            if dev.type == "cuda":
                torch.cuda.synchronize()
        if res.graph:
            raise RuntimeError("the profiled step replayed a CUDA graph: no module ranges to split it by")
    finally:
        rt.cuda_graphs = graphs
        for h in hooks:
            h.remove()
        for i in range(len(prompts)):
            rt.free(i)
    events = prof.key_averages()

    def device_us(ev) -> float:
        return getattr(ev, "device_time_total", 0.0) or getattr(ev, "cuda_time_total", 0.0)

    part = {e.key: device_us(e) for e in events if e.key.startswith("bench.")}
    if not part.get("bench.step"):  # a CPU run: CPU time instead
        part = {e.key: e.cpu_time_total for e in events if e.key.startswith("bench.")}
    total = part["bench.step"]
    attn, experts = part.get("bench.attention", 0.0), part.get("bench.experts", 0.0)
    return {
        "total_ms": total / 1e3,
        "attention": attn / total,
        "experts": experts / total,
        "rest": max(0.0, 1 - (attn + experts) / total),
    }


# ------------------------------------------------------------------------------ main
def parse_cases(spec: str) -> list[tuple[int, int]]:
    """``PxB,...``: documents of P pages, B of them at once."""
    out = []
    for c in spec.split(","):
        p, b = c.lower().split("x")
        out.append((int(p), int(b)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="toy sizes (the CPU smoke test)")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--paths", default="dash,vllm,dense")
    ap.add_argument(
        "--cases",
        default=None,
        help="PxB: documents of P pages, B at once (default 1x1,1x32,1x128,4x32,16x1,16x16,16x64)",
    )
    ap.add_argument("--page-tokens", type=int, default=None, help=f"image tokens a page ({PAGE_TOKENS}; quick 60)")
    ap.add_argument("--answer-per-page", type=int, default=None, help="answer tokens a page (1000; quick 24)")
    ap.add_argument("--steps", type=int, default=16, help="decode steps measured at each point")
    ap.add_argument("--answer-end", default="", help="cases (PxB) also measured at the answer's end")
    ap.add_argument("--full", default="", help="cases (PxB) whose whole answer is generated (pages/s measured)")
    ap.add_argument("--prefill-chunk", type=int, default=8192)
    ap.add_argument("--vllm", help="vLLM 0.34.0's DASH files: a folder with vllm/..., or a .tar.xz of one")
    ap.add_argument("--parts", action="store_true", help="also the MoE layer, the vision tower and the step's shares")
    ap.add_argument("--check", action="store_true", help="first check the paths' tokens against each other")
    ap.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="seconds: the cases not started by then are skipped (and listed)",
    )
    ap.add_argument(
        "--dtype", choices=sorted(M.DTYPES), help="default bfloat16 (float32 on a CPU without the vllm path)"
    )
    ap.add_argument("--shares", default="", help="case (PxB) whose eager step is split into parts (default the last)")
    ap.add_argument("--json")
    ap.add_argument("--png")
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    conf = published_config(a.layers, quick=a.quick)
    dtype = (
        M.DTYPES[a.dtype] if a.dtype else torch.bfloat16 if dev.type == "cuda" or "vllm" in a.paths else torch.float32
    )
    page_tokens = a.page_tokens or (60 if a.quick else PAGE_TOKENS)
    per_page = a.answer_per_page or (24 if a.quick else 1000)
    cases = parse_cases(a.cases or ("1x2,2x2" if a.quick else "1x1,1x32,1x128,4x32,16x1,16x16,16x64"))
    ends = set(parse_cases(a.answer_end)) if a.answer_end else set()
    fulls = set(parse_cases(a.full)) if a.full else set()
    shares_case = parse_cases(a.shares)[0] if a.shares else cases[-1]
    paths = [p.strip() for p in a.paths.split(",") if p.strip()]
    commit = os.environ.get("DASH_COMMIT", "unknown")
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    t_build = time.perf_counter()
    model = M.random_model(conf, seed=0, dtype=dtype, device=dev)
    cfg = model.config
    build_s = time.perf_counter() - t_build
    vllm = None
    if "vllm" in paths and not a.vllm:
        raise SystemExit("--paths vllm needs --vllm (vLLM 0.34.0's DASH files: bench/vllm_peer.py)")
    if a.vllm and ("vllm" in paths or "dense-fa3" in paths):  # dense-fa3 runs on its FA3 library
        import vllm_peer

        vllm = vllm_peer.load_from(a.vllm)
        if vllm.fa_unavailable:
            print(
                f"# vLLM's FlashAttention 3 did not load ({vllm.fa_unavailable}); its segments run on {vllm.segments}"
            )
    max_model_len = cfg.get("max_position_embeddings") if hasattr(cfg, "get") else 32768
    title = (
        f"{name}, torch {torch.__version__}, Unlimited-OCR-2 shape ({cfg.num_hidden_layers} layers, "
        f"{'toy' if a.quick else 'published'} sizes), {str(dtype).split('.')[-1]}, commit {commit}"
    )
    print(
        f"# bench_pages: {title}; model built in {build_s:.1f} s; pages of {page_tokens} image tokens, "
        f"{per_page} answer tokens a page",
        flush=True,
    )
    clock = Clock(dev)
    results: dict = {
        "title": title,
        "commit": commit,
        "device": name,
        "page_tokens": page_tokens,
        "answer_per_page": per_page,
        "cases": [],
        "parts": {},
    }

    def save():
        if a.json:
            with open(a.json, "w", encoding="utf-8") as fh:
                json.dump(results, fh, indent=1)

    if a.check:
        results["check"] = check_paths(model, paths, vllm, max_model_len, page_tokens, a.prefill_chunk, dev, clock)
        save()
    if a.parts:
        results["parts"]["moe"] = bench_moe(model, dev, clock)
        for r in results["parts"]["moe"]:
            print(
                f"  moe {r['tokens']:5d} tokens {r['form']:8s} {r['ms']:8.3f} ms "
                f"(rel. err vs loop {r['rel_err_vs_loop']:.1e})",
                flush=True,
            )
        towers = []
        for n in (2,) if a.quick else (1, 8, 32):
            towers.append(bench_tower(conf, dev, dtype, n, a.quick))
            print(
                f"  tower {n:3d} pages: {towers[-1]['ms']:.1f} ms, {towers[-1]['pages_per_s']:.1f} pages/s", flush=True
            )
        results["parts"]["tower"] = towers
        save()
    tower_s_per_page = None
    if results["parts"].get("tower"):
        best = max(results["parts"]["tower"], key=lambda r: r["pages"])
        tower_s_per_page = best["ms"] / best["pages"] / 1e3
    t_start = time.perf_counter()
    for pages, b in cases:
        if a.time_budget is not None and time.perf_counter() - t_start > a.time_budget:
            results.setdefault("skipped", []).append(f"{pages}x{b}")
            print(f"## {pages} page(s) x {b} documents: skipped (--time-budget {a.time_budget:.0f} s spent)")
            continue
        prompts = [document(pages, page_tokens, cfg) for _ in range(b)]
        ans = [answer(pages, per_page, cfg, seed=i) for i in range(b)]
        a_len = pages * per_page
        row = {"pages": pages, "batch": b, "prompt_tokens": len(prompts[0]), "answer_tokens": a_len, "paths": {}}
        print(f"## {pages} page(s) x {b} documents ({len(prompts[0])} prompt tokens each)", flush=True)
        for pname in paths:
            _memory_reset(dev)
            full = a_len - 1 if (pages, b) in fulls else 0
            end = (pages, b) in ends
            need = len(prompts[0]) + (a_len if (end or full) else 0) + a.steps + 8
            try:
                path = make_path(pname, model, b, need, a.prefill_chunk, vllm, max_model_len)
                r = run_case(path, prompts, None, a.steps, full, clock)
                r.pop("tokens")
                if end:
                    r_end = run_case(path, prompts, [x[: a_len - 1] for x in ans], a.steps, 0, clock)
                    r["step_end_ms"] = r_end["step_ms"]
                r["cache_gib"] = path.cache_gib()
                r["peak_gib"] = _peak_gib(dev)
                r["segments"] = path.segments
                if a.parts and pname == "dash" and (pages, b) == shares_case:
                    results["parts"]["shares"] = step_shares(path, model, prompts, dev)
                    results["parts"]["busy"] = step_busy(path, prompts, dev)
                del path
            except torch.cuda.OutOfMemoryError as exc:  # noqa: PERF203 - one case's failure is a result
                r = {"error": f"out of memory: {str(exc).splitlines()[0]}"}
            except PathUnavailable as exc:
                r = {"error": str(exc)}
            r.update(pages_per_s(r, pages, b, a_len, full, tower_s_per_page))
            row["paths"][pname] = r
            print("  " + describe(pname, r), flush=True)
            save()
        results["cases"].append(row)
        save()
    print()
    print(table(results))
    if a.png:
        note = plot(results, a.png)
        if note:
            print(note)
    return 0


def pages_per_s(r: dict, pages: int, b: int, a_len: int, full: int, tower_s: float | None) -> dict:
    """Pages a second of a case: B x P pages over the tower's time for them, the prefill and
    the answer's decode (measured whole with ``full``; else the steps at the answer's start and,
    if measured, its end, linear between)."""
    if "error" in r:
        return {}
    if full:
        decode = r["decode_s"]
        how = "full run"
    else:
        start = r["step_ms"] / 1e3
        end = r.get("step_end_ms", r["step_ms"]) / 1e3
        decode = (a_len - 1) * (start + end) / 2
        how = "start and end steps" if "step_end_ms" in r else "start step only"
    tower = (tower_s or 0.0) * pages * b
    total = tower + r["prefill_s"] + decode
    return {
        "pages_per_s": pages * b / total,
        "decode_tok_s": b / (r["step_ms"] / 1e3),
        "pages_per_s_how": how + ("" if tower_s else ", no tower time"),
        "tower_s": tower,
    }


def describe(name: str, r: dict) -> str:
    if "error" in r:
        return f"{name:5s}: {r['error']}"
    end = f", end {r['step_end_ms']:.2f} ms" if "step_end_ms" in r else ""
    return (
        f"{name:5s}: TTFT {r['ttft_last_s']:.2f} s (mean {r['ttft_mean_s']:.2f}), step {r['step_ms']:.2f} ms{end}, "
        f"{r['decode_tok_s']:.0f} tok/s, {r['pages_per_s']:.2f} pages/s ({r['pages_per_s_how']}), "
        f"cache {r['cache_gib']:.1f} GiB, peak {r['peak_gib']:.1f} GiB [{r['segments']}]"
    )


def table(results: dict) -> str:
    lines = [
        "| documents | path | TTFT batch (s) | decode step, answer start (ms) | at answer end (ms) | decode tok/s | "
        "pages/s | how | vs best dense (step) | vs vLLM (step) | KV cache (GiB) | peak (GiB) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for row in results["cases"]:
        label = f"{row['pages']} p x {row['batch']}"
        ps = row["paths"]
        for name, r in ps.items():
            if "error" in r:
                brief = ". ".join(r["error"].split(". ")[:2])  # torch's OOM message runs on for lines
                lines.append(f"| {label} | {name} | {brief} | | | | | | | | | |")
                continue

            def vs(others, ps=ps, r=r, name=name):
                o = [ps[n]["step_ms"] for n in others if n in ps and "error" not in ps[n] and n != name]
                return f"{min(o) / r['step_ms']:.2f}x" if o else "-"

            end = f"{r['step_end_ms']:.2f}" if "step_end_ms" in r else "-"
            lines.append(
                f"| {label} | {name} | {r['ttft_last_s']:.2f} | {r['step_ms']:.2f} | {end} | {r['decode_tok_s']:.0f} | "
                f"{r['pages_per_s']:.2f} | {r['pages_per_s_how']} | {vs(DENSE_PATHS)} | {vs(['vllm'])} | "
                f"{r['cache_gib']:.1f} | {r['peak_gib']:.1f} |"
            )
    parts = results.get("parts") or {}
    if parts.get("moe"):
        lines += ["", "| MoE layer | tokens | ms | rel. error vs loop |", "| --- | ---: | ---: | ---: |"]
        for r in parts["moe"]:
            lines.append(f"| {r['form']} | {r['tokens']} | {r['ms']:.3f} | {r['rel_err_vs_loop']:.1e} |")
    if parts.get("tower"):
        lines += ["", "| vision tower, pages at once | ms | pages/s |", "| ---: | ---: | ---: |"]
        for r in parts["tower"]:
            lines.append(f"| {r['pages']} | {r['ms']:.1f} | {r['pages_per_s']:.1f} |")
    if parts.get("shares"):
        s = parts["shares"]
        lines += [
            "",
            f"decode step kernel time {s['total_ms']:.2f} ms: attention {s['attention']:.0%}, "
            f"experts {s['experts']:.0%}, rest {s['rest']:.0%}",
        ]
    if parts.get("busy") and parts["busy"].get("gpu_ms"):
        s = parts["busy"]
        lines += [
            "",
            f"decode step (CUDA graphs) wall {s['wall_ms']:.2f} ms, GPU busy {s['gpu_ms']:.2f} ms: "
            f"wall/GPU {s['wall_over_gpu']:.2f}",
        ]
    return "\n".join(lines)


def plot(results: dict, path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: no plot"
    rows = [r for r in results["cases"] if r["paths"]]
    names = sorted({n for r in rows for n in r["paths"]}, key=["dash", "vllm", *DENSE_PATHS].index)
    labels = [f"{r['pages']}p x{r['batch']}" for r in rows]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.2))
    w = 0.8 / max(1, len(names))
    for j, n in enumerate(names):
        xs = [i + (j - (len(names) - 1) / 2) * w for i in range(len(rows))]
        step = [r["paths"].get(n, {}).get("step_ms", math.nan) for r in rows]
        pps = [r["paths"].get(n, {}).get("pages_per_s", math.nan) for r in rows]
        a1.bar(xs, step, w, label=n)
        a2.bar(xs, pps, w, label=n)
    for ax, title in (
        (a1, "decode step of the whole model, ms (lower is better)"),
        (a2, "pages/s with the tower, prefill and decode (higher is better)"),
    ):
        ax.set_xticks(range(len(rows)), labels, fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=8)
    a1.set_yscale("log")
    fig.suptitle(results["title"], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return None


def check_paths(model, paths, vllm, max_model_len, page_tokens, chunk, dev, clock) -> dict:
    """The paths' first answer tokens and a few decode steps on two short documents: DASH
    paths against each other (same function: greedy tokens equal up to bf16 near-ties), dense as
    a reference of the driver only. Returns the tokens and agreements."""
    cfg = model.config
    prompts = [document(2, min(page_tokens, 300), cfg), document(3, min(page_tokens, 200), cfg)]
    steps = 8
    with torch.no_grad():
        ref = M.reference_generate(model, prompts, steps + 1, stop_at_eos=False).tokens
    got = {"reference": {i: list(t) for i, t in enumerate(ref)}}
    for name in list(paths):
        try:
            path = make_path(name, model, len(prompts), 2048, chunk, vllm, max_model_len)
        except PathUnavailable as exc:
            print(f"# check: {exc}", flush=True)
            paths = [p for p in paths if p != name]
            continue
        got[name] = run_case(path, prompts, None, steps, 0, clock)["tokens"]
        del path
    out = {"tokens": {k: {str(i): v for i, v in t.items()} for k, t in got.items()}, "agree": {}}
    for name in paths:
        if name in DENSE_PATHS:  # another function: the dense paths check each other and the driver
            others = [p for p in DENSE_PATHS if p in paths and p != name]
        else:
            others = ["reference"] + [p for p in paths if p not in DENSE_PATHS and p != name]
        for other in others:
            key = f"{name} vs {other}"
            if f"{other} vs {name}" in out["agree"]:
                continue
            # tokens equal up to the first difference (greedy decoding diverges after it)
            prefix = [_common_prefix(got[name][i], got[other][i]) for i in range(len(prompts))]
            out["agree"][key] = {"equal_prefix": prefix, "length": steps + 1}
            print(f"# check: {key}: equal for the first {prefix} of {steps + 1} tokens", flush=True)
    return out


def _common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
