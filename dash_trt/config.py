"""Typed, validated DASH attention configuration.

The model's ``config.json`` carries a ``dash_attention_config`` section whose keys
are the ``sp`` dict of the reference implementation. :class:`DashConfig` is the one
place those keys are declared (name, type, default, allowed range, meaning); the
reference, the paged operator, the exporter and the plugin attribute table all read
them from here.

Validation happens once, when the config is built: missing required keys, wrong
types, non-positive sizes, non-finite numbers and unknown keys all raise
:class:`DashConfigError` naming the key. Head dims are only known at the call site,
so :meth:`DashConfig.check_head_dim` is called by the operators at their boundary.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "DashConfig",
    "DashConfigError",
    "CONFIG_SECTION",
    "FREQ_MODES",
    "as_config",
]

#: Name of the section in a Hugging-Face-style ``config.json``.
CONFIG_SECTION = "dash_attention_config"

#: Accepted values of the two ``*_tok_freq_mode`` keys. The reference only tests
#: ``== "truncate"``; any other spelling would silently mean "default", so we accept
#: an explicit list and reject the rest.
FREQ_MODES = (None, "default", "truncate")


class DashConfigError(ValueError):
    """A DASH attention configuration is missing a key or holds a bad value."""


def _key(
    doc: str,
    *,
    default: Any = dataclasses.MISSING,
    minimum: float | None = None,
    kind: str = "int",
) -> Any:
    """Declare one configuration key: its meaning, default and allowed range."""
    meta = {"doc": doc, "minimum": minimum, "kind": kind}
    if default is dataclasses.MISSING:
        return field(metadata=meta)
    if isinstance(default, (list, tuple)):
        return field(default_factory=lambda: tuple(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class DashConfig:
    """DASH attention hyper-parameters (the reference's ``sp`` dict, typed).

    Field names are exactly the ``sp`` / ``dash_attention_config`` keys.
    """

    sparse_block_size: int = _key("tokens per sparse block (indexer and routing unit)", minimum=1)
    sparse_local_block: int = _key("sparse blocks in the local window", minimum=1)
    sparse_topk_blocks: int | tuple[int, ...] = _key(
        "remote blocks each query selects: an int, or one int per layer",
        default=16,
        minimum=0,
        kind="int_or_list",
    )
    sparse_dense_layers: tuple[int, ...] = _key(
        "layer indices that select every remote block", default=(), minimum=0, kind="int_list"
    )
    sparse_page_bias: float = _key(
        "logit bias added to tokens of forced same-page blocks", default=0.0, kind="float"
    )
    sparse_rope_page_pairs: int = _key(
        "RoPE frequency pairs given to the page coordinate", default=1, minimum=0
    )
    sparse_rope_tok_theta: float = _key(
        "RoPE base for the token coordinate", default=10000.0, minimum=0.0, kind="pos_float"
    )
    sparse_rope_page_theta: float = _key(
        "RoPE base for the page coordinate", default=256.0, minimum=0.0, kind="pos_float"
    )
    sparse_main_rope_tok_freq_mode: str | None = _key(
        'token frequency mode for q/k: "truncate" or default', default=None, kind="mode"
    )
    sparse_rope_tok_freq_mode: str | None = _key(
        'token frequency mode for iq/ik: "truncate" or default', default=None, kind="mode"
    )
    sparse_rope_page_mod: int = _key("page coordinate modulo (0 = off)", default=0, minimum=0)
    dash_query_chunk: int = _key(
        "queries per chunk in the PyTorch paths (memory bound only)", default=2048, minimum=1
    )
    image_token_id: int | None = _key(
        "token id of image tokens (needed by prompt_page_positions)", default=None, kind="opt_int"
    )
    page_token_id: int | None = _key(
        "token id of the <PAGE> marker (needed by prompt_page_positions)",
        default=None,
        kind="opt_int",
    )

    # ------------------------------------------------------------------ building
    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def required_keys(cls) -> tuple[str, ...]:
        return tuple(
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        )

    @classmethod
    def from_dict(cls, sp: Mapping[str, Any], *, strict: bool = True) -> DashConfig:
        """Build from an ``sp`` dict. Unknown keys raise (``strict``) or warn."""
        if isinstance(sp, DashConfig):
            return sp
        if not isinstance(sp, Mapping):
            raise DashConfigError(
                f"DASH config must be a mapping of keys to values, got {type(sp).__name__}"
            )
        unknown = sorted(k for k in sp if k not in cls.keys())
        if unknown:
            msg = (
                f"unknown DASH config key(s): {', '.join(map(str, unknown))}; "
                f"known keys are: {', '.join(cls.keys())}"
            )
            if strict:
                raise DashConfigError(msg)
            warnings.warn(msg, stacklevel=2)
        missing = [k for k in cls.required_keys() if k not in sp]
        if missing:
            raise DashConfigError(f"DASH config is missing required key(s): {', '.join(missing)}")
        values = {k: _coerce(k, sp[k]) for k in cls.keys() if k in sp}
        return cls(**values)

    @classmethod
    def from_model_config(
        cls, config: Mapping[str, Any] | str | os.PathLike, *, strict: bool = True
    ) -> DashConfig:
        """Build from a model's ``config.json`` (path or parsed dict), section
        ``dash_attention_config``."""
        source = "model config"
        if not isinstance(config, Mapping):
            source = os.fspath(config)
            try:
                with open(source, encoding="utf-8") as fh:
                    config = json.load(fh)
            except FileNotFoundError:
                raise DashConfigError(f"model config not found: {source}") from None
            except json.JSONDecodeError as exc:
                raise DashConfigError(f"model config {source} is not valid JSON: {exc}") from None
        if not isinstance(config, Mapping):
            raise DashConfigError(f"{source} must hold a JSON object")
        section = config.get(CONFIG_SECTION)
        if section is None:
            raise DashConfigError(f"{source} has no '{CONFIG_SECTION}' section")
        return cls.from_dict(section, strict=strict)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _validate(f, getattr(self, f.name))

    def to_dict(self) -> dict[str, Any]:
        """The ``sp`` dict (JSON-serialisable; tuples become lists)."""
        out = {}
        for k in self.keys():
            v = getattr(self, k)
            out[k] = list(v) if isinstance(v, tuple) else v
        return out

    # ------------------------------------------------------------------ derived
    @property
    def local_window(self) -> int:
        """Tokens in the local window (``sparse_local_block * sparse_block_size``)."""
        return self.sparse_local_block * self.sparse_block_size

    def is_dense_layer(self, layer_idx: int) -> bool:
        return int(layer_idx) in self.sparse_dense_layers

    def topk_for(self, layer_idx: int) -> int:
        """``sparse_topk_blocks`` for one layer (the per-layer list is indexed)."""
        topk = self.sparse_topk_blocks
        if isinstance(topk, tuple):
            if not 0 <= layer_idx < len(topk):
                raise DashConfigError(
                    f"sparse_topk_blocks has {len(topk)} entries, no entry for layer {layer_idx}"
                )
            return topk[layer_idx]
        return topk

    def check_head_dim(self, dim: int, name: str = "head dim") -> None:
        """RoPE splits ``dim`` into ``dim // 2`` pairs, ``sparse_rope_page_pairs`` of
        them for the page coordinate; at least one must remain for the token."""
        if dim <= 0 or dim % 2:
            raise DashConfigError(f"{name} must be a positive even number, got {dim}")
        if dim // 2 <= self.sparse_rope_page_pairs:
            raise DashConfigError(
                f"{name} {dim} is too small: half of it ({dim // 2}) must be larger than "
                f"sparse_rope_page_pairs ({self.sparse_rope_page_pairs})"
            )


def _coerce(key: str, value: Any) -> Any:
    """JSON gives lists where the dataclass keeps tuples."""
    if isinstance(value, list):
        return tuple(value)
    return value


def _is_int(v: Any) -> bool:
    # bool is an int subclass; a config saying `true` for a size is a mistake.
    return isinstance(v, int) and not isinstance(v, bool)


def _validate(f: dataclasses.Field, value: Any) -> None:
    name, kind, minimum = f.name, f.metadata["kind"], f.metadata["minimum"]

    def fail(what: str) -> None:
        raise DashConfigError(f"DASH config key '{name}' {what}, got {value!r}")

    def check_int(v: Any) -> None:
        if not _is_int(v):
            fail("must be an integer")
        if minimum is not None and v < minimum:
            fail(f"must be >= {minimum}" if minimum else "must not be negative")

    if kind == "int":
        check_int(value)
    elif kind == "opt_int":
        if value is not None:
            check_int(value)
    elif kind == "int_or_list":
        if isinstance(value, tuple):
            if not value:
                fail("must not be an empty list")
            for v in value:
                check_int(v)
        else:
            check_int(value)
    elif kind == "int_list":
        if not isinstance(value, tuple):
            fail("must be a list of integers")
        for v in value:
            check_int(v)
    elif kind in ("float", "pos_float"):
        if not (_is_int(value) or isinstance(value, float)):
            fail("must be a number")
        if not math.isfinite(value):
            fail("must be finite")
        if kind == "pos_float" and value <= 0:
            fail("must be > 0")
    elif kind == "mode":
        if value not in FREQ_MODES:
            fail(f"must be one of {FREQ_MODES}")
    else:  # pragma: no cover - a new kind without a validator is a programming error
        raise AssertionError(f"no validator for kind {kind}")


def as_config(sp: DashConfig | Mapping[str, Any]) -> DashConfig:
    """Accept either a :class:`DashConfig` or an ``sp`` dict (validated)."""
    if isinstance(sp, DashConfig):
        return sp
    return DashConfig.from_dict(sp)
