"""The Qwen2 Dual Chunk Attention model on the serving runtime: the same PagedRuntime, backends,
engine (continuous batching, KV on demand, preemption by recompute) and `generate` as DASH
models, giving the tokens of the cache-free reference (dash_trt.models.qwen2_dca.reference_generate).
Also ONNX Runtime through the runtime's functional backend; prefix caching between prompts of the
same length scale; no page rules (the model has no pages)."""

from __future__ import annotations

import random

import pytest

from dash_trt.attention.dca.reference import DcaConfigError
from dash_trt.models import qwen2_dca as Q
from dash_trt.serving.engine import EngineConfig, GenerationEngine, RequestError
from dash_trt.serving.generate import generate
from dash_trt.serving.runner import PagedRuntime

# Small steps on a 2-core machine run several times faster single-threaded (conftest.py).
pytestmark = pytest.mark.usefixtures("single_thread")


def _model(scaled: bool, seed: int = 1) -> Q.Qwen2DcaForCausalLM:
    overrides = {"rope_theta": 1e6}
    if scaled:  # s(L) > 1 from 17 tokens on
        overrides["dual_chunk_attention_config"] = {
            "chunk_size": 32,
            "local_size": 8,
            "original_max_position_embeddings": 16,
        }
    cfg = Q.Qwen2DcaConfig.from_dict(Q.tiny_qwen2_dca_config(**overrides))
    return Q.init_random_weights(Q.Qwen2DcaForCausalLM(cfg), seed=seed)


def _prompts(cfg, lengths, seed=0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(cfg.vocab_size) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module", params=[False, True], ids=["unscaled", "scaled"])
def setup(request):
    model = _model(request.param)
    prompts = _prompts(model.config, (70, 9, 33, 48))
    return model, prompts, Q.reference_generate(model, prompts, 40).tokens


@pytest.mark.parametrize("chunk", [None, 16, 24])
def test_serving_generate_equals_the_reference(setup, chunk):
    model, prompts, want = setup
    out = generate(model, prompts, 40, kv_block_size=8, prefill_chunk=chunk, stop_at_eos=False)
    assert out.tokens == want


def test_the_engine_with_preemption_equals_the_reference(setup):
    """A pool too small for every sequence's growth: requests are preempted and recomputed; the
    engine's invariants hold before and after every step."""
    model, prompts, want = setup
    engine = GenerationEngine(
        model, EngineConfig(num_blocks=30, kv_block_size=8, prefill_chunk=16, max_batch_tokens=40)
    )
    run = engine._run

    def checked(plan):
        assert engine.check_invariants(plan) == []
        run(plan)
        assert engine.check_invariants() == []

    engine._run = checked
    assert engine.generate(prompts, 40, stop_at_eos=False) == want
    assert engine.counters["preempted"] > 0
    pool = engine.runtime.pool
    assert pool.num_free_blocks == pool.num_blocks and not pool.seq_ids


def test_seeded_sampling_in_a_batch_equals_alone(setup):
    model, prompts, _ = setup
    sampling = {"temperature": 0.9, "top_k": 20, "seed": 11}

    def run(ps, blocks):
        engine = GenerationEngine(model, EngineConfig(num_blocks=blocks, kv_block_size=8, max_batch_tokens=48))
        return engine.generate(ps, 24, stop_at_eos=False, sampling=sampling)

    together = run(prompts, 24)
    assert together == [run([p], 64)[0] for p in prompts]


def test_onnx_runtime_through_the_runtime_s_functional_backend(tmp_path):
    model = _model(True)
    prompts = _prompts(model.config, (45, 12), seed=3)
    path = Q.export_onnx(model, tmp_path / "dca.onnx", kv_block_size=8)
    out = generate(
        model, prompts, 16, kv_block_size=8, prefill_chunk=16, stop_at_eos=False, forward=Q.ort_forward(path)
    )
    assert out.tokens == Q.reference_generate(model, prompts, 16).tokens


def test_prefix_caching_shares_blocks_written_with_the_same_length_scale():
    """Questions over one shared document: with the same length scale s(P) (scaling off, or prompts
    of one length) their whole document blocks are shared; prompts whose scales differ share
    nothing (their cached keys differ). Every answer equals the cache-free reference."""
    for scaled, lengths in ((False, (0, 5, 9)), (True, (4, 4, 4)), (True, (0, 5, 9))):
        model = _model(scaled)
        doc = _prompts(model.config, (60,), seed=8)[0]
        prompts = [doc + q for q in _prompts(model.config, [3 + n for n in lengths], seed=9)]
        want = Q.reference_generate(model, prompts, 10).tokens
        engine = GenerationEngine(model, EngineConfig(num_blocks=64, kv_block_size=8, prefix_caching=True))
        assert engine.runtime.prefix_caching
        first = engine.generate(prompts[:1], 10, stop_at_eos=False)  # the document's blocks registered
        rest = engine.generate(prompts[1:], 10, stop_at_eos=False)
        assert first + rest == want, (scaled, lengths)
        scales = {model.config.dca.length_scale(len(p)) for p in prompts}
        cached = engine.counters["prompt_tokens_cached"]
        if len(scales) == 1:
            assert cached == 2 * 56, (scaled, lengths, cached)  # 7 whole blocks of the document, twice
        else:
            assert cached == 0, (scaled, lengths, scales)


def test_what_a_text_model_does_not_have():
    model = _model(False)
    rt = PagedRuntime(model, 16, 8, prefix_caching=True)
    assert rt.kernels_reason is not None
    engine = GenerationEngine(model, EngineConfig(num_blocks=16, kv_block_size=8))
    with pytest.raises(RequestError, match="needs document pages"):
        engine.submit([1, 2, 3], 4, rules={"page_guard": True})
    with pytest.raises(RequestError, match="takes no image_features"):
        engine.submit([1, 2, 3], 4, image_features=[[0.0]])
    with pytest.raises(RequestError, match="at least one token"):
        engine.submit([], 4)
    with pytest.raises(DcaConfigError, match="multiple of the KV block size"):
        PagedRuntime(model, 16, 5)


# ------------------------------------------------------------------ served by Triton
@pytest.mark.triton
def test_triton_serves_a_dca_folder_like_offline_generation(tmp_path):
    """`dash-triton write` on a Hugging Face folder with dual_chunk_attention_config, then the real
    Triton server: HTTP and gRPC streaming answer with the reference's tokens."""
    import subprocess
    import sys

    from conftest import running_triton

    from dash_trt.triton import client as C

    folder = tmp_path / "qwen2-dca"
    Q.write_tiny_qwen2_dca(
        folder,
        seed=4,
        rope_theta=1e6,
        dual_chunk_attention_config={"chunk_size": 32, "local_size": 8, "original_max_position_embeddings": 16},
    )
    model = Q.load_qwen2_dca(folder)
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
    assert (repo / "dash" / "1" / "checkpoint" / "config.json").is_file()
    with running_triton(repo, tmp_path / "tritonserver.log") as srv:
        with C.DashClient(srv.http_url, protocol="http") as http, C.DashClient(srv.grpc_url, protocol="grpc") as grpc:
            for p, w in zip(prompts, want):
                assert http.generate(p, 12, stop_at_eos=False).tokens == w
                assert grpc.stream(p, 12, stop_at_eos=False).tokens == w
            stats = http.stats()
            assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["running"] == 0
