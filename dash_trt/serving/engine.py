"""Continuous-batching greedy generation over one paged KV pool.

This is the serving logic of the Triton generation model, kept free of Triton so it
runs (and is tested) in a plain Python process; the Python-backend ``model.py`` only
parses requests, calls :meth:`GenerationEngine.submit` and turns :class:`Event` s into
responses, while an :class:`EngineRunner` thread calls :meth:`GenerationEngine.step`.

One step is one step of the serving runtime (:class:`~dash_trt.serving.runner.PagedRuntime`:
the model with its caches written in place, logits only for the chosen tokens, decode
steps from CUDA graphs on the kernels), the runtime :func:`dash_trt.model.generate` uses
too, so the served tokens are the tokens offline generation gives: every running
sequence contributes either its next decode token or its next prefill chunk (at most
``prefill_chunk`` tokens, within the step's ``max_batch_tokens``), so prefill chunks and
decode steps of different requests share a step, and requests that arrive while others
are decoding join at the next step (continuous batching).

Who runs and what a step computes is the :class:`~dash_trt.serving.scheduler.Scheduler`'s.
KV blocks are allocated on demand (``EngineConfig.kv_on_demand``, the default): a request is
admitted on its prompt's blocks and its sequence grows as it generates; when a step needs more
blocks than are free, the newest running requests are preempted by recompute (their blocks
freed, their tokens kept, their cache recomputed when they are readmitted; their answers do not
change). With ``kv_on_demand=False`` admission reserves a request's worst case up front
(``ceil((prompt + max_new_tokens - 1) / kv_block_size)`` blocks) and nothing is preempted, at
the price of holding blocks a request that stops early never uses. Requests that do not fit
wait in FIFO order. A request that could never fit, even in an empty pool, is refused at
:meth:`~GenerationEngine.submit`.

Threading: :meth:`~GenerationEngine.submit`, :meth:`~GenerationEngine.stats` and
:meth:`~GenerationEngine.close` may be called from any thread; :meth:`~GenerationEngine.step`
from one thread at a time (the runner's). Only that thread touches the pool and the
cache. Event callbacks run on the stepping thread and must not block for long.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from ..attention.dash.paged import PageCoordState, TextCoordState
from ..modeling import DashModel, prompt_coordinates
from ..models.prompts import document_prompt
from .kv import blocks_for
from .rules import DecodingRules, RulesError
from .runner import ForwardFn, PagedRuntime, size_pool_for_memory
from .sampling import SamplingError, SamplingParams
from .scheduler import Scheduler

__all__ = [
    "EngineConfig",
    "EngineConfigError",
    "RequestError",
    "Event",
    "Request",
    "GenerationEngine",
    "EngineRunner",
    "INVALID_ARGUMENT",
    "UNAVAILABLE",
    "CANCELLED",
    "INTERNAL",
]

log = logging.getLogger("dash_trt.triton")

#: Error codes of failed requests (the Triton model maps them to TritonError codes).
INVALID_ARGUMENT, UNAVAILABLE, CANCELLED, INTERNAL = "invalid_argument", "unavailable", "cancelled", "internal"
#: The most stop token ids one request may give.
MAX_STOP_IDS = 256


class EngineConfigError(ValueError):
    """An :class:`EngineConfig` field is out of range."""


class RequestError(ValueError):
    """A request the engine refuses; nothing was queued. ``code`` is one of the error codes."""

    def __init__(self, message: str, code: str = INVALID_ARGUMENT):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class EngineConfig:
    """Sizes of the pool and of a step."""

    num_blocks: int = 512  #: KV blocks in the pool (shared by all layers' caches)
    kv_block_size: int = 16  #: tokens per KV block
    prefill_chunk: int = 256  #: most prompt tokens of one sequence in one step
    max_batch_tokens: int = 512  #: most new tokens in one step (decode tokens + prefill chunks)
    max_num_seqs: int = 64  #: most sequences running at once (the rest wait)
    default_max_new_tokens: int = 32  #: when a request does not say
    max_new_tokens_limit: int = 4096  #: the most a request may ask for
    #: most tokens (prompt + generated) of one request; 0: the pool's size, at most 131072. On the
    #: CUDA kernels every block table has this width (max_model_len / kv_block_size columns).
    max_model_len: int = 0
    #: on CUDA, the pool takes this fraction of the GPU's memory (less the model and a step's
    #: activations) instead of ``num_blocks`` blocks; 0: off
    gpu_memory_fraction: float = 0.0
    #: replay decode steps from CUDA graphs (where the CUDA kernels run the model)
    cuda_graphs: bool = True
    #: share completed document blocks between requests (docs/triton.md, "Prefix caching")
    prefix_caching: bool = True
    #: allocate KV blocks as requests grow and preempt (by recompute) under pressure; false:
    #: reserve each request's worst case (prompt + max_new_tokens) at admission
    kv_on_demand: bool = True
    #: most document pages (``<PAGE>`` markers of the prompts) running at once; the rest wait,
    #: in order; a request alone is admitted whatever its pages. 0: no limit
    max_pages_in_flight: int = 0

    #: Upper bounds (checked when the config is made, not when a pool of that size fails to
    #: allocate at serve time): 2^24 blocks, blocks of 4096 tokens, 2^20-token steps.
    _LIMITS = {
        "num_blocks": 1 << 24,
        "kv_block_size": 4096,
        "prefill_chunk": 1 << 20,
        "max_batch_tokens": 1 << 20,
        "max_num_seqs": 1 << 16,
        "default_max_new_tokens": 1 << 20,
        "max_new_tokens_limit": 1 << 20,
    }

    def __post_init__(self) -> None:
        for f in (
            "num_blocks",
            "kv_block_size",
            "prefill_chunk",
            "max_batch_tokens",
            "max_num_seqs",
            "default_max_new_tokens",
            "max_new_tokens_limit",
        ):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise EngineConfigError(f"engine config '{f}' must be a positive integer, got {v!r}")
            if v > self._LIMITS[f]:
                raise EngineConfigError(f"engine config '{f}' is {v}, more than the supported {self._LIMITS[f]}")
        if (
            not isinstance(self.max_model_len, int)
            or isinstance(self.max_model_len, bool)
            or self.max_model_len < 0
            or self.max_model_len > 1 << 24
        ):
            raise EngineConfigError(
                f"engine config 'max_model_len' must be an integer in 0..{1 << 24}, got {self.max_model_len!r}"
            )
        m = self.max_pages_in_flight
        if not isinstance(m, int) or isinstance(m, bool) or not 0 <= m <= 1 << 20:
            raise EngineConfigError(
                f"engine config 'max_pages_in_flight' must be an integer in 0..{1 << 20}, got {m!r}"
            )
        f = self.gpu_memory_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 <= f <= 1.0:
            raise EngineConfigError(f"engine config 'gpu_memory_fraction' must be a number in [0, 1], got {f!r}")
        for flag in ("cuda_graphs", "prefix_caching", "kv_on_demand"):
            if not isinstance(getattr(self, flag), bool):
                raise EngineConfigError(f"engine config '{flag}' must be true or false, got {getattr(self, flag)!r}")
        if self.default_max_new_tokens > self.max_new_tokens_limit:
            raise EngineConfigError(
                f"default_max_new_tokens ({self.default_max_new_tokens}) exceeds "
                f"max_new_tokens_limit ({self.max_new_tokens_limit})"
            )

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> EngineConfig:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise EngineConfigError(f"engine config is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise EngineConfigError(f"engine config must be a JSON object, got {type(data).__name__}")
        unknown = sorted(set(data) - set(cls.__dataclass_fields__))
        if unknown:
            raise EngineConfigError(f"unknown engine config key(s): {', '.join(unknown)}")
        return cls(**data)

    def blocks_for(self, tokens: int) -> int:
        """KV blocks of this config's size for ``tokens`` tokens."""
        return blocks_for(tokens, self.kv_block_size)


