"""``dash-build``: an exported DASH model (ONNX) to a TensorRT engine that runs the DashAttention
plugin.

::

    dash-build model.onnx --plugin build/plugins/trt/libdash_trt_plugin.so --out model.plan \\
        --max-tokens 1,256,8192 --max-seqs 1,16,64 --max-context 32768

Steps: load the plugin library into TensorRT's plugin registry (``load_library``: the library's
``getCreators`` entry point), parse the ONNX file (every DashAttention node becomes a plugin
layer: the nodes carry ``plugin_namespace``, which TensorRT >= 10.15's parser needs to prefer
the plugin over the node's ONNX function; 10.8-10.14 prefer a registered plugin anyway; a file
exported without it is parsed again with ``OnnxParserFlag.ENABLE_PLUGIN_OVERRIDE`` where that
flag exists), build one optimization profile from the model's dynamic
dims and the limits below, turn on aliased plugin I/O (``PreviewFeature.ALIASED_PLUGIN_IO_10_03``)
when the network has plugin layers, so the paged caches are written in place, build, save the
plan and the timing cache, and print the engine's layer summary (engine inspector).

Dynamic dims are recognised by their ONNX names (:data:`DIM_ROLES`, what ``dash-export`` writes;
``name + k`` is understood, as in ``query_start_loc`` [num_seqs + 1]):

==============  ======================================  ============================================
role            limit option (``MAX`` or ``MIN,OPT,MAX``)  default
==============  ======================================  ============================================
tokens          ``--max-tokens``                        ``1,256,8192`` new tokens per step
seqs            ``--max-seqs``                          ``1,16,64`` sequences per step
width           ``--max-table-width``                   ``ceil(--max-context / KV block size)``
blocks          ``--max-blocks``                        ``1, seqs.opt * width.opt, seqs.max * width.max``
logits          (derived)                               ``1, seqs.opt, max(seqs.max, tokens.max)`` rows scored
images          (derived)                               ``0, tokens.opt, tokens.max`` image feature rows
                                                        (models that take image features)
==============  ======================================  ============================================

Any other dynamic input needs ``--shape NAME:MIN:OPT:MAX`` (dims as ``AxB``, trtexec style).
The DASH configuration is read from the ONNX ``metadata_props`` (key ``sparse_attention_config``,
a JSON object) or the DashAttention nodes' attributes when the ``onnx`` package is installed,
else from ``--config config.json``; it is used to check the KV block size and printed.

Types: strongly typed by default (every type from the ONNX model); ``--fp16``/``--bf16`` build a
weakly typed network on TensorRT 10 (TensorRT 11 is always strongly typed and refuses them).

``--print-trtexec`` prints the equivalent ``trtexec`` command line and exits; it needs the
``onnx`` package (to read the inputs) but not TensorRT. The flags follow the TensorRT version
(``--trt-version``, default the installed one, else 10.8; read from trtexec's
``samples/common/sampleOptions.cpp`` of 10.8.0, 10.15, 10.16, 11.0 and 11.1): 11.x has no
``--fp16``/``--bf16`` and ``--stronglyTyped`` is a no-op there; ``--enablePluginOverride`` (10.15
on) is added only for a file whose nodes lack ``plugin_namespace``. Paths are shell-quoted.

Exit codes: 0 built (or command printed); 1 TensorRT could not parse the model or build the
engine; 2 bad arguments or files, or TensorRT (>= 10.8) not installed.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .attention.dash import attributes as A
from .attention.dash.attributes import PLUGIN_NAME, PLUGIN_NAMESPACE, PLUGIN_VERSION
from .attention.dash.config import CONFIG_SECTION, DashConfig, DashConfigError
from .cliutil import EXIT_CODES_NOTE, cli_main
from .onnx_graph import GraphReadError, read_graph
from .versions import version_line as _version_line

__all__ = [
    "DIM_ROLES",
    "Limit",
    "InputSpec",
    "ProfileError",
    "derive_limits",
    "profile_shapes",
    "trtexec_command",
    "nodes_carry_namespace",
    "load_plugin_library",
    "summarize_engine",
    "BindingMemory",
    "binding_memory",
    "read_profile_record",
    "main",
]

EXIT_OK, EXIT_BUILD_FAILED, EXIT_USAGE = 0, 1, 2
MIN_TENSORRT = (10, 8)

#: ONNX dim names -> role. The names ``dash-export`` gives its dynamic dims (plus aliases).
DIM_ROLES: dict[str, str] = {
    "num_tokens": "tokens",
    "num_seqs": "seqs",
    "num_kv_blocks": "blocks",
    "num_blocks": "blocks",
    "block_table_width": "width",
    "table_width": "width",
    "num_logits": "logits",
    "num_image_features": "images",
}
ROLES = ("tokens", "seqs", "width", "blocks", "logits", "images")

NOT_FOUND = (
    "TensorRT not found: pip install tensorrt (TensorRT >= 10.8; e.g. 'pip install tensorrt-cu12' for "
    "CUDA 12), or build with trtexec: 'dash-build ... --print-trtexec' prints the equivalent command "
    "line (README.md, 'Build a TensorRT engine')."
)

_DIM_EXPR = re.compile(r"^\(?\s*([A-Za-z_][\w.]*)\s*(?:([+-])\s*(\d+))?\s*\)?$")


class ProfileError(ValueError):
    """The optimization profile cannot be derived (unknown dynamic dim, bad limits)."""


# ------------------------------------------------------------------------------------ limits
@dataclass(frozen=True)
class Limit:
    """min / opt / max of one dynamic quantity."""

    min: int
    opt: int
    max: int

    def __post_init__(self) -> None:
        if not 0 <= self.min <= self.opt <= self.max or self.max < 1:
            raise ValueError(f"need 0 <= min <= opt <= max and max >= 1, got {self.min},{self.opt},{self.max}")

    @classmethod
    def parse(cls, text: str, *, default_opt=None) -> Limit:
        """``MAX`` (min 1, opt ``default_opt(max)`` or max) or ``MIN,OPT,MAX``."""
        parts = [p.strip() for p in str(text).split(",")]
        try:
            values = [int(p) for p in parts]
        except ValueError:
            raise ValueError(f"expected MAX or MIN,OPT,MAX (integers), got {text!r}") from None
        if len(values) == 1:
            top = values[0]
            if top < 1:
                raise ValueError(f"the maximum must be >= 1, got {top}")
            return cls(1, min(top, default_opt(top)) if default_opt else top, top)
        if len(values) != 3:
            raise ValueError(f"expected MAX or MIN,OPT,MAX, got {text!r}")
        return cls(*values)

    def shifted(self, k: int) -> Limit:
        return Limit(max(0, self.min + k), max(0, self.opt + k), max(1, self.max + k))

    def __str__(self) -> str:
        return f"{self.min},{self.opt},{self.max}"


def _limit_type(default_opt):
    def parse(text: str) -> Limit:
        try:
            return Limit.parse(text, default_opt=default_opt)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def _shape_override(text: str) -> tuple[str, tuple[tuple[int, ...], ...]]:
    """``NAME:MIN:OPT:MAX`` with each shape ``AxBxC`` (``x``-separated, trtexec style)."""
    parts = text.rsplit(":", 3)
    if len(parts) != 4 or not parts[0]:
        raise argparse.ArgumentTypeError(f"expected NAME:MIN:OPT:MAX (shapes as AxB), got {text!r}")
    try:
        shapes = tuple(tuple(int(x) for x in p.split("x")) if p else () for p in parts[1:])
    except ValueError:
        raise argparse.ArgumentTypeError(f"shapes must be integers separated by 'x', got {text!r}") from None
    if len({len(s) for s in shapes}) != 1:
        raise argparse.ArgumentTypeError(f"min, opt and max of {parts[0]} have different ranks: {text!r}")
    for lo, op, hi in zip(*shapes):
        if not 0 <= lo <= op <= hi:
            raise argparse.ArgumentTypeError(f"{parts[0]}: need min <= opt <= max in every dim, got {text!r}")
    return parts[0], shapes


# ---------------------------------------------------------------------------------- profiles
@dataclass(frozen=True)
class InputSpec:
    """A network input: its shape (-1 where dynamic) and the ONNX names of its dims."""

    name: str
    shape: tuple[int, ...]
    dim_names: tuple[str | None, ...] = ()
    #: ONNX element type name ("FLOAT16", "INT64", ...), None where not known
    elem_type: str | None = None

    def dim_name(self, axis: int) -> str | None:
        return self.dim_names[axis] if axis < len(self.dim_names) else None


def dim_role(name: str | None) -> tuple[str, int] | None:
    """(role, offset) of a dim name such as ``num_seqs`` or ``num_seqs + 1``; None if unknown."""
    if not name:
        return None
    m = _DIM_EXPR.match(name)
    if not m or m.group(1) not in DIM_ROLES:
        return None
    offset = int(m.group(3) or 0) * (-1 if m.group(2) == "-" else 1)
    return DIM_ROLES[m.group(1)], offset


def kv_block_size(inputs: Sequence[InputSpec]) -> int | None:
    """The static KV block size: dim 1 of the rank-4 cache inputs [num_kv_blocks, bsz, Hkv, D]."""
    sizes = set()
    for spec in inputs:
        role = dim_role(spec.dim_name(0)) if spec.shape else None
        if len(spec.shape) == 4 and role and role[0] == "blocks" and spec.shape[1] > 0:
            sizes.add(spec.shape[1])
    if len(sizes) > 1:
        raise ProfileError(f"the cache inputs disagree on the KV block size: {sorted(sizes)}")
    return sizes.pop() if sizes else None


def derive_limits(
    inputs: Sequence[InputSpec],
    *,
    tokens: Limit | None = None,
    seqs: Limit | None = None,
    width: Limit | None = None,
    blocks: Limit | None = None,
    max_context: int = 32768,
    config: DashConfig | None = None,
) -> dict[str, Limit]:
    """Limits of every role from the user's limits, the defaults and the model."""
    tokens = tokens or Limit(1, 256, 8192)
    seqs = seqs or Limit(1, 16, 64)
    bsz = kv_block_size(inputs)
    if config is not None and bsz is not None and bsz % config.sparse_block_size:
        raise ProfileError(
            f"the model's KV block size {bsz} is not a whole multiple of sparse_block_size "
            f"{config.sparse_block_size}: the DashAttention kernels cannot run it"
        )
    if width is None:
        if bsz is None:
            raise ProfileError(
                "cannot derive the block-table width: no cache input with a static KV block size "
                "(dim 1 of [num_kv_blocks, block_size, Hkv, D]); pass --max-table-width"
            )
        if max_context < 1:
            raise ProfileError(f"--max-context must be >= 1, got {max_context}")
        top = math.ceil(max_context / bsz)
        width = Limit(1, min(top, math.ceil(min(max_context, 4096) / bsz)), top)
    if blocks is None:
        blocks = Limit(1, max(1, seqs.opt * width.opt), max(1, seqs.max * width.max))
    # Rows scored (logits_indices): one per sampling sequence when serving, every new token in
    # the export check and dash-compare.
    logits = Limit(1, seqs.opt, max(seqs.max, tokens.max))
    # Image feature rows of a step: at most one per new token (0 when no prompt carries any).
    images = Limit(0, tokens.opt, tokens.max)
    return {"tokens": tokens, "seqs": seqs, "width": width, "blocks": blocks, "logits": logits, "images": images}


