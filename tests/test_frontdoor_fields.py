"""Every request field of the OpenAI front door (dash-triton openai), one by one, on
/v1/completions and /v1/chat/completions (and their streams where the field matters there),
against the real Triton server on CPU. Each test asserts the field's observable effect: the
tokens offline generation gives (greedy: ``dash_trt.model.generate``; sampling: the engine the
server runs, ``GenerationEngine`` with the served model's own engine config, and the same seed),
the number of tokens and ``finish_reason``, the usage numbers, or the 400 in OpenAI's error
object (``message``, ``type``, ``param``, ``code``) that names the field.

The server, the checkpoint and the tokenizer are the fixtures of ``test_frontdoor`` (one
tritonserver for this module)."""

from __future__ import annotations

import json

import httpx
import pytest
import test_frontdoor as fd
import torch

from dash_trt import model as M

# test_frontdoor's fixtures (module-scoped: one tritonserver and front door for this module) and helpers
folder, triton, door, model, tok = fd.folder, fd.triton, fd.door, fd.model, fd.tok
client, data_url, png, prompt_text = fd.client, fd.data_url, fd.png, fd.prompt_text
openai = pytest.importorskip("openai")

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
Q = prompt_text(0)  # <PAGE> six <image> "Question 0?"
C = prompt_text(1)  # the chat tests' message
#: A prompt whose greedy answer is EOS at once (found by a search over prompts; checked offline
#: in the tests that use it, so a changed checkpoint fails there and not in a confusing way).
EOS_PROMPT = "<PAGE>" + "<image>" * 4 + "TX}"


# ------------------------------------------------------------------------------ fixtures, helpers
@pytest.fixture(scope="module")
def engine(triton, model):
    """The engine the server runs, offline: the served model's own EngineConfig."""
    import tritonclient.grpc as grpcclient

    from dash_trt import triton_protocol as P
    from dash_trt.serving.engine import EngineConfig, GenerationEngine

    c = grpcclient.InferenceServerClient(triton.grpc_url)
    try:
        cfg = c.get_model_config("dash", as_json=True)["config"]
    finally:
        c.close()
    params = {k: v.get("string_value", "") for k, v in cfg["parameters"].items()}
    return GenerationEngine(model, EngineConfig.from_json(params[P.PARAM_ENGINE]))


@pytest.fixture(scope="module")
def small_default(triton, folder):
    """A second front door on the same Triton whose chat default for max tokens is 5."""
    from dash_trt.triton.openai import FrontDoor, FrontDoorSettings

    d = FrontDoor(
        FrontDoorSettings(
            triton_grpc=triton.grpc_url, tokenizer=str(folder), default_max_tokens=5, allow_control_text=True
        ),
        port=0,
    ).start()
    yield d
    d.close()


class one_thread:
    """torch on one thread (as the server's --torch-threads 1) for offline generation."""

    def __enter__(self):
        self.threads = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc):
        torch.set_num_threads(self.threads)


def cmpl_ids(tok, text: str) -> list[int]:
    return [tok.bos_id, *tok.encode(text)]


def chat_ids(tok, content: str) -> list[int]:
    """The demo checkpoint has no chat template: the front door's plain ``role: content`` one."""
    return tok.encode(f"user: {content}\nassistant: ")


def greedy(model, ids, n, eos=True) -> list[int]:
    with one_thread():
        return M.generate(model, [ids], n, stop_at_eos=eos).tokens[0]


def sampled(engine, ids, n, eos=False, **sampling) -> list[int]:
    with one_thread():
        return engine.generate([ids], n, stop_at_eos=eos, sampling=sampling)[0]


def sampled_each(engine, ids, n, seeds, eos=False, **sampling) -> dict[int, list[int]]:
    """One request per seed, in one engine run (a seeded request's tokens do not depend on what
    runs beside it)."""
    with one_thread():
        reqs = {s: engine.submit(ids, n, stop_at_eos=eos, sampling={**sampling, "seed": s}) for s in seeds}
        engine.run_until_idle()
    return {s: r.result(timeout=0) for s, r in reqs.items()}


def text(tok, tokens) -> str:
    return tok.decode(tokens, skip_special_tokens=True)


def post(door, path, body, status=200) -> dict:
    r = httpx.post(door.url + path, json=body, timeout=120)
    assert r.status_code == status, (body, r.status_code, r.text)
    return r.json()


def cmpl(door, prompt=Q, **body) -> dict:
    return post(door, CMPL, {"model": "dash", "prompt": prompt, **body})


def chat(door, content=C, **body) -> dict:
    return post(door, CHAT, {"model": "dash", "messages": [{"role": "user", "content": content}], **body})


def answer(path, body) -> tuple[str, str, dict]:
    """(text, finish_reason, usage) of a non-streamed answer of either endpoint."""
    ch = body["choices"][0]
    return (ch["text"] if path == CMPL else ch["message"]["content"]), ch["finish_reason"], body["usage"]


def got(tok, body, tokens, reason):
    """The answer (either endpoint) is ``tokens``: its text, its count and its finish_reason."""
    path = CMPL if body["object"] == "text_completion" else CHAT
    t, r, use = answer(path, body)
    assert (t, use["completion_tokens"], r) == (text(tok, tokens), len(tokens), reason)