@dataclass(eq=False)  # requests compare by identity (the queues hold them)
class Request:
    """One generation request and its state. Fields after ``tokens`` change while it runs."""

    id: int
    prompt: list[int]
    max_new_tokens: int
    stop_at_eos: bool
    blocks_reserved: int = 0  #: KV blocks the scheduler counts for it while it runs
    on_event: Callable[[Event], None] | None = None
    is_cancelled: Callable[[], bool] | None = None
    tag: Any = None  #: caller's data (the Triton model keeps the response sender here)
    stop_ids: frozenset[int] = frozenset()  #: generating one of these ends the request (it is kept)
    sampling: SamplingParams | None = None  #: None: greedy
    rules: DecodingRules | None = None  #: the page-count guard, no-repeat n-grams (None: none)
    image_features: torch.Tensor | None = None  #: [image tokens, image_feature_dim], float32 on the CPU
    pages: int = 0  #: document pages in the prompt (its ``<PAGE>`` markers; 0 for a text prompt)
    prompt_cached: int = 0  #: prompt tokens found in the prefix cache (not computed)
    tokens: list[int] = field(default_factory=list)  #: generated so far
    status: str = "queued"  #: queued -> waiting -> running (-> waiting: preempted -> running) -> done | failed
    error: str | None = None
    error_code: str | None = None
    prompt_done: int = 0  #: prompt tokens already in the cache (the most it reached: not reset by a preemption)
    preemptions: int = 0  #: times it was preempted (its cache recomputed)
    t_submit: float = 0.0
    t_admit: float | None = None
    t_first_token: float | None = None
    t_end: float | None = None
    # engine-internal
    _coords: tuple[PageCoordState | TextCoordState, torch.Tensor] | None = field(default=None, repr=False)
    _hashes: list[bytes] | None = field(default=None, repr=False)
    _resume: Any = field(default=None, repr=False)  #: the runner's state while preempted
    _high: int = 0  #: the most tokens its cache has held (below it, steps recompute)
    _waited: bool = False
    _finished: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def finished(self) -> bool:
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the request is done or failed; False on timeout."""
        return self._finished.wait(timeout)

    def result(self, timeout: float | None = None) -> list[int]:
        """The generated ids; raises :class:`RequestError` if the request failed."""
        if not self.wait(timeout):
            raise TimeoutError(f"request {self.id} not finished after {timeout} s")
        if self.status != "done":
            raise RequestError(self.error or "failed", self.error_code or INTERNAL)
        return list(self.tokens)


@dataclass(frozen=True)
class Event:
    """What happened to a request in a step.

    ``kind``: ``"progress"`` (a prefill chunk is in the cache: ``request.prompt_done``),
    ``"token"`` (``tokens`` holds the one new token), ``"done"`` (finished; its blocks are
    free; ``tokens`` holds all generated ids) or ``"error"`` (failed; ``error`` says why).
    Exactly one of ``done``/``error`` ends every request.
    """

    kind: str
    request: Request
    tokens: tuple[int, ...] = ()
    error: str | None = None
    code: str | None = None
    step: int = 0  #: the engine step it happened in (0: outside a step)


class GenerationEngine:
    """Greedy generation for many requests at once over one
    :class:`~dash_trt.serving.runner.PagedRuntime` (one paged KV pool).

    ``forward`` replaces the model call, as in :func:`dash_trt.model.generate`
    (``forward(inputs, caches) -> (logits, new_caches)``), so another runtime
    (ONNX Runtime, a TensorRT engine) can run the same steps; ``backend`` is a runtime
    backend object (:class:`dash_trt.serving.tensorrt.TensorRTBackend`).
    """

    def __init__(
        self,
        model: DashModel,
        config: EngineConfig | None = None,
        *,
        forward: ForwardFn | None = None,
        cancel_poll_interval: float = 0.2,
        clock: Callable[[], float] = time.monotonic,
        backend: Any = None,
    ):
        self.model = model
        # Asking Triton whether a request was cancelled is a round trip to the server
        # process: do it at most this often (seconds of ``clock``), not on every step.
        self.cancel_poll_interval = cancel_poll_interval
        self._clock = clock
        self._last_cancel_poll = float("-inf")
        self._paused = False
        self.config = ecfg = config or EngineConfig()
        self.model_config = model.config
        num_blocks = ecfg.num_blocks
        if ecfg.gpu_memory_fraction > 0 and model.device.type == "cuda" and forward is None and backend is None:
            num_blocks = size_pool_for_memory(
                model, ecfg.kv_block_size, ecfg.gpu_memory_fraction, ecfg.max_batch_tokens
            )
        #: KV blocks in the pool (``config.num_blocks``, or what ``gpu_memory_fraction`` gave)
        self.num_blocks = num_blocks
        #: the waiting queue, the running requests and their KV blocks: the scheduler owns the
        #: pool (``self.scheduler.pool``), the runtime runs its steps on it
        self.scheduler = Scheduler(
            num_blocks=num_blocks,
            kv_block_size=ecfg.kv_block_size,
            max_num_seqs=ecfg.max_num_seqs,
            max_batch_tokens=ecfg.max_batch_tokens,
            prefill_chunk=ecfg.prefill_chunk,
            on_demand=ecfg.kv_on_demand,
            max_pages=ecfg.max_pages_in_flight,
        )
        self.runtime = PagedRuntime(
            model,
            pool=self.scheduler.pool,
            forward=forward,
            backend=backend,
            max_model_len=ecfg.max_model_len or None,
            max_num_seqs=ecfg.max_num_seqs,
            cuda_graphs=ecfg.cuda_graphs,
            prefix_caching=ecfg.prefix_caching,
        )
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._incoming: deque[Request] = deque()
        self._closed: str | None = None
        #: requests drain() took off the queue, answered (failed) by the next step: every
        #: response of the engine's requests goes out from the thread that steps it
        self._to_fail: list[tuple[Request, str]] = []
        self._drain_deadline: float | None = None  #: drain(): running requests fail from then on
        self._step_no = 0  # steps run so far (not reset with the counters)
        self._ids = itertools.count()
        self.counters = {
            "submitted": 0,
            "refused": 0,
            "done": 0,
            "failed": 0,
            "pages_done": 0,
            "steps": 0,
            "tokens_generated": 0,
            "prompt_tokens_computed": 0,
            "prompt_tokens_cached": 0,
            "peak_running": 0,
            "peak_waiting": 0,
            "peak_pages_running": 0,
            "waited": 0,
            "peak_blocks_in_use": 0,
            "preempted": 0,
            "tokens_recomputed": 0,
        }

    # ----------------------------------------------------------------- requests
    def check(self, prompt: Any, max_new_tokens: Any = None) -> tuple[list[int], int, tuple]:
        """Validate a request; returns (prompt ids, max_new_tokens, prompt coordinates: a
        :class:`~dash_trt.attention.dash.paged.PageCoordState` and the rows) or raises :class:`RequestError`
        with a message that says what is wrong. Sizes are checked before any work that grows
        with the prompt."""
        cfg, ecfg = self.model_config, self.config
        if max_new_tokens is None:
            max_new = ecfg.default_max_new_tokens
        else:
            max_new = _as_int("max_new_tokens", max_new_tokens)
        if not 1 <= max_new <= ecfg.max_new_tokens_limit:
            raise RequestError(f"max_new_tokens must be 1..{ecfg.max_new_tokens_limit}, got {max_new}")
        length = _prompt_length(prompt)
        if length == 0:
            raise RequestError(
                "input_ids is empty: a prompt needs at least one document page "
                f"(<PAGE> id {cfg.page_token_id} followed by <image> tokens, id {cfg.image_token_id})"
                if cfg.page_token_id is not None
                else "input_ids is empty: a prompt needs at least one token"
            )
        need = ecfg.blocks_for(length + max_new - 1)
        if need > self.num_blocks:
            raise RequestError(
                f"request too long for the KV pool: a prompt of {length} tokens plus up to {max_new} new tokens "
                f"needs {need} KV blocks of {ecfg.kv_block_size} tokens, the pool has {self.num_blocks} in all "
                f"({self.num_blocks * ecfg.kv_block_size} tokens); shorten the prompt or max_new_tokens, or give "
                f"the model a larger pool (dash-triton write --num-blocks)"
            )
        if length + max_new - 1 > self.runtime.max_model_len:
            raise RequestError(
                f"request too long: a prompt of {length} tokens plus up to {max_new} new tokens exceeds the "
                f"model's max_model_len of {self.runtime.max_model_len} tokens (dash-triton write --max-model-len)"
            )
        arr = _as_id_array(prompt)
        outside = (arr < 0) | (arr >= cfg.vocab_size)
        if outside.any():
            bad = arr[outside]
            raise RequestError(
                f"input_ids holds {bad.size} id(s) outside the vocabulary 0..{cfg.vocab_size - 1}: {bad[:5].tolist()}"
            )
        ids = arr.tolist()
        try:
            coords = prompt_coordinates(torch.from_numpy(arr), cfg)
        except ValueError as exc:
            raise RequestError(
                f"bad prompt ({len(ids)} tokens): {exc} (<PAGE> is id {cfg.page_token_id}, "
                f"<image> is id {cfg.image_token_id})"
            ) from None
        return ids, max_new, coords

    def _pages(self, ids: list[int]) -> int:
        """Document pages in a prompt: its ``<PAGE>`` markers (0 for a model without pages)."""
        page = self.model_config.page_token_id
        return 0 if page is None else ids.count(page)

    def check_options(
        self, stop_token_ids: Any = None, sampling: Any = None
    ) -> tuple[frozenset[int], SamplingParams | None]:
        """Validate a request's stop tokens (ids in the vocabulary, at most
        :data:`MAX_STOP_IDS`) and sampling (a :class:`~dash_trt.serving.sampling.SamplingParams` or a
        dict of its fields); raises :class:`RequestError` naming the bad value."""
        vocab = self.model_config.vocab_size
        stops: frozenset[int] = frozenset()
        if stop_token_ids is not None:
            arr = np.asarray(stop_token_ids).reshape(-1)
            if arr.size > MAX_STOP_IDS:
                raise RequestError(f"stop_token_ids holds {arr.size} ids, at most {MAX_STOP_IDS}")
            if arr.size and (arr.dtype.kind not in "iu" or bool(((arr < 0) | (arr >= vocab)).any())):
                raise RequestError(f"stop_token_ids must be token ids in 0..{vocab - 1}, got {arr[:5].tolist()}")
            stops = frozenset(int(x) for x in arr)
        if sampling is None or isinstance(sampling, SamplingParams):
            params = sampling
        elif isinstance(sampling, Mapping):
            unknown = sorted(set(sampling) - {f.name for f in dataclasses.fields(SamplingParams)})
            if unknown:
                raise RequestError(f"unknown sampling parameter(s): {', '.join(map(str, unknown))}")
            try:
                params = SamplingParams(**sampling)
            except SamplingError as exc:
                raise RequestError(str(exc)) from None
        else:
            raise RequestError(f"sampling must be a dict or SamplingParams, got {type(sampling).__name__}")
        return stops, params

    def check_rules(self, rules: Any) -> DecodingRules | None:
        """A request's decoding rules (a :class:`~dash_trt.serving.rules.DecodingRules` or a dict of
        its fields; :class:`RequestError` naming the bad one)."""
        if rules is None or isinstance(rules, DecodingRules):
            out = rules
        elif isinstance(rules, Mapping):
            unknown = sorted(set(rules) - {f.name for f in dataclasses.fields(DecodingRules)})
            if unknown:
                raise RequestError(f"unknown decoding rule(s): {', '.join(map(str, unknown))}")
            try:
                out = DecodingRules(**rules)
            except RulesError as exc:
                raise RequestError(str(exc)) from None
        else:
            raise RequestError(f"rules must be a dict or DecodingRules, got {type(rules).__name__}")
        if out is not None and out.page_guard and self.model_config.eos_token_id is None:
            raise RequestError("the page-count guard needs an eos_token_id, and this model's config sets none")
        if out is not None and out.page_guard and self.model_config.page_token_id is None:
            raise RequestError("the page-count guard needs document pages, and this model has none")
        return out

    def check_image_features(self, features: Any, ids: list[int]) -> torch.Tensor | None:
        """A request's image features as a float32 tensor [image tokens, image_feature_dim], or
        :class:`RequestError`: the model must take them, one finite row per ``<image>`` token."""
        if features is None:
            return None
        cfg = self.model_config
        if cfg.image_feature_dim is None:
            raise RequestError(
                "this model takes no image_features (its config sets no image_feature_dim): send "
                "input_ids only; image tokens are embedded from the token table"
            )
        arr = np.asarray(features)
        if arr.ndim != 2 or arr.shape[1] != cfg.image_feature_dim:
            raise RequestError(f"image_features must be [image tokens, {cfg.image_feature_dim}], got {list(arr.shape)}")
        n_img = ids.count(cfg.image_token_id)
        if arr.shape[0] != n_img:
            raise RequestError(
                f"image_features has {arr.shape[0]} rows, the prompt has {n_img} <image> tokens "
                f"(id {cfg.image_token_id}): give one row per image token, in order"
            )
        if arr.dtype.kind != "f" or not np.isfinite(arr).all():
            raise RequestError("image_features must be finite floating-point values")
        return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32))

    def submit(
        self,
        prompt: Any,
        max_new_tokens: Any = None,
        *,
        stop_at_eos: bool = True,
        on_event: Callable[[Event], None] | None = None,
        is_cancelled: Callable[[], bool] | None = None,
        tag: Any = None,
        stop_token_ids: Any = None,
        sampling: Any = None,
        image_features: Any = None,
        rules: Any = None,
    ) -> Request:
        """Queue a request (any thread). Raises :class:`RequestError` (nothing queued) if it
        is invalid or the engine is closed; otherwise its events follow from
        :meth:`step` and ``request.result()`` gives the tokens. ``stop_token_ids``: generating
        any of them ends the request (the token is kept, as EOS is); ``sampling``: temperature,
        top_k, top_p and seed (:mod:`dash_trt.serving.sampling`; default greedy); ``image_features``:
        one row per ``<image>`` token (:meth:`check_image_features`); ``rules``: the page-count guard
        and no-repeat n-grams (:meth:`check_rules`)."""
        try:
            stops, params = self.check_options(stop_token_ids, sampling)
            checked_rules = self.check_rules(rules)
            ids, max_new, coords = self.check(prompt, max_new_tokens)
            feats = self.check_image_features(image_features, ids)
        except RequestError:
            with self._lock:
                self.counters["refused"] += 1
            raise
        req = Request(
            id=-1,
            prompt=ids,
            max_new_tokens=max_new,
            stop_at_eos=bool(stop_at_eos),
            on_event=on_event,
            is_cancelled=is_cancelled,
            tag=tag,
            t_submit=time.perf_counter(),
            stop_ids=stops,
            sampling=params,
            rules=checked_rules,
            image_features=feats,
            pages=self._pages(ids),
        )
        req._coords = coords
        if self.runtime.prefix_caching:  # hashed here, on the caller's thread, not the engine's
            req._hashes = self.runtime.block_hashes(ids, feats)
        with self._work:
            if self._closed is not None:
                self.counters["refused"] += 1
                raise RequestError(self._closed, UNAVAILABLE)
            req.id = next(self._ids)
            self._incoming.append(req)
            self.counters["submitted"] += 1
            self._work.notify_all()
        return req

    # --------------------------------------------------------------------- steps
    def has_work(self) -> bool:
        with self._lock:
            return self._queued() or bool(self._to_fail)

    def wait_for_work(self, timeout: float | None = None) -> bool:
        """Block until a request arrives (or ``timeout``); True if there is work to step.
        While paused, block until resumed, closed or the next cancellation poll is due."""
        with self._work:
            if self._paused and not self._closed:
                poll = self.cancel_poll_interval if self.cancel_poll_interval > 0 else 0.05
                self._work.wait(poll if timeout is None else min(timeout, poll))
            elif not (self._queued() or self._to_fail):  # idle (closed and idle too): no spinning
                self._work.wait(timeout)
            return bool(self._to_fail) or (not self._paused and self._queued())

    def _queued(self) -> bool:
        """Requests arrived, waiting or running (under the lock)."""
        return bool(self._incoming or self.scheduler.waiting or self.scheduler.running)

    # ------------------------------------------------------------ operator control
    def pause(self) -> None:
        """Stop running model steps (any thread). Requests are still accepted, admitted
        (their KV blocks reserved) and dropped when cancelled, so an operator can drain or
        inspect the engine, and tests can hold requests in a known state; nothing runs
        until :meth:`resume`."""
        with self._work:
            self._paused = True
            self._work.notify_all()

    def resume(self) -> None:
        """Run model steps again after :meth:`pause` (any thread)."""
        with self._work:
            self._paused = False
            self._work.notify_all()

    @property
    def paused(self) -> bool:
        return self._paused

    def step(self) -> bool:
        """Admit what fits, run one model step, dispatch events. Returns False when idle
        (or paused: then it only admits and drops cancelled requests)."""
        with self._lock:
            while self._incoming:
                req = self._incoming.popleft()
                req.status = "waiting"
                self.scheduler.enqueue(req)
            to_fail, self._to_fail = self._to_fail, []
        for req, reason in to_fail:  # drain()'s queued requests, answered from this thread
            self._fail(req, reason, UNAVAILABLE)
        self._drop_cancelled()
        if self._drain_deadline is not None and self._clock() >= self._drain_deadline:
            # the drain's grace is over (preempted requests wait with their tokens: them too)
            for req in list(self.scheduler.running) + self.scheduler.take_waiting():
                self._fail(req, self._closed or "the server is shutting down", UNAVAILABLE)
        self._admit()
        if self._paused:
            return False
        plan = self.scheduler.plan(self.runtime.seq, self._preempt)
        if not plan:
            return False
        self._run(plan)
        return True

    def run_until_idle(self, max_steps: int | None = None) -> int:
        """Step until every queued request has finished; returns the number of steps."""
        n = 0
        while self.step():
            n += 1
            if max_steps is not None and n >= max_steps:
                break
        return n

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int | None = None,
        *,
        stop_at_eos: bool = True,
        stop_token_ids: Any = None,
        sampling: Any = None,
        image_features: Sequence[Any] | None = None,
    ) -> list[list[int]]:
        """Offline convenience: submit every prompt (with its image features, if given), run
        until done, return the tokens."""
        feats = list(image_features) if image_features is not None else [None] * len(prompts)
        reqs = [
            self.submit(
                p,
                max_new_tokens,
                stop_at_eos=stop_at_eos,
                stop_token_ids=stop_token_ids,
                sampling=sampling,
                image_features=f,
            )
            for p, f in zip(prompts, feats)
        ]
        self.run_until_idle()
        return [r.result(timeout=0) for r in reqs]

    def warmup(self) -> None:
        """One tiny generation (the op's first call pays torch's compile-machinery import) and,
        on the CUDA kernels, the decode graphs' capture: paid before serving, not in the
        first requests' latency. Counters are reset afterwards."""
        cfg = self.model_config
        prompt = document_prompt([1], "", cfg) if cfg.page_token_id is not None else [0, 1]
        self.generate([prompt], 2, stop_at_eos=False)
        self.runtime.capture_decode_graphs()
        self.reset_counters()

    def drain(self, reason: str = "the server is shutting down", grace: float = 5.0) -> int:
        """Graceful shutdown (any thread): refuse new requests, take the queued ones off the
        queue and fail them (code ``unavailable``, with ``reason``) at the next step, let the
        running ones go on for ``grace`` seconds, then fail what is left. Nothing is answered
        from the calling thread: responses go out only from the thread that steps the engine
        (two threads answering at once crashed Triton's Python backend). Returns how many
        queued requests will be failed."""
        with self._work:
            self._closed = reason
            pending = list(self._incoming) + self.scheduler.take_waiting(preempted=False)
            self._incoming.clear()
            self._to_fail.extend((req, reason) for req in pending)
            self._drain_deadline = self._clock() + max(0.0, float(grace))
            self._work.notify_all()
        return len(pending)

    def close(self, reason: str = "the generation engine is shutting down") -> int:
        """Refuse new requests and fail every queued or running one with ``reason``
        (code ``unavailable``). Call it with no step in progress (the runner's
        :meth:`EngineRunner.stop` does). Returns how many requests were failed."""
        with self._work:
            self._closed = reason
            pending = [r for r, _ in self._to_fail] + list(self._incoming) + self.scheduler.take_waiting()
            self._to_fail.clear()
            self._incoming.clear()
            self._work.notify_all()
        running = list(self.scheduler.running)
        for req in pending + running:
            self._fail(req, reason, UNAVAILABLE)
        return len(pending) + len(running)

    # ------------------------------------------------------------------ internals
    def _drop_cancelled(self) -> None:
        now = self._clock()
        if now - self._last_cancel_poll < self.cancel_poll_interval:
            return
        self._last_cancel_poll = now
        for req in list(self.scheduler.waiting) + list(self.scheduler.running):
            if req.is_cancelled is None:
                continue
            try:
                cancelled = bool(req.is_cancelled())
            except Exception:  # a dead request handle counts as cancelled
                cancelled = True
            if cancelled:
                self._fail(req, "request cancelled by the client", CANCELLED)

    def _admit(self) -> None:
        def start(req: Request, cached: list[int]) -> None:
            if req._resume is not None:  # preempted: its tokens come back, its cache is recomputed
                self.runtime.resume(req._resume, cached)
                req._resume = req._hashes = None
                req.status = "running"
                return
            seq = self.runtime.add(
                req.id,
                req.prompt,
                len(req.prompt) if self.scheduler.on_demand else len(req.prompt) + req.max_new_tokens - 1,
                coords=req._coords,
                sampling=req.sampling,
                image_features=req.image_features,
                block_hashes=req._hashes,
                cached_blocks=cached,
                rules=req.rules,
            )
            req.prompt_cached = req.prompt_done = seq.cached_tokens
            self.counters["prompt_tokens_cached"] += seq.cached_tokens
            req._coords = req.image_features = req._hashes = None  # the runtime holds them now
            req.status, req.t_admit = "running", time.perf_counter()
            if req._waited:
                self.counters["waited"] += 1

        self.scheduler.admit(start)
        c, sched = self.counters, self.scheduler
        c["peak_running"] = max(c["peak_running"], len(sched.running))
        c["peak_waiting"] = max(c["peak_waiting"], len(sched.waiting))
        c["peak_pages_running"] = max(c["peak_pages_running"], sum(r.pages for r in sched.running))

    def _preempt(self, req: Request) -> None:
        """The scheduler preempts ``req``: its sequence leaves the runner (blocks freed, tokens
        kept) until it is readmitted."""
        state = self.runtime.preempt(req.id)
        req._resume, req._hashes = state, state.block_hashes
        req.status = "waiting"
        req.preemptions += 1
        self.counters["preempted"] += 1

    def _run(self, plan: list[tuple[Request, int]]) -> None:
        cfg = self.model_config
        self.counters["steps"] += 1
        self._step_no += 1
        pool = self.scheduler.pool
        self.counters["peak_blocks_in_use"] = max(
            self.counters["peak_blocks_in_use"], pool.num_blocks - pool.num_free_blocks
        )
        try:
            result = self.runtime.step([(r.id, n) for r, n in plan])
        except Exception as exc:
            # The planned sequences' cache rows are now undefined: fail them, keep the rest.
            log.exception("model step failed")
            for r, _ in plan:
                self._fail(r, f"internal error in the model step: {type(exc).__name__}: {exc}", INTERNAL)
            self.scheduler.settle()
            return
        chosen, step_no, eos = result.tokens, self._step_no, cfg.eos_token_id
        generated = 0
        for r, n in plan:
            seq = self.runtime.seq(r.id)
            # Tokens below the most the cache ever held are a preempted request's recompute.
            fresh = max(0, seq.fed - max(seq.fed - n, r._high))
            self.counters["tokens_recomputed"] += n - fresh
            r._high = max(r._high, seq.fed)
            new_prompt = max(0, min(seq.fed, seq.prompt_len) - r.prompt_done)
            if new_prompt:
                self.counters["prompt_tokens_computed"] += new_prompt
                r.prompt_done += new_prompt
                if r.on_event is not None:
                    self._emit(Event("progress", r, step=step_no))
            tok = chosen.get(r.id)
            if tok is None:
                continue  # more prompt to prefill
            if r.t_first_token is None:
                r.t_first_token = time.perf_counter()
            r.tokens.append(tok)
            generated += 1
            if r.on_event is not None:
                self._emit(Event("token", r, (tok,), step=step_no))
            if len(r.tokens) >= r.max_new_tokens or (r.stop_at_eos and tok == eos) or tok in r.stop_ids:
                self._finish(r)
        self.counters["tokens_generated"] += generated
        self.scheduler.settle()

    def _release(self, req: Request) -> None:
        if self.scheduler.release(req):
            self.runtime.free(req.id)

    def _finish(self, req: Request) -> None:
        self._release(req)
        req.status, req.t_end = "done", time.perf_counter()
        with self._lock:
            self.counters["done"] += 1
            self.counters["pages_done"] += req.pages
        self._emit(Event("done", req, tuple(req.tokens), step=self._step_no))
        req._finished.set()

    def _fail(self, req: Request, message: str, code: str) -> None:
        if req.finished:
            return
        self._release(req)
        req.status, req.error, req.error_code, req.t_end = "failed", message, code, time.perf_counter()
        with self._lock:
            self.counters["failed"] += 1
        self._emit(Event("error", req, tuple(req.tokens), message, code, step=self._step_no))
        req._finished.set()

    def _emit(self, event: Event) -> None:
        if event.request.on_event is None:
            return
        try:
            event.request.on_event(event)
        except Exception:  # a broken callback must not stop the other requests
            log.exception("event callback of request %s failed", event.request.id)

    def check_invariants(self, plan: Sequence[tuple[Request, int]] = ()) -> list[str]:
        """What is inconsistent in the engine's bookkeeping between steps (empty when all is
        well): the pool's (:meth:`KVBlockPool.check_invariants`), the scheduler's (reservations,
        limits, ``plan`` within ``max_batch_tokens``), no finished request queued or running.
        For tests and debugging."""
        sched = self.scheduler
        problems = sched.pool.check_invariants() + sched.check_invariants(list(plan))
        if any(r.finished for r in sched.running) or any(r.finished for r in sched.waiting):
            problems.append("a finished request is still queued or running")
        return problems

    # ---------------------------------------------------------------- monitoring
    def reset_counters(self) -> None:
        """Zero the counters (after a warm-up run, say); the pool state is unaffected."""
        with self._lock:
            self.counters = dict.fromkeys(self.counters, 0)

    def stats(self) -> dict[str, Any]:
        """Pool and queue state and counters (any thread)."""
        pool = self.scheduler.pool
        with self._lock:
            out = dict(self.counters)
            out.update(
                kv_blocks_total=pool.num_blocks,
                kv_blocks_free=pool.num_free_blocks,
                kv_blocks_reserved=self.scheduler.reserved,
                kv_blocks_cached=pool.num_cached_blocks,
                kv_blocks_pinned=pool.num_pinned_blocks,
                kv_on_demand=self.scheduler.on_demand,
                prefix_caching=self.runtime.prefix_caching,
                kv_block_size=pool.block_size,
                running=len(self.scheduler.running),
                waiting=len(self.scheduler.waiting) + len(self._incoming),
                pages_running=sum(r.pages for r in self.scheduler.running),
                pages_waiting=sum(r.pages for r in self.scheduler.waiting) + sum(r.pages for r in self._incoming),
                closed=self._closed is not None,
                paused=self._paused,
            )
        return out


