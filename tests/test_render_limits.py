"""Issue 67 N2: a PDF's pages are read and rendered in a worker process held to a CPU-time and
memory budget and killed when a page goes over it or the request is cancelled (its client went
away). The flate bomb is made here: one page whose FlateDecode content stream inflates to
megabytes of drawing operators (a few KB of file, minutes of pdfium's CPU at full size)."""

from __future__ import annotations

import io
import itertools
import os
import signal
import sys
import time
import types
import zlib

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from dash_trt.documents.pages import DocumentError, load_pages, open_pages
from dash_trt.documents.render import RenderCancelled, Renderer, RenderLimits, RenderWorkers

pytest.importorskip("pypdfium2")

KILLED = tuple(-getattr(signal, n) for n in ("SIGXCPU", "SIGKILL") if hasattr(signal, n))
#: a worker that never answers (it waits: no CPU limit would stop it)
BLOCKING = [sys.executable, "-c", "import time; time.sleep(3600)"]


def flate_bomb(megabytes: float = 32) -> bytes:
    """A one-page PDF whose content stream is ``megabytes`` MiB of lines, FlateDecode."""
    unit = b"0 0 m 612 792 l S\n"
    stream = zlib.compress(unit * (int(megabytes * 2**20) // len(unit)), 9)
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R >>",
        b"<< /Length %d /Filter /FlateDecode >>\nstream\n" % len(stream) + stream + b"\nendstream",
    ]
    out, offsets = bytearray(b"%PDF-1.4\n"), []
    for i, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % i + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % o for o in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    return bytes(out)


def small_pdf() -> bytes:
    images = []
    for w, h in ((600, 800), (800, 400)):
        im = Image.new("RGB", (w, h), "white")
        ImageDraw.Draw(im).text((10, 10), f"page {w}", fill="black")
        images.append(im)
    buf = io.BytesIO()
    images[0].save(buf, "PDF", save_all=True, append_images=images[1:], resolution=72.0)
    return buf.getvalue()


def png(color) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), color).save(buf, "PNG")
    return buf.getvalue()


class FakeClock:
    """Wall-clock seconds that advance one second each time they are read."""

    def __init__(self):
        self.ticks = itertools.count()

    def __call__(self) -> float:
        return float(next(self.ticks))


def test_a_normal_pdf_renders_the_same_in_the_worker_and_in_process():
    data = small_pdf()
    isolated = load_pages([("a.pdf", data)], render_side=512)
    here = load_pages([("a.pdf", data)], render_side=512, limits=RenderLimits(isolate=False))
    assert [p.size for p in isolated] == [p.size for p in here] == [(384, 512), (512, 256)]
    assert [p.source for p in isolated] == ["a.pdf page 1", "a.pdf page 2"]
    assert all(a.image.mode == "RGB" and a.image.tobytes() == b.image.tobytes() for a, b in zip(isolated, here))


def test_a_flate_bomb_page_is_stopped_at_its_cpu_budget():
    """The kernel's CPU limit ends the worker inside the page (however busy the machine): the
    page is refused naming it and the limit, and the worker is gone."""
    bomb = flate_bomb()
    assert len(bomb) < 200_000
    with Renderer(RenderLimits(page_seconds=1)) as renderer:
        pages = open_pages([("bomb.pdf", bomb)], render_side=1024, renderer=renderer)
        proc = renderer.proc
        with pytest.raises(DocumentError, match=r"bomb\.pdf page 1: rendering took more than .*1 CPU seconds"):
            pages[0].render()
        assert renderer.proc is None and proc.returncode in KILLED


def test_a_flate_bomb_is_stopped_at_the_requests_cpu_budget():
    with pytest.raises(DocumentError, match=r"bomb\.pdf page 1: .*the request's 1 CPU seconds"):
        load_pages([("bomb.pdf", flate_bomb())], limits=RenderLimits(page_seconds=0, seconds=1))


