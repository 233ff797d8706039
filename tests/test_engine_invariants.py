"""The generation engine under random workloads, checked after every step: the pool's and the
engine's bookkeeping (every block free, cached or held exactly once, reference counts, the
blocks counted for running requests equal to what they hold (on demand) or each within its
reservation (worst case), the step within its token budget and the free blocks), and, at the
end, every request's tokens equal to running it alone (a one-request-at-a-time reference),
cancelled ones a prefix of theirs, the pool free. Small pools make requests wait, be preempted
and recomputed (KV on demand), and evict cached prefix blocks; cancellations arrive at random
steps."""

from __future__ import annotations

import random

import pytest

from dash_trt import model as M
from dash_trt.serving.engine import CANCELLED, EngineConfig, GenerationEngine

# Small steps on a 2-core machine run several times faster single-threaded (conftest.py).
pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def model():
    return M.demo_model(seed=2)


def _workload(rng: random.Random, cfg) -> list[dict]:
    """Requests over three documents (so prompts share prefix blocks), with questions."""
    docs = [
        M.document_prompt([rng.randint(12, 40) for _ in range(rng.randint(1, 3))], "", cfg, preamble="Doc ")
        for _ in range(3)
    ]
    out = []
    for _ in range(rng.randint(6, 12)):
        doc = rng.choice(docs)
        question = M.document_prompt([1], rng.choice(["Title?", "Who?", "Read page 2.", ""]), cfg)[-4:]
        out.append(
            {
                "prompt": doc + question,
                "max_new": rng.randint(1, 24),
                "stop_at_eos": rng.random() < 0.5,
                "submit_at": rng.randint(0, 12),  # the step before which it arrives
                "cancel_at": rng.randint(1, 25) if rng.random() < 0.25 else None,
            }
        )
    return out


def _alone(model, req: dict, block_size: int) -> list[int]:
    engine = GenerationEngine(model, EngineConfig(num_blocks=256, kv_block_size=block_size, prefix_caching=False))
    return engine.generate([req["prompt"]], req["max_new"], stop_at_eos=req["stop_at_eos"])[0]


@pytest.mark.parametrize("seed", range(16))
def test_random_workloads_keep_every_invariant_and_the_tokens(model, seed):
    rng = random.Random(seed)
    block_size = rng.choice([8, 16, 16, 32])  # prefix caching needs whole sparse blocks (16)
    config = EngineConfig(
        num_blocks=rng.randint(96, 240) // block_size,
        kv_block_size=block_size,
        prefill_chunk=rng.choice([8, 16, 48]),
        max_batch_tokens=rng.choice([24, 40, 96]),
        max_num_seqs=rng.randint(1, 4),
        prefix_caching=rng.random() < 0.75,
        kv_on_demand=rng.random() < 0.75,
        max_new_tokens_limit=64,
    )
    engine = GenerationEngine(model, config, cancel_poll_interval=0.0)
    work = _workload(rng, model.config)
    room = config.num_blocks * block_size
    work = [w for w in work if len(w["prompt"]) <= room]
    for w in work:  # every request fits the pool alone (a larger one is refused at submit)
        w["max_new"] = max(1, min(w["max_new"], room - len(w["prompt"]) + 1))
    step = {"n": 0}
    plans = []
    run = engine._run

    def checked_run(plan):  # the step's plan, checked before it runs
        plans.append(plan)
        assert engine.check_invariants(plan) == []
        run(plan)

    engine._run = checked_run
    reqs: list = [None] * len(work)
    while True:
        for i, w in enumerate(work):
            if reqs[i] is None and w["submit_at"] <= step["n"]:
                cancel_at = w["cancel_at"]
                reqs[i] = engine.submit(
                    w["prompt"],
                    w["max_new"],
                    stop_at_eos=w["stop_at_eos"],
                    is_cancelled=(lambda c=cancel_at: c is not None and step["n"] >= c),
                )
        busy = engine.step()
        step["n"] += 1
        assert engine.check_invariants() == [], step["n"]
        if not busy and all(r is not None for r in reqs) and not engine.has_work():
            break
        assert step["n"] < 2000
    assert plans, "no step ran"
    for w, r in zip(work, reqs):
        want = _alone(model, w, block_size)
        if r.error_code == CANCELLED:
            assert r.tokens == want[: len(r.tokens)]
        else:
            assert r.status == "done" and r.tokens == want, (w, r.tokens, want)
    pool = engine.runtime.pool
    assert pool.num_free_blocks == pool.num_blocks and not pool.seq_ids and pool.check_invariants() == []
    COVERAGE["waited"] += engine.counters["waited"]
    COVERAGE["cancelled"] += sum(r.error_code == CANCELLED for r in reqs)
    COVERAGE["cached"] += engine.counters["prompt_tokens_cached"]
    COVERAGE["preempted"] += engine.counters["preempted"]
    COVERAGE["recomputed"] += engine.counters["tokens_recomputed"]


COVERAGE = {"waited": 0, "cancelled": 0, "cached": 0, "preempted": 0, "recomputed": 0}


def test_the_workloads_made_requests_wait_cancel_and_share():
    """Run after the workloads (same module, file order): over the seeds, requests waited for
    blocks, were cancelled, found prompt blocks in the prefix cache and were preempted."""
    print(COVERAGE)
    assert all(v > 0 for v in COVERAGE.values()), COVERAGE


def test_the_checks_see_broken_bookkeeping(model):
    """The invariant checks can fail: a reservation off by one, a block on the free list that a
    sequence holds, a reference count off by one."""
    engine = GenerationEngine(model, EngineConfig(num_blocks=32, kv_block_size=8))
    req = engine.submit(M.document_prompt([12], "Who?", model.config), 6, stop_at_eos=False)
    engine.step()
    assert engine.check_invariants() == []
    engine.scheduler.reserved += 1
    assert any("reserved" in p for p in engine.check_invariants())
    engine.scheduler.reserved -= 1
    pool = engine.runtime.pool
    held = pool.blocks(req.id)[0]
    pool._free.append(held)
    assert any("both free and held" in p for p in pool.check_invariants())
    pool._free.pop()
    pool._ref[held] += 1
    assert any("reference counts" in p for p in pool.check_invariants())
    pool._ref[held] -= 1
    assert engine.check_invariants() == []
