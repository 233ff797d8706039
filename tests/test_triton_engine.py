"""The generation engine behind the Triton model, without a server: continuous batching
gives exactly the tokens of offline greedy generation (dash_trt.model.generate), requests
that do not fit wait and none is dropped, blocks come back, bad requests are refused with
a message, failures stay with the requests they belong to."""

import threading
import time

import numpy as np
import pytest
import torch

from dash_trt import model as M
from dash_trt.serving.engine import (
    CANCELLED,
    INTERNAL,
    INVALID_ARGUMENT,
    UNAVAILABLE,
    EngineConfig,
    EngineConfigError,
    EngineRunner,
    GenerationEngine,
    RequestError,
)

#: Seed of the demo model's weights: with it, greedy outputs differ from prompt to prompt.
WEIGHTS_SEED = 2


# Small steps on a 2-core machine run several times faster single-threaded (conftest.py).
pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def model():
    return M.demo_model(seed=WEIGHTS_SEED)


@pytest.fixture(scope="module")
def prompts(model):
    cfg = model.config
    return [
        M.document_prompt([20, 9, 14], "Read page 2.", cfg, preamble="Doc "),
        M.document_prompt([30], "Title?", cfg),
        M.document_prompt([5, 5, 5, 5], "", cfg),
        M.document_prompt([40, 3], "Who?", cfg),
        M.document_prompt([2], "x", cfg),
    ]


MAX_NEW = [6, 3, 5, 1, 7]


@pytest.fixture(scope="module")
def offline(model, prompts):
    return [M.generate(model, [p], n).tokens[0] for p, n in zip(prompts, MAX_NEW)]


def _record(events):
    return lambda e: events.append(e)


@pytest.mark.parametrize(
    "config",
    [
        # a pool for roughly two requests at a time: the rest wait, chunked prefill mixes with decode
        EngineConfig(num_blocks=14, kv_block_size=8, prefill_chunk=24, max_batch_tokens=40),
        # everything fits at once, the whole prompt in one chunk, odd block size
        EngineConfig(num_blocks=64, kv_block_size=5, prefill_chunk=512, max_batch_tokens=1024),
    ],
)
def test_engine_equals_offline_generation(model, prompts, offline, config):
    engine = GenerationEngine(model, config)
    events = []
    reqs = [engine.submit(p, n, on_event=_record(events)) for p, n in zip(prompts, MAX_NEW)]
    engine.run_until_idle()
    assert [r.result(timeout=0) for r in reqs] == offline
    stats = engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] == config.num_blocks
    assert stats["kv_blocks_reserved"] == 0 and stats["running"] == stats["waiting"] == 0
    assert stats["done"] == len(prompts) and stats["failed"] == 0
    assert stats["peak_blocks_in_use"] <= config.num_blocks
    # every request ends with exactly one "done", after its tokens
    for r in reqs:
        mine = [e for e in events if e.request is r]
        assert [e.kind for e in mine].count("done") == 1 and mine[-1].kind == "done"
        assert [t for e in mine if e.kind == "token" for t in e.tokens] == r.tokens
        assert mine[-1].tokens == tuple(r.tokens)
    if config.num_blocks == 14:
        assert stats["waited"] > 0 and stats["peak_waiting"] > 0
        # some step mixed one request's prefill chunk with another's decode token
        by_step = {}
        for e in events:
            by_step.setdefault(e.step, {}).setdefault(e.kind, set()).add(e.request.id)
        assert any(("progress" in k and "token" in k and (k["token"] - k["progress"])) for k in by_step.values())
        # prefill went in chunks
        assert max(sum(1 for e in events if e.request is r and e.kind == "progress") for r in reqs) >= 2


