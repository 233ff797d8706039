"""The front door's limits without a server: the body guard (size cap, stall timeout, absolute
deadline) on a scripted ASGI ``receive`` and clock, and a prompt's length checked before it is
tokenized, the tokenizing done off the event loop."""

import asyncio
import random
import threading
import types

import pytest

pytest.importorskip("fastapi")

from dash_trt.frontdoor.http_guard import BodyTimeout, BodyTooLarge, _BodyGuard  # noqa: E402


class Script:
    """``receive`` returning the given chunks at once, and a clock moved by ``step`` seconds
    at each chunk: a client sending a byte every ``step`` seconds."""

    def __init__(self, chunks: list[bytes], step: float):
        self.chunks, self.step, self.now = list(chunks), step, 0.0

    def clock(self) -> float:
        return self.now

    async def receive(self):
        self.now += self.step
        body = self.chunks.pop(0)
        return {"type": "http.request", "body": body, "more_body": bool(self.chunks)}


def drain(guard) -> int:
    async def run():
        n = 0
        while True:
            m = await guard()
            n += len(m["body"])
            if not m["more_body"]:
                return n

    return asyncio.run(run())


def test_a_trickle_inside_every_stall_timeout_meets_the_deadline():
    # one byte every 20 s never stalls 30 s, but 100 of them take 2,000 s: refused at 300 s
    s = Script([b"x"] * 100, step=20.0)
    with pytest.raises(BodyTimeout) as e:
        drain(_BodyGuard(s.receive, 1 << 20, 30.0, 300.0, done=False, clock=s.clock))
    assert "not complete within 300 s" in e.value.reason
    assert s.now == pytest.approx(300.0)  # refused at the first read past the deadline
    assert len(s.chunks) == 100 - 15


def test_a_body_inside_the_deadline_passes_whole():
    s = Script([b"ab"] * 10, step=20.0)  # 200 s in all
    assert drain(_BodyGuard(s.receive, 1 << 20, 30.0, 300.0, done=False, clock=s.clock)) == 20


def test_the_cap_counts_every_chunk():
    s = Script([b"x" * 600] * 2, step=0.0)
    with pytest.raises(BodyTooLarge):
        drain(_BodyGuard(s.receive, 1000, 30.0, 300.0, done=False, clock=s.clock))


def test_a_stall_is_told_apart_from_the_deadline():
    async def never():
        await asyncio.sleep(3600)

    async def run(timeout, deadline):
        with pytest.raises(BodyTimeout) as e:
            await _BodyGuard(never, 1000, timeout, deadline, done=False)()
        return e.value.reason

    # real waits of 0.05 s: whichever bound is nearer decides, and says which it was
    assert "stalled for 0.05 s" in asyncio.run(run(0.05, 300.0))
    assert "not complete within 0.05 s" in asyncio.run(run(300.0, 0.05))


# ----------------------------------------------------------------------------- prompt length
def test_longest_request_from_an_engine_config():
    from dash_trt.serving.limits import DEFAULT_MAX_MODEL_LEN, longest_request

    assert longest_request({"max_model_len": 4096, "num_blocks": 8, "kv_block_size": 16}) == 4096
    assert longest_request({"num_blocks": 8, "kv_block_size": 16}) == 128  # the pool
    assert longest_request('{"num_blocks": 100000, "kv_block_size": 64}') == DEFAULT_MAX_MODEL_LEN
    # a pool sized from GPU memory is unknown until made: the cap, never a smaller guess
    assert longest_request({"num_blocks": 8, "kv_block_size": 16, "gpu_memory_fraction": 0.9}) == DEFAULT_MAX_MODEL_LEN


def _bpe(byte_level: bool):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from dash_trt.documents.tokenizer import TextTokenizer

    t = Tokenizer(models.BPE())
    alphabet = []
    if byte_level:
        t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        t.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    text = ["the quick brown fox jumps over the lazy dog " * 20, "=" * 64 + " tables | cells | rows"]
    t.train_from_iterator(text, trainers.BpeTrainer(vocab_size=400, initial_alphabet=alphabet))
    return TextTokenizer(t)


def test_max_token_chars_bounds_every_text():
    """``len(text) <= tokens * max_token_chars`` for a byte-level BPE vocabulary, on texts made
    of its own longest entries, other scripts and random bytes; None where an unknown token can
    stand for a run of text."""
    from tokenizers import Tokenizer, models

    from dash_trt.documents.tokenizer import TextTokenizer

    tok = _bpe(byte_level=True)
    per = tok.max_token_chars
    assert per == max(len(t) for t in tok.tokenizer.get_vocab())
    rng = random.Random(0)
    texts = ["=" * 640, "the quick brown fox " * 50, "\u6587\u5b57 \u00e9\u0301 \U0001f600" * 30]
    texts += ["".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(rng.randrange(1, 400))) for _ in range(50)]
    for text in texts:
        assert len(text) <= len(tok.encode(text)) * per
    assert TextTokenizer(Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))).max_token_chars is None


class _Recorder:
    """A tokenizer that records the thread it runs on."""

    max_token_chars = 7
    bos_id = None

    def __init__(self):
        self.threads = []

    def encode(self, text):
        self.threads.append(threading.get_ident())
        return [1] * len(text)


def _endpoint(max_prompt_tokens):
    from dash_trt.frontdoor.endpoint import Endpoint
    from dash_trt.frontdoor.settings import FrontDoorSettings

    tok = _Recorder()
    backend = types.SimpleNamespace(tokenizer=tok, max_prompt_tokens=max_prompt_tokens, max_token_chars=7)
    return Endpoint(FrontDoorSettings(), None, {"backend": backend}), tok


def test_a_prompt_too_long_is_refused_before_tokenizing():
    from dash_trt.frontdoor.models import APIError

    ep, tok = _endpoint(max_prompt_tokens=10)
    assert asyncio.run(ep.encode("x" * 70)) == [1] * 70  # 70 characters may still be 10 tokens
    with pytest.raises(APIError) as e:
        asyncio.run(ep.encode("x" * 71))  # 71 cannot: at most 7 characters a token
    assert e.value.status == 400 and e.value.code == "context_length_exceeded"
    assert "71 characters" in str(e.value) and "10 tokens" in str(e.value)
    assert len(tok.threads) == 1  # the refused one was never tokenized
    ep, tok = _endpoint(max_prompt_tokens=None)  # a repository that does not say: not checked
    assert len(asyncio.run(ep.encode("x" * 1000))) == 1000


def test_tokenizing_runs_off_the_event_loop():
    ep, tok = _endpoint(max_prompt_tokens=None)

    async def run():
        await ep.encode("some text")
        return threading.get_ident()  # the event loop's thread

    loop_thread = asyncio.run(run())
    assert len(tok.threads) == 1 and tok.threads[0] != loop_thread
