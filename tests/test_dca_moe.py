"""Qwen2-MoE with Dual Chunk Attention (dash_trt.models.qwen2_dca.moe): the reference form
against a dense causal Qwen2-MoE written here in float64 from transformers' formulas (router
softmax over every expert, top-k, renormalised only with norm_topk_prob, the sigmoid-gated shared
expert, the layers mlp_only_layers / decoder_sparse_step leave dense); the two forms of the routed
experts; greedy generation over the paged cache against the cache-free reference, scaling off
and on; the Hugging Face folder round trip (transformers' tensor names) and refusals; the ONNX
export run by ONNX Runtime against the PyTorch paged generation."""

import json
import math

import onnx
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_dca_model import dense_qwen2_logits, gated_mlp64

from dash_trt.attention.dca import onnx as dca_onnx
from dash_trt.attention.dca.reference import DcaConfigError
from dash_trt.models import qwen2_dca as Q
from dash_trt.models.checkpoint import CheckpointError
from dash_trt.models.loader import load_model
from dash_trt.models.qwen2_dca import moe as M
from dash_trt.models.qwen2_dca.load import dca_model_class, load_dca

CHUNK, LOCAL = 32, 8
C = CHUNK - LOCAL  # c = 24
BLOCK = 8
L_ORIG = 16
PROMPT, NEW = 70, 24  # 93 cached positions: chunks 0..3 (boundaries 24, 48, 72)
#: float32 model against the float64 dense Qwen2-MoE, relative to the largest |logit|
DENSE_RTOL = 1e-5
#: paged (chunked, cached) against reference logits, both float32
PAGED_ATOL = 1e-4
#: the float64 routing must not be within this of a tie (else float32 may choose otherwise)
ROUTING_MARGIN = 1e-5

pytestmark = pytest.mark.usefixtures("single_thread")


def dca_section(l_orig: int = 0) -> dict:
    return {"chunk_size": CHUNK, "local_size": LOCAL, "original_max_position_embeddings": l_orig}


def make_model(seed: int = 0, l_orig: int = 0, **overrides) -> M.Qwen2MoeDcaForCausalLM:
    raw = M.tiny_qwen2_moe_dca_config(dual_chunk_attention_config=dca_section(l_orig), **overrides)
    return Q.init_random_weights(M.Qwen2MoeDcaForCausalLM(M.Qwen2MoeDcaConfig.from_dict(raw)), seed).eval()


def random_ids(n: int, seed: int, vocab: int = 96) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ------------------------------------------------------------ dense Qwen2-MoE (float64)
def moe_ffn64(config: dict, margins: list[float]):
    """transformers' Qwen2MoeDecoderLayer feed-forward in float64, one token at a time: the sparse
    block in the layers (i + 1) % decoder_sparse_step == 0 outside mlp_only_layers, else the
    dense MLP. ``margins`` collects each token's gap between the k-th and the (k+1)-th routing
    probability (a tie would make the choice depend on rounding)."""
    experts, k = config["num_experts"], config["num_experts_per_tok"]
    step, only = config.get("decoder_sparse_step", 1), config.get("mlp_only_layers") or []

    def ffn(w: dict, layer: int, h: torch.Tensor) -> torch.Tensor:
        p = f"model.layers.{layer}.mlp."
        if layer in only or (layer + 1) % step:
            return gated_mlp64(w, p, h)
        probs = torch.softmax(h @ w[p + "gate.weight"].T, dim=-1)  # [n, E], all experts
        out = torch.zeros_like(h)
        for t in range(h.shape[0]):
            order = sorted(range(experts), key=lambda e: (-float(probs[t, e]), e))
            chosen = order[:k]
            if k < experts:
                margins.append(float(probs[t, order[k - 1]] - probs[t, order[k]]))
            weights = [probs[t, e] for e in chosen]
            if config.get("norm_topk_prob"):
                total = sum(weights)
                weights = [x / total for x in weights]
            for e, we in zip(chosen, weights):
                out[t] += we * gated_mlp64(w, f"{p}experts.{e}.", h[t : t + 1])[0]
        shared = torch.sigmoid(h @ w[p + "shared_expert_gate.weight"].T) * gated_mlp64(w, p + "shared_expert.", h)
        return out + shared

    return ffn


