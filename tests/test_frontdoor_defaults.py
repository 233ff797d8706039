"""The OpenAI front door's defaults and finish_reason over a recording backend (no Triton): the
completions defaults (max_tokens 16, temperature 1, EOS stops), chat's 2048 default and
max_completion_tokens over max_tokens, and a stop id or EOS at the last allowed position
finishing with "stop" (vLLM's rule)."""

from __future__ import annotations

import pytest

from dash_trt import model as M


@pytest.fixture(scope="module")
def door():
    from fastapi.testclient import TestClient

    from dash_trt.documents.tokenizer import ByteTokenizer
    from dash_trt.triton.openai import FrontDoorSettings, create_app

    cfg = M.demo_model().config

    class Recording:
        def __init__(self):
            self.config, self.tokenizer, self.calls, self.answer = cfg, ByteTokenizer(cfg), [], None

        async def start(self):
            pass

        async def close(self):
            pass

        async def ready(self):
            return True

        async def generate(self, ids, max_tokens, stop_at_eos, stop_ids, sampling, features=None):
            self.calls.append(dict(max_tokens=max_tokens, stop_at_eos=stop_at_eos, sampling=sampling))
            return (self.answer(max_tokens) if self.answer else [65] * max_tokens), 0

    fake = Recording()
    with TestClient(create_app(FrontDoorSettings(allow_control_text=True), backend=fake)) as c:
        yield c, fake


def test_completions_defaults_are_openai_s(door):
    c, fake = door
    c.post("/v1/completions", json={"prompt": "<PAGE><image>Hi"}).raise_for_status()
    call = fake.calls[-1]
    assert call["max_tokens"] == 16 and call["stop_at_eos"] is True and call["sampling"]["temperature"] == 1.0
    c.post("/v1/completions", json={"prompt": "<PAGE><image>Hi", "ignore_eos": True}).raise_for_status()
    assert fake.calls[-1]["stop_at_eos"] is False


def test_chat_max_tokens(door):
    c, fake = door
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    c.post("/v1/chat/completions", json=chat).raise_for_status()
    assert fake.calls[-1]["max_tokens"] == 2048
    c.post("/v1/chat/completions", json={**chat, "max_tokens": 5, "max_completion_tokens": 7}).raise_for_status()
    assert fake.calls[-1]["max_tokens"] == 7


def test_a_stop_token_at_the_last_allowed_position_is_stop(door):
    c, fake = door
    eos = M.demo_model().config.eos_token_id
    try:
        fake.answer = lambda n: [65] * (n - 1) + [66]
        r = c.post("/v1/completions", json={"prompt": "<PAGE><image>Hi", "max_tokens": 4, "stop_token_ids": [66]})
        assert r.json()["choices"][0]["finish_reason"] == "stop"
        fake.answer = lambda n: [65] * (n - 1) + [eos]
        r = c.post("/v1/completions", json={"prompt": "<PAGE><image>Hi", "max_tokens": 4})
        assert r.json()["choices"][0]["finish_reason"] == "stop"
        fake.answer = lambda n: [65] * n
        r = c.post("/v1/completions", json={"prompt": "<PAGE><image>Hi", "max_tokens": 4})
        assert r.json()["choices"][0]["finish_reason"] == "length"
    finally:
        fake.answer = None
