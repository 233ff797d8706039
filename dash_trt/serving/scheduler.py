"""Which requests run, and what each step computes.

The :class:`Scheduler` keeps the waiting queue (FIFO) and the running requests and decides,
against the KV block pool, who is admitted and what one step computes; the engine
(:class:`~dash_trt.serving.engine.GenerationEngine`) validates requests, runs what the
scheduler says on the model runner and answers the requests. vLLM v1 splits its engine the
same way (``core/sched/scheduler.py`` over the KV cache manager, the model runner apart).

Admission reserves a request's worst case up front: ``ceil((prompt + max_new_tokens - 1) /
kv_block_size)`` KV blocks, less the blocks it finds in the prefix cache, which it pins (held
by no sequence now, they count against the pool beside the reservations). A running sequence
never runs out of blocks, so nothing is preempted. Requests that do not fit wait in FIFO order:
a large request is not overtaken forever by small ones.

A request here is anything with ``prompt``, ``max_new_tokens``, ``blocks_reserved``,
``_hashes`` (its prefix-cache block hashes or None), ``_waited`` and ``id`` (the engine's
:class:`~dash_trt.serving.engine.Request`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from .block_pool import KVBlockPool, blocks_for

__all__ = ["Scheduler"]


class Scheduler:
    """The waiting queue, the running requests and their KV block reservations over one pool
    (``num_blocks`` blocks of ``kv_block_size`` tokens), and each step's plan."""

    def __init__(
        self,
        pool: KVBlockPool,
        *,
        num_blocks: int,
        kv_block_size: int,
        max_num_seqs: int,
        max_batch_tokens: int,
        prefill_chunk: int,
    ):
        self.pool = pool
        self.num_blocks = num_blocks
        self.kv_block_size = kv_block_size
        self.max_num_seqs = max_num_seqs
        self.max_batch_tokens = max_batch_tokens
        self.prefill_chunk = prefill_chunk
        self.waiting: deque[Any] = deque()
        self.running: list[Any] = []
        #: KV blocks reserved by the running requests (their own, past their cached prefixes)
        self.reserved = 0

    def reservation(self, req: Any, cached: int = 0) -> int:
        """Blocks ``req`` reserves beyond ``cached`` blocks found in the prefix cache: its
        worst case (the last generated token is never written to the cache)."""
        return blocks_for(len(req.prompt) + req.max_new_tokens - 1, self.kv_block_size) - cached

    def enqueue(self, req: Any) -> None:
        self.waiting.append(req)

    def admit(self, start: Callable[[Any, list[int]], None]) -> int:
        """Admit waiting requests in FIFO order while they fit (blocks and ``max_num_seqs``);
        ``start(request, cached_blocks)`` puts each on the model runner as it is admitted
        (the pool's pinned count, which the next admission reads, changes then). Returns how
        many were admitted; the ones left have waited."""
        pool, n = self.pool, 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            cached = pool.match(req._hashes) if req._hashes else []
            own = self.reservation(req, len(cached))
            if self.reserved + pool.num_pinned_blocks + pool.newly_pinned(cached) + own > self.num_blocks:
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

    def plan(self, seq: Callable[[Any], Any]) -> list[tuple[Any, int]]:
        """One step: a decode token for each running sequence whose prompt is in the cache,
        then prefill chunks (at most ``prefill_chunk`` tokens each) in admission order within
        what is left of ``max_batch_tokens``. ``seq(id)`` is the runner's state of a sequence
        (``fed``, ``prompt_len``, ``pending``)."""
        states = [(r, seq(r.id)) for r in self.running]
        plan = [(r, 1) for r, s in states if s.fed >= s.prompt_len]
        budget = self.max_batch_tokens - len(plan)
        for r, s in states:
            if s.fed >= s.prompt_len:
                continue
            if budget <= 0:
                break
            n = min(s.pending, self.prefill_chunk, budget)
            plan.append((r, n))
            budget -= n
        return plan

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

    def take_waiting(self) -> list[Any]:
        """Empty the waiting queue (a drain or close): the requests that were in it."""
        out = list(self.waiting)
        self.waiting.clear()
        return out

    def check_invariants(self, plan: list[tuple[Any, int]] = ()) -> list[str]:
        """What is inconsistent here (empty when all is well): the reservation against the
        running requests', each within it, the pool holding exactly the running sequences,
        the limits, ``plan`` within ``max_batch_tokens``."""
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
            if own > r.blocks_reserved:
                problems.append(f"request {r.id} holds {own} blocks of its own, reserved {r.blocks_reserved}")
        if len(self.running) > self.max_num_seqs:
            problems.append(f"{len(self.running)} running, max_num_seqs {self.max_num_seqs}")
        if self.reserved + pool.num_pinned_blocks > self.num_blocks:
            problems.append(f"{self.reserved} reserved + {pool.num_pinned_blocks} pinned > {self.num_blocks} blocks")
        if sum(n for _, n in plan) > self.max_batch_tokens:
            problems.append(f"a step of {sum(n for _, n in plan)} tokens, over max_batch_tokens")
        return problems
