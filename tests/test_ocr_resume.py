"""Issue 69 item 5, resume and retries: ``dash-trt ocr --out`` is a workspace (its manifest names
each output's input; a run again skips what is written and unchanged, a killed run resumed writes
what an uninterrupted one writes), a page that cannot be rendered is tried again and then left
out and reported (the rest of the document written) unless too many of the document's pages
fail, and folders and lists of files as inputs. In process, with the tiny random-weight
checkpoint; generation is counted, never timed."""

from __future__ import annotations

import argparse
import io
import json
import os

import pytest
from conftest import write_tiny_unlimited_ocr2
from PIL import Image, ImageDraw

from dash_trt.commands import ocr as O
from dash_trt.documents import pages as P
from dash_trt.documents.processor import DocumentOptions
from dash_trt.documents.workspace import MANIFEST
from dash_trt.serving import documents as SD

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: small budgets: every document is a few tokens a page (random weights run each page to it)
FAST = ["--max-page-tokens", "3", "--no-progress"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_unlimited_ocr2(tmp_path_factory, "uocr2resume")


def page_image(w: int, h: int, text: str) -> Image.Image:
    im = Image.new("RGB", (w, h), "white")
    ImageDraw.Draw(im).text((10, 10), text, fill="black")
    return im


def pdf_bytes(images) -> bytes:
    buf = io.BytesIO()
    images[0].save(buf, "PDF", save_all=True, append_images=list(images[1:]), resolution=72.0)
    return buf.getvalue()


def png_bytes(im) -> bytes:
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue()


def three_pages(tag: str = "") -> bytes:
    return pdf_bytes(
        [page_image(300, 400, "one" + tag), page_image(400, 300, "two" + tag), page_image(350, 350, "three" + tag)]
    )


@pytest.fixture
def inputs(tmp_path):
    """A folder of three documents: a 3-page PDF and two images (and a file that is not one)."""
    d = tmp_path / "in"
    d.mkdir()
    (d / "a.pdf").write_bytes(three_pages())
    (d / "b.png").write_bytes(png_bytes(page_image(200, 260, "bee")))
    (d / "c.png").write_bytes(png_bytes(page_image(260, 200, "sea")))
    (d / "notes.txt").write_text("not a document")
    return d


@pytest.fixture
def generations(monkeypatch):
    """The prompts generated, by their length (every call of the model's generate)."""
    calls = []
    real = SD.generate

    def generate(model, prompts, *args, **kw):
        calls.append(len(prompts[0]))
        return real(model, prompts, *args, **kw)

    monkeypatch.setattr(SD, "generate", generate)
    return calls


def _ocr(*argv):
    p = argparse.ArgumentParser()
    O.add_parser(p.add_subparsers(dest="command"))
    out, err = io.StringIO(), io.StringIO()
    rc = O.ocr_main(p.parse_args(["ocr", *map(str, argv)]), out, err)
    return rc, out.getvalue(), err.getvalue()


def _files(out) -> dict[str, bytes]:
    """Every file under ``out`` (the manifest apart) by its path there."""
    found = {}
    for root, _, names in os.walk(out):
        for n in names:
            rel = os.path.relpath(os.path.join(root, n), out)
            if rel != MANIFEST:
                found[rel] = open(os.path.join(root, n), "rb").read()
    return found


def _manifest(out) -> dict:
    return json.loads((out / MANIFEST).read_text())["documents"]


def _stable(manifest: dict) -> dict:
    """The manifest without what differs between runs of the same inputs: the pages' seconds."""
    return {
        k: dict(v, pages=[{f: x for f, x in p.items() if f != "seconds"} for p in v["pages"]])
        for k, v in manifest.items()
    }


def test_a_run_again_recomputes_nothing_and_leaves_the_files_as_they_were(folder, inputs, tmp_path, generations):
    """A folder in: its PDFs and images, sorted (notes.txt left out). The manifest names each
    output's input and digests; a second run loads no model, generates nothing, and every file,
    the manifest included, is byte for byte what it was; its report is the first run's."""
    out = tmp_path / "out"
    rc, first, err = _ocr(inputs, "--checkpoint", folder, "--out", out, *FAST, "--json")
    assert rc == 3, first + err  # written; random weights run every page to its budget (length)
    lines = [json.loads(x) for x in first.splitlines()]
    assert [os.path.basename(x["file"]) for x in lines] == ["a.pdf", "b.png", "c.png"]
    assert [x["pages"] for x in lines] == [3, 1, 1] and not any(x["skipped"] for x in lines)
    assert len(generations) == 3
    manifest = _manifest(out)
    assert sorted(manifest) == ["a", "b", "c"]
    a = manifest["a"]
    assert a["status"] == "complete" and a["error"] is None
    assert a["input"]["path"] == str(inputs / "a.pdf") and a["input"]["size"] == (inputs / "a.pdf").stat().st_size
    assert sorted(a["outputs"]) == ["a.md", "a/page-0001.md", "a/page-0002.md", "a/page-0003.md"]
    assert [p["finish_reason"] for p in a["pages"]] == ["length"] * 3
    assert a["options"]["backend"] == {"checkpoint": str(folder), "dtype": None}
    before, manifest_bytes = _files(out), (out / MANIFEST).read_bytes()

    def no_model(*a, **k):
        raise AssertionError("the model was loaded for a run with nothing to do")

    generations.clear()
    import dash_trt.serving.documents as module

    real = module.DocumentOCR
    module.DocumentOCR = no_model
    try:
        rc, second, err = _ocr(inputs, "--checkpoint", folder, "--out", out, *FAST, "--json")
    finally:
        module.DocumentOCR = real
    assert rc == 3 and generations == [], second + err
    again = [json.loads(x) for x in second.splitlines()]
    assert all(x["skipped"] for x in again)
    assert [dict(x, skipped=False) for x in again] == lines
    assert _files(out) == before and (out / MANIFEST).read_bytes() == manifest_bytes
    rc, text, _ = _ocr(inputs, "--checkpoint", folder, "--out", out, *FAST)
    assert "3 of 3 documents, 5 pages (5 cut at their token budget), written to" in text
    assert "; 3 written by an earlier run, not done again" in text and generations == []


def test_a_killed_run_resumed_writes_what_an_uninterrupted_run_writes(
    folder, inputs, tmp_path, generations, monkeypatch
):
    """The run is killed (an interrupt) while the second document's files are written, one page
    file of it written; run again, it does the second and third documents, not the first, and
    leaves the files and the manifest of a run that was never interrupted."""
    whole = tmp_path / "whole"
    assert _ocr(inputs, "--checkpoint", folder, "--out", whole, *FAST)[0] == 3
    generations.clear()
    out = tmp_path / "out"
    real = O._write_text
    written = []

    def killed(path, text):
        written.append(path)
        if len(written) == 6:  # a's 3 pages and a.md, then b's page: b.md is not written
            raise KeyboardInterrupt
        return real(path, text)

    monkeypatch.setattr(O, "_write_text", killed)
    with pytest.raises(KeyboardInterrupt):
        _ocr(inputs, "--checkpoint", folder, "--out", out, *FAST)
    monkeypatch.setattr(O, "_write_text", real)
    assert sorted(_manifest(out)) == ["a"] and not (out / "b.md").exists()
    assert not [n for n in os.listdir(out / "b") if n.startswith(".tmp-")]  # nothing half-written
    assert len(generations) in (2, 3)  # a and b, and c if it had started (its answer never written)
    generations.clear()
    rc, text, err = _ocr(inputs, "--checkpoint", folder, "--out", out, *FAST)
    assert rc == 3, text + err
    assert len(generations) == 2  # b and c, not a
    assert "; 1 written by an earlier run, not done again" in text
    assert _files(out) == _files(whole)
    assert _stable(_manifest(out)) == _stable(_manifest(whole))


def test_a_changed_input_or_option_is_done_again(folder, inputs, tmp_path, generations):
    """A changed input is done again (the others not); so is a document whose output was edited
    or removed; changed options redo every document; --no-resume too."""
    out = tmp_path / "out"
    _ocr(inputs, "--checkpoint", folder, "--out", out, *FAST)
    old = _manifest(out)
    generations.clear()
    (inputs / "b.png").write_bytes(png_bytes(page_image(200, 260, "another bee")))
    (out / "c" / "page-0001.md").write_text("edited by hand\n")
    rc, text, _ = _ocr(inputs, "--checkpoint", folder, "--out", out, *FAST)
    assert len(generations) == 2 and "; 1 written by an earlier run" in text  # b and c, not a
    new = _manifest(out)
    assert new["b"]["input"]["sha256"] != old["b"]["input"]["sha256"] and new["a"] == old["a"]
    assert (out / "c" / "page-0001.md").read_text() != "edited by hand\n"
    generations.clear()
    _ocr(inputs, "--checkpoint", folder, "--out", out, *FAST, "--crop", "off")
    assert len(generations) == 3 and _manifest(out)["a"]["options"]["crop"] == "off"
    generations.clear()
    _ocr(inputs, "--checkpoint", folder, "--out", out, *FAST, "--crop", "off", "--no-resume")
    assert len(generations) == 3
    generations.clear()
    _ocr(inputs, "--checkpoint", folder, "--out", out, *FAST, "--crop", "off")
    assert generations == []


@pytest.fixture
def broken(monkeypatch):
    """``broken[source] = n``: that page fails to render its first n times (a PageError, as a
    damaged page or a rendering process that died gives); the attempts are counted."""
    fail: dict[str, int] = {}
    tries: dict[str, int] = {}
    real = P.PageSource.render

    def render(self):
        tries[self.source] = tries.get(self.source, 0) + 1
        if tries[self.source] <= fail.get(self.source, 0):
            raise P.PageError(f"{self.source}: cannot be rendered (damaged)")
        return real(self)

    monkeypatch.setattr(P.PageSource, "render", render)
    fail["tries"] = tries  # type: ignore[assignment]
    return fail


def test_a_page_that_fails_once_is_tried_again_and_the_document_is_complete(folder, tmp_path, broken, generations):
    doc = tmp_path / "a.pdf"
    doc.write_bytes(three_pages())
    rc, _, _ = _ocr(doc, "--checkpoint", folder, "--out", tmp_path / "whole", *FAST)
    assert rc == 3
    broken["a.pdf page 2"] = 1
    broken["tries"].clear()
    rc, out, err = _ocr(doc, "--checkpoint", folder, "--out", tmp_path / "out", *FAST, "--format", "jsonl")
    assert rc == 3, out + err
    assert broken["tries"]["a.pdf page 2"] == 2 and broken["tries"]["a.pdf page 3"] == 1
    assert [json.loads(x)["finish_reason"] for x in out.splitlines()] == ["length"] * 3
    assert _files(tmp_path / "out") == _files(tmp_path / "whole")
    assert generations[0] == generations[1]  # the same prompt, every page in it


def test_a_page_that_always_fails_is_reported_and_the_rest_written(folder, tmp_path, broken, generations):
    """Past its retries the page is left out of the prompt (the document is read as if it had
    pages 1 and 3 only: the same prompt and text), reported in its place (finish reason error,
    its message), the rest written, exit status 3; the manifest says partial, so a run again
    tries it again. Over --max-page-error-rate (the default 0.1 of 3 pages) the document fails;
    with a rate of 0 it fails with the page's own message."""
    doc = tmp_path / "a.pdf"
    doc.write_bytes(three_pages())
    short = tmp_path / "short.pdf"
    im = [page_image(300, 400, "one"), page_image(400, 300, "two"), page_image(350, 350, "three")]
    short.write_bytes(pdf_bytes([im[0], im[2]]))
    rc, _, _ = _ocr(short, "--checkpoint", folder, "--out", tmp_path / "short", *FAST)
    assert rc == 3
    broken["a.pdf page 2"] = 99
    out = tmp_path / "out"
    rc, text, err = _ocr(doc, "--checkpoint", folder, "--out", out, *FAST, "--max-page-error-rate", "0.5")
    assert rc == 3, text + err
    assert broken["tries"]["a.pdf page 2"] == 2  # --max-page-retries 1 by default
    assert "PAGE FAILED " + str(doc) + " page 2: a.pdf page 2: cannot be rendered (damaged) (2 attempts)" in text
    assert "3 pages (2 cut at their token budget, 1 could not be rendered)" in text
    assert generations[0] == generations[1]  # the prompt of the two pages left
    assert (out / "a" / "page-0001.md").read_bytes() == (tmp_path / "short" / "short" / "page-0001.md").read_bytes()
    assert (out / "a" / "page-0003.md").read_bytes() == (tmp_path / "short" / "short" / "page-0002.md").read_bytes()
    assert (out / "a" / "page-0002.md").read_text() == "\n"
    assert (
        "<!-- page 2: a.pdf page 2 (failed: a.pdf page 2: cannot be rendered (damaged) (2 attempts)) -->"
        in (out / "a.md").read_text()
    )
    entry = _manifest(out)["a"]
    assert entry["status"] == "partial" and [p["finish_reason"] for p in entry["pages"]][1] == "error"
    generations.clear()
    broken["tries"].clear()
    rc, jsonl, _ = _ocr(
        doc, "--checkpoint", folder, "--out", out, *FAST, "--max-page-error-rate", "0.5", "--format", "jsonl"
    )
    assert len(generations) == 1 and rc == 3  # partial: done again
    record = [json.loads(x) for x in jsonl.splitlines()][1]
    assert record["finish_reason"] == "error" and "cannot be rendered" in record["error"] and record["markdown"] == ""
    rc, text, _ = _ocr(doc, "--checkpoint", folder, "--out", tmp_path / "o2", *FAST, "--max-page-retries", "0")
    assert rc == 1 and broken["tries"]["a.pdf page 2"] == 3  # once more, no retry
    assert f"FAILED {doc}: 1 of 3 pages could not be rendered, more than the 0.1 of its pages" in text
    assert not (tmp_path / "o2" / "a.md").exists() and _manifest(tmp_path / "o2")["a"]["status"] == "failed"
    rc, text, _ = _ocr(doc, "--checkpoint", folder, "--out", tmp_path / "o3", *FAST, "--max-page-error-rate", "0")
    assert rc == 1 and f"FAILED {doc}: a.pdf page 2: cannot be rendered (damaged)\n" in text


def test_a_failed_page_is_dropped_from_the_prompt_as_if_it_was_never_there(folder, broken):
    """The processor's part: the pages kept, their numbers, and the prompt rebuilt for them, equal
    to the prompt of a document of those pages alone."""
    ocr = SD.DocumentOCR(folder)
    try:
        broken["d.pdf page 1"] = 99
        opts = DocumentOptions(page_retries=2, max_page_error_rate=0.5)
        doc = ocr.processor.plan([("d.pdf", three_pages())], opts)
        feats = SD.page_features(ocr.tower, doc)
        assert broken["tries"]["d.pdf page 1"] == 3 and doc.page_numbers == [2, 3]
        (r,) = doc.failed
        assert (r.page, r.finish_reason) == (1, "error")
        im = [page_image(400, 300, "two"), page_image(350, 350, "three")]
        alone = ocr.processor.plan([("e.pdf", pdf_bytes(im))])
        assert doc.prompt_ids == alone.prompt_ids and feats.shape[0] == sum(alone.page_tokens)
        alone.close()
        with pytest.raises(P.DocumentError, match="every page failed"):
            broken.update({"d.pdf page 2": 99, "d.pdf page 3": 99})
            everything = ocr.processor.plan([("d.pdf", three_pages())], DocumentOptions(max_page_error_rate=1.0))
            SD.page_features(ocr.tower, everything)
    finally:
        ocr.close()


def test_folders_and_lists_of_files_as_inputs(tmp_path):
    """A folder: its PDFs and images, sorted, hidden files and others left out; --recursive: its
    subfolders' too, after its own; --files-from: one path a line. A folder with none, or
    nothing given, is exit 2 with one line."""
    d = tmp_path / "in"
    (d / "sub").mkdir(parents=True)
    for name in ("b.PNG", "a.pdf", ".hidden.pdf", "notes.txt", "sub/c.tif"):
        (d / name).write_bytes(b"x")
    listed = tmp_path / "list.txt"
    listed.write_text(f"# documents\n{d / 'a.pdf'}\n\n{d / 'sub'}\n")

    def inputs(*argv):
        p = argparse.ArgumentParser()
        O.add_parser(p.add_subparsers(dest="command"))
        return O._inputs(p.parse_args(["ocr", *map(str, argv), "--out", "o", "--server", "x"]))

    assert inputs(d) == ([str(d / "a.pdf"), str(d / "b.PNG")], None)
    assert inputs(d, "--recursive")[0] == [str(d / "a.pdf"), str(d / "b.PNG"), str(d / "sub" / "c.tif")]
    assert inputs("--files-from", listed)[0] == [str(d / "a.pdf"), str(d / "sub" / "c.tif")]
    assert inputs(d / "sub", d / "a.pdf")[0] == [str(d / "sub" / "c.tif"), str(d / "a.pdf")]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert inputs(empty)[1] == f"no PDF or image in {empty} (--recursive: subfolders)"
    assert inputs()[1].startswith("no input")
    rc, out, err = _ocr("--out", tmp_path / "o", "--server", "127.0.0.1:9")
    assert rc == 2 and err.startswith("dash-trt ocr: error: no input") and err.count("\n") == 1
    rc, out, err = _ocr(d, "--out", tmp_path / "o", "--server", "127.0.0.1:9", "--max-page-error-rate", "2")
    assert rc == 2 and "--max-page-error-rate in [0, 1]" in err


def test_an_unreadable_manifest_is_started_afresh_and_names_are_kept_from_it(tmp_path, monkeypatch):
    """Through a stand-in server: a manifest that is not JSON is noted and replaced; no document
    is given the manifest's name."""
    from dash_trt.triton import client as C

    monkeypatch.setattr(
        C.DashClient, "ocr", lambda self, data, name, **kw: {"pages": [{"page": 1, "source": name, "text": "hi"}]}
    )
    doc = tmp_path / "manifest.json.png"
    doc.write_bytes(b"stand-in")
    out = tmp_path / "out"
    out.mkdir()
    (out / MANIFEST).write_text("{not json")
    rc, text, err = _ocr(doc, "--server", "127.0.0.1:9", "--out", out, "--no-progress")
    assert rc == 0, text + err
    assert f"{out / MANIFEST} could not be read" in err and "every document is done again" in err
    assert (out / "manifest.json-2.md").is_file()
    assert list(_manifest(out)) == [O._stems([str(doc)])[0]]


def test_a_rendering_process_that_dies_on_a_page_is_replaced_and_the_page_tried_again(folder, monkeypatch):
    """The real rendering worker, told to crash (signal 11, as pdfium on a damaged page) on page
    2's first render: the page is rendered again by a new worker, the PDF sent to it again, and
    every page is read; without retries the document fails with the page's message, as before.
    A worker killed by the CPU limit (SIGKILL, SIGXCPU) is a budget: not tried again."""
    from dash_trt.documents import render as R

    real = R._Worker.exchange
    renders, signal = [], [-11]

    def exchange(self, header, *a, **k):
        if header.get("op") == "render":
            renders.append(header["index"])
            if len(renders) == 2:
                self.kill()
                raise R._Stop("ended", signal[0])
        return real(self, header, *a, **k)

    monkeypatch.setattr(R._Worker, "exchange", exchange)
    ocr = SD.DocumentOCR(folder)
    try:
        doc = ocr.processor.plan([("d.pdf", three_pages())], DocumentOptions(page_retries=1))
        feats = SD.page_features(ocr.tower, doc)
        assert renders == [0, 1, 1, 2] and doc.failed == [] and doc.page_numbers == [1, 2, 3]
        assert feats.shape[0] == sum(doc.page_tokens)
        renders.clear()
        doc = ocr.processor.plan([("d.pdf", three_pages())], DocumentOptions())
        with pytest.raises(P.PageError, match=r"^d\.pdf page 2: cannot be rendered \(the rendering process ended"):
            SD.page_features(ocr.tower, doc)
        renders.clear()
        signal[0] = -9
        doc = ocr.processor.plan([("d.pdf", three_pages())], DocumentOptions(page_retries=1, max_page_error_rate=1))
        with pytest.raises(P.DocumentError, match=r"d\.pdf page 2: rendering took more than") as caught:
            SD.page_features(ocr.tower, doc)
        assert not isinstance(caught.value, P.PageError) and renders == [0, 1]
    finally:
        ocr.close()
