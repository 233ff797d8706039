"""Unlimited-OCR-2's decoder (dash_trt.models.unlimited_ocr2): the DeepSeek-V2 expert routing on
hand-derived cases, the MoE layer against an independent float64 formulation, the published
folder layout (nested config, shards, checkpoint names) with its errors, and the tools with no
--model: dash-export (ONNX Runtime = PyTorch), dash-compare and the Triton service."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from conftest import running_triton, write_tiny_unlimited_ocr2

from dash_trt import model as M
from dash_trt.models import unlimited_ocr2 as U
from dash_trt.models.checkpoint import CheckpointError, load_checkpoint, save_pretrained
from dash_trt.models.config import DashModelConfig, ModelConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def moe_config(**change) -> U.MoEConfig:
    base = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)
    return U.MoEConfig(**{**base, **change})


# ------------------------------------------------------------------------------ routing
def test_softmax_greedy_top_k_by_hand():
    # softmax of log(1, 2, 3, 1) is (1, 2, 3, 1) / 7: experts 2 then 1
    logits = torch.log(torch.tensor([[1.0, 2.0, 3.0, 1.0]]))
    w, ids = U.route_experts(logits, moe_config())
    assert ids.tolist() == [[2, 1]]
    assert torch.allclose(w, torch.tensor([[3 / 7, 2 / 7]]))
    w, _ = U.route_experts(logits, moe_config(norm_topk_prob=True))
    assert torch.allclose(w, torch.tensor([[0.6, 0.4]]))
    w, _ = U.route_experts(logits, moe_config(norm_topk_prob=True, routed_scaling_factor=2.5))
    assert torch.allclose(w, torch.tensor([[1.5, 1.0]]))
    w, _ = U.route_experts(logits, moe_config(routed_scaling_factor=2.0))
    assert torch.allclose(w, torch.tensor([[6 / 7, 4 / 7]]))


def test_sigmoid_scores_and_ties_by_hand():
    logits = torch.tensor([[0.0, 2.0, 0.0, 2.0]])
    w, ids = U.route_experts(logits, moe_config(scoring_func="sigmoid"))
    assert ids.tolist() == [[1, 3]]  # a tie goes to the lower index first
    s = 1 / (1 + math.exp(-2.0))
    assert torch.allclose(w, torch.tensor([[s, s]]))
    w, ids = U.route_experts(torch.zeros(1, 4), moe_config())
    assert ids.tolist() == [[0, 1]] and torch.allclose(w, torch.full((1, 2), 0.25))


def test_group_limited_greedy_keeps_the_best_groups():
    # groups {0, 1} and {2, 3}; the best single expert (0) is in group 0, the next two in group 1
    logits = torch.log(torch.tensor([[5.0, 0.5, 4.0, 4.0]]))
    greedy = U.route_experts(logits, moe_config())[1]
    assert greedy.tolist() == [[0, 2]]
    limited = moe_config(topk_method="group_limited_greedy", n_group=2, topk_group=1)
    w, ids = U.route_experts(logits, limited)
    assert ids.tolist() == [[0, 1]]  # only group 0 (best score 5) is kept
    assert torch.allclose(w, torch.tensor([[5 / 13.5, 0.5 / 13.5]]))
    w, ids = U.route_experts(torch.log(torch.tensor([[1.0, 0.5, 4.0, 3.0]])), limited)
    assert ids.tolist() == [[2, 3]]


def _moe_float64(moe: U.MoE, x: torch.Tensor) -> torch.Tensor:
    """The MoE output token by token in float64, written from the definition: scores, the k best
    by sorting, their weights, each chosen expert's SiLU-gated MLP, the shared experts."""
    cfg = moe.moe
    d = {k: v.double() for k, v in moe.state_dict().items()}
    out = torch.zeros(x.shape, dtype=torch.float64)

    def mlp(prefix, v):
        gate = v @ d[f"{prefix}.gate_proj.weight"].T
        up = v @ d[f"{prefix}.up_proj.weight"].T
        return (gate / (1 + torch.exp(-gate)) * up) @ d[f"{prefix}.down_proj.weight"].T

    for t in range(x.shape[0]):
        v = x[t].double()
        logits = d["gate.weight"] @ v
        scores = torch.exp(logits - logits.max())
        scores = scores / scores.sum()
        order = sorted(range(len(scores)), key=lambda e: (-float(scores[e]), e))[: cfg.num_experts_per_tok]
        weights = [float(scores[e]) for e in order]
        if cfg.norm_topk_prob:
            weights = [w / sum(weights) for w in weights]
        for e, w in zip(order, weights):
            out[t] += w * cfg.routed_scaling_factor * mlp(f"experts.{e}", v)
        if moe.shared_experts is not None:
            out[t] += mlp("shared_experts", v)
    return out


