"""The front door's hardening without a server, over fake backends: one attachment budget per
request (checked as attachments are fetched), a client gone while its body is read answered 499
quietly, a cancelled gather's outcome retrieved, text spelling a control token refused, and a
content part's error naming its field."""

from __future__ import annotations

import asyncio
import base64
import gc
import types

import pytest

pytest.importorskip("fastapi")

from dash_trt import model as M  # noqa: E402
from dash_trt.documents.tokenizer import ByteTokenizer  # noqa: E402
from dash_trt.frontdoor.models import APIError  # noqa: E402
from dash_trt.frontdoor.settings import FrontDoorSettings  # noqa: E402

CHAT, CMPL = "/v1/chat/completions", "/v1/completions"


class Fake:
    """A backend answering every request at once: the demo model's byte tokenizer, a document
    model (one page a file), every call recorded."""

    def __init__(self, tokenizer=None):
        self.config = M.demo_model().config
        self.tokenizer = tokenizer or ByteTokenizer(self.config)
        self.has_documents = True
        self.calls: list[tuple] = []

    async def start(self):
        pass

    async def close(self):
        pass

    async def ready(self):
        return True

    async def generate(self, ids, max_tokens, stop_at_eos, stop_ids, sampling, features=None):
        self.calls.append(("generate", list(ids)))
        return [65], 0

    async def document(self, files, instruction, max_tokens, crop, rules):
        self.calls.append(("document", [len(d) for _, d in files]))
        pages = [{"page": i + 1, "source": n, "text": "x"} for i, (n, _) in enumerate(files)]
        return {"pages": pages, "prompt_tokens": 1, "generated_tokens": 1}


def client(settings: FrontDoorSettings, backend=None):
    from fastapi.testclient import TestClient

    from dash_trt.frontdoor.app import create_app

    fake = backend or Fake()
    return TestClient(create_app(settings, backend=fake)), fake


def requests_counted(metrics, endpoint: str) -> dict[str, float]:
    """``dash_frontdoor_requests_total`` of ``endpoint`` by status."""
    out = {}
    for metric in metrics.registry.collect():
        for s in metric.samples:
            if s.name == "dash_frontdoor_requests_total" and s.labels["endpoint"] == endpoint:
                out[s.labels["status"]] = s.value
    return out


# ----------------------------------------------------------------------------- N4: attachment budget
def test_the_attachments_of_one_request_share_one_budget(tmp_path, monkeypatch):
    """One small body naming an allowed 1000-byte file ten times: each is under --fetch-max-mb,
    but the request's total (2500 bytes) is passed at the third, which is refused (413 naming
    that part) before it is read; no file after it is fetched, nothing reaches the backend."""
    import dash_trt.frontdoor.chat as chat

    (tmp_path / "big.bin").write_bytes(b"x" * 1000)
    fetched = []
    real = chat.fetch_attachment

    async def counting(url, settings, param, *rest):
        fetched.append(param)
        return await real(url, settings, param, *rest)

    monkeypatch.setattr(chat, "fetch_attachment", counting)
    s = FrontDoorSettings(allow_file_root=str(tmp_path), fetch_max_bytes=1000, fetch_total_bytes=2500)
    part = {"type": "image_url", "image_url": {"url": f"file://{tmp_path}/big.bin"}}
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "read"}] + [part] * 10}]}
    c, fake = client(s)
    with c:
        r = c.post(CHAT, json=body)
        assert r.status_code == 413, r.text
        err = r.json()["error"]
        assert err["param"] == "messages[0].content[2]" and err["code"] == "too_large", err
        assert "over" in err["message"] and "--fetch-total-mb" in err["message"], err
        assert len(fetched) == 3 and fake.calls == []
        # two of them fit: answered
        body["messages"][0]["content"] = [part, part]
        assert c.post(CHAT, json=body).status_code == 200
        assert fake.calls == [("document", [1000, 1000])]


