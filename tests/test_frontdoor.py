"""The OpenAI front door (dash-triton openai) in front of the real Triton server on CPU, driven by
the real clients: the official openai package (sync, async, streaming, errors, retries),
LangChain's OpenAI wrappers (invoke, stream, batch), raw sockets for the HTTP edge cases, 512
concurrent clients and 200 slow sockets. The model is the tiny Unlimited-OCR-2 folder (a trained
tokenizer, a vision tower and the document model), so chat completions take images and PDFs."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest
import torch
from conftest import running_triton, write_tiny_unlimited_ocr2
from PIL import Image

from dash_trt import model as M
from dash_trt.documents.tokenizer import load_tokenizer

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")  # the openai client's own HTTP library
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY = "sk-test-dash"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_unlimited_ocr2(tmp_path_factory, "frontdoor")


@pytest.fixture(scope="module")
def triton(folder, tmp_path_factory):
    repo = tmp_path_factory.mktemp("frontdoor-repo") / "repo"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "dash_trt.triton.cli",
            "write",
            str(folder),
            "--out",
            str(repo),
            "--num-blocks",
            "1024",
            "--max-num-seqs",
            "256",
            "--torch-threads",
            "1",
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    with running_triton(repo, repo.parent / "tritonserver.log", metrics_port=0) as srv:
        yield srv


@pytest.fixture(scope="module")
def door(triton, folder):
    from dash_trt.triton.openai import FrontDoor, FrontDoorSettings

    settings = FrontDoorSettings(
        triton_grpc=triton.grpc_url,
        tokenizer=str(folder),
        max_body_bytes=1 << 20,
        header_timeout=2.0,
        body_timeout=2.0,
        body_deadline=4.0,
        allow_control_text=True,  # the tests type the page markup
    )
    d = FrontDoor(settings, port=0).start()
    yield d
    d.close()


@pytest.fixture(scope="module")
def keyed(triton, folder):
    from dash_trt.triton.openai import FrontDoor, FrontDoorSettings

    settings = FrontDoorSettings(
        triton_grpc=triton.grpc_url, tokenizer=str(folder), api_key=KEY, allow_control_text=True
    )
    d = FrontDoor(settings, port=0).start()
    yield d
    d.close()


@pytest.fixture(scope="module")
def model(folder):
    return M.load_checkpoint(folder)


@pytest.fixture(scope="module")
def tok(folder):
    return load_tokenizer(folder)


def client(door, **kw):
    return openai.OpenAI(base_url=door.url + "/v1", api_key=kw.pop("api_key", "none"), **kw)


def prompt_text(i: int) -> str:
    return "<PAGE>" + "<image>" * (6 + i) + f"Question {i}?"


def offline(model, tok, text: str, n: int) -> str:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ids = [tok.bos_id, *tok.encode(text)]
        tokens = M.generate(model, [ids], n, stop_at_eos=True).tokens[0]
    finally:
        torch.set_num_threads(threads)
    return tok.decode(tokens, skip_special_tokens=True)


def png(w=300, h=400) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), "white").save(buf, "PNG")
    return buf.getvalue()


def pdf(pages=2) -> bytes:
    ims = [Image.new("RGB", (300 + 50 * i, 400), "white") for i in range(pages)]
    buf = io.BytesIO()
    ims[0].save(buf, "PDF", save_all=True, append_images=ims[1:])
    return buf.getvalue()


def data_url(data: bytes, kind: str) -> str:
    return f"data:{kind};base64," + base64.b64encode(data).decode()


def metric(door, name: str, **labels) -> float:
    import urllib.request

    with urllib.request.urlopen(door.url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(part in line for part in want.split(",")):
            total += float(line.rsplit(" ", 1)[1])
    return total


# ------------------------------------------------------------------------------ the openai client
def test_completions_equal_offline_generation(door, model, tok):
    c = client(door)
    r = c.completions.create(model="dash", prompt=prompt_text(0), max_tokens=8, temperature=0)
    assert r.choices[0].text == offline(model, tok, prompt_text(0), 8)
    assert r.usage.prompt_tokens == len(tok.encode(prompt_text(0))) + 1
    # several prompts in one request (LangChain's batch): one choice each, in order
    r = c.completions.create(model="dash", prompt=[prompt_text(1), prompt_text(2)], max_tokens=5, temperature=0)
    assert [ch.index for ch in r.choices] == [0, 1]
    assert [ch.text for ch in r.choices] == [offline(model, tok, prompt_text(i), 5) for i in (1, 2)]
    # neutral values of unsupported fields are accepted
    r = c.completions.create(
        model="dash",
        prompt=prompt_text(0),
        max_tokens=3,
        temperature=0,
        best_of=1,
        stop=[],
        logit_bias={},
        n=1,
        echo=False,
    )
    assert r.choices[0].text == offline(model, tok, prompt_text(0), 3)
    assert c.models.retrieve("dash").id == "dash" and [m.id for m in c.models.list()] == ["dash"]


def test_streaming_with_a_separate_usage_chunk(door, model, tok):
    c = client(door)
    chunks = list(
        c.completions.create(
            model="dash",
            prompt=prompt_text(3),
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    assert all(ch.usage is None for ch in chunks[:-1])
    assert "".join(ch.choices[0].text for ch in chunks[:-1]) == offline(model, tok, prompt_text(3), 8)
    plain = list(c.completions.create(model="dash", prompt=prompt_text(3), max_tokens=8, temperature=0, stream=True))
    assert all(ch.usage is None for ch in plain)


def test_chat_completions_with_an_image_and_a_two_page_pdf(door):
    c = client(door)
    image = [
        {"type": "text", "text": "Read it."},
        {"type": "image_url", "image_url": {"url": data_url(png(), "image/png")}},
    ]
    doc = [{"type": "file", "file": {"file_data": data_url(pdf(2), "application/pdf"), "filename": "two.pdf"}}]
    for content, pages in ((image, 1), (doc, 2)):
        r = c.chat.completions.create(
            model="dash", messages=[{"role": "user", "content": content}], max_tokens=12, temperature=0
        )
        text = r.choices[0].message.content
        assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens >= 1
        details = r.usage.prompt_tokens_details.model_dump()
        assert details["pages"] == pages and details["image_tokens"] > 0
        if pages == 2:
            assert "<!-- page 1: two.pdf page 1 -->" in text and "<!-- page 2: two.pdf page 2 -->" in text
        stream = c.chat.completions.create(
            model="dash", messages=[{"role": "user", "content": content}], max_tokens=12, temperature=0, stream=True
        )
        assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == text


def test_ocr_endpoint_takes_uploads(door):
    import httpx

    files = [("file", ("scan.png", png(), "image/png")), ("file", ("doc.pdf", pdf(2), "application/pdf"))]
    r = httpx.post(door.url + "/v1/ocr", files=files, data={"max_tokens": "10"}, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    assert [p["source"] for p in body["pages"]] == ["scan.png", "doc.pdf page 1", "doc.pdf page 2"]
    assert body["usage"]["prompt_tokens_details"]["pages"] == 3
    r = httpx.post(door.url + "/v1/ocr", files=[("file", ("bad.pdf", b"%PDF-1.4 junk", "application/pdf"))], timeout=60)
    assert r.status_code == 400 and "bad.pdf: not a readable PDF" in r.json()["error"]["message"]


def test_errors_are_openai_errors_and_4xx_on_both_paths(door):
    c = client(door, max_retries=0)
    cases = [
        (dict(prompt=prompt_text(0), max_tokens=4294967299), "max_tokens", "less than or equal"),
        (dict(prompt=prompt_text(0), extra_body={"top_k": 4294967297}), "top_k", "less than or equal"),
        (dict(prompt=prompt_text(0), stop=["\n"]), "stop", "stop_token_ids"),
        (dict(prompt=prompt_text(0), n=2), "n", "less than or equal to 1"),
        (dict(prompt=""), "prompt", "non-empty"),
    ]
    for kw, param, fragment in cases:
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model="dash", temperature=0, **{"max_tokens": 4, **kw})
        err = e.value.body
        assert err["param"] == param and fragment in err["message"] and err["code"], (kw, err)
    for stream in (False, True):  # a refusal of the engine: 400 on the streaming path too
        with pytest.raises(openai.BadRequestError, match="max_new_tokens must be"):
            c.completions.create(model="dash", prompt=prompt_text(0), max_tokens=900000, temperature=0, stream=stream)
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="other", prompt=prompt_text(0), max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="unknown parameter: temprature"):
        c.completions.create(model="dash", prompt=prompt_text(0), max_tokens=2, extra_body={"temprature": 0})


def test_a_client_error_is_not_retried(door):
    before = metric(door, "dash_frontdoor_requests_total", endpoint="/v1/completions", status="400")
    with pytest.raises(openai.BadRequestError):
        client(door, max_retries=3).completions.create(
            model="dash", prompt=prompt_text(0), max_tokens=900000, stream=True
        )
    assert metric(door, "dash_frontdoor_requests_total", endpoint="/v1/completions", status="400") == before + 1


def test_the_api_key(keyed):
    with pytest.raises(openai.AuthenticationError) as e:
        client(keyed, api_key="wrong", max_retries=0).models.list()
    assert e.value.body["code"] == "invalid_api_key"
    assert [m.id for m in client(keyed, api_key=KEY).models.list()] == ["dash"]
    # every endpoint but /health needs it: the metrics and any other path too
    for path in ("/metrics", "/openapi.json", "/anything"):
        r = httpx.get(keyed.url + path)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
        assert httpx.get(keyed.url + path, headers={"Authorization": "Bearer " + KEY[:-1] + "x"}).status_code == 401
    assert httpx.get(keyed.url + "/metrics", headers={"Authorization": "Bearer " + KEY}).status_code == 200
    assert httpx.get(keyed.url + "/health").status_code in (200, 503)


def test_async_client(door, model, tok):
    async def run():
        c = openai.AsyncOpenAI(base_url=door.url + "/v1", api_key="none")
        r = await c.completions.create(model="dash", prompt=prompt_text(4), max_tokens=6, temperature=0)
        s = await c.completions.create(model="dash", prompt=prompt_text(4), max_tokens=6, temperature=0, stream=True)
        text = "".join([ch.choices[0].text async for ch in s])
        await c.close()
        return r.choices[0].text, text

    got, streamed = asyncio.run(run())
    assert got == streamed == offline(model, tok, prompt_text(4), 6)


def test_langchain_invoke_stream_batch(door, model, tok):
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.OpenAI(
        base_url=door.url + "/v1", api_key="none", model="dash", max_tokens=6, temperature=0, max_retries=0
    )
    want = [offline(model, tok, prompt_text(i), 6) for i in (5, 6)]
    assert llm.invoke(prompt_text(5)) == want[0]
    assert "".join(llm.stream(prompt_text(5))) == want[0]
    assert llm.batch([prompt_text(5), prompt_text(6)]) == want
    chat = langchain_openai.ChatOpenAI(
        base_url=door.url + "/v1", api_key="none", model="dash", max_tokens=8, temperature=0, max_retries=0
    )
    from langchain_core.messages import HumanMessage

    msg = HumanMessage(
        content=[
            {"type": "text", "text": "Read."},
            {"type": "image_url", "image_url": {"url": data_url(png(), "image/png")}},
        ]
    )
    answer = chat.invoke([msg]).content
    assert answer == "".join(c.content for c in chat.stream([msg]))


# ------------------------------------------------------------------------------ HTTP, by hand
def _raw(door, data: bytes, timeout: float = 30.0) -> bytes:
    with socket.create_connection(("127.0.0.1", door.port), timeout=timeout) as s:
        s.sendall(data)
        chunks = []
        while True:
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)


def _post_raw(path: str, body: bytes, extra: str = "", ctype: str = "application/json", close=False) -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n{extra}"
    return (head + ("Connection: close\r\n" if close else "") + "\r\n").encode() + body


def test_keep_alive_after_a_404_with_a_body(door):
    body = json.dumps({"prompt": prompt_text(0), "max_tokens": 2, "temperature": 0}).encode()
    out = _raw(door, _post_raw("/v1/nope", b'{"x": 1}') + _post_raw("/v1/completions", body, close=True))
    statuses = re.findall(rb"HTTP/1\.1 (\d{3}) ", out)  # a body does not end in CRLF: the next status follows it
    assert statuses == [b"404", b"200"]


def test_http_defects_of_the_old_proxy(door):
    smuggled = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
        b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    out = _raw(door, smuggled)
    assert out.count(b"HTTP/1.1 ") == 1 and out.startswith(b"HTTP/1.1 400") and b'"object":"list"' not in out
    out = _raw(door, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}")
    assert out.startswith(b"HTTP/1.1 400")
    deep = b"[" * 100000 + b"]" * 100000
    out = _raw(door, _post_raw("/v1/completions", deep[: (1 << 20) - 10], close=True))
    assert out.startswith(b"HTTP/1.1 400") and b"invalid_request_error" in out
    out = _raw(door, _post_raw("/v1/completions", b'{"prompt": "x"}', ctype="text/plain", close=True))
    assert out.startswith(b"HTTP/1.1 415")
    big = b'{"prompt": "' + b"a" * (2 << 20) + b'"}'
    head = _post_raw("/v1/completions", big, close=True)[: -len(big)]
    out = _raw(door, head)  # answered from the headers, before a byte of the 2 MiB body is read
    assert out.startswith(b"HTTP/1.1 413") and b"over 1 MiB" in out
    chunked = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        + b"".join(b"%x\r\n" % (64 << 10) + b"a" * (64 << 10) + b"\r\n" for _ in range(20))
    )
    try:  # no Content-Length: counted as it arrives, refused past 1 MiB
        out = _raw(door, chunked)
    except ConnectionResetError:
        out = b"HTTP/1.1 413 (reset after the answer)"
    assert out.startswith(b"HTTP/1.1 413")
    # a body that stalls: 408 after the body timeout (2 s here), not a socket held forever
    out = _raw(
        door,
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{",
    )
    assert out.startswith(b"HTTP/1.1 408")


def test_a_trickling_body_meets_the_deadline(door):
    """A byte every 0.2 s never stalls the 2 s body timeout, but 99 of them never complete the
    declared 100-byte body: it is answered 408 once 4 s have passed since its first byte (without
    the deadline it would be read for as long as the client kept sending)."""
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    out = b""
    with socket.create_connection(("127.0.0.1", door.port), timeout=30) as s:
        s.sendall(head)
        s.settimeout(0.2)
        for _ in range(99):
            try:
                s.sendall(b" ")
                out = s.recv(65536)
            except TimeoutError:
                continue
            except OSError:  # answered and closed between two bytes
                pass
            break
        s.settimeout(30)
        while not out.endswith(b"}"):
            chunk = s.recv(65536)
            if not chunk:
                break
            out += chunk
    assert out.startswith(b"HTTP/1.1 408"), out[:200]
    assert b"not complete within 4 s" in out, out


def test_malformed_json_is_a_400_on_every_json_route(door):
    """A body that is not a JSON object (cut short, not UTF-8, an array, a bare value, empty) is
    the client's error: 400 with OpenAI's error object on both JSON routes, never a 5xx."""
    for path in ("/v1/completions", "/v1/chat/completions"):
        bad = (b'{"prompt": "x", "max_tokens": ', b'{"prompt": "\xff\xfe"}', b"[1, 2]", b"17", b"")
        # a lone surrogate, an integer past Python's 4300-digit limit (both were plain-text 500s)
        bad += (b'{"prompt": "a\\ud800b", "max_tokens": 2}', b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}")
        for body in bad:
            out = _raw(door, _post_raw(path, body, close=True))
            assert out.startswith(b"HTTP/1.1 400"), (path, body, out[:200])
            error = json.loads(out.split(b"\r\n\r\n", 1)[1])["error"]
            assert error["type"] == "invalid_request_error" and error["message"], (path, body, error)


@pytest.fixture
def roomy_door(triton, folder):
    """A front door whose header timeout (10 s) leaves room for an event loop slowed by 700
    connections on a loaded machine: a timer that fires before the loop reads headers already
    sent would cut a well-behaved client (the slowloris sockets are still closed by it)."""
    from dash_trt.triton.openai import FrontDoor, FrontDoorSettings

    settings = FrontDoorSettings(
        triton_grpc=triton.grpc_url, tokenizer=str(folder), header_timeout=10.0, allow_control_text=True
    )
    d = FrontDoor(settings, port=0).start()
    yield d
    d.close()


def test_512_concurrent_clients_and_200_slow_sockets(roomy_door, model, tok):
    """512 clients at once: no connection reset, every answer equal to offline generation; 200
    slowloris sockets opened first do not stop them and are closed by the header timeout."""
    import httpx

    door = roomy_door

    want = {i: offline(model, tok, prompt_text(i), 4) for i in range(8)}
    slow = []
    for _ in range(200):
        s = socket.create_connection(("127.0.0.1", door.port), timeout=60)
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")  # never finished
        slow.append(s)

    async def burst():
        limits = httpx.Limits(max_connections=600, max_keepalive_connections=600)
        async with httpx.AsyncClient(limits=limits, timeout=600) as c:

            async def one(k):
                body = {"prompt": prompt_text(k % 8), "max_tokens": 4, "temperature": 0}
                r = await c.post(door.url + "/v1/completions", json=body)
                return k, r.status_code, r.json()

            return await asyncio.gather(*(one(k) for k in range(512)), return_exceptions=True)

    results = asyncio.run(burst())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    assert all(status == 200 for _, status, _ in results), [r for r in results if r[1] != 200][:3]
    assert all(body["choices"][0]["text"] == want[k % 8] for k, _, body in results)
    deadline = time.monotonic() + 60
    for s in slow:  # the server closes every one (header timeout 10 s); a socket left open fails here
        s.settimeout(max(0.1, deadline - time.monotonic()))
        try:
            assert s.recv(1024) == b""
        except ConnectionResetError:
            pass
        s.close()


def _triton_metric(triton, name: str, model: str, extra: str = "") -> float:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{triton.metrics_port}/metrics", timeout=30) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and f'model="{model}"' in line and extra in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def _triton_failed(triton, model: str) -> float:
    return _triton_metric(triton, "dash_requests_total", model, 'outcome="failed"')


def _door_in_flight(door) -> float:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{door.port}/metrics", timeout=30) as r:
        text = r.read().decode()
    return sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith("dash_frontdoor_in_flight "))


def test_a_client_that_disconnects_cancels_its_request(door, triton):
    """Streaming and not: the client goes away, its Triton request is cancelled, and the engine
    drops it (counted failed) long before its 3000 tokens, its KV blocks freed; the front door's
    in-flight gauge is back where it was (a stream's used to stay counted for ever)."""
    for stream, model in ((True, "dash_stream"), (False, "dash")):
        in_flight = _door_in_flight(door)
        before = _triton_failed(triton, model)
        body = {"prompt": prompt_text(0), "max_tokens": 3000, "temperature": 0, "ignore_eos": True, "stream": stream}
        s = socket.create_connection(("127.0.0.1", door.port), timeout=60)
        s.sendall(_post_raw("/v1/completions", json.dumps(body).encode()))
        if stream:
            assert s.recv(4096).startswith(b"HTTP/1.1 200")  # the stream has started
        else:  # wait until the engine runs it (no answer can come before its 3000 tokens)
            deadline = time.monotonic() + 60
            while _triton_metric(triton, "dash_requests_running", model) < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
        s.close()  # gone
        deadline = time.monotonic() + 60
        while _triton_failed(triton, model) < before + 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _triton_failed(triton, model) == before + 1, model
        # and its blocks are back in the pool (the gauges are set when the engine answers it)
        assert _triton_metric(triton, "dash_requests_running", model) == 0
        assert _triton_metric(triton, "dash_kv_blocks_in_use", model) == 0, model
        deadline = time.monotonic() + 30  # the handler's cleanup may end just after Triton's
        while _door_in_flight(door) != in_flight and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _door_in_flight(door) == in_flight, (model, in_flight)


def test_finish_reason_and_stop_token_ids_field_by_field(door, model, tok):
    """finish_reason and usage as OpenAI defines them: "length" when max_tokens ran out (EOS
    ignored), "stop" at a stop token id, which is the last token generated (vLLM's
    ``stop_token_ids``), whichever of the offline tokens it is."""
    c = client(door)
    ids = [tok.bos_id, *tok.encode(prompt_text(4))]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        want = M.generate(model, [ids], 6, stop_at_eos=False).tokens[0]
    finally:
        torch.set_num_threads(threads)
    r = c.completions.create(
        model="dash", prompt=prompt_text(4), max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 6
    assert r.choices[0].text == tok.decode(want, skip_special_tokens=True)
    for k in (0, 2, 4):
        stop = want[k]
        n = want.index(stop) + 1  # the first time the stop id comes
        r = c.completions.create(
            model="dash",
            prompt=prompt_text(4),
            max_tokens=6,
            temperature=0,
            extra_body={"ignore_eos": True, "stop_token_ids": [stop]},
        )
        assert r.choices[0].finish_reason == "stop", k
        assert r.usage.completion_tokens == n, (k, n, r.usage)
        assert r.choices[0].text == tok.decode(want[:n], skip_special_tokens=True)


def test_file_attachments_stay_under_the_allowed_root(tmp_path):
    """file:// attachments: read under --allow-file-root only; outside it, a NUL byte (%00, was a
    plain-text 500) and no root at all are each a 400 naming the field."""
    from dash_trt.triton.openai import APIError, FrontDoorSettings, fetch_attachment

    root = tmp_path / "root"
    root.mkdir()
    (root / "a.png").write_bytes(b"png bytes")
    (tmp_path / "secret.txt").write_text("no")
    s = FrontDoorSettings(allow_file_root=str(root))
    assert asyncio.run(fetch_attachment(f"file://{root}/a.png", s, "image_url")) == b"png bytes"
    for url, msg in (
        (f"file://{root}/a.png%00.txt", "NUL byte"),
        (f"file://{root}/../secret.txt", "outside the allowed folder"),
        (f"file://{root}/missing.png", "no such file"),
    ):
        with pytest.raises(APIError, match=msg) as e:
            asyncio.run(fetch_attachment(url, s, "image_url"))
        assert e.value.status == 400 and e.value.param == "image_url"
    with pytest.raises(APIError, match="not allowed on this server"):
        asyncio.run(fetch_attachment(f"file://{root}/a.png", FrontDoorSettings(), "file"))