DENSE_CONFIGS = {
    # 8 experts, 2 a token, not renormalised, every layer sparse; 2 KV heads, base 1e4
    "top2-of-8": dict(),
    # 6 experts, 3 a token, renormalised; layer 1 dense (mlp_only_layers); tied embeddings, one KV
    # head, head_dim 24 given, base 1e6, scaling on with L_orig 64 above every length (s = 1)
    "top3-of-6-norm-mlp-only": dict(
        num_experts=6,
        num_experts_per_tok=3,
        norm_topk_prob=True,
        num_hidden_layers=3,
        mlp_only_layers=[1],
        tie_word_embeddings=True,
        num_key_value_heads=1,
        head_dim=24,
        rope_theta=1e6,
        l_orig=64,
    ),
    # decoder_sparse_step 2 over 4 layers, layer 3 in mlp_only_layers: only layer 1 is sparse
    "sparse-step-2": dict(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3], num_experts_per_tok=1),
}


@pytest.mark.parametrize("name", list(DENSE_CONFIGS))
def test_reference_is_dense_qwen2_moe_within_a_chunk(name):
    """Up to min(c + W + 1, 2c) = 33 tokens DCA is dense attention: the reference logits (and
    those of the dense form of the experts) equal the float64 Qwen2-MoE written above; at the
    34th token the last row differs."""
    over = dict(DENSE_CONFIGS[name])
    model = make_model(seed=3, **over)
    raw = model.config.to_dict()
    sparse_layers = [i for i in range(raw["num_hidden_layers"]) if model.config.is_moe_layer(i)]
    assert sparse_layers == {"top2-of-8": [0, 1], "top3-of-6-norm-mlp-only": [0, 2], "sparse-step-2": [1]}[name]
    for i, layer in enumerate(model.model.layers):
        assert isinstance(layer.mlp, M.Qwen2MoeSparseBlock) == (i in sparse_layers)
    state = model.state_dict()
    margins: list[float] = []
    ffn = moe_ffn64(raw, margins)
    exact = min(C + LOCAL + 1, 2 * C)
    for n in (1, 7, C, exact):
        ids = random_ids(n, seed=n)
        want = dense_qwen2_logits(state, raw, ids, ffn)
        got = model.reference_logits(ids)
        scale = float(want.abs().max())
        err = float((got.double() - want).abs().max())
        assert err <= DENSE_RTOL * scale, (n, err, scale)
        model.set_expert_form("dense")
        err = float((model.reference_logits(ids).double() - want).abs().max())
        model.set_expert_form(None)
        assert err <= DENSE_RTOL * scale, ("dense form", n, err, scale)
    assert min(margins) > ROUTING_MARGIN, min(margins)
    ids = random_ids(exact + 1, seed=99)
    want = dense_qwen2_logits(state, raw, ids, ffn)
    got = model.reference_logits(ids).double()
    scale = float(want.abs().max())
    assert float((got[:exact] - want[:exact]).abs().max()) <= DENSE_RTOL * scale
    assert float((got[exact] - want[exact]).abs().max()) > 1e-2 * scale


def test_routing_rule():
    """Softmax over every expert in float32, the k highest (equal ones in index order), divided by
    their sum only with norm_topk_prob, cast to the logits' dtype."""
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0], [3.0, -1.0, 0.5, 0.0]])
    w, ids = M.route(logits, 2, False)
    probs = logits.softmax(-1)
    assert ids.tolist() == [[1, 3], [0, 2]]
    torch.testing.assert_close(w, probs.gather(1, ids))
    w, _ = M.route(logits, 2, True)
    torch.testing.assert_close(w.sum(-1), torch.ones(2))
    w, _ = M.route(logits.bfloat16(), 2, False)
    assert w.dtype == torch.bfloat16


# ------------------------------------------------------------------------- generation
@pytest.fixture(scope="module", params=[0, L_ORIG], ids=["unscaled", "scaled"])
def case(request):
    model = make_model(seed=3, l_orig=request.param, rope_theta=1e6)
    prompts = [random_ids(PROMPT, seed=10), random_ids(45, seed=11)]
    return model, prompts, Q.reference_generate(model, prompts, NEW)


@pytest.mark.parametrize("split", [None, 7, [1, 23, 24, 25, 48, 69]], ids=["one-shot", "chunks-of-7", "boundaries"])
def test_paged_generation_equals_reference_greedy(case, split):
    """Both prompts in one ragged batch (prefill chunks beside decode tokens), shuffled blocks,
    NaN in every unwritten slot: the reference's greedy tokens, logits within 1e-4."""
    model, prompts, ref = case
    gen = Q.generate(model, prompts, NEW, prefill=split, kv_block_size=BLOCK, seed=5, cache_fill=math.nan)
    for i in range(2):
        assert gen.tokens[i] == ref.tokens[i]
        assert bool(torch.isfinite(gen.logits[i]).all())
        err = float((gen.logits[i] - ref.logits[i]).abs().max())
        assert err <= PAGED_ATOL, (i, err)
    assert len(set(ref.tokens[0])) >= 8 and (PROMPT + NEW - 1) // C >= 3
    assert any(b != a + 1 for a, b in zip(gen.block_tables[0], gen.block_tables[0][1:]))