def test_the_budget_counts_data_urls_before_decoding_them():
    from dash_trt.frontdoor.attachments import Budget, fetch_attachment

    s = FrontDoorSettings(fetch_max_bytes=1000, fetch_total_bytes=1500)
    url = "data:image/png;base64," + base64.b64encode(b"y" * 900).decode()
    budget = Budget(s.fetch_total_bytes)
    assert asyncio.run(fetch_attachment(url, s, "a", budget)) == b"y" * 900
    with pytest.raises(APIError) as e:
        asyncio.run(fetch_attachment(url, s, "b", budget))
    assert e.value.status == 413 and e.value.param == "b" and budget.used == 900
    assert asyncio.run(fetch_attachment(url, s, "c")) == b"y" * 900  # a budget of its own


# ----------------------------------------------------------------------------- N6: disconnects
def test_a_client_gone_while_its_body_is_read_is_a_quiet_499():
    """starlette raises ClientDisconnect out of request.body(): answered 499 (counted as such in
    /metrics, not 500) by a handler, so nothing propagates (no traceback in the log)."""
    from dash_trt.frontdoor.app import create_app

    app = create_app(FrontDoorSettings(), backend=Fake())
    sent = []

    async def receive():
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": CHAT,
        "raw_path": CHAT.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"100")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 9000),
    }
    asyncio.run(app(scope, receive, send))  # raised ClientDisconnect before the fix
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499
    metrics = app.app.state.metrics
    assert requests_counted(metrics, CHAT) == {"499": 1.0}
    assert metrics.in_flight._value.get() == 0


def test_a_cancelled_gather_leaves_no_unretrieved_exception():
    """A non-stream request whose client disconnects: its gather is cancelled and its outcome
    retrieved, so asyncio reports no "_GatheringFuture exception was never retrieved"."""
    from dash_trt.frontdoor.endpoint import Endpoint

    async def gone():
        return {"type": "http.disconnect"}

    async def never():
        await asyncio.Event().wait()

    async def run():
        reports = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: reports.append(ctx["message"]))
        ep = Endpoint(FrontDoorSettings(), None, {"backend": None})
        status = None
        try:
            await ep.guarded(
                types.SimpleNamespace(receive=gone), asyncio.gather(never(), never(), return_exceptions=True)
            )
        except APIError as exc:
            status = exc.status
        for _ in range(10):  # the children's cancellation, then the gather's
            await asyncio.sleep(0)
        gc.collect()
        return status, reports

    status, reports = asyncio.run(run())
    assert status == 499
    assert not [r for r in reports if "never retrieved" in r], reports


