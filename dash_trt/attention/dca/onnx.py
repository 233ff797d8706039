"""The ONNX front end of paged Dual Chunk Attention: node ``dash_trt.DualChunkAttention`` and its
model-local function in standard ONNX ops.

One node (op_type ``DualChunkAttention``, domain ``dash_trt``) with the 9 inputs and 3 outputs of
the functional torch op ``dash_trt::dual_chunk_attention`` (:mod:`dash_trt.attention.dca.ops`) and its six
scalars as attributes (:data:`dash_trt.attention.dca.ops.ATTRIBUTES`: ``chunk_size``, ``local_size``,
``original_max_position_embeddings`` and ``rotary_dim`` INT, ``rope_theta`` and
``softmax_scale`` FLOAT; ``rotary_dim`` 0 = head dim, ``softmax_scale`` 0.0 = head_dim ** -0.5).
The schema also declares the optional STRING attributes ``plugin_version`` and
``plugin_namespace`` (the fields a TensorRT plugin node carries, see :mod:`dash_trt.attention.dash.onnx`);
:func:`make_node` sets them only when asked, since no TensorRT plugin implements this op.

The model-local function of the same domain and name computes what
:func:`dash_trt.attention.dca.paged.paged_dual_chunk_attention` computes, with the same roundings (only the
float32 sums run in another order), in standard ops only (opset :data:`OPSET`), so ONNX Runtime
runs the file. No loops; ``T`` new tokens, ``B`` sequences:

1. token -> sequence ``seq[t] = #{b : query_start_loc[b+1] <= t}``, position
   ``pos[t] = seq_lens[s] - (query_start_loc[s+1] - t)``, slot through the block table;
2. each token's scale length ``L = prompt_len`` for a prompt token (``pos < prompt_len``), else
   ``pos + 1``; ``s(L) = max(1, 0.1 ln(L / original_max_position_embeddings) + 1)`` in double
   (1 when ``original_max_position_embeddings`` is 0);
3. RoPE tables in double (``inv_freq = 1 / theta ** (arange(0, rd, 2) / rd)``, angles
   ``p * inv_freq``), cos / sin rounded to float32; neox rotation of the first ``rotary_dim``
   dims in float32;
4. the new keys rotated at ``p mod c`` and multiplied by ``s(L)``, cast to the cache type, and the
   values, written into the flattened caches with ``ScatterND`` (the two cache outputs);
5. each token gathers its sequence's keys and values at positions ``0..max(seq_lens)-1`` (clamped
   to ``0..pos``, so no unwritten slot is read) from the updated caches, as float32
   ([T, max(seq_lens), Hkv, D]);
6. the three query rotations (intra at ``p mod c``, successive at ``min(p mod c + c, C)``, inter
   at ``min(2c - 1, C)``), one ``MatMul`` each against the gathered keys (GQA by reshaping q to
   [T, Hkv, G, D]); per key the region (key chunk = query chunk: intra, one chunk back:
   successive, further: inter) picks the logit; times ``s(L) * softmax_scale`` (double, rounded
   once to float32); keys after ``pos`` get -inf; one float32 ``Softmax``; ``MatMul`` with the
   values; cast to q's type.

The function does not check its inputs (the torch op does, through the paged operator): block
tables that overlap or point outside the cache are undefined behaviour here. Memory is
O(T * max(seq_lens) * Hkv * D) for the gathered keys and values and O(T * H * max(seq_lens)) per
logit tensor: fine for checking a model in ONNX Runtime, not for long prefills.

``rope_theta`` and ``softmax_scale`` are FLOAT attributes, so the node carries them rounded to
float32 (the torch op takes Python floats); the usual bases (1e4, 1e6, 1e7) are exact.

Export: :func:`translation_table` (for ``torch.onnx.export(custom_translation_table=...)``) turns
the functional op into the bare node, and :func:`add_function` adds this function to the exported
model (what :func:`dash_trt.export.export_program` does for DASH). No DCA model and no
``dash-export`` path use them yet.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import AttributeProto, TensorProto, helper

from ..dash.onnx import _Builder, ort_session_options
from . import ops as dca_ops
from .ops import ATTRIBUTES, OUTPUTS, TENSOR_INPUTS

__all__ = [
    "DOMAIN",
    "OP_TYPE",
    "OPSET",
    "DOMAIN_VERSION",
    "NODE_ATTRIBUTES",
    "register_schema",
    "dual_chunk_attention_function",
    "make_node",
    "node_attributes",
    "single_node_model",
    "run_function_ort",
    "translation_table",
    "add_function",
]

DOMAIN = "dash_trt"
OP_TYPE = "DualChunkAttention"
#: Default-domain opset of the function body and of :func:`single_node_model`.
OPSET = 20
#: Version of the ``dash_trt`` domain.
DOMAIN_VERSION = 1

_ATTR_TYPE = {"INT": AttributeProto.INT, "FLOAT": AttributeProto.FLOAT, "STRING": AttributeProto.STRING}
#: (name, ONNX type, required, doc) of every attribute the schema declares.
NODE_ATTRIBUTES = tuple((n, o, True, doc) for n, _, o, doc in ATTRIBUTES) + (
    ("plugin_version", "STRING", False, "TensorRT plugin version (no plugin implements this op yet)"),
    ("plugin_namespace", "STRING", False, "TensorRT plugin namespace (no plugin implements this op yet)"),
)
_FLOAT_TYPES = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]
_INDEX_TYPES = ["tensor(int32)", "tensor(int64)"]
_INPUT_TYPES = {n: "T" for n in ("q", "k", "v", "key_cache", "value_cache")}
_INPUT_TYPES.update({n: "I" for n in ("block_tables", "seq_lens", "query_start_loc", "prompt_lens")})
_RANKS = {
    "q": 3,
    "k": 3,
    "v": 3,
    "key_cache": 4,
    "value_cache": 4,
    "block_tables": 2,
    "seq_lens": 1,
    "query_start_loc": 1,
    "prompt_lens": 1,
}


# --------------------------------------------------------------------------- schema
def register_schema() -> None:
    """Register ``dash_trt.DualChunkAttention`` with ``onnx.defs`` (idempotent)."""
    if onnx.defs.has(OP_TYPE, DOMAIN):
        return
    S = onnx.defs.OpSchema
    schema = S(
        OP_TYPE,
        DOMAIN,
        DOMAIN_VERSION,
        doc="Dual Chunk Attention over a paged KV cache (keys cached rotated at p mod c and length-scaled); "
        "returns the output and the updated caches. See dash_trt.attention.dca.onnx.",
        inputs=[S.FormalParameter(n, _INPUT_TYPES[n]) for n in TENSOR_INPUTS],
        outputs=[S.FormalParameter(n, "T") for n in OUTPUTS],
        type_constraints=[
            ("T", _FLOAT_TYPES, "activations and caches"),
            ("I", _INDEX_TYPES, "batch metadata"),
        ],
        attributes=[S.Attribute(n, _ATTR_TYPE[o], doc, required=req) for n, o, req, doc in NODE_ATTRIBUTES],
    )
    onnx.defs.register_schema(schema)


# ----------------------------------------------------------------------- translation
def _translate(*inputs, **attrs):
    """Translation for ``custom_translation_table``: the bare custom node."""
    import onnxscript

    opset = onnxscript.values.Opset(DOMAIN, DOMAIN_VERSION)
    node_attrs = {n: (int(attrs[n]) if kind == "INT" else float(attrs[n])) for n, _, kind, _ in ATTRIBUTES}
    return getattr(opset, OP_TYPE)(*inputs, **node_attrs)


def translation_table() -> dict:
    """``{torch op: translation}`` for ``torch.onnx.export(custom_translation_table=...)``: the
    functional op ``dash_trt::dual_chunk_attention`` becomes one ``DualChunkAttention`` node.
    Add the function to the exported model with :func:`add_function`."""
    import inspect

    register_schema()
    P = inspect.Parameter
    params = [P(n, P.POSITIONAL_OR_KEYWORD) for n in TENSOR_INPUTS]
    py_type = {"INT": int, "FLOAT": float}
    params += [P(n, P.KEYWORD_ONLY, annotation=py_type[kind]) for n, _, kind, _ in ATTRIBUTES]
    # the exporter reads the signature to tell tensor inputs from attributes
    _translate.__signature__ = inspect.Signature(params)
    return {dca_ops.dual_chunk_attention_op(): _translate}


def add_function(program) -> None:
    """Add the model-local function (and the domain's opset) to a ``torch.onnx.ONNXProgram``
    exported with :func:`translation_table`."""
    import onnx_ir as ir

    fn = ir.serde.deserialize_function(dual_chunk_attention_function())
    program.model.functions[fn.identifier()] = fn
    program.model.opset_imports.setdefault(DOMAIN, DOMAIN_VERSION)


# ------------------------------------------------------------------- function builder
class _DcaBuilder(_Builder):
    """:class:`dash_trt.attention.dash.onnx._Builder` reading this node's attributes."""

    def attr(self, name: str) -> str:
        kind = next(o for n, o, _, _ in NODE_ATTRIBUTES if n == name)
        field = {"INT": "value_int", "FLOAT": "value_float", "STRING": "value_string"}[kind]
        node = helper.make_node("Constant", [], [self.fresh(name)], name=self.fresh(self._prefix))
        node.attribute.append(helper.make_attribute_ref(field, _ATTR_TYPE[kind]))
        node.attribute[-1].ref_attr_name = name
        self.nodes.append(node)
        return node.output[0]

    def d(self, v) -> str:
        """A float64 scalar (stored as a double, exactly)."""
        return self.const(v, np.float64)


def dual_chunk_attention_function() -> onnx.FunctionProto:
    """The model-local function ``dash_trt.DualChunkAttention`` (standard ONNX ops only)."""
    g = _DcaBuilder()
    q, k, v, key_c, value_c, tables, seq_lens, qsl, prompt_lens = TENSOR_INPUTS
    I64, F32, F64 = TensorProto.INT64, TensorProto.FLOAT, TensorProto.DOUBLE

    # ---- attributes and sizes
    big_c = g.attr("chunk_size")
    c = g.op("Sub", big_c, g.attr("local_size"))  # chunk length
    orig = g.attr("original_max_position_embeddings")
    theta = g.cast(g.attr("rope_theta"), F64)
    rd_attr = g.attr("rotary_dim")
    sm_attr = g.attr("softmax_scale")
    t_len, heads, head_dim = g.dim(q, 0), g.dim(q, 1), g.dim(q, 2)
    kv_heads = g.dim(k, 1)
    bsz_s = g.scalar(g.dim(key_c, 1))
    head_dim_s = g.scalar(head_dim)
    rd = g.op("Where", g.op("Greater", rd_attr, g.i(0)), rd_attr, head_dim_s)  # scalar
    half = g.op("Div", rd, g.i(2))

    # ---- 1: token -> sequence, position, slot
    table = g.cast(tables, I64)
    lens = g.cast(seq_lens, I64)
    starts = g.cast(qsl, I64)
    prompts = g.cast(prompt_lens, I64)
    ends = g.op("Slice", starts, g.i([1]), g.i([np.iinfo(np.int64).max]))  # [B]
    t_idx = g.arange(g.scalar(t_len))  # [T]
    seq = g.op(
        "ReduceSum", g.cast(g.op("LessOrEqual", g.unsq(ends, 0), g.unsq(t_idx, 1)), I64), g.i([1]), keepdims=0
    )  # [T]
    pos = g.op("Sub", g.op("Gather", lens, seq), g.op("Sub", g.op("Gather", ends, seq), t_idx))  # [T]
    table_t = g.op("Gather", table, seq)  # [T, W]

    def slots(p: str) -> str:
        """Flat cache slot of positions ``p`` [T, m] through each token's block-table row."""
        block = g.op("GatherElements", table_t, g.op("Div", p, bsz_s), axis=1)
        return g.op("Add", g.op("Mul", block, bsz_s), g.op("Mod", p, bsz_s))

    slot_idx = slots(g.unsq(pos, 1))  # [T, 1]

    # ---- 2: length scale of every new token (query and key), the logit multiplier
    prompt_t = g.op("Gather", prompts, seq)
    scale_len = g.op("Where", g.op("Less", pos, prompt_t), prompt_t, g.op("Add", pos, g.i(1)))
    ratio = g.op("Div", g.cast(scale_len, F64), g.cast(g.op("Max", orig, g.i(1)), F64))
    s = g.op("Max", g.op("Add", g.op("Mul", g.d(0.1), g.op("Log", ratio)), g.d(1.0)), g.d(1.0))
    s = g.op("Where", g.op("Greater", orig, g.i(0)), s, g.d(1.0))  # [T] double
    default_sm = g.op("Pow", g.cast(head_dim_s, F64), g.d(-0.5))
    sm = g.op("Where", g.op("Greater", sm_attr, g.f(0.0)), g.cast(sm_attr, F64), default_sm)
    q_mult = g.cast(g.op("Mul", s, sm), F32)  # [T]

    # ---- 3: RoPE
    exponent = g.op("Div", g.cast(g.op("Range", g.i(0), rd, g.i(2)), F64), g.cast(rd, F64))
    inv_freq = g.op("Div", g.d(1.0), g.op("Pow", theta, exponent))  # [rd/2] double
    half_1, rd_1 = g.unsq(half, 0), g.unsq(rd, 0)
    axis2, lo, hi = g.i([2]), g.i([0]), g.i([np.iinfo(np.int64).max])

    def rotate(x: str, p: str) -> str:
        """Neox RoPE of float32 ``x`` [T, heads, D] at int64 positions ``p`` [T]."""
        angles = g.op("Mul", g.unsq(g.cast(p, F64), 1), g.unsq(inv_freq, 0))
        cos = g.unsq(g.cast(g.op("Cos", angles), F32), 1)
        sin = g.unsq(g.cast(g.op("Sin", angles), F32), 1)
        x1 = g.op("Slice", x, lo, half_1, axis2)
        x2 = g.op("Slice", x, half_1, rd_1, axis2)
        rest = g.op("Slice", x, rd_1, hi, axis2)
        first = g.op("Sub", g.op("Mul", x1, cos), g.op("Mul", x2, sin))
        second = g.op("Add", g.op("Mul", x2, cos), g.op("Mul", x1, sin))
        return g.cat(first, second, rest, axis=2)

    local = g.op("Mod", pos, c)  # p mod c: the key's and the intra query's position
    successive = g.op("Min", g.op("Add", local, c), big_c)
    inter = g.op("Expand", g.op("Min", g.op("Sub", g.op("Mul", c, g.i(2)), g.i(1)), big_c), g.op("Shape", pos))

    # ---- 4: write the keys (rotated at p mod c, scaled) and the values
    k_rot = g.op("Mul", rotate(g.cast(k, F32), local), g.unsq(g.cast(s, F32), 1, 2))
    flat = g.cat(g.i([-1]), kv_heads, head_dim)
    key_flat = g.op("ScatterND", g.op("Reshape", key_c, flat), slot_idx, g.op("CastLike", k_rot, key_c))
    value_flat = g.op("ScatterND", g.op("Reshape", value_c, flat), slot_idx, g.op("CastLike", v, value_c))
    g.nodes.append(helper.make_node("Reshape", [key_flat, g.op("Shape", key_c)], ["key_cache_out"], name=g.fresh()))
    g.nodes.append(
        helper.make_node("Reshape", [value_flat, g.op("Shape", value_c)], ["value_cache_out"], name=g.fresh())
    )

    # ---- 5: each token's sequence keys and values, read back from the updated caches
    j = g.arange(g.scalar(g.op("ReduceMax", lens, g.i([0]), keepdims=1)))  # [L]
    pos_col = g.unsq(pos, 1)
    kv_slot = slots(g.op("Min", g.unsq(j, 0), pos_col))  # [T, L]: positions past pos clamped to pos
    keys = g.cast(g.op("Gather", key_flat, kv_slot), F32)  # [T, L, Hkv, D]
    values = g.cast(g.op("Gather", value_flat, kv_slot), F32)
    keys_t = g.op("Transpose", keys, perm=[0, 2, 3, 1])  # [T, Hkv, D, L]

    # ---- 6: three query rotations, the region of every key, one softmax
    qf = g.cast(q, F32)
    group = g.op("Div", heads, kv_heads)
    grouped = g.cat(t_len, kv_heads, group, head_dim)
    intra_l, succ_l, inter_l = (
        g.op("MatMul", g.op("Reshape", rotate(qf, p), grouped), keys_t) for p in (local, successive, inter)
    )  # [T, Hkv, G, L]
    back = g.op("Sub", g.unsq(g.op("Div", pos, c), 1), g.unsq(g.op("Div", j, c), 0))  # [T, L] chunks back
    back4 = g.unsq(back, 1, 2)
    near = g.op("Where", g.op("Equal", back4, g.i(1)), succ_l, intra_l)
    logits = g.op("Where", g.op("GreaterOrEqual", back4, g.i(2)), inter_l, near)
    logits = g.op("Mul", logits, g.unsq(q_mult, 1, 2, 3))
    visible = g.unsq(g.op("LessOrEqual", g.unsq(j, 0), pos_col), 1, 2)
    logits = g.op("Where", visible, logits, g.f(-np.inf))
    probs = g.op("Softmax", logits, axis=3)  # one softmax over the union of the regions
    out = g.op("MatMul", probs, g.op("Transpose", values, perm=[0, 2, 1, 3]))  # [T, Hkv, G, D]
    out = g.op("Reshape", out, g.cat(t_len, heads, head_dim))
    g.nodes.append(helper.make_node("CastLike", [out, q], ["out"], name=g.fresh()))

    return helper.make_function(
        DOMAIN,
        OP_TYPE,
        list(TENSOR_INPUTS),
        list(OUTPUTS),
        g.nodes,
        [helper.make_opsetid("", OPSET)],
        attributes=[n for n, _, _, _ in NODE_ATTRIBUTES],
        doc_string="Paged Dual Chunk Attention in standard ONNX ops (see dash_trt.attention.dca.onnx).",
    )


# ------------------------------------------------------------------------- the node
def node_attributes(cfg, *, rope_theta: float = 10000.0, rotary_dim=None, softmax_scale=None) -> dict:
    """The node's config attributes of a call (:func:`dash_trt.attention.dca.ops.encode`)."""
    return dca_ops.encode(cfg, rope_theta=rope_theta, rotary_dim=rotary_dim, softmax_scale=softmax_scale)


def node_config(node: onnx.NodeProto) -> dca_ops.DcaAttributes:
    """The decoded config of a ``DualChunkAttention`` node (:func:`dash_trt.attention.dca.ops.decode`)."""
    if (node.domain, node.op_type) != (DOMAIN, OP_TYPE):
        raise ValueError(f"not a {DOMAIN}.{OP_TYPE} node: {node.domain}.{node.op_type}")
    return dca_ops.decode({a.name: helper.get_attribute_value(a) for a in node.attribute})


def make_node(
    inputs: list[str],
    outputs: list[str],
    attrs: dict,
    name: str = "dual_chunk_attention",
    plugin_fields: dict[str, str] | None = None,
) -> onnx.NodeProto:
    """A ``dash_trt.DualChunkAttention`` node with the config attributes ``attrs`` (from
    :func:`node_attributes`), plus ``plugin_version`` / ``plugin_namespace`` if given."""
    node = helper.make_node(OP_TYPE, inputs, outputs, name=name, domain=DOMAIN)
    for n, _, kind, _ in ATTRIBUTES:
        value = int(attrs[n]) if kind == "INT" else float(attrs[n])
        node.attribute.append(helper.make_attribute(n, value, attr_type=_ATTR_TYPE[kind]))
    for n, value in (plugin_fields or {}).items():
        if n not in ("plugin_version", "plugin_namespace"):
            raise ValueError(f"unknown plugin field {n!r}")
        node.attribute.append(helper.make_attribute(n, value, attr_type=AttributeProto.STRING))
    return node


def single_node_model(
    attrs: dict, dtype: int = TensorProto.FLOAT, index_dtype: int = TensorProto.INT32
) -> onnx.ModelProto:
    """A model holding one ``DualChunkAttention`` node and its function, every dim dynamic (for
    testing the function against the paged operator)."""
    register_schema()

    def vi(name: str, base: str) -> onnx.ValueInfoProto:
        elem = index_dtype if _INPUT_TYPES[base] == "I" else dtype
        return helper.make_tensor_value_info(name, elem, [f"{base}_{d}" for d in range(_RANKS[base])])

    inputs = [vi(n, n) for n in TENSOR_INPUTS]
    outputs = [vi("out", "q"), vi("key_cache_out", "key_cache"), vi("value_cache_out", "value_cache")]
    graph = helper.make_graph(
        [make_node(list(TENSOR_INPUTS), list(OUTPUTS), attrs)], "dual_chunk_attention", inputs, outputs
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(DOMAIN, DOMAIN_VERSION)],
        functions=[dual_chunk_attention_function()],
    )
    model.ir_version = 10
    return model


def run_function_ort(model: onnx.ModelProto) -> Callable:
    """An ONNX Runtime session (CPU) over ``model`` as a function of numpy inputs, in the model's
    input order; returns the list of outputs."""
    from ..dash.onnx import import_onnxruntime

    ort = import_onnxruntime()
    sess = ort.InferenceSession(model.SerializeToString(), ort_session_options(), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    return lambda *arrays: sess.run(None, dict(zip(names, arrays)))
