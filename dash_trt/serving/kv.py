"""What the model runner needs of the KV blocks, and nothing more.

The scheduler (:mod:`dash_trt.serving.scheduler`) owns the KV block pool
(:class:`~dash_trt.serving.block_pool.KVBlockPool`): it decides who holds which blocks. The
runner (:class:`~dash_trt.serving.runner.PagedRuntime`) is handed that pool as a
:class:`KVBlocks`, the narrow view it runs steps through (a sequence's blocks taken and given
back as it enters and leaves, completed prompt blocks registered, a step's block tables), and
never imports the pool itself. :func:`blocks_for` is the one place "KV blocks for N tokens" is
computed, :func:`prefix_block_hashes` the one place a prompt's cacheable blocks are hashed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from ..attention.dash.paged import BatchHost

__all__ = ["KVBlocks", "blocks_for", "prefix_block_hashes"]


def blocks_for(tokens: int, block_size: int) -> int:
    """KV blocks of ``block_size`` tokens that hold ``tokens`` tokens."""
    return -(-int(tokens) // int(block_size))


def prefix_block_hashes(
    prompt: Sequence[int],
    image_token_id: int | None,
    block_size: int,
    image_features: torch.Tensor | None = None,
    *,
    seed: bytes = b"",
) -> list[bytes]:
    """Prefix-cache hashes of a prompt's cacheable KV blocks, chained (each covers its block
    and everything before it, and ``seed``: what else the blocks' contents depend on, e.g. a
    length scale). Cacheable, for a document model: whole blocks of tokens at or before the
    prompt's last image token, whose page coordinates, and so every cache field, depend on no
    later token (a text token after the last image is coordinated as the question); for a model
    without image tokens (``image_token_id`` None): whole blocks; either way at most up to the
    prompt's second-to-last token, so at least one token is computed. ``image_features`` (a row
    per image token, in order) enter the hash of the blocks that read them."""
    ids = np.asarray(prompt, dtype=np.int64)
    if image_token_id is None:
        n = (ids.size - 1) // block_size
    else:
        images = np.flatnonzero(ids == image_token_id)
        if not images.size:
            return []
        n = min((int(images[-1]) + 1) // block_size, (ids.size - 1) // block_size)
    feats = None
    if image_features is not None and image_token_id is not None:
        feats = np.ascontiguousarray(torch.as_tensor(image_features).detach().float().cpu().numpy())
        rows = np.cumsum(ids == image_token_id) - 1
    out, h = [], b"dash-trt prefix v1 %d" % block_size + (b" " + seed if seed else b"")
    for i in range(n):
        d = hashlib.blake2b(h, digest_size=16)
        chunk = ids[i * block_size : (i + 1) * block_size]
        d.update(chunk.tobytes())
        if feats is not None:
            sel = rows[i * block_size : (i + 1) * block_size][chunk == image_token_id]
            if sel.size:
                d.update(feats[sel].tobytes())
        h = d.digest()
        out.append(h)
    return out


class KVBlocks(Protocol):
    """The KV blocks as the runner sees them (:class:`~dash_trt.serving.block_pool.KVBlockPool`
    is one): ``num_blocks`` blocks of ``block_size`` tokens, shared by every layer's cache."""

    num_blocks: int
    block_size: int

    @property
    def num_free_blocks(self) -> int: ...

    def __contains__(self, seq_id: object) -> bool: ...

    def add(self, seq_id: object, prompt_length: int, reserve_tokens: int, cached_blocks: Sequence[int]) -> None: ...

    def free(self, seq_id: object) -> None: ...

    def match(self, hashes: Sequence[bytes]) -> list[int]: ...

    def register(self, seq_id: object, index: int, block_hash: bytes) -> bool: ...

    def advance_within(self, seq_ids: Sequence[object], n: int = 1) -> bool: ...

    def schedule_host(self, step: Sequence[tuple[object, int]], table_width: int | None = None) -> BatchHost: ...
