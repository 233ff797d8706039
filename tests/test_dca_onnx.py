"""The ONNX node ``dash_trt.DualChunkAttention`` and its standard-ops function: ONNX Runtime
running a one-node model against dash_trt.attention.dca.paged.paged_dual_chunk_attention (output and both
caches), step after step, over random ragged batches, shuffled block tables and NaN-filled caches."""

import random

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto
from test_dca_paged import CONFIGS, Scenario, dca_cfg, random_lengths

from dash_trt.attention.dca import onnx as dca_onnx
from dash_trt.attention.dca import ops as dca_ops
from dash_trt.attention.dca.paged import paged_dual_chunk_attention

FLOATS = {torch.float32: TensorProto.FLOAT, torch.float16: TensorProto.FLOAT16}
INDEX = {torch.int32: TensorProto.INT32, torch.int64: TensorProto.INT64}
# float32: both sides compute in float32 from the same rounded caches (the RoPE tables in double),
# summing in different orders; float16: the float32 results, rounded to half once, may land one
# half ulp apart (4.9e-4 at most in these runs; the key caches came out bitwise equal)
TOLERANCES = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=1e-3, rtol=1e-3)}


def _model(cfg, dtype=torch.float32, index=torch.int32, **kw):
    attrs = dca_onnx.node_attributes(dca_cfg(cfg), rope_theta=cfg["theta"], rotary_dim=cfg["rd"], **kw)
    return dca_onnx.single_node_model(attrs, FLOATS[dtype], INDEX[index]), attrs


class Runner:
    """One scenario run twice: by the paged operator on ``scn.cache`` and by ONNX Runtime on the
    caches its own previous runs returned."""

    def __init__(self, scn, run, index=torch.int32, **kw):
        self.scn, self.run, self.index, self.kw = scn, run, index, kw
        self.key, self.value = scn.cache.key.numpy().copy(), scn.cache.value.numpy().copy()
        self.steps = 0

    def step(self, step, prompt_lens=True):
        scn, cfg = self.scn, self.scn.cfg
        q, k, v, meta = scn.batch(step)
        meta = {n: t.to(self.index) for n, t in meta.items()}
        if not prompt_lens:
            meta["prompt_lens"] = torch.full_like(meta["prompt_lens"], -1)
        feeds = [q, k, v, self.key, self.value, *meta.values()]
        out, key, value = self.run(*[x if isinstance(x, np.ndarray) else x.numpy() for x in feeds])
        want = paged_dual_chunk_attention(
            q, k, v, scn.cache, cfg=dca_cfg(cfg), rope_theta=cfg["theta"], rotary_dim=cfg["rd"], **meta, **self.kw
        )
        tol = TOLERANCES[scn.dtype]
        assert out.dtype == q.numpy().dtype and key.dtype == self.key.dtype
        torch.testing.assert_close(torch.from_numpy(out), want, **tol)
        # the key cache: same rounding of the same float32 rotation; values copied bitwise
        torch.testing.assert_close(torch.from_numpy(key), scn.cache.key, **tol, equal_nan=True)
        assert np.array_equal(value, scn.cache.value.numpy(), equal_nan=True)
        self.key, self.value = key, value
        self.steps += 1
        return out, want


def _random_run(runner):
    """Random subsets of the unfinished sequences in random order: prefill chunks at random split
    points, then one decode token per step (test_dca_paged.run_random's schedule)."""
    rng, decoded, widest = runner.scn.rng, set(), 0
    while True:
        live = [s for s in runner.scn.seqs if s.done < s.total]
        if not live:
            return decoded, widest
        rng.shuffle(live)
        step = []
        for seq in live[: rng.randint(1, len(live))]:
            if seq.done < seq.prompt:
                n = rng.randint(1, seq.prompt - seq.done) if rng.random() < 0.7 else seq.prompt - seq.done
            else:
                n = 1
                decoded.add(seq.done)
            step.append((seq, n))
        widest = max(widest, len(step))
        runner.step(step)


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("index", [torch.int32, torch.int64], ids=str)
def test_ort_runs_the_function_equal_to_the_paged_operator(name, dtype, index):
    cfg = CONFIGS[name]
    c = cfg["C"] - cfg["W"]
    model, _ = _model(cfg, dtype, index)
    onnx.checker.check_model(model, full_check=True)
    run = dca_onnx.run_function_ort(model)
    scn = Scenario(cfg, random_lengths(random.Random(7), c, 4), dtype=dtype, seed=11)
    runner = Runner(scn, run, index)
    decoded, widest = _random_run(runner)
    assert {k * c + d for k in (2, 3) for d in (-1, 0, 1)} <= decoded and widest > 1
    scn.check_cache()


