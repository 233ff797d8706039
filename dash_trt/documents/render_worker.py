"""The process that reads and renders PDFs for :mod:`dash_trt.documents.render`: run as a script
of its own (never imported by dash_trt), so that it needs nothing but pypdfium2, and so that a
page that renders for too long can be stopped by killing the process (pdfium cannot be
interrupted inside a page).

It limits itself before it reads anything (``argv[1]``, JSON): its CPU time in all (``seconds``,
``RLIMIT_CPU``'s hard limit: the kernel kills it there) and its address space (``memory_mb``,
``RLIMIT_AS``); before each PDF it opens and each page it renders, the CPU soft limit is set to
``page_seconds`` past the time it has used (the kernel sends ``SIGXCPU``, which ends it), so one
page takes at most ``page_seconds`` of CPU and the whole request at most ``seconds``.

Messages both ways are frames: a 4-byte big-endian length, a JSON header of that length, then
``header["bytes"]`` bytes of payload. In: ``{"op": "open", "bytes": n}`` + the PDF (answered
``{"ok": true, "pages": n, "sizes": [[w, h], ...]}``, sizes in points with the page's rotation
applied, none when there are more than ``max_pages`` pages) and ``{"op": "render", "index": i,
"scale": s}`` (answered ``{"ok": true, "mode", "width", "height", "stride", "cpu", "bytes"}`` +
the bitmap's rows). A failure is ``{"ok": false, "error": "..."}``. JSON, never pickle: this process parses
untrusted files, and the parent checks the numbers it says.
"""

import json
import math
import struct
import sys
import time

try:
    import resource
except ImportError:  # not on POSIX: the parent's wall-clock deadline is the only limit
    resource = None


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


def _limit_cpu(page_seconds, hard):
    """The CPU soft limit ``page_seconds`` past what this process has used (at most ``hard``)."""
    if resource is None:
        return
    used = time.process_time()
    soft = min(int(math.ceil(used + page_seconds)), hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def _setup(limits):
    """The whole process's limits (module docstring); returns the CPU hard limit."""
    if resource is None:
        return 0
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # SIGXCPU would dump core
    memory = int(limits.get("memory_mb") or 0)
    if memory > 0:
        resource.setrlimit(resource.RLIMIT_AS, (memory << 20, memory << 20))
    hard = int(math.ceil(time.process_time() + float(limits["seconds"])))
    resource.setrlimit(resource.RLIMIT_CPU, (hard, hard))
    return hard


def main():
    limits = json.loads(sys.argv[1])
    hard = _setup(limits)
    page_seconds = float(limits["page_seconds"])
    max_pages = int(limits.get("max_pages") or 0)
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    try:
        import pypdfium2 as pdfium
    except ImportError:
        _send(out, {"ok": False, "error": "reading PDFs needs pypdfium2 (pip install 'dash-trt[documents]')"})
        return
    pdf = None
    while True:
        try:
            (n,) = struct.unpack(">I", _read_exact(inp, 4))
            header = json.loads(_read_exact(inp, n))
            payload = _read_exact(inp, int(header.get("bytes", 0)))
        except EOFError:  # the parent closed the pipe: done
            return
        _limit_cpu(page_seconds, hard)
        try:
            if header["op"] == "open":
                if pdf is not None:
                    pdf.close()
                pdf = pdfium.PdfDocument(payload)
                count = len(pdf)
                sizes = [] if max_pages and count > max_pages else [list(pdf.get_page_size(i)) for i in range(count)]
                _send(out, {"ok": True, "pages": count, "sizes": sizes})
            elif header["op"] == "render":
                page = pdf[int(header["index"])]
                bitmap = page.render(scale=float(header["scale"]))
                data = bytes(bitmap.buffer)
                reply = {"mode": bitmap.mode, "width": bitmap.width, "height": bitmap.height, "stride": bitmap.stride}
                bitmap.close()
                page.close()
                _send(out, dict(reply, ok=True, cpu=time.process_time()), data)
            else:
                _send(out, {"ok": False, "error": f"unknown op {header['op']!r}"})
        except MemoryError:
            _send(out, {"ok": False, "error": "MemoryError", "memory": True})
        except Exception as exc:  # noqa: BLE001 - a damaged file: said to the parent, which names the page
            _send(out, {"ok": False, "error": f"{type(exc).__name__}: {exc}"})


if __name__ == "__main__":
    main()
