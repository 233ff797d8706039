"""The DASH attention attributes, declared once.

Every front end that carries the configuration as flat scalars reads this table:
the torch custom op's schema (:mod:`dash_trt.attention.dash.ops`), the ONNX ``dash_trt.DashAttention``
node, its ``OpSchema`` and its local function (:mod:`dash_trt.attention.dash.onnx`), and later the
TensorRT plugin creator's field list. The table is generated from the fields of
:class:`~dash_trt.attention.dash.config.DashConfig` that a node carries (plus the per-call ``layer_idx``),
so a new config key shows up everywhere at once and no front end repeats a name as a string
literal.

A node is one layer, so it carries that layer's routing values resolved
(:meth:`DashConfig.for_layer`): ``dash_scaling_factor`` and ``dash_prior_floor`` hold the
layer's scale and floor (its entries of ``dash_scale_per_layer`` / ``dash_floor_per_layer``
when the config has them); the per-layer lists, the layer map ``sparse_attention_freq`` and
the flags Unlimited-OCR-2 fixes are not attributes. Every attribute is a scalar: no list
attribute, so tools that cannot type an empty list (onnx-graphsurgeon) read the node.

Encoding (ONNX attributes have no "optional"):

======================  ============  ==================================================
DashConfig kind         ONNX type     encoding
======================  ============  ==================================================
int                     INT           as is
opt_int (None allowed)  INT           ``-1`` for None (token ids are never negative)
float, pos_float        FLOAT         as is
mode (None allowed)     STRING        ``""`` for None
======================  ============  ==================================================

``decode(encode(cfg, layer)) == (cfg.for_layer(layer), layer)`` for every valid config.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...versions import PLUGIN_VERSION
from .config import DashConfig

__all__ = [
    "Attribute",
    "CONFIG_ATTRIBUTES",
    "CALL_ATTRIBUTES",
    "OP_ATTRIBUTES",
    "NODE_ATTRIBUTES",
    "ONNX_DOMAIN",
    "PLUGIN_NAME",
    "PLUGIN_VERSION",
    "PLUGIN_NAMESPACE",
    "PLUGIN_FIELDS",
    "encode",
    "decode",
    "torch_schema_args",
]


#: The node: op type ``DashAttention`` of domain ``dash_trt``; the TensorRT plugin creator
#: registers under the same name (plugins/trt/dash_plugin.h, kPluginName).
ONNX_DOMAIN = "dash_trt"
PLUGIN_NAME = "DashAttention"

#: Namespace the TensorRT plugin creator registers in (ONNX attribute ``plugin_namespace``).
#: TensorRT's ONNX parser from 10.15 on imports a node whose op also has a model-local
#: function as that function unless the node carries a ``plugin_namespace`` attribute (or the
#: parser flag ENABLE_PLUGIN_OVERRIDE is set); 10.7-10.14 prefer a registered plugin anyway.
#: With the attribute, every release looks the creator up by (op type, ``plugin_version``,
#: ``plugin_namespace``).
PLUGIN_NAMESPACE = ""

#: The contract attributes every node carries, with their fixed values.
PLUGIN_FIELDS = {"plugin_version": PLUGIN_VERSION, "plugin_namespace": PLUGIN_NAMESPACE}

#: ONNX attribute type names (``onnx.AttributeProto.AttributeType`` members).
_ONNX_TYPE = {
    "int": "INT",
    "opt_int": "INT",
    "float": "FLOAT",
    "pos_float": "FLOAT",
    "mode": "STRING",
}

#: torch schema type of each ONNX attribute type.
_TORCH_TYPE = {"INT": "int", "FLOAT": "float", "STRING": "str"}


@dataclass(frozen=True)
class Attribute:
    """One flat attribute of the DASH attention op."""

    name: str
    onnx_type: str  #: "INT", "FLOAT" or "STRING"
    default: Any  #: encoded default; ``None`` when the attribute is required
    doc: str
    kind: str  #: DashConfig kind ("int", "mode", ...) or "call" for per-call attributes

    @property
    def torch_type(self) -> str:
        return _TORCH_TYPE[self.onnx_type]

    @property
    def required(self) -> bool:
        return self.default is None


def _encode_value(kind: str, value: Any) -> Any:
    if kind == "opt_int":
        return -1 if value is None else int(value)
    if kind in ("float", "pos_float"):
        return float(value)
    if kind == "mode":
        return "" if value is None else str(value)
    return int(value)


def _decode_value(kind: str, value: Any) -> Any:
    if kind == "opt_int":
        return None if int(value) < 0 else int(value)
    if kind in ("float", "pos_float"):
        return float(value)
    if kind == "mode":
        if isinstance(value, bytes):
            value = value.decode()
        return None if value == "" else str(value)
    return int(value)


def _config_attributes() -> tuple[Attribute, ...]:
    out = []
    for f in dataclasses.fields(DashConfig):
        if not f.metadata["attribute"]:
            continue
        kind = f.metadata["kind"]
        default = None if f.default is dataclasses.MISSING else _encode_value(kind, f.default)
        out.append(Attribute(f.name, _ONNX_TYPE[kind], default, f.metadata["doc"], kind))
    return tuple(out)


#: One attribute per :class:`DashConfig` field a node carries, in field order.
CONFIG_ATTRIBUTES: tuple[Attribute, ...] = _config_attributes()

#: Attributes of one call that are not configuration.
CALL_ATTRIBUTES: tuple[Attribute, ...] = (
    Attribute(
        "layer_idx",
        "INT",
        None,
        "index of the decoder layer (its routing values are already "
        "resolved into the node's attributes; kept to name the layer)",
        "call",
    ),
)

#: What the torch custom op takes as scalar arguments.
OP_ATTRIBUTES: tuple[Attribute, ...] = CONFIG_ATTRIBUTES + CALL_ATTRIBUTES

#: What the ONNX node carries: the op's attributes plus the contract's version and namespace.
NODE_ATTRIBUTES: tuple[Attribute, ...] = OP_ATTRIBUTES + (
    Attribute(
        "plugin_version", "STRING", PLUGIN_VERSION, "version of the DashAttention node/plugin contract", "version"
    ),
    Attribute(
        "plugin_namespace",
        "STRING",
        PLUGIN_NAMESPACE,
        "namespace of the TensorRT plugin creator; marks the node as a plugin node for TensorRT's "
        "ONNX parser (>= 10.15 otherwise imports the model-local function)",
        "version",
    ),
)


def encode(sp: DashConfig | Mapping[str, Any], layer_idx: int) -> dict[str, Any]:
    """Flat attribute values (:data:`OP_ATTRIBUTES` order) of one call: the layer's config
    (:meth:`DashConfig.for_layer`, which refuses a layer that is not a DASH layer)."""
    cfg = sp if isinstance(sp, DashConfig) else DashConfig.from_dict(sp)
    if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or layer_idx < 0:
        raise ValueError(f"layer_idx must be a non-negative integer, got {layer_idx!r}")
    # the layer's values, as cfg.for_layer(layer_idx) holds them (without building a config: this
    # runs inside torch.compile'd code, which cannot trace dataclasses.replace)
    r = cfg.routing(layer_idx)
    resolved = {"dash_scaling_factor": r.scale, "dash_prior_floor": r.floor}
    attrs = {a.name: _encode_value(a.kind, resolved.get(a.name, getattr(cfg, a.name))) for a in CONFIG_ATTRIBUTES}
    attrs["layer_idx"] = int(layer_idx)
    return attrs


def decode(attrs: Mapping[str, Any]) -> tuple[DashConfig, int]:
    """Inverse of :func:`encode` (missing optional attributes take their defaults).

    Raises :class:`~dash_trt.attention.dash.config.DashConfigError` for bad values (validated by
    :class:`DashConfig`) and ``ValueError`` for a missing required attribute.
    """
    sp = {}
    for a in CONFIG_ATTRIBUTES:
        if a.name in attrs:
            sp[a.name] = _decode_value(a.kind, attrs[a.name])
        elif a.required:
            raise ValueError(f"DASH attention attribute '{a.name}' is required")
    if "layer_idx" not in attrs:
        raise ValueError("DASH attention attribute 'layer_idx' is required")
    return DashConfig.from_dict(sp), int(attrs["layer_idx"])


def torch_schema_args() -> str:
    """The op's keyword-only scalar arguments as a torch schema fragment."""
    return ", ".join(f"{a.torch_type} {a.name}" for a in OP_ATTRIBUTES)
