"""The ONNX front end of DASH attention: node ``dash_trt.DashAttention`` and its local
function.

Every DASH attention call becomes ONE node (op_type ``DashAttention``, domain
``dash_trt``) with the 17 inputs and 7 outputs of the torch op (:mod:`dash_trt.attention.dash.ops`)
and the configuration as attributes (:mod:`dash_trt.attention.dash.attributes`, plus
``plugin_version`` and ``plugin_namespace``). The model also carries a model-local
function of the same domain and name whose body uses standard ONNX ops only, so ONNX
Runtime (or any runtime without the plugin) runs the file as is, while TensorRT runs the
plugin: its ONNX parser looks the creator up by op type, ``plugin_version`` and
``plugin_namespace``; 10.7-10.14 prefer a registered plugin over a local function of the
same name, and from 10.15 on a node is imported as a plugin only when it carries a
``plugin_namespace`` attribute (read in onnx-tensorrt's ModelImporter.cpp, parseNode, of
those releases), which every node here does.

How the exporter is made to do this (torch 2.13, onnx 1.23, onnxscript 0.7; measured):

- the exporter refuses a custom-domain op without a schema ("No schema registered for
  'DashAttention'"), so :func:`register_schema` registers an ``onnx.defs.OpSchema``;
  attributes not declared in that schema are silently dropped from the node, hence
  ``plugin_version`` and ``plugin_namespace`` are declared too;
- the translation (:func:`translation_table`, for ``custom_translation_table``) emits
  the bare custom node; a translation that calls an onnxscript function instead gets
  inlined by the exporter's passes (the function disappears, or the inliner fails on
  a multi-output call);
- :func:`dash_attention_function` builds the ``FunctionProto``, which
  :func:`dash_trt.export.export_program` adds to the model's functions after export.

The function body is built with ``onnx.helper`` from small Python helpers (RoPE is
used four times) instead of onnxscript's script mode, where each helper would become a
nested function call of its own. It reads every configuration value from the node's
attributes (attribute references), so one function serves every layer.

How the body computes the paged operator on a ragged batch (no loops; T new tokens,
B sequences, every step vectorised over tokens):

1. token -> sequence: ``seq[t] = #{b : query_start_loc[b+1] <= t}``; position
   ``pos[t] = seq_lens[s] - (query_start_loc[s+1] - t)``; slot from the block table.
   Rotated k, v, rotated index keys (non-finite zeroed) and image pages are written
   with ``ScatterND``.
2. A new token completes sparse block ``pos // sbs`` exactly when
   ``(pos + 1) % sbs == 0``; those tokens (``NonZero``) gather their block's index
   keys and image pages from the updated cache and ``ScatterND`` the summaries and page
   ranges into place (same formulas as :func:`dash_trt.attention.dash.reference.block_summaries`).
3. Scores against every complete block of every sequence in one ``MatMul``
   ([T, Di] x [Di, B * N]), then each token keeps its own sequence's row; blocks that
   are not remote get -1e9. Candidates from the page ranges; the rare "page strictly
   inside the range" pairs are resolved from the image pages (``NonZero`` + gather +
   ``ScatterND``), like :func:`dash_trt.attention.dash.paged._candidates`.
4. Routing exactly as docs/spec.md's (Unlimited-OCR-2's): each token's candidates are its
   page's remote image blocks, or every remote block when there are none; routing values
   ``x = score * scale / sqrt(Di)`` there, -1e4 elsewhere. The block axis is the batch's
   widest (complete blocks plus one never-remote column); a token's columns past its own
   sequence's ``N = ceil(len / sbs)`` get -inf, so one ``TopK`` of ``min(16, N')`` (ties to the
   lower index, as the reference's stable sort) ranks every token's own top ``M = min(16, N)``
   first. entmax-1.5 over the first M ranks in closed form (``CumSum`` of the halved values and
   their squares, the support counted over ranks < M); the first ``K = min(dash_topk_blocks, M)``
   are kept, valid where they are candidates; their bias is the centred log of the floored
   prior over ``dash_sigma``.
5. Attention over the selected blocks plus the local window: keys and values gathered
   through the block table ([T, M, Hkv, D]), GQA by reshaping q to [T, Hkv, G, D],
   float32 logits and softmax, output cast to q's dtype.

Memory: the gathered keys and values take O(T * (K * sbs + window) * Hkv * D); the
body does not chunk queries (the reference does). Fine for checking a model in ONNX
Runtime; long prefills belong to the plugin.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import AttributeProto, TensorProto, helper

from . import attributes as A
from .config import ROUTE_TOP_M
from .ops import OUTPUTS, TENSOR_INPUTS, paged_attention_op
from .reference import NOT_CANDIDATE, NOT_REMOTE, SCORE_CLAMP

__all__ = [
    "DOMAIN",
    "OP_TYPE",
    "OPSET",
    "DOMAIN_VERSION",
    "register_schema",
    "translation_table",
    "dash_attention_function",
    "make_node",
    "node_config",
    "single_node_model",
    "run_function_ort",
    "ort_session_options",
]

DOMAIN = A.ONNX_DOMAIN
OP_TYPE = A.PLUGIN_NAME
#: Default-domain opset of the exported model and of the function body.
OPSET = 20
#: Version of the ``dash_trt`` domain.
DOMAIN_VERSION = 1

_FLOAT_TYPES = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]
_INDEX_TYPES = ["tensor(int32)", "tensor(int64)"]
#: type constraint of each input / output (see ``docs/api.md`` for the layouts)
_INPUT_TYPES = {
    "q": "T",
    "k": "T",
    "v": "T",
    "iq": "T",
    "ik": "T",
    "coords": "I",
    "head_cls": "T",  # the plugin reads it in q's type (plugins/trt/dash_plugin.cpp, kData)
    "key_cache": "T",
    "value_cache": "T",
    "index_key_cache": "T",
    "image_page_cache": "tensor(int32)",
    "summary_cache": "tensor(float)",
    "summary_pages_cache": "tensor(int32)",
    "block_tables": "I",
    "seq_lens": "I",
    "query_start_loc": "I",
    "prompt_lens": "I",
}
_OUTPUT_TYPES = {
    "out": "T",
    "key_cache_out": "T",
    "value_cache_out": "T",
    "index_key_cache_out": "T",
    "image_page_cache_out": "tensor(int32)",
    "summary_cache_out": "tensor(float)",
    "summary_pages_cache_out": "tensor(int32)",
}
_ATTR_TYPE = {
    "INT": onnx.AttributeProto.INT,
    "INTS": onnx.AttributeProto.INTS,
    "FLOAT": onnx.AttributeProto.FLOAT,
    "STRING": onnx.AttributeProto.STRING,
}


# --------------------------------------------------------------------------- schema
def register_schema() -> None:
    """Register ``dash_trt.DashAttention`` with ``onnx.defs`` (idempotent).

    The exporter needs it to emit the node; the checker uses it to check the node.
    """
    if onnx.defs.has(OP_TYPE, DOMAIN):
        return
    S = onnx.defs.OpSchema
    schema = S(
        OP_TYPE,
        DOMAIN,
        DOMAIN_VERSION,
        doc="DASH attention over a paged KV cache (block-sparse, page-aware RoPE); "
        "returns the output and the updated caches. See dash_trt.attention.dash.onnx.",
        inputs=[S.FormalParameter(n, _INPUT_TYPES[n]) for n in TENSOR_INPUTS],
        outputs=[S.FormalParameter(n, _OUTPUT_TYPES[n]) for n in OUTPUTS],
        type_constraints=[
            ("T", _FLOAT_TYPES, "activations, head_cls and caches"),
            ("I", _INDEX_TYPES, "coordinates and batch metadata"),
        ],
        attributes=[S.Attribute(a.name, _ATTR_TYPE[a.onnx_type], a.doc, required=True) for a in A.NODE_ATTRIBUTES],
    )
    onnx.defs.register_schema(schema)


# ----------------------------------------------------------------------- translation
def _translate(*inputs, **attrs):
    """Translation for ``custom_translation_table``: the bare custom node."""
    import onnx_ir as ir
    import onnxscript

    opset = onnxscript.values.Opset(DOMAIN, DOMAIN_VERSION)
    node_attrs = {a.name: attrs[a.name] for a in A.OP_ATTRIBUTES}
    for a in A.OP_ATTRIBUTES:
        if a.onnx_type == "INTS":
            # an empty list (no dense layers) has no type of its own: say it
            node_attrs[a.name] = ir.Attr(a.name, ir.AttributeType.INTS, [int(x) for x in attrs[a.name]])
    return getattr(opset, OP_TYPE)(*inputs, **node_attrs, **A.PLUGIN_FIELDS)


def translation_table() -> dict:
    """``{torch op: translation}`` for ``torch.onnx.export(custom_translation_table=...)``."""
    import inspect

    register_schema()
    P = inspect.Parameter
    params = [P(n, P.POSITIONAL_OR_KEYWORD) for n in TENSOR_INPUTS]
    py_type = {"INT": int, "INTS": list[int], "FLOAT": float, "STRING": str}
    params += [P(a.name, P.KEYWORD_ONLY, annotation=py_type[a.onnx_type]) for a in A.OP_ATTRIBUTES]
    # The exporter reads the signature to tell tensor inputs from attributes.
    _translate.__signature__ = inspect.Signature(params)
    return {paged_attention_op(): _translate}


# ------------------------------------------------------------------- function builder
class _Builder:
    """Appends nodes to a function body; returns value names."""

    def __init__(self, prefix: str = "n"):
        self.nodes: list[onnx.NodeProto] = []
        self._count = 0
        self._prefix = prefix

    def fresh(self, hint: str = "t") -> str:
        self._count += 1
        return f"{hint}_{self._count}"

    def op(self, op_type: str, *inputs: str, outputs: int = 1, hint: str | None = None, **attrs):
        names = [self.fresh(hint or op_type.lower()) for _ in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), names, name=self.fresh(self._prefix), **attrs))
        return names[0] if outputs == 1 else names

    # constants
    def const(self, value, dtype=np.int64, hint: str = "c") -> str:
        arr = np.asarray(value, dtype=dtype)
        return self.op(
            "Constant",
            value=helper.make_tensor(
                self.fresh(hint), helper.np_dtype_to_tensor_dtype(arr.dtype), arr.shape, arr.flatten().tolist()
            ),
            hint=hint,
        )

    def i(self, v) -> str:
        return self.const(v, np.int64)

    def f(self, v) -> str:
        return self.const(v, np.float32)

    def attr(self, name: str) -> str:
        """The node attribute ``name`` as a tensor (int64 / float32 scalar, int64 [n],
        or a string scalar)."""
        a = next(x for x in A.NODE_ATTRIBUTES if x.name == name)
        field = {"INT": "value_int", "INTS": "value_ints", "FLOAT": "value_float", "STRING": "value_string"}[
            a.onnx_type
        ]
        node = helper.make_node("Constant", [], [self.fresh(name)], name=self.fresh(self._prefix))
        node.attribute.append(helper.make_attribute_ref(field, _ATTR_TYPE[a.onnx_type]))
        node.attribute[-1].ref_attr_name = name
        self.nodes.append(node)
        return node.output[0]

    def string(self, v: str) -> str:
        return self.op(
            "Constant", value=helper.make_tensor(self.fresh("s"), TensorProto.STRING, [], [v.encode()]), hint="s"
        )

    # shapes
    def dim(self, x: str, axis: int) -> str:
        """Size of ``x`` along ``axis`` as int64 [1]."""
        if axis == -1:
            return self.op("Shape", x, start=-1)
        return self.op("Shape", x, start=axis, end=axis + 1)

    def scalar(self, x: str) -> str:
        return self.op("Squeeze", x, self.i([0]))

    def unsq(self, x: str, *axes: int) -> str:
        return self.op("Unsqueeze", x, self.i(list(axes)))

    def sq(self, x: str, *axes: int) -> str:
        return self.op("Squeeze", x, self.i(list(axes)))

    def cat(self, *xs: str, axis: int = 0) -> str:
        return self.op("Concat", *xs, axis=axis)

    def reshape(self, x: str, *parts: str) -> str:
        return self.op("Reshape", x, self.cat(*parts))

    def cast(self, x: str, to: int) -> str:
        return self.op("Cast", x, to=to)

    def col(self, x: str, j: int) -> str:
        """Column ``j`` of a 2-D tensor -> 1-D."""
        return self.op("Gather", x, self.i(j), axis=1)

    def arange(self, n: str) -> str:
        """0..n-1 (int64) for a scalar n."""
        return self.op("Range", self.i(0), n, self.i(1))

    def nan_to_num(self, x: str, like: str) -> str:
        xf = self.cast(x, TensorProto.FLOAT)
        bad = self.op("Or", self.op("IsNaN", xf), self.op("IsInf", xf))
        return self.op("Where", bad, self.op("CastLike", self.f(0.0), like), x)


def _rope(g: _Builder, x: str, rank: int, tok_f: str, page_f: str, mode_attr: str) -> str:
    """``page_rope`` (dash_trt.attention.dash.reference) of ``x`` [T, (heads,) dim] in x's dtype.

    ``tok_f`` [T] float32 token coordinates, ``page_f`` [T] float32 page coordinates
    (already reduced modulo ``sparse_rope_page_mod``).
    """
    dim = g.dim(x, -1)
    half = g.op("Div", dim, g.i([2]))
    pairs = g.unsq(g.attr("sparse_rope_page_pairs"), 0)
    ntok = g.op("Sub", half, pairs)
    truncate = g.op("Equal", g.attr(mode_attr), g.string("truncate"))
    # NOTE: float32 frequencies as in the reference: theta ** (i / n), then 1 / that.
    denom = g.op(
        "Where", truncate, g.op("Div", g.cast(dim, TensorProto.FLOAT), g.f(2.0)), g.cast(ntok, TensorProto.FLOAT)
    )
    exponent = g.op("Div", g.cast(g.arange(g.scalar(ntok)), TensorProto.FLOAT), denom)
    inv_tok = g.op("Div", g.f(1.0), g.op("Pow", g.attr("sparse_rope_tok_theta"), exponent))
    page_exp = g.op("Div", g.cast(g.arange(g.scalar(pairs)), TensorProto.FLOAT), g.cast(pairs, TensorProto.FLOAT))
    inv_page = g.op("Div", g.f(1.0), g.op("Pow", g.attr("sparse_rope_page_theta"), page_exp))
    angles = g.cat(
        g.op("Mul", g.unsq(tok_f, 1), g.unsq(inv_tok, 0)), g.op("Mul", g.unsq(page_f, 1), g.unsq(inv_page, 0)), axis=1
    )
    phase = g.cat(angles, angles, axis=1)  # [T, dim]
    cos = g.op("CastLike", g.op("Cos", phase), x)
    sin = g.op("CastLike", g.op("Sin", phase), x)
    if rank == 3:
        cos, sin = g.unsq(cos, 1), g.unsq(sin, 1)
    a, b = g.op("Split", x, axis=-1, num_outputs=2, outputs=2)
    rotated = g.cat(g.op("Neg", b), a, axis=-1)
    return g.op("Add", g.op("Mul", x, cos), g.op("Mul", rotated, sin))


def _block_summaries(g: _Builder, keys: str, real: str, head_cls_f: str, inv_sqrt_di: str) -> str:
    """``reference.block_summaries``: keys [C, sbs, Di] f32, real [C, sbs] bool.

    C is 0 in most decode steps (no block completes). Reductions here name their axes as
    non-negative numbers: ONNX Runtime before 1.32 returns the input unreduced for a negative
    axis over a tensor with a zero-size dimension (seen with 1.18-1.31).
    """
    logits = g.op("Mul", g.op("ReduceSum", g.op("Mul", keys, head_cls_f), g.i([2]), keepdims=0), inv_sqrt_di)
    logits = g.op("Clip", logits, g.f(-SCORE_CLAMP), g.f(SCORE_CLAMP))
    lowest = g.f(float(np.finfo(np.float32).min))
    row_max = g.op("ReduceMax", g.op("Where", real, logits, lowest), g.i([1]), keepdims=1)
    # NOTE: like the reference, tokens that do not count still enter exp() before being
    # zeroed; an all-masked block gives inf * 0 = nan, which nan_to_num turns into 0.
    ex = g.op("Mul", g.op("Exp", g.op("Sub", logits, row_max)), g.cast(real, TensorProto.FLOAT))
    denom = g.op("Max", g.op("ReduceSum", ex, g.i([1]), keepdims=1), g.f(1e-6))
    weights = g.op("Div", ex, denom)
    summ = g.op("ReduceSum", g.op("Mul", g.unsq(weights, 2), keys), g.i([1]), keepdims=0)
    return g.nan_to_num(summ, summ)


def _inv_sqrt(g: _Builder, dim: str) -> str:
    """1 / sqrt(dim) computed in double and rounded once, as Python does."""
    d = g.cast(dim, TensorProto.DOUBLE)
    return g.cast(g.op("Div", g.const(1.0, np.float64), g.op("Sqrt", d)), TensorProto.FLOAT)


def dash_attention_function() -> onnx.FunctionProto:
    """The model-local function ``dash_trt.DashAttention`` (standard ONNX ops only)."""
    g = _Builder()
    (
        q,
        k,
        v,
        iq,
        ik,
        coords,
        head_cls,
        key_c,
        value_c,
        ikey_c,
        img_c,
        summ_c,
        spages_c,
        tables,
        seq_lens,
        qsl,
        prompt_lens,
    ) = TENSOR_INPUTS
    I64, F32, I32 = TensorProto.INT64, TensorProto.FLOAT, TensorProto.INT32

    # ---- sizes and attributes
    sbs = g.attr("sparse_block_size")
    lblk = g.attr("sparse_local_block")
    window = g.op("Mul", sbs, lblk)
    t_len = g.dim(q, 0)
    heads, head_dim = g.dim(q, 1), g.dim(q, 2)
    kv_heads = g.dim(k, 1)
    idx_dim = g.dim(iq, 1)
    bsz = g.dim(key_c, 1)
    bsz_s = g.scalar(bsz)
    width = g.dim(tables, 1)
    inv_sqrt_di = _inv_sqrt(g, idx_dim)
    inv_sqrt_d = _inv_sqrt(g, head_dim)

    # ---- 1a: token -> sequence, position, slot
    c64 = g.cast(coords, I64)
    tok, page, img_page, q_page = (g.col(c64, j) for j in range(4))
    table = g.cast(tables, I64)
    lens = g.cast(seq_lens, I64)
    starts = g.cast(qsl, I64)
    prompts = g.cast(prompt_lens, I64)
    ends = g.op("Slice", starts, g.i([1]), g.i([np.iinfo(np.int64).max]))  # [B]
    t_idx = g.arange(g.scalar(t_len))  # [T]
    seq = g.op(
        "ReduceSum", g.cast(g.op("LessOrEqual", g.unsq(ends, 0), g.unsq(t_idx, 1)), I64), g.i([1]), keepdims=0
    )  # [T]
    len_t = g.op("Gather", lens, seq)
    pos = g.op("Sub", len_t, g.op("Sub", g.op("Gather", ends, seq), t_idx))
    prompt_t = g.op("Gather", prompts, seq)
    table_t = g.op("Gather", table, seq)  # [T, W]

    def slots(tab: str, p: str) -> str:
        """Flat cache slot of positions ``p`` [n, m] through block-table rows ``tab`` [n, W]."""
        return g.op(
            "Add", g.op("Mul", g.op("GatherElements", tab, g.op("Div", p, bsz_s), axis=1), bsz_s), g.op("Mod", p, bsz_s)
        )

    slot = g.sq(slots(table_t, g.unsq(pos, 1)), 1)  # [T]
    slot_idx = g.unsq(slot, 1)  # [T, 1]

    # ---- page RoPE coordinates
    mod = g.attr("sparse_rope_page_mod")
    page_m = g.op("Where", g.op("Greater", mod, g.i(0)), g.op("Mod", page, g.op("Max", mod, g.i(1))), page)
    tok_f, page_f = g.cast(tok, F32), g.cast(page_m, F32)

    # ---- 1b: write rotated keys, values, index keys, image pages
    k_rot = _rope(g, k, 3, tok_f, page_f, "sparse_main_rope_tok_freq_mode")
    ik_rot = g.nan_to_num(_rope(g, ik, 2, tok_f, page_f, "sparse_rope_tok_freq_mode"), ik)
    key_shape, ikey_shape, img_shape = g.op("Shape", key_c), g.op("Shape", ikey_c), g.op("Shape", img_c)
    flat_kv = g.cat(g.i([-1]), kv_heads, head_dim)
    key_flat = g.op("ScatterND", g.op("Reshape", key_c, flat_kv), slot_idx, k_rot)
    value_flat = g.op("ScatterND", g.op("Reshape", value_c, flat_kv), slot_idx, v)
    ikey_flat = g.op("ScatterND", g.op("Reshape", ikey_c, g.cat(g.i([-1]), idx_dim)), slot_idx, ik_rot)
    img_flat = g.op("ScatterND", g.op("Reshape", img_c, g.i([-1])), slot_idx, g.cast(img_page, I32))
    g.nodes.append(helper.make_node("Reshape", [key_flat, key_shape], ["key_cache_out"], name=g.fresh()))
    g.nodes.append(helper.make_node("Reshape", [value_flat, key_shape], ["value_cache_out"], name=g.fresh()))
    g.nodes.append(helper.make_node("Reshape", [ikey_flat, ikey_shape], ["index_key_cache_out"], name=g.fresh()))
    g.nodes.append(helper.make_node("Reshape", [img_flat, img_shape], ["image_page_cache_out"], name=g.fresh()))

    # ---- 2: summaries of the sparse blocks this call completes
    completes = g.op("Equal", g.op("Mod", g.op("Add", pos, g.i(1)), sbs), g.i(0))
    done = g.sq(g.op("NonZero", completes), 0)  # [C]
    c_seq = g.op("Gather", seq, done)
    c_blk = g.op("Div", g.op("Gather", pos, done), sbs)
    c_table = g.op("Gather", table, c_seq)  # [C, W]
    c_first = g.op("Mul", c_blk, sbs)
    blk_pos = g.op("Add", g.unsq(c_first, 1), g.unsq(g.arange(sbs), 0))  # [C, sbs]
    blk_slot = slots(c_table, blk_pos)
    c_keys = g.cast(g.op("Gather", ikey_flat, blk_slot), F32)  # [C, sbs, Di]
    c_prompt = g.unsq(g.op("Gather", prompts, c_seq), 1)
    real = g.op("Or", g.op("Less", c_prompt, g.i(0)), g.op("Less", blk_pos, c_prompt))
    head_cls_f = g.cast(head_cls, F32)
    summaries = _block_summaries(g, c_keys, real, head_cls_f, inv_sqrt_di)
    c_phys = g.op("GatherElements", c_table, g.unsq(g.op("Div", c_first, bsz_s), 1), axis=1)  # [C, 1]
    c_sub = g.unsq(g.op("Div", g.op("Mod", c_first, bsz_s), sbs), 1)
    c_loc = g.cat(c_phys, c_sub, axis=1)  # [C, 2]
    summ_new = g.op("ScatterND", summ_c, c_loc, summaries)
    # page ranges: lowest / highest image page, and whether every page between occurs
    c_img = g.cast(g.op("Gather", img_flat, blk_slot), I64)  # [C, sbs]
    has = g.op("GreaterOrEqual", c_img, g.i(0))
    lo = g.op("ReduceMin", g.op("Where", has, c_img, g.i(np.iinfo(np.int64).max)), g.i([1]), keepdims=0)
    hi = g.op("ReduceMax", g.op("Where", has, c_img, g.i(-1)), g.i([1]), keepdims=0)
    any_img = g.op("Greater", g.op("ReduceMax", g.cast(has, I64), g.i([1]), keepdims=0), g.i(0))
    lo = g.op("Where", any_img, lo, g.i(-1))
    # distinct pages = tokens whose page does not occur earlier in the block
    ar = g.arange(sbs)
    earlier = g.op("Less", g.unsq(ar, 1), g.unsq(ar, 0))  # [j, i]: j < i
    same = g.op("Equal", g.unsq(c_img, 2), g.unsq(c_img, 1))  # [C, j, i]
    seen = g.op("ReduceMax", g.cast(g.op("And", same, earlier), I64), g.i([1]), keepdims=0)  # [C, i]
    first_occ = g.op("And", has, g.op("Equal", seen, g.i(0)))
    distinct = g.op("ReduceSum", g.cast(first_occ, I64), g.i([1]), keepdims=0)
    dense = g.op("Or", g.op("Equal", distinct, g.op("Add", g.op("Sub", hi, lo), g.i(1))), g.op("Not", any_img))
    c_pages = g.cast(g.cat(g.unsq(lo, 1), g.unsq(hi, 1), g.unsq(g.cast(dense, I64), 1), axis=1), I32)
    spages_new = g.op("ScatterND", spages_c, c_loc, c_pages)
    g.nodes.append(helper.make_node("Identity", [summ_new], ["summary_cache_out"], name=g.fresh()))
    g.nodes.append(helper.make_node("Identity", [spages_new], ["summary_pages_cache_out"], name=g.fresh()))

    # ---- 3: scores and candidates over every sequence's complete blocks
    n_max = g.op("Div", g.op("ReduceMax", lens, keepdims=1), sbs)  # [1]
    n_cols = g.op("Add", n_max, g.i([1]))  # one extra, never remote
    j = g.arange(g.scalar(n_cols))  # [N']
    j_first = g.op("Mul", j, sbs)
    tab_col = g.op("Min", g.op("Div", j_first, bsz_s), g.op("Sub", g.scalar(width), g.i(1)))
    phys_bj = g.op("Max", g.op("Gather", table, tab_col, axis=1), g.i(0))  # [B, N'] (-1 pad -> 0)
    sub_j = g.op("Div", g.op("Mod", j_first, bsz_s), sbs)  # [N']
    loc_bj = g.cat(g.unsq(phys_bj, 2), g.unsq(g.op("Expand", g.unsq(sub_j, 0), g.op("Shape", phys_bj)), 2), axis=2)
    summ_bj = g.op("GatherND", summ_new, loc_bj)  # [B, N', Di]
    pages_bj = g.cast(g.op("GatherND", spages_new, loc_bj), I64)  # [B, N', 3]
    q_rot = _rope(g, q, 3, tok_f, page_f, "sparse_main_rope_tok_freq_mode")
    iq_rot = g.nan_to_num(g.cast(_rope(g, iq, 2, tok_f, page_f, "sparse_rope_tok_freq_mode"), F32), head_cls_f)
    n_seq = g.dim(lens, 0)
    flat_summ = g.op("Reshape", summ_bj, g.cat(g.i([-1]), idx_dim))  # [B*N', Di]
    scores_all = g.op(
        "Reshape", g.op("MatMul", iq_rot, g.op("Transpose", flat_summ, perm=[1, 0])), g.cat(t_len, n_seq, n_cols)
    )  # [T, B, N']
    own = g.op("Expand", g.unsq(seq, 1, 2), g.cat(t_len, g.i([1]), n_cols))
    scores = g.sq(g.op("GatherElements", scores_all, own, axis=1), 1)  # [T, N']
    scores = g.op("Clip", g.op("Mul", scores, inv_sqrt_di), g.f(-SCORE_CLAMP), g.f(SCORE_CLAMP))
    blk_t = g.op("Div", pos, sbs)
    remote = g.op("LessOrEqual", g.unsq(j, 0), g.unsq(g.op("Sub", blk_t, lblk), 1))
    prompt_col = g.unsq(prompt_t, 1)
    remote = g.op(
        "And", remote, g.op("Or", g.op("Less", prompt_col, g.i(0)), g.op("Less", g.unsq(j_first, 0), prompt_col))
    )
    # NOTE: -1e9 marks "not remote", as in the reference.
    scores = g.op("Where", remote, scores, g.f(NOT_REMOTE))
    pages_t = g.op("Gather", pages_bj, seq)  # [T, N', 3]
    p_lo = g.op("Gather", pages_t, g.i(0), axis=2)
    p_hi = g.op("Gather", pages_t, g.i(1), axis=2)
    p_dense = g.op("Gather", pages_t, g.i(2), axis=2)
    qp = g.unsq(q_page, 1)
    inside = g.op(
        "And",
        g.op("And", g.op("GreaterOrEqual", qp, g.i(0)), g.op("LessOrEqual", p_lo, qp)),
        g.op("LessOrEqual", qp, p_hi),
    )
    sure = g.op("Or", g.op("Or", g.op("Greater", p_dense, g.i(0)), g.op("Equal", qp, p_lo)), g.op("Equal", qp, p_hi))
    cand = g.op("And", inside, sure)
    # a page strictly inside a block's page range may have no image token there: look
    # at the block's image pages for those (rare) remote pairs only
    unsure = g.op("And", g.op("And", inside, g.op("Not", sure)), remote)
    u_idx = g.op("Transpose", g.op("NonZero", unsure), perm=[1, 0])  # [U, 2]
    u_t = g.op("Gather", u_idx, g.i(0), axis=1)
    u_b = g.op("Gather", u_idx, g.i(1), axis=1)
    u_pos = g.op("Add", g.unsq(g.op("Mul", u_b, sbs), 1), g.unsq(g.arange(sbs), 0))  # [U, sbs]
    u_img = g.cast(g.op("Gather", img_flat, slots(g.op("Gather", table_t, u_t), u_pos)), I64)
    u_hit = g.op(
        "Greater",
        g.op(
            "ReduceMax", g.cast(g.op("Equal", u_img, g.unsq(g.op("Gather", q_page, u_t), 1)), I64), g.i([1]), keepdims=0
        ),
        g.i(0),
    )
    cand = g.op("ScatterND", cand, u_idx, u_hit)

    # ---- 4: route (Unlimited-OCR-2: own-page restriction, top 16 by routing value, entmax-1.5
    # prior over them, keep K, centred log prior over sigma as each kept block's bias)
    own = g.op("And", cand, remote)
    any_own = g.op("Greater", g.op("ReduceMax", g.cast(own, I64), g.i([1]), keepdims=1), g.i(0))  # [T, 1]
    # (ONNX Runtime has no boolean Where)
    restrict = g.op("Or", g.op("And", any_own, own), g.op("And", g.op("Not", any_own), remote))  # [T, N']
    # NOTE: scale / sqrt(Di) in double, rounded once to float32, as the reference's Python float
    factor = g.cast(
        g.op(
            "Div",
            g.cast(g.attr("dash_scaling_factor"), TensorProto.DOUBLE),
            g.op("Sqrt", g.cast(idx_dim, TensorProto.DOUBLE)),
        ),
        F32,
    )
    not_cand = g.f(NOT_CANDIDATE)
    x = g.op("Where", restrict, g.op("Mul", scores, factor), not_cand)
    x = g.op("Where", g.op("Or", g.op("IsNaN", x), g.op("IsInf", x)), not_cand, x)
    # The sequence's own N = ceil(len / sbs) blocks; the batch's other columns rank below all of them.
    n_t = g.op("Div", g.op("Add", len_t, g.op("Sub", sbs, g.i(1))), sbs)  # [T]
    x = g.op("Where", g.op("Less", g.unsq(j, 0), g.unsq(n_t, 1)), x, g.f(-np.inf))
    kk = g.op("Min", g.i([ROUTE_TOP_M]), n_cols)  # [1]
    vals, idx = g.op("TopK", x, kk, axis=1, largest=1, sorted=1, outputs=2)  # ties to the lower index
    m_t = g.op("Min", n_t, g.i(ROUTE_TOP_M))  # [T]: M of the token's sequence
    rank = g.arange(g.scalar(kk))
    in_m = g.op("Less", g.unsq(rank, 0), g.unsq(m_t, 1))  # [T, kk]
    top = g.op("Slice", vals, g.i([0]), g.i([1]), g.i([1]))  # [T, 1]
    z = g.op("Where", in_m, g.op("Div", g.op("Sub", vals, top), g.f(2.0)), g.f(0.0))
    rho = g.unsq(g.cast(g.op("Add", rank, g.i(1)), F32), 0)  # [1, kk]
    mean = g.op("Div", g.op("CumSum", z, g.i(1)), rho)
    mean_sq = g.op("Div", g.op("CumSum", g.op("Mul", z, z), g.i(1)), rho)
    gap = g.op(
        "Max",
        g.op("Div", g.op("Sub", g.f(1.0), g.op("Mul", rho, g.op("Sub", mean_sq, g.op("Mul", mean, mean)))), rho),
        g.f(0.0),
    )
    tau = g.op("Sub", mean, g.op("Sqrt", gap))
    support = g.op("ReduceSum", g.cast(g.op("And", g.op("LessOrEqual", tau, z), in_m), I64), g.i([1]), keepdims=1)
    thr = g.op("GatherElements", tau, g.op("Sub", g.op("Max", support, g.i(1)), g.i(1)), axis=1)  # [T, 1]
    d = g.op("Max", g.op("Sub", z, thr), g.f(0.0))
    prior = g.op("Mul", d, d)
    k_take = g.op("Min", g.unsq(g.attr("dash_topk_blocks"), 0), kk)  # [1]: columns kept
    k_t = g.op("Min", g.attr("dash_topk_blocks"), m_t)  # [T]: K of the token's sequence
    selected = g.op("Slice", idx, g.i([0]), k_take, g.i([1]))  # [T, K]
    prior = g.op("Slice", prior, g.i([0]), k_take, g.i([1]))
    kept = g.op("Less", g.unsq(g.arange(g.scalar(k_take)), 0), g.unsq(k_t, 1))
    valid = g.op("And", g.op("GatherElements", restrict, selected, axis=1), kept)
    logp = g.op("Log", g.op("Max", prior, g.attr("dash_prior_floor")))
    zero = g.f(0.0)
    n_valid = g.op("Max", g.op("ReduceSum", g.cast(valid, F32), g.i([1]), keepdims=1), g.f(1.0))
    mean_log = g.op("Div", g.op("ReduceSum", g.op("Where", valid, logp, zero), g.i([1]), keepdims=1), n_valid)
    bias = g.op("Where", valid, g.op("Div", g.op("Sub", logp, mean_log), g.attr("dash_sigma")), zero)

    # ---- 5: attend selected blocks + local window (float32 softmax, GQA)
    neg_inf = g.f(-np.inf)
    offs = g.arange(sbs)
    r_pos = g.op(
        "Reshape", g.op("Add", g.unsq(g.op("Mul", selected, sbs), 2), g.unsq(offs, 0, 1)), g.cat(t_len, g.i([-1]))
    )  # [T, K*sbs]
    sel_shape3 = g.cat(t_len, k_take, g.unsq(sbs, 0))
    flat2 = g.cat(t_len, g.i([-1]))
    r_bias = g.op("Reshape", g.op("Expand", g.unsq(bias, 2), sel_shape3), flat2)
    r_valid = g.op("Reshape", g.op("Expand", g.unsq(valid, 2), sel_shape3), flat2)
    pos_col, len_col = g.unsq(pos, 1), g.unsq(len_t, 1)
    r_valid = g.op("And", r_valid, g.op("LessOrEqual", r_pos, g.op("Sub", pos_col, window)))
    r_valid = g.op("And", r_valid, g.op("Less", r_pos, len_col))
    r_valid = g.op("And", r_valid, g.op("Or", g.op("Less", prompt_col, g.i(0)), g.op("Less", r_pos, prompt_col)))
    l_pos = g.op("Add", g.op("Add", g.op("Sub", pos_col, window), g.i(1)), g.unsq(g.arange(window), 0))
    kv_pos = g.cat(r_pos, l_pos, axis=1)  # [T, M]
    kv_pos = g.op("Min", g.op("Max", kv_pos, g.i(0)), g.op("Sub", len_col, g.i(1)))
    keep = g.cat(r_valid, g.op("GreaterOrEqual", l_pos, g.i(0)), axis=1)
    additive = g.cat(r_bias, g.op("ConstantOfShape", g.op("Shape", l_pos)), axis=1)
    kv_slot = slots(table_t, kv_pos)
    keys = g.cast(g.op("Gather", key_flat, kv_slot), F32)  # [T, M, Hkv, D]
    values = g.cast(g.op("Gather", value_flat, kv_slot), F32)
    group = g.op("Div", heads, kv_heads)
    qg = g.op("Reshape", g.cast(q_rot, F32), g.cat(t_len, kv_heads, group, head_dim))
    logits = g.op("MatMul", qg, g.op("Transpose", keys, perm=[0, 2, 3, 1]))  # [T, Hkv, G, M]
    logits = g.op("Add", g.op("Mul", logits, inv_sqrt_d), g.unsq(additive, 1, 2))
    # NOTE: float32 softmax; masked keys are -inf, the local window always holds the
    # query itself so no row is empty.
    logits = g.op("Where", g.unsq(keep, 1, 2), logits, neg_inf)
    probs = g.op("Softmax", logits, axis=-1)
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
        attributes=[a.name for a in A.NODE_ATTRIBUTES],
        doc_string="DASH attention over a paged KV cache in standard ONNX ops (see dash_trt.attention.dash.onnx).",
    )


def node_config(node: onnx.NodeProto):
    """``(DashConfig, layer_idx)`` from a ``DashAttention`` node's attributes."""
    if (node.domain, node.op_type) != (DOMAIN, OP_TYPE):
        raise ValueError(f"not a {DOMAIN}.{OP_TYPE} node: {node.domain}.{node.op_type}")
    return A.decode({a.name: helper.get_attribute_value(a) for a in node.attribute})