def test_a_worker_that_never_answers_is_killed_at_the_wall_clock_deadline():
    """A fake clock (one second a read) and a worker that blocks: the wait ends at 5 x 4 s and
    the worker is killed, whatever the machine's load."""
    renderer = Renderer(RenderLimits(page_seconds=5, seconds=0), clock=FakeClock(), command=BLOCKING)
    with pytest.raises(DocumentError, match=r"x\.pdf: rendering took more than 20 s \(the page's 5 CPU seconds"):
        renderer.open_pdf(b"%PDF-1.4 any", "x.pdf")
    assert renderer.proc is None
    renderer.close()


def test_a_cancelled_request_kills_the_worker_inside_a_page():
    """The client goes away while a page renders (a worker that blocks): the wait sees the
    cancel and kills the worker instead of finishing the document."""
    asked = itertools.count()
    renderer = Renderer(RenderLimits(page_seconds=0, seconds=0), cancelled=lambda: next(asked) >= 5, command=BLOCKING)
    renderer._start()
    proc = renderer.proc
    with pytest.raises(RenderCancelled, match="the request was cancelled"):
        renderer.render_pdf_page(b"%PDF-1.4 any", 0, 1.0, "x.pdf page 1")
    assert proc.returncode == -signal.SIGKILL and renderer.proc is None


def test_cancel_is_checked_between_pages():
    gone = []
    with Renderer(cancelled=lambda: bool(gone)) as renderer:
        pages = open_pages([("a.png", png("red")), ("b.png", png("blue"))], renderer=renderer)
        assert pages[0].render().image.getpixel((0, 0)) == (255, 0, 0)
        gone.append(True)
        with pytest.raises(RenderCancelled):
            pages[1].render()


# ------------------------------------------------------------------ the warm worker
def _request(workers: RenderWorkers, data: bytes, render_side: int = 256, **kw) -> tuple[list, Renderer]:
    """One request's pages of the PDF ``data``, rendered by a worker of ``workers``; the renderer
    (closed: its worker given back)."""
    with Renderer(workers=workers, **kw) as renderer:
        pages = [p.render() for p in open_pages([("a.pdf", data)], render_side=render_side, renderer=renderer)]
        renderer.pid = renderer.proc.pid
    return pages, renderer


def _gone(proc) -> bool:
    """The process ended and was waited for (no zombie left)."""
    return proc.returncode is not None and not os.path.exists(f"/proc/{proc.pid}")


def test_one_warm_worker_serves_request_after_request():
    data = small_pdf()
    with RenderWorkers(RenderLimits()) as workers:
        first, a = _request(workers, data)
        second, b = _request(workers, data)
        assert a.pid == b.pid and workers.starts == 1
        assert [p.size for p in first] == [p.size for p in second] == [(192, 256), (256, 128)]
        assert a.proc is None and b.proc is None  # each request gave it back


def test_after_a_bomb_page_the_next_request_gets_a_new_worker():
    with RenderWorkers(RenderLimits(page_seconds=1)) as workers:
        _, before = _request(workers, small_pdf())
        with Renderer(workers=workers) as renderer:
            pages = open_pages([("bomb.pdf", flate_bomb())], render_side=1024, renderer=renderer)
            proc = renderer.proc
            assert proc.pid == before.pid  # the warm one
            with pytest.raises(DocumentError, match=r"bomb\.pdf page 1: rendering took more than .*1 CPU seconds"):
                pages[0].render()
            assert renderer.proc is None and proc.returncode in KILLED and _gone(proc)
        pages, after = _request(workers, small_pdf())
        assert after.pid != proc.pid and len(pages) == 2 and workers.starts == 2


def test_after_a_cancel_the_next_request_gets_a_new_worker():
    """The client goes away while the bomb page renders (cancel seen after a few polls, long
    before any CPU limit): the worker is killed; the next request renders in a fresh one."""
    asked = itertools.count()
    with RenderWorkers(RenderLimits()) as workers:
        with Renderer(workers=workers, cancelled=lambda: next(asked) >= 8) as renderer:
            pages = open_pages([("bomb.pdf", flate_bomb())], render_side=1024, renderer=renderer)
            proc = renderer.proc
            with pytest.raises(RenderCancelled, match="the request was cancelled"):
                pages[0].render()
            assert proc.returncode == -signal.SIGKILL and _gone(proc)
        pages, after = _request(workers, small_pdf())
        assert after.pid != proc.pid and len(pages) == 2


