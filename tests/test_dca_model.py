"""Qwen2 with Dual Chunk Attention (dash_trt.models.qwen2_dca): the reference form against a dense
causal Qwen2 written here from the Hugging Face formulas; greedy generation over the paged cache
(chunked prefill at several split points, then decode, shuffled block tables, NaN in every
unwritten slot) against greedy over the reference recomputed at every step, with the length
scaling off and on; the Hugging Face folder round trip and refusals; the ONNX export run by ONNX
Runtime step by step against the PyTorch paged generation."""

import json
import math
import os

import numpy as np
import onnx
import pytest
import torch
from safetensors.torch import load_file, save_file

from dash_trt.attention.dash.paged import BatchHost, DashBatch
from dash_trt.attention.dca import onnx as dca_onnx
from dash_trt.attention.dca.reference import DcaConfigError, length_scale
from dash_trt.models import qwen2_dca as Q
from dash_trt.models.checkpoint import CheckpointError
from dash_trt.models.loader import load_model
from dash_trt.models.qwen2_dca.model import _chunks
from dash_trt.serving.block_pool import KVBlockPool

CHUNK, LOCAL = 32, 8
C = CHUNK - LOCAL  # the chunk length c = 24
BLOCK = 8  # KV block size (divides c)
#: original_max_position_embeddings of the scaled model: s(70) = 1.148, s(109) = 1.192
L_ORIG = 16
PROMPT, NEW = 70, 40  # 70 + 40 - 1 = 109 cached positions: chunks 0..4 (boundaries 24, 48, 72, 96)
#: float32 model (attention in float32, RoPE angles in float64) against the float64 dense Qwen2,
#: relative to the logits' scale; the largest error seen was 3e-7 of the largest |logit|
DENSE_RTOL = 1e-5
#: paged (chunked, cached) against reference (whole sequence) logits, both float32: the same
#: arithmetic, the projections' sums over other row counts; the largest difference seen was 2e-6
PAGED_ATOL = 1e-4


# Small steps on a 2-core machine run several times faster single-threaded (conftest.py).
pytestmark = pytest.mark.usefixtures("single_thread")


def dca_section(l_orig: int = 0) -> dict:
    return {"chunk_size": CHUNK, "local_size": LOCAL, "original_max_position_embeddings": l_orig}


def make_model(seed: int = 0, l_orig: int = 0, **overrides) -> Q.Qwen2DcaForCausalLM:
    """A tiny random model (Q.tiny_qwen2_dca_config) with chunk_size 32, local_size 8 and
    original_max_position_embeddings ``l_orig``."""
    raw = Q.tiny_qwen2_dca_config(dual_chunk_attention_config=dca_section(l_orig), **overrides)
    return Q.init_random_weights(Q.Qwen2DcaForCausalLM(Q.Qwen2DcaConfig.from_dict(raw)), seed).eval()


def random_ids(n: int, seed: int, vocab: int = 96) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ------------------------------------------------------------------- dense Qwen2 (float64)
def gated_mlp64(w: dict, prefix: str, h: torch.Tensor) -> torch.Tensor:
    """Qwen2's SiLU-gated MLP ``{prefix}{gate,up,down}_proj`` in float64."""
    gate, up = h @ w[prefix + "gate_proj.weight"].T, h @ w[prefix + "up_proj.weight"].T
    return (torch.nn.functional.silu(gate) * up) @ w[prefix + "down_proj.weight"].T