class EngineRunner:
    """Steps a :class:`GenerationEngine` on a background thread while there is work."""

    def __init__(self, engine: GenerationEngine, *, name: str = "dash-engine", idle_timeout: float = 0.5):
        self.engine = engine
        self._stop = threading.Event()
        self._idle_timeout = idle_timeout
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.error: BaseException | None = None

    def start(self) -> EngineRunner:
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                if not self.engine.step():
                    self.engine.wait_for_work(self._idle_timeout)
            except Exception as exc:  # a bug in the engine itself: fail what runs, keep serving
                self.error = exc
                log.exception("generation engine step failed")
                for req in list(self.engine.scheduler.running):
                    self.engine._fail(req, f"internal error in the engine: {type(exc).__name__}: {exc}", INTERNAL)

    def stop(self, reason: str = "the server is shutting down", timeout: float = 30.0) -> int:
        """Stop stepping (after the current step), then, once the stepping thread has ended,
        fail whatever is still queued or running with ``reason`` from this thread: never two
        threads answering at once. Returns how many requests were failed. A thread that does
        not end within ``timeout`` keeps its requests (answering them now would race its own
        answers); that is logged and 0 is returned. (Triton's Python backend calls this from
        ``finalize``, where answers must come from the calling thread.)"""
        self._stop.set()
        with self.engine._work:
            self.engine._work.notify_all()
        if self._thread.ident is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("the generation engine did not stop within %.0f s; its requests were not failed", timeout)
                return 0
        return self.engine.close(reason)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