def profile_shapes(
    inputs: Sequence[InputSpec],
    limits: Mapping[str, Limit],
    overrides: Mapping[str, tuple[tuple[int, ...], ...]] | None = None,
) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """(min, opt, max) shape of every network input that has a dynamic dim."""
    overrides = dict(overrides or {})
    unknown_names = sorted(set(overrides) - {s.name for s in inputs})
    if unknown_names:
        raise ProfileError(f"--shape names inputs the model does not have: {', '.join(unknown_names)}")
    out = {}
    for spec in inputs:
        if spec.name in overrides:
            shapes = overrides[spec.name]
            if len(shapes[0]) != len(spec.shape):
                raise ProfileError(f"--shape {spec.name}: rank {len(shapes[0])}, the input has rank {len(spec.shape)}")
            for axis, (lo, hi) in enumerate(zip(shapes[0], shapes[2])):
                if spec.shape[axis] >= 0 and not lo == hi == spec.shape[axis]:
                    raise ProfileError(f"--shape {spec.name}: dim {axis} is fixed at {spec.shape[axis]} in the model")
            out[spec.name] = shapes
            continue
        if all(d >= 0 for d in spec.shape):
            continue
        lo, op, hi = [], [], []
        for axis, d in enumerate(spec.shape):
            if d >= 0:
                lo.append(d), op.append(d), hi.append(d)
                continue
            role = dim_role(spec.dim_name(axis))
            if role is None:
                raise ProfileError(
                    f"input {spec.name} dim {axis} (named {spec.dim_name(axis)!r}) is dynamic and not one of the "
                    f"known dims ({', '.join(sorted(DIM_ROLES))}); pass --shape {spec.name}:MIN:OPT:MAX"
                )
            lim = limits[role[0]].shifted(role[1])
            lo.append(lim.min), op.append(lim.opt), hi.append(lim.max)
        out[spec.name] = (tuple(lo), tuple(op), tuple(hi))
    return out