def test_scaling_and_experts_matter():
    """The length scaling shows (L_orig 16), and so does the routing: the same weights with another
    top-k or renormalised give other logits."""
    prompt = random_ids(PROMPT, seed=10)
    scaled, plain = make_model(seed=0, l_orig=L_ORIG), make_model(seed=0)
    assert float((scaled.reference_logits(prompt) - plain.reference_logits(prompt)).abs().max()) > 0.1
    for change in ({"num_experts_per_tok": 3}, {"norm_topk_prob": True}):
        other = make_model(seed=0, **change)
        assert float((other.reference_logits(prompt) - plain.reference_logits(prompt)).abs().max()) > 0.1


# ------------------------------------------------------------------------- checkpoints
def expected_names(config: M.Qwen2MoeDcaConfig) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    names |= set() if config.tie_word_embeddings else {"lm_head.weight"}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        names |= {p + f"self_attn.{x}_proj.{y}" for x in "qkv" for y in ("weight", "bias")}
        names |= {p + "self_attn.o_proj.weight"}
        mlps = [p + "mlp."]
        if i not in config.mlp_only_layers and (i + 1) % config.decoder_sparse_step == 0:
            names |= {p + "mlp.gate.weight", p + "mlp.shared_expert_gate.weight"}
            mlps = [p + f"mlp.experts.{e}." for e in range(config.num_experts)] + [p + "mlp.shared_expert."]
        names |= {m + f"{x}_proj.weight" for m in mlps for x in ("gate", "up", "down")}
    return names


def test_hf_folder_round_trip(tmp_path):
    folder = tmp_path / "tiny-moe"
    over = dict(num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=True)
    M.write_tiny_qwen2_moe_dca(folder, seed=4, dual_chunk_attention_config=dca_section(20), **over)
    raw = json.loads((folder / "config.json").read_text())
    assert raw["architectures"] == ["Qwen2MoeForCausalLM"] and raw["model_type"] == "qwen2_moe"
    assert (raw["num_experts"], raw["num_experts_per_tok"], raw["mlp_only_layers"]) == (8, 2, [1])
    loaded = load_dca(folder)
    assert type(loaded) is M.Qwen2MoeDcaForCausalLM and type(load_model(folder)) is M.Qwen2MoeDcaForCausalLM
    stored = load_file(folder / "model.safetensors")
    assert set(stored) == expected_names(loaded.config)
    assert stored["model.layers.0.mlp.shared_expert_gate.weight"].shape == (1, 64)
    assert stored["model.layers.0.mlp.gate.weight"].shape == (8, 64)
    same = make_model(seed=4, l_orig=20, **over)
    ids = random_ids(60, seed=3)
    assert torch.equal(loaded.reference_logits(ids), same.reference_logits(ids))
    assert loaded.config == M.Qwen2MoeDcaConfig.from_model_config(folder)
    Q.save_qwen2_dca(loaded, tmp_path / "again")
    assert torch.equal(load_dca(tmp_path / "again").reference_logits(ids), same.reference_logits(ids))
    # the loader's --model must name the folder's class
    spec = "dash_trt.models.qwen2_moe_dca:Qwen2MoeDcaForCausalLM"
    assert type(load_model(folder, model_class=spec)) is M.Qwen2MoeDcaForCausalLM
    with pytest.raises(CheckpointError, match=r"\(Qwen2MoeDcaForCausalLM\); --model .*:Qwen2DcaForCausalLM"):
        load_model(folder, model_class="dash_trt.models.qwen2_dca:Qwen2DcaForCausalLM")
    # a shard without one expert's down projection
    state = dict(stored)
    del state["model.layers.2.mlp.experts.5.down_proj.weight"]
    save_file(state, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match="missing model.layers.2.mlp.experts.5.down_proj.weight"):
        load_dca(folder)