def test_decode_token_by_token_next_to_a_chunked_prefill_and_an_idle_sequence():
    """One sequence decoded through k*c - 1, k*c, k*c + 1 (k = 1, 2, 3) next to another's
    chunked prefill, and a third sequence in the batch with no new tokens."""
    cfg = CONFIGS["c7"]
    c = cfg["C"] - cfg["W"]
    model, _ = _model(cfg)
    scn = Scenario(cfg, [(c - 2, 3 * c + 2), (3 * c + 1, 3 * c + 1), (5, 5)], seed=3)
    dec, pre, idle = scn.seqs
    runner = Runner(scn, dca_onnx.run_function_ort(model))
    runner.step([(idle, 5), (dec, dec.prompt)])
    while dec.done < dec.total:
        step = [(dec, 1), (idle, 0)]
        if pre.done < pre.total:
            step.insert(0, (pre, min(3, pre.total - pre.done)))
        runner.step(step)
    assert runner.steps == 2 * c + 5 and dec.done == 3 * c + 2
    scn.check_cache()


def test_attribute_sentinels_softmax_scale_and_no_prompt_lens():
    """rotary_dim 0 is the head dim; an explicit softmax_scale is used (as a float32 attribute);
    with the scaling off, prompt_lens -1 everywhere."""
    cfg = dict(CONFIGS["c4"], rd=6)  # rotary dim = head dim 6, no scaling
    for kw in (dict(rotary_dim=None), dict(rotary_dim=6, softmax_scale=0.3)):
        attrs = dca_onnx.node_attributes(dca_cfg(cfg), rope_theta=cfg["theta"], **kw)
        assert attrs["rotary_dim"] == (kw["rotary_dim"] or 0)
        run = dca_onnx.run_function_ort(dca_onnx.single_node_model(attrs))
        scn = Scenario(cfg, [(9, 12), (5, 7)], seed=6)
        runner = Runner(scn, run, softmax_scale=kw.get("softmax_scale"))
        a, b = scn.seqs
        runner.step([(a, 9), (b, 5)], prompt_lens=False)
        for _ in range(2):
            runner.step([(b, 1), (a, 1)], prompt_lens=False)
    scaled = dca_onnx.node_attributes(dca_cfg(cfg), rope_theta=cfg["theta"], softmax_scale=0.3)
    plain = dca_onnx.node_attributes(dca_cfg(cfg), rope_theta=cfg["theta"])
    scn = Scenario(cfg, [(9, 9)], seed=6)
    q, k, v, meta = scn.batch([(scn.seqs[0], 9)])
    feeds = [x.numpy() for x in (q, k, v, scn.cache.key, scn.cache.value, *meta.values())]
    one = dca_onnx.run_function_ort(dca_onnx.single_node_model(scaled))(*feeds)[0]
    two = dca_onnx.run_function_ort(dca_onnx.single_node_model(plain))(*feeds)[0]
    assert np.abs(one - two).max() > 1e-3


def test_graphsurgeon_round_trip_runs_identically():
    import onnx_graphsurgeon as gs

    cfg = CONFIGS["c8"]
    model, _ = _model(cfg, index=torch.int64)
    copy = gs.export_onnx(gs.import_onnx(model))
    assert [f.name for f in copy.functions] == [dca_onnx.OP_TYPE]
    node = copy.graph.node[0]
    assert (node.domain, node.op_type) == (dca_onnx.DOMAIN, dca_onnx.OP_TYPE)
    assert dca_onnx.node_config(node) == dca_onnx.node_config(model.graph.node[0])
    onnx.checker.check_model(copy, full_check=True)
    runs = [dca_onnx.run_function_ort(m) for m in (model, copy)]
    scn = Scenario(cfg, [(13, 20), (3, 10)], seed=2)
    a, b = scn.seqs
    key, value = scn.cache.key.numpy(), scn.cache.value.numpy()
    for step in ([(a, 13), (b, 3)], *[[(b, 1), (a, 1)]] * 6, [(b, 1)]):
        q, k, v, meta = scn.batch(step)
        feeds = [x.numpy() for x in (q, k, v)] + [key, value] + [t.long().numpy() for t in meta.values()]
        first, second = (run(*feeds) for run in runs)
        assert all(np.array_equal(x, y, equal_nan=True) for x, y in zip(first, second))
        _, key, value = first