def _shape_text(shape: Sequence[int]) -> str:
    return "x".join(str(d) for d in shape) if shape else ""


# ------------------------------------------------------------------------------ I/O memory
#: Bytes per element of the ONNX element types a DASH graph's inputs and outputs use.
ELEM_BYTES = {
    "DOUBLE": 8,
    "INT64": 8,
    "UINT64": 8,
    "FLOAT": 4,
    "INT32": 4,
    "UINT32": 4,
    "FLOAT16": 2,
    "BFLOAT16": 2,
    "INT16": 2,
    "UINT16": 2,
    "INT8": 1,
    "UINT8": 1,
    "BOOL": 1,
    "FLOAT8E4M3FN": 1,
}


@dataclass(frozen=True)
class BindingMemory:
    """Device memory of a network's inputs and outputs at the profile's maximum shapes: what
    Triton's TensorRT backend allocates for one model instance (every io binding gets its own
    buffer of the maximum size: tensorrt_backend ``src/instance_state.cc``, the allocation loop
    over the engine's io tensors)."""

    #: (name, max shape, bytes) of every binding whose size is known
    rows: tuple[tuple[str, tuple[int, ...], int], ...]
    #: bindings whose maximum size is not known (an output dim TensorRT infers at build time)
    unknown: tuple[str, ...]
    #: bytes of one KV block summed over every cache binding (inputs past.* and outputs present.*)
    kv_block_bytes: int
    kv_blocks: int

    @property
    def total(self) -> int:
        return sum(b for _, _, b in self.rows)

    @property
    def kv(self) -> int:
        return self.kv_block_bytes * self.kv_blocks

    def describe(self) -> str:
        gib = 2**30
        text = (
            f"Triton's TensorRT backend allocates every input and output at the profile's maximum: "
            f"{'at least ' if self.unknown else ''}{self.total / gib:.2f} GiB per model instance"
        )
        if self.kv_block_bytes:
            text += (
                f", of which the KV caches {self.kv / gib:.2f} GiB ({self.kv_blocks} blocks x "
                f"{self.kv_block_bytes / 2**10:.1f} KiB, inputs and outputs)"
            )
        if self.unknown:
            text += f"; sizes not known before the build: {', '.join(self.unknown)}"
        return text


def _is_block_dim(spec: InputSpec) -> bool:
    role = dim_role(spec.dim_name(0)) if spec.shape else None
    return bool(role and role[0] == "blocks" and role[1] == 0)


def kv_block_bytes(bindings: Sequence[InputSpec]) -> int:
    """Bytes of one KV block over every binding whose dim 0 is the block count (the caches)."""
    total = 0
    for spec in bindings:
        if _is_block_dim(spec) and spec.elem_type in ELEM_BYTES and all(d > 0 for d in spec.shape[1:]):
            total += math.prod(spec.shape[1:]) * ELEM_BYTES[spec.elem_type]
    return total


def binding_memory(
    inputs: Sequence[InputSpec],
    outputs: Sequence[InputSpec],
    limits: Mapping[str, Limit],
    shapes: Mapping[str, tuple[tuple[int, ...], ...]],
) -> BindingMemory:
    """The inputs' and outputs' bytes at the profile's maximum (``shapes`` from
    :func:`profile_shapes`; outputs' dynamic dims by their names' roles)."""
    rows, unknown = [], []
    for spec in (*inputs, *outputs):
        top = shapes[spec.name][2] if spec.name in shapes else spec.shape
        if any(d < 0 for d in top):
            resolved = []
            for axis, d in enumerate(top):
                role = dim_role(spec.dim_name(axis)) if d < 0 else None
                resolved.append(d if d >= 0 else (limits[role[0]].shifted(role[1]).max if role else -1))
            top = tuple(resolved)
        if spec.elem_type not in ELEM_BYTES or any(d < 0 for d in top):
            unknown.append(spec.name)
            continue
        rows.append((spec.name, tuple(top), math.prod(top) * ELEM_BYTES[spec.elem_type]))
    return BindingMemory(tuple(rows), tuple(unknown), kv_block_bytes([*inputs, *outputs]), limits["blocks"].max)


def blocks_for_budget(inputs: Sequence[InputSpec], outputs: Sequence[InputSpec], gib: float) -> int:
    """The most KV blocks whose cache bindings (inputs and outputs) fit in ``gib`` GiB."""
    per_block = kv_block_bytes([*inputs, *outputs])
    if not per_block:
        raise ProfileError("--kv-pool-gib: the model has no cache input [num_kv_blocks, ...] of a known type")
    blocks = int(gib * 2**30) // per_block
    if blocks < 1:
        raise ProfileError(
            f"--kv-pool-gib {gib}: one KV block takes {per_block / 2**20:.2f} MiB over the cache "
            f"inputs and outputs, more than the budget"
        )
    return blocks


#: The file dash-build writes beside an engine (and beside --out with --print-trtexec): its
#: profile, for ``dash-triton write --plan`` (the config's fixed dims, the memory Triton takes).
PROFILE_SUFFIX = ".profile.json"


def profile_record(
    shapes: Mapping[str, tuple[tuple[int, ...], ...]], limits: Mapping[str, Limit], memory: BindingMemory
) -> dict[str, Any]:
    return {
        "profile": {name: [list(lo), list(op), list(hi)] for name, (lo, op, hi) in shapes.items()},
        "limits": {role: [lim.min, lim.opt, lim.max] for role, lim in limits.items()},
        "binding_bytes": memory.total,
        "binding_bytes_unknown": list(memory.unknown),
        "kv_blocks": limits["blocks"].max,
        "kv_block_bytes": memory.kv_block_bytes,
    }