BAD_CONFIGS = [
    ({"num_experts": None}, "missing the required key 'num_experts'"),
    ({"moe_intermediate_size": 0}, "'moe_intermediate_size' must be a positive int"),
    ({"shared_expert_intermediate_size": None}, "missing the required key 'shared_expert_intermediate_size'"),
    ({"num_experts_per_tok": 9}, r"num_experts_per_tok \(9\) must be at most num_experts \(8\)"),
    ({"decoder_sparse_step": 0}, "'decoder_sparse_step' must be a positive int"),
    ({"mlp_only_layers": [2]}, r"mlp_only_layers must be a list of layer indices in \[0, 2\)"),
    ({"mlp_only_layers": 1}, "mlp_only_layers must be a list"),
    ({"norm_topk_prob": "yes"}, "norm_topk_prob must be true or false"),
    ({"qkv_bias": False}, "qkv_bias is false"),
    ({"model_type": "qwen3_moe"}, "model_type is 'qwen3_moe'"),
    ({"dual_chunk_attention_config": {**dca_section(), "sparse_attention_config": [{}]}}, "sparse"),
]


@pytest.mark.parametrize("overrides, message", BAD_CONFIGS, ids=[m[:40] for _, m in BAD_CONFIGS])
def test_bad_configs_refused(tmp_path, overrides, message):
    raw = M.tiny_qwen2_moe_dca_config(**overrides)
    raw = {k: v for k, v in raw.items() if v is not None}
    with pytest.raises(DcaConfigError, match=message):
        M.Qwen2MoeDcaConfig.from_dict(raw)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(DcaConfigError, match=message):
        load_dca(tmp_path)


def test_config_defaults_and_family_dispatch():
    raw = M.tiny_qwen2_moe_dca_config()
    for key in ("norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "intermediate_size", "model_type"):
        del raw[key]
    cfg = M.Qwen2MoeDcaConfig.from_dict(raw)  # model_type from architectures in the loader; here the class's
    assert (cfg.norm_topk_prob, cfg.decoder_sparse_step, cfg.mlp_only_layers) == (False, 1, ())
    assert cfg.intermediate_size == 5632  # transformers' default (used by dense layers only)
    assert dca_model_class(raw) is M.Qwen2MoeDcaForCausalLM
    assert dca_model_class(Q.tiny_qwen2_dca_config()) is Q.Qwen2DcaForCausalLM
    with pytest.raises(DcaConfigError, match="model_type is 'qwen2_moe'; this model is Qwen2ForCausalLM"):
        Q.Qwen2DcaConfig.from_dict(M.tiny_qwen2_moe_dca_config())
    with pytest.raises(DcaConfigError, match="model_type is 'qwen2'; this model is Qwen2MoeForCausalLM"):
        M.Qwen2MoeDcaConfig.from_dict({**M.tiny_qwen2_moe_dca_config(), "model_type": "qwen2"})
    with pytest.raises(TypeError, match="config must be a Qwen2MoeDcaConfig"):
        M.Qwen2MoeDcaForCausalLM(Q.Qwen2DcaConfig.from_dict(Q.tiny_qwen2_dca_config()))


# ------------------------------------------------------------------------------ ONNX
@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    model = make_model(seed=0, l_orig=L_ORIG, rope_theta=1e6, norm_topk_prob=True)
    path = tmp_path_factory.mktemp("onnx") / "qwen2_moe_dca.onnx"
    Q.export_onnx(model, path, kv_block_size=BLOCK)
    return model, str(path)


def test_onnx_export_structure(exported):
    """One DualChunkAttention node per layer and its function; the routed experts as standard ops
    (the dense form: TopK and ScatterElements, no loop over experts)."""
    model, path = exported
    dca_onnx.register_schema()
    onnx.checker.check_model(path, full_check=True)
    proto = onnx.load(path)
    layers = model.config.num_hidden_layers
    assert [n.op_type for n in proto.graph.node if n.domain == dca_onnx.DOMAIN] == [dca_onnx.OP_TYPE] * layers
    assert {n.domain for n in proto.graph.node} <= {"", dca_onnx.DOMAIN}
    ops = [n.op_type for n in proto.graph.node]
    assert ops.count("TopK") == layers and "Loop" not in ops and "If" not in ops
    assert [i.name for i in proto.graph.input] == [*Q.GRAPH_INPUTS, *model.cache_names("past")]


def test_onnx_runtime_generation_equals_pytorch(exported):
    model, path = exported
    prompts = [random_ids(PROMPT, seed=10), random_ids(45, seed=11)]
    kw = dict(prefill=[9, 24, 50], kv_block_size=BLOCK, seed=3, cache_fill=math.nan)
    want = Q.generate(model, prompts, NEW, **kw)
    got = Q.generate(model, prompts, NEW, forward=Q.ort_forward(path), **kw)
    assert got.plans == want.plans and got.block_tables == want.block_tables
    for i in range(2):
        assert got.tokens[i] == want.tokens[i]
        err = float((got.logits[i] - want.logits[i]).abs().max())
        assert err <= PAGED_ATOL, (i, err)
    assert len(set(want.tokens[0])) >= 8
