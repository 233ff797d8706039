"""KV blocks on demand: requests are admitted on their prompt's blocks, grow as they generate,
and under pressure the newest are preempted by recompute; their answers do not change.

Checked here: preempted requests (greedy, seeded sampling, decoding rules, shared prefix-cached
documents) answer exactly as each alone in a large pool, with the engine's invariants after
every step; with ``max_new_tokens`` 8x what requests use, at least 3x as many run at once on
the same pool as with the worst case reserved up front; the runtime's preempt/resume alone;
a drain lets preempted requests finish within its grace."""

from __future__ import annotations

import random

import pytest

from dash_trt import model as M
from dash_trt.serving.engine import UNAVAILABLE, EngineConfig, GenerationEngine
from dash_trt.serving.runner import PagedRuntime
from dash_trt.serving.sampling import SamplingParams

# Small steps on a 2-core machine run several times faster single-threaded (conftest.py).
pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def model():
    return M.demo_model(seed=3)


def _alone(model, prompt, max_new, **options) -> list[int]:
    """The one-request-at-a-time reference: the request alone in a pool that holds it whole."""
    engine = GenerationEngine(model, EngineConfig(num_blocks=256, kv_block_size=16, prefix_caching=False))
    req = engine.submit(prompt, max_new, **options)
    engine.run_until_idle()
    return req.result(0)


def _checked(engine: GenerationEngine) -> list:
    """Check the engine's invariants before every model step (with its plan) and after."""
    plans = []
    run = engine._run

    def checked_run(plan):
        plans.append(plan)
        assert engine.check_invariants(plan) == []
        run(plan)
        assert engine.check_invariants() == []

    engine._run = checked_run
    return plans


def _requests(rng: random.Random, cfg, n: int) -> list[dict]:
    docs = [M.document_prompt([rng.randint(10, 30)], "", cfg, preamble="Doc ") for _ in range(2)]
    out = []
    for i in range(n):
        options: dict = {"stop_at_eos": False}
        kind = i % 3
        if kind == 1:
            options["sampling"] = {"temperature": 0.8, "top_k": 20, "seed": rng.randint(0, 1000)}
        elif kind == 2:
            options["rules"] = {"no_repeat_ngram": 3}
        question = M.document_prompt([1], rng.choice(["Title?", "Who?", "Read it."]), cfg)[-4:]
        out.append({"prompt": rng.choice(docs) + question, "max_new": rng.randint(30, 60), "options": options})
    return out