def read_profile_record(engine: str | Path) -> dict[str, Any] | None:
    """The record :func:`write_profile_record` left beside ``engine``, or None if there is none
    (ValueError for a file that is not one)."""
    path = Path(str(engine) + PROFILE_SUFFIX)
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        limits = {role: Limit(*record["limits"][role]) for role in ROLES}
        profile = {name: tuple(tuple(int(d) for d in s) for s in shapes) for name, shapes in record["profile"].items()}
        int(record["binding_bytes"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a dash-build profile record ({exc})") from None
    return {**record, "limits": limits, "profile": profile}


def fixed_dims(
    name: str, dims: Sequence[int], dim_names: Sequence[str | None], record: Mapping[str, Any]
) -> tuple[int, ...]:
    """``dims`` (-1 where dynamic) with every axis the engine's profile fixes (min == max)
    written as that number: from the recorded profile of an input, or the limit of the axis's
    role (outputs, such as ``present.*`` [num_kv_blocks, ...])."""
    shapes = record["profile"].get(name)
    out = []
    for axis, d in enumerate(dims):
        if d < 0 and shapes is not None and shapes[0][axis] == shapes[2][axis]:
            d = shapes[2][axis]
        elif d < 0:
            role = dim_role(dim_names[axis] if axis < len(dim_names) else None)
            lim = record["limits"][role[0]].shifted(role[1]) if role else None
            if lim is not None and lim.min == lim.max:
                d = lim.max
        out.append(d)
    return tuple(out)


def write_profile_record(engine: Path, record: Mapping[str, Any]) -> Path:
    from .fileio import atomic_write

    path = Path(str(engine) + PROFILE_SUFFIX)

    def write(tmp: str) -> None:
        with open(tmp, "w") as fh:
            json.dump(record, fh, indent=1)
            fh.write("\n")

    atomic_write(str(path), write)
    return path


def trtexec_command(
    model: str,
    plugin: str,
    out: str,
    shapes: Mapping[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]],
    *,
    aliasing: bool = True,
    timing_cache: str | None = None,
    workspace_mib: int | None = None,
    trt_version: tuple[int, int] = (10, 8),
    plugin_override: bool = False,
) -> str:
    """The trtexec command line that builds the same engine as dash-build, for trtexec of
    ``trt_version``; every path shell-quoted. Strongly typed always (``--stronglyTyped`` on 10.x;
    11.x has only strong typing). ``plugin_override``: the model's nodes lack
    ``plugin_namespace`` (an older export), so TensorRT >= 10.15 needs ``--enablePluginOverride``."""
    import shlex

    major = trt_version[0]

    def spec(k: int) -> str:
        return ",".join(f"{name}:{_shape_text(s[k])}" for name, s in shapes.items())

    q = shlex.quote
    parts = ["trtexec", f"--onnx={q(model)}", f"--dynamicPlugins={q(plugin)}"]
    if shapes:
        parts += [q(f"--minShapes={spec(0)}"), q(f"--optShapes={spec(1)}"), q(f"--maxShapes={spec(2)}")]
    if major < 11:
        parts.append("--stronglyTyped")
    if plugin_override and tuple(trt_version) >= (10, 15):
        parts.append("--enablePluginOverride")
    if aliasing:
        parts.append("--preview=+aliasedPluginIO1003")
    if timing_cache:
        parts.append(f"--timingCacheFile={q(timing_cache)}")
    if workspace_mib:
        parts.append(f"--memPoolSize=workspace:{workspace_mib}M")
    parts += ["--profilingVerbosity=detailed", "--dumpLayerInfo", "--skipInference", f"--saveEngine={q(out)}"]
    return " \\\n    ".join(parts)


def nodes_carry_namespace_or_unknown(path: Path) -> bool:
    """:func:`nodes_carry_namespace`, True where the file cannot be read here (no onnx package)."""
    try:
        return nodes_carry_namespace(path)
    except GraphReadError:
        return True


def nodes_carry_namespace(path: Path) -> bool:
    """Every DashAttention node of the ONNX file has a ``plugin_namespace`` attribute (what
    TensorRT >= 10.15's parser needs to import it as the plugin); needs the onnx package."""
    return all("plugin_namespace" in node for node in read_graph(path).dash_nodes)


def load_plugin_library(registry, path: str) -> str | None:
    """Load the plugin into a TensorRT plugin registry (``IPluginRegistry.load_library``: its
    ``getCreators``) and check that the DashAttention creator is there; the problem, or None.
    A registry that already holds the creator (the library loaded before in this process: a
    second engine, a compare after a build) is left as it is: loading it again would register
    the same creator twice, which TensorRT refuses."""
    if registry.get_creator(PLUGIN_NAME, PLUGIN_VERSION, PLUGIN_NAMESPACE) is not None:
        return None
    try:
        handle = registry.load_library(path)
    except Exception as exc:  # the bindings raise on some failures, return None on others
        return f"TensorRT could not load {path}: {exc}"
    if handle is None:
        return f"TensorRT could not load {path} (see the TensorRT log above)"
    if registry.get_creator(PLUGIN_NAME, PLUGIN_VERSION, PLUGIN_NAMESPACE) is None:
        return f"{path} is loaded but registers no {PLUGIN_NAME} v{PLUGIN_VERSION} creator"
    return None


def _installed_trt_version() -> tuple[int, int] | None:
    import importlib.metadata

    for dist in ("tensorrt", "tensorrt-cu13", "tensorrt-cu12"):
        try:
            v = _version_tuple(importlib.metadata.version(dist))
            return (v[0], v[1] if len(v) > 1 else 0)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


# ------------------------------------------------------------------------------ engine summary
def summarize_engine(info: Mapping[str, Any] | str) -> list[str]:
    """Lines describing an engine from IEngineInspector.get_engine_information(JSON): layer count by
    type, the DashAttention plugin layers, and every layer that copies or reformats a tensor (the
    copies TensorRT may insert around aliased plugin I/O show up here)."""
    if isinstance(info, str):
        info = json.loads(info)
    layers = info.get("Layers", []) if isinstance(info, Mapping) else []
    if not layers:
        return ["engine inspector: no layer information"]
    if all(isinstance(layer, str) for layer in layers):  # profiling verbosity below DETAILED: names only
        return [f"{len(layers)} layers (names only; build with detailed profiling verbosity for types)"]

    def ltype(layer) -> str:
        return str(layer.get("LayerType", "?"))

    def tensors(layer, key) -> list[str]:
        return [t.get("Name", "?") if isinstance(t, Mapping) else str(t) for t in layer.get(key, []) or []]

    counts = Counter(ltype(layer) for layer in layers)
    lines = [f"{len(layers)} layers: " + ", ".join(f"{n} {t}" for t, n in counts.most_common())]
    plugins = [layer for layer in layers if "plugin" in ltype(layer).lower() or PLUGIN_NAME in str(layer.get("Name"))]
    lines.append(f"DashAttention plugin layers: {len(plugins)}")
    copies = [
        layer
        for layer in layers
        if any(w in ltype(layer).lower() for w in ("reformat", "copy")) or "copy" in str(layer.get("Name")).lower()
    ]
    if copies:
        lines.append(f"copy/reformat layers: {len(copies)}")
        for layer in copies:
            lines.append(
                f"  {layer.get('Name')} [{ltype(layer)}]: {', '.join(tensors(layer, 'Inputs'))} -> "
                f"{', '.join(tensors(layer, 'Outputs'))}"
            )
    else:
        lines.append("copy/reformat layers: none")
    return lines


def engine_aliases(engine) -> dict[str, str | None] | None:
    """Each output's aliased input as the engine reports it (``ICudaEngine::getAliasedInputTensor``,
    TensorRT >= 10.15; None for an output that aliases none), or None where the API is missing.
    TensorRT may also report none for a plugin's aliased output and copy around it instead;
    either way the caller binds ``present.*`` to ``past.*`` (the plugin writes in place)."""
    get = getattr(engine, "get_aliased_input_tensor", None)
    if get is None:
        return None
    out = {}
    for i in range(engine.num_io_tensors):
        name = engine.get_tensor_name(i)
        if str(engine.get_tensor_mode(name)).rsplit(".", 1)[-1].upper() == "OUTPUT":
            out[name] = get(name) or None
    return out


def describe_engine_io(engine) -> list[str]:
    """What dash-build prints after a build: each output's aliased input (or that it has none, or
    that this TensorRT cannot say) and the engine's device memory."""
    lines = []
    aliases = engine_aliases(engine)
    if aliases is None:
        lines.append(
            "aliased outputs: not reported by this TensorRT (getAliasedInputTensor is 10.15+); bind each "
            "present.* to its past.* buffer"
        )
    else:
        named = {o: i for o, i in aliases.items() if i}
        lines.append(f"aliased outputs: {len(named)} of {len(aliases)}")
        lines += [f"  {o} -> {i}" for o, i in named.items()]
        none = [o for o, i in aliases.items() if not i and o.startswith("present.")]
        if none:
            lines.append(
                f"  no alias reported for {len(none)} present.* output(s) ({none[0]}, ...): TensorRT may "
                f"copy them; bind each to its past.* buffer"
            )
    size = getattr(engine, "device_memory_size_v2", None)
    if size is None:
        size = getattr(engine, "device_memory_size", None)
    if size is not None:
        lines.append(f"engine device memory (activations and workspace, besides the I/O): {int(size) / 2**20:.1f} MiB")
    return lines


# --------------------------------------------------------------------------------- ONNX side
def read_onnx(path: Path) -> tuple[list[InputSpec], list[InputSpec], DashConfig | None, int]:
    """Inputs, outputs, the DASH configuration and the number of DashAttention nodes
    (:func:`dash_trt.onnx_graph.read_graph`: GraphReadError without the onnx package or for an
    unreadable file); weights are not loaded."""
    graph = read_graph(path)
    inputs = [InputSpec(t.name, tuple(t.dims or ()), t.dim_names, t.elem_type) for t in graph.inputs]
    outputs = [InputSpec(t.name, tuple(t.dims or ()), t.dim_names, t.elem_type) for t in graph.outputs]
    nodes = graph.dash_nodes
    config = None
    if CONFIG_SECTION in graph.metadata:
        try:
            config = DashConfig.from_dict(json.loads(graph.metadata[CONFIG_SECTION]))
        except (json.JSONDecodeError, DashConfigError) as exc:
            raise DashConfigError(f"{path}: metadata '{CONFIG_SECTION}' is not a valid DASH config: {exc}") from None
    elif nodes:
        config = _config_from_node(nodes[0])
    return inputs, outputs, config, len(nodes)


def _config_from_node(attributes: Mapping[str, Any]) -> DashConfig | None:
    """The DASH configuration of the layer a DashAttention node computes (its attributes, read by
    dash_trt.attention.dash.attributes, which needs neither torch nor TensorRT)."""
    try:
        return A.decode(dict(attributes))[0]
    except (ValueError, TypeError):
        return None  # the plugin validates the attributes itself; this copy is informational


# ------------------------------------------------------------------------------------- CLI
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dash-build",
        description="Build a TensorRT engine (plan) from a DASH ONNX model with the DashAttention plugin. "
        "Exit codes: 0 built, 1 TensorRT failed to parse or build, 2 bad arguments or no TensorRT, " + EXIT_CODES_NOTE,
    )
    p.add_argument("--version", action="version", version=_version_line())
    p.add_argument("model", type=Path, help="the exported ONNX model (dash-export)")
    p.add_argument(
        "--plugin",
        type=Path,
        default=None,
        help="libdash_trt_plugin.so (default: the one in this installation, see dash-trt info)",
    )
    p.add_argument("--out", type=Path, help="engine file to write (required unless --print-trtexec)")
    p.add_argument(
        "--config",
        type=Path,
        help="model config.json with a sparse_attention_config section, used when the ONNX file carries none",
    )
    p.add_argument(
        "--max-tokens",
        type=_limit_type(lambda m: 256),
        help="new tokens per step: MAX or MIN,OPT,MAX [default 1,256,8192]",
    )
    p.add_argument("--max-seqs", type=_limit_type(lambda m: 16), help="sequences per step [default 1,16,64]")
    p.add_argument(
        "--max-table-width", type=_limit_type(lambda m: m), help="block-table columns [default from --max-context]"
    )
    p.add_argument(
        "--max-blocks", type=_limit_type(lambda m: m), help="KV blocks in each cache [default seqs x table width]"
    )
    p.add_argument(
        "--kv-pool-gib",
        type=float,
        metavar="GIB",
        help="size the KV block count so that the cache "
        "inputs and outputs take at most GIB GiB at the profile's maximum (Triton's TensorRT backend "
        "allocates every binding at that size); instead of --max-blocks",
    )
    p.add_argument(
        "--max-context",
        type=int,
        default=32768,
        help="longest sequence (tokens), for the default table width [default 32768]",
    )
    p.add_argument(
        "--shape",
        type=_shape_override,
        action="append",
        default=[],
        metavar="NAME:MIN:OPT:MAX",
        help="explicit profile of one input (shapes AxB); repeatable",
    )
    p.add_argument("--fp16", action="store_true", help=argparse.SUPPRESS)  # refused: see WEAK_TYPES
    p.add_argument("--bf16", action="store_true", help=argparse.SUPPRESS)
    p.add_argument(
        "--strongly-typed",
        action="store_true",
        help="take every type from the ONNX model (always: engines are strongly typed; kept for scripts that pass it)",
    )
    p.add_argument(
        "--no-aliasing",
        action="store_true",
        help="do not turn on aliased plugin I/O; bind each "
        "present.* output to its past.* input buffer instead (the plugin then works in place too)",
    )
    p.add_argument("--timing-cache", type=Path, help="timing cache file: read if it exists, written after the build")
    p.add_argument("--workspace", type=int, metavar="MIB", help="workspace memory pool limit (MiB)")
    p.add_argument(
        "--verbose", action="store_true", help="TensorRT verbose logging, and the traceback of an unexpected error"
    )
    p.add_argument(
        "--print-trtexec",
        action="store_true",
        help="print the equivalent trtexec command and exit (needs the onnx package, not TensorRT)",
    )
    p.add_argument(
        "--trt-version",
        metavar="MAJOR.MINOR",
        help="with --print-trtexec: the TensorRT version whose "
        "trtexec runs the command [default: the installed tensorrt package's, else 10.8]",
    )
    return p