def test_the_cpu_budget_is_rearmed_relative_to_what_the_worker_has_used():
    """A page of about a quarter CPU second, request after request in one worker held to 1 CPU
    second a page and a request: the worker's lifetime CPU goes well past 1 s (RLIMIT_CPU counts
    it all), and each page still renders, because each unit's limit is armed past what was used."""
    page = flate_bomb(0.25)
    used, pids = 0.0, set()
    with RenderWorkers(RenderLimits(page_seconds=1, seconds=1)) as workers:
        for _ in range(40):
            pages, renderer = _request(workers, page, render_side=64)
            assert len(pages) == 1
            used += renderer.cpu  # the units' CPU only: less than the worker's lifetime CPU
            pids.add(renderer.pid)
            if used > 3.0:
                break
        assert used > 3.0 and len(pids) == 1 and workers.starts == 1


def _ask_worker(worker, header: dict) -> dict:
    head, _ = worker.exchange(
        header, b"", deadline=time.monotonic() + 30, clock=time.monotonic, cancelled=lambda: False
    )
    return head


def test_a_request_leaves_nothing_open_in_the_warm_worker():
    """Two PDFs, each opened (its bytes sent) once and kept open by id while one page of each is
    rendered; the request's end closes both in the worker, which goes back warm: a render that
    names either id is answered "closed", the worker holds no document, and the next request
    renders in the same process."""
    ops = []
    with RenderWorkers(RenderLimits()) as workers:
        with Renderer(workers=workers) as renderer:
            ask = renderer._ask
            renderer._ask = lambda name, header, payload=b"": ops.append(header["op"]) or ask(name, header, payload)
            pages = open_pages([("a.pdf", small_pdf()), ("b.pdf", small_pdf())], render_side=256, renderer=renderer)
            ids = sorted(doc for _, doc in renderer._docs.values())
            assert [pages[0].render().size, pages[2].render().size] == [(192, 256), (192, 256)]
            assert sorted(doc for _, doc in renderer._docs.values()) == ids and len(ids) == 2  # still open
            pid = renderer.proc.pid
        assert ops == ["open", "open", "render", "render"] and renderer.proc is None
        worker = workers.take()
        assert worker.pid == pid and worker.alive()
        for doc in ids:
            head = _ask_worker(worker, {"op": "render", "id": doc, "index": 0, "scale": 1.0})
            assert head["ok"] is False and head["closed"] is True
        assert _ask_worker(worker, {"op": "close"}) == {"ok": True, "open": 0, "bytes": 0}
        workers.give(worker)
        pages, after = _request(workers, small_pdf())
        assert after.pid == pid and len(pages) == 2 and workers.starts == 1


def test_closing_the_workers_leaves_no_process():
    """Idle workers are stopped at close; one still in use is stopped when its request ends."""
    workers = RenderWorkers(RenderLimits())
    workers.warm()
    (idle,) = [w.proc for w in workers._idle]
    renderer = Renderer(workers=workers)
    renderer.open_pdf(small_pdf(), "a.pdf")
    busy = renderer.proc
    assert busy.pid == idle.pid  # the warm one
    workers.warm()
    (spare,) = [w.proc for w in workers._idle]
    workers.close()
    assert _gone(spare) and busy.returncode is None
    renderer.close()
    assert _gone(busy) and not workers._idle
    _, later = _request(workers, small_pdf())  # closed: a request still renders, in a worker of its own
    assert not workers._idle


def test_render_limits_are_a_parameter_of_the_document_model():
    from dash_trt import triton_protocol as P
    from dash_trt.triton.repository import document_model_config

    limits = RenderLimits(page_seconds=5, seconds=50, memory_mb=1024)
    cfg = document_model_config("m_document", "m", max_prompt_tokens=100, render_limits=limits)
    params = {p["key"]: p["value"]["string_value"] for p in cfg["parameters"]}
    assert RenderLimits.from_json(params[P.PARAM_RENDER_LIMITS]) == limits
    default = document_model_config("m_document", "m", max_prompt_tokens=100)
    assert (
        RenderLimits.from_json(
            next(p for p in default["parameters"] if p["key"] == P.PARAM_RENDER_LIMITS)["value"]["string_value"]
        )
        == RenderLimits()
    )
    assert RenderLimits.from_json("") == RenderLimits()
    with pytest.raises(ValueError, match="render limits"):
        RenderLimits.from_json('{"page_seconds": "soon"}')