def _random_moe(norm: bool, scale: float, seed: int = 0, experts: int = 8, topk: int = 3) -> U.MoE:
    torch.manual_seed(seed)
    cfg = moe_config(n_routed_experts=experts, num_experts_per_tok=topk, n_shared_experts=2, norm_topk_prob=norm)
    cfg = U.MoEConfig(**{**cfg.__dict__, "routed_scaling_factor": scale, "moe_intermediate_size": 16})
    moe = U.MoE(24, cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape) / math.sqrt(p.shape[-1]))
    return moe


@pytest.mark.parametrize("form", U.EXPERT_FORMS)
@pytest.mark.parametrize("norm, scale", [(False, 1.0), (True, 2.5)])
def test_moe_layer_equals_a_float64_formulation_in_every_form(norm, scale, form):
    moe = _random_moe(norm, scale)
    x = torch.randn(40, 24)
    want = _moe_float64(moe, x)
    moe.form = form
    got = moe(x)
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), want, atol=1e-5, rtol=1e-5), (form, (got.double() - want).abs().max())


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_grouped_experts_equal_the_per_expert_loop_on_skewed_routing(seed):
    # 64 experts, top 6 (the published shape's counts): most experts get no token, some many;
    # tokens that all pick the same experts; one token; the grouped GEMM's empty groups.
    moe = _random_moe(True, 1.0, seed=seed, experts=64, topk=6)
    for x in (torch.randn(33, 24), torch.randn(1, 24), torch.randn(1, 24).expand(7, 24).clone()):
        weights, ids = moe.route(x)
        loop = moe.sparse_experts(x, weights, ids)
        grouped = moe.grouped_experts(x, weights, ids)
        assert torch.allclose(grouped, loop, atol=1e-6, rtol=1e-5), (grouped - loop).abs().max()
        assert not torch.equal(grouped, torch.zeros_like(grouped))


def test_grouped_experts_restack_when_weights_change():
    moe = _random_moe(False, 1.0)
    moe.form = "grouped"
    x = torch.randn(12, 24)
    before = moe(x)
    w13, _ = moe.stacked_weights()
    assert moe.stacked_weights()[0] is w13  # kept while the weights stay
    with torch.no_grad():  # new weights for every expert, written in place (a checkpoint load)
        for e in moe.experts:
            e.down_proj.weight.mul_(-2.0)
    after = moe(x)
    assert torch.allclose(after.double(), _moe_float64(moe, x), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(after, before)
    moved = moe.to(torch.bfloat16)  # new storage: restacked in the new dtype
    assert moved.stacked_weights()[0].dtype == torch.bfloat16
    xb = x.bfloat16()
    grouped = moved(xb).float()
    moved.form = "sparse"
    assert torch.allclose(grouped, moved(xb).float(), atol=2e-2, rtol=2e-2)
    assert torch.allclose(grouped.double(), _moe_float64(moe, x), atol=0.1, rtol=0.1)
    with pytest.raises(ValueError, match="one of"):
        moe.form = "fused"
        moe(x)


@pytest.mark.gpu
def test_grouped_experts_on_the_gpu_equal_the_loop_eager_and_in_a_cuda_graph():
    """The MoE layer's default form on a GPU (grouped GEMMs, bf16): close to the per-expert
    loop, captured in a CUDA graph with no host synchronisation, and a replay on new tokens
    equal to the eager call on them."""
    torch.manual_seed(0)
    cfg = U.MoEConfig(
        **{
            **moe_config(n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2).__dict__,
            "moe_intermediate_size": 128,
        }
    )
    moe = U.MoE(256, cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape) / math.sqrt(p.shape[-1]))
    moe = moe.cuda().bfloat16()
    x = torch.randn(48, 256, device="cuda", dtype=torch.bfloat16)
    if not U.grouped_native(x):
        pytest.skip("PyTorch's grouped GEMM is not one kernel on this GPU (sm_90/sm_100 bf16 only)")
    with torch.no_grad():
        assert moe.form_for(x) == "grouped"
        grouped = moe(x).float()
        moe.form = "sparse"
        loop = moe(x).float()
        moe.form = None
        assert ((grouped - loop).norm() / loop.norm()) < 1e-2
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            moe(x)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = moe(x)
        x.copy_(torch.randn_like(x))
        graph.replay()
        assert torch.equal(out, moe(x))