def _fail(message: str, code: int = EXIT_USAGE) -> int:
    print(f"dash-build: error: {message}", file=sys.stderr)
    return code


#: Why --fp16/--bf16 are refused: a weakly typed TensorRT 10 build may give the caches another float
#: type than the model's and insert casts around past.* / present.* (losing precision silently,
#: and the in-place cache with it); TensorRT 11 has no weak typing at all.
WEAK_TYPES = (
    "dash-build builds strongly typed engines only (every type from the ONNX model: a weakly typed "
    "build may cast the KV caches to another float type); export the model in float16 or bfloat16 "
    "instead (dash-export --dtype float16)"
)


#: What a printed trtexec command names as the plugin when none was given or found.
PLUGIN_PLACEHOLDER = "libdash_trt_plugin.so"


def _check_arguments(args) -> str | None:
    if args.fp16 or args.bf16:
        return WEAK_TYPES
    if not args.model.is_file():
        return f"model not found: {args.model}"
    if args.plugin is None:
        from .libraries import plugin_path

        args.plugin = plugin_path()
        if args.plugin is None and args.print_trtexec:
            # the command is only printed: name the library it needs, to be built or found
            args.plugin = Path(PLUGIN_PLACEHOLDER)
            print(
                f"dash-build: note: no TensorRT plugin library in this installation; the command names "
                f"{PLUGIN_PLACEHOLDER} (build it with -DDASH_BUILD_TRT_PLUGIN=ON, plugins/trt/README.md)",
                file=sys.stderr,
            )
        if args.plugin is None:
            return (
                "no TensorRT plugin library in this installation: pass --plugin libdash_trt_plugin.so (build it "
                "with -DDASH_BUILD_TRT_PLUGIN=ON, plugins/trt/README.md)"
            )
    if not args.print_trtexec and not args.plugin.is_file():
        return (
            f"plugin library not found: {args.plugin} (build it with -DDASH_BUILD_TRT_PLUGIN=ON, plugins/trt/README.md)"
        )
    if not args.print_trtexec:
        if args.out is None:
            return "--out is required"
        if not args.out.resolve().parent.is_dir():
            return f"the folder of --out does not exist: {args.out.resolve().parent}"
        inputs = {
            "the model": args.model,
            "--plugin": args.plugin,
            "--config": args.config,
            "--timing-cache": args.timing_cache,
        }
        for what, path in inputs.items():
            if path is not None and path.resolve() == args.out.resolve():
                return f"--out {args.out} is {what}: the engine would overwrite it; write the engine elsewhere"
    if args.kv_pool_gib is not None and args.max_blocks is not None:
        return "--kv-pool-gib sets the KV block count; drop --max-blocks (or --kv-pool-gib)"
    if args.kv_pool_gib is not None and not (math.isfinite(args.kv_pool_gib) and args.kv_pool_gib > 0):
        return f"--kv-pool-gib must be a positive number of GiB, got {args.kv_pool_gib}"
    if args.config is not None and not args.config.is_file():
        return f"config not found: {args.config}"
    if args.workspace is not None and args.workspace < 1:
        return f"--workspace must be >= 1 MiB, got {args.workspace}"
    return None


