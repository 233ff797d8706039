"""``dash-trt ocr`` around its model: a server that refuses connections (retried with a growing
pause, its URL named), an empty file through a server (named as in this process),
``--concurrency`` with a checkpoint (one document at a time, said so), and a Dual Chunk Attention
folder given as a checkpoint (called a token-id model). No real server and no real pause: the
client's ``ocr`` and the pause are stand-ins (the whole pipeline: tests/test_documents.py)."""

from __future__ import annotations

import argparse
import io
import json

import pytest

from dash_trt.commands import ocr as O
from dash_trt.triton import client as C


def _args(*argv):
    p = argparse.ArgumentParser()
    O.add_parser(p.add_subparsers(dest="command"))
    return p.parse_args(["ocr", *argv])


def _ocr(*argv, sleep=None):
    out, err = io.StringIO(), io.StringIO()
    kw = {} if sleep is None else {"sleep": sleep}
    rc = O.ocr_main(_args(*argv), out, err, **kw)
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture
def doc(tmp_path):
    path = tmp_path / "scan.png"
    path.write_bytes(b"not looked at: the client is a stand-in")
    return path


def _answer(name):
    return {"pages": [{"page": 1, "source": name, "text": "hello"}]}


def test_a_refused_connection_is_retried_with_a_growing_pause(doc, tmp_path, monkeypatch):
    """Issue D17: 'ConnectionRefusedError: ... Connection refused' (capital C) was not retried."""
    calls = []

    def ocr(self, data, name, **kw):
        calls.append(name)
        if len(calls) <= 3:
            raise C.DashClientError("ConnectionRefusedError: [Errno 111] Connection refused")
        return _answer(name)

    monkeypatch.setattr(C.DashClient, "ocr", ocr)
    pauses = []
    rc, out, err = _ocr(str(doc), "--server", "127.0.0.1:9", "--out", str(tmp_path / "o"), sleep=pauses.append)
    assert rc == 0, out + err
    assert calls == ["scan.png"] * 4 and pauses == [0.5, 1.0, 2.0]
    assert (tmp_path / "o" / "scan" / "page-0001.md").read_text() == "hello\n"


def test_a_server_never_reached_is_named_by_its_url(doc, tmp_path):
    """Nothing listens on port 1: every attempt is refused at once, the pauses are recorded, not
    slept, and the failure line names the server."""
    pauses = []
    argv = [str(doc), "--server", "127.0.0.1:1", "--retries", "2", "--out", str(tmp_path / "o"), "--json"]
    rc, out, err = _ocr(*argv, "--no-progress", sleep=pauses.append)
    (line,) = map(json.loads, out.splitlines())
    assert rc == 1 and not line["ok"] and pauses == [0.5, 1.0], out + err
    assert line["error"].startswith("server 127.0.0.1:1 not reached or busy after 3 attempt(s): ")
    assert "refused" in line["error"].lower()


def test_a_document_the_server_refuses_is_not_retried(doc, tmp_path, monkeypatch):
    calls = []

    def ocr(self, data, name, **kw):
        calls.append(name)
        raise C.DashClientError("scan.png: not a supported image", "400")

    monkeypatch.setattr(C.DashClient, "ocr", ocr)
    pauses = []
    rc, out, err = _ocr(str(doc), "--server", "127.0.0.1:9", "--out", str(tmp_path / "o"), sleep=pauses.append)
    assert rc == 1 and calls == ["scan.png"] and pauses == []
    assert "FAILED " + str(doc) + ": scan.png: not a supported image" in out


