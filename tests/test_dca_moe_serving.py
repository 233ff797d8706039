"""The Qwen2-MoE Dual Chunk Attention model on the serving runtime, as tests/test_dca_serving.py
runs the Qwen2 one: the same PagedRuntime, engine (continuous batching, KV on demand, preemption
by recompute) and `generate`, giving the tokens of the cache-free reference; ONNX Runtime through
the runtime's functional backend; prefix caching; `dash-triton write` on a Qwen2-MoE folder and
the real Triton server answering with the offline tokens."""

from __future__ import annotations

import random

import pytest

from dash_trt.models import qwen2_dca as Q
from dash_trt.models.qwen2_dca import moe as M
from dash_trt.models.qwen2_dca.load import load_dca
from dash_trt.serving.engine import EngineConfig, GenerationEngine
from dash_trt.serving.generate import generate

pytestmark = pytest.mark.usefixtures("single_thread")

#: s(L) > 1 from 17 tokens on
DCA = {"chunk_size": 32, "local_size": 8, "original_max_position_embeddings": 16}


def _model(seed: int = 3, **overrides) -> M.Qwen2MoeDcaForCausalLM:
    raw = M.tiny_qwen2_moe_dca_config(rope_theta=1e6, dual_chunk_attention_config=DCA, **overrides)
    return Q.init_random_weights(M.Qwen2MoeDcaForCausalLM(M.Qwen2MoeDcaConfig.from_dict(raw)), seed=seed)


def _prompts(cfg, lengths, seed=0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(cfg.vocab_size) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def setup():
    """Layer 1 of 3 dense (mlp_only_layers), the others sparse with renormalised top-2 of 8."""
    model = _model(num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=True)
    prompts = _prompts(model.config, (70, 9, 33, 48))
    return model, prompts, Q.reference_generate(model, prompts, 24).tokens


@pytest.mark.parametrize("chunk", [None, 16])
def test_serving_generate_equals_the_reference(setup, chunk):
    model, prompts, want = setup
    out = generate(model, prompts, 24, kv_block_size=8, prefill_chunk=chunk, stop_at_eos=False)
    assert out.tokens == want
    assert min(len(set(t)) for t in want) >= 6


def test_the_engine_with_preemption_equals_the_reference(setup):
    model, prompts, want = setup
    engine = GenerationEngine(
        model, EngineConfig(num_blocks=24, kv_block_size=8, prefill_chunk=16, max_batch_tokens=40)
    )
    run = engine._run

    def checked(plan):
        assert engine.check_invariants(plan) == []
        run(plan)
        assert engine.check_invariants() == []

    engine._run = checked
    assert engine.generate(prompts, 24, stop_at_eos=False) == want
    assert engine.counters["preempted"] > 0
    pool = engine.runtime.pool
    assert pool.num_free_blocks == pool.num_blocks and not pool.seq_ids


def test_onnx_runtime_through_the_runtime_s_functional_backend(setup, tmp_path):
    model, prompts, want = setup
    path = Q.export_onnx(model, tmp_path / "moe.onnx", kv_block_size=8)
    out = generate(
        model, prompts[:2], 24, kv_block_size=8, prefill_chunk=16, stop_at_eos=False, forward=Q.ort_forward(path)
    )
    assert out.tokens == want[:2]


def test_prefix_caching_shares_a_document_s_blocks(setup):
    """Two questions over one document, prompts of one length (one length scale): the second
    reuses the document's whole blocks, and both answers equal the reference."""
    model, _, _ = setup
    doc = _prompts(model.config, (60,), seed=8)[0]
    prompts = [doc + q for q in _prompts(model.config, (5, 5), seed=9)]
    want = Q.reference_generate(model, prompts, 8).tokens
    engine = GenerationEngine(model, EngineConfig(num_blocks=48, kv_block_size=8, prefix_caching=True))
    first = engine.generate(prompts[:1], 8, stop_at_eos=False)
    assert first + engine.generate(prompts[1:], 8, stop_at_eos=False) == want
    assert engine.counters["prompt_tokens_cached"] == 56  # the document's 7 whole blocks


# ------------------------------------------------------------------ served by Triton
@pytest.mark.triton
def test_triton_serves_a_qwen2_moe_dca_folder_like_offline_generation(tmp_path):
    """`dash-triton write` on a Qwen2-MoE folder, then the real Triton server: HTTP and gRPC
    streaming answer with the reference's tokens."""
    import subprocess
    import sys

    from conftest import running_triton

    from dash_trt.triton import client as C

    folder = tmp_path / "qwen2-moe-dca"
    M.write_tiny_qwen2_moe_dca(folder, seed=3, rope_theta=1e6, dual_chunk_attention_config=DCA)
    model = load_dca(folder)
    assert type(model) is M.Qwen2MoeDcaForCausalLM
    prompts = _prompts(model.config, (50, 7), seed=5)
    want = Q.reference_generate(model, prompts, 12).tokens
    repo = tmp_path / "repo"
    res = subprocess.run(
        [sys.executable, "-m", "dash_trt.triton.cli", "write", str(folder), "--out", str(repo)]
        + ["--num-blocks", "32", "--kv-block-size", "8", "--torch-threads", "1"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "Qwen2MoeForCausalLM" in (repo / "dash" / "1" / "checkpoint" / "config.json").read_text()
    with running_triton(repo, tmp_path / "tritonserver.log") as srv:
        with C.DashClient(srv.http_url, protocol="http") as http, C.DashClient(srv.grpc_url, protocol="grpc") as grpc:
            for p, w in zip(prompts, want):
                assert http.generate(p, 12, stop_at_eos=False).tokens == w
                assert grpc.stream(p, 12, stop_at_eos=False).tokens == w
            stats = http.stats()
            assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["running"] == 0