def _plugin_major_problem(plugin: Path, trt_version: tuple[int, int], what: str) -> str | None:
    """The plugin library only registers its creator in a TensorRT runtime of the major its
    headers were (plugins/trt/dash_logging.cpp); a mismatch is an error before anything runs."""
    from .libraries import plugin_tensorrt_version

    built = plugin_tensorrt_version(plugin) if plugin.is_file() else None
    if built is None or built[0] == trt_version[0]:
        return None
    return (
        f"{plugin} was built against TensorRT {built[0]}.{built[1]} headers and {what} TensorRT "
        f"{trt_version[0]}.{trt_version[1]}: a plugin only works with the TensorRT major it was built for; "
        f"build it against TensorRT {trt_version[0]} headers (plugins/trt/README.md)"
    )


def _limits_from_args(args, inputs, outputs, config) -> dict[str, Limit]:
    blocks = args.max_blocks
    if args.kv_pool_gib is not None:
        top = blocks_for_budget(inputs, outputs, args.kv_pool_gib)
        blocks = Limit(1, top, top)
    return derive_limits(
        inputs,
        tokens=args.max_tokens,
        seqs=args.max_seqs,
        width=args.max_table_width,
        blocks=blocks,
        max_context=args.max_context,
        config=config,
    )


def _print_profile(shapes, limits, out=sys.stdout) -> None:
    print("optimization profile (min / opt / max):", file=out)
    for role in ROLES:
        print(f"  {role:<7} {limits[role]}", file=out)
    width = max((len(n) for n in shapes), default=0)
    for name, (lo, op, hi) in shapes.items():
        print(
            f"  {name:<{width}}  {_shape_text(lo) or '-'} / {_shape_text(op) or '-'} / {_shape_text(hi) or '-'}",
            file=out,
        )


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:3])


