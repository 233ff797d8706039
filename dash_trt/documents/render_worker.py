"""The process that reads and renders PDFs for :mod:`dash_trt.documents.render`: run as a script
of its own (never imported by dash_trt), so that it needs nothing but pypdfium2, and so that a
page that renders for too long can be stopped by killing the process (pdfium cannot be
interrupted inside a page).

One process serves request after request (one at a time) while it stays healthy. It limits its
address space before it reads anything (``argv[1]``, JSON: ``memory_mb``, ``RLIMIT_AS``). CPU
time is limited one unit of work at a time: each message that opens a PDF or renders a page says
how many CPU seconds it may take (``cpu``, the parent's smaller of the page's budget and what is
left of the request's), and before the work starts the soft ``RLIMIT_CPU`` is re-armed to that
many seconds past the CPU this process has used so far (a lifetime count in the kernel, hence
relative). Past it the kernel sends ``SIGXCPU``, whose default action (reset here, in case a
parent ignored it) ends the process; the hard limit is left as inherited (an unprivileged
process could never raise it again). Between units the soft limit is :data:`IDLE_SECONDS` past
the time used, for reading the next message.

Messages both ways are frames: a 4-byte big-endian length, a JSON header of that length, then
``header["bytes"]`` bytes of payload. In: ``{"op": "open", "id": k, "cpu": s, "bytes": n}`` +
the PDF (answered ``{"ok": true, "pages": n, "sizes": [[w, h], ...]}``, sizes in points with the
page's rotation applied, none when there are more than ``max_pages`` pages), ``{"op": "render",
"id": k, "index": i, "scale": s, "cpu": s}`` (answered ``{"ok": true, "mode", "width", "height",
"stride", "bytes"}`` + the bitmap's rows), ``{"op": "close", "id": k}`` (document ``k`` is let go
after its last page; not answered) and ``{"op": "close"}`` without an id (the request is over:
every document it opened is let go; answered ``{"ok": true, "open": 0}``, the documents still
open). Every answer to open and render says ``cpu``, the CPU seconds the unit took, and
``used``, this process's CPU seconds so far. A failure is ``{"ok": false, "error": "..."}``.
JSON, never pickle: this process parses untrusted files, and the parent checks the numbers it
says.

Image files too: ``{"op": "image", "id": k, "name": n, "refuse": r, "cpu": s, "bytes": n}`` +
the file (answered ``{"ok": true, "image": {"size", "frames", "sizes", "swap"}}``, read from its
headers by dash_trt's ``images.py``, loaded from the folder ``argv[1]`` names as ``documents``,
alone), then ``{"op": "decode", "id": k, "index": i, "name": n, "cpu": s}`` (answered as a
rendered page: RGB rows). A file or frame that ``images.py`` refuses (not an allowed format, too
many pixels or frames, a damaged frame) is ``{"ok": false, "refused": "<its message>", "page":
<a page error>}``; the file is kept under its id like a PDF.

A PDF is parsed once however many of its pages are rendered: the parent numbers each PDF it
opens (``id``, unique in the parent's process), and the document stays open under it for the
``render`` messages that name it until it is closed, by its id or at the request's end. At most
:data:`MAX_OPEN` documents are kept, the oldest let go first; a ``render`` of a document not open
is answered ``{"ok": false, "closed": true}`` and the parent sends the PDF again (the worker is
not at fault). An ``open`` or ``render`` without an id uses the one document kept without one.
"""

import importlib
import json
import math
import signal
import struct
import sys
import time
import types

#: Documents kept open at once (the parent closes each after its last page; a request's PDFs are
#: all opened to be counted before any is rendered, so a request of many PDFs reopens some).
MAX_OPEN = 8

try:
    import resource
except ImportError:  # not on POSIX: the parent's wall-clock deadline is the only limit
    resource = None

#: CPU seconds this process may use starting up and between two units of work.
IDLE_SECONDS = 30.0


def _read_exact(stream, n):
    out = bytearray()
    while len(out) < n:
        chunk = stream.read(n - len(out))
        if not chunk:
            raise EOFError
        out += chunk
    return bytes(out)


def _send(stream, header, payload=b""):
    header = dict(header, bytes=len(payload))
    blob = json.dumps(header).encode()
    stream.write(struct.pack(">I", len(blob)) + blob)
    if payload:
        stream.write(payload)
    stream.flush()


def _arm_cpu(seconds):
    """The CPU soft limit ``seconds`` past what this process has used (None: no limit, up to the
    hard limit, which is kept)."""
    if resource is None:
        return
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    if seconds is None or not math.isfinite(seconds):
        soft = hard
    else:
        soft = int(math.ceil(time.process_time() + max(float(seconds), 0.0)))
        if hard != resource.RLIM_INFINITY:
            soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def _setup(limits):
    """The whole process's limits (module docstring)."""
    if hasattr(signal, "SIGXCPU"):
        signal.signal(signal.SIGXCPU, signal.SIG_DFL)  # an ignored SIGXCPU is inherited through exec
    if resource is None:
        return
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # SIGXCPU would dump core
    memory = int(limits.get("memory_mb") or 0)
    if memory > 0:
        resource.setrlimit(resource.RLIMIT_AS, (memory << 20, memory << 20))
    _arm_cpu(IDLE_SECONDS)