def test_engine_counts_document_pages_waiting_running_and_done(model, prompts):
    """A request's pages are its prompt's <PAGE> markers: the stats show them waiting, then
    running once admitted, then done (a failed request's pages are not counted done)."""
    engine = GenerationEngine(model, EngineConfig(num_blocks=64, kv_block_size=8, prefill_chunk=512))
    page = model.config.page_token_id
    pages = [p.count(page) for p in prompts]
    assert pages == [3, 1, 4, 2, 1]
    reqs = [engine.submit(p, 2) for p in prompts]
    assert [r.pages for r in reqs] == pages
    stats = engine.stats()
    assert stats["pages_waiting"] == 11 and stats["pages_running"] == 0
    engine.step()
    stats = engine.stats()
    assert stats["pages_running"] + stats["pages_waiting"] == 11 and stats["pages_running"] > 0
    engine._fail(reqs[0], "refused for the test", INTERNAL)
    engine.run_until_idle()
    stats = engine.stats()
    assert stats["pages_running"] == stats["pages_waiting"] == 0
    assert stats["pages_done"] == 11 - 3 and stats["done"] == 4 and stats["failed"] == 1


@pytest.mark.parametrize("limit", [0, 4, 1])
def test_engine_admits_documents_by_their_pages(model, prompts, offline, limit):
    """max_pages_in_flight: requests are admitted in order while the running pages and their
    own stay within the limit (pages [3, 1, 4, 2, 1] under 4: 3+1, then 4 alone, then 2+1); a
    request over the limit runs alone (limit 1); the answers are offline generation's."""
    config = EngineConfig(num_blocks=64, kv_block_size=8, prefill_chunk=512, max_pages_in_flight=limit)
    engine = GenerationEngine(model, config)
    reqs = [engine.submit(p, n) for p, n in zip(prompts, MAX_NEW)]
    running, admitted, admit = [], [], engine.scheduler.admit

    def watched(start):  # the running set right after each admission, before its step
        n = admit(start)
        now = engine.scheduler.running
        running.append(sum(r.pages for r in now))
        admitted.extend(r.id for r in now if r.id not in admitted)
        assert limit == 0 or running[-1] <= limit or len(now) == 1
        return n

    engine.scheduler.admit = watched
    engine.run_until_idle()
    assert [r.result(timeout=0) for r in reqs] == offline
    assert admitted == [r.id for r in reqs]  # first come, first served
    peak = engine.counters["peak_pages_running"]
    assert peak == {0: 11, 4: 4, 1: 4}[limit] == max(running)
    assert engine.stats()["pages_done"] == 11


def test_engine_config_refuses_a_bad_page_limit():
    for bad in (-1, 1.5, True, 1 << 21):
        with pytest.raises(EngineConfigError, match="max_pages_in_flight"):
            EngineConfig(max_pages_in_flight=bad)


def test_requests_join_while_others_decode(model, prompts, offline):
    engine = GenerationEngine(model, EngineConfig(num_blocks=64, kv_block_size=16))
    first = engine.submit(prompts[0], MAX_NEW[0])
    engine.step()
    engine.step()  # first is decoding now
    assert len(first.tokens) == 2 and not first.finished
    events = []
    late = engine.submit(prompts[1], MAX_NEW[1], on_event=_record(events))
    engine.step()
    assert events[0].kind == "progress" and not first.finished  # joined the running batch
    engine.run_until_idle()
    assert first.result(0) == offline[0] and late.result(0) == offline[1]


