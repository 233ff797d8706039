"""The KV block pool: which physical KV blocks each sequence holds, the prefix cache of
shared prompt blocks, and the host-side metadata of a step (:class:`~dash_trt.attention.dash.paged.BatchHost`).

One pool serves every layer's cache (the blocks of a sequence are the same in each layer).
:func:`blocks_for` (:mod:`.kv`, named here too) is the one place "KV blocks for N tokens" is
computed; :func:`prefix_block_hashes` (:mod:`.kv` too) hashes a prompt's cacheable blocks.
The scheduler owns the pool; the runner sees it through :class:`.kv.KVBlocks`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch

from ..attention.dash.paged import BatchHost, DashBatch
from .kv import blocks_for, prefix_block_hashes

__all__ = ["KVBlockPool", "CacheFullError", "blocks_for", "prefix_block_hashes"]


class CacheFullError(RuntimeError):
    """Not enough free KV blocks for a request; nothing was allocated."""


class KVBlockPool:
    """Allocation of KV blocks to sequences, and the batch metadata of each step.

    ``add`` registers a sequence, optionally with its whole reservation allocated at once
    (``reserve_tokens``: its block table then never changes); ``schedule`` allocates the
    blocks a step needs beyond that for every sequence at once or raises
    :class:`CacheFullError` having allocated none; ``free`` returns a sequence's blocks.
    Lengths advance when a step is scheduled, since the paged operator writes the new tokens
    in place. Each sequence keeps its block ids in a numpy row, so building a step's block
    table is one copy per sequence, not a loop over its blocks.

    Prefix caching: a completed block may be :meth:`register`-ed under a hash of its contents
    (its tokens and everything they depend on). Registered blocks are reference-counted and
    shared read-only: :meth:`match` finds the longest run of them for a list of hashes, and
    ``add(..., cached_blocks=...)`` starts a sequence with them in its table. A registered block
    no sequence holds any more stays cached; allocation takes never-registered free blocks
    first, then evicts cached ones, least recently used first. ``num_free_blocks`` counts
    both (every one of them can be allocated).
    """

    def __init__(self, num_blocks: int, block_size: int, *, shuffle_seed: int | None = None):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.num_blocks = int(num_blocks)
        self.block_size = int(block_size)
        # Hand out low block ids first (a stack of free ids, lowest on top), or with
        # ``shuffle_seed`` in an order shuffled by it (block tables then are not contiguous:
        # tests see that no kernel assumes they are).
        self._free: list[int] = list(range(self.num_blocks - 1, -1, -1))
        if shuffle_seed is not None:
            order = torch.randperm(self.num_blocks, generator=torch.Generator().manual_seed(int(shuffle_seed)))
            self._free = order.tolist()[::-1]
        self._rows: dict[object, np.ndarray] = {}  # block ids (int32), capacity >= count
        self._count: dict[object, int] = {}
        self._lens: dict[object, int] = {}
        self._prompt: dict[object, int] = {}
        self._shared: dict[object, int] = {}  # leading blocks of a row taken from the cache
        # prefix cache
        self._ref = np.zeros(self.num_blocks, dtype=np.int32)  # sequences holding each block
        self._owned = np.zeros(self.num_blocks, dtype=bool)  # allocated by a live sequence
        self._hash_of: dict[int, bytes] = {}
        self._by_hash: dict[bytes, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached, held by no sequence
        self._pinned = 0  # blocks held only through the cache (ref > 0, not owned)

    # -- allocation
    def _take(self) -> int:
        if self._free:
            b = self._free.pop()
        else:  # evict the least recently used cached block
            b, _ = self._lru.popitem(last=False)
            del self._by_hash[self._hash_of.pop(b)]
        self._ref[b], self._owned[b] = 1, True
        return b

    def _release_block(self, b: int, owned: bool, freed: list[int]) -> None:
        self._ref[b] -= 1
        if owned:
            self._owned[b] = False
            if self._ref[b] > 0:
                self._pinned += 1  # still read by sequences that found it in the cache
        elif self._ref[b] == 0:
            self._pinned -= 1
        if self._ref[b] == 0:
            if b in self._hash_of:
                self._lru[b] = None
            else:
                freed.append(b)

    # -- sequences
    def add(
        self,
        seq_id: object,
        prompt_length: int | None = None,
        reserve_tokens: int = 0,
        cached_blocks: Sequence[int] = (),
    ) -> None:
        """Register ``seq_id``; with ``reserve_tokens`` > 0 its blocks for that many tokens
        are allocated now (:class:`CacheFullError`, nothing registered, if they do not fit).
        ``cached_blocks`` (from :meth:`match`) start its table: their tokens count as in the
        cache already, and only the blocks past them are allocated."""
        if seq_id in self._rows:
            raise ValueError(f"sequence {seq_id!r} already exists")
        if prompt_length is not None and prompt_length < 0:
            raise ValueError(f"prompt_length must be None or >= 0, got {prompt_length}")
        if reserve_tokens < 0:
            raise ValueError(f"reserve_tokens must be >= 0, got {reserve_tokens}")
        cached = [int(b) for b in cached_blocks]
        if any(b not in self._hash_of for b in cached):
            raise ValueError("cached_blocks must be registered blocks (from match())")
        want = max(0, blocks_for(reserve_tokens, self.block_size) - len(cached))
        available = len(self._free) + len(self._lru) - sum(1 for b in cached if self._ref[b] == 0)
        if want > available:
            raise CacheFullError(
                f"sequence {seq_id!r} needs {want} KV blocks, only {available} of {self.num_blocks} are free"
            )
        for b in cached:
            if self._ref[b] == 0:
                del self._lru[b]
                if not self._owned[b]:
                    self._pinned += 1
            else:
                self._lru.pop(b, None)
            self._ref[b] += 1
        row = np.empty(max(len(cached) + want, 4), dtype=np.int32)
        row[: len(cached)] = cached
        for j in range(want):
            row[len(cached) + j] = self._take()
        n = len(cached) + want
        self._rows[seq_id], self._count[seq_id], self._lens[seq_id] = row, n, len(cached) * self.block_size
        self._shared[seq_id] = len(cached)
        self._prompt[seq_id] = -1 if prompt_length is None else int(prompt_length)

    def free(self, seq_id: object) -> None:
        row = self._rows.pop(self._known(seq_id))
        n = self._count.pop(seq_id)
        shared = self._shared.pop(seq_id)
        del self._lens[seq_id], self._prompt[seq_id]
        freed: list[int] = []
        for j, b in enumerate(row[:n].tolist()):
            self._release_block(b, j >= shared, freed)
        self._free.extend(sorted(freed, reverse=True))

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._rows

    def length(self, seq_id: object) -> int:
        return self._lens[self._known(seq_id)]

    def blocks(self, seq_id: object) -> list[int]:
        return self._rows[self._known(seq_id)][: self._count[seq_id]].tolist()

    def num_seq_blocks(self, seq_id: object) -> int:
        return self._count[self._known(seq_id)]

    def num_own_blocks(self, seq_id: object) -> int:
        """Blocks of ``seq_id``'s table it allocated (not taken from the prefix cache)."""
        return self._count[self._known(seq_id)] - self._shared[seq_id]

    @property
    def seq_ids(self) -> list[object]:
        """The sequences the pool holds blocks for."""
        return list(self._rows)

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: never-registered free ones and cached ones no
        sequence holds (evicted when taken)."""
        return len(self._free) + len(self._lru)

    @property
    def num_cached_blocks(self) -> int:
        """Registered blocks (held by sequences or not)."""
        return len(self._by_hash)

    @property
    def num_pinned_blocks(self) -> int:
        """Blocks held only through the cache: read by sequences that found them there after the
        sequence that wrote them ended. They count against the pool beside the sequences' own."""
        return self._pinned

    def newly_pinned(self, cached_blocks: Sequence[int]) -> int:
        """How many of ``cached_blocks`` no sequence holds now (taking them pins them)."""
        return sum(1 for b in cached_blocks if self._ref[int(b)] == 0)

    def check_invariants(self) -> list[str]:
        """What is inconsistent in the pool's bookkeeping (empty when all is well): every block
        free, cached-and-unheld, or held, exactly once; reference counts equal to the tables
        that hold a block; ownership and the pinned count as the tables say; the hash maps each
        other's inverse. For tests and debugging (a pass over every table)."""
        problems = []
        refs = np.zeros(self.num_blocks, dtype=np.int64)
        owned = np.zeros(self.num_blocks, dtype=bool)
        for sid, row in self._rows.items():
            n, shared = self._count[sid], self._shared[sid]
            ids = row[:n].tolist()
            if len(set(ids)) != len(ids):
                problems.append(f"sequence {sid!r} holds a block twice: {ids}")
            if self._lens[sid] > n * self.block_size:
                problems.append(f"sequence {sid!r} is {self._lens[sid]} tokens long in {n} blocks")
            for j, b in enumerate(ids):
                refs[b] += 1
                if j >= shared:
                    if owned[b]:
                        problems.append(f"block {b} is owned by two sequences")
                    owned[b] = True
        if not np.array_equal(refs, self._ref):
            bad = np.nonzero(refs != self._ref)[0][:5].tolist()
            problems.append(f"reference counts differ from the tables at blocks {bad}")
        if not np.array_equal(owned, self._owned):
            bad = np.nonzero(owned != self._owned)[0][:5].tolist()
            problems.append(f"ownership differs from the tables at blocks {bad}")
        pinned = int(((refs > 0) & ~owned).sum())
        if pinned != self._pinned:
            problems.append(f"{self._pinned} blocks counted as pinned, the tables pin {pinned}")
        free, lru = self._free, list(self._lru)
        if len(set(free)) != len(free):
            problems.append("a block is on the free list twice")
        held = set(np.nonzero(refs > 0)[0].tolist())
        for name, group in (("free", set(free)), ("cached", set(lru))):
            if group & held:
                problems.append(f"blocks both {name} and held: {sorted(group & held)[:5]}")
        if set(free) & set(lru):
            problems.append(f"blocks both free and cached: {sorted(set(free) & set(lru))[:5]}")
        if len(free) + len(lru) + len(held) != self.num_blocks:
            problems.append(
                f"{len(free)} free + {len(lru)} cached + {len(held)} held blocks, not the pool's {self.num_blocks}"
            )
        if any(b in self._hash_of for b in free):
            problems.append("a registered block is on the free list")
        if any(b not in self._hash_of for b in lru):
            problems.append("an unregistered block is in the cache's LRU")
        if {h: b for b, h in self._hash_of.items()} != self._by_hash:
            problems.append("the hash maps are not each other's inverse")
        return problems

    # -- prefix cache
    def register(self, seq_id: object, index: int, block_hash: bytes) -> bool:
        """Record block ``index`` of ``seq_id`` (completely written, never written again) as
        the block of ``block_hash``; False when that hash has a block already or this block
        has a hash."""
        b = int(self._rows[self._known(seq_id)][index])
        if block_hash in self._by_hash or b in self._hash_of:
            return False
        self._hash_of[b], self._by_hash[block_hash] = block_hash, b
        return True

    def match(self, hashes: Sequence[bytes]) -> list[int]:
        """The blocks of the longest prefix of ``hashes`` in the cache (most recently used
        from now on)."""
        out = []
        for h in hashes:
            b = self._by_hash.get(h)
            if b is None:
                break
            out.append(b)
            if b in self._lru:
                self._lru.move_to_end(b)
        return out

    def clear_cache(self) -> None:
        """Forget every registered block (the held ones stay with their sequences)."""
        for b in list(self._lru):
            self._free.append(b)
        self._lru.clear()
        self._hash_of.clear()
        self._by_hash.clear()
        self._free.sort(reverse=True)

    def blocks_needed(self, seq_id: object, num_new_tokens: int) -> int:
        total = self._lens[self._known(seq_id)] + int(num_new_tokens)
        return max(0, blocks_for(total, self.block_size) - self._count[seq_id])

    def _append(self, seq_id: object, n: int) -> None:
        row, count = self._rows[seq_id], self._count[seq_id]
        if count + n > row.size:
            grown = np.empty(max(2 * row.size, count + n), dtype=np.int32)
            grown[:count] = row[:count]
            self._rows[seq_id] = row = grown
        for j in range(n):
            row[count + j] = self._take()
        self._count[seq_id] = count + n

    # -- steps
    def advance_within(self, seq_ids: Sequence[object], n: int = 1) -> bool:
        """Advance each sequence by ``n`` tokens if every one stays within the blocks it holds
        (a decode step of sequences whose reservation was allocated up front): True, lengths
        advanced, tables unchanged. False, nothing changed, if one would need a new block."""
        lens, count, bs = self._lens, self._count, self.block_size
        if any(lens[s] + n > count[s] * bs for s in seq_ids):
            return False
        for s in seq_ids:
            lens[s] += n
        return True

    def schedule_host(self, step: Sequence[tuple[object, int]], table_width: int | None = None) -> BatchHost:
        """Reserve blocks for ``step`` = [(seq_id, num_new_tokens), ...] and return the
        batch metadata for that call as numpy arrays."""
        ids = [sid for sid, _ in step]
        if len(set(ids)) != len(ids):
            raise ValueError("a sequence may appear only once per step")
        need = 0
        for sid, n in step:
            if int(n) <= 0:
                raise ValueError(f"sequence {sid!r}: number of new tokens must be positive, got {n}")
            need += self.blocks_needed(sid, n)
        if need > self.num_free_blocks:
            raise CacheFullError(
                f"step needs {need} more KV blocks, only {self.num_free_blocks} of {self.num_blocks} are free"
            )
        counts = np.empty(len(step), dtype=np.int32)
        for i, (sid, n) in enumerate(step):
            extra = self.blocks_needed(sid, n)
            if extra:
                self._append(sid, extra)
            self._lens[sid] += int(n)
            counts[i] = n
        width = max(self._count[sid] for sid in ids)
        if table_width is not None:
            if table_width < width:
                raise ValueError(f"table_width {table_width} < blocks of the longest sequence ({width})")
            width = table_width
        table = np.full((len(ids), width), -1, dtype=np.int32)
        for i, sid in enumerate(ids):
            c = self._count[sid]
            table[i, :c] = self._rows[sid][:c]
        qsl = np.zeros(len(ids) + 1, dtype=np.int32)
        np.cumsum(counts, out=qsl[1:])
        return BatchHost(
            block_tables=table,
            seq_lens=np.array([self._lens[s] for s in ids], dtype=np.int32),
            query_start_loc=qsl,
            prompt_lens=np.array([self._prompt[s] for s in ids], dtype=np.int32),
        )

    def schedule(
        self,
        step: Sequence[tuple[object, int]],
        device: str | torch.device = "cpu",
        table_width: int | None = None,
    ) -> DashBatch:
        """:meth:`schedule_host`, with the metadata on ``device`` (one copy) and
        ``max_query_len`` set."""
        host = self.schedule_host(step, table_width)
        most = int(max(n for _, n in step))
        return DashBatch.from_host(host, device, max_query_len=most)

    def _known(self, seq_id: object) -> object:
        if seq_id not in self._rows:
            raise KeyError(f"unknown sequence {seq_id!r}")
        return seq_id