class _Held:
    """An image file kept under its id between its ``image`` and ``decode`` messages."""

    def __init__(self, data):
        self.data = data

    def close(self):
        self.data = None


def _images(folder):
    """dash_trt's image reader (``images.py``, with the ``limits.py`` beside it), loaded from
    ``folder`` as a package of its own: nothing else of dash_trt is imported here."""
    name = "_dash_documents"
    if name not in sys.modules:
        package = types.ModuleType(name)
        package.__path__ = [folder]
        sys.modules[name] = package
    return importlib.import_module(name + ".images")


def main():
    limits = json.loads(sys.argv[1])
    _setup(limits)
    max_pages = int(limits.get("max_pages") or 0)
    global _FOLDER
    _FOLDER = limits.get("documents")
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    try:
        import pypdfium2 as pdfium
    except ImportError:
        _send(out, {"ok": False, "error": "reading PDFs needs pypdfium2 (pip install 'dash-trt[documents]')"})
        return
    docs = {}  # id (None: the document opened without one) -> its open PdfDocument, oldest first
    while True:
        try:
            (n,) = struct.unpack(">I", _read_exact(inp, 4))
            header = json.loads(_read_exact(inp, n))
            _arm_cpu(header.get("cpu", IDLE_SECONDS))  # before the payload is read: it is this unit's
            payload = _read_exact(inp, int(header.get("bytes", 0)))
        except EOFError:  # the parent closed the pipe: done
            return
        try:
            _answer(pdfium, docs, header, payload, max_pages, out)
        except MemoryError:
            _send(out, {"ok": False, "error": "MemoryError", "memory": True})
        except Exception as exc:  # noqa: BLE001 - a damaged file: said to the parent, which names the page
            _send(out, {"ok": False, "error": f"{type(exc).__name__}: {exc}"})
        payload = header = None
        _arm_cpu(IDLE_SECONDS)


def _close(docs, key):
    pdf = docs.pop(key, None)
    if pdf is not None:
        pdf.close()


def _answer(pdfium, docs, header, payload, max_pages, out):
    """One message's answer (module docstring)."""
    op, key = header["op"], header.get("id")
    if op == "close":
        if key is not None:  # not answered, even when closing fails (the parent waits for nothing)
            try:
                _close(docs, key)
            except Exception:  # noqa: BLE001, S110 - a document pdfium cannot close is dropped all the same
                pass
            return
        while docs:  # the request is over: nothing of it stays here
            _close(docs, next(iter(docs)))
        _send(out, {"ok": True, "open": len(docs)})
        return
    start = time.process_time()
    if op in ("image", "decode"):
        _image_answer(docs, header, payload, out, start)
        return
    if op == "open":
        _close(docs, key)
        pdf = pdfium.PdfDocument(payload)
        docs[key] = pdf
        while len(docs) > MAX_OPEN:
            _close(docs, next(iter(docs)))
        count = len(pdf)
        sizes = [] if max_pages and count > max_pages else [list(pdf.get_page_size(i)) for i in range(count)]
        reply, data = {"pages": count, "sizes": sizes}, b""
    elif op == "render":
        pdf = docs.get(key)
        if pdf is None:
            _send(out, {"ok": False, "closed": True, "error": "the PDF is not open", "cpu": 0.0})
            return
        page = pdf[int(header["index"])]
        bitmap = page.render(scale=float(header["scale"]))
        data = bytes(bitmap.buffer)
        reply = {"mode": bitmap.mode, "width": bitmap.width, "height": bitmap.height, "stride": bitmap.stride}
        bitmap.close()
        page.close()
    else:
        raise ValueError(f"unknown op {op!r}")
    used = time.process_time()
    _send(out, dict(reply, ok=True, cpu=used - start, used=used), data)


#: The folder of images.py (the parent's ``documents`` in argv[1]).
_FOLDER = None


def _image_answer(docs, header, payload, out, start):
    """An ``image`` message (the file's frames and sizes, read from its headers; the file kept
    under its id) or a ``decode`` one (a frame decoded to RGB rows). A file or frame the checks
    refuse is ``{"ok": false, "refused": message, "page": is a PageError}``."""
    if not _FOLDER:
        raise ValueError("no images.py folder given")
    images = _images(_FOLDER)
    op, key, name = header["op"], header.get("id"), str(header.get("name") or "image")
    if op == "decode" and docs.get(key) is None:
        _send(out, {"ok": False, "closed": True, "error": "the image is not open", "cpu": 0.0})
        return
    data = b""
    try:
        if op == "image":
            _close(docs, key)
            limit = int(header.get("max_pixels") or images.MAX_PIXELS)
            info = images.probe_image(payload, name, bool(header.get("refuse")), limit)
            docs[key] = _Held(payload)
            while len(docs) > MAX_OPEN:
                _close(docs, next(iter(docs)))
            reply = {"image": info.to_dict()}
        else:
            image = images.decode_frame(docs[key].data, int(header["index"]), name)
            data = image.tobytes()
            reply = {"mode": "RGB", "width": image.width, "height": image.height, "stride": image.width * 3}
            image = None
    except images.DocumentError as exc:
        used = time.process_time()
        page = isinstance(exc, images.PageError)
        _send(out, {"ok": False, "refused": str(exc), "page": page, "cpu": used - start, "used": used})
        return
    used = time.process_time()
    _send(out, dict(reply, ok=True, cpu=used - start, used=used), data)


if __name__ == "__main__":
    main()