def events(door, path, body) -> list[dict]:
    """The data events of a stream (``[DONE]`` last, checked, and left out)."""
    with httpx.stream("POST", door.url + path, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines and all(line.startswith("data: ") for line in lines), lines
    assert lines[-1] == "data: [DONE]" and "data: [DONE]" not in lines[:-1]
    return [json.loads(line[6:]) for line in lines[:-1]]


def streamed(path, evs) -> tuple[str, str, dict | None]:
    """(concatenated text, the finish_reason, the usage chunk's usage or None) of a stream of one
    choice; every chunk but the usage chunk has exactly one choice, and only the last choice
    chunk has a finish_reason."""
    usage = [e for e in evs if "usage" in e and e["usage"] is not None]
    assert len(usage) <= 1
    if usage:
        assert evs[-1] is usage[0] and evs[-1]["choices"] == []
    choice = [e for e in evs if e not in usage]
    assert all(len(e["choices"]) == 1 for e in choice)
    reasons = [e["choices"][0]["finish_reason"] for e in choice]
    assert all(r is None for r in reasons[:-1]) and reasons[-1] is not None, reasons
    key = (lambda c: c["text"]) if path == CMPL else (lambda c: c["delta"].get("content", ""))
    return "".join(key(e["choices"][0]) for e in choice), reasons[-1], usage[0]["usage"] if usage else None


def refused(door, path, body, param, *, status=400, code=None) -> dict:
    """A refusal in OpenAI's error object that names ``param`` (in ``param`` and the message)."""
    r = httpx.post(door.url + path, json=body, timeout=60)
    assert r.status_code == status, (body, r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["type"] == ("invalid_request_error" if status == 400 else "not_found_error"), err
    assert err["param"] == param and param.split(".")[-1] in err["message"] and err["code"], (body, err)
    if code is not None:
        assert err["code"] == code, err
    return err


def engine_refused(door, body, fragment) -> None:
    """A value only the engine can judge (it knows the vocabulary, the pool, the prompt's pages):
    a 400 invalid_value in OpenAI's error object on both paths, whose message names the field as
    the engine calls it (max_new_tokens, input_ids, ...) and whose param is null: the front door
    does not map the engine's refusals to the request's parameters."""
    for stream in (False, True):
        r = httpx.post(door.url + CMPL, json={**body, "stream": stream}, timeout=60)
        assert r.status_code == 400, (body, r.status_code, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", "invalid_value", None), err
        assert fragment in err["message"], (fragment, err)


def refused_both(door, path, body, param, **kw) -> dict:
    """Refused the same way whether streamed or not."""
    err = refused(door, path, body, param, **kw)
    assert refused(door, path, {**body, "stream": True}, param, **kw) == err
    return err


def base(path, **body) -> dict:
    """A valid body of ``path`` with ``body`` on top."""
    if path == CMPL:
        return {"model": "dash", "prompt": Q, "max_tokens": 2, "temperature": 0, **body}
    return {"model": "dash", "messages": [{"role": "user", "content": C}], "max_tokens": 2, "temperature": 0, **body}


def first_seed(seeds, pred) -> int:
    """The first seed for which ``pred`` holds (asserted to exist: the choice is deterministic)."""
    for s in seeds:
        if pred(s):
            return s
    raise AssertionError("no seed among the candidates has the property the test needs")


# ------------------------------------------------------------------------------ temperature
def test_temperature_zero_is_the_offline_greedy_answer(door, model, tok):
    """temperature 0: the offline greedy tokens on both endpoints and both paths; seed, top_k
    and top_p change nothing at temperature 0 (greedy ignores them)."""
    want = greedy(model, cmpl_ids(tok, Q), 8, eos=False)
    for extra in ({}, {"seed": 5, "top_k": 3, "top_p": 0.2}):
        got(tok, cmpl(door, max_tokens=8, temperature=0, ignore_eos=True, **extra), want, "length")
        t, r, _ = streamed(CMPL, events(door, CMPL, base(CMPL, max_tokens=8, ignore_eos=True, stream=True, **extra)))
        assert (t, r) == (text(tok, want), "length")
    want = greedy(model, chat_ids(tok, C), 8, eos=False)
    got(tok, chat(door, max_tokens=8, temperature=0, ignore_eos=True), want, "length")
    t, r, _ = streamed(CHAT, events(door, CHAT, base(CHAT, max_tokens=8, ignore_eos=True, stream=True)))
    assert (t, r) == (text(tok, want), "length")
    for path in (CMPL, CHAT):
        for bad in (-0.5, 100.5, "hot"):
            refused_both(door, path, base(path, temperature=bad), "temperature", code="invalid_value")


def test_temperature_and_seed_sample_as_the_engine_does(door, engine, model, tok):
    """temperature > 0 with a seed: the engine's seeded sampling offline (both endpoints, both
    paths); the same seed twice gives the same text, another seed another; without temperature
    the default is 1 (OpenAI's), sampled, not greedy."""
    ids = cmpl_ids(tok, Q)
    offline = sampled_each(engine, ids, 8, range(1, 9), temperature=0.8)
    a = 1
    b = first_seed(range(2, 9), lambda s: text(tok, offline[s]) != text(tok, offline[a]))
    for s in (a, b):
        body = dict(max_tokens=8, temperature=0.8, seed=s, ignore_eos=True)
        first, again = cmpl(door, **body), cmpl(door, **body)
        got(tok, first, offline[s], "length")
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        t, _, _ = streamed(CMPL, events(door, CMPL, base(CMPL, stream=True, **body)))  # dash_stream: its own engine
        assert t == text(tok, offline[s])
    assert cmpl(door, max_tokens=8, temperature=0.8, seed=a, ignore_eos=True)["choices"][0]["text"] != text(
        tok, offline[b]
    )
    # the default temperature is 1.0: sampled as the engine samples at 1.0, not greedy
    default = sampled(engine, ids, 8, temperature=1.0, seed=a)
    assert default != greedy(model, ids, 8, eos=False)
    body = {"model": "dash", "prompt": Q, "max_tokens": 8, "seed": a, "ignore_eos": True}
    got(tok, post(door, CMPL, body), default, "length")
    # chat: the same
    cids = chat_ids(tok, C)
    offline = sampled_each(engine, cids, 6, (a, b), temperature=1.5)
    assert offline[a] != offline[b]
    for s in (a, b):
        got(tok, chat(door, max_tokens=6, temperature=1.5, seed=s, ignore_eos=True), offline[s], "length")
        t, _, _ = streamed(
            CHAT, events(door, CHAT, base(CHAT, max_tokens=6, temperature=1.5, seed=s, ignore_eos=True, stream=True))
        )
        assert t == text(tok, offline[s])


def test_seed_bounds(door, engine, tok):
    """seed in 0..2**63-1: the largest is taken (and sampled with, as the engine does), -1 and
    2**63 are a 400 naming seed, on both endpoints and both paths."""
    top = 2**63 - 1
    want = sampled(engine, cmpl_ids(tok, Q), 5, temperature=1.0, seed=top)
    got(tok, cmpl(door, max_tokens=5, temperature=1.0, seed=top, ignore_eos=True), want, "length")
    want = sampled(engine, chat_ids(tok, C), 5, temperature=1.0, seed=0)
    got(tok, chat(door, max_tokens=5, temperature=1.0, seed=0, ignore_eos=True), want, "length")
    for path in (CMPL, CHAT):
        for bad in (-1, 2**63, 1.5, "7x"):
            err = refused_both(door, path, base(path, temperature=1.0, seed=bad), "seed", code="invalid_value")
            if bad == 2**63:
                assert "less than or equal to 9223372036854775807" in err["message"]


# ------------------------------------------------------------------------------ top_k, top_p
def test_top_k(door, engine, model, tok):
    """top_k: the engine's tokens with the same top_k and seed (which differ from top_k off with
    that seed); top_k=1 is greedy; out of range is a 400 naming top_k."""
    ids = cmpl_ids(tok, Q)
    k3 = sampled_each(engine, ids, 8, range(1, 9), temperature=1.0, top_k=3)
    off = sampled_each(engine, ids, 8, range(1, 9), temperature=1.0)
    s = first_seed(range(1, 9), lambda s: text(tok, k3[s]) != text(tok, off[s]))
    got(tok, cmpl(door, max_tokens=8, temperature=1.0, top_k=3, seed=s, ignore_eos=True), k3[s], "length")
    got(tok, cmpl(door, max_tokens=8, temperature=1.0, top_k=0, seed=s, ignore_eos=True), off[s], "length")
    t, _, _ = streamed(
        CMPL,
        events(door, CMPL, base(CMPL, max_tokens=8, temperature=1.0, top_k=3, seed=s, ignore_eos=True, stream=True)),
    )
    assert t == text(tok, k3[s])
    # top_k=1 keeps the most likely token only: greedy, whatever the seed and temperature
    want = greedy(model, ids, 8, eos=False)
    assert off[s] != want
    got(tok, cmpl(door, max_tokens=8, temperature=5.0, top_k=1, seed=s, ignore_eos=True), want, "length")
    cids = chat_ids(tok, C)
    cwant = sampled(engine, cids, 6, temperature=1.0, top_k=3, seed=s)
    got(tok, chat(door, max_tokens=6, temperature=1.0, top_k=3, seed=s, ignore_eos=True), cwant, "length")
    got(
        tok,
        chat(door, max_tokens=6, temperature=5.0, top_k=1, seed=s, ignore_eos=True),
        greedy(model, cids, 6, False),
        "length",
    )
    for path in (CMPL, CHAT):
        for bad in (-1, 2**31, 2.5):
            refused_both(door, path, base(path, temperature=1.0, top_k=bad), "top_k", code="invalid_value")


def test_top_p(door, engine, model, tok):
    """top_p: the engine's tokens with the same top_p and seed (which differ from top_p 1 with
    that seed); a tiny top_p keeps the most likely token only (greedy); (0, 1] enforced."""
    ids = cmpl_ids(tok, Q)
    half = sampled_each(engine, ids, 8, range(1, 9), temperature=1.0, top_p=0.5)
    full = sampled_each(engine, ids, 8, range(1, 9), temperature=1.0)
    s = first_seed(range(1, 9), lambda s: text(tok, half[s]) != text(tok, full[s]))
    got(tok, cmpl(door, max_tokens=8, temperature=1.0, top_p=0.5, seed=s, ignore_eos=True), half[s], "length")
    got(tok, cmpl(door, max_tokens=8, temperature=1.0, top_p=1.0, seed=s, ignore_eos=True), full[s], "length")
    t, _, _ = streamed(
        CMPL,
        events(door, CMPL, base(CMPL, max_tokens=8, temperature=1.0, top_p=0.5, seed=s, ignore_eos=True, stream=True)),
    )
    assert t == text(tok, half[s])
    want = greedy(model, ids, 8, eos=False)
    got(tok, cmpl(door, max_tokens=8, temperature=5.0, top_p=1e-9, seed=s, ignore_eos=True), want, "length")
    cids = chat_ids(tok, C)
    cwant = sampled(engine, cids, 6, temperature=1.0, top_p=0.5, seed=s)
    got(tok, chat(door, max_tokens=6, temperature=1.0, top_p=0.5, seed=s, ignore_eos=True), cwant, "length")
    for path in (CMPL, CHAT):
        for bad in (0, -0.1, 1.01):
            refused_both(door, path, base(path, temperature=1.0, top_p=bad), "top_p", code="invalid_value")


# ------------------------------------------------------------------------------ token limits, EOS
def test_max_tokens_of_completions(door, model, tok):
    """max_tokens: that many tokens and finish_reason "length" (EOS ignored), 16 when left out
    (OpenAI's default), on both paths; 0 and over 2**20 are a 400 naming max_tokens."""
    want = greedy(model, cmpl_ids(tok, Q), 16, eos=False)
    for n in (1, 3):
        got(tok, cmpl(door, max_tokens=n, temperature=0, ignore_eos=True), want[:n], "length")
        t, r, use = streamed(
            CMPL,
            events(
                door,
                CMPL,
                base(CMPL, max_tokens=n, ignore_eos=True, stream=True, stream_options={"include_usage": True}),
            ),
        )
        assert (t, r, use["completion_tokens"]) == (text(tok, want[:n]), "length", n)
    got(tok, post(door, CMPL, {"prompt": Q, "temperature": 0, "ignore_eos": True}), want, "length")
    for bad in (0, -1, 2**20 + 1, 2.5):
        refused_both(door, CMPL, base(CMPL, max_tokens=bad), "max_tokens", code="invalid_value")
    engine_refused(door, base(CMPL, max_tokens=2**20), "max_new_tokens must be 1..")  # past the engine's limit


def test_max_completion_tokens_and_max_tokens_of_chat(door, small_default, model, tok):
    """Chat: max_completion_tokens wins over max_tokens, max_tokens alone counts, and neither
    gives the server's default (5 on the second front door); "length" each time."""
    want = greedy(model, chat_ids(tok, C), 8, eos=False)
    msgs = [{"role": "user", "content": C}]
    for limits, n in (
        ({"max_tokens": 4}, 4),
        ({"max_completion_tokens": 3}, 3),
        ({"max_completion_tokens": 3, "max_tokens": 6}, 3),
        ({"max_completion_tokens": 6, "max_tokens": 2}, 6),
        ({"max_completion_tokens": None, "max_tokens": 2}, 2),
    ):
        got(
            tok,
            post(door, CHAT, {"messages": msgs, "temperature": 0, "ignore_eos": True, **limits}),
            want[:n],
            "length",
        )
        t, r, use = streamed(
            CHAT,
            events(
                door,
                CHAT,
                {"messages": msgs, "temperature": 0, "ignore_eos": True, "stream": True, **limits}
                | {"stream_options": {"include_usage": True}},
            ),
        )
        assert (t, r, use["completion_tokens"]) == (text(tok, want[:n]), "length", n), limits
    got(tok, post(small_default, CHAT, {"messages": msgs, "temperature": 0, "ignore_eos": True}), want[:5], "length")
    for field in ("max_tokens", "max_completion_tokens"):
        for bad in (0, 2**20 + 1):
            refused_both(door, CHAT, {**base(CHAT), field: bad}, field, code="invalid_value")


def test_ignore_eos(door, engine, model, tok):
    """ignore_eos: on a prompt whose greedy answer is EOS, false (the default) stops there with
    finish_reason "stop" (the EOS counted, not shown), true goes on to max_tokens ("length"), on
    both paths. Chat: a seeded sample that draws EOS early, the same."""
    eos = model.config.eos_token_id
    assert eos is not None
    ids = cmpl_ids(tok, EOS_PROMPT)
    assert greedy(model, ids, 6, eos=True) == [eos]  # the prompt's premise
    on = greedy(model, ids, 6, eos=False)
    assert on[0] == eos and eos not in on[1:]
    for body in ({}, {"ignore_eos": False}):
        got(tok, cmpl(door, EOS_PROMPT, max_tokens=6, temperature=0, **body), [eos], "stop")
        t, r, use = streamed(
            CMPL,
            events(
                door,
                CMPL,
                base(
                    CMPL, prompt=EOS_PROMPT, max_tokens=6, stream=True, stream_options={"include_usage": True}, **body
                ),
            ),
        )
        assert (t, r, use["completion_tokens"]) == ("", "stop", 1)
    got(tok, cmpl(door, EOS_PROMPT, max_tokens=6, temperature=0, ignore_eos=True), on, "length")
    t, r, _ = streamed(
        CMPL, events(door, CMPL, base(CMPL, prompt=EOS_PROMPT, max_tokens=6, ignore_eos=True, stream=True))
    )
    assert (t, r) == (text(tok, on), "length") and t != ""
    # chat: the first seed whose sample at temperature 100 (near uniform) draws EOS in 2nd..7th place
    cids = chat_ids(tok, C)
    runs = sampled_each(engine, cids, 8, range(400), temperature=100.0)
    s = first_seed(range(400), lambda s: eos in runs[s][1:7])
    cut = runs[s][: runs[s].index(eos) + 1]
    body = dict(max_tokens=8, temperature=100.0, seed=s)
    got(tok, chat(door, **body), cut, "stop")
    got(tok, chat(door, ignore_eos=False, **body), cut, "stop")
    got(tok, chat(door, ignore_eos=True, **body), runs[s], "length")
    t, r, _ = streamed(CHAT, events(door, CHAT, base(CHAT, stream=True, **body)))
    assert (t, r) == (text(tok, cut), "stop")
    for path in (CMPL, CHAT):
        refused_both(door, path, base(path, ignore_eos="sometimes"), "ignore_eos", code="invalid_value")


# ------------------------------------------------------------------------------ stream, usage
def test_stream_and_include_usage(door, model, tok):
    """stream: the concatenated deltas are the non-streamed text, with the same finish_reason;
    stream_options.include_usage: a last chunk with no choices and the usage, only when asked;
    usage = the token counts (prompt: the prompt's ids, BOS included; completion; total)."""
    for path, ids in ((CMPL, cmpl_ids(tok, Q)), (CHAT, chat_ids(tok, C))):
        want = greedy(model, ids, 7, eos=False)
        plain = post(door, path, base(path, max_tokens=7, ignore_eos=True))
        t, r, use = answer(path, plain)
        assert (t, r) == (text(tok, want), "length")
        assert (use["prompt_tokens"], use["completion_tokens"], use["total_tokens"]) == (len(ids), 7, len(ids) + 7)
        for options, with_usage in (
            (None, False),
            ({}, False),
            ({"include_usage": False}, False),
            ({"include_usage": True}, True),
        ):
            body = base(path, max_tokens=7, ignore_eos=True, stream=True)
            if options is not None:
                body["stream_options"] = options
            evs = events(door, path, body)
            st, sr, su = streamed(path, evs)
            assert (st, sr) == (t, r), options
            assert all(e["model"] == "dash" and e["id"] == evs[0]["id"] for e in evs)
            assert all(e["object"] == ("text_completion" if path == CMPL else "chat.completion.chunk") for e in evs)
            if with_usage:
                assert {k: su[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")} == {
                    k: use[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")
                }
            else:
                assert su is None and all(e["choices"] for e in evs)
            if path == CHAT:
                assert evs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        # stream false is the JSON answer; a non-boolean stream is a 400
        assert post(door, path, base(path, max_tokens=7, ignore_eos=True, stream=False))["choices"] == plain["choices"]
        refused(door, path, base(path, stream="please"), "stream", code="invalid_value")
        refused(
            door, path, base(path, stream=True, stream_options={"include_usage": "x"}), "stream_options.include_usage"
        )
    # several prompts in one streamed completion: usage sums them, each choice its own text
    prompts = [Q, prompt_text(2)]
    evs = events(
        door,
        CMPL,
        base(CMPL, prompt=prompts, max_tokens=3, ignore_eos=True, stream=True, stream_options={"include_usage": True}),
    )
    for i, p in enumerate(prompts):
        mine = "".join(e["choices"][0]["text"] for e in evs if e["choices"] and e["choices"][0]["index"] == i)
        assert mine == text(tok, greedy(model, cmpl_ids(tok, p), 3, eos=False))
    n_prompt = sum(len(cmpl_ids(tok, p)) for p in prompts)
    assert evs[-1]["usage"]["prompt_tokens"] == n_prompt and evs[-1]["usage"]["completion_tokens"] == 6
    assert evs[-1]["usage"]["total_tokens"] == n_prompt + 6


# ------------------------------------------------------------------------------ neutral-only fields
def test_n(door):
    """n: 1 gives one choice; 0 and 2 are a 400 naming n (the official client too)."""
    for path in (CMPL, CHAT):
        assert len(post(door, path, base(path, n=1))["choices"]) == 1
        for bad in (0, 2):
            refused_both(door, path, base(path, n=bad), "n", code="invalid_value")
    with pytest.raises(openai.BadRequestError) as e:
        client(door, max_retries=0).chat.completions.create(
            model="dash", messages=[{"role": "user", "content": C}], max_tokens=2, n=2
        )
    assert e.value.body["param"] == "n"


def test_best_of_echo_suffix_logprobs_of_completions(door, model, tok):
    """best_of 1, echo false, suffix "", logprobs null / 0: accepted, the answer unchanged (no
    prompt echoed, logprobs null); other values are a 400 naming the field."""
    want = text(tok, greedy(model, cmpl_ids(tok, Q), 3, eos=False))
    for neutral in (
        {"best_of": 1},
        {"best_of": None},
        {"echo": False},
        {"suffix": ""},
        {"suffix": None},
        {"logprobs": None},
        {"logprobs": 0},
    ):
        body = post(door, CMPL, base(CMPL, max_tokens=3, ignore_eos=True, **neutral))
        assert body["choices"][0]["text"] == want and body["choices"][0]["logprobs"] is None, neutral
    for field, bad in (
        ("best_of", 2),
        ("best_of", 0),
        ("echo", True),
        ("suffix", "tail"),
        ("logprobs", 1),
        ("logprobs", 5),
    ):
        refused_both(door, CMPL, base(CMPL, **{field: bad}), field, code="invalid_value")
    # fields of the other endpoint are unknown here
    for field, value in (("max_completion_tokens", 2), ("top_logprobs", 0), ("response_format", {"type": "text"})):
        refused(door, CMPL, base(CMPL, **{field: value}), field, code="unknown_parameter")


def test_logprobs_top_logprobs_of_chat(door, model, tok):
    """Chat: logprobs false / null and top_logprobs 0 / null accepted (logprobs null in the
    answer); logprobs true and top_logprobs > 0 are a 400 naming the field."""
    want = text(tok, greedy(model, chat_ids(tok, C), 3, eos=False))
    for neutral in ({"logprobs": False}, {"logprobs": None}, {"top_logprobs": 0}, {"top_logprobs": None}):
        body = post(door, CHAT, base(CHAT, max_tokens=3, ignore_eos=True, **neutral))
        assert body["choices"][0]["message"]["content"] == want and body["choices"][0]["logprobs"] is None
    for field, bad in (("logprobs", True), ("top_logprobs", 1), ("top_logprobs", -1)):
        refused_both(door, CHAT, base(CHAT, **{field: bad}), field, code="invalid_value")
    for field, value in (("best_of", 1), ("echo", False), ("suffix", ""), ("prompt", Q)):
        refused(door, CHAT, base(CHAT, **{field: value}), field, code="unknown_parameter")


def test_presence_and_frequency_penalty(door, model, tok):
    """Penalties: 0 accepted (no effect); anything else is a 400 naming the penalty."""
    for path, ids in ((CMPL, cmpl_ids(tok, Q)), (CHAT, chat_ids(tok, C))):
        want = text(tok, greedy(model, ids, 3, eos=False))
        for field in ("presence_penalty", "frequency_penalty"):
            body = post(door, path, base(path, max_tokens=3, ignore_eos=True, **{field: 0}))
            assert answer(path, body)[0] == want
            for bad in (0.5, -0.5, 2.0):
                refused_both(door, path, base(path, **{field: bad}), field, code="invalid_value")


def test_logit_bias(door, model, tok):
    """logit_bias: {} and null accepted (no effect); a non-empty map is a 400 naming logit_bias."""
    for path, ids in ((CMPL, cmpl_ids(tok, Q)), (CHAT, chat_ids(tok, C))):
        want = text(tok, greedy(model, ids, 3, eos=False))
        for neutral in ({}, None):
            assert (
                answer(path, post(door, path, base(path, max_tokens=3, ignore_eos=True, logit_bias=neutral)))[0] == want
            )
        err = refused_both(door, path, base(path, logit_bias={"50": 100}), "logit_bias", code="invalid_value")
        assert "not supported" in err["message"]
        refused(door, path, base(path, logit_bias=[1, 2]), "logit_bias", code="invalid_value")


def test_stop(door, model, tok):
    """stop: "", [] and null accepted, no effect (the answer runs to max_tokens); a text stop,
    as a string or in a list, is a 400 naming stop that points to stop_token_ids."""
    for path, ids in ((CMPL, cmpl_ids(tok, Q)), (CHAT, chat_ids(tok, C))):
        want = greedy(model, ids, 5, eos=False)
        for neutral in ("", [], None):
            body = post(door, path, base(path, max_tokens=5, ignore_eos=True, stop=neutral))
            got(tok, body, want, "length")
        # a stop text that is in the answer would cut it if it were applied
        piece = text(tok, want[1:2]) or "x"
        for bad in (piece, [piece], [""], ["a", "b"]):
            err = refused_both(door, path, base(path, stop=bad), "stop", code="invalid_value")
            assert "stop_token_ids" in err["message"]


def test_stop_token_ids(door, model, tok):
    """stop_token_ids (vLLM's) on chat: ends at the first stop id, kept and counted, "stop";
    on both paths; ids outside 0..2**31-1 or more than 256 are a 400 naming the field."""
    want = greedy(model, chat_ids(tok, C), 8, eos=False)
    stop = want[3]
    cut = want[: want.index(stop) + 1]
    got(tok, chat(door, max_tokens=8, temperature=0, ignore_eos=True, stop_token_ids=[stop]), cut, "stop")
    t, r, _ = streamed(
        CHAT, events(door, CHAT, base(CHAT, max_tokens=8, ignore_eos=True, stop_token_ids=[stop], stream=True))
    )
    assert (t, r) == (text(tok, cut), "stop")
    got(tok, chat(door, max_tokens=8, temperature=0, ignore_eos=True, stop_token_ids=[]), want, "length")
    for path in (CMPL, CHAT):
        for bad in ([-1], [2**31], list(range(257)), 5):
            refused_both(door, path, base(path, stop_token_ids=bad), "stop_token_ids", code="invalid_value")
    vocab = model.config.vocab_size
    engine_refused(door, base(CMPL, stop_token_ids=[vocab]), f"stop_token_ids must be token ids in 0..{vocab - 1}")


def test_user(door, model, tok):
    """user: accepted, no effect; at most 256 characters (257 is a 400 naming user)."""
    for path, ids in ((CMPL, cmpl_ids(tok, Q)), (CHAT, chat_ids(tok, C))):
        want = text(tok, greedy(model, ids, 3, eos=False))
        for u in ("alice", "u" * 256):
            assert answer(path, post(door, path, base(path, max_tokens=3, ignore_eos=True, user=u)))[0] == want
        refused_both(door, path, base(path, user="u" * 257), "user", code="invalid_value")
        refused(door, path, base(path, user=7), "user", code="invalid_value")


def test_response_format(door, model, tok):
    """response_format: {"type": "text"} accepted (no effect); json_object and json_schema are
    a 400 naming response_format."""
    want = text(tok, greedy(model, chat_ids(tok, C), 3, eos=False))
    for neutral in ({"type": "text"}, None):
        assert (
            answer(CHAT, chat(door, max_tokens=3, temperature=0, ignore_eos=True, response_format=neutral))[0] == want
        )
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    for bad in ({"type": "json_object"}, schema, "json"):
        refused_both(door, CHAT, base(CHAT, response_format=bad), "response_format", code="invalid_value")


def test_parallel_tool_calls(door, model, tok):
    """parallel_tool_calls: true / false / null accepted (no tools here: no effect); a non-boolean
    is a 400 naming it; tools themselves are an unknown parameter."""
    want = text(tok, greedy(model, chat_ids(tok, C), 3, eos=False))
    for v in (True, False, None):
        body = chat(door, max_tokens=3, temperature=0, ignore_eos=True, parallel_tool_calls=v)
        assert answer(CHAT, body)[0] == want and "tool_calls" not in body["choices"][0]["message"]
    refused_both(door, CHAT, base(CHAT, parallel_tool_calls="maybe"), "parallel_tool_calls", code="invalid_value")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    refused(door, CHAT, base(CHAT, tools=tools), "tools", code="unknown_parameter")


def test_model(door, model, tok):
    """model: the served name, or none, answers (the answer names "dash"); another name is a 404
    not_found_error model_not_found naming model, streamed or not, on both endpoints (and
    /v1/models/{id})."""
    for path, ids in ((CMPL, cmpl_ids(tok, Q)), (CHAT, chat_ids(tok, C))):
        want = text(tok, greedy(model, ids, 3, eos=False))
        for name in ("dash", None, "absent"):
            body = base(path, max_tokens=3, ignore_eos=True)
            if name == "absent":
                del body["model"]
            else:
                body["model"] = name
            r = post(door, path, body)
            assert r["model"] == "dash" and answer(path, r)[0] == want
        for other in ("gpt-4o", "Dash", "dash "):
            err = refused_both(door, path, base(path, model=other), "model", status=404, code="model_not_found")
            assert repr(other) in err["message"] and "'dash'" in err["message"]
        refused(door, path, base(path, model=3), "model", code="invalid_value")
    r = httpx.get(door.url + "/v1/models/gpt-4o", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert httpx.get(door.url + "/v1/models/dash", timeout=30).json()["id"] == "dash"


def test_crop(door, folder):
    """crop (chat with an image): auto (and none) crops a single page as on does (more image
    tokens: the tiles), off gives the global view only; the counts are the processor's; another
    value is a 400 naming crop. Without an image crop is accepted and changes nothing."""
    from dash_trt.documents.views import ViewSpec, image_token_count

    with open(folder / "config.json") as fh:
        spec = ViewSpec.from_config(json.load(fh))
    w, h = 300, 400
    on, off = image_token_count(w, h, spec, True), image_token_count(w, h, spec, False)
    assert on > off
    content = [
        {"type": "text", "text": "Read it."},
        {"type": "image_url", "image_url": {"url": data_url(png(w, h), "image/png")}},
    ]
    for crop, n in (("auto", on), (None, on), ("on", on), ("off", off)):
        body = post(door, CHAT, base(CHAT, messages=[{"role": "user", "content": content}], max_tokens=2, crop=crop))
        details = body["usage"]["prompt_tokens_details"]
        assert (details["image_tokens"], details["pages"]) == (n, 1), crop
        assert body["usage"]["prompt_tokens"] > n
    msgs = [{"role": "user", "content": content}]
    for bad in ("yes", True, "ON"):
        refused_both(door, CHAT, base(CHAT, messages=msgs, crop=bad), "crop", code="invalid_value")
    plain = post(door, CHAT, base(CHAT, max_tokens=3))
    assert post(door, CHAT, base(CHAT, max_tokens=3, crop="off"))["choices"] == plain["choices"]
    refused(door, CMPL, base(CMPL, crop="on"), "crop", code="unknown_parameter")


def test_sampling_fields_with_a_document_are_refused_unless_greedy(door):
    """A chat with an image is a document, transcribed greedily: a sampling field set to anything
    but its greedy value is a 400 naming it (it would otherwise be ignored silently); greedy
    values, and leaving the fields out, are answered alike."""
    content = [
        {"type": "text", "text": "Read it."},
        {"type": "image_url", "image_url": {"url": data_url(png(120, 90), "image/png")}},
    ]
    msgs = [{"role": "user", "content": content}]
    plain = post(door, CHAT, {"model": "dash", "messages": msgs, "max_tokens": 3})
    neutral = dict(temperature=0, top_p=1.0, top_k=0, stop_token_ids=[], ignore_eos=False)
    assert post(door, CHAT, base(CHAT, messages=msgs, max_tokens=3, **neutral))["choices"] == plain["choices"]
    for name, value in (
        ("temperature", 0.7),
        ("top_p", 0.5),
        ("top_k", 5),
        ("seed", 3),
        ("stop_token_ids", [5]),
        ("ignore_eos", True),
    ):
        err = refused_both(door, CHAT, base(CHAT, messages=msgs, **{name: value}), name)
        assert "transcribed greedily" in err["message"]


def test_unknown_fields_are_refused(door):
    """extra=forbid: an unknown field, top-level or nested, is a 400 unknown_parameter naming it
    (streamed or not); a misspelt field does not pass silently."""
    for path in (CMPL, CHAT):
        for field in ("temprature", "max_token", "foo", "functions"):
            err = refused_both(door, path, base(path, **{field: 1}), field, code="unknown_parameter")
            assert err["message"] == f"unknown parameter: {field}"
        refused(
            door,
            path,
            base(path, stream=True, stream_options={"include_usage": True, "x": 1}),
            "stream_options.x",
            code="unknown_parameter",
        )
    msgs = [{"role": "user", "content": C, "colour": "blue"}]
    refused(door, CHAT, base(CHAT, messages=msgs), "messages.colour", code="unknown_parameter")
    with pytest.raises(openai.BadRequestError) as e:
        client(door, max_retries=0).chat.completions.create(
            model="dash", messages=[{"role": "user", "content": C}], max_tokens=2, extra_body={"top_a": 1}
        )
    assert e.value.body["param"] == "top_a" and e.value.body["code"] == "unknown_parameter"


# ------------------------------------------------------------------------------ prompt, messages
def test_prompt_forms(door, model, tok):
    """prompt: text (BOS added), token ids (taken as they are), a list of texts or of id lists
    (one choice each, in order); empty or too many prompts are a 400 naming prompt."""
    ids = cmpl_ids(tok, Q)
    want = greedy(model, ids, 4, eos=False)
    for prompt in (Q, ids):
        body = cmpl(door, prompt, max_tokens=4, temperature=0, ignore_eos=True)
        got(tok, body, want, "length")
        assert body["usage"]["prompt_tokens"] == len(ids)
    other = cmpl_ids(tok, prompt_text(2))
    both = [want, greedy(model, other, 4, eos=False)]
    for prompt in ([Q, prompt_text(2)], [ids, other]):
        body = cmpl(door, prompt, max_tokens=4, temperature=0, ignore_eos=True)
        assert [c["index"] for c in body["choices"]] == [0, 1]
        assert [c["text"] for c in body["choices"]] == [text(tok, w) for w in both]
        assert body["usage"]["prompt_tokens"] == len(ids) + len(other) and body["usage"]["completion_tokens"] == 8
    for bad in ("", [], [[]], [""], [Q] * 65, [-1], [Q, 3]):
        refused_both(door, CMPL, base(CMPL, prompt=bad), "prompt", code="invalid_value")
    body = base(CMPL)
    del body["prompt"]
    refused(door, CMPL, body, "prompt", code="missing_required_parameter")
    vocab = model.config.vocab_size
    engine_refused(door, base(CMPL, prompt=[*ids, vocab]), f"outside the vocabulary 0..{vocab - 1}")
    engine_refused(door, base(CMPL, prompt="no page here"), "bad prompt")


def test_image_features(door, model, tok):
    """image_features (one row per <image> token): the offline tokens with those features, not
    the ones without; a ragged or wrongly shaped list is a 400 naming image_features."""
    ids = cmpl_ids(tok, Q)
    rows = ids.count(model.config.image_token_id)
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(rows, model.config.image_feature_dim, generator=g)
    with one_thread():
        want = M.generate(model, [ids], 5, stop_at_eos=False, image_features=[feats]).tokens[0]
    assert want != greedy(model, ids, 5, eos=False)
    body = cmpl(door, max_tokens=5, temperature=0, ignore_eos=True, image_features=feats.tolist())
    got(tok, body, want, "length")
    t, _, _ = streamed(
        CMPL, events(door, CMPL, base(CMPL, max_tokens=5, ignore_eos=True, stream=True, image_features=feats.tolist()))
    )
    assert t == text(tok, want)
    flat = feats.reshape(-1).tolist()
    ragged = [feats[0].tolist(), feats[1, :5].tolist()]
    for bad in (flat, ragged, [["a"] * 3], "x"):
        refused_both(door, CMPL, base(CMPL, image_features=bad), "image_features", code="invalid_value")
    refused(door, CMPL, base(CMPL, prompt=[Q, Q], image_features=feats.tolist()), "image_features")
    # the shape the model needs is the engine's check (one row per <image>, image_feature_dim columns)
    engine_refused(door, base(CMPL, image_features=feats[1:].tolist()), f"image_features has {rows - 1} rows")
    engine_refused(door, base(CMPL, image_features=feats[:, 1:].tolist()), "image_features must be [image tokens,")
    refused(door, CHAT, base(CHAT, image_features=feats.tolist()), "image_features", code="unknown_parameter")


def test_messages(door, model, tok):
    """messages: through the chat template (``role: content`` lines, then ``assistant: ``) with
    every role; text parts are joined as the string content; name is accepted and not rendered;
    a bad role, no messages or a missing content type is a 400 naming messages."""
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": "Plain text."},
        {"role": "user", "content": C, "name": "alice"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "More?"},
    ]
    rendered = "".join(f"{m['role']}: {m['content']}\n" for m in msgs) + "assistant: "
    ids = tok.encode(rendered)
    want = greedy(model, ids, 4, eos=False)
    body = post(door, CHAT, base(CHAT, messages=msgs, max_tokens=4, ignore_eos=True))
    got(tok, body, want, "length")
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert body["choices"][0]["message"]["role"] == "assistant" and body["object"] == "chat.completion"
    parts = [{"type": "text", "text": C[:10]}, {"type": "text", "text": C[10:]}]
    got(
        tok,
        chat(door, parts, max_tokens=4, temperature=0, ignore_eos=True),
        greedy(model, chat_ids(tok, C), 4, eos=False),
        "length",
    )
    refused(door, CHAT, base(CHAT, messages=[]), "messages", code="invalid_value")
    refused(door, CHAT, base(CHAT, messages=[{"role": "tool", "content": "x"}]), "messages.role", code="invalid_value")
    for parts in ([{"text": "x"}], [{"type": "audio", "audio": "x"}]):
        refused(door, CHAT, base(CHAT, messages=[{"role": "user", "content": parts}]), "messages.content")
    parts = [{"type": "text", "text": "x", "bold": True}]  # the part's own error names its field
    refused(door, CHAT, base(CHAT, messages=[{"role": "user", "content": parts}]), "messages.content.bold")
    refused(door, CHAT, base(CHAT, messages=[{"role": "user", "content": C, "name": "n" * 65}]), "messages.name")
    body = base(CHAT)
    del body["messages"]
    refused(door, CHAT, body, "messages", code="missing_required_parameter")


def test_null_is_the_default(door, engine, model, tok):
    """OpenAI's nullable fields (temperature, top_p, n, stream, penalties, max_tokens of
    completions, echo, ...): null means the default, as OpenAI's API takes it."""
    ids = cmpl_ids(tok, Q)
    want = greedy(model, ids, 16, eos=False)
    nulls = {
        "top_p": None,
        "n": None,
        "stream": None,
        "presence_penalty": None,
        "frequency_penalty": None,
        "max_tokens": None,
        "echo": None,
        "top_k": None,
        "seed": None,
        "stop": None,
        "logit_bias": None,
        "user": None,
        "stream_options": None,
    }
    body = post(door, CMPL, {"model": "dash", "prompt": Q, "temperature": 0, "ignore_eos": True, **nulls})
    got(tok, body, want, "length")  # max_tokens null: 16
    cnulls = {k: v for k, v in nulls.items() if k not in ("max_tokens", "echo")} | {
        "max_tokens": 3,
        "top_logprobs": None,
    }
    body = post(door, CHAT, base(CHAT, ignore_eos=True, **cnulls))
    got(tok, body, greedy(model, chat_ids(tok, C), 3, eos=False), "length")
    # temperature null: the default, 1 (sampled with the seed as the engine samples at 1.0, not greedy)
    for path, pids in ((CMPL, ids), (CHAT, chat_ids(tok, C))):
        want = sampled(engine, pids, 6, temperature=1.0, seed=3)
        assert want != greedy(model, pids, 6, eos=False)
        got(
            tok,
            post(door, path, {**base(path, max_tokens=6, seed=3, ignore_eos=True), "temperature": None}),
            want,
            "length",
        )
    # ignore_eos null: false (stops at EOS)
    got(tok, cmpl(door, EOS_PROMPT, max_tokens=6, temperature=0, ignore_eos=None), [model.config.eos_token_id], "stop")
    # a required field null is missing
    refused(door, CMPL, {**base(CMPL), "prompt": None}, "prompt", code="missing_required_parameter")
    refused(door, CHAT, {**base(CHAT), "messages": None}, "messages", code="missing_required_parameter")
    # an unknown field is refused even when null
    refused(door, CMPL, base(CMPL, temprature=None), "temprature", code="unknown_parameter")