# ------------------------------------------------------------------------------ config
def test_nested_config_is_read_and_written_back_as_published():
    raw = U.tiny_config(3)
    cfg = DashModelConfig.from_dict(raw)
    assert cfg.nested and cfg.architecture == U.ARCHITECTURE
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.head_dim) == (320, 128, 3, 32)
    assert cfg.image_feature_dim == 128 and cfg.eos_token_id == 1
    assert cfg.get("n_routed_experts") == 8 and cfg.get("vision_config")["deepencoder"]["sam_layers"] == 3
    written = cfg.to_dict()
    section = written.pop("sparse_attention_config")  # every key of it written, defaults included
    assert written == {k: v for k, v in raw.items() if k != "sparse_attention_config"}
    assert {k: section[k] for k in raw["sparse_attention_config"]} == raw["sparse_attention_config"]
    assert DashModelConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.prompt_length(40) == 40
    no_window = DashModelConfig.from_dict({**raw, "rswa_window": 0})
    assert no_window.prompt_length(40) is None and no_window.to_dict()["rswa_window"] == 0
    assert DashModelConfig.from_dict({**raw, "rswa_window": 16}).rswa_window == 16


@pytest.mark.parametrize(
    "change, message",
    [
        ({"use_mla": True}, r"language_config\.use_mla is True; Unlimited-OCR-2 needs false"),
        ({"qk_rope_head_dim": 64}, r"language_config\.qk_rope_head_dim is 64"),
        ({"hidden_act": "gelu"}, r"language_config\.hidden_act is 'gelu'"),
        ({"topk_method": "noaux_tc"}, r"topk_method is 'noaux_tc'.*DeepSeek-V3"),
        ({"num_experts_per_tok": 9}, r"num_experts_per_tok is 9; .*at most n_routed_experts \(8\)"),
        ({"n_routed_experts": None}, r"language_config is missing key 'n_routed_experts'"),
        ({"scoring_func": "relu"}, r"scoring_func is 'relu'"),
    ],
)
def test_a_wrong_language_key_is_named(change, message):
    with pytest.raises(M.ModelContractError, match=message):
        M.random_model(U.tiny_config(overrides=change))


def test_config_errors_name_the_key():
    raw = U.tiny_config()
    with pytest.raises(ModelConfigError, match=r"rswa_window must be unset, 0 .* or 16"):
        DashModelConfig.from_dict({**raw, "rswa_window": 128})
    lang = dict(raw["language_config"])
    del lang["hidden_size"]
    with pytest.raises(ModelConfigError, match=r"language_config is missing key\(s\): hidden_size"):
        DashModelConfig.from_dict({**raw, "language_config": lang})
    sp = {**raw["sparse_attention_config"], "sparse_index_dim": 16}
    with pytest.raises(
        M.ModelContractError, match=r"sparse_index_dim is 16; Unlimited-OCR-2 requires index_dim == head"
    ):
        M.random_model({**raw, "sparse_attention_config": sp})
    sp = {**raw["sparse_attention_config"], "dash_image_only": False}
    with pytest.raises(ModelConfigError, match="dash_image_only"):
        DashModelConfig.from_dict({**raw, "sparse_attention_config": sp})
    v1 = {k: v for k, v in raw.items() if k != "sparse_attention_config"}
    with pytest.raises(ModelConfigError, match="sparse_attention_config"):
        DashModelConfig.from_dict(v1)