def test_an_empty_file_through_a_server_is_named_as_in_this_process(tmp_path, monkeypatch):
    """Issue D16: the server's 'document is required' named no file; the client names it."""
    empty = tmp_path / "empty.png"
    empty.write_bytes(b"")
    monkeypatch.setattr(C.DashClient, "ocr", lambda *a, **k: pytest.fail("an empty file was sent"))
    rc, out, err = _ocr(str(empty), "--server", "127.0.0.1:9", "--out", str(tmp_path / "o"), "--no-progress")
    assert rc == 1 and f"FAILED {empty}: empty.png: the file is empty" in out
    monkeypatch.undo()
    client = C.DashClient("127.0.0.1:9")
    with pytest.raises(C.DashClientError, match=r"^b\.png: the file is empty$"):
        client.ocr([("a.png", b"x"), ("b.png", b"")])


class _InTurn:
    """A stand-in DocumentOCR: every document one page, "x"."""

    closed = 0

    def __init__(self, *a, **k):
        pass

    def close(self):  # the run's end stops the rendering worker
        type(self).closed += 1

    def transcribe(self, sources, options, **kw):
        from types import SimpleNamespace

        page = SimpleNamespace(page=1, source=sources[0][0], text="x", tokens=[5], finish_reason="stop", seconds=0.0)
        return SimpleNamespace(pages=[page])


@pytest.mark.parametrize("given", [None, "1", "8"])
def test_concurrency_with_a_checkpoint_says_it_runs_one_document_at_a_time(tmp_path, monkeypatch, given):
    """Issue D18: --concurrency did nothing offline, silently; now it runs one worker and says so."""
    from dash_trt.serving import documents as SD

    monkeypatch.setattr(SD, "DocumentOCR", _InTurn)
    monkeypatch.setattr(_InTurn, "closed", 0)
    workers = []
    real = O.ThreadPoolExecutor
    monkeypatch.setattr(O, "ThreadPoolExecutor", lambda max_workers: workers.append(max_workers) or real(max_workers))
    files = []
    for i in range(3):
        (tmp_path / f"d{i}.png").write_bytes(b"x")
        files.append(str(tmp_path / f"d{i}.png"))
    more = [] if given is None else ["--concurrency", given]
    rc, out, err = _ocr(*files, "--checkpoint", str(tmp_path), "--out", str(tmp_path / "o"), "--no-progress", *more)
    assert rc == 0, out + err
    noted = "--concurrency 8 is for --server; with --checkpoint the model in this process takes documents one" in err
    assert noted == (given == "8")
    assert workers == [1] and _InTurn.closed == 1


def test_a_dca_folder_as_a_checkpoint_is_called_a_token_id_model(tmp_path):
    """Issue D11: a Dual Chunk Attention folder used to get 'add the section with the sparse_* keys'."""
    from dash_trt.models.qwen2_dca import write_tiny_qwen2_dca

    write_tiny_qwen2_dca(tmp_path / "qwen2-dca")
    (tmp_path / "p.png").write_bytes(b"x")
    rc, out, err = _ocr(str(tmp_path / "p.png"), "--checkpoint", str(tmp_path / "qwen2-dca"), "--out", str(tmp_path))
    (line,) = err.strip().splitlines()
    assert rc == 2 and line.startswith("dash-trt ocr: error: ")
    assert "Dual Chunk Attention text model" in line and "token ids" in line and "sparse_*" not in line