@pytest.mark.parametrize("seed", range(4))
def test_preempted_requests_answer_as_they_would_alone(model, seed):
    rng = random.Random(seed)
    block_size = 16
    work = _requests(rng, model.config, 6)
    longest = max(len(w["prompt"]) + w["max_new"] - 1 for w in work)
    # A pool that holds every prompt at once but not their growth: preemption is certain.
    config = EngineConfig(
        num_blocks=-(-longest // block_size) + 6,
        kv_block_size=block_size,
        prefill_chunk=rng.choice([16, 32]),
        max_batch_tokens=64,
        max_num_seqs=6,
        prefix_caching=seed % 2 == 0,
    )
    engine = GenerationEngine(model, config)
    plans = _checked(engine)
    reqs = [engine.submit(w["prompt"], w["max_new"], **w["options"]) for w in work]
    engine.run_until_idle()
    assert plans and engine.counters["preempted"] > 0 and engine.counters["tokens_recomputed"] > 0
    for w, r in zip(work, reqs):
        assert r.status == "done", r.error
        assert r.tokens == _alone(model, w["prompt"], w["max_new"], **w["options"]), (w, r.preemptions)
    pool = engine.runtime.pool
    assert pool.num_free_blocks == pool.num_blocks and not pool.seq_ids and engine.check_invariants() == []
    s = engine.stats()
    assert s["running"] == s["waiting"] == 0 and s["kv_blocks_reserved"] == 0
    # every prompt token was computed once at first; recompute is counted apart
    assert s["prompt_tokens_computed"] + s["prompt_tokens_cached"] == sum(len(w["prompt"]) for w in work)


def test_on_demand_runs_three_times_as_many_requests_when_max_tokens_is_8x_the_use(model):
    """Requests that stop after ~16 tokens (a stop id) but ask for 128: on the same pool, the
    worst-case policy runs few at once, on demand at least 3x as many; the same answers."""
    cfg = model.config
    prompts = [M.document_prompt([10], "", cfg, preamble=f"R{i} ")[:16] for i in range(40)]
    stops = []
    for p in prompts:  # a stop id each: the 16th token of its own answer (its first occurrence)
        free = _alone(model, p, 16, stop_at_eos=False)
        stops.append(free[free.index(free[15])])
    expected = [_alone(model, p, 128, stop_at_eos=False, stop_token_ids=[s]) for p, s in zip(prompts, stops)]
    assert all(len(e) <= 16 for e in expected)
    peaks = {}
    for on_demand in (False, True):
        engine = GenerationEngine(
            model,
            EngineConfig(
                num_blocks=72,
                kv_block_size=16,
                max_num_seqs=64,
                max_batch_tokens=1024,
                max_new_tokens_limit=128,
                kv_on_demand=on_demand,
            ),
        )
        _checked(engine)
        reqs = [engine.submit(p, 128, stop_at_eos=False, stop_token_ids=[s]) for p, s in zip(prompts, stops)]
        engine.run_until_idle()
        assert [r.result(0) for r in reqs] == expected
        pool = engine.runtime.pool
        assert pool.num_free_blocks == pool.num_blocks and not pool.seq_ids
        peaks[on_demand] = engine.counters["peak_running"]
    # worst case: ceil((16 + 127) / 16) = 9 blocks each, 8 of them in 72 blocks
    assert peaks[False] == 8
    assert peaks[True] >= 3 * peaks[False], peaks


def test_runtime_preempt_and_resume_give_the_tokens_of_an_uninterrupted_run(model):
    """PagedRuntime alone: a sequence preempted mid-generation (its prompt blocks in the prefix
    cache) and resumed, the cached blocks taken back, continues with the same tokens."""
    cfg = model.config
    prompt = M.document_prompt([40, 20], "Read both pages.", cfg)
    want = _alone(model, prompt, 30, stop_at_eos=False)

    rt = PagedRuntime(model, 64, 16, prefix_caching=True)
    seq = rt.add("a", prompt, len(prompt))
    out = []
    while len(out) < 30:
        n = min(seq.pending, 24)
        tok = rt.step([("a", n)]).tokens.get("a")
        if tok is None:
            continue
        out.append(tok)
        if len(out) in (1, 17):  # preempt after the first token and in mid-decode
            state = rt.preempt("a")
            assert "a" not in rt and not rt.pool.seq_ids and rt.pool.num_free_blocks == 64
            cached = rt.pool.match(state.block_hashes)
            assert len(cached) == len(state.block_hashes) > 0  # the prompt's blocks stayed cached
            seq = rt.resume(state, cached)
            assert seq.fed == len(cached) * 16 and seq.pending == len(prompt) + len(out) - seq.fed
            assert rt.pool.check_invariants() == []
    assert out == want


def test_a_drain_lets_preempted_requests_finish_within_its_grace(model):
    now = {"t": 0.0}
    cfg = model.config
    engine = GenerationEngine(
        model, EngineConfig(num_blocks=10, kv_block_size=16, max_batch_tokens=64), clock=lambda: now["t"]
    )
    prompts = [M.document_prompt([12], "", cfg, preamble=f"D{i} ")[:20] for i in range(3)]
    reqs = [engine.submit(p, 60, stop_at_eos=False) for p in prompts]
    while not engine.counters["preempted"]:
        assert engine.step()
    preempted = [r for r in reqs if r._resume is not None]
    assert preempted and all(r.status == "waiting" for r in preempted)
    late = engine.submit(prompts[0], 4)
    assert engine.drain(grace=100.0) == 1  # only the request that never ran is failed now
    engine.run_until_idle()
    assert late.status == "failed" and late.error_code == UNAVAILABLE
    for r, p in zip(reqs, prompts):
        assert r.result(0) == _alone(model, p, 60, stop_at_eos=False)
    assert engine.runtime.pool.num_free_blocks == 10


def test_when_the_grace_ends_preempted_requests_fail_too(model):
    now = {"t": 0.0}
    engine = GenerationEngine(
        model, EngineConfig(num_blocks=10, kv_block_size=16, max_batch_tokens=64), clock=lambda: now["t"]
    )
    prompts = [M.document_prompt([12], "", model.config, preamble=f"E{i} ")[:20] for i in range(3)]
    reqs = [engine.submit(p, 60, stop_at_eos=False) for p in prompts]
    while not engine.counters["preempted"]:
        assert engine.step()
    engine.drain(grace=1.0)
    now["t"] = 2.0
    engine.step()
    assert all(r.status == "failed" and r.error_code == UNAVAILABLE for r in reqs)
    assert engine.runtime.pool.num_free_blocks == 10 and engine.check_invariants() == []


def test_sampling_parameters_survive_preemption(model):
    """A seeded sampled request preempted twice draws the tokens it draws alone."""
    params = SamplingParams(temperature=1.0, seed=7)
    prompts = [M.document_prompt([12], "", model.config, preamble=f"S{i} ")[:20] for i in range(4)]
    engine = GenerationEngine(model, EngineConfig(num_blocks=12, kv_block_size=16, max_batch_tokens=64))
    _checked(engine)
    reqs = [engine.submit(p, 50, stop_at_eos=False, sampling=params) for p in prompts]
    engine.run_until_idle()
    assert max(r.preemptions for r in reqs) >= 1
    for r, p in zip(reqs, prompts):
        assert r.result(0) == _alone(model, p, 50, stop_at_eos=False, sampling=params)