# ------------------------------------------------------------------------------ checkpoints
@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The tiny folder the repository's script writes."""
    return write_tiny_unlimited_ocr2(tmp_path_factory, "uocr2")


@pytest.fixture(scope="module")
def tiny(folder):
    return load_checkpoint(folder)


def test_the_folder_is_the_published_layout_and_loads_by_its_architecture(tiny, folder):
    assert type(tiny) is U.UnlimitedOCR2ForCausalLM
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == [U.ARCHITECTURE] and "language_config" in config
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    names = set(index)
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in names
    assert "model.layers.1.mlp.gate.weight" in names and "model.layers.1.mlp.shared_experts.up_proj.weight" in names
    assert "model.layers.0.mlp.gate_proj.weight" in names  # first_k_dense_replace = 1: a dense MLP
    assert "model.layers.0.self_attn.dash_router.head_cls" in names and "lm_head.weight" in names
    assert len(set(index.values())) > 1
    made = M.random_model(U.tiny_config(), seed=0)  # what the script saved
    for k, v in made.state_dict().items():
        assert torch.equal(tiny.state_dict()[k], v), k


def _copy(folder, dest):
    import shutil

    shutil.copytree(folder, dest)
    return dest


def _rewrite_shard(path, change):
    import safetensors.torch as st

    tensors = st.load_file(str(path))
    change(tensors)
    st.save_file(tensors, str(path), metadata={"format": "pt"})


def test_partial_or_wrong_checkpoints_get_one_line_naming_the_tensor(folder, tmp_path):
    index_path = folder / "model.safetensors.index.json"
    weight_map = json.loads(index_path.read_text())["weight_map"]
    shard = weight_map["model.layers.1.mlp.experts.3.up_proj.weight"]

    missing = _copy(folder, tmp_path / "missing")
    (missing / shard).unlink()
    with pytest.raises(CheckpointError, match=f"weights file not found: .*{shard}"):
        load_checkpoint(missing)

    unknown = _copy(folder, tmp_path / "unknown")
    name = "model.layers.1.mlp.experts.8.up_proj.weight"
    _rewrite_shard(unknown / shard, lambda t: t.__setitem__(name, torch.zeros(64, 128)))
    idx = json.loads((unknown / "model.safetensors.index.json").read_text())
    idx["weight_map"][name] = shard
    (unknown / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match=r"unexpected layers\.1\.mlp\.experts\.8\.up_proj\.weight"):
        load_checkpoint(unknown)

    wrong = _copy(folder, tmp_path / "wrong")
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    _rewrite_shard(wrong / shard, lambda t: t.__setitem__(name, torch.zeros(32, 128)))
    with pytest.raises(CheckpointError, match=r"layers\.1\.mlp\.experts\.3\.up_proj\.weight is \[32, 128\] in the "):
        load_checkpoint(wrong)

    gone = _copy(folder, tmp_path / "gone")
    name = "model.layers.1.mlp.gate.weight"
    _rewrite_shard(gone / weight_map[name], lambda t: t.pop(name))
    idx = json.loads((gone / "model.safetensors.index.json").read_text())
    del idx["weight_map"][name]
    (gone / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match=r"missing layers\.1\.mlp\.gate\.weight"):
        load_checkpoint(gone)

    flag = _copy(folder, tmp_path / "flag")
    config = json.loads((flag / "config.json").read_text())
    config["language_config"]["use_mla"] = True
    (flag / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"language_config\.use_mla is True"):
        load_checkpoint(flag)


