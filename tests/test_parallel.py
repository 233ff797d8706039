"""Tensor parallelism (dash_trt.parallel): the sharding arithmetic, and a TP=2 model on two CPU
processes (gloo) generating the same tokens as the unsharded model."""

import os

import pytest
import torch
import torch.multiprocessing as mp

from dash_trt import model as M
from dash_trt import parallel as TP


def test_shards_split_heads_kv_heads_and_the_mlp_in_contiguous_groups():
    cfg = M.DashModelConfig.from_dict(
        {**M.DEMO_CONFIG, "num_attention_heads": 8, "num_key_value_heads": 4, "intermediate_size": 256}
    )
    s = [TP.shard_sizes(cfg, r, 4) for r in range(4)]
    assert [(x.heads, x.kv_heads, x.intermediate) for x in s] == [(2, 1, 64)] * 4
    assert [(x.head0, x.kv_head0, x.inter0) for x in s] == [(0, 0, 0), (2, 1, 64), (4, 2, 128), (6, 3, 192)]
    # GQA: a rank's query heads read exactly its KV heads (head h reads KV head h // G)
    g = cfg.num_attention_heads // cfg.num_key_value_heads
    for x in s:
        assert {h // g for h in range(x.head0, x.head0 + x.heads)} == set(range(x.kv_head0, x.kv_head0 + x.kv_heads))
    with pytest.raises(TP.TensorParallelError, match="num_key_value_heads \\(4\\) is not divisible by .* 8"):
        TP.shard_sizes(cfg, 0, 8)
    with pytest.raises(TP.TensorParallelError, match="not in a world"):
        TP.shard_sizes(cfg, 2, 2)


def test_a_shard_holds_its_slices_and_reassembles_the_model():
    model = M.demo_model(seed=3)
    shards = [TP.shard_model(model, r, 2) for r in range(2)]
    full = model.state_dict()
    for name in ("layers.1.self_attn.q_proj.weight", "layers.1.self_attn.k_proj.weight", "layers.1.mlp.up_proj.weight"):
        assert torch.equal(torch.cat([s.state_dict()[name] for s in shards], 0), full[name])
    for name in ("layers.1.self_attn.o_proj.weight", "layers.1.mlp.down_proj.weight"):
        assert torch.equal(torch.cat([s.state_dict()[name] for s in shards], 1), full[name])
    for name in (
        "embed_tokens.weight",
        "lm_head.weight",
        "layers.1.self_attn.dash_router.q_proj.weight",
        "layers.1.self_attn.dash_router.k_norm.weight",
        "layers.1.self_attn.dash_router.head_cls",
        "norm.weight",
    ):
        assert all(torch.equal(s.state_dict()[name], full[name]) for s in shards)  # replicated
    assert shards[0].config.num_attention_heads == 2 and shards[0].config.num_key_value_heads == 1
    assert shards[0].allocate_cache(4, 16)[0].key.shape[2] == 1  # a cache of its own KV heads only
    assert TP.shard_model(model, 0, 1) is model
    tied = TP.shard_model(M.random_model({**M.DEMO_CONFIG, "tie_word_embeddings": True}), 1, 2)
    assert tied.lm_head.weight is tied.embed_tokens.weight  # the tie survives the split


def _model(kind: str):
    if kind == "demo":
        return M.demo_model(seed=0)
    from dash_trt.models.unlimited_ocr2 import tiny_config

    return M.random_model(tiny_config(), seed=0)


def _rank(rank: int, world: int, init_file: str, out: str, kind: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = _model(kind)
        prompts, feats = M.check_prompts(model, seed=1)
        shard = TP.shard_model(model, rank, world)
        gen = M.generate(shard, prompts, 6, prefill_chunk=40, cuda_graphs=False, image_features=feats)
        torch.save({"tokens": gen.tokens, "logits": gen.logits}, f"{out}.{rank}")
        # Both ranks past their last collective before either leaves.
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    # Leave without tearing gloo down: its teardown aborted a peer now and then even after the
    # barrier ("terminate called without an active exception", SIGABRT, in CI). The results are
    # on disk; ending the process here runs no destructor that could.
    os._exit(0)


def test_unlimited_ocr2_shards_split_every_expert_and_replicate_the_router():
    from dash_trt.models.unlimited_ocr2 import tiny_config

    model = M.random_model(tiny_config(), seed=2)
    shards = [TP.shard_model(model, r, 2) for r in range(2)]
    full = model.state_dict()
    rows = ("layers.1.mlp.experts.5.up_proj.weight", "layers.1.mlp.shared_experts.gate_proj.weight",
            "layers.0.mlp.gate_proj.weight", "layers.1.self_attn.v_proj.weight")  # fmt: skip
    for name in rows:
        assert torch.equal(
            torch.cat(
                [s.state_dict()[name.replace("mlp.", "mlp.module.", name.startswith("layers.1.mlp"))] for s in shards],
                0,
            ),
            full[name],
        ), name
    cols = ("layers.1.mlp.experts.5.down_proj.weight", "layers.1.mlp.shared_experts.down_proj.weight")
    for name in cols:
        local = name.replace("mlp.", "mlp.module.")
        assert torch.equal(torch.cat([s.state_dict()[local] for s in shards], 1), full[name]), name
    for s in shards:
        assert torch.equal(s.state_dict()["layers.1.mlp.module.gate.weight"], full["layers.1.mlp.gate.weight"])
        assert s.moe_config.moe_intermediate_size == 32 and s.config.intermediate_size == 128
        assert isinstance(s.layers[1].mlp, TP.AllReduced)
    odd = M.random_model(tiny_config(overrides={"moe_intermediate_size": 66}))
    with pytest.raises(TP.TensorParallelError, match=r"moe_intermediate_size \(66\) is not divisible by .* 4"):
        TP.shard_model(odd, 0, 4)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["demo", "unlimited_ocr2"])
def test_tp2_on_two_cpu_processes_generates_the_unsharded_tokens(tmp_path, kind):
    model = _model(kind)
    prompts, feats = M.check_prompts(model, seed=1)
    want = M.generate(model, prompts, 6, prefill_chunk=40, cuda_graphs=False, image_features=feats)
    out = str(tmp_path / "gen")
    env = {k: os.environ.get(k) for k in TP.NVLS_OFF}
    mp.start_processes(_rank, args=(2, str(tmp_path / "init"), out, kind), nprocs=2, join=True, start_method="spawn")
    assert {k: os.environ.get(k) for k in TP.NVLS_OFF} == env
    got = [torch.load(f"{out}.{r}") for r in range(2)]
    assert got[0]["tokens"] == got[1]["tokens"], "the ranks disagree"
    assert got[0]["tokens"] == want.tokens
    for a, b in zip(got[0]["logits"], want.logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)  # float32: only the all-reduce's order differs


def test_launch_errors_are_clear(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    for key in TP.NVLS_OFF:  # init_from_env sets them; restored after the test
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(TP.TensorParallelError, match="launch with torchrun"):
        TP.init_from_env()
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "examples" / "custom_decoder.py"
    spec = importlib.util.spec_from_file_location("custom_decoder_for_tp", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    cfg = M.DashModelConfig.from_dict({**M.DEMO_CONFIG, "architectures": ["TinyOCRDecoder"]})
    custom = M.random_model(cfg, model_class=mod.TinyOCRDecoder)
    with pytest.raises(TP.TensorParallelError, match="splits the built-in .*, not TinyOCRDecoder"):
        TP.shard_model(custom, 0, 2)
