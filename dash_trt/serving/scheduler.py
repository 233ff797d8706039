"""Which requests run, and what each step computes.

The :class:`Scheduler` owns the KV block pool (:func:`new_pool` makes it; the engine hands
the same pool to the model runner as a :class:`~dash_trt.serving.kv.KVBlocks`, the narrow view a
step needs), keeps the waiting queue (FIFO) and the running requests and decides,
against the pool, who is admitted, who is preempted and what one step computes; the
engine (:class:`~dash_trt.serving.engine.GenerationEngine`) validates requests, runs what the
scheduler says on the model runner and answers the requests. vLLM v1 splits its engine the
same way (``core/sched/scheduler.py`` over the KV cache manager, the model runner apart).

KV blocks, two policies (``on_demand``):

- **On demand** (the default, as vLLM allocates): a request is admitted when the blocks of
  the tokens it knows (its prompt; after a preemption, its prompt and the tokens it has
  generated) fit in the free blocks, less the blocks it finds in the prefix cache, with a
  watermark of 1% of the pool (at least one block) left free while others run. Its
  sequence grows block by block as it generates. When a step needs more blocks than are free,
  the newest running requests are **preempted by recompute**: their blocks go back to the pool
  (their registered prompt blocks stay in the prefix cache), they go back to the front of the
  queue with their tokens kept, and when readmitted their steps recompute the cache of those
  tokens (in prefill chunks) before the next token is chosen, so their answers are the ones
  they would have had. A request that stops early held only what it used.
- **Worst case up front** (``on_demand=False``): admission reserves ``ceil((prompt +
  max_new_tokens - 1) / kv_block_size)`` blocks (the last generated token is never written to
  the cache), less the cached ones, which it pins; a running sequence never runs out of
  blocks and nothing is preempted, but a request that stops early held more than it used.

Documents are also admitted by their pages (``max_pages``, off by default): a request is
admitted only while the pages of the running requests and its own (``req.pages``, its prompt's
``<PAGE>`` markers) stay within the limit, which bounds the vision and prefill work in flight
and the decode batch's documents without reserving any request's worst-case tokens.

Either way requests that do not fit wait in FIFO order (a large request is not overtaken
forever by small ones), and one request alone always fits (the engine refuses at submit a
request whose worst case exceeds the pool), so the oldest running request always progresses.

A request here is anything with ``id``, ``prompt``, ``max_new_tokens``, ``pages``, ``tokens`` (generated
so far), ``blocks_reserved``, ``_hashes`` (its prefix-cache block hashes or None), ``_resume``
(the runner's state of a preempted request, else None) and ``_waited`` (the engine's
:class:`~dash_trt.serving.engine.Request`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from .block_pool import KVBlockPool
from .kv import blocks_for

__all__ = ["Scheduler", "SchedulerError", "new_pool"]


def new_pool(num_blocks: int, kv_block_size: int, *, shuffle_seed: int | None = None) -> KVBlockPool:
    """A KV block pool of ``num_blocks`` blocks of ``kv_block_size`` tokens: the one place the
    serving side makes one (the scheduler's own; the runner makes one through it only when it
    is run alone, as :func:`dash_trt.model.generate` and the tests do). ``shuffle_seed`` hands
    its blocks out in an order shuffled by that seed (:class:`KVBlockPool`)."""
    return KVBlockPool(int(num_blocks), int(kv_block_size), shuffle_seed=shuffle_seed)


class SchedulerError(RuntimeError):
    """A step cannot get the KV blocks it needs even with every other request preempted (a
    bookkeeping bug: the engine admits no request whose worst case exceeds the pool)."""


class Scheduler:
    """The waiting queue, the running requests and their KV blocks over one pool
    (``num_blocks`` blocks of ``kv_block_size`` tokens), and each step's plan. The scheduler
    owns the pool: ``pool`` (None: a :func:`new_pool` of that size) is ``self.pool``, which the
    engine hands to the runner and asks about blocks."""

    def __init__(
        self,
        pool: KVBlockPool | None = None,
        *,
        num_blocks: int,
        kv_block_size: int,
        max_num_seqs: int,
        max_batch_tokens: int,
        prefill_chunk: int,
        on_demand: bool = True,
        max_pages: int = 0,
    ):
        self.pool = pool if pool is not None else new_pool(num_blocks, kv_block_size)
        self.num_blocks = num_blocks
        self.kv_block_size = kv_block_size
        self.max_num_seqs = max_num_seqs
        self.max_batch_tokens = max_batch_tokens
        self.prefill_chunk = prefill_chunk
        self.on_demand = bool(on_demand)
        #: most document pages (``req.pages``) running at once; 0: no limit
        self.max_pages = int(max_pages)
        self.waiting: deque[Any] = deque()
        self.running: list[Any] = []
        #: KV blocks counted for the running requests: on demand, the blocks of their own they
        #: hold (after the last step); worst case, their reservations (past their cached prefixes)
        self.reserved = 0
        self.preemptions = 0  #: requests preempted so far

    @staticmethod
    def known_tokens(req: Any) -> int:
        """Tokens of ``req`` the model has seen or will see first: its prompt, and what it
        generated before a preemption."""
        return len(req.prompt) + (len(req.tokens) if req._resume is not None else 0)

    def reservation(self, req: Any, cached: int = 0) -> int:
        """Blocks ``req`` takes at admission beyond ``cached`` blocks found in the prefix cache:
        on demand, its known tokens' blocks; worst case, every block it may ever need (the last
        generated token is never written to the cache)."""
        tokens = self.known_tokens(req) if self.on_demand else len(req.prompt) + req.max_new_tokens - 1
        return blocks_for(tokens, self.kv_block_size) - cached

    def enqueue(self, req: Any) -> None:
        self.waiting.append(req)

    def _fits(self, own: int, newly_pinned: int) -> bool:
        pool = self.pool
        if self.on_demand:
            # The blocks it takes (cached ones no sequence holds leave the free count too), and
            # a watermark of 1% of the pool (at least a block) while others run, for their growth.
            watermark = max(1, self.num_blocks // 100) if self.running else 0
            return own + newly_pinned + watermark <= pool.num_free_blocks
        return self.reserved + pool.num_pinned_blocks + newly_pinned + own <= self.num_blocks

    def _pages_fit(self, req: Any) -> bool:
        """Whether ``req``'s document pages fit under ``max_pages`` beside the running ones (a
        request alone always fits, whatever its page count)."""
        if self.max_pages <= 0 or not self.running:
            return True
        return sum(r.pages for r in self.running) + req.pages <= self.max_pages

    def admit(self, start: Callable[[Any, list[int]], None]) -> int:
        """Admit waiting requests in FIFO order while they fit (blocks, ``max_num_seqs`` and
        ``max_pages``);
        ``start(request, cached_blocks)`` puts each on the model runner as it is admitted
        (its blocks are taken then, which the next admission reads). Returns how many were
        admitted; the ones left have waited."""
        pool, n = self.pool, 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if not self._pages_fit(req):
                break  # FIFO, as for blocks
            cached = pool.match(req._hashes) if req._hashes else []
            own = self.reservation(req, len(cached))
            if not self._fits(own, pool.newly_pinned(cached)):
                break  # FIFO: the head waits for blocks; the ones behind it wait for the head
            self.waiting.popleft()
            req.blocks_reserved = own
            self.reserved += own
            start(req, cached)
            self.running.append(req)
            n += 1
        for req in self.waiting:  # left waiting for blocks or a sequence slot
            req._waited = True
        return n

    def plan(self, seq: Callable[[Any], Any], preempt: Callable[[Any], None]) -> list[tuple[Any, int]]:
        """One step: a decode token for each running sequence with one token pending, then
        chunks (at most ``prefill_chunk`` tokens each: a prompt, or a preempted request's
        tokens being recomputed) in admission order within what is left of
        ``max_batch_tokens``. ``seq(id)`` is the runner's state of a sequence (``fed``,
        ``prompt_len``, ``pending``). When the step needs more KV blocks than are free, the
        newest running requests are preempted (``preempt(request)`` takes each off the
        runner) until it fits."""
        while True:
            states = [(r, seq(r.id)) for r in self.running]
            plan = [(r, 1) for r, s in states if s.pending == 1 and s.fed >= s.prompt_len]
            budget = self.max_batch_tokens - len(plan)
            for r, s in states:
                if s.pending == 1 and s.fed >= s.prompt_len:
                    continue
                if budget <= 0:
                    break
                n = min(s.pending, self.prefill_chunk, budget)
                plan.append((r, n))
                budget -= n
            need = sum(self.pool.blocks_needed(r.id, n) for r, n in plan)
            if need <= self.pool.num_free_blocks:
                return plan
            if len(self.running) < 2:
                raise SchedulerError(
                    f"request {self.running[0].id if self.running else '?'} needs {need} more KV blocks, "
                    f"{self.pool.num_free_blocks} are free and no other request runs"
                )
            victim = self.running.pop()
            self.reserved -= victim.blocks_reserved
            victim.blocks_reserved = 0
            preempt(victim)
            self.waiting.appendleft(victim)
            self.preemptions += 1

    def settle(self) -> None:
        """After a step, on demand: each running request's count is the blocks of its own it
        holds now (its sequence grew)."""
        if not self.on_demand:
            return
        total = 0
        for r in self.running:
            r.blocks_reserved = self.pool.num_own_blocks(r.id)
            total += r.blocks_reserved
        self.reserved = total

    def release(self, req: Any) -> bool:
        """Take ``req`` off the queue or the running set; True if it was running (the caller
        frees its sequence on the runner)."""
        if req in self.running:
            self.running.remove(req)
            self.reserved -= req.blocks_reserved
            return True
        if req in self.waiting:
            self.waiting.remove(req)
        return False

    def take_waiting(self, *, preempted: bool = True) -> list[Any]:
        """Take the requests off the waiting queue (a drain or close) and return them; with
        ``preempted=False`` the preempted ones stay (they were running: a drain lets them
        finish within its grace)."""
        out = [r for r in self.waiting if preempted or r._resume is None]
        self.waiting = deque(r for r in self.waiting if r not in out)
        return out

    def check_invariants(self, plan: list[tuple[Any, int]] = ()) -> list[str]:
        """What is inconsistent here (empty when all is well): the blocks counted against the
        running requests' (on demand: what each holds of its own; worst case: each within its
        reservation), the pool holding exactly the running sequences, the limits, ``plan``
        within ``max_batch_tokens`` and the free blocks."""
        pool = self.pool
        problems = []
        if self.reserved != sum(r.blocks_reserved for r in self.running):
            problems.append(
                f"{self.reserved} blocks reserved, the running requests reserved "
                f"{sum(r.blocks_reserved for r in self.running)}"
            )
        ids = {r.id for r in self.running}
        in_pool = set(pool.seq_ids)
        if ids != in_pool:
            problems.append(f"running {sorted(ids)} but the pool holds sequences {sorted(in_pool, key=str)}")
        for r in self.running:
            own = pool.num_own_blocks(r.id) if r.id in in_pool else 0
            if self.on_demand and own != r.blocks_reserved:
                problems.append(f"request {r.id} holds {own} blocks of its own, counted {r.blocks_reserved}")
            if not self.on_demand and own > r.blocks_reserved:
                problems.append(f"request {r.id} holds {own} blocks of its own, reserved {r.blocks_reserved}")
        for r in self.waiting:
            if r.id in in_pool:
                problems.append(f"request {r.id} is waiting but holds blocks")
        if len(self.running) > self.max_num_seqs:
            problems.append(f"{len(self.running)} running, max_num_seqs {self.max_num_seqs}")
        if self.reserved + pool.num_pinned_blocks > self.num_blocks:
            problems.append(f"{self.reserved} reserved + {pool.num_pinned_blocks} pinned > {self.num_blocks} blocks")
        if sum(n for _, n in plan) > self.max_batch_tokens:
            problems.append(f"a step of {sum(n for _, n in plan)} tokens, over max_batch_tokens")
        if plan and sum(pool.blocks_needed(r.id, n) for r, n in plan) > pool.num_free_blocks:
            problems.append("a step needs more KV blocks than are free")
        return problems
