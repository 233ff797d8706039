"""Greedy generation of a DASH model: :func:`generate` on the serving runtime (paged caches
written in place) and :func:`reference_generate`, its step-by-step dense reference."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..attention.dash.paged import assign_flat_cache_tensors, flat_cache_tensors
from ..modeling import DashModel
from ..models.config import DashModelConfig
from .kv import blocks_for
from .rules import DecodingRules
from .runner import ForwardFn, PagedRuntime, greedy_tokens
from .scheduler import new_pool

__all__ = ["generate", "reference_generate", "Generation", "PagedState"]


# ----------------------------------------------------------------------- generation
class PagedState:
    """The paged cache of every layer (one :class:`DashKVCache` each, one
    :class:`KVBlockPool` and so one block table shared by all layers)."""

    def __init__(self, model: DashModel, num_blocks: int, kv_block_size: int):
        self.pool = new_pool(num_blocks, kv_block_size)
        self.caches = model.allocate_cache(num_blocks, kv_block_size)

    def tensors(self) -> list[torch.Tensor]:
        return flat_cache_tensors(self.caches)

    def update(self, tensors: Sequence[torch.Tensor]) -> None:
        assign_flat_cache_tensors(self.caches, tensors)


@dataclass
class Generation:
    """Result of :func:`generate`: per sequence, the generated ids and the logits
    [n, vocab] that chose each of them."""

    tokens: list[list[int]]
    logits: list[torch.Tensor]
    steps: int = 0
    batches: list[list[tuple[int, int]]] = field(default_factory=list)  #: (sequence, new tokens) per step
    blocks_in_use: int = 0  #: KV blocks still held at the end (0 once every sequence finished)
    graph_steps: int = 0  #: decode steps replayed from a CUDA graph


def _greedy(logits: torch.Tensor, config: DashModelConfig) -> int:
    """The greedy choice for one row of logits [vocab] (:func:`~dash_trt.serving.runner.greedy_tokens`)."""
    return int(greedy_tokens(logits[None], config.image_token_id)[0])


def generate(
    model: DashModel,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    prefill_chunk: int | None = None,
    kv_block_size: int = 16,
    num_blocks: int | None = None,
    stop_at_eos: bool = True,
    forward: ForwardFn | None = None,
    cuda_graphs: bool | None = None,
    keep_logits: bool = True,
    image_features: Sequence[torch.Tensor | None] | None = None,
    rules: DecodingRules | Sequence[DecodingRules | None] | None = None,
) -> Generation:
    """Greedy generation over the paged cache, on the serving runtime
    (:class:`~dash_trt.serving.runner.PagedRuntime`: caches written in place, logits only for the
    tokens chosen, decode steps replayed from CUDA graphs on the kernels).

    Every step is one batch: each sequence contributes its next prefill chunk (of up to
    ``prefill_chunk`` tokens; the whole prompt if None) or its next decode token, so
    prefill chunks and decode steps of different sequences mix. Each sequence's blocks for
    its prompt and ``max_new_tokens - 1`` generated tokens are allocated up front
    (``num_blocks`` defaults to their sum). ``forward`` replaces the model call with a
    functional one (the ONNX check runs another runtime on the same steps);
    ``cuda_graphs=False`` runs decode steps eagerly; ``keep_logits=False`` skips copying
    the chosen rows' logits to the host. ``image_features`` gives each prompt its image
    features ([image tokens, image_feature_dim], or None for token embeddings). ``rules``
    (:class:`~dash_trt.serving.rules.DecodingRules`, one for all prompts or one each) edit each
    next token's logits: the page-count guard, no-repeat n-grams.
    """
    cfg = model.config
    prompts = [list(map(int, p)) for p in prompts]
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate needs at least one non-empty prompt")
    if prefill_chunk is not None and prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
    reserve = [len(p) + max(max_new_tokens, 1) - 1 for p in prompts]
    if num_blocks is None:
        num_blocks = sum(blocks_for(r, kv_block_size) for r in reserve) + 1
    pool = new_pool(num_blocks, kv_block_size)
    runtime = PagedRuntime(
        model,
        pool=pool,
        forward=forward,
        max_model_len=max(reserve),
        max_num_seqs=len(prompts),
        cuda_graphs=cuda_graphs,
    )
    n = len(prompts)
    feats = list(image_features) if image_features is not None else [None] * n
    if len(feats) != n:
        raise ValueError(f"image_features has {len(feats)} entries for {n} prompts")
    each_rules = list(rules) if isinstance(rules, (list, tuple)) else [rules] * n
    if len(each_rules) != n:
        raise ValueError(f"rules has {len(each_rules)} entries for {n} prompts")
    for i, p in enumerate(prompts):
        runtime.add(i, p, reserve[i], image_features=feats[i], rules=each_rules[i])
    finished = [max_new_tokens <= 0] * n
    result = Generation([[] for _ in range(n)], [])
    logits_out: list[list[torch.Tensor]] = [[] for _ in range(n)]
    while True:
        plan = []
        for i in range(n):
            if finished[i]:
                continue
            left = runtime.seq(i).pending
            plan.append((i, left if prefill_chunk is None else min(left, prefill_chunk)))
        if not plan:
            break
        step = runtime.step(plan, return_logits=keep_logits)
        result.steps += 1
        result.batches.append(plan)
        for i, tok in step.tokens.items():
            result.tokens[i].append(tok)
            if keep_logits:
                logits_out[i].append(step.logits[i])
            if len(result.tokens[i]) >= max_new_tokens or (stop_at_eos and tok == cfg.eos_token_id):
                finished[i] = True
                runtime.free(i)
    result.blocks_in_use = pool.num_blocks - pool.num_free_blocks
    result.logits = [torch.stack(x) if x else torch.empty(0, cfg.vocab_size) for x in logits_out]
    result.graph_steps = runtime.graph_steps
    return result


def reference_generate(
    model: DashModel,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    stop_at_eos: bool = True,
    image_features: Sequence[torch.Tensor | None] | None = None,
    rules: DecodingRules | None = None,
) -> Generation:
    """Step-by-step reference for :func:`generate`: every token re-runs the whole
    sequence through the dense reference attention, no cache (``rules`` edit each row first)."""
    cfg = model.config
    tokens, logits = [], []
    feats = list(image_features) if image_features is not None else [None] * len(prompts)
    for p, f in zip(prompts, feats):
        hist, gen, lg = list(p), [], []
        procs = rules.processors(p, cfg.page_token_id, cfg.eos_token_id) if rules is not None else []
        with torch.no_grad():
            for _ in range(max_new_tokens):
                last = model.reference_logits(hist, cfg.prompt_length(len(p)), f)[-1].float().cpu()
                for process in procs:
                    process(gen, last)
                tok = _greedy(last, cfg)
                gen.append(tok)
                lg.append(last)
                hist.append(tok)
                if stop_at_eos and tok == cfg.eos_token_id:
                    break
        tokens.append(gen)
        logits.append(torch.stack(lg) if lg else torch.empty(0, cfg.vocab_size))
    return Generation(tokens, logits)
