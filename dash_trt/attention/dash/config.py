"""Typed, validated DASH attention configuration: Unlimited-OCR-2's ``sparse_attention_config``.

A model's ``config.json`` carries a top-level ``sparse_attention_config`` section, the ``sp``
dict of the DASH layer that Baidu's Unlimited-OCR-2 checkpoints ship and vLLM 0.34.0 serves
(``vllm/model_executor/layers/dash_attention.py``). :class:`DashConfig` is the one place those
keys are declared (name, type, default, allowed range, meaning); the reference, the paged
operator, the exporter and the plugin attribute table all read them from here.

Validation happens once, when the config is built: missing required keys, wrong types,
non-positive sizes, non-finite numbers and the flags Unlimited-OCR-2 fixes (refused with
vLLM's own reason) raise :class:`DashConfigError` naming the key. Keys that neither this
package nor vLLM's DASH layer reads are accepted and listed once in a warning (a real
checkpoint's section may carry training keys); the three routing keys of an earlier,
withdrawn rule of this package are refused with what replaced them. Head dims are known
only at the call site, so :meth:`DashConfig.check_head_dim` and
:meth:`DashConfig.check_index_dim` run at the operators' boundary.

Per-layer values (``dash_scale_per_layer``, ``dash_floor_per_layer``) are indexed by the
layer's *slot*, the number of DASH layers before it in ``sparse_attention_freq``;
:meth:`DashConfig.routing` resolves them for one layer, and :meth:`DashConfig.for_layer`
gives the single-layer config an exported node carries.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

__all__ = [
    "DashConfig",
    "DashConfigError",
    "LayerRouting",
    "CONFIG_SECTION",
    "FREQ_MODES",
    "ROUTE_TOP_M",
    "REQUIRED_FLAGS",
    "WITHDRAWN_KEYS",
    "as_config",
]

#: Name of the section in a Hugging-Face-style ``config.json`` (top level, as Unlimited-OCR-2's).
CONFIG_SECTION = "sparse_attention_config"

#: The section name of the withdrawn schema (dash-trt before Unlimited-OCR-2's rule).
OLD_CONFIG_SECTION = "dash_attention_config"

#: Blocks ranked by routing before the entmax prior (a constant of the published model).
ROUTE_TOP_M = 16

#: Accepted values of the two ``*_tok_freq_mode`` keys. The function only tests
#: ``== "truncate"``; any other spelling would silently mean "default", so we accept
#: an explicit list and reject the rest.
FREQ_MODES = (None, "default", "truncate")

#: Flags vLLM 0.34.0 requires in the section, with the only value it accepts
#: (``UnlimitedOCRForCausalLMConfig.verify_and_update_model_config``).
REQUIRED_FLAGS: dict[str, Any] = {
    "training_stage": "dash",
    "dash_stage0": "head_cls",
    "sparse_main_rope_mode": "page2d",
    "sparse_rope_mode": "page2d",
    "sparse_rope_page_span": 0,
    "use_sparse_attention": True,
    "image_bucket_constraint": True,
    "dash_image_only": True,
}

#: Keys of dash-trt's earlier, invented routing rule, with what replaced them.
WITHDRAWN_KEYS = {
    "sparse_topk_blocks": "dash_topk_blocks (the blocks kept of the top 16; one value for every layer)",
    "sparse_dense_layers": "nothing: every layer of the model is a DASH layer (sparse_attention_freq)",
    "sparse_page_bias": "nothing: each kept block's bias is its log entmax prior, centred, over dash_sigma",
}


class DashConfigError(ValueError):
    """A DASH attention configuration is missing a key or holds a bad value."""


class LayerRouting(NamedTuple):
    """Routing values of one layer, per-layer lists resolved (docs/spec.md step 4)."""

    topk: int  #: K: blocks kept of the top ROUTE_TOP_M
    sigma: float  #: divisor of the centred log prior
    scale: float  #: routing scale: x = score * scale / sqrt(sparse_index_dim)
    floor: float  #: floor under the entmax prior before the log


def _key(
    doc: str,
    *,
    default: Any = dataclasses.MISSING,
    minimum: float | None = None,
    kind: str = "int",
    attribute: bool = True,
) -> Any:
    """Declare one configuration key: its meaning, default and allowed range. ``attribute``:
    whether an exported node (and the torch op, and the plugin) carries it; the per-layer
    lists, the layer map and the fixed flags are resolved or implied instead."""
    meta = {"doc": doc, "minimum": minimum, "kind": kind, "attribute": attribute}
    if default is dataclasses.MISSING:
        return field(metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class DashConfig:
    """DASH attention hyper-parameters (the ``sp`` dict, typed).

    Field names are exactly the ``sparse_attention_config`` keys.
    """

    sparse_block_size: int = _key("tokens per sparse block (indexer and routing unit)", minimum=1)
    sparse_local_block: int = _key("sparse blocks in the local window", minimum=1)
    sparse_index_dim: int = _key(
        "indexer dim Di (the router's q/k width; equal to the head dim in Unlimited-OCR-2)", minimum=2
    )
    dash_topk_blocks: int = _key("K: blocks each query keeps of its top 16", default=12, minimum=1)
    dash_sigma: float = _key("divisor of each kept block's centred log prior", default=1.0, kind="pos_float")
    dash_scaling_factor: float = _key(
        "routing scale: x = score * scale / sqrt(sparse_index_dim) (a node carries its layer's value)",
        default=128.0,
        kind="float",
    )
    dash_prior_floor: float = _key(
        "floor under the entmax prior before the log (a node carries its layer's value)", default=1e-4, kind="pos_float"
    )
    dash_scale_per_layer: tuple[float, ...] | None = _key(
        "routing scale of each DASH layer (by slot), instead of dash_scaling_factor",
        default=None,
        kind="float_list",
        attribute=False,
    )
    dash_floor_per_layer: tuple[float, ...] | None = _key(
        "prior floor of each DASH layer (by slot), instead of dash_prior_floor",
        default=None,
        kind="pos_float_list",
        attribute=False,
    )
    sparse_attention_freq: tuple[int, ...] | None = _key(
        "per decoder layer, 1 for a DASH layer (unset: every layer); a layer's slot counts the 1s before it",
        default=None,
        kind="freq",
        attribute=False,
    )
    sparse_rope_page_pairs: int = _key("RoPE frequency pairs given to the page coordinate", default=1, minimum=0)
    sparse_rope_tok_theta: float = _key("RoPE base for the token coordinate", default=10000.0, kind="pos_float")
    sparse_rope_page_theta: float = _key("RoPE base for the page coordinate", default=256.0, kind="pos_float")
    sparse_main_rope_tok_freq_mode: str | None = _key(
        'token frequency mode for q/k: "truncate" or default', default=None, kind="mode"
    )
    sparse_rope_tok_freq_mode: str | None = _key(
        'token frequency mode for iq/ik: "truncate" or default', default=None, kind="mode"
    )
    sparse_rope_page_mod: int = _key("page coordinate modulo (0 = off)", default=0, minimum=0)
    dash_query_chunk: int = _key("queries per chunk in the PyTorch paths (memory bound only)", default=2048, minimum=1)
    image_token_id: int | None = _key(
        "token id of image tokens (needed by prompt_page_positions)", default=None, kind="opt_int"
    )
    page_token_id: int | None = _key(
        "token id of the <PAGE> marker (needed by prompt_page_positions)",
        default=None,
        kind="opt_int",
    )
    training_stage: str = _key('fixed "dash"', default="dash", kind="flag", attribute=False)
    dash_stage0: str = _key('fixed "head_cls"', default="head_cls", kind="flag", attribute=False)
    sparse_main_rope_mode: str = _key('fixed "page2d"', default="page2d", kind="flag", attribute=False)
    sparse_rope_mode: str = _key('fixed "page2d"', default="page2d", kind="flag", attribute=False)
    sparse_rope_page_span: int = _key("fixed 0", default=0, kind="flag", attribute=False)
    use_sparse_attention: bool = _key("fixed true", default=True, kind="flag", attribute=False)
    image_bucket_constraint: bool = _key("fixed true", default=True, kind="flag", attribute=False)
    dash_image_only: bool = _key("fixed true", default=True, kind="flag", attribute=False)
    #: Keys of the section that nothing reads (kept for to_dict, not compared).
    ignored_keys: Mapping[str, Any] = field(
        default_factory=dict, compare=False, hash=False, repr=False, metadata={"kind": "ignored", "attribute": False}
    )

    # ------------------------------------------------------------------ building
    @classmethod
    def _fields(cls) -> tuple[dataclasses.Field, ...]:
        return tuple(f for f in dataclasses.fields(cls) if f.metadata["kind"] != "ignored")

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in cls._fields())

    @classmethod
    def required_keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in cls._fields() if f.default is dataclasses.MISSING)

    @classmethod
    def from_dict(cls, sp: Mapping[str, Any], *, strict: bool = False) -> DashConfig:
        """Build from an ``sp`` dict. Keys nothing reads warn (``strict``: raise); the withdrawn
        routing keys always raise."""
        if isinstance(sp, DashConfig):
            return sp
        if not isinstance(sp, Mapping):
            raise DashConfigError(f"DASH config must be a mapping of keys to values, got {type(sp).__name__}")
        old = [k for k in WITHDRAWN_KEYS if k in sp]
        if old:
            raise DashConfigError(
                "; ".join(
                    f"'{k}' belongs to a withdrawn routing rule (not a key of Unlimited-OCR-2): use {WITHDRAWN_KEYS[k]}"
                    for k in old
                )
                + " (docs/spec.md)"
            )
        unknown = {k: sp[k] for k in sorted(sp, key=str) if k not in cls.keys()}
        if unknown:
            msg = (
                f"DASH config key(s) not used by dash-trt, nor by vLLM's DASH layer: "
                f"{', '.join(map(str, unknown))}; they are kept but ignored"
            )
            if strict:
                raise DashConfigError(msg)
            warnings.warn(msg, stacklevel=2)
        missing = [k for k in cls.required_keys() if k not in sp]
        if missing:
            raise DashConfigError(f"DASH config is missing required key(s): {', '.join(missing)}")
        values = {k: _coerce(sp[k]) for k in cls.keys() if k in sp}
        return cls(**values, ignored_keys=unknown)

    @classmethod
    def from_model_config(cls, config: Mapping[str, Any] | str | os.PathLike, *, strict: bool = False) -> DashConfig:
        """Build from a model's ``config.json`` (path or parsed dict), section
        ``sparse_attention_config``."""
        source = "model config"
        if not isinstance(config, Mapping):
            source = os.fspath(config)
            try:
                with open(source, encoding="utf-8") as fh:
                    config = json.load(fh)
            except FileNotFoundError:
                raise DashConfigError(f"model config not found: {source}") from None
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise DashConfigError(f"model config {source} is not valid JSON: {exc}") from None
        if not isinstance(config, Mapping):
            raise DashConfigError(f"{source} must hold a JSON object")
        section = config.get(CONFIG_SECTION)
        if section is None:
            raise DashConfigError(missing_section_message(config, source))
        return cls.from_dict(section, strict=strict)

    def __post_init__(self) -> None:
        for f in self._fields():
            value = getattr(self, f.name)
            if isinstance(value, list):  # built directly with a list: keep the tuple form
                object.__setattr__(self, f.name, value := tuple(value))
            _validate(f, value)
        if not isinstance(self.ignored_keys, Mapping):
            raise DashConfigError("ignored_keys must be a mapping")

    def to_dict(self) -> dict[str, Any]:
        """The ``sp`` dict (JSON-serialisable; tuples become lists; unset lists are left out;
        ignored keys kept)."""
        out = {}
        for k in self.keys():
            v = getattr(self, k)
            if v is None and k in ("dash_scale_per_layer", "dash_floor_per_layer", "sparse_attention_freq"):
                continue
            out[k] = list(v) if isinstance(v, tuple) else v
        out.update(self.ignored_keys)
        return out

    # ------------------------------------------------------------------ derived
    @property
    def local_window(self) -> int:
        """Tokens in the local window (``sparse_local_block * sparse_block_size``)."""
        return self.sparse_local_block * self.sparse_block_size

    @property
    def num_dash_layers(self) -> int | None:
        """DASH layers ``sparse_attention_freq`` lists (None when it is unset: every layer)."""
        return None if self.sparse_attention_freq is None else sum(map(bool, self.sparse_attention_freq))

    def slot(self, layer_idx: int) -> int:
        """The layer's slot: the number of DASH layers before it (its index into the per-layer
        lists). Raises if ``sparse_attention_freq`` says the layer is not a DASH layer."""
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or layer_idx < 0:
            raise DashConfigError(f"layer_idx must be a non-negative integer, got {layer_idx!r}")
        freq = self.sparse_attention_freq
        if freq is None:
            return layer_idx
        if layer_idx >= len(freq):
            raise DashConfigError(f"sparse_attention_freq lists {len(freq)} layers, no entry for layer {layer_idx}")
        if not freq[layer_idx]:
            raise DashConfigError(f"layer {layer_idx} is not a DASH layer (sparse_attention_freq[{layer_idx}] is 0)")
        return sum(map(bool, freq[:layer_idx]))

    def routing(self, layer_idx: int) -> LayerRouting:
        """K, sigma, scale and floor of one layer (per-layer lists indexed by its slot)."""
        slot = self.slot(layer_idx)

        def per_layer(name: str, values: tuple[float, ...] | None, fallback: float) -> float:
            if not values:
                return float(fallback)
            if slot >= len(values):
                raise DashConfigError(
                    f"{name} lists {len(values)} DASH layers, no entry for layer {layer_idx} (slot {slot})"
                )
            return float(values[slot])

        return LayerRouting(
            topk=self.dash_topk_blocks,
            sigma=float(self.dash_sigma),
            scale=per_layer("dash_scale_per_layer", self.dash_scale_per_layer, self.dash_scaling_factor),
            floor=per_layer("dash_floor_per_layer", self.dash_floor_per_layer, self.dash_prior_floor),
        )

    def for_layer(self, layer_idx: int) -> DashConfig:
        """The config of one layer with its routing values resolved: the per-layer lists and the
        layer map dropped, the layer's scale and floor in ``dash_scaling_factor`` and
        ``dash_prior_floor``. ``for_layer(i).routing(any)`` equals ``routing(i)``: what an
        exported node carries."""
        r = self.routing(layer_idx)
        return dataclasses.replace(
            self,
            dash_scaling_factor=r.scale,
            dash_prior_floor=r.floor,
            dash_scale_per_layer=None,
            dash_floor_per_layer=None,
            sparse_attention_freq=None,
            ignored_keys={},
        )

    def check_layers(self, num_layers: int) -> None:
        """A model of ``num_layers`` decoder layers, each with DASH attention: the layer map
        covers every layer with a 1 (vLLM's rule) and the per-layer lists have an entry for each."""
        freq = self.sparse_attention_freq
        if freq is not None and list(map(bool, freq)) != [True] * num_layers:
            raise DashConfigError(
                f"Unlimited-OCR-2 requires DASH in every decoder layer: sparse_attention_freq "
                f"must be [1] * {num_layers}, got {list(freq)}"
            )
        for name in ("dash_scale_per_layer", "dash_floor_per_layer"):
            values = getattr(self, name)
            if values and len(values) < num_layers:
                raise DashConfigError(f"{name} lists {len(values)} DASH layers, the model has {num_layers}")

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

    def check_index_dim(self, dim: int, name: str = "indexer dim Di") -> None:
        """The indexer's width must be ``sparse_index_dim`` (routing divides by its square root)."""
        if dim != self.sparse_index_dim:
            raise DashConfigError(f"{name} is {dim}, the config's sparse_index_dim is {self.sparse_index_dim}")
        self.check_head_dim(dim, name)


def missing_section_message(config: Mapping[str, Any], source: str) -> str:
    """Why ``config`` has no usable DASH section (the old section name gets its own line)."""
    if OLD_CONFIG_SECTION in config:
        return (
            f"{source} has a '{OLD_CONFIG_SECTION}' section, the withdrawn schema of earlier dash-trt "
            f"releases: rename it '{CONFIG_SECTION}' (Unlimited-OCR-2's), add sparse_index_dim, and replace "
            f"sparse_topk_blocks by dash_topk_blocks (sparse_dense_layers and sparse_page_bias are gone; "
            f"docs/spec.md)"
        )
    return f"{source} has no '{CONFIG_SECTION}' section"


def _coerce(value: Any) -> Any:
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

    def check_float(v: Any, positive: bool) -> None:
        if not (_is_int(v) or isinstance(v, float)):
            fail("must be a number")
        if not math.isfinite(v):
            fail("must be finite")
        if positive and v <= 0:
            fail("must be > 0")

    if kind == "int":
        check_int(value)
    elif kind == "opt_int":
        if value is not None:
            check_int(value)
    elif kind in ("float", "pos_float"):
        check_float(value, kind == "pos_float")
    elif kind in ("float_list", "pos_float_list"):
        if value is not None:
            if not isinstance(value, tuple):
                fail("must be a list of numbers, one per DASH layer")
            for v in value:
                check_float(v, kind == "pos_float_list")
    elif kind == "freq":
        if value is not None:
            if not isinstance(value, tuple) or not value:
                fail("must be a non-empty list of 0/1, one per decoder layer")
            if any(v not in (0, 1) for v in value):  # True and False compare equal to 1 and 0
                fail("must hold only 0 and 1")
    elif kind == "mode":
        if value not in FREQ_MODES:
            fail(f"must be one of {FREQ_MODES}")
    elif kind == "flag":
        want = REQUIRED_FLAGS[name]
        if value != want:  # vLLM's test (so 1 passes for true, as it does there)
            raise DashConfigError(f"Unlimited-OCR-2 requires {name}={want!r}, got {value!r}")
    else:  # pragma: no cover - a new kind without a validator is a programming error
        raise AssertionError(f"no validator for kind {kind}")


def as_config(sp: DashConfig | Mapping[str, Any]) -> DashConfig:
    """Accept either a :class:`DashConfig` or an ``sp`` dict (validated)."""
    if isinstance(sp, DashConfig):
        return sp
    return DashConfig.from_dict(sp)