def unsupported_ops(path: Path) -> str | None:
    """Why the plugin cannot build ``path`` when it holds a node of the package's domain that the
    plugin has no kernels for (Dual Chunk Attention), else None (also for an unreadable file:
    the later steps say what is wrong with it)."""
    try:
        ops = {op for op, _ in read_graph(path).domain_nodes}
    except GraphReadError:
        return None
    others = sorted(ops - {PLUGIN_NAME})
    if not others:
        return None
    return (
        f"{path} holds {', '.join(f'dash_trt.{op}' for op in others)} nodes: the TensorRT plugin implements only "
        f"dash_trt.{PLUGIN_NAME} (there are no Dual Chunk Attention kernels yet); run this model with ONNX "
        f"Runtime (dash-compare) or serve it with dash-triton's Python generation model"
    )


@cli_main("dash-build")
def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # the model's own ops first: a Dual Chunk Attention file is refused for what it is, not for a
    # plugin library it could not use anyway
    problem = unsupported_ops(args.model) or _check_arguments(args)
    if problem:
        return _fail(problem)
    config = None
    if args.config is not None:
        try:
            config = DashConfig.from_model_config(args.config)
        except DashConfigError as exc:
            return _fail(str(exc))

    if args.print_trtexec:
        try:
            inputs, outputs, onnx_config, _ = read_onnx(args.model)
        except (GraphReadError, DashConfigError) as exc:
            return _fail(f"--print-trtexec reads the model's inputs: {exc}")
        try:
            limits = _limits_from_args(args, inputs, outputs, onnx_config or config)
            shapes = profile_shapes(inputs, limits, dict(args.shape))
        except (ProfileError, ValueError) as exc:
            return _fail(str(exc))
        memory = binding_memory(inputs, outputs, limits, shapes)
        if args.trt_version:
            v = _version_tuple(args.trt_version)
            if not v or not re.fullmatch(r"\d+(\.\d+){0,2}", args.trt_version):
                return _fail(f"--trt-version must be MAJOR.MINOR (e.g. 10.8 or 11.1), got {args.trt_version!r}")
            trt_version = (v[0], v[1] if len(v) > 1 else 0)
            if trt_version < MIN_TENSORRT:
                return _fail(
                    f"--trt-version {args.trt_version}: the DashAttention plugin needs TensorRT >= "
                    f"{MIN_TENSORRT[0]}.{MIN_TENSORRT[1]} (IPluginV3 with aliased plugin I/O; older ONNX "
                    "parsers import the node's ONNX function instead of the plugin)"
                )
        else:
            from .libraries import plugin_tensorrt_version

            built = plugin_tensorrt_version(args.plugin) if args.plugin.is_file() else None
            trt_version = _installed_trt_version() or built or (10, 8)
            if _installed_trt_version() is None:
                print(
                    f"dash-build: no tensorrt package: the command is for TensorRT {trt_version[0]}.{trt_version[1]} "
                    f"({'the plugin was built for it' if built else 'the oldest supported'}; pass --trt-version for "
                    "another)",
                    file=sys.stderr,
                )
        problem = _plugin_major_problem(args.plugin, trt_version, "the command is for")
        if problem:
            return _fail(problem)
        override = not nodes_carry_namespace(args.model)
        if override and trt_version >= (10, 15):
            print(
                "dash-build: warning: the model's DashAttention nodes have no plugin_namespace attribute (exported "
                "before it was added): --enablePluginOverride makes TensorRT import them as the plugin, and also "
                "imports ScatterND/ScatterElements as TensorRT's own plugins; re-export to drop it",
                file=sys.stderr,
            )
        try:
            command = trtexec_command(
                str(args.model),
                str(args.plugin),
                str(args.out or "model.plan"),
                shapes,
                aliasing=not args.no_aliasing,
                timing_cache=str(args.timing_cache) if args.timing_cache else None,
                workspace_mib=args.workspace,
                trt_version=trt_version,
                plugin_override=override,
            )
        except ValueError as exc:
            return _fail(str(exc))
        print(command)
        print(f"dash-build: {memory.describe()}", file=sys.stderr)
        if args.out is not None:
            record = write_profile_record(args.out, profile_record(shapes, limits, memory))
            print(f"dash-build: wrote {record} (the profile, for dash-triton write --plan)", file=sys.stderr)
        return EXIT_OK

    try:
        import tensorrt as trt
    except ImportError:
        return _fail(NOT_FOUND)
    version = getattr(trt, "__version__", "0")
    if _version_tuple(version)[:2] < MIN_TENSORRT:
        return _fail(
            f"TensorRT {version} is installed; the DashAttention plugin needs TensorRT >= "
            f"{MIN_TENSORRT[0]}.{MIN_TENSORRT[1]}"
        )
    installed = _version_tuple(version)
    problem = _plugin_major_problem(
        args.plugin, (installed[0], installed[1] if len(installed) > 1 else 0), "the installed tensorrt is"
    )
    if problem:
        return _fail(problem)
    return _build(trt, args, config, installed[0])


