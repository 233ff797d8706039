"""The torch custom ops ``dash_trt::dual_chunk_attention`` (functional) and
``dash_trt::dual_chunk_attention_`` (in place) against dash_trt.attention.dca.paged.paged_dual_chunk_attention."""

import operator

import pytest
import torch
from test_dca_paged import CONFIGS, Scenario, dca_cfg, same

from dash_trt.attention.dca import ops as dca_ops
from dash_trt.attention.dca.paged import DcaKVCache, paged_dual_chunk_attention
from dash_trt.attention.dca.reference import DcaConfig, DcaConfigError


def _case(name, dtype=torch.float32, seed=0, fill=float("nan")):
    """A step under test: sequence 0's last prefill chunk next to sequence 1's decode token at a
    chunk boundary (position 2c), over a cache already holding both sequences' earlier tokens.
    Returns (scenario, op tensors, op scalars)."""
    cfg = CONFIGS[name]
    c = cfg["C"] - cfg["W"]
    scn = Scenario(cfg, [(2 * c + 3, 2 * c + 3), (c - 1, 2 * c + 4)], dtype=dtype, seed=seed)
    if fill is None:
        gen = torch.Generator().manual_seed(seed)
        scn.cache.key.copy_(torch.randn(scn.cache.key.shape, generator=gen))
        scn.cache.value.copy_(torch.randn(scn.cache.value.shape, generator=gen))
    a, b = scn.seqs
    scn.call([(a, c + 1), (b, b.prompt)])
    while b.done < 2 * c:
        scn.call([(b, 1)])
    q, k, v, meta = scn.batch([(b, 1), (a, a.prompt - a.done)])
    args = (q, k, v, scn.cache.key, scn.cache.value, *meta.values())
    attrs = dca_ops.encode(dca_cfg(cfg), rope_theta=cfg["theta"], rotary_dim=cfg["rd"])
    return scn, args, attrs


def _paged(scn, args, cache):
    cfg = scn.cfg
    q, k, v, _, _, tables, lens, qsl, prompts = args
    return paged_dual_chunk_attention(
        q,
        k,
        v,
        cache,
        tables,
        lens,
        qsl,
        dca_cfg(cfg),
        rope_theta=cfg["theta"],
        rotary_dim=cfg["rd"],
        prompt_lens=prompts,
    )


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_opcheck_functional(name, dtype):
    _, args, attrs = _case(name, dtype, fill=None)
    result = torch.library.opcheck(dca_ops.dual_chunk_attention_op(), args, attrs)
    assert set(result.values()) == {"SUCCESS"}, result


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_opcheck_inplace(name, dtype):
    _, args, attrs = _case(name, dtype, fill=None)
    result = torch.library.opcheck(dca_ops.dual_chunk_attention_inplace_op(), args, attrs)
    assert set(result.values()) == {"SUCCESS"}, result


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_functional_op_equals_paged_operator_and_leaves_its_inputs_alone(name, dtype):
    scn, args, _ = _case(name, dtype)
    cfg = scn.cfg
    before = [t.clone() for t in args]
    out, (key, value) = dca_ops.dual_chunk_attention_functional(
        *args[:3],
        scn.cache,
        *args[5:8],
        dca_cfg(cfg),
        rope_theta=cfg["theta"],
        rotary_dim=cfg["rd"],
        prompt_lens=args[8],
    )
    for got, was in zip(args, before):
        assert same(got, was) if got.is_floating_point() else torch.equal(got, was)
    ref = scn.cache.clone()
    want = _paged(scn, args, ref)
    assert torch.equal(out, want)
    assert same(key, ref.key) and same(value, ref.value)
    assert not same(key, scn.cache.key) and not same(value, scn.cache.value)
    assert key.data_ptr() != scn.cache.key.data_ptr() and value.data_ptr() != scn.cache.value.data_ptr()


@pytest.mark.parametrize("name", CONFIGS)
def test_inplace_op_writes_the_caches_where_they_are(name):
    scn, args, attrs = _case(name)
    cfg = scn.cfg
    ref = scn.cache.clone()
    want = _paged(scn, args, ref)
    ptrs = scn.cache.key.data_ptr(), scn.cache.value.data_ptr()
    out = dca_ops.dual_chunk_attention_inplace(
        *args[:3],
        scn.cache,
        *args[5:8],
        dca_cfg(cfg),
        rope_theta=cfg["theta"],
        rotary_dim=cfg["rd"],
        prompt_lens=args[8],
    )
    assert torch.equal(out, want)
    assert (scn.cache.key.data_ptr(), scn.cache.value.data_ptr()) == ptrs
    assert same(scn.cache.key, ref.key) and same(scn.cache.value, ref.value)
    # the raw op on the (key, value) pair: one more decode step, against the functional op
    _, args2, attrs2 = _case(name, seed=1)
    fun_out, *fun_cache = dca_ops.dual_chunk_attention_op()(*args2, **attrs2)
    got = dca_ops.dual_chunk_attention_inplace_op()(*args2, **attrs2)
    assert torch.equal(got, fun_out)
    assert same(args2[3], fun_cache[0]) and same(args2[4], fun_cache[1])


