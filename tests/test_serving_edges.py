"""Edges of the serving engine, pool and runtime that a planted-bug audit found untested: the
last cacheable block of a prompt that ends with an image on a block boundary, admission counting
the unheld cached blocks it takes, padded decode steps that grow block by block, a request of
exactly the pool's size, which request is preempted, close() with preempted requests, resumes
through the prefix cache with the counters adding up, stop_at_eos=False past EOS, a decode batch
shrinking inside its bucket onto reused blocks, padded decode right after a preempt/resume."""

from __future__ import annotations

import pytest
import torch

from dash_trt import model as M
from dash_trt.serving.block_pool import KVBlockPool, prefix_block_hashes
from dash_trt.serving.engine import UNAVAILABLE, EngineConfig, GenerationEngine
from dash_trt.serving.runner import PagedRuntime

# Small steps on a 2-core machine run several times faster single-threaded (conftest.py).
pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def m2():
    return M.demo_model(seed=2)


# a prompt of whole blocks that ends with an image: its last block is never cacheable
def test_a_prompt_ending_with_an_image_on_a_block_boundary_keeps_a_token_to_compute(m2):
    cfg = m2.config
    doc = M.document_prompt([31], "", cfg)  # 32 tokens, the last one an image
    assert len(doc) == 32 and doc[-1] == cfg.image_token_id
    assert len(prefix_block_hashes(doc, cfg.image_token_id, 16)) == 1
    e = GenerationEngine(m2, EngineConfig(num_blocks=32, kv_block_size=16))
    a = e.submit(doc, 4, stop_at_eos=False)
    e.run_until_idle()
    b = e.submit(doc, 4, stop_at_eos=False)
    e.run_until_idle()
    assert b.status == "done" and b.result(0) == a.result(0) and b.prompt_cached == 16


# newly_pinned, and admission counting cached blocks no sequence holds
def test_admission_counts_the_unheld_cached_blocks_it_takes(m2):
    cfg = m2.config
    pool = KVBlockPool(4, 4)
    pool.add("a", reserve_tokens=8)
    pool.register("a", 0, b"h0")
    assert pool.newly_pinned([pool.blocks("a")[0]]) == 0  # held: taking it pins nothing new
    pool.free("a")
    assert pool.newly_pinned(pool.match([b"h0"])) == 1  # unheld: it leaves the free count

    doc = M.document_prompt([47], "", cfg)  # 3 cacheable blocks of 16
    e = GenerationEngine(m2, EngineConfig(num_blocks=8, kv_block_size=16))
    e.generate([doc + list(b"Q?")], 2, stop_at_eos=False)
    x = e.submit(M.document_prompt([10], "x", cfg) + [65] * 6, 40, stop_at_eos=False)
    e.step()
    b = e.submit(doc + [66] * 60, 1, stop_at_eos=False)  # 3 cached + 4 own blocks
    e.run_until_idle()  # must not raise CacheFullError from admission
    assert x.status == b.status == "done" and b.prompt_cached == 48


# padded decode steps of sequences that grow block by block
def test_padded_decode_steps_grow_on_demand(m2):
    p = M.document_prompt([12], "Who?", m2.config)
    want = M.generate(m2, [p], 20, kv_block_size=8, stop_at_eos=False).tokens[0]
    rt = PagedRuntime(m2, 16, 8, max_model_len=64, max_num_seqs=2, decode_padding=True)
    rt.add("a", p, len(p))  # blocks for the prompt only
    got = []
    while len(got) < 20:
        got.append(rt.step([("a", rt.seq("a").pending)]).tokens["a"])
    assert got == want and rt.pool.length("a") == len(p) + 19


# a request of exactly the pool's size is accepted and served
@pytest.mark.parametrize("images, max_new", [(31, 1), (20, 12)])
def test_a_request_of_exactly_the_pool_is_served(m2, images, max_new):
    p = M.document_prompt([images], "", m2.config)
    assert len(p) + max_new - 1 == 32
    e = GenerationEngine(m2, EngineConfig(num_blocks=4, kv_block_size=8))
    r = e.submit(p, max_new, stop_at_eos=False)
    e.run_until_idle(max_steps=100)
    assert r.status == "done" and len(r.tokens) == max_new


def _preempting_engine(m2, prefix):
    cfg = m2.config
    e = GenerationEngine(m2, EngineConfig(num_blocks=10, kv_block_size=16, max_batch_tokens=64, prefix_caching=prefix))
    prompts = [M.document_prompt([12], "", cfg, preamble=f"D{i} ")[:20] for i in range(3)]
    return e, [e.submit(p, 60, stop_at_eos=False) for p in prompts]


# the newest running request is the victim; the oldest always progresses
def test_the_newest_running_request_is_preempted(m2):
    e, reqs = _preempting_engine(m2, False)
    while not e.counters["preempted"]:
        assert e.step()
    assert [r for r in reqs if r._resume is not None] == [reqs[-1]]
    e.run_until_idle()
    assert reqs[0].preemptions == 0