def _build(trt, args, config: DashConfig | None, major: int) -> int:  # pragma: no cover
    t0 = time.perf_counter()
    logger = trt.Logger(trt.Logger.VERBOSE if args.verbose else trt.Logger.WARNING)
    builder = trt.Builder(logger)
    problem = load_plugin_library(builder.get_plugin_registry(), str(args.plugin))
    if problem:
        return _fail(problem)

    # TensorRT 11 is always strongly typed (its STRONGLY_TYPED flag is deprecated and ignored).
    flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED) if major < 11 else 0

    def parse(override: bool):
        net = builder.create_network(flags)
        onnx_parser = trt.OnnxParser(net, logger)
        if override:
            onnx_parser.set_flag(trt.OnnxParserFlag.ENABLE_PLUGIN_OVERRIDE)
        if not onnx_parser.parse_from_file(str(args.model)):
            for i in range(onnx_parser.num_errors):
                print(f"dash-build: ONNX parser: {onnx_parser.get_error(i)}", file=sys.stderr)
            return None, onnx_parser
        return net, onnx_parser

    def plugin_count(net) -> int:
        return sum(1 for i in range(net.num_layers) if net.get_layer(i).type == trt.LayerType.PLUGIN_V3)

    network, parser = parse(False)
    can_override = hasattr(trt.OnnxParserFlag, "ENABLE_PLUGIN_OVERRIDE")
    if network is None and can_override and not nodes_carry_namespace_or_unknown(args.model):
        # 10.15+ imports the ONNX function of a node without plugin_namespace; where that import
        # fails (an op of the function the parser lacks), the override is the way in too.
        print(
            "dash-build: warning: parsing failed and the DashAttention nodes lack plugin_namespace; parsing "
            "again with ENABLE_PLUGIN_OVERRIDE",
            file=sys.stderr,
        )
        network, parser = parse(True)
    if network is None:
        return _fail(f"TensorRT could not parse {args.model}", EXIT_BUILD_FAILED)
    if plugin_count(network) == 0 and can_override:
        # An export whose nodes lack plugin_namespace, on TensorRT >= 10.15: the parser imported
        # the ONNX functions. Parse again with the override (it also swaps ScatterND /
        # ScatterElements for TensorRT's own plugins).
        print(
            "dash-build: warning: the parser imported the DashAttention ONNX functions (nodes without "
            "plugin_namespace: re-export with this dash-trt); parsing again with ENABLE_PLUGIN_OVERRIDE",
            file=sys.stderr,
        )
        network, parser = parse(True)
        if network is None:
            return _fail(f"TensorRT could not parse {args.model} with ENABLE_PLUGIN_OVERRIDE", EXIT_BUILD_FAILED)

    onnx_inputs: dict[str, InputSpec] = {}
    outputs: list[InputSpec] = []
    try:
        onnx_in, outputs, onnx_config, _ = read_onnx(args.model)
        config = onnx_config or config
        onnx_inputs = {spec.name: spec for spec in onnx_in}
    except (GraphReadError, DashConfigError):  # onnx missing or unreadable: TensorRT parsed it, carry on
        pass
    inputs = []
    for i in range(network.num_inputs):
        t = network.get_input(i)
        shape = tuple(int(d) for d in t.shape)
        # The ONNX parser names dims after their dim_param; the onnx package reads the same names.
        named = getattr(t, "get_dimension_name", None)
        names = tuple(named(a) for a in range(len(shape))) if named else ()
        known = onnx_inputs.get(t.name)
        if not any(names):
            names = known.dim_names if known else ()
        inputs.append(InputSpec(t.name, shape, names, known.elem_type if known else None))
    try:
        limits = _limits_from_args(args, inputs, outputs, config)
        shapes = profile_shapes(inputs, limits, dict(args.shape))
    except (ProfileError, ValueError) as exc:
        return _fail(str(exc))
    if config is not None:
        print(f"DASH config: {json.dumps(config.to_dict())}")
    _print_profile(shapes, limits)
    memory = binding_memory(inputs, outputs, limits, shapes)
    print(memory.describe())

    plugin_layers = plugin_count(network)
    if plugin_layers == 0:
        print(
            "dash-build: warning: the network has no plugin layer: TensorRT imported the DashAttention ONNX "
            "function instead of the plugin (the plugin was not registered, or the nodes lack plugin_namespace on "
            "a TensorRT >= 10.15 without ENABLE_PLUGIN_OVERRIDE)",
            file=sys.stderr,
        )

    bconfig = builder.create_builder_config()
    aliasing = plugin_layers > 0 and not args.no_aliasing
    if aliasing:
        bconfig.set_preview_feature(trt.PreviewFeature.ALIASED_PLUGIN_IO_10_03, True)
    if args.workspace:
        bconfig.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, args.workspace << 20)
    bconfig.profiling_verbosity = trt.ProfilingVerbosity.DETAILED
    profile = builder.create_optimization_profile()
    for name, (lo, op, hi) in shapes.items():
        profile.set_shape(name, lo, op, hi)
    bconfig.add_optimization_profile(profile)
    cache = None
    if args.timing_cache:
        data = args.timing_cache.read_bytes() if args.timing_cache.is_file() else b""
        cache = bconfig.create_timing_cache(data)
        bconfig.set_timing_cache(cache, ignore_mismatch=False)

    print(
        f"building: {plugin_layers} DashAttention plugin layer(s), strongly typed, "
        f"aliased plugin I/O {'on' if aliasing else 'off'}"
    )
    serialized = builder.build_serialized_network(network, bconfig)
    if serialized is None:
        return _fail("TensorRT could not build the engine (see the TensorRT log above)", EXIT_BUILD_FAILED)
    with open(args.out, "wb") as fh:
        fh.write(serialized)
    if cache is not None:
        with open(args.timing_cache, "wb") as fh:
            fh.write(cache.serialize())
    print(f"wrote {write_profile_record(args.out, profile_record(shapes, limits, memory))}")

    try:
        runtime = trt.Runtime(logger)
        engine = runtime.deserialize_cuda_engine(serialized)
        inspector = engine.create_engine_inspector()
        info = inspector.get_engine_information(trt.LayerInformationFormat.JSON)
        for line in summarize_engine(info):
            print(line)
        for line in describe_engine_io(engine):
            print(line)
    except Exception as exc:
        print(f"dash-build: warning: no layer summary ({exc})", file=sys.stderr)
    size_mb = Path(args.out).stat().st_size / 2**20
    print(f"wrote {args.out} ({size_mb:.1f} MiB) in {time.perf_counter() - t0:.1f} s")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