def test_vision_tower_and_warm_up_indexer_tensors_are_not_the_decoder_s(tiny, folder, tmp_path):
    """The folder holds the vision tower beside the decoder (the decoder leaves its tensors to it),
    and the unused warm-up indexer and CLIP's position ids are dropped."""
    names = set(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"])
    assert {"model.image_newline", "model.view_seperator", "model.projector.layers.weight"} <= names
    assert any(n.startswith("model.sam_model.blocks.") for n in names)
    assert any(n.startswith("model.vision_model.transformer.layers.") for n in names)
    extra = _copy(folder, tmp_path / "extra")
    shard = sorted(p.name for p in extra.glob("model-*.safetensors"))[0]
    added = {
        "model.vision_model.embeddings.position_ids": torch.zeros(1, 4),
        "model.layers.0.self_attn.indexer.wq.weight": torch.zeros(4, 4),
    }
    _rewrite_shard(extra / shard, lambda t: t.update(added))
    idx = json.loads((extra / "model.safetensors.index.json").read_text())
    idx["weight_map"].update(dict.fromkeys(added, shard))
    (extra / "model.safetensors.index.json").write_text(json.dumps(idx))
    loaded = load_checkpoint(extra)
    assert torch.equal(loaded.lm_head.weight, tiny.lm_head.weight)
    from dash_trt.models.checkpoint import load_vision_tower

    tower = load_vision_tower(extra)
    assert tower.image_newline.shape == (128,)


def test_an_unset_rswa_window_is_read_as_vllm_reads_it():
    """vLLM 0.34.0 reads an unset rswa_window as 128 and refuses it unless the model's window
    (sparse_local_block x sparse_block_size) is 128: a window of 16 must be set."""
    raw = U.tiny_config()
    raw.pop("rswa_window")
    with pytest.raises(
        ValueError, match=r"rswa_window is unset: vLLM 0.34.0 reads that as 128.* set rswa_window to 16"
    ):
        M.random_model(raw)
    raw["sparse_attention_config"] = {
        **raw["sparse_attention_config"],
        "sparse_block_size": 32,
        "sparse_local_block": 4,
    }
    model = M.random_model(raw)  # a window of 128: unset is fine, as in vLLM
    assert model.config.prompt_length(40) == 40
    for window in (0, 16):
        assert M.random_model({**U.tiny_config(), "rswa_window": window}).config.rswa_window == window


def test_lm_head_is_never_tied_as_in_vllm(tmp_path):
    """vLLM 0.34.0's DeepSeek-V2 keeps its own lm_head whatever tie_word_embeddings says: a folder
    that says true and ships lm_head.weight gets that tensor as the output head and keeps its
    embeddings; one that ships no lm_head.weight is refused naming it."""
    raw = U.tiny_config(overrides={"tie_word_embeddings": True})
    model = M.random_model(raw, seed=1)
    assert model.lm_head.weight is not model.embed_tokens.weight
    assert not torch.equal(model.lm_head.weight, model.embed_tokens.weight)
    save_pretrained(model, tmp_path / "untied")
    loaded = load_checkpoint(tmp_path / "untied")
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)
    assert torch.equal(loaded.embed_tokens.weight, model.embed_tokens.weight)
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "no_head"
    folder.mkdir()
    (folder / "config.json").write_text((tmp_path / "untied" / "config.json").read_text())
    state = load_file(str(tmp_path / "untied" / "model.safetensors"))
    del state["lm_head.weight"]
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"missing .*lm_head\.weight"):
        load_checkpoint(folder)