# ----------------------------------------------------------------------------- N13: control tokens
@pytest.mark.parametrize(
    "path, body, param",
    [
        (CMPL, {"prompt": "<PAGE><image>hello"}, "prompt"),
        (CMPL, {"prompt": "see <image*3> here"}, "prompt"),
        (CMPL, {"prompt": ["fine", "<PAGE>x"]}, "prompt"),
        (CHAT, {"messages": [{"role": "user", "content": "<PAGE><image><image>read"}]}, "messages[0].content"),
        (
            CHAT,
            {
                "messages": [
                    {"role": "system", "content": "x"},
                    {"role": "user", "content": [{"type": "text", "text": "a<PAGE>"}]},
                ]
            },
            "messages[1].content",
        ),
    ],
)
def test_text_spelling_a_control_token_is_refused(path, body, param):
    c, fake = client(FrontDoorSettings())
    with c:
        r = c.post(path, json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and "control token" in err["message"], err
        assert fake.calls == []
    c, fake = client(FrontDoorSettings(allow_control_text=True))  # the opt-out: the markup as before
    with c:
        assert c.post(path, json=body).status_code == 200
        control = {fake.config.page_token_id, fake.config.image_token_id}
        assert any(control & set(ids) for _, ids in fake.calls), fake.calls


def test_token_ids_and_plain_text_are_unchanged():
    cfg = M.demo_model().config
    c, fake = client(FrontDoorSettings())
    with c:
        ids = [cfg.page_token_id, cfg.image_token_id, 72, 105]
        assert c.post(CMPL, json={"prompt": ids}).status_code == 200
        assert fake.calls[-1] == ("generate", ids)
        assert c.post(CMPL, json={"prompt": "a <PAGE or image> < PAGE >"}).status_code == 200
        assert c.post(CHAT, json={"messages": [{"role": "user", "content": "1 < 2 > 0"}]}).status_code == 200


def test_a_checkpoint_tokenizer_s_special_tokens_are_control_tokens():
    """A tokenizers.Tokenizer: its special added tokens and the model's <PAGE> / <image> (even
    when not marked special) match; ordinary text and non-special added tokens do not."""
    from tokenizers import AddedToken, Tokenizer, models

    from dash_trt.documents.tokenizer import TextTokenizer
    from dash_trt.frontdoor.endpoint import control_pattern

    t = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    t.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    t.add_tokens([AddedToken("<PAGE>", special=False), AddedToken("<image>", special=False), "plain"])
    cfg = types.SimpleNamespace(page_token_id=t.token_to_id("<PAGE>"), image_token_id=t.token_to_id("<image>"))
    p = control_pattern(TextTokenizer(t), cfg)
    for text, hit in [("x<|im_start|>user", "<|im_start|>"), ("<PAGE>", "<PAGE>"), ("a<image>", "<image>")]:
        assert p.search(text).group(0) == hit
    assert p.search("plain text <im_start> <page>") is None
    assert control_pattern(object()) is None


# ----------------------------------------------------------------------------- D19: the param of a part
@pytest.mark.parametrize(
    "part, param, fragment",
    [
        ({"type": "image_url", "image_url": "https://example.com/a.png"}, "messages.content.image_url", "dictionary"),
        (
            {"type": "image_url", "image_url": {"url": "x", "detail": "max"}},
            "messages.content.image_url.detail",
            "'auto'",
        ),
        ({"type": "input_image", "image_url": "https://example.com/a.png"}, "messages.content", "'input_image'"),
        ({"type": "text", "text": "x", "bold": True}, "messages.content.bold", "unknown parameter"),
    ],
)
def test_a_bad_content_part_names_its_field(part, param, fragment):
    c, _ = client(FrontDoorSettings())
    with c:
        r = c.post(CHAT, json={"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}]})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and fragment in err["message"], err
        assert "valid string" not in err["message"], err


# ----------------------------------------------------------------------------- one page budget
class Budgets(Fake):
    """Records the budgets a document was sent with; answers two pages, the second cut."""

    async def document(self, files, instruction, max_tokens, crop, rules):
        self.calls.append(("document", max_tokens, rules))
        pages = [
            {"page": 1, "source": "a", "text": "x", "finish_reason": "stop", "tokens": 1, "seconds": 0.1},
            {"page": 2, "source": "b", "text": "y", "finish_reason": "length", "tokens": 4, "seconds": 0.2},
        ]
        return {"pages": pages, "prompt_tokens": 1, "generated_tokens": 5, "finish_reason": "length"}


def test_chat_and_ocr_leave_a_document_s_budget_to_the_page_budget():
    """Issue D1: a chat document got the text chat's 2048 tokens in all. Chat and /v1/ocr now
    send no total unless the request gives one (the document model derives it from the page
    budget), pass max_page_tokens as the page budget, and say length when a page was cut; /v1/ocr
    gives each page's finish_reason, tokens and seconds."""
    c, fake = client(FrontDoorSettings(), Budgets())
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"x").decode()}}
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "read"}, image]}]}
    with c:
        r = c.post(CHAT, json=body)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
        r = c.post(CHAT, json={**body, "max_tokens": 50, "max_page_tokens": 7})
        assert r.status_code == 200, r.text
        assert fake.calls == [("document", None, None), ("document", 50, {"max_page_tokens": 7})]
        r = c.post(CHAT, json={"messages": [{"role": "user", "content": "hi"}], "max_page_tokens": 7})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_page_tokens"
        files = {"file": ("a.png", b"x", "image/png")}
        r = c.post("/v1/ocr", files=files, data={"max_page_tokens": "9"})
        assert r.status_code == 200, r.text
        assert fake.calls[-1] == ("document", None, {"max_page_tokens": 9})
        out = r.json()
        assert out["finish_reason"] == "length"
        assert [(p["finish_reason"], p["tokens"], p["seconds"]) for p in out["pages"]] == [
            ("stop", 1, 0.1),
            ("length", 4, 0.2),
        ]
        r = c.post("/v1/ocr", files=files, data={"max_page_tokens": "0"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_page_tokens"


class Instructions(Budgets):
    """Records the instruction a document was sent with."""

    async def document(self, files, instruction, max_tokens, crop, rules):
        self.calls.append(("instruction", instruction))
        return await super().document(files, instruction, max_tokens, crop, rules)


def test_a_document_chat_s_instruction_holds_system_and_developer_messages():
    c, fake = client(FrontDoorSettings(), Instructions())
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"x").decode()}}
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": "Tables as HTML."},
        {"role": "user", "content": [{"type": "text", "text": "read"}, image]},
    ]
    with c:
        r = c.post(CHAT, json={"messages": messages})
        assert r.status_code == 200, r.text
        assert fake.calls[0] == ("instruction", "Be brief.\nTables as HTML.\nread")
        r = c.post(CHAT, json={"messages": messages[1:]})
        assert r.status_code == 200, r.text
        assert fake.calls[2] == ("instruction", "Tables as HTML.\nread")