# ---------------------------------------------------------------- standalone models
def make_node(inputs: list[str], outputs: list[str], attrs: dict, name: str = "dash_attention") -> onnx.NodeProto:
    """A ``dash_trt.DashAttention`` node with the op attributes ``attrs`` (from
    :func:`dash_trt.attention.dash.attributes.encode`), ``plugin_version`` and ``plugin_namespace``."""
    node = helper.make_node(OP_TYPE, inputs, outputs, name=name, domain=DOMAIN)
    for a in A.OP_ATTRIBUTES:
        node.attribute.append(helper.make_attribute(a.name, attrs[a.name], attr_type=_ATTR_TYPE[a.onnx_type]))
    for name, value in A.PLUGIN_FIELDS.items():
        node.attribute.append(helper.make_attribute(name, value, attr_type=AttributeProto.STRING))
    return node


_NP_TO_ONNX = {
    np.dtype(np.float32): TensorProto.FLOAT,
    np.dtype(np.float16): TensorProto.FLOAT16,
    np.dtype(np.int32): TensorProto.INT32,
    np.dtype(np.int64): TensorProto.INT64,
}


def single_node_model(
    attrs: dict,
    dtype: int = TensorProto.FLOAT,
    index_dtype: int = TensorProto.INT32,
    ranks: dict[str, int] | None = None,
) -> onnx.ModelProto:
    """A model holding one ``DashAttention`` node and its function, every dim dynamic
    (for testing the function against the paged operator)."""
    register_schema()
    rank = {
        "q": 3,
        "k": 3,
        "v": 3,
        "iq": 2,
        "ik": 2,
        "coords": 2,
        "head_cls": 1,
        "key_cache": 4,
        "value_cache": 4,
        "index_key_cache": 3,
        "image_page_cache": 2,
        "summary_cache": 3,
        "summary_pages_cache": 3,
        "block_tables": 2,
        "seq_lens": 1,
        "query_start_loc": 1,
        "prompt_lens": 1,
    }
    types = {
        "image_page_cache": TensorProto.INT32,
        "summary_cache": TensorProto.FLOAT,
        "summary_pages_cache": TensorProto.INT32,
    }
    for n in ("coords", "block_tables", "seq_lens", "query_start_loc", "prompt_lens"):
        types[n] = index_dtype

    def vi(name: str, base: str) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, types.get(base, dtype), [f"{base}_{d}" for d in range(rank[base])])

    inputs = [vi(n, n) for n in TENSOR_INPUTS]
    outputs = [vi("out", "q")] + [vi(o, o[: -len("_out")]) for o in OUTPUTS[1:]]
    graph = helper.make_graph([make_node(list(TENSOR_INPUTS), list(OUTPUTS), attrs)], "dash_attention", inputs, outputs)
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(DOMAIN, DOMAIN_VERSION)],
        functions=[dash_attention_function()],
    )
    model.ir_version = 10
    return model


