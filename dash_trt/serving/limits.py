"""The longest request a served model admits, read without building anything (no torch): what
the runner sizes its block tables by, what the repository tells the document model, and what
the front door checks a prompt's length against before tokenizing it."""

from __future__ import annotations

import json
from collections.abc import Mapping

__all__ = ["DEFAULT_MAX_MODEL_LEN", "longest_request"]

#: Longest sequence (prompt + generated tokens) when ``max_model_len`` is not given: the
#: pool's size, at most this (it sets the block-table width of every kernel call).
DEFAULT_MAX_MODEL_LEN = 131072


def longest_request(engine: Mapping | str) -> int:
    """The most tokens (prompt + generated) one request may hold under an engine config (an
    :class:`~dash_trt.serving.engine.EngineConfig`'s dict or JSON): its ``max_model_len``, or
    else the pool's size at most :data:`DEFAULT_MAX_MODEL_LEN`; a pool sized from GPU memory
    (``gpu_memory_fraction``) is not known before it is made, so then the cap itself."""
    e = json.loads(engine) if isinstance(engine, str) else engine
    if int(e.get("max_model_len") or 0) > 0:
        return int(e["max_model_len"])
    if float(e.get("gpu_memory_fraction") or 0) > 0:
        return DEFAULT_MAX_MODEL_LEN
    return min(int(e.get("num_blocks", 512)) * int(e.get("kv_block_size", 16)), DEFAULT_MAX_MODEL_LEN)