def test_ocr_refuses_max_tokens_0():
    c, fake = client(FrontDoorSettings(), Budgets())
    files = {"file": ("a.png", b"x", "image/png")}
    with c:
        r = c.post("/v1/ocr", files=files, data={"max_tokens": "0"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
        assert fake.calls == []
        r = c.post("/v1/ocr", files=files, data={"max_tokens": "1"})
        assert r.status_code == 200 and fake.calls[-1] == ("document", 1, None), r.text


class _FakeAio:
    """tritonclient.grpc.aio as far as TritonBackend.start reads it: the demo model's config and
    whether a document model is ready."""

    def __init__(self, documents: bool):
        self.documents = documents

    def InferenceServerClient(self, url):  # noqa: N802 - tritonclient's name
        import json as _json

        from dash_trt import triton_protocol as P
        from dash_trt.models.registry import demo_model

        documents = self.documents

        class Client:
            async def get_model_config(self, name, as_json=True):
                cfg = _json.dumps(demo_model().config.to_dict())
                return {"config": {"parameters": {P.PARAM_MODEL_CONFIG: {"string_value": cfg}}}}

            async def is_model_ready(self, name):
                return documents and name.endswith(P.DOCUMENT_SUFFIX)

            async def close(self):
                pass

        return Client()


@pytest.mark.parametrize("documents", [False, True])
def test_a_repository_with_a_document_model_needs_its_tokenizer(documents):
    """A repository with a document model was written from a checkpoint with its own tokenizer:
    the front door refuses to start without --tokenizer rather than encode text with the demo's
    bytes (a new user's D10); without a document model the demo tokenizer is the model's."""
    import asyncio

    from dash_trt.documents.tokenizer import ByteTokenizer
    from dash_trt.frontdoor.backend import TritonBackend

    backend = TritonBackend(FrontDoorSettings())
    backend.aio = _FakeAio(documents)
    if documents:
        with pytest.raises(RuntimeError, match="pass --tokenizer FOLDER"):
            asyncio.run(backend.start())
    else:
        asyncio.run(backend.start())
        assert isinstance(backend.tokenizer, ByteTokenizer) and not backend.has_documents