#: What to do when ONNX Runtime is missing: dash-trt depends on neither distribution, so that a
#: GPU machine's onnxruntime-gpu is never overwritten by the CPU package (both write the same
#: ``onnxruntime`` module).
ORT_MISSING = (
    "ONNX Runtime is not installed: pip install 'dash-trt[ort]' (the CPU distribution, onnxruntime) "
    "or 'dash-trt[ort-gpu]' (onnxruntime-gpu), never both"
)


class OnnxRuntimeMissing(ImportError):
    """ONNX Runtime is needed and neither distribution is installed (:data:`ORT_MISSING`)."""


def import_onnxruntime():
    """The ``onnxruntime`` module, or :class:`OnnxRuntimeMissing` with the install line."""
    try:
        import onnxruntime
    except ImportError:
        raise OnnxRuntimeMissing(ORT_MISSING) from None
    return onnxruntime


def ort_session_options():
    """ONNX Runtime options for checking runs: quiet, and threads that sleep when idle
    (by default they spin after each run and slow down everything else in the process)."""
    ort = import_onnxruntime()

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    opts.add_session_config_entry("session.inter_op.allow_spinning", "0")
    return opts


def run_function_ort(model: onnx.ModelProto) -> Callable:
    """An ONNX Runtime session over ``model`` as a function of numpy inputs."""
    ort = import_onnxruntime()

    sess = ort.InferenceSession(model.SerializeToString(), ort_session_options(), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    return lambda *arrays: sess.run(None, dict(zip(names, arrays)))