def dense_qwen2_logits(state: dict, config: dict, ids: list[int], ffn=None) -> torch.Tensor:
    """Hugging Face Qwen2 without DCA, written from its formulas: float64, causal softmax
    attention with standard (rotate-half) RoPE at absolute positions, q/k/v bias, grouped KV
    heads repeated, SiLU-gated MLP, RMSNorm. ``ffn(w, layer, h)`` replaces the MLP (Qwen2-MoE's
    block, tests/test_dca_moe.py)."""
    w = {k: v.double() for k, v in state.items()}
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    d = config.get("head_dim") or config["hidden_size"] // heads
    eps, theta = config["rms_norm_eps"], config["rope_theta"]

    def norm(x, weight):
        return weight * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))

    n = len(ids)
    inv_freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = torch.arange(n, dtype=torch.float64)[:, None] * inv_freq[None, :]  # [S, D/2]
    cos = torch.cat([angle.cos(), angle.cos()], -1)[:, None, :]
    sin = torch.cat([angle.sin(), angle.sin()], -1)[:, None, :]

    def rope(x):  # x [S, heads, D]; rotate_half(x) = (-x2, x1)
        half = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
        return x * cos + half * sin

    x = w["model.embed_tokens.weight"][torch.tensor(ids)]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = norm(x, w[p + "input_layernorm.weight"])
        q = (h @ w[p + "self_attn.q_proj.weight"].T + w[p + "self_attn.q_proj.bias"]).view(n, heads, d)
        k = (h @ w[p + "self_attn.k_proj.weight"].T + w[p + "self_attn.k_proj.bias"]).view(n, kv_heads, d)
        v = (h @ w[p + "self_attn.v_proj.weight"].T + w[p + "self_attn.v_proj.bias"]).view(n, kv_heads, d)
        q, k = rope(q), rope(k)
        k = k.repeat_interleave(heads // kv_heads, dim=1)  # query head j reads KV head j // group
        v = v.repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
        probs = scores.masked_fill(~causal, -math.inf).softmax(-1)
        attn = torch.einsum("hqk,khd->qhd", probs, v).reshape(n, heads * d)
        x = x + attn @ w[p + "self_attn.o_proj.weight"].T
        h = norm(x, w[p + "post_attention_layernorm.weight"])
        x = x + (ffn(w, i, h) if ffn is not None else gated_mlp64(w, p + "mlp.", h))
    head = w["model.embed_tokens.weight"] if config.get("tie_word_embeddings") else w["lm_head.weight"]
    return norm(x, w["model.norm.weight"]) @ head.T


DENSE_CONFIGS = {
    # untied, 4 query heads over 2 KV heads of dim 16 (hidden // heads), base 1e4, no scaling
    "kv2": dict(),
    # tied embeddings, 4 query heads over 1 KV head, head_dim 24 given (not hidden // heads),
    # base 1e6, length scaling on but L_orig = 64 >= every length here, so s = 1 exactly
    "tied-kv1-hd24": dict(tie_word_embeddings=True, num_key_value_heads=1, head_dim=24, rope_theta=1e6, l_orig=64),
}


@pytest.mark.parametrize("name", list(DENSE_CONFIGS))
def test_reference_is_dense_qwen2_within_a_chunk(name):
    """Up to c tokens (and, more precisely, up to min(c + W + 1, 2c) = 33), DCA is dense causal
    attention with standard RoPE: the reference logits equal the float64 dense Qwen2; at the
    34th token the last row differs."""
    over = dict(DENSE_CONFIGS[name])
    model = make_model(seed=3, **over)
    raw = model.config.to_dict()
    state = model.state_dict()
    exact = min(C + LOCAL + 1, 2 * C)
    assert exact == 33
    for n in (1, 7, C, exact):
        ids = random_ids(n, seed=n)
        want = dense_qwen2_logits(state, raw, ids)
        got = model.reference_logits(ids)
        assert got.dtype == torch.float32 and got.shape == (n, 96)
        scale = float(want.abs().max())
        err = float((got.double() - want).abs().max())
        assert err <= DENSE_RTOL * scale, (n, err, scale)
    ids = random_ids(exact + 1, seed=99)
    want = dense_qwen2_logits(state, raw, ids)
    got = model.reference_logits(ids).double()
    scale = float(want.abs().max())
    assert float((got[:exact] - want[:exact]).abs().max()) <= DENSE_RTOL * scale
    assert float((got[exact] - want[exact]).abs().max()) > 1e-2 * scale  # the successive rotation saturates


# ------------------------------------------------------------------------- generation
@pytest.fixture(scope="module", params=[0, L_ORIG], ids=["unscaled", "scaled"])
def case(request):
    """A model (scaling off or on; RoPE base 1e6, not the default), two prompts and the reference
    greedy generation of each."""
    model = make_model(seed=0, l_orig=request.param, rope_theta=1e6)
    prompts = [random_ids(PROMPT, seed=10), random_ids(45, seed=11)]
    ref = Q.reference_generate(model, prompts, NEW)
    return model, prompts, ref


def _check_against_reference(gen, ref, which):
    for i, j in enumerate(which):
        assert gen.tokens[i] == ref.tokens[j], f"prompt {j}: paged {gen.tokens[i]} != reference {ref.tokens[j]}"
        assert bool(torch.isfinite(gen.logits[i]).all())  # no NaN slot was read
        err = float((gen.logits[i] - ref.logits[j]).abs().max())
        assert err <= PAGED_ATOL, (j, err)


SPLITS = {
    "one-shot": None,
    "chunks-of-32": 32,
    "at-chunk-boundaries": [1, 5, 23, 24, 25, 47, 48, 49, 69],
    "chunks-of-7": 7,
}


@pytest.mark.parametrize("split", list(SPLITS))
def test_paged_generation_equals_reference_greedy(case, split):
    model, prompts, ref = case
    gen = Q.generate(model, prompts[:1], NEW, prefill=SPLITS[split], kv_block_size=BLOCK, seed=5, cache_fill=math.nan)
    _check_against_reference(gen, ref, [0])
    # the test means something: varied tokens, decode across chunk boundaries, scattered blocks
    assert len(set(ref.tokens[0])) >= 8
    assert (PROMPT + NEW - 1) // C >= 4
    table = gen.block_tables[0]
    assert len(table) == -(-(PROMPT + NEW - 1) // BLOCK)
    assert any(b != a + 1 for a, b in zip(table, table[1:]))
    n_prefill = len(_chunks(PROMPT, SPLITS[split]))
    assert [p[0][1] for p in gen.plans] == _chunks(PROMPT, SPLITS[split]) + [1] * (NEW - 1)
    assert len(gen.plans) == n_prefill + NEW - 1


def test_ragged_batch_generation_equals_reference_greedy(case):
    """Two prompts in one batch: prefill chunks of one beside decode tokens of the other, blocks
    given back by the shorter one and reused by the longer one (their stale keys must not be read)."""
    model, prompts, ref = case
    gen = Q.generate(model, prompts, NEW, prefill=16, kv_block_size=BLOCK, seed=7, cache_fill=math.nan)
    _check_against_reference(gen, ref, [0, 1])
    mixed = [p for p in gen.plans if len(p) == 2 and sorted(n for _, n in p) == [1, 16]]
    assert mixed, "no step mixed a prefill chunk with a decode token"
    # the shorter sequence stops early at an end id, and its blocks go to the longer one: a pool
    # too small to hold both sequences whole
    k = next(k for k in range(3, NEW) if ref.tokens[1][k] not in ref.tokens[0] + ref.tokens[1][:k])
    eos = ref.tokens[1][k]
    held = -(-(45 + k) // BLOCK) + -(-(PROMPT + k) // BLOCK)  # both, when the shorter one ends
    num_blocks = max(held, -(-(PROMPT + NEW - 1) // BLOCK))
    assert num_blocks < sum(-(-(n + NEW - 1) // BLOCK) for n in (PROMPT, 45))
    kw = dict(prefill=[20], kv_block_size=BLOCK, num_blocks=num_blocks, eos_token_id=eos, cache_fill=math.nan)
    gen = Q.generate(model, prompts, NEW, **kw)
    assert gen.tokens[1] == ref.tokens[1][: k + 1]
    torch.testing.assert_close(gen.logits[1], ref.logits[1][: k + 1], atol=PAGED_ATOL, rtol=0)
    assert gen.tokens[0] == ref.tokens[0]
    torch.testing.assert_close(gen.logits[0], ref.logits[0], atol=PAGED_ATOL, rtol=0)
    assert set(gen.block_tables[0]) & set(gen.block_tables[1])


def test_scaling_is_visible():
    """With L_orig = 16 the logits are not the unscaled model's, and a decode step is not a
    one-shot recompute (keys keep the scale they were written with); the first generated token's
    logits are a one-shot prefill's (every prompt token scaled by s(P))."""
    scaled, plain = make_model(seed=0, l_orig=L_ORIG), make_model(seed=0)
    assert length_scale(PROMPT, L_ORIG) > 1.14
    prompt = random_ids(PROMPT, seed=10)
    gen = Q.generate(scaled, [prompt], 6, prefill=32, kv_block_size=BLOCK)
    base = Q.generate(plain, [prompt], 6, prefill=32, kv_block_size=BLOCK)
    assert float((gen.logits[0] - base.logits[0]).abs().max()) > 0.1
    one_shot = scaled.reference_logits(prompt)[-1]
    assert float((gen.logits[0][0] - one_shot).abs().max()) <= PAGED_ATOL
    seq = prompt + gen.tokens[0][:-1]
    recompute = scaled.reference_logits(seq)[-1]
    assert float((gen.logits[0][-1] - recompute).abs().max()) > 1e-3


def test_forward_paged_on_block_pool_batches():
    """forward_paged takes the serving pool's DashBatch: a prefill chunk of one sequence beside
    another's whole prompt, then a decode step of both; the rows asked for equal the reference."""
    model = make_model(seed=1, l_orig=L_ORIG)
    pool = KVBlockPool(24, BLOCK)
    caches = model.allocate_cache(24, BLOCK, fill=math.nan)
    a, b = random_ids(50, seed=1), random_ids(30, seed=2)
    pool.add("a", prompt_length=len(a))
    pool.add("b", prompt_length=len(b))
    batch = pool.schedule([("a", 40), ("b", 30)])
    ids = torch.tensor(a[:40] + b, dtype=torch.long)
    got = model.forward_paged(ids, None, batch, caches, torch.tensor([39, 69, 0]))
    torch.testing.assert_close(got[0], model.reference_logits(a[:40], prompt_len=len(a))[-1], atol=PAGED_ATOL, rtol=0)
    torch.testing.assert_close(got[1], model.reference_logits(b)[-1], atol=PAGED_ATOL, rtol=0)
    torch.testing.assert_close(got[2], model.reference_logits(a[:1], prompt_len=len(a))[0], atol=PAGED_ATOL, rtol=0)
    batch = pool.schedule([("a", 10), ("b", 1)])
    ids = torch.tensor(a[40:] + [7], dtype=torch.long)
    got = model.forward_paged(ids, None, batch, caches, torch.tensor([9, 10]))
    torch.testing.assert_close(got[0], model.reference_logits(a)[-1], atol=PAGED_ATOL, rtol=0)
    torch.testing.assert_close(got[1], model.reference_logits(b + [7], prompt_len=len(b))[-1], atol=PAGED_ATOL, rtol=0)
    host = batch.host
    again = DashBatch.from_host(BatchHost(host.block_tables, host.seq_lens, host.query_start_loc, host.prompt_lens))
    assert again.num_seqs == 2


def test_generation_refusals():
    model = make_model()
    with pytest.raises(DcaConfigError, match="multiple of the KV block size 5"):
        Q.generate(model, [[1, 2, 3]], 2, kv_block_size=5)
    with pytest.raises(RuntimeError, match="KV pool is full"):
        Q.generate(model, [random_ids(40, 0)], 10, kv_block_size=BLOCK, num_blocks=4)
    with pytest.raises(ValueError, match="non-empty prompt"):
        Q.generate(model, [[]], 2)
    with pytest.raises(ValueError, match="split points"):
        Q.generate(model, [[1, 2, 3, 4]], 2, prefill=[3, 2])
    with pytest.raises(ValueError, match="expected 2 layer caches"):
        model.forward_paged(torch.tensor([1]), None, None, [])


# ------------------------------------------------------------------------- checkpoints
def expected_names(layers: int, tied: bool) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"} | (set() if tied else {"lm_head.weight"})
    for i in range(layers):
        p = f"model.layers.{i}."
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        names |= {p + f"self_attn.{x}_proj.{y}" for x in "qkv" for y in ("weight", "bias")}
        names |= {p + "self_attn.o_proj.weight"}
        names |= {p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
    return names


@pytest.mark.parametrize("tied", [False, True])
def test_hf_folder_round_trip(tmp_path, tied):
    folder = tmp_path / "tiny"
    files = Q.write_tiny_qwen2_dca(
        folder, seed=4, tie_word_embeddings=tied, dual_chunk_attention_config=dca_section(20)
    )
    assert sorted(files) == ["config.json", "model.safetensors"]
    stored = load_file(folder / "model.safetensors")
    assert set(stored) == expected_names(2, tied)
    assert "model.layers.0.self_attn.o_proj.bias" not in stored
    raw = json.loads((folder / "config.json").read_text())
    assert raw["dual_chunk_attention_config"] == dca_section(20)
    assert raw["architectures"] == ["Qwen2ForCausalLM"] and raw["model_type"] == "qwen2"
    loaded = Q.load_qwen2_dca(folder)
    assert loaded.config == Q.Qwen2DcaConfig.from_model_config(folder)
    assert loaded.config.dca.original_max_position_embeddings == 20
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tied
    same = make_model(seed=4, l_orig=20, tie_word_embeddings=tied)
    ids = random_ids(60, seed=3)
    assert torch.equal(loaded.reference_logits(ids), same.reference_logits(ids))
    # another dtype on request, or from config.json's torch_dtype
    half = Q.load_qwen2_dca(folder, dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16
    assert float((half.reference_logits(ids[:10]) - same.reference_logits(ids[:10])).abs().max()) < 0.5
    # the folder written again from the loaded model reads back the same
    Q.save_qwen2_dca(loaded, tmp_path / "again")
    assert torch.equal(Q.load_qwen2_dca(tmp_path / "again").reference_logits(ids), same.reference_logits(ids))


def test_sharded_folder_and_ignored_tensors(tmp_path):
    """Shards listed by model.safetensors.index.json are read; a stored RoPE table is ignored."""
    src = tmp_path / "one"
    Q.write_tiny_qwen2_dca(src, seed=2)
    state = load_file(src / "model.safetensors")
    folder = tmp_path / "sharded"
    folder.mkdir()
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    halves["model-00002-of-00002.safetensors"].append("model.layers.0.self_attn.rotary_emb.inv_freq")
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    for fname, keys in halves.items():
        save_file({k: state[k] for k in keys}, folder / fname)
    index = {"weight_map": {k: f for f, keys in halves.items() for k in keys}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "config.json").write_text((src / "config.json").read_text())
    ids = random_ids(30, seed=8)
    assert torch.equal(Q.load_qwen2_dca(folder).reference_logits(ids), Q.load_qwen2_dca(src).reference_logits(ids))


BAD_CONFIGS = [
    ({"dual_chunk_attention_config": None}, "not a Dual Chunk Attention model"),
    ({"dual_chunk_attention_config": {"local_size": 8}}, r"missing required key\(s\): chunk_size"),
    ({"dual_chunk_attention_config": {"chunk_size": 8, "local_size": 8}}, "must be smaller than chunk_size"),
    ({"dual_chunk_attention_config": {**dca_section(), "sparse_attention_enabled": True}}, "sparse"),
    (
        {"dual_chunk_attention_config": {**dca_section(), "sparse_attention_config": [{}]}},
        "no sparse_attention_enabled",
    ),
    ({"dual_chunk_attention_config": {**dca_section(), "original_max_position_embeddings": -1}}, "non-negative"),
    ({"hidden_size": None}, "missing the required key 'hidden_size'"),
    ({"vocab_size": "96"}, "'vocab_size' must be a positive int, got '96'"),
    ({"num_hidden_layers": 0}, "'num_hidden_layers' must be a positive int"),
    ({"intermediate_size": True}, "'intermediate_size' must be a positive int"),
    ({"num_key_value_heads": 3}, r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"),
    ({"hidden_size": 66}, r"hidden_size \(66\) is not a multiple of num_attention_heads \(4\)"),
    ({"head_dim": 15}, "head_dim must be even"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_scaling .* cannot be combined with Dual Chunk"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn' cannot be combined"),
    ({"rope_theta": 0}, "'rope_theta' must be a positive finite number"),
    ({"rope_parameters": {"rope_theta": 1e6}}, r"rope_theta \(10000.0\) and rope_parameters.rope_theta"),
    ({"use_sliding_window": True}, "sliding-window attention is not implemented"),
    ({"model_type": "llama"}, "model_type is 'llama'"),
    ({"hidden_act": "gelu"}, "hidden_act must be 'silu'"),
    ({"torch_dtype": "int8"}, "torch_dtype must be one of"),
    ({"rms_norm_eps": -1e-6}, "'rms_norm_eps' must be a positive finite number"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings must be true or false"),
    ({"eos_token_id": -3}, "eos_token_id must be a non-negative int"),
]


@pytest.mark.parametrize("overrides, message", BAD_CONFIGS, ids=[m[:40] for _, m in BAD_CONFIGS])
def test_bad_configs_refused(tmp_path, overrides, message):
    raw = Q.tiny_qwen2_dca_config(**overrides)
    raw = {k: v for k, v in raw.items() if v is not None}
    with pytest.raises(DcaConfigError, match=message):
        Q.Qwen2DcaConfig.from_dict(raw)
    # the same from a folder: the loader refuses it before reading any weight
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(DcaConfigError, match=message):
        Q.load_qwen2_dca(tmp_path)


def test_config_defaults_and_newer_rope_parameters():
    raw = Q.tiny_qwen2_dca_config()
    for key in ("num_key_value_heads", "rms_norm_eps", "rope_theta", "tie_word_embeddings", "torch_dtype"):
        del raw[key]
    cfg = Q.Qwen2DcaConfig.from_dict({**raw, "eos_token_id": [95, 7]})
    assert (cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps, cfg.rope_theta) == (4, 16, 1e-6, 10000.0)
    assert (cfg.tie_word_embeddings, cfg.dtype, cfg.eos_token_id) == (False, torch.float32, 95)
    cfg = Q.Qwen2DcaConfig.from_dict({**raw, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    assert cfg.rope_theta == 1e6
    assert Q.Qwen2DcaForCausalLM(cfg).dca_attributes["rope_theta"] == 1e6


def test_bad_folders_refused(tmp_path):
    with pytest.raises(CheckpointError, match="model folder not found"):
        Q.load_qwen2_dca(tmp_path / "nowhere")
    with pytest.raises(DcaConfigError, match="model config not found"):
        Q.load_qwen2_dca(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(DcaConfigError, match="is not valid JSON"):
        Q.load_qwen2_dca(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(Q.tiny_qwen2_dca_config()))
    with pytest.raises(CheckpointError, match="has no model.safetensors"):
        Q.load_qwen2_dca(tmp_path)
    good = tmp_path / "good"
    Q.write_tiny_qwen2_dca(good)
    state = load_file(good / "model.safetensors")

    def broken(edit, message, **config):
        folder = tmp_path / f"bad{len(os.listdir(tmp_path))}"
        Q.write_tiny_qwen2_dca(folder, **config)
        s = dict(load_file(folder / "model.safetensors"))
        edit(s)
        save_file(s, folder / "model.safetensors")
        with pytest.raises(CheckpointError, match=message):
            Q.load_qwen2_dca(folder)

    broken(lambda s: s.pop("model.layers.1.mlp.up_proj.weight"), "missing model.layers.1.mlp.up_proj.weight")
    broken(lambda s: s.update(extra=torch.zeros(2)), "unexpected extra")
    broken(lambda s: s.pop("model.layers.0.self_attn.q_proj.bias"), "missing model.layers.0.self_attn.q_proj.bias")
    wrong = {"model.layers.0.self_attn.k_proj.weight": state["model.layers.0.self_attn.q_proj.weight"]}
    broken(lambda s: s.update(wrong), r"k_proj.weight is \[64, 64\], expected \[32, 64\]")
    other = torch.zeros_like(state["model.embed_tokens.weight"])
    broken(lambda s: s.update({"lm_head.weight": other}), "lm_head.weight differs", tie_word_embeddings=True)


#: An illustrative sparse attention config (upstream reads one entry per layer: head -> pattern).
SPARSE = [{"0": ["vertical_and_slash", 1000, 6096, 0.9]}, {"0": ["vertical_and_slash", 1000, 6096, 0.9]}]


def test_sparse_attention_config_json_is_refused_unless_switched_off(tmp_path):
    """A folder with sparse_attention_config.json (vLLM and SGLang would run sparse prefill above
    32768 tokens) is refused by both loaders, naming the file and the key that runs it dense;
    with "sparse_attention_enabled": false it loads (a warning says the file is ignored) and
    generates the dense model's tokens. The section's own sparse_attention_config with the key
    false, refused before, loads too."""
    plain = tmp_path / "plain"
    Q.write_tiny_qwen2_dca(plain, seed=2, rope_theta=1e6, dual_chunk_attention_config=dca_section(L_ORIG))
    model = Q.load_qwen2_dca(plain)
    prompt = random_ids(PROMPT, seed=10)
    want = Q.reference_generate(model, [prompt], 12).tokens

    shipped = tmp_path / "shipped"
    Q.write_tiny_qwen2_dca(shipped, seed=2, rope_theta=1e6, dual_chunk_attention_config=dca_section(L_ORIG))
    (shipped / "sparse_attention_config.json").write_text(json.dumps(SPARSE))
    for load in (Q.load_qwen2_dca, load_model):
        with pytest.raises(DcaConfigError) as err:
            load(shipped)
        msg = str(err.value)
        assert msg.startswith(f"{shipped / 'sparse_attention_config.json'}: vLLM and SGLang merge this file"), msg
        assert "dash-trt runs Dual Chunk Attention dense only" in msg
        assert '"sparse_attention_enabled": false in dual_chunk_attention_config of config.json' in msg

    off = {**dca_section(L_ORIG), "sparse_attention_enabled": False}
    raw = json.loads((shipped / "config.json").read_text())
    (shipped / "config.json").write_text(json.dumps({**raw, "dual_chunk_attention_config": off}))
    for load in (Q.load_qwen2_dca, load_model):
        with pytest.warns(UserWarning, match="sparse_attention_config.json is ignored"):
            loaded = load(shipped)
        assert Q.generate(loaded, [prompt], 12, prefill=16, kv_block_size=BLOCK).tokens == want
    assert torch.equal(loaded.reference_logits(prompt), model.reference_logits(prompt))

    inline = tmp_path / "inline"
    section = {**dca_section(L_ORIG), "sparse_attention_enabled": False, "sparse_attention_config": SPARSE}
    Q.write_tiny_qwen2_dca(inline, seed=2, rope_theta=1e6, dual_chunk_attention_config=section)
    loaded = Q.load_qwen2_dca(inline)
    assert loaded.config.to_dict()["dual_chunk_attention_config"]["sparse_attention_enabled"] is False
    assert Q.generate(loaded, [prompt], 12, prefill=16, kv_block_size=BLOCK).tokens == want


# ------------------------------------------------------------------------------ ONNX
@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    model = make_model(seed=0, l_orig=L_ORIG, rope_theta=1e6)
    path = tmp_path_factory.mktemp("onnx") / "qwen2_dca.onnx"
    Q.export_onnx(model, path, kv_block_size=BLOCK)
    return model, str(path)


def test_onnx_export_structure(exported):
    model, path = exported
    dca_onnx.register_schema()
    onnx.checker.check_model(path, full_check=True)
    proto = onnx.load(path)
    nodes = [n for n in proto.graph.node if n.domain == dca_onnx.DOMAIN]
    assert [n.op_type for n in nodes] == [dca_onnx.OP_TYPE] * model.config.num_hidden_layers
    for node in nodes:
        attrs = dca_onnx.node_config(node)
        assert attrs.cfg == model.config.dca and attrs.rope_theta == model.config.rope_theta
        assert attrs.rotary_dim is None and attrs.softmax_scale is None
    assert [(f.domain, f.name) for f in proto.functions] == [(dca_onnx.DOMAIN, dca_onnx.OP_TYPE)]
    assert [i.name for i in proto.graph.input] == [*Q.GRAPH_INPUTS, *model.cache_names("past")]
    assert [o.name for o in proto.graph.output] == ["logits", *model.cache_names("present")]
    # every other node is a standard op
    assert {n.domain for n in proto.graph.node} <= {"", dca_onnx.DOMAIN}


def test_onnx_runtime_generation_equals_pytorch(exported):
    """ONNX Runtime runs the file step by step (its caches fed back), over other token, sequence,
    block and table sizes than the traced ones, and generates the paged model's tokens."""
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


def test_onnx_caches_equal_pytorch_caches(exported):
    """One prefill step of the file and of export_forward: the logits and every present cache."""
    model, path = exported
    run = Q.ort_forward(path)
    caches = [t for c in model.allocate_cache(12, BLOCK) for t in (c.key, c.value)]
    ids = torch.tensor(random_ids(30, seed=4))
    inputs = {
        "input_ids": ids,
        "block_tables": torch.tensor([[7, 2, 9, 0]], dtype=torch.int32),
        "seq_lens": torch.tensor([30], dtype=torch.int32),
        "query_start_loc": torch.tensor([0, 30], dtype=torch.int32),
        "prompt_lens": torch.tensor([30], dtype=torch.int32),
        "logits_indices": torch.tensor([29, 3]),
    }
    with torch.no_grad():
        want = model.export_forward(*inputs.values(), *caches)
    logits, new = run(inputs, caches)
    torch.testing.assert_close(logits, want[0], atol=PAGED_ATOL, rtol=0)
    for a, b in zip(new, want[1:]):
        torch.testing.assert_close(torch.from_numpy(np.asarray(a)), b, atol=1e-5, rtol=1e-5)
    assert all(float(c.abs().max()) == 0 for c in caches)  # the functional form wrote no input