def test_jsonl_gives_a_record_a_page_and_a_page_cut_at_its_budget_exits_3(doc, tmp_path, monkeypatch):
    """Issue D1: a page that ran out of its token budget was reported as written and complete,
    exit 0. Its record says length, the summary counts and names it, and the exit status is 3."""

    def ocr(self, data, name, **kw):
        pages = [
            {
                "page": 1,
                "source": f"{name} page 1",
                "text": "one",
                "finish_reason": "stop",
                "tokens": 2,
                "seconds": 0.5,
            },
            {
                "page": 2,
                "source": f"{name} page 2",
                "text": "tw",
                "finish_reason": "length",
                "tokens": 6,
                "seconds": 1.5,
            },
        ]
        return {"pages": pages, "finish_reason": "length"}

    monkeypatch.setattr(C.DashClient, "ocr", ocr)
    out_dir = tmp_path / "o"
    rc, out, err = _ocr(
        str(doc), "--server", "127.0.0.1:9", "--out", str(out_dir), "--no-progress", "--format", "jsonl"
    )
    assert rc == O.EXIT_TRUNCATED == 3, out + err
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["page"] for r in records] == [1, 2]
    for r in records:
        assert set(r) >= {"file", "page", "source", "output", "markdown", "finish_reason", "tokens", "seconds"}
        assert r["file"] == str(doc) and open(r["output"], encoding="utf-8").read() == r["markdown"] + "\n"
    assert [(r["finish_reason"], r["tokens"], r["seconds"]) for r in records] == [("stop", 2, 0.5), ("length", 6, 1.5)]
    rc, out, err = _ocr(str(doc), "--server", "127.0.0.1:9", "--out", str(out_dir), "--no-progress")
    assert rc == 3
    assert "1 of 1 documents, 2 pages (1 cut at their token budget), written to" in out
    assert f"TRUNCATED {doc}: page(s) 2 ran out of tokens" in out
    rc, out, err = _ocr(str(doc), "--server", "127.0.0.1:9", "--out", str(out_dir), "--no-progress", "--json")
    (line,) = map(json.loads, out.splitlines())
    assert rc == 3 and line["ok"] and line["pages"] == 2 and line["length_pages"] == [2]
    assert line["output"] == str(out_dir / "scan.md")


def test_every_page_complete_exits_0_and_the_page_ranges_are_named():
    assert O._pages_text([2, 3, 4, 7, 9, 10]) == "2-4, 7, 9-10"
    outcome = O.DocumentOutcome("a.pdf", pages=[{"page": 1, "finish_reason": "stop"}, {"page": 2}])
    assert outcome.truncated == []


def test_the_budget_of_a_document_and_how_each_page_ended():
    """(pages + 1) x (page budget + 1): every page's budget and marker, as much again before the
    first marker, the end; held to the room the model leaves. Page ends by hand (P: <PAGE>, E: EOS)."""
    from dash_trt.documents import budget as B

    assert B.DEFAULT_MAX_PAGE_TOKENS == 20000
    assert B.document_max_new_tokens(3) == 4 * 20001 and B.document_max_new_tokens(3, 6) == 28
    assert B.document_max_new_tokens(17, 6, room=100) == 100 and B.document_max_new_tokens(2, 0) == 3 * 20001
    P, E = 100, 101

    def reasons(tokens, pages, cap=4, guard=True):
        return B.finish_reasons(tokens, P, E, pages, cap, guard)

    assert reasons([P, 1, 2, P, 3, E], 2) == ["stop", "stop"]
    assert reasons([P, 1, 2, 3, 4, P, 5, E], 2) == ["length", "stop"]  # page 1 reached its 4
    assert reasons([1, 2, 3, 4, P, 5, P, 6, E], 2) == ["length", "stop"]  # 4 before the first marker
    assert reasons([P, 1, P, 2, 3], 3) == ["stop", "length", "length"]  # the total ran out in page 2
    assert reasons([P, 1, P, 2, P, E], 2) == ["stop", "guard"]  # a marker too many, ended by the guard
    assert reasons([P, 1, 2, 3, 4, 5, E], 1, guard=False) == ["stop"]  # no guard: no page cap
    assert reasons([P, 1, E], 3, guard=False) == ["stop", "stop", "stop"]  # the model ended it
    assert B.document_finish_reason(["stop", "guard"]) == "stop"
    assert B.document_finish_reason(["stop", "length"]) == "length"
    entries = B.page_entries([P, 1, 2, P, 3, E], ["a", "b"], lambda s: "".join(map(str, s)), P, E, seconds=5.0)
    assert [(e["text"], e["tokens"], e["finish_reason"]) for e in entries] == [("12", 2, "stop"), ("3", 1, "stop")]
    assert [e["seconds"] for e in entries] == [3.0, 2.0]  # shared by tokens, each counted one more
