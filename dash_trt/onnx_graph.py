"""An ONNX file's interface, read once: the one reader of graph inputs, outputs, DASH nodes and
metadata that ``dash-compare``, ``dash-build``, ``dash-export``'s checks and the Triton
repository writer share (weights are never loaded; needs the ``onnx`` package, not torch).

The KV block size is fixed in an exported graph (dim 1 of every ``past.<layer>.key`` input):
:attr:`GraphIO.kv_block_size` is where every tool recovers it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .attention.dash.attributes import ONNX_DOMAIN, PLUGIN_NAME

__all__ = ["GraphReadError", "GraphTensor", "GraphIO", "read_graph"]


class GraphReadError(ValueError):
    """The file is missing, is not an ONNX model, or the onnx package is not installed."""


@dataclass(frozen=True)
class GraphTensor:
    """One graph input or output."""

    name: str
    #: ONNX element type name (``"FLOAT"``, ``"INT64"``, ...); None if the value is not a tensor
    elem_type: str | None
    #: dims, -1 where symbolic or unknown; None if the tensor has no shape (rank unknown)
    dims: tuple[int, ...] | None
    #: the ``dim_param`` name of each axis, None where it has none
    dim_names: tuple[str | None, ...]


@dataclass(frozen=True)
class GraphIO:
    """What the tools read of an ONNX file."""

    path: str
    #: graph inputs that are not initializers, in order
    inputs: tuple[GraphTensor, ...]
    outputs: tuple[GraphTensor, ...]
    #: the nodes of the ``dash_trt`` domain: (op type, attributes by name), in graph order
    domain_nodes: tuple[tuple[str, Mapping[str, Any]], ...]
    #: the model-local functions as (domain, name)
    functions: tuple[tuple[str, str], ...]
    metadata: Mapping[str, str]

    @property
    def dash_nodes(self) -> list[Mapping[str, Any]]:
        """The attributes of every ``dash_trt.DashAttention`` node."""
        return [attrs for op, attrs in self.domain_nodes if op == PLUGIN_NAME]

    @property
    def has_dash_function(self) -> bool:
        return (ONNX_DOMAIN, PLUGIN_NAME) in self.functions

    def dims(self) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
        """Input and output name -> dims (-1 where dynamic; [] where the rank is unknown)."""
        return (
            {t.name: list(t.dims or ()) for t in self.inputs},
            {t.name: list(t.dims or ()) for t in self.outputs},
        )

    def mismatches(self, model, kv_block_size: int | None = None) -> list[str]:
        """Where this interface differs from what ``model`` (a :class:`dash_trt.modeling.DashModel`)
        exports with the graph's KV block size (``kv_block_size`` where the graph leaves it
        dynamic): missing or unexpected inputs, each cache's fixed dims (KV heads, head dim,
        indexer dim), the logits' vocabulary. One line per problem; empty when they match."""
        kv_block_size = self.kv_block_size or kv_block_size
        problems: list[str] = []
        inputs, outputs = self.dims()
        cfg = model.config
        want = [*model.input_names(), *model.cache_names("past")]
        have_layers = len({n.split(".")[1] for n in inputs if n.startswith("past.") and n.count(".") == 2})
        if have_layers != cfg.num_hidden_layers:
            problems.append(
                f"the graph has caches for {have_layers} layers, the checkpoint has {cfg.num_hidden_layers}"
            )
        else:
            missing = [n for n in want if n not in inputs]
            extra = [n for n in inputs if n not in want]
            if missing:
                problems.append(f"the graph lacks the input(s) {', '.join(missing[:4])}")
            if extra:
                problems.append(f"the graph has unexpected input(s) {', '.join(extra[:4])}")
        if kv_block_size is not None:
            for layer, cache in enumerate(model.allocate_cache(1, kv_block_size, device="meta")):
                for name, tensor in cache.tensors().items():
                    dims = inputs.get(f"past.{layer}.{name}")
                    if dims is None:
                        continue
                    exp, got = list(tensor.shape[1:]), list(dims[1:])
                    if len(got) != len(exp) or any(g not in (-1, e) for g, e in zip(got, exp)):
                        problems.append(
                            f"past.{layer}.{name} is [NB, {', '.join(map(str, got))}] in the graph, "
                            f"[NB, {', '.join(map(str, exp))}] for the checkpoint"
                        )
                        break  # one line per layer is enough
        logits = outputs.get("logits")
        if logits and logits[-1] not in (-1, cfg.vocab_size):
            problems.append(f"logits of {logits[-1]} classes, the checkpoint's vocab_size is {cfg.vocab_size}")
        return problems

    @property
    def kv_block_size(self) -> int | None:
        """The KV block size the export fixed (dim 1 of the first ``past.*.key`` input), or None
        if the graph has no such input or leaves it dynamic."""
        key = next((t for t in self.inputs if t.name.startswith("past.") and t.name.endswith(".key")), None)
        if key is None or key.dims is None or len(key.dims) != 4 or key.dims[1] < 1:
            return None
        return key.dims[1]


def read_graph(path: str | os.PathLike) -> GraphIO:
    """Read ``path``'s interface (GraphReadError if it is missing or unreadable)."""
    try:
        import onnx
    except ImportError:
        raise GraphReadError("reading an ONNX file needs the 'onnx' package (pip install onnx)") from None
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise GraphReadError(f"ONNX file not found: {path}")
    try:
        model = onnx.load(path, load_external_data=False)
    except Exception as exc:  # noqa: BLE001 - onnx raises protobuf's DecodeError and others: all mean a bad file
        raise GraphReadError(f"{path}: not a readable ONNX model ({type(exc).__name__}: {exc})") from None

    def tensor(v) -> GraphTensor:
        t = v.type
        if t.WhichOneof("value") != "tensor_type":
            return GraphTensor(v.name, None, None, ())
        elem = onnx.TensorProto.DataType.Name(t.tensor_type.elem_type)
        if not t.tensor_type.HasField("shape"):
            return GraphTensor(v.name, elem, None, ())
        axes = t.tensor_type.shape.dim
        return GraphTensor(
            v.name,
            elem,
            tuple(d.dim_value if d.HasField("dim_value") else -1 for d in axes),
            tuple(d.dim_param if d.HasField("dim_param") else None for d in axes),
        )

    initializers = {t.name for t in model.graph.initializer}
    return GraphIO(
        path=path,
        inputs=tuple(tensor(v) for v in model.graph.input if v.name not in initializers),
        outputs=tuple(tensor(v) for v in model.graph.output),
        domain_nodes=tuple(
            (n.op_type, {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute})
            for n in model.graph.node
            if n.domain == ONNX_DOMAIN
        ),
        functions=tuple((f.domain, f.name) for f in model.functions),
        metadata={p.key: p.value for p in model.metadata_props},
    )