def test_write_takes_the_render_limits(monkeypatch):
    from dash_trt.triton import cli

    seen = {}

    def fake_write(out, model, **kw):
        seen.update(kw)
        raise cli.RepositoryError("stop here")

    monkeypatch.setattr(cli, "write_repository", fake_write)
    monkeypatch.setattr(cli, "demo_model", lambda seed=0: None)
    a = cli._parser().parse_args(
        [
            "write",
            "--demo",
            "--out",
            "/nonexistent/x",
            "--render-page-seconds",
            "7",
            "--render-seconds",
            "70",
            "--render-memory-mb",
            "512",
        ]
    )
    cli.write_main(a, io.StringIO(), io.StringIO())
    assert seen["render_limits"] == RenderLimits(7, 70, 512)


# ------------------------------------------------------------------ the Triton document model
class _Tensor:
    def __init__(self, arr):
        self.arr = arr

    def to_dlpack(self):
        return torch.from_numpy(np.array(self.arr))


def _fake_pb_utils():
    class TritonError:
        INVALID_ARG, INTERNAL, UNAVAILABLE, CANCELLED = "INVALID_ARG", "INTERNAL", "UNAVAILABLE", "CANCELLED"

        def __init__(self, message, code=None):
            self.message, self.code = message, code

    class InferenceResponse:
        def __init__(self, output_tensors=(), error=None):
            self.error = error

    return types.SimpleNamespace(
        TritonError=TritonError,
        InferenceResponse=InferenceResponse,
        get_input_tensor_by_name=lambda request, name: request.inputs.get(name),
    )


def _document_model(monkeypatch):
    """The document model's module (``model.py`` in a repository), with a stand-in Triton."""
    import importlib.util

    from dash_trt import triton_protocol as P

    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", _fake_pb_utils())
    spec = importlib.util.spec_from_file_location(
        "dash_document_model_under_test", P.__file__.replace("triton_protocol.py", "triton/document_model.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_document_model_passes_the_requests_cancel_to_rendering(monkeypatch):
    """The front door cancels its gRPC call when its client goes; Triton marks the request
    cancelled; the document model hands ``is_cancelled`` to rendering and answers CANCELLED."""
    from dash_trt import triton_protocol as P

    mod = _document_model(monkeypatch)
    model = object.__new__(mod.TritonPythonModel)
    from dash_trt.documents.processor import DocumentOptions

    model.P, model.torch = P, torch
    model.DocumentError, model.DocumentOptions, model.RenderCancelled = DocumentError, DocumentOptions, RenderCancelled
    model.max_prompt_tokens = 0
    handed = []

    class Processor:
        def plan(self, files, options, max_prompt_tokens=None, cancelled=None):
            handed.append(cancelled)
            with Renderer(RenderLimits(), cancelled=cancelled, command=BLOCKING) as r:
                r.render_pdf_page(files[0][1], 0, 1.0, "doc.pdf page 1")

    model.processor = Processor()
    cancelled = itertools.count()
    request = types.SimpleNamespace(
        inputs={P.DOCUMENT: _Tensor(np.frombuffer(b"%PDF-1.4 x", dtype=np.uint8))},
        is_cancelled=lambda: next(cancelled) >= 3,
    )
    (response,) = model.execute([request])
    assert handed == [request.is_cancelled]
    assert response.error.code == "CANCELLED" and "cancelled" in response.error.message


def test_finalize_stops_the_document_models_worker(monkeypatch):
    """Triton unloads the document model: finalize stops its warm worker (killed, waited for)."""
    from dash_trt.documents.processor import DocumentProcessor

    model = object.__new__(_document_model(monkeypatch).TritonPythonModel)
    model.processor = DocumentProcessor(None, image_token_id=1, page_token_id=2)
    model.processor.render_workers.warm()
    (proc,) = [w.proc for w in model.processor.render_workers._idle]
    assert proc.poll() is None
    model.finalize()
    assert _gone(proc) and model.processor.render_workers.closed