def test_schema_node_and_config_round_trip():
    dca_onnx.register_schema()
    dca_onnx.register_schema()
    schema = onnx.defs.get_schema(dca_onnx.OP_TYPE, dca_onnx.DOMAIN_VERSION, dca_onnx.DOMAIN)
    assert [i.name for i in schema.inputs] == list(dca_ops.TENSOR_INPUTS)
    assert [o.name for o in schema.outputs] == list(dca_ops.OUTPUTS)
    required = {n for n, a in schema.attributes.items() if a.required}
    assert required == set(dca_ops.ATTRIBUTE_NAMES)
    assert set(schema.attributes) - required == {"plugin_version", "plugin_namespace"}
    cfg = CONFIGS["c7"]
    attrs = dca_onnx.node_attributes(dca_cfg(cfg), rope_theta=cfg["theta"], rotary_dim=4, softmax_scale=0.5)
    node = dca_onnx.make_node(list(dca_ops.TENSOR_INPUTS), list(dca_ops.OUTPUTS), attrs)
    assert dca_onnx.node_config(node) == (dca_cfg(cfg), cfg["theta"], 4, 0.5)
    assert {a.name for a in node.attribute} == set(dca_ops.ATTRIBUTE_NAMES)
    plugin = dca_onnx.make_node(["q"], ["out"], attrs, plugin_fields={"plugin_version": "1", "plugin_namespace": ""})
    assert {a.name for a in plugin.attribute} >= {"plugin_version", "plugin_namespace"}
    with pytest.raises(ValueError, match="unknown plugin field"):
        dca_onnx.make_node(["q"], ["out"], attrs, plugin_fields={"plugin_name": "x"})
    other = onnx.helper.make_node("Relu", ["x"], ["y"])
    with pytest.raises(ValueError, match="not a dash_trt.DualChunkAttention node"):
        dca_onnx.node_config(other)
    function = dca_onnx.dual_chunk_attention_function()
    assert {n.domain for n in function.node} == {""}  # standard ops only
    assert {n.op_type for n in function.node} >= {"ScatterND", "Softmax", "MatMul", "Cos", "Sin"}
    for dtype in FLOATS:
        for index in INDEX:
            onnx.checker.check_model(_model(cfg, dtype, index)[0], full_check=True)


def test_an_empty_call_writes_nothing():
    cfg = CONFIGS["c8"]
    model, _ = _model(cfg)
    scn = Scenario(cfg, [(5, 9)], seed=1)
    q, k, v, meta = scn.batch([(scn.seqs[0], 0)])
    meta["seq_lens"][:] = 0
    out, key, value = dca_onnx.run_function_ort(model)(
        *[x.numpy() for x in (q, k, v, scn.cache.key, scn.cache.value, *meta.values())]
    )
    assert out.shape == (0, cfg["H"], cfg["D"])
    assert np.isnan(key).all() and np.isnan(value).all() and key.shape == tuple(scn.cache.key.shape)


def test_the_functional_op_exports_as_one_node_that_onnx_runtime_runs():
    """torch.onnx.export (dynamo) of a module calling the functional op, with translation_table()
    and add_function(): one DualChunkAttention node, dynamic tokens / blocks / sequences; ONNX
    Runtime runs the file on a batch of other sizes equal to the op."""
    from test_dca_ops import _case

    _, args, attrs = _case("c8", fill=None)

    class M(torch.nn.Module):
        def forward(self, *a):
            out, key, value = torch.ops.dash_trt.dual_chunk_attention(*a, **attrs)
            return out * 2.0, key, value

    tokens, blocks = torch.export.Dim("tokens", min=1), torch.export.Dim("blocks", min=1)
    seqs, width = torch.export.Dim("seqs", min=1), torch.export.Dim("width", min=1)
    by_seq = {0: seqs}
    shapes = ({0: tokens},) * 3 + ({0: blocks},) * 2 + ({0: seqs, 1: width}, by_seq, {0: seqs + 1}, by_seq)
    program = torch.onnx.export(
        M(),
        args,
        dynamo=True,
        dynamic_shapes=(shapes,),
        input_names=list(dca_ops.TENSOR_INPUTS),
        output_names=["out2", "key_cache_out", "value_cache_out"],
        opset_version=dca_onnx.OPSET,
        custom_translation_table=dca_onnx.translation_table(),
        optimize=True,
        verbose=False,
    )
    dca_onnx.add_function(program)
    model = program.model_proto
    onnx.checker.check_model(model, full_check=True)
    nodes = [(n.domain, n.op_type) for n in model.graph.node]
    assert nodes.count((dca_onnx.DOMAIN, dca_onnx.OP_TYPE)) == 1 and len(nodes) == 2
    node = next(n for n in model.graph.node if n.op_type == dca_onnx.OP_TYPE)
    assert dca_onnx.node_config(node) == dca_ops.decode(attrs)
    run = dca_onnx.run_function_ort(model)
    # another batch: three sequences, other token / block / table sizes than the traced one
    scn = Scenario(CONFIGS["c8"], [(11, 30), (4, 9), (20, 21)], seed=13)
    a, b, c = scn.seqs
    key, value = scn.cache.key.numpy(), scn.cache.value.numpy()
    for step in ([(b, 4), (a, 7), (c, 20)], [(a, 4), (b, 1), (c, 1)], *[[(b, 1), (a, 1)]] * 4):
        q, k, v, meta = scn.batch(step)
        got = run(*[x.numpy() for x in (q, k, v)], key, value, *[t.numpy() for t in meta.values()])
        want = M()(q, k, v, torch.from_numpy(key), torch.from_numpy(value), *meta.values())
        torch.testing.assert_close(torch.from_numpy(got[0]), want[0], **TOLERANCES[torch.float32])
        assert np.array_equal(got[1], want[1].numpy(), equal_nan=True)
        assert np.array_equal(got[2], want[2].numpy(), equal_nan=True)
        _, key, value = got