@pytest.mark.parametrize("n_group, topk_group", [(4, 1), (4, 2), (2, 1)])
def test_experts_are_grouped_whenever_n_group_is_over_one_as_in_vllm(n_group, topk_group):
    """vLLM 0.34.0 (deepseek_v2.py: use_grouped_topk=True) limits the experts to the topk_group best
    groups whenever n_group > 1, with topk_method greedy too."""
    raw = U.tiny_config(overrides={"topk_method": "greedy", "n_group": n_group, "topk_group": topk_group})
    moe = U.MoEConfig.from_config(DashModelConfig.from_dict(raw))
    assert (moe.n_group, moe.topk_group) == (n_group, topk_group)
    torch.manual_seed(n_group + topk_group)
    logits = torch.randn(50, 8)
    _, ids = U.route_experts(logits, moe)
    size = 8 // n_group
    groups = logits.softmax(-1).view(50, n_group, size).amax(-1)
    best = groups.topk(topk_group, -1).indices
    for t in range(50):
        assert set((ids[t] // size).tolist()) <= set(best[t].tolist())
    if topk_group == 1:  # (with 2 of 4 groups kept, a token's 2 best experts are always in them)
        greedy = U.route_experts(logits, U.MoEConfig(**{**moe.__dict__, "n_group": 1, "topk_group": 1}))[1]
        assert not torch.equal(ids, greedy)  # the grouping changed some choice


# ------------------------------------------------------------------------------ generation
def test_paged_generation_equals_the_dense_reference_with_and_without_a_window(tiny):
    prompts, feats = M.check_prompts(tiny)
    want = M.reference_generate(tiny, prompts, 6, image_features=feats, stop_at_eos=False).tokens
    got = M.generate(tiny, prompts, 6, image_features=feats, prefill_chunk=24, stop_at_eos=False).tokens
    assert got == want
    raw = {**U.tiny_config(), "rswa_window": 0}
    full = M.random_model(raw, seed=0)
    full.load_state_dict(tiny.state_dict())
    want0 = M.reference_generate(full, prompts, 6, image_features=feats, stop_at_eos=False).tokens
    assert M.generate(full, prompts, 6, image_features=feats, stop_at_eos=False).tokens == want0


@pytest.mark.parametrize("form", ["dense", "grouped"])
def test_every_expert_form_generates_the_sparse_tokens(tiny, form):
    prompts, feats = M.check_prompts(tiny)
    want = M.generate(tiny, prompts, 6, image_features=feats, stop_at_eos=False)
    try:
        tiny.set_expert_form(form)
        got = M.generate(tiny, prompts, 6, image_features=feats, stop_at_eos=False)
    finally:
        tiny.set_expert_form(None)
    assert got.tokens == want.tokens
    with pytest.raises(ValueError, match="expert form"):
        tiny.set_expert_form("fast")


def run_cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_export_and_compare_take_the_folder_without_model(folder, tmp_path):
    out = tmp_path / "uocr2.onnx"
    res = run_cli("dash_trt.export", str(folder), "--out", str(out), "--quiet")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "the checker and ONNX Runtime agree with PyTorch" in res.stdout
    import onnx

    graph = onnx.load(str(out), load_external_data=False).graph
    assert [i.name for i in graph.input][7:9] == list(M.IMAGE_INPUTS)
    assert sum(n.op_type == "DashAttention" for n in graph.node) == 2
    assert not any(n.op_type in ("Loop", "NonZero", "If") for n in graph.node)  # the dense experts
    res = run_cli("dash_trt.compare", str(out), "--checkpoint", str(folder), "--no-cuda")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "all backends match the reference" in res.stdout
    res = run_cli("dash_trt.build", str(out), "--plugin", "p.so", "--print-trtexec", "--max-tokens", "64",
                  "--max-seqs", "2", "--max-context", "256", "--trt-version", "10.8")  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    assert "image_features:64x128" in res.stdout and "past.1.summary_pages:32x1x3" in res.stdout


def test_onnx_runtime_generates_the_pytorch_tokens(tiny, tmp_path):
    from dash_trt import export as E

    path = tmp_path / "m.onnx"
    E.export_onnx(tiny, path)
    sess = E._ort_session(str(path))
    names = [i.name for i in sess.get_inputs()]
    state: dict = {}

    def ort_forward(inputs: dict, caches: list):
        past = state.get("caches") or [E.to_numpy(c) for c in caches]
        res = sess.run(None, dict(zip(names, [E.to_numpy(v) for v in inputs.values()] + past)))
        state["caches"] = res[1:]
        return E.to_torch(res[0]), [E.to_torch(a) for a in res[1:]]

    prompts, feats = M.check_prompts(tiny)
    want = M.generate(tiny, prompts, 8, image_features=feats, prefill_chunk=40, stop_at_eos=False).tokens
    got = M.generate(
        tiny, prompts, 8, image_features=feats, prefill_chunk=40, stop_at_eos=False, forward=ort_forward
    ).tokens
    assert got == want


def test_triton_serves_the_folder_like_offline_generation(tiny, folder, tmp_path):
    from dash_trt.triton import client as C

    repo = tmp_path / "repo"
    res = run_cli("dash_trt.triton.cli", "write", str(folder), "--out", str(repo), "--num-blocks", "64",
                  "--torch-threads", "1")  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    prompts, feats = M.check_prompts(tiny)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        want = [
            M.generate(tiny, [p], 6, image_features=[f], stop_at_eos=False).tokens[0] for p, f in zip(prompts, feats)
        ]
    finally:
        torch.set_num_threads(threads)
    with running_triton(repo, tmp_path / "tritonserver.log") as srv:
        with C.DashClient(srv.http_url, protocol="http") as http:
            assert http.model_config() == tiny.config
            for p, f, w in zip(prompts, feats, want):
                arr = None if f is None else f.numpy()
                assert http.generate(p, 6, stop_at_eos=False, image_features=arr).tokens == w


def test_exported_routing_orders_ties_as_pytorch_does(tmp_path):
    """The exported graph picks experts with ONNX's TopK (equal scores in index order), PyTorch
    with a stable sort: the same experts on rows full of ties, and on random rows."""
    import onnxruntime as ort

    cfg = moe_config(n_routed_experts=8, num_experts_per_tok=3, topk_method="group_limited_greedy", n_group=4,
                     topk_group=2)  # fmt: skip

    class Route(torch.nn.Module):
        def forward(self, logits):
            return U.route_experts(logits, cfg)

    logits = torch.cat([torch.zeros(2, 8), torch.tensor([[1.0, 1, 0, 0, 1, 1, 0, 0]]), torch.randn(5, 8)])
    path = tmp_path / "route.onnx"
    torch.onnx.export(Route(), (logits,), str(path), dynamo=True, dynamic_shapes=({0: torch.export.Dim("t")},))
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    weights, ids = sess.run(None, {sess.get_inputs()[0].name: logits.numpy()})
    want_w, want_ids = U.route_experts(logits, cfg)
    assert ids.tolist() == want_ids.tolist()
    assert ids[:3].tolist() == [[0, 1, 2], [0, 1, 2], [0, 1, 4]]
    assert torch.allclose(torch.from_numpy(weights), want_w)


def test_dash_trt_info_prints_the_deployment_facts(folder, capsys):
    """Parameters, active parameters and KV bytes of the tiny folder, derived by hand: embeddings
    and lm_head 2 x 320 x 128; a layer's attention 4 x 128^2, its router 2 x 128 x 32 + 2 x 32 + 32,
    its norms 2 x 128; layer 0's dense MLP 3 x 128 x 256; layer 1's gate 8 x 128, 8 experts of
    3 x 128 x 64 (2 of them a token) and shared experts 3 x 128 x 128; the final norm 128."""
    from dash_trt.commands import info

    attn = 4 * 128 * 128 + 2 * 128 * 32 + 2 * 32 + 32 + 2 * 128
    experts = 8 * 3 * 128 * 64
    total = 2 * 320 * 128 + 128 + 2 * attn + 3 * 128 * 256 + 8 * 128 + experts + 3 * 128 * 128
    assert info.main(["info", str(folder), "--json", "--gpu-memory-gib", "1"]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["parameters"] == total and facts["active_parameters"] == total - experts * 6 // 8
    assert facts["weight_bytes"] == 4 * total
    # a token a layer: K and V (4 heads x 32 x 4 B each), index key 32 x 4 B, image page 4 B,
    # its share of a 16-token sparse block's summary (32 x 4 B) and page range (3 x 4 B)
    assert facts["kv_bytes_per_token_per_layer"] == 512 + 512 + 128 + 4 + 128 / 16 + 12 / 16
    blocks = (0.9 * 2**30 - 4 * total) // facts["block_bytes"]
    assert facts["pools"] == [{"memory": "1 GiB", "bytes": 2**30, "kv_blocks": blocks, "kv_tokens": 16 * blocks}]
    assert info.main(["info", str(folder), "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert (
        "UnlimitedOCRForCausalLM, 2 layers, bfloat16" in out
        and f"active per token: {total - experts * 6 // 8:,}" in out
    )
    assert info.main(["info", str(folder / "nope")]) == 2
    assert "not found" in capsys.readouterr().err