# close() answers preempted requests too
def test_close_fails_preempted_requests_too(m2):
    e, reqs = _preempting_engine(m2, False)
    while not e.counters["preempted"]:
        e.step()
    assert e.close("bye") == 3
    assert all(r.finished and r.status == "failed" and r.error_code == UNAVAILABLE for r in reqs)
    assert not e.scheduler.waiting and not e.scheduler.running


# resume through the prefix cache; the counters add up; statuses
def test_preempted_requests_resume_from_the_cache_and_the_counters_add_up():
    model = M.demo_model(seed=3)
    cfg = model.config
    doc = M.document_prompt([40], "", cfg, preamble="Doc ")  # 3 cacheable blocks of 16
    prompts = [doc + list(f"Q{i}?".encode()) for i in range(4)]
    e = GenerationEngine(model, EngineConfig(num_blocks=12, kv_block_size=16, max_batch_tokens=64, prefill_chunk=16))
    resumed = []
    resume = e.runtime.resume
    e.runtime.resume = lambda s, c=(): (resumed.append(len(c)), resume(s, c))[1]
    fed = []
    run = e._run

    def checked(plan):
        fed.append(sum(n for _, n in plan))
        assert all(r.status == "running" for r in e.scheduler.running)
        assert all(r.status == "waiting" for r in e.scheduler.waiting)
        run(plan)

    e._run = checked
    reqs = [e.submit(p, 40, stop_at_eos=False) for p in prompts]
    e.run_until_idle()
    c = e.counters
    assert c["preempted"] > 0 and resumed and all(n == 2 for n in resumed)  # (len(doc) - 1) // 16 blocks
    fresh = sum(len(p) - r.prompt_cached for p, r in zip(prompts, reqs)) + sum(len(r.tokens) - 1 for r in reqs)
    assert sum(fed) == fresh + c["tokens_recomputed"]
    assert c["prompt_tokens_computed"] + c["prompt_tokens_cached"] == sum(map(len, prompts))


# stop_at_eos=False generates past EOS
def test_stop_at_eos_false_goes_on_after_eos(m2):
    cfg = m2.config
    p = M.document_prompt([10], "", cfg, preamble="P25 ")
    want = M.generate(m2, [p], 24, stop_at_eos=False).tokens[0]
    assert cfg.eos_token_id in want[:-1]
    e = GenerationEngine(m2, EngineConfig(num_blocks=64, kv_block_size=16))
    assert e.generate([p], 24, stop_at_eos=False)[0] == want
    assert e.generate([p], 24, stop_at_eos=True)[0] == want[: want.index(cfg.eos_token_id) + 1]


# a decode batch that shrinks inside its bucket leaves the freed rows idle
def test_a_batch_shrinking_inside_its_bucket_writes_no_departed_sequence(m2):
    cfg = m2.config
    P = {
        k: M.document_prompt([n, 4], "Read page 2.", cfg, preamble=k * 3)
        for k, n in (("a", 9), ("b", 11), ("c", 7), ("d", 5), ("e", 20))
    }

    def run(padding):
        rt = PagedRuntime(m2, 40, 8, max_model_len=96, max_num_seqs=4, decode_padding=padding, graph_batch_sizes=(4,))
        out = {k: [] for k in P}
        logits = {k: [] for k in P}

        def step(plan):
            r = rt.step(plan, return_logits=True)
            for sid, tok in r.tokens.items():
                out[sid].append(tok)
                logits[sid].append(r.logits[sid])

        for k in "abcd":
            rt.add(k, P[k], len(P[k]) + 12)
        step([(k, len(P[k])) for k in "abcd"])
        for _ in range(3):
            step([(k, 1) for k in "abcd"])
        rt.free("d")
        rt.add("e", P["e"], len(P["e"]) + 12)  # takes d's blocks
        step([("e", len(P["e"]))])
        step([(k, 1) for k in "abc"])  # 3 rows in the bucket of 4
        for _ in range(6):
            step([(k, 1) for k in "abce"])
        return out, logits

    (tp, lp), (tu, lu) = run(True), run(False)
    assert tp == tu
    for k in "abce":
        for x, y in zip(lp[k], lu[k]):
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)


# preempt forgets the last decode step's buffers
def test_padded_decode_after_an_immediate_preempt_and_resume(m2):
    cfg = m2.config
    A, B = M.document_prompt([9], "Who?", cfg), M.document_prompt([11], "Title?", cfg)

    def run(padding):
        rt = PagedRuntime(m2, 32, 8, max_model_len=96, max_num_seqs=2, decode_padding=padding, graph_batch_sizes=(2,))
        rt.add("a", A, len(A))
        rt.add("b", B, len(B))
        out = {"a": [], "b": []}

        def step(plan):
            for sid, tok in rt.step(plan).tokens.items():
                out[sid].append(tok)

        step([("a", len(A)), ("b", len(B))])
        for _ in range(3):
            step([("a", 1), ("b", 1)])
        rt.resume(rt.preempt("b"))
        while len(out["b"]) < 8:
            step([("a", 1), ("b", 1)])
        return out

    assert run(True) == run(False)
