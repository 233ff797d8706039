"""The serving runtime: paged generation over one KV pool, caches written in place.

Every path that generates tokens runs on it: :func:`dash_trt.model.generate`, the Triton
service's :class:`~dash_trt.serving.engine.GenerationEngine`, the benchmark
(``bench/bench_generate.py``). One step is one call of the model over a ragged batch,
each sequence contributing its next prefill chunk or its next decode token:

1. **One plan per step.** The KV blocks the runtime is handed (a
   :class:`~dash_trt.serving.kv.KVBlocks`: the scheduler's pool, which the scheduler owns; the
   runtime never imports the pool) build the step's metadata
   (:meth:`~dash_trt.serving.kv.KVBlocks.schedule_host`: block tables, lengths, query starts,
   prompt lengths) on the host from the pool's own state, so it is valid by construction; it
   reaches the device in one copy as a :class:`~dash_trt.attention.dash.paged.DashBatch` (with
   ``max_query_len``) and is handed unchanged to every layer. Nothing in a step reads the
   device back except the chosen tokens.
2. **In place.** Each layer calls the in-place op (``torch.ops.dash_trt.paged_attention_``):
   the cache tensors keep their storage for the runtime's whole life (no step copies the
   pool). A sequence gets the blocks :meth:`PagedRuntime.add` reserves for it when it is
   added, and further blocks as it grows past them (the pool appends them when a step
   needs them; the pool's ``CacheFullError`` if none is free).
   :meth:`PagedRuntime.preempt` takes a sequence's blocks back and keeps its tokens;
   :meth:`PagedRuntime.resume` recomputes its cache from them.
3. **O(1) page coordinates.** A sequence keeps a :class:`~dash_trt.attention.dash.paged.PageCoordState`;
   a generated token's coordinates come from it, not from the whole sequence again.
4. **Logits only where a token is chosen** (the model's ``logits_indices``), and the
   greedy choice (image tokens masked, as :func:`dash_trt.model.generate` always did) on
   the device: one small read per step.
5. **CUDA graphs for decode steps** on the CUDA kernels: a step where every sequence feeds
   one token runs a graph captured for the next batch-size bucket
   (:data:`GRAPH_BATCH_SIZES`), its rows padded with idle sequences on a scratch KV block
   that no sequence owns. With ``cuda_graphs=False`` the same padded step runs eagerly, so
   graph replay and eager give the same bits. Prefill and mixed steps run eagerly.

On CUDA the kernels take every step's block table at one width
(``max_model_len / kv_block_size`` columns), so graph and eager calls see the same
shapes. Elsewhere (CPU, or sizes the kernels do not run) the in-place op runs the PyTorch
paged operator and no graph is used.

What runs the model is a backend (:mod:`dash_trt.serving.backends`): the model in PyTorch
(default); a functional ``forward(inputs, caches) -> (logits, new_caches)`` (ONNX Runtime
in the export check and dash-compare); or a TensorRT engine
(:mod:`dash_trt.serving.tensorrt`). Each takes the step the runtime planned
(:class:`~dash_trt.serving.backends.ModelStep`) and the caches, and returns the logits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..attention.dash import cuda as dcuda
from ..attention.dash.paged import DashBatch, DashKVCache, PageCoordState, TextCoordState, flat_cache_tensors
from ..modeling import image_feature_rows, prompt_coordinates, token_role
from ..models.prompts import document_prompt
from .backends import ForwardFn, FunctionalBackend, ModelBackend, ModelStep, TorchBackend
from .kv import KVBlocks, blocks_for, prefix_block_hashes
from .limits import DEFAULT_MAX_MODEL_LEN
from .rules import DecodingRules
from .sampling import Sampler, SamplingParams
from .scheduler import new_pool

__all__ = [
    "GRAPH_BATCH_SIZES",
    "DEFAULT_MAX_MODEL_LEN",
    "RuntimeConfigError",
    "PoolTooSmallError",
    "SequenceState",
    "StepResult",
    "PagedRuntime",
    "ForwardFn",
    "greedy_tokens",
    "pool_block_bytes",
    "blocks_for_memory",
    "size_pool_for_memory",
]

#: Decode batch sizes a CUDA graph is captured for (a step of B sequences runs the graph of
#: the smallest size >= B; up to the runtime's ``max_num_seqs``).
GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class RuntimeConfigError(ValueError):
    """A runtime size is unusable (pool, max_model_len, batch sizes)."""


class PoolTooSmallError(RuntimeConfigError):
    """The model, its activations and the KV pool do not fit the device memory allowed."""


def greedy_tokens(logits: torch.Tensor, image_token_id: int | None) -> torch.Tensor:
    """Greedy choice per row [N] (int64): argmax with image tokens masked (image tokens come
    from the vision encoder, never from the decoder; a generated one would also move the
    prompt/response boundary of the page coordinates). Ties go to the lower id. A model
    without image tokens (``image_token_id`` None) masks nothing."""
    if image_token_id is None:
        return logits.argmax(-1)
    masked = logits.clone()
    masked[:, image_token_id] = -math.inf  # a fill kernel: no host-to-device copy (graph capture)
    return masked.argmax(-1)


def _greedy_row(row: torch.Tensor, image_token_id: int | None) -> int:
    """:func:`greedy_tokens` of one float32 host row (after the logits processors edited it)."""
    if image_token_id is not None:
        row = row.clone()
        row[image_token_id] = -math.inf
    return int(row.argmax())


def pool_block_bytes(model, kv_block_size: int) -> int:
    """Device bytes of one KV block in every layer's cache (the six cache tensors), measured on
    the caches :meth:`~dash_trt.model.DashForCausalLM.allocate_cache` makes (on the meta
    device: nothing is allocated)."""
    caches = model.allocate_cache(1, kv_block_size, device="meta")
    return sum(t.numel() * t.element_size() for t in flat_cache_tensors(caches))


def blocks_for_memory(
    model, kv_block_size: int, memory_fraction: float, *, activation_bytes: int, device: torch.device | None = None
) -> int:
    """KV blocks that fit in ``memory_fraction`` of the device's memory next to what is
    already allocated (the model's weights) and ``activation_bytes`` (a step's peak
    activations). Raises :class:`PoolTooSmallError` if not even one block fits."""
    device = device or model.device
    if not 0.0 < memory_fraction <= 1.0:
        raise RuntimeConfigError(f"gpu_memory_fraction must be in (0, 1], got {memory_fraction}")
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    budget = int(total * memory_fraction) - used - int(activation_bytes)
    per = pool_block_bytes(model, kv_block_size)
    blocks = budget // per
    if blocks < 1:
        raise PoolTooSmallError(
            f"no room for the KV pool: {memory_fraction:.0%} of {total / 2**30:.1f} GiB is "
            f"{total * memory_fraction / 2**30:.1f} GiB; the model and what else is on the device take "
            f"{used / 2**30:.1f} GiB and a step's activations about {activation_bytes / 2**30:.1f} GiB "
            f"(one KV block of {kv_block_size} tokens in all layers is {per / 2**20:.2f} MiB). Raise "
            f"gpu_memory_fraction, lower max_batch_tokens, or use a smaller model or dtype"
        )
    return int(blocks)


#: Device memory kept free beside the measured peak of a step when the pool is sized from the
#: GPU's memory: the decode graphs' private pool and the allocator's fragmentation.
MEMORY_HEADROOM_BYTES = 512 * 2**20


def size_pool_for_memory(model, kv_block_size: int, memory_fraction: float, max_batch_tokens: int) -> int:
    """KV blocks for a pool that takes ``memory_fraction`` of the model's GPU: one step of
    ``max_batch_tokens`` prompt tokens is run on a scratch pool to measure the activations'
    peak (as vLLM profiles a step), then what is left of the fraction goes to the pool."""
    device = model.device
    if device.type != "cuda":
        raise RuntimeConfigError("gpu_memory_fraction needs the model on a CUDA device")
    cfg = model.config
    tokens = max(2, int(max_batch_tokens))
    prompt = document_prompt([tokens - 1], "", cfg)[:tokens]
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    blocks = blocks_for(len(prompt), kv_block_size) + 1
    probe = PagedRuntime(model, blocks, kv_block_size, max_model_len=len(prompt), max_num_seqs=1, cuda_graphs=False)
    probe.add(0, prompt, len(prompt))
    probe.step([(0, len(prompt))])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    cache_bytes = sum(t.numel() * t.element_size() for t in probe.tensors())
    del probe
    torch.cuda.empty_cache()
    return blocks_for_memory(
        model,
        kv_block_size,
        memory_fraction,
        activation_bytes=peak - cache_bytes + MEMORY_HEADROOM_BYTES,
        device=device,
    )


def _pool_sizes(pool: KVBlocks | None, num_blocks: int | None, kv_block_size: int | None) -> tuple[int, int]:
    """``(num_blocks, kv_block_size)`` of a runtime: ``pool``'s (the sizes, if given too, must
    match it), else the ones given (both positive)."""
    if pool is not None:
        for name, given, has in (
            ("num_blocks", num_blocks, pool.num_blocks),
            ("kv_block_size", kv_block_size, pool.block_size),
        ):
            if given is not None and int(given) != has:
                raise RuntimeConfigError(f"{name}={given}, the pool it was handed has {has}")
        return int(pool.num_blocks), int(pool.block_size)
    if num_blocks is None or kv_block_size is None:
        raise RuntimeConfigError("give num_blocks and kv_block_size, or pool=")
    if int(num_blocks) < 1 or int(kv_block_size) < 1:
        raise RuntimeConfigError(f"num_blocks and kv_block_size must be positive, got {num_blocks}, {kv_block_size}")
    return int(num_blocks), int(kv_block_size)


@dataclass
class SequenceState:
    """One sequence in the runtime: its tokens (prompt, then generated) and their page
    coordinates, and how many are in the cache."""

    seq_id: object
    tokens: list[int]
    prompt_len: int
    coords: np.ndarray  #: [capacity, 4] int32, rows 0..len(tokens)-1 filled
    coord_state: PageCoordState | TextCoordState
    prompt_ids: np.ndarray  #: [prompt_len] int64: prefill chunks are sliced from it, not converted
    fed: int = 0  #: tokens already in the cache
    sampler: Sampler | None = None  #: draws its tokens (None: greedy, the runtime's own choice)
    image_features: torch.Tensor | None = None  #: [M, image_feature_dim] on the runtime's device
    image_rows: np.ndarray | None = None  #: [prompt_len] int64: each prompt token's feature row, -1 for none
    block_hashes: list[bytes] | None = None  #: prefix-cache hashes of its cacheable blocks (None: not cached)
    #: logits processors (:mod:`dash_trt.serving.rules`): each edits the float32 row of its next
    #: token in place, given its generated tokens, before the token is chosen
    processors: tuple = ()
    registered: int = 0  #: leading blocks registered in (or found in) the prefix cache
    cached_tokens: int = 0  #: prompt tokens found in the prefix cache (not computed)

    @property
    def pending(self) -> int:
        """Tokens known but not yet in the cache (the rest of the prompt, or the last token)."""
        return len(self.tokens) - self.fed

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]


@dataclass
class StepResult:
    """What a step produced: the chosen token of every sequence whose known tokens are now
    all in the cache (its prompt is prefilled), in plan order."""

    tokens: dict[object, int] = field(default_factory=dict)
    logits: dict[object, torch.Tensor] | None = None  #: float32 rows on the CPU, if asked for
    num_tokens: int = 0
    graph: bool = False  #: the step replayed a CUDA graph


@dataclass
class _Static:
    """The static buffers of one decode bucket (graph inputs and outputs)."""

    size: int
    host: torch.Tensor  #: pinned int32 staging: ids, coords, table, seq_lens, qsl, prompt_lens, logits_indices
    device: torch.Tensor
    views: dict[str, torch.Tensor]
    host_views: dict[str, np.ndarray]
    graph: Any = None
    tokens: torch.Tensor | None = None
    logits: torch.Tensor | None = None


class PagedRuntime:
    """Greedy generation steps for many sequences over one paged KV pool (see the module
    docstring).

    ``num_blocks`` KV blocks of ``kv_block_size`` tokens, shared by every layer's cache: the
    blocks of ``pool`` (a :class:`~dash_trt.serving.kv.KVBlocks`, the scheduler's pool, which
    the runtime is handed and does not own; sizes, if given too, must match it), or of a pool
    of that size made for this runtime alone (:func:`~dash_trt.serving.scheduler.new_pool`).
    ``forward`` replaces the PyTorch model call with a functional backend. ``cuda_graphs``
    (default: on where the CUDA kernels run the model) captures decode steps;
    ``max_num_seqs`` bounds a step's sequences and so the largest graph;
    ``max_model_len`` the tokens of one sequence. ``decode_padding`` (default: where the
    kernels run) pads decode steps to the graph sizes, graphs or not. ``backend``: a
    :class:`~dash_trt.serving.backends.ModelBackend` that runs the model on the runtime's
    caches in place (:class:`dash_trt.serving.tensorrt.TensorRTBackend`).
    """

    def __init__(
        self,
        model,
        num_blocks: int | None = None,
        kv_block_size: int | None = None,
        *,
        pool: KVBlocks | None = None,
        forward: ForwardFn | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        cuda_graphs: bool | None = None,
        graph_batch_sizes: Sequence[int] | None = None,
        backend: ModelBackend | None = None,
        decode_padding: bool | None = None,
        device: str | torch.device | None = None,
        prefix_caching: bool = False,
    ):
        self.model = model
        self.config = model.config
        #: Where the caches and step tensors live: the model's device, or ``device`` (a backend
        #: such as TensorRT runs the model; its weights may then stay on the CPU).
        self.device = torch.device(device) if device is not None else model.device
        if device is not None and backend is None and forward is None and self.device != model.device:
            raise RuntimeConfigError(
                f"the model is on {model.device}, device={self.device}: only a backend "
                f"(forward=, backend=) may run elsewhere"
            )
        num_blocks, kv_block_size = _pool_sizes(pool, num_blocks, kv_block_size)
        self.kv_block_size = kv_block_size
        if max_num_seqs < 1:
            raise RuntimeConfigError(f"max_num_seqs must be positive, got {max_num_seqs}")
        #: The KV blocks every step runs on (the scheduler's pool when it was handed one).
        self.pool: KVBlocks = pool if pool is not None else new_pool(num_blocks, kv_block_size)
        #: Completed prompt blocks are shared through the pool's prefix cache (KV blocks must hold
        #: whole sparse blocks, whose summaries are then final).
        self.prefix_caching = bool(prefix_caching) and model.prefix_cacheable(self.kv_block_size)
        self.prompt_tokens_cached = 0  #: prompt tokens taken from the prefix cache, all sequences
        self.max_num_seqs = int(max_num_seqs)
        if forward is not None and backend is not None:
            raise RuntimeConfigError("give forward= or backend=, not both")
        #: The model in PyTorch when no other backend runs it (the decode graphs capture it).
        self._torch = TorchBackend(model, self.device) if forward is None and backend is None else None
        #: What runs each step's model call.
        self.backend: ModelBackend = (
            backend if backend is not None else FunctionalBackend(forward, self.device) if forward else self._torch
        )
        c = self.config
        reason = None
        if self.device.type != "cuda":
            reason = "not on a CUDA device"
        elif forward is not None or backend is not None:
            reason = "another backend runs the model"
        elif getattr(c, "dash", None) is None:
            reason = "the model has no DASH attention layers"
        else:
            reason = dcuda.supports(
                c.head_dim, c.index_head_dim, self.kv_block_size, c.dash.sparse_block_size, model.dtype
            )
        #: None when every step runs the CUDA kernels (fixed table width, padding, graphs), else why not.
        self.kernels_reason = reason
        self.kernels = reason is None
        #: Decode steps run the padded bucket body (every row scored, idle rows on scratch
        #: blocks); on by default where the kernels run, so graph and eager steps agree.
        self.decode_padding = self.kernels if decode_padding is None else bool(decode_padding)
        if self.decode_padding and self._torch is None:
            raise RuntimeConfigError("decode_padding runs the model in PyTorch: not with forward= or backend=")
        most = self.pool.num_blocks * self.kv_block_size
        if max_model_len is None:
            max_model_len = min(most, DEFAULT_MAX_MODEL_LEN)
        if max_model_len < 1:
            raise RuntimeConfigError(f"max_model_len must be positive, got {max_model_len}")
        self.max_model_len = int(max_model_len)
        sizes = sorted({int(b) for b in (graph_batch_sizes or GRAPH_BATCH_SIZES) if 0 < int(b)})
        if not sizes:
            raise RuntimeConfigError("graph_batch_sizes must hold a positive size")
        # Every batch up to max_num_seqs has a bucket: the sizes below it, and it.
        self.graph_batch_sizes = tuple(b for b in sizes if b < self.max_num_seqs) + (self.max_num_seqs,)
        #: Block-table width of every call (None: each step's own, the longest sequence's).
        self.table_width = blocks_for(self.max_model_len, self.kv_block_size) if self.decode_padding else None
        # Blocks past the pool's, never handed out: idle row j of a padded decode step is a
        # one-token-deep sequence at slot j of them (every idle row writes its own slot).
        self._scratch = self.pool.num_blocks
        scratch = blocks_for(self.graph_batch_sizes[-1], self.kv_block_size) if self.decode_padding else 0
        if self.kernels:  # the kernels' own limits, before any memory is taken
            dcuda.check_sizes(
                c.num_attention_heads,
                c.num_key_value_heads,
                c.head_dim,
                c.index_head_dim,
                self.pool.num_blocks + scratch,
                self.kv_block_size,
                self.table_width,
                c.dash,
                model.dtype,
                c.num_hidden_layers,
            )
        self.caches: list[DashKVCache] = model.allocate_cache(
            self.pool.num_blocks + scratch, self.kv_block_size, device=self.device
        )
        self.cuda_graphs = self.kernels and self.decode_padding and (cuda_graphs is None or bool(cuda_graphs))
        self._static: dict[int, _Static] = {}
        self._last_decode: tuple | None = None  # (bucket, sequence ids) of the last decode step
        self._graph_pool = None
        self._seqs: dict[object, SequenceState] = {}
        self.steps = 0
        self.graph_steps = 0

    # ------------------------------------------------------------- sequences
    def tensors(self) -> list[torch.Tensor]:
        """The cache tensors, flat, ``(layer, field)`` order (the exported graph's ``past.*``)."""
        return flat_cache_tensors(self.caches)

    def add(
        self,
        seq_id: object,
        prompt: Sequence[int],
        reserve_tokens: int,
        *,
        coords: tuple[PageCoordState | TextCoordState, torch.Tensor] | None = None,
        sampling: SamplingParams | None = None,
        image_features: torch.Tensor | None = None,
        block_hashes: Sequence[bytes] | None = None,
        cached_blocks: Sequence[int] | None = None,
        rules: DecodingRules | None = None,
    ) -> SequenceState:
        """Register a sequence and allocate blocks for ``reserve_tokens`` tokens (at least its
        prompt; more blocks are allocated as it grows past them). ``coords`` is
        :func:`~dash_trt.modeling.prompt_coordinates` when the caller has it already; ``sampling``
        draws its tokens instead of the greedy choice (:mod:`dash_trt.serving.sampling`);
        ``image_features`` [M, image_feature_dim], one row per ``<image>`` token of the prompt in
        order, replace those tokens' embeddings (models that take image features). With
        prefix caching, ``block_hashes`` (:func:`prefix_block_hashes`, computed if None) find
        the cached blocks the sequence starts with (``cached_blocks``: a :meth:`KVBlocks.match`
        the caller made already); its completed prompt blocks are registered as it runs.
        ``rules`` (:class:`~dash_trt.serving.rules.DecodingRules`) edit each next token's logits
        (the page-count guard, no-repeat n-grams). Raises
        the pool's ``CacheFullError`` (nothing added) when the blocks are not free,
        ``ValueError`` for a bad prompt."""
        prompt = list(prompt)
        if not set(map(type, prompt)) <= {int}:  # numpy or torch integers: plain ints (a C-speed check first)
            prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("a sequence needs a non-empty prompt")
        if reserve_tokens < len(prompt):
            raise ValueError(f"reserve_tokens ({reserve_tokens}) is less than the prompt ({len(prompt)} tokens)")
        if reserve_tokens > self.max_model_len:
            raise ValueError(f"sequence of up to {reserve_tokens} tokens exceeds max_model_len {self.max_model_len}")
        feats = rows = None
        if image_features is not None:
            feats, rows = self._image_inputs(prompt, image_features)
        state, prompt_coords = coords if coords is not None else prompt_coordinates(prompt, self.config)
        hashes, cached = None, []
        if self.prefix_caching:
            hashes = list(block_hashes) if block_hashes is not None else self.block_hashes(prompt, image_features)
            cached = list(cached_blocks) if cached_blocks is not None else self.pool.match(hashes)
            if len(cached) > len(hashes):
                raise ValueError(f"{len(cached)} cached blocks for {len(hashes)} cacheable ones")
        self.pool.add(
            seq_id,
            prompt_length=self.config.prompt_length(len(prompt)),
            reserve_tokens=reserve_tokens,
            cached_blocks=cached,
        )
        buf = np.empty((max(reserve_tokens + 1, len(prompt)), 4), dtype=np.int32)
        buf[: len(prompt)] = prompt_coords.numpy()
        sampler = (
            Sampler(sampling, self.config.image_token_id) if sampling is not None and not sampling.greedy else None
        )
        processors = ()
        if rules is not None and rules.active:
            processors = tuple(rules.processors(prompt, self.config.page_token_id, self.config.eos_token_id))
        seq = SequenceState(
            seq_id,
            prompt,
            len(prompt),
            buf,
            state,
            np.array(prompt, dtype=np.int64),
            sampler=sampler,
            image_features=feats,
            image_rows=rows,
            block_hashes=hashes,
            registered=len(cached),
            processors=processors,
        )
        seq.fed = seq.cached_tokens = len(cached) * self.kv_block_size
        self.prompt_tokens_cached += seq.cached_tokens
        self._seqs[seq_id] = seq
        return seq

    def block_hashes(self, prompt: Sequence[int], image_features=None) -> list[bytes]:
        """The prefix-cache hashes of a prompt's cacheable blocks (:func:`prefix_block_hashes`,
        seeded with what else the model's cached blocks depend on: ``model.prefix_hash_seed``)."""
        seed = self.model.prefix_hash_seed(len(prompt))
        return prefix_block_hashes(prompt, self.config.image_token_id, self.kv_block_size, image_features, seed=seed)

    def _image_inputs(self, prompt: list[int], features) -> tuple[torch.Tensor, np.ndarray]:
        """A sequence's image features on the device and its prompt tokens' rows of them."""
        dim = self.config.image_feature_dim
        if dim is None:
            raise ValueError(
                "this model takes no image features (its config sets no image_feature_dim): "
                "image tokens are embedded from the token table"
            )
        features = torch.as_tensor(features)
        if features.dim() != 2 or features.shape[1] != dim:
            raise ValueError(f"image features must be [image tokens, {dim}], got {list(features.shape)}")
        if not features.is_floating_point() or not bool(torch.isfinite(features).all()):
            raise ValueError("image features must be finite floating-point values")
        rows = np.asarray(image_feature_rows(prompt, self.config, int(features.shape[0])), dtype=np.int64)
        return features.to(device=self.device, dtype=self.model.dtype), rows

    def free(self, seq_id: object) -> None:
        self._seqs.pop(seq_id, None)
        if seq_id in self.pool:
            self.pool.free(seq_id)

    def preempt(self, seq_id: object) -> SequenceState:
        """Take a sequence out of the runtime and give its blocks back to the pool (its
        registered prompt blocks stay in the prefix cache); returns its state, tokens kept,
        for :meth:`resume`."""
        seq = self._seqs.pop(seq_id)
        self.pool.free(seq_id)
        seq.fed = seq.registered = seq.cached_tokens = 0
        self._last_decode = None
        return seq

    def resume(self, seq: SequenceState, cached_blocks: Sequence[int] = ()) -> SequenceState:
        """Put a :meth:`preempt`-ed sequence back: blocks for all its known tokens (prompt and
        generated) are allocated, less ``cached_blocks`` (a :meth:`KVBlocks.match` of its
        ``block_hashes``), and its steps recompute their cache; the step that feeds its last
        known token chooses its next one, as if it had never left. Its page coordinates,
        sampler and logits processors are the ones it had. Raises
        the pool's ``CacheFullError`` (nothing added) when the blocks are not free."""
        if seq.seq_id in self._seqs:
            raise ValueError(f"sequence {seq.seq_id!r} is in the runtime")
        cached = list(cached_blocks) if self.prefix_caching and seq.block_hashes is not None else []
        if len(cached) > len(seq.block_hashes or ()):
            raise ValueError(f"{len(cached)} cached blocks for {len(seq.block_hashes or ())} cacheable ones")
        self.pool.add(
            seq.seq_id,
            prompt_length=self.config.prompt_length(seq.prompt_len),
            reserve_tokens=len(seq.tokens),
            cached_blocks=cached,
        )
        seq.fed = seq.cached_tokens = len(cached) * self.kv_block_size
        seq.registered = len(cached)
        self._seqs[seq.seq_id] = seq
        return seq

    def append_tokens(self, seq_id: object, tokens: Sequence[int]) -> None:
        """Append tokens a sequence is known to continue with (an answer produced elsewhere, a
        benchmark's stand-in answer): later steps feed them to the cache as they feed a
        recomputed sequence's output (prefill chunks, its prompt length unchanged), and the step
        that feeds the last of them chooses the next token. Blocks for them come as the
        sequence grows (reserve them at :meth:`add` for a fixed pool)."""
        seq = self._seqs[seq_id]
        for t in tokens:
            if not 0 <= int(t) < self.config.vocab_size:
                raise ValueError(f"token {t} is outside the vocabulary (0..{self.config.vocab_size - 1})")
        for t in tokens:
            self._append(seq, int(t))
        self._last_decode = None

    def seq(self, seq_id: object) -> SequenceState:
        return self._seqs[seq_id]

    def sequences(self) -> list[SequenceState]:
        """The sequences now in the runtime (in the order they were added)."""
        return list(self._seqs.values())

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    def _append(self, seq: SequenceState, token: int) -> None:
        role = token_role(token, self.config)
        n = len(seq.tokens)
        if n >= seq.coords.shape[0]:
            grown = np.empty((2 * n, 4), dtype=np.int32)
            grown[:n] = seq.coords[:n]
            seq.coords = grown
        seq.coords[n] = seq.coord_state.next(role)
        seq.tokens.append(int(token))

    # ----------------------------------------------------------------- steps
    def step(self, plan: Sequence[tuple[object, int]], *, return_logits: bool = False) -> StepResult:
        """Feed ``plan`` = [(seq_id, n_new), ...]: each sequence's next ``n_new`` known
        tokens go into the cache; every sequence whose known tokens are then all in the cache
        gets its next token chosen (greedy) and appended. Returns those tokens."""
        if not plan:
            raise ValueError("a step needs at least one sequence")
        seqs = [self._seqs[sid] for sid, _ in plan]
        for s, (_, n) in zip(seqs, plan):
            if not 1 <= n <= s.pending:
                raise ValueError(f"sequence {s.seq_id!r}: {n} new tokens, {s.pending} are pending")
            if s.fed + n > self.max_model_len:
                raise ValueError(
                    f"sequence {s.seq_id!r} would hold {s.fed + n} tokens, more than max_model_len {self.max_model_len}"
                )
        samples = [s.fed + n == len(s.tokens) for s, (_, n) in zip(seqs, plan)]
        decode = all(n == 1 for _, n in plan)
        graph = False
        # A sequence still reading image features goes through the eager body (the decode
        # graphs embed token ids only).
        every_row = (
            self.decode_padding
            and decode
            and len(plan) <= self.graph_batch_sizes[-1]
            and not any(s.image_rows is not None and s.fed < s.prompt_len for s in seqs)
        )
        if every_row:  # the padded decode body (graph or eager) scores every row
            tokens, logits, graph = self._decode(seqs)
        else:
            self._last_decode = None  # the static buffers' lengths are stale now
            tokens, logits = self._eager(seqs, plan, samples)
        out = StepResult(num_tokens=sum(n for _, n in plan), graph=graph)
        chosen = tokens.tolist()  # the one read of the step
        rows = logits.float().cpu() if return_logits else None
        if return_logits:
            out.logits = {}
        k = 0  # eager steps score the sampling rows only; decode steps score every row
        for j, (s, (sid, n), sample) in enumerate(zip(seqs, plan, samples)):
            s.fed += n
            if s.block_hashes is not None and s.registered < len(s.block_hashes):
                # Completed prompt blocks are final from now on: share them.
                done = min(s.fed // self.kv_block_size, len(s.block_hashes))
                for i in range(s.registered, done):
                    self.pool.register(sid, i, s.block_hashes[i])
                s.registered = max(s.registered, done)
            if not sample:
                continue
            row = j if every_row else k
            k += 1
            if s.processors:
                x = logits[row].detach().float().cpu().clone()
                for process in s.processors:
                    process(s.generated, x)
                tok = s.sampler.choose(x) if s.sampler is not None else _greedy_row(x, self.config.image_token_id)
            else:
                tok = int(chosen[row]) if s.sampler is None else s.sampler.choose(logits[row])
            if rows is not None:
                out.logits[sid] = rows[row]
            out.tokens[sid] = tok
            self._append(s, tok)
        self.steps += 1
        self.graph_steps += int(graph)
        return out

    def _eager(self, seqs, plan, samples):
        """A step run op by op: rows to score are the sampling sequences' last tokens (at
        least one row, so no shape is ever empty)."""
        host = self.pool.schedule_host(plan, table_width=self.table_width)
        qsl = host.query_start_loc
        rows = [int(qsl[j + 1]) - 1 for j, sample in enumerate(samples) if sample] or [int(qsl[-1]) - 1]
        ids = np.concatenate(
            [
                s.prompt_ids[s.fed : s.fed + n]
                if s.fed + n <= s.prompt_len
                else np.asarray(s.tokens[s.fed : s.fed + n], dtype=np.int64)
                for s, (_, n) in zip(seqs, plan)
            ]
        )
        coords = np.concatenate([s.coords[s.fed : s.fed + n] for s, (_, n) in zip(seqs, plan)])
        images = self._step_images(seqs, plan) if self.config.image_feature_dim is not None else None
        step = ModelStep(
            ids,
            coords,
            host,
            np.asarray(rows, dtype=np.int64),
            max(n for _, n in plan),
            self.config.vocab_size,
            images,
        )
        logits = self.backend.run(step, self.caches)
        return greedy_tokens(logits, self.config.image_token_id), logits

    def _step_images(self, seqs, plan) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's ``(image_features [M, F], image_feature_index [T])``: the feature rows its
        prompt chunks read, and for each new token its row (-1: embedded from its id)."""
        parts, index, off = [], [], 0
        for s, (_, n) in zip(seqs, plan):
            rows = np.full(n, -1, dtype=np.int64)
            if s.image_rows is not None and s.fed < s.prompt_len:
                r = s.image_rows[s.fed : min(s.fed + n, s.prompt_len)]
                used = r[r >= 0]
                if used.size:
                    lo, hi = int(used[0]), int(used[-1]) + 1  # a chunk's rows are consecutive
                    parts.append(s.image_features[lo:hi])
                    rows[: r.size] = np.where(r >= 0, r - lo + off, -1)
                    off += hi - lo
            index.append(rows)
        feats = (
            torch.cat(parts)
            if parts
            else torch.zeros(0, self.config.image_feature_dim, dtype=self.model.dtype, device=self.device)
        )
        return feats, torch.from_numpy(np.concatenate(index)).to(self.device)

    # ----------------------------------------------------------- decode graphs
    def _bucket(self, n: int) -> int:
        return next(b for b in self.graph_batch_sizes if b >= n)

    def _static_for(self, size: int) -> _Static:
        st = self._static.get(size)
        if st is not None:
            return st
        w = self.table_width
        layout = (
            ("ids", (size,)),
            ("coords", (size, 4)),
            ("block_tables", (size, w)),
            ("seq_lens", (size,)),
            ("query_start_loc", (size + 1,)),
            ("prompt_lens", (size,)),
            ("logits_indices", (size,)),
        )
        total = sum(int(np.prod(shape)) for _, shape in layout)
        pinned = self.device.type == "cuda"
        host = torch.empty(total, dtype=torch.int32, pin_memory=pinned)
        device = torch.empty(total, dtype=torch.int32, device=self.device) if pinned else host
        hv, dv, off = {}, {}, 0
        for name, shape in layout:
            n = int(np.prod(shape))
            hv[name] = host.numpy()[off : off + n].reshape(shape)
            dv[name] = device[off : off + n].view(shape)
            off += n
        # Constant rows: one token per sequence, every row scored; idle rows on the scratch block.
        hv["query_start_loc"][:] = np.arange(size + 1, dtype=np.int32)
        hv["logits_indices"][:] = np.arange(size, dtype=np.int32)
        st = _Static(size, host, device, dv, hv)
        self._fill_idle(st, 0)
        self._static[size] = st
        return st

    def _fill_idle(self, st: _Static, first: int) -> None:
        """Rows ``first:`` of a bucket: idle sequences, row j ending at slot j of the scratch
        blocks (text token 0, no page; what they read is scratch too)."""
        hv = st.host_views
        rows = np.arange(first, st.size)
        bs = self.kv_block_size
        hv["ids"][first:] = 0
        hv["coords"][first:] = (0, 0, -1, -1)
        hv["block_tables"][first:] = -1
        hv["block_tables"][first:, 0] = self._scratch + rows // bs
        hv["seq_lens"][first:] = rows % bs + 1
        hv["prompt_lens"][first:] = -1

    def _run_static(self, st: _Static) -> None:
        """The decode body on a bucket's static buffers (captured, or run eagerly)."""
        v = st.views
        batch = DashBatch(v["block_tables"], v["seq_lens"], v["query_start_loc"], v["prompt_lens"], max_query_len=1)
        st.logits = self._torch.forward(v["ids"], v["coords"], batch, self.caches, v["logits_indices"])
        st.tokens = greedy_tokens(st.logits, self.config.image_token_id)

    def capture_decode_graphs(self) -> int:
        """Capture a CUDA graph for every decode batch size (largest first, sharing one memory
        pool); returns how many were captured. Runs idle rows only: no sequence's cache is
        touched. Called on the first decode step when not called before."""
        if not self.cuda_graphs:
            return 0
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        done = 0
        for size in sorted(self.graph_batch_sizes, reverse=True):
            st = self._static_for(size)
            if st.graph is not None:
                continue
            self._fill_idle(st, 0)
            self._last_decode = None
            st.device.copy_(st.host)  # the capture path is CUDA only
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: cuBLAS handles, the op's first-call setup
                    self._run_static(st)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._graph_pool):
                self._run_static(st)
            st.graph = graph
            done += 1
        torch.cuda.synchronize(self.device)
        return done

    def _decode(self, seqs: list[SequenceState]):
        b = len(seqs)
        size = self._bucket(b)
        if self.cuda_graphs and (size not in self._static or self._static[size].graph is None):
            self.capture_decode_graphs()
        st = self._static_for(size)
        hv = st.host_views
        ids = tuple(s.seq_id for s in seqs)
        if self._last_decode == (size, ids) and self.pool.advance_within(ids):
            # The previous step was a decode step of these sequences in this bucket: their
            # tables and prompt lengths are in place, each is one token longer.
            hv["seq_lens"][:b] += 1
        else:
            host = self.pool.schedule_host([(sid, 1) for sid in ids], table_width=self.table_width)
            hv["block_tables"][:b] = host.block_tables
            hv["seq_lens"][:b] = host.seq_lens
            hv["prompt_lens"][:b] = host.prompt_lens
            self._fill_idle(st, b)
        self._last_decode = (size, ids)
        hv["ids"][:b] = [s.tokens[s.fed] for s in seqs]
        hv["coords"][:b] = [s.coords[s.fed] for s in seqs]
        if st.device is not st.host:
            st.device.copy_(st.host, non_blocking=True)
        replay = self.cuda_graphs and st.graph is not None  # graphs turned off: eager, captured or not
        if replay:
            st.graph.replay()
        else:
            self._run_static(st)
        return st.tokens[:b], st.logits[:b], replay
