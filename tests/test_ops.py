"""The torch custom op ``dash_trt::paged_attention`` and the attribute table."""

import dataclasses

import pytest
import torch

from dash_trt.attention.dash import attributes as A
from dash_trt.attention.dash import ops
from dash_trt.attention.dash.config import DashConfig, DashConfigError
from dash_trt.attention.dash.paged import DashKVCache, paged_dash_attention, sequence_coords
from dash_trt.serving.block_pool import KVBlockPool
from dash_trt.testing import TOLERANCES, random_config, random_inputs, random_roles

HEADS, KV_HEADS, D, DI = 4, 2, 16, 16
SEEDS = [0, 1, 2]


def _batch(seed, dtype=torch.float32, block_size=8, sbs=4, layer=0):
    """Two sequences: one prefilled in two chunks, one decoding, in a shared cache
    already holding earlier tokens. Returns (op args without attrs, cfg, cache)."""
    gen = torch.Generator().manual_seed(seed)
    cfg = random_config(gen, sparse_block_size=sbs)
    head_cls = torch.randn(DI, generator=gen).to(dtype)
    seqs = []
    for pages, response in ((3, 0), (2, 4)):
        roles = random_roles(gen, pages, response=response, max_images=10)
        seqs.append(
            (
                random_inputs(
                    gen, roles, heads=HEADS, kv_heads=KV_HEADS, head_dim=D, index_dim=DI, dtype=dtype, head_cls=head_cls
                ),
                sequence_coords(roles),
                response,
            )
        )
    num_blocks = sum(-(-x.length // block_size) for x, _, _ in seqs) + 2
    pool = KVBlockPool(num_blocks, block_size)
    cache = DashKVCache.allocate(num_blocks, block_size, KV_HEADS, D, DI, sbs, dtype=dtype)
    for i, (x, _, response) in enumerate(seqs):
        pool.add(i, prompt_length=x.length - response)
    # step 1 (in place, to fill the cache): the first 60% of seq 0, all but one token of seq 1
    n0, n1 = int(seqs[0][0].length * 0.6), seqs[1][0].length - 1
    first = pool.schedule([(0, n0), (1, n1)])

    def rows(spec):
        return [torch.cat([getattr(seqs[i][0], f)[a:b] for i, a, b in spec]) for f in ("q", "k", "v", "iq", "ik")] + [
            torch.cat([seqs[i][1][a:b] for i, a, b in spec])
        ]

    paged_dash_attention(*rows([(0, 0, n0), (1, 0, n1)]), head_cls, cache, **first.kwargs(), sp=cfg, layer_idx=layer)
    # step 2 (the one under test): the rest of seq 0 (prefill chunk) + one decode token of seq 1
    second = pool.schedule([(1, 1), (0, seqs[0][0].length - n0)])
    q, k, v, iq, ik, coords = rows([(1, n1, n1 + 1), (0, n0, seqs[0][0].length)])
    tensors = (
        q,
        k,
        v,
        iq,
        ik,
        coords,
        head_cls,
        *(getattr(cache, f) for f in ops.CACHE_FIELDS),
        *second.kwargs().values(),
    )
    return tensors, cfg, cache


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_opcheck(seed, dtype):
    args, cfg, _ = _batch(seed, dtype)
    result = torch.library.opcheck(ops.paged_attention_op(), args, A.encode(cfg, seed % 2))
    assert set(result.values()) == {"SUCCESS"}, result


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("layer", [0, 1])
def test_op_equals_paged_operator_and_leaves_inputs_alone(seed, layer):
    args, cfg, cache = _batch(seed, layer=layer)
    before = [t.clone() for t in args]
    out, new_cache = ops.paged_attention(*args[:7], cache, *args[13:], cfg, layer)
    # the op is functional: nothing it was given changed
    for a, b in zip(args, before):
        assert torch.equal(a, b)
    ref_cache = cache.clone()
    want = paged_dash_attention(*args[:7], ref_cache, *args[13:], sp=cfg, layer_idx=layer)
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    changed = 0
    for name, got in zip(ops.CACHE_FIELDS, new_cache):
        assert torch.equal(got, getattr(ref_cache, name)), name
        changed += not torch.equal(got, getattr(cache, name))
    assert changed == len(ops.CACHE_FIELDS), "every cache tensor is written by this step"


def test_op_under_torch_export_is_one_node_with_dynamic_tokens():
    args, cfg, _ = _batch(0)

    class M(torch.nn.Module):
        def forward(self, *a):
            return torch.ops.dash_trt.paged_attention(*a, **A.encode(cfg, 1))

    tokens = torch.export.Dim("tokens", min=1)
    blocks = torch.export.Dim("blocks", min=1)
    shapes = tuple([{0: tokens}] * 6 + [None] + [{0: blocks}] * 6 + [None] * 4)
    ep = torch.export.export(M(), args, dynamic_shapes=(shapes,))
    import operator

    calls = [n for n in ep.graph.nodes if n.op == "call_function" and n.target is not operator.getitem]
    assert [str(n.target) for n in calls] == ["dash_trt.paged_attention.default"]
    assert calls[0].kwargs["layer_idx"] == 1
    # the fake implementation keeps the sizes symbolic: out [T, H, D], caches [NB, ...]
    vals = calls[0].meta["val"]
    assert isinstance(vals[0].shape[0], torch.SymInt) and vals[0].shape[1:] == args[0].shape[1:]
    assert all(isinstance(v.shape[0], torch.SymInt) for v in vals[1:])


def test_op_under_torch_compile():
    """fullgraph with aot_eager: the fake implementation carries the op through
    Dynamo and AOT functionalization; results equal eager."""
    args, cfg, _ = _batch(1)

    def f(*a):
        out = torch.ops.dash_trt.paged_attention(*a, **A.encode(cfg, 0))
        return out[0] * 2, out[5]

    torch._dynamo.reset()
    try:
        got = torch.compile(f, fullgraph=True, backend="aot_eager", dynamic=True)(*args)
    finally:
        torch._dynamo.reset()
    want = f(*args)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_attribute_table_is_generated_from_config():
    names = [a.name for a in A.CONFIG_ATTRIBUTES]
    assert names == [f.name for f in dataclasses.fields(DashConfig) if f.metadata["attribute"]]
    assert [a.name for a in A.OP_ATTRIBUTES] == names + ["layer_idx"]
    assert [a.name for a in A.NODE_ATTRIBUTES[-2:]] == list(A.PLUGIN_FIELDS) == ["plugin_version", "plugin_namespace"]
    # scalars only: no list attribute (onnx-graphsurgeon cannot type an empty one)
    assert {a.onnx_type for a in A.NODE_ATTRIBUTES} == {"INT", "FLOAT", "STRING"}
    # the per-layer lists, the layer map and the fixed flags are resolved or implied, not carried
    assert not {"dash_scale_per_layer", "dash_floor_per_layer", "sparse_attention_freq", "training_stage"} & set(names)
    by_name = {a.name: a for a in A.OP_ATTRIBUTES}
    assert by_name["dash_topk_blocks"].onnx_type == "INT" and by_name["dash_topk_blocks"].default == 12
    assert by_name["dash_scaling_factor"].onnx_type == "FLOAT" and by_name["dash_scaling_factor"].default == 128.0
    assert by_name["sparse_index_dim"].required
    assert by_name["sparse_block_size"].required and by_name["layer_idx"].required
    assert by_name["sparse_main_rope_tok_freq_mode"].default == ""
    assert by_name["image_token_id"].default == -1
    # the op schema is built from the same table
    schema = str(ops.paged_attention_op()._schema)
    for a in A.OP_ATTRIBUTES:
        assert f"{a.torch_type} {a.name}" in schema


@pytest.mark.parametrize("seed", range(6))
def test_attributes_round_trip(seed):
    gen = torch.Generator().manual_seed(seed)
    extra = [
        {},
        {"sparse_attention_freq": [0, 1, 1], "dash_scale_per_layer": [3.0, 9.0], "dash_floor_per_layer": [0.5, 0.01]},
        {"image_token_id": 7, "page_token_id": 9},
    ][seed % 3]
    cfg = random_config(gen, **extra)
    layer = 2 if "sparse_attention_freq" in extra else 1
    attrs = A.encode(cfg, layer)
    assert all(isinstance(v, (int, float, str)) for v in attrs.values())
    back, got_layer = A.decode(attrs)
    assert got_layer == layer
    assert back == cfg.for_layer(layer) and back.routing(layer) == cfg.routing(layer)
    if extra.get("dash_scale_per_layer"):
        assert (attrs["dash_scaling_factor"], attrs["dash_prior_floor"]) == (9.0, 0.01)  # slot 1's entries


def test_attribute_errors():
    cfg = random_config(torch.Generator().manual_seed(0))
    attrs = A.encode(cfg, 0)
    with pytest.raises(ValueError, match="layer_idx"):
        A.encode(cfg, -1)
    with pytest.raises(DashConfigError, match="layer 0 is not a DASH layer"):
        A.encode(
            DashConfig.from_dict(
                {
                    **cfg.to_dict(),
                    "sparse_attention_freq": [0, 1],
                    "dash_scale_per_layer": None,
                    "dash_floor_per_layer": None,
                }
            ),
            0,
        )
    with pytest.raises(ValueError, match="sparse_block_size"):
        A.decode({k: v for k, v in attrs.items() if k != "sparse_block_size"})
    with pytest.raises(DashConfigError, match="sparse_local_block"):
        A.decode({**attrs, "sparse_local_block": 0})
    with pytest.raises(DashConfigError, match="sparse_rope_tok_freq_mode"):
        A.decode({**attrs, "sparse_rope_tok_freq_mode": "linear"})


def test_cuda_hook_registration():
    saved = ops.cuda_impls()  # the kernels, where they are built: put back for the next tests
    with pytest.raises(TypeError, match="expects callables or None, got int"):
        ops.register_cuda_impl(42)
    calls = []
    ops.register_cuda_impl(lambda *a: calls.append(a), lambda *a: calls.append(a))
    try:
        # CPU tensors never go to the CUDA implementations
        args, cfg, cache = _batch(0)
        out, _ = ops.paged_attention(*args[:7], cache, *args[13:], cfg, 0)
        assert out.shape == args[0].shape and not calls
        ops.register_cuda_impl(None)
        assert ops.cuda_impls() == (None, None)
    finally:
        ops.register_cuda_impl(*saved)


@pytest.mark.gpu
def test_op_on_cuda_uses_the_registered_kernel_and_falls_back_without_one():
    args, cfg, cache = _batch(0)
    cuda_args = [t.cuda() for t in args]
    out, _ = ops.paged_attention(*cuda_args[:7], cuda_args[7:13], *cuda_args[13:], cfg, 0)
    want = paged_dash_attention(*args[:7], cache.clone(), *args[13:], sp=cfg, layer_idx=0)
    atol, rtol = TOLERANCES[torch.float32]
    torch.testing.assert_close(out.cpu(), want, atol=atol, rtol=rtol)
    seen = []

    def fake_kernel(call):
        seen.append(call.layer_idx)
        return (torch.zeros_like(call.q), *(t.clone() for t in call.cache.tensors().values()))

    saved = ops.cuda_impls()
    ops.register_cuda_impl(fake_kernel)
    try:
        out, _ = ops.paged_attention(*cuda_args[:7], cuda_args[7:13], *cuda_args[13:], cfg, 0)
    finally:
        ops.register_cuda_impl(*saved)
    assert seen == [0] and not bool(out.any())


def test_one_name_per_tensor_from_the_op_to_the_plugin_and_the_params():
    """The TensorRT plugin's I/O table (plugins/trt/dash_plugin.cpp, in order) holds the op's
    tensor names, and DashParams (params.h) names each cache <field>_cache, as the op does."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    plugin = (root / "plugins" / "trt" / "dash_plugin.cpp").read_text()
    table = re.findall(r'\{"(\w+)", \d, IoType::', plugin)
    assert table == list(ops.TENSOR_INPUTS)
    outputs = re.search(r"kOutputNames\[kNbOutputs\] = \{([^}]*)\}", plugin).group(1)
    assert re.findall(r'"(\w+)"', outputs) == list(ops.OUTPUTS)
    params = (root / "plugins" / "include" / "dash" / "params.def").read_text()
    for f in ops.CACHE_FIELDS:
        assert re.search(rf"DASH_PARAM\([^,]+, {f}_cache, CACHE,", params), f"DashParams has no field {f}_cache"


def test_cuda_tensors_without_the_kernel_library_warn_once_and_loudly(monkeypatch):
    import warnings

    from dash_trt.attention.dash import cuda

    saved = ops.cuda_impls()
    monkeypatch.setattr(ops, "_kernels_missing", None)
    monkeypatch.setattr(ops, "_warned_missing", False)
    monkeypatch.setattr(cuda, "library_path", lambda: None)
    try:
        ops._register_kernels_if_built()  # an installation without the library
    finally:
        ops.register_cuda_impl(*saved)
    assert "DASH CUDA kernels not found" in ops._kernels_missing and "dash-trt info" in ops._kernels_missing
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        ops._warn_cuda_without_kernels()
        ops._warn_cuda_without_kernels()
    assert [w.category for w in got] == [RuntimeWarning]
    assert "many times slower" in str(got[0].message)
    # registered kernels, or the fallback chosen on purpose (register_cuda_impl(None)): no warning
    monkeypatch.setattr(ops, "_kernels_missing", None)
    monkeypatch.setattr(ops, "_warned_missing", False)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        ops._warn_cuda_without_kernels()
    assert got == []