# -------------------------------------------------------------------- helpers
def _prompt_length(prompt: Any) -> int:
    """Tokens in a prompt, read without converting it (RequestError if it has no length)."""
    if isinstance(prompt, (np.ndarray, torch.Tensor)):
        if prompt.ndim != 1:
            raise RequestError(f"input_ids must be 1-D [num_tokens], got shape {list(prompt.shape)}")
        return int(prompt.shape[0])
    if isinstance(prompt, (str, bytes)):
        raise RequestError("input_ids must be token ids, got a string (tokenize it first: dash_trt.model.tokenize)")
    try:
        return len(prompt)
    except TypeError:
        raise RequestError(f"input_ids must be a sequence of token ids, got {type(prompt).__name__}") from None


def _as_id_array(prompt: Any) -> np.ndarray:
    """Token ids [S] int64 from a list, a 1-D integer numpy array or tensor; RequestError
    otherwise. Vectorised: a 128k-token prompt is a few milliseconds, not a Python loop."""
    if isinstance(prompt, torch.Tensor):
        prompt = prompt.detach().cpu().numpy()
    if isinstance(prompt, np.ndarray):
        if prompt.ndim != 1:
            raise RequestError(f"input_ids must be 1-D [num_tokens], got shape {list(prompt.shape)}")
        if prompt.dtype.kind not in "iu":
            raise RequestError(f"input_ids must hold integer token ids, got dtype {prompt.dtype}")
        return prompt.astype(np.int64, copy=False)
    if isinstance(prompt, (str, bytes)):
        raise RequestError("input_ids must be token ids, got a string (tokenize it first: dash_trt.model.tokenize)")
    try:
        items = list(prompt)
    except TypeError:
        raise RequestError(f"input_ids must be a sequence of token ids, got {type(prompt).__name__}") from None
    if set(map(type, items)) <= {int}:  # the common case, checked at C speed (bool is not int here)
        try:
            return np.array(items, dtype=np.int64)
        except OverflowError:
            raise RequestError("input_ids holds an id that does not fit in int64") from None
    for x in items:  # name the first bad element
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
            raise RequestError(f"input_ids must hold integer token ids, found {x!r} ({type(x).__name__})")
    return np.array([int(x) for x in items], dtype=np.int64)


def _as_int(name: str, value: Any) -> int:
    if isinstance(value, (np.ndarray, torch.Tensor)):
        arr = np.asarray(value.cpu() if isinstance(value, torch.Tensor) else value)
        if arr.size != 1:
            raise RequestError(f"{name} must be one integer, got shape {list(arr.shape)}")
        if arr.dtype.kind not in "iu":
            raise RequestError(f"{name} must be an integer, got dtype {arr.dtype}")
        return int(arr.reshape(-1)[0])
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise RequestError(f"{name} must be an integer, got {value!r}")
    return int(value)
