"""Per-request sampling (dash_trt.serving.sampling) and stop tokens, in the sampler and the engine."""

from __future__ import annotations

import math

import pytest
import torch

from dash_trt import model as M
from dash_trt.serving.engine import EngineConfig, GenerationEngine, RequestError
from dash_trt.serving.sampling import Sampler, SamplingError, SamplingParams

IMAGE = 7


def logits(seed=0, n=50):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"temperature": -1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**63}, "seed"),
        ({"seed": True}, "seed"),
    ],
)
def test_bad_parameters_are_named(kw, match):
    with pytest.raises(SamplingError, match=match):
        SamplingParams(**kw)


def test_same_seed_same_draws_other_seed_other_draws():
    p = SamplingParams(temperature=1.0, seed=5)
    draws = [[Sampler(p, IMAGE).choose(logits(i)) for i in range(40)] for _ in range(2)]
    assert draws[0] == draws[1]
    other = [Sampler(SamplingParams(temperature=1.0, seed=6), IMAGE).choose(logits(i)) for i in range(40)]
    assert other != draws[0]


def test_degenerate_settings_are_the_argmax():
    for i in range(20):
        x = logits(i)
        x[IMAGE] = x.max() + 5  # the image token is never chosen, however likely
        best = int(torch.where(torch.arange(x.numel()) == IMAGE, -math.inf, x).argmax())
        for p in (
            SamplingParams(temperature=1.0, top_k=1, seed=i),
            SamplingParams(temperature=1.0, top_p=1e-6, seed=i),
            SamplingParams(temperature=1e-6, seed=i),
            SamplingParams(),
        ):
            assert Sampler(p, IMAGE).choose(x) == best, p


def test_top_k_and_top_p_keep_only_their_tokens():
    x = torch.tensor([0.0, 3.0, 2.9, -1.0, 2.8, 0.5, -2.0, 9.0])  # 7 is the image token; 1, 2, 4 hold ~90% of the rest
    seen_k = {Sampler(SamplingParams(temperature=1.0, top_k=2, seed=s), IMAGE).choose(x) for s in range(200)}
    assert seen_k == {1, 2}
    seen_p = {Sampler(SamplingParams(temperature=1.0, top_p=0.8, seed=s), IMAGE).choose(x) for s in range(300)}
    assert seen_p == {1, 2, 4}


@pytest.fixture(scope="module")
def engine():
    model = M.demo_model(seed=2)
    return GenerationEngine(
        model, EngineConfig(num_blocks=64, kv_block_size=16, prefill_chunk=48, max_batch_tokens=256)
    )


@pytest.fixture(scope="module")
def prompts(engine):
    cfg = engine.model_config
    return [
        M.document_prompt([30, 20], "what?", cfg),
        M.document_prompt([40], "title", cfg),
        M.document_prompt([9, 9, 9], "", cfg),
    ]


def test_greedy_default_equals_offline_generation(engine, prompts):
    want = M.generate(engine.model, prompts, 10, stop_at_eos=False, kv_block_size=16).tokens
    assert engine.generate(prompts, 10, stop_at_eos=False) == want
    assert engine.generate(prompts, 10, stop_at_eos=False, sampling={"temperature": 0.0, "seed": 3}) == want


def test_a_seeded_request_gets_its_tokens_whatever_runs_beside_it(engine, prompts):
    s = {"temperature": 1.0, "top_p": 0.95, "seed": 11}
    alone = engine.generate(prompts[:1], 12, stop_at_eos=False, sampling=s)[0]
    others = [engine.submit(p, 5 + i, stop_at_eos=False) for i, p in enumerate(prompts[1:])]
    req = engine.submit(prompts[0], 12, stop_at_eos=False, sampling=s)
    engine.run_until_idle()
    assert req.result(timeout=0) == alone and all(r.result(timeout=0) for r in others)
    greedy = engine.generate(prompts[:1], 12, stop_at_eos=False)[0]
    assert alone != greedy  # 12 draws at temperature 1 from a random model: not the argmax path


def test_stop_token_ids_end_the_request(engine, prompts):
    greedy = engine.generate(prompts, 10, stop_at_eos=False)
    stop = greedy[0][3]
    got = engine.generate(prompts[:1], 10, stop_at_eos=False, stop_token_ids=[stop, 0])[0]
    assert got == greedy[0][: greedy[0].index(stop) + 1]


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"stop_token_ids": [10**6]}, "stop_token_ids must be token ids"),
        ({"stop_token_ids": list(range(300))}, "at most 256"),
        ({"stop_token_ids": [1.5]}, "stop_token_ids must be token ids"),
        ({"sampling": {"temperature": -1.0}}, "temperature"),
        ({"sampling": {"temp": 1.0}}, "unknown sampling parameter"),
        ({"sampling": 3}, "sampling must be a dict"),
    ],
)
def test_bad_options_are_refused_before_queueing(engine, prompts, kw, match):
    before = engine.counters["submitted"]
    with pytest.raises(RequestError, match=match):
        engine.submit(prompts[0], 4, **kw)
    assert engine.counters["submitted"] == before