def test_sentinels_and_defaults():
    """rotary_dim 0 is the head dim, softmax_scale 0.0 is D ** -0.5, prompt_lens None is -1 (scaling off)."""
    cfg = CONFIGS["c4"]  # D = rotary dim = 6, no scaling
    scn, args, attrs = _case("c4")
    assert attrs["rotary_dim"] == 6 and attrs["softmax_scale"] == 0.0
    want = dca_ops.dual_chunk_attention_op()(*args, **attrs)
    explicit = dict(attrs, rotary_dim=0, softmax_scale=6**-0.5)
    for got, w in zip(dca_ops.dual_chunk_attention_op()(*args, **explicit), want):
        assert same(got, w)
    out, cache = dca_ops.dual_chunk_attention_functional(*args[:3], (args[3], args[4]), *args[5:8], dca_cfg(cfg))
    ref = scn.cache.clone()
    q, k, v, _, _, tables, lens, qsl, _ = args
    assert torch.equal(out, paged_dual_chunk_attention(q, k, v, ref, tables, lens, qsl, dca_cfg(cfg)))
    assert same(cache[0], ref.key)
    doubled = dca_ops.dual_chunk_attention_op()(*args, **dict(attrs, softmax_scale=2 * 6**-0.5))[0]
    assert not torch.allclose(doubled, want[0], atol=1e-3)


def test_encode_decode_and_idempotent_registration():
    cfg = DcaConfig(12, 4, 5)
    attrs = dca_ops.encode(cfg, rope_theta=1e6, rotary_dim=4, softmax_scale=0.25)
    assert tuple(attrs) == dca_ops.ATTRIBUTE_NAMES
    assert dca_ops.decode(attrs) == (cfg, 1e6, 4, 0.25)
    assert dca_ops.decode(dca_ops.encode(cfg)) == (cfg, 10000.0, None, None)
    with pytest.raises(ValueError, match="missing Dual Chunk Attention attribute"):
        dca_ops.decode({"chunk_size": 4})
    with pytest.raises(DcaConfigError, match="local_size"):
        dca_ops.decode(dict(attrs, local_size=12))
    with pytest.raises(TypeError, match="DcaConfig"):
        dca_ops.encode({"chunk_size": 12})
    op = dca_ops.dual_chunk_attention_op()
    dca_ops.register()
    dca_ops.register()
    assert dca_ops.dual_chunk_attention_op() is op
    schema = str(dca_ops.dual_chunk_attention_inplace_op()._schema)
    assert "Tensor(a!) key_cache" in schema and "Tensor(b!) value_cache" in schema
    _, args, attrs = _case("c8")
    assert len(dca_ops.dual_chunk_attention_op()(*args, **attrs)) == len(dca_ops.OUTPUTS)


def test_bad_inputs_are_refused_through_both_ops_and_the_cache_is_untouched():
    scn, args, attrs = _case("c8")
    before = scn.cache.clone()
    for op in (dca_ops.dual_chunk_attention_op(), dca_ops.dual_chunk_attention_inplace_op()):
        with pytest.raises(DcaConfigError, match="must be a multiple of the KV block size"):
            op(*args, **dict(attrs, local_size=5))  # c = 7, blocks of 4
        with pytest.raises(DcaConfigError, match="rotary_dim must be an even int"):
            op(*args, **dict(attrs, rotary_dim=3))
        with pytest.raises(DcaConfigError, match="every sequence needs its prompt length"):
            op(*args[:8], torch.full_like(args[8], -1), **attrs)
    assert same(scn.cache.key, before.key) and same(scn.cache.value, before.value)
    with pytest.raises(ValueError, match="caches must be"):
        dca_ops._functional_fake(*args[:4], args[4][0], **attrs)


def test_functional_op_under_torch_export_is_one_node_with_dynamic_sizes():
    scn, args, attrs = _case("c8", fill=None)

    class M(torch.nn.Module):
        def forward(self, *a):
            return torch.ops.dash_trt.dual_chunk_attention(*a, **attrs)

    tokens = torch.export.Dim("tokens", min=1)
    blocks = torch.export.Dim("blocks", min=1)
    shapes = ({0: tokens}, {0: tokens}, {0: tokens}, {0: blocks}, {0: blocks}, None, None, None, None)
    ep = torch.export.export(M(), args, dynamic_shapes=(shapes,))
    calls = [n for n in ep.graph.nodes if n.op == "call_function" and n.target is not operator.getitem]
    assert [str(n.target) for n in calls] == ["dash_trt.dual_chunk_attention.default"]
    assert calls[0].kwargs["chunk_size"] == 12
    vals = calls[0].meta["val"]
    assert isinstance(vals[0].shape[0], torch.SymInt) and isinstance(vals[1].shape[0], torch.SymInt)
    got = ep.module()(*args)
    want = M()(*args)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_cache_allocated_by_dca_kv_cache_runs_through_the_op():
    """A zeroed DcaKVCache from allocate(), a one-shot prefill of one sequence: out and caches as the paged call."""
    cfg = CONFIGS["c7"]
    scn = Scenario(cfg, [(9, 9)], seed=4)
    q, k, v, meta = scn.batch([(scn.seqs[0], 9)])
    cache = DcaKVCache.allocate(scn.cache.num_blocks, cfg["bsz"], cfg["Hkv"], cfg["D"])
    kw = dict(rope_theta=cfg["theta"], rotary_dim=cfg["rd"])
    out, (key, value) = dca_ops.dual_chunk_attention_functional(q, k, v, cache, cfg=dca_cfg(cfg), **kw, **meta)
    assert not cache.key.any()
    want = paged_dual_chunk_attention(q, k, v, cache, cfg=dca_cfg(cfg), **kw, **meta)
    assert torch.equal(out, want) and torch.equal(key, cache.key) and torch.equal(value, cache.value)
