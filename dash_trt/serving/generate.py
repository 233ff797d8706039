"""Greedy generation of a DASH model: :func:`generate` on the serving runtime (paged caches
written in place) and :func:`reference_generate`, its step-by-step dense reference."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..attention.dash.paged import assign_flat_cache_tensors, flat_cache_tensors
from ..modeling import DashModel
from ..models.config import DashModelConfig
from .block_pool import CacheFullError
from .kv import blocks_for
from .rules import DecodingRules
from .runner import ForwardFn, PagedRuntime, greedy_tokens
from .scheduler import new_pool

__all__ = ["generate", "reference_generate", "prefill_chunks", "Generation", "PagedState"]


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
    #: per sequence, the physical KV blocks it held at the end, in logical order
    block_tables: list[list[int]] = field(default_factory=list)


def _greedy(logits: torch.Tensor, config: DashModelConfig) -> int:
    """The greedy choice for one row of logits [vocab] (:func:`~dash_trt.serving.runner.greedy_tokens`)."""
    return int(greedy_tokens(logits[None], config.image_token_id)[0])


def prefill_chunks(prompt_len: int, prefill: int | Sequence[int] | None) -> list[int]:
    """Sizes of a prompt's prefill chunks: the whole prompt (``prefill`` None), chunks of
    ``prefill`` tokens (an int), or the pieces between split points (token indices, positive and
    increasing; those at or past the prompt's end are ignored)."""
    if prefill is None:
        return [prompt_len]
    if isinstance(prefill, numbers.Integral) and not isinstance(prefill, bool):
        if prefill < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill}")
        return [min(int(prefill), prompt_len - i) for i in range(0, prompt_len, int(prefill))]
    points = [int(p) for p in prefill]
    if any(b <= a for a, b in zip(points, points[1:])) or (points and points[0] < 1):
        raise ValueError(f"prefill split points must be positive and increasing, got {points}")
    cuts = [0, *[p for p in points if p < prompt_len], prompt_len]
    return [b - a for a, b in zip(cuts, cuts[1:])]


def generate(
    model: DashModel,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    prefill_chunk: int | Sequence[int] | None = None,
    kv_block_size: int = 16,
    num_blocks: int | None = None,
    stop_at_eos: bool = True,
    forward: ForwardFn | None = None,
    cuda_graphs: bool | None = None,
    keep_logits: bool = True,
    image_features: Sequence[torch.Tensor | None] | None = None,
    rules: DecodingRules | Sequence[DecodingRules | None] | None = None,
    eos_token_id: int | None = None,
    reserve_blocks: bool = True,
    shuffle_seed: int | None = None,
    cache_fill: float | None = None,
) -> Generation:
    """Greedy generation over the paged cache, on the serving runtime
    (:class:`~dash_trt.serving.runner.PagedRuntime`: caches written in place, logits only for the
    tokens chosen, decode steps replayed from CUDA graphs on the kernels).

    Every step is one batch: each sequence contributes its next prefill chunk or its next
    decode token, so prefill chunks and decode steps of different sequences mix. The chunks
    are :func:`prefill_chunks`' (``prefill_chunk``: None the whole prompt, an int chunks of up
    to that many tokens, a list split points). Each sequence's blocks for its prompt and
    ``max_new_tokens - 1`` generated tokens are allocated up front (``num_blocks`` defaults to
    their sum); with ``reserve_blocks=False`` only its prompt's are, the rest as it grows, so a
    pool smaller than every sequence whole reuses the blocks of those that finished.
    ``shuffle_seed`` hands the blocks out in a shuffled order (tables not contiguous);
    ``cache_fill`` fills every floating-point cache slot first (NaN shows that no unwritten slot
    is read).
    A sequence ends after ``max_new_tokens`` tokens or, with ``stop_at_eos``, at the end id
    (``eos_token_id``, default the config's). ``forward`` replaces the model call with a
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
    chunks = [prefill_chunks(len(p), prefill_chunk) for p in prompts]
    eos = cfg.eos_token_id if eos_token_id is None else eos_token_id
    reserve = [len(p) + max(max_new_tokens, 1) - 1 for p in prompts]
    if num_blocks is None:
        num_blocks = sum(blocks_for(r, kv_block_size) for r in reserve) + 1
    pool = new_pool(num_blocks, kv_block_size, shuffle_seed=shuffle_seed)
    runtime = PagedRuntime(
        model,
        pool=pool,
        forward=forward,
        max_model_len=max(reserve),
        max_num_seqs=len(prompts),
        cuda_graphs=cuda_graphs,
    )
    if cache_fill is not None:
        for t in runtime.tensors():
            if t.is_floating_point():
                t.fill_(cache_fill)
    n = len(prompts)
    feats = list(image_features) if image_features is not None else [None] * n
    if len(feats) != n:
        raise ValueError(f"image_features has {len(feats)} entries for {n} prompts")
    each_rules = list(rules) if isinstance(rules, (list, tuple)) else [rules] * n
    if len(each_rules) != n:
        raise ValueError(f"rules has {len(each_rules)} entries for {n} prompts")
    result = Generation([[] for _ in range(n)], [], block_tables=[[] for _ in range(n)])
    try:
        for i, p in enumerate(prompts):
            held = reserve[i] if reserve_blocks else len(p)
            runtime.add(i, p, held, image_features=feats[i], rules=each_rules[i])
        finished = [max_new_tokens <= 0] * n
        logits_out: list[list[torch.Tensor]] = [[] for _ in range(n)]
        while True:
            plan = []
            for i in range(n):
                if not finished[i]:
                    plan.append((i, chunks[i].pop(0) if chunks[i] else runtime.seq(i).pending))
            if not plan:
                break
            step = runtime.step(plan, return_logits=keep_logits)
            result.steps += 1
            result.batches.append(plan)
            for i, tok in step.tokens.items():
                result.tokens[i].append(tok)
                if keep_logits:
                    logits_out[i].append(step.logits[i])
                if len(result.tokens[i]) >= max_new_tokens or (stop_at_eos and tok == eos):
                    finished[i] = True
                    result.block_tables[i] = pool.blocks(i)
                    runtime.free(i)
    except CacheFullError as exc:
        raise CacheFullError(f"the KV pool is full: {exc}") from exc
    for i in range(n):
        if i in pool:
            result.block_tables[i] = pool.blocks(i)
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