def test_fifo_wait_when_the_pool_is_full(model, prompts, offline):
    # room for one request at a time: each waits for the one before it to free its blocks
    need = max(-(-(len(p) + n - 1) // 8) for p, n in zip(prompts, MAX_NEW))
    engine = GenerationEngine(model, EngineConfig(num_blocks=need, kv_block_size=8))
    reqs = [engine.submit(p, n) for p, n in zip(prompts, MAX_NEW)]
    engine.run_until_idle()
    assert [r.result(0) for r in reqs] == offline
    admitted = sorted(reqs, key=lambda r: r.t_admit)
    assert admitted == reqs  # first come, first admitted
    assert engine.stats()["waited"] >= 3 and engine.stats()["peak_running"] <= 2
    assert engine.stats()["kv_blocks_free"] == need


def test_max_num_seqs_limits_running(model, prompts, offline):
    engine = GenerationEngine(model, EngineConfig(num_blocks=128, max_num_seqs=2))
    reqs = [engine.submit(p, n) for p, n in zip(prompts, MAX_NEW)]
    engine.run_until_idle()
    assert [r.result(0) for r in reqs] == offline
    assert engine.stats()["peak_running"] == 2


def _bad_requests(cfg, engine_cfg):
    page, image = cfg.page_token_id, cfg.image_token_id
    return [
        ([], None, "input_ids is empty"),
        (M.tokenize("no document here", cfg), None, "no image token"),
        ([image, image, 65], None, "no <PAGE> marker before its image tokens"),
        ([65, image, page, image], None, "image token at position 1 comes before the first <PAGE> marker"),
        ([page, image, cfg.vocab_size + 3, -1], None, r"outside the vocabulary 0\.\.319: \[323, -1\]"),
        (np.array([page, image], dtype=np.float32), None, "integer token ids, got dtype float32"),
        (np.array([[page, image]], dtype=np.int64), None, r"1-D \[num_tokens\], got shape \[1, 2\]"),
        ("<PAGE><image>", None, "got a string"),
        ([page, image, True], None, "integer token ids"),
        ([page, image], 0, "max_new_tokens must be 1..16"),
        ([page, image], 17, "max_new_tokens must be 1..16"),
        ([page, image], np.array([2, 3], dtype=np.int32), r"one integer, got shape \[2\]"),
        (
            [page] + [image] * (engine_cfg.num_blocks * engine_cfg.kv_block_size),
            1,
            "too long for the KV pool.*needs 9 KV blocks of 8 tokens, the pool has 8",
        ),
        ([page] + [image] * 50, 16, "too long for the KV pool: a prompt of 51 tokens plus up to 16"),
    ]


def test_bad_requests_are_refused_and_the_engine_keeps_serving(model, prompts, offline):
    ecfg = EngineConfig(num_blocks=8, kv_block_size=8, max_new_tokens_limit=16, default_max_new_tokens=4)
    engine = GenerationEngine(model, ecfg)
    good = engine.submit(prompts[4], MAX_NEW[4])
    cases = _bad_requests(model.config, ecfg)
    for prompt, max_new, match in cases:
        with pytest.raises(RequestError, match=match) as e:
            engine.submit(prompt, max_new)
        assert e.value.code == INVALID_ARGUMENT
    engine.run_until_idle()
    assert good.result(0) == offline[4]
    stats = engine.stats()
    assert stats["refused"] == len(cases) and stats["submitted"] == 1 and stats["kv_blocks_free"] == 8
    # the default max_new_tokens applies when a request does not say
    assert len(engine.generate([prompts[4]], stop_at_eos=False)[0]) == 4


def test_cancelled_request_frees_its_blocks(model, prompts, offline):
    engine = GenerationEngine(model, EngineConfig(num_blocks=64), cancel_poll_interval=0)
    events = []
    flag = {"cancel": False}
    victim = engine.submit(prompts[0], 50, on_event=_record(events), is_cancelled=lambda: flag["cancel"])
    other = engine.submit(prompts[1], MAX_NEW[1])
    engine.step()
    engine.step()
    flag["cancel"] = True
    engine.run_until_idle()
    assert victim.status == "failed" and victim.error_code == CANCELLED
    assert events[-1].kind == "error" and "cancelled" in events[-1].error
    assert other.result(0) == offline[1]
    assert engine.stats()["kv_blocks_free"] == 64


def test_paused_engine_admits_and_cancels_but_runs_no_step(model, prompts, offline):
    # An injected clock decides when the cancellation poll is due: no real time involved.
    now = {"t": 0.0}
    engine = GenerationEngine(
        model, EngineConfig(num_blocks=64, kv_block_size=16), cancel_poll_interval=1.0, clock=lambda: now["t"]
    )
    flag = {"cancel": False}
    engine.pause()
    victim = engine.submit(prompts[0], 50, is_cancelled=lambda: flag["cancel"])
    other = engine.submit(prompts[1], MAX_NEW[1])
    assert engine.step() is False and not engine.wait_for_work(0)  # paused: admitted, nothing run
    s = engine.stats()
    assert s["paused"] and s["running"] == 2 and s["steps"] == 0 and s["tokens_generated"] == 0
    assert s["kv_blocks_reserved"] == victim.blocks_reserved + other.blocks_reserved
    flag["cancel"] = True
    engine.step()  # the poll is not due yet (same instant as the last one)
    assert victim.status == "running"
    now["t"] = 1.0
    engine.step()  # due: the cancelled request goes, while the engine is still paused
    assert victim.status == "failed" and victim.error_code == CANCELLED and victim.tokens == []
    assert engine.stats()["kv_blocks_reserved"] == other.blocks_reserved
    engine.resume()
    assert engine.wait_for_work(0)
    engine.run_until_idle()
    assert other.result(0) == offline[1]
    s = engine.stats()
    assert not s["paused"] and s["kv_blocks_free"] == 64 and s["kv_blocks_reserved"] == 0


def test_a_failing_step_fails_only_its_requests(model, prompts, offline):
    calls = {"n": 0}

    def flaky(inputs, caches):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("device lost")
        with torch.no_grad():
            out = model.export_forward(*(inputs[k] for k in M.MODEL_INPUTS), *caches)
        return out[0], out[1:]

    engine = GenerationEngine(model, EngineConfig(num_blocks=64), forward=flaky)
    first = engine.submit(prompts[0], MAX_NEW[0])
    engine.step()  # fails
    later = engine.submit(prompts[1], MAX_NEW[1])
    engine.run_until_idle()
    assert first.status == "failed" and first.error_code == INTERNAL and "device lost" in first.error
    with pytest.raises(RequestError, match="device lost"):
        first.result(0)
    assert later.result(0) == offline[1]
    assert engine.stats()["kv_blocks_free"] == 64


def test_a_broken_callback_does_not_stop_others(model, prompts, offline):
    engine = GenerationEngine(model, EngineConfig(num_blocks=64))

    def boom(event):
        raise ValueError("callback bug")

    a = engine.submit(prompts[1], MAX_NEW[1], on_event=boom)
    b = engine.submit(prompts[4], MAX_NEW[4])
    engine.run_until_idle()
    assert a.result(0) == offline[1] and b.result(0) == offline[4]


def test_runner_serves_concurrent_submitters_then_shuts_down(model, prompts, offline):
    engine = GenerationEngine(model, EngineConfig(num_blocks=24, kv_block_size=8, prefill_chunk=16))
    runner = EngineRunner(engine).start()
    results = [None] * len(prompts)

    def client(i):
        results[i] = engine.submit(prompts[i], MAX_NEW[i]).result(timeout=120)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert results == offline
    assert engine.stats()["kv_blocks_free"] == 24
    # shutdown: a request that cannot start before the stop is answered (by the stepping
    # thread as it exits), not dropped
    engine.pause()  # no model step from here: the request stays queued
    queued = engine.submit(prompts[0], 4)
    assert runner.stop("going away") == 1
    assert queued.status == "failed" and queued.error_code == UNAVAILABLE and queued.error == "going away"
    with pytest.raises(RequestError, match="going away") as e:
        engine.submit(prompts[0], 4)
    assert e.value.code == UNAVAILABLE
    assert engine.stats()["kv_blocks_free"] == 24 and engine.stats()["closed"]


def test_engine_config_validation_and_json():
    cfg = EngineConfig(num_blocks=10, kv_block_size=4)
    assert EngineConfig.from_json(cfg.to_json()) == cfg
    with pytest.raises(EngineConfigError, match="'num_blocks' must be a positive integer"):
        EngineConfig(num_blocks=0)
    with pytest.raises(EngineConfigError, match="exceeds max_new_tokens_limit"):
        EngineConfig(default_max_new_tokens=10, max_new_tokens_limit=5)
    with pytest.raises(EngineConfigError, match="unknown engine config key"):
        EngineConfig.from_json('{"num_blockz": 3}')
    with pytest.raises(EngineConfigError, match="not valid JSON"):
        EngineConfig.from_json("{")


def test_sizes_are_checked_before_the_prompt_is_read(model):
    """A prompt too long for the pool is refused from its length alone: its ids are never
    converted or scanned (a 16M-token prompt used to be converted, checked and its
    coordinates computed before the pool-size check)."""

    class Huge:
        def __init__(self, n=16_000_000):
            self.n = n

        def __len__(self):
            return self.n

        def __iter__(self):
            raise AssertionError("the prompt's ids were read")

    engine = GenerationEngine(model, EngineConfig(num_blocks=64, kv_block_size=16))
    with pytest.raises(RequestError, match="too long for the KV pool: a prompt of 16000000 tokens"):
        engine.submit(Huge(), 4)
    big = np.zeros(16_000_000, dtype=np.int64)  # an array: its length is its shape, nothing copied
    with pytest.raises(RequestError, match="too long for the KV pool"):
        engine.submit(big, 4)
    long = EngineConfig(num_blocks=1000, kv_block_size=16, max_model_len=4096)
    with pytest.raises(RequestError, match="exceeds the model's max_model_len of 4096 tokens"):
        GenerationEngine(model, long).submit(Huge(10_000), 4)
    assert engine.stats()["refused"] == 2


def test_drain_answers_queued_now_and_running_after_the_grace(model, prompts):
    """drain(): new requests refused, queued ones (not admitted: the pool is full) failed at
    the next step with UNAVAILABLE (answered by the stepping thread, not the draining one),
    running ones step on until the grace is over (an injected clock: no real time), then fail
    UNAVAILABLE; the pool ends free. (Worst-case reservations keep the second request queued;
    tests/test_kv_on_demand.py drains with preempted requests.)"""
    now = {"t": 0.0}
    engine = GenerationEngine(
        model,
        EngineConfig(num_blocks=12, kv_block_size=16, max_new_tokens_limit=200, kv_on_demand=False),
        clock=lambda: now["t"],
    )
    running = engine.submit(prompts[1], 80, stop_at_eos=False)  # 8 blocks
    queued = engine.submit(prompts[0], 80, stop_at_eos=False)  # 9 blocks: does not fit beside the first
    engine.step()
    assert running.status == "running" and queued.status == "waiting"
    assert engine.drain("going down", grace=5.0) == 1
    assert not queued.finished and engine.has_work()  # answered by the next step, not here
    with pytest.raises(RequestError, match="going down"):
        engine.submit(prompts[2], 3)
    before = len(running.tokens)
    engine.step()
    assert queued.finished and queued.error_code == UNAVAILABLE and queued.error == "going down"
    engine.step()
    assert not running.finished and len(running.tokens) == before + 2  # the grace: it still runs
    now["t"] = 5.0
    engine.step()
    assert running.finished and running.error_code == UNAVAILABLE and running.error == "going down"
    assert engine.stats()["kv_blocks_free"] == 12 and not engine.has_work()


def test_never_two_threads_answer_at_once(model, prompts):
    """Triton's Python backend crashed when two threads answered at once (a drain from the
    control thread while the engine thread sent tokens). Under a running EngineRunner, drain()
    from another thread leaves its answers to the stepping thread; stop() answers what is left
    only after the stepping thread has ended; every request is answered."""
    import threading

    engine = GenerationEngine(model, EngineConfig(num_blocks=24, kv_block_size=16, max_new_tokens_limit=400))
    seen: list[tuple[str, bool]] = []  # (answering thread, whether the stepper was alive then)
    started = threading.Event()
    runner = EngineRunner(engine, name="stepper")

    def on_event(event):
        seen.append((threading.current_thread().name, runner.alive))
        if event.kind == "token":
            started.set()

    engine.pause()  # every request queued or admitted before the runner steps: a known state
    reqs = [engine.submit(p, 300, stop_at_eos=False, on_event=on_event) for p in prompts * 3]
    runner.start()
    engine.resume()
    assert started.wait(60)
    queued = engine.drain("going down", grace=3600.0)
    assert queued > 0  # the pool holds a few; the rest queue
    deadline = time.monotonic() + 60
    while sum(r.error == "going down" for r in reqs) < queued and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sum(r.error == "going down" for r in reqs) == queued  # answered by the stepper
    assert runner.stop("stopped") > 0  # the running ones
    assert all(r.finished for r in reqs)
    assert {r.error for r in reqs if r.error} == {"going down", "stopped"}
    assert {name for name, _ in seen} <= {"stepper", threading.current_thread().name}
    assert all(name == "stepper" or not alive for name, alive in seen), seen  # one answering thread at a time
    assert [name for name, _ in seen if name != "stepper"] and engine.stats()["kv_blocks_free"] == 24
