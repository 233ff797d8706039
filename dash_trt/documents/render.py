"""A request's PDFs read and rendered within a CPU-time and memory budget, in a process that can be
killed: a small PDF whose page content inflates to megabytes of drawing operators can keep pdfium
busy for minutes inside one page, and nothing in this process can interrupt it there.

:class:`Renderer` (one a request, a context manager) starts one worker process
(:mod:`dash_trt.documents.render_worker`, run as a script of its own) the first time a PDF is
read, and gives it every PDF of the request in turn: it counts the pages, reads their sizes and
renders them one at a time. The worker's limits (:class:`RenderLimits`) are the kernel's
(``RLIMIT_CPU``, ``RLIMIT_AS``), so they hold however busy the machine is: each page (opening a
PDF counts as a page) at most ``page_seconds`` of CPU, the request's PDFs together at most
``seconds``, its address space at most ``memory_mb``. Here, while waiting for the worker, the
renderer also checks a wall-clock deadline (:data:`WALL_FACTOR` times the CPU limits, for a
worker that waits instead of computing) and the request's ``cancelled`` (the client went away):
either kills the worker. Between pages (images too) it checks them again. A page over its budget
is a :class:`~dash_trt.documents.pages.DocumentError` naming the page and the limit; a
cancelled request :class:`RenderCancelled`.

Measured overhead (a 3-page PDF of scanned A4 pages rendered at 1280 px, on 2 CPU cores shared
with other work): 0.29 s in this process, 0.50 to 0.70 s through the worker: its start (one
Python, ``-S``, with pypdfium2 imported; 0.25 to 0.35 s a request) and each bitmap through a pipe.
``RenderLimits(isolate=False)`` renders in this process instead
(limits checked between pages only: a bomb page is not stopped).
"""

from __future__ import annotations

import json
import math
import os
import select
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "RenderLimits",
    "Renderer",
    "RenderCancelled",
    "DEFAULT_PAGE_SECONDS",
    "DEFAULT_SECONDS",
    "DEFAULT_MEMORY_MB",
    "WALL_FACTOR",
]

#: CPU seconds one PDF page may take to render (pdfium's work on one page: parsing its content
#: and drawing it). A page of text or a scan takes well under a second.
DEFAULT_PAGE_SECONDS = 30.0
#: CPU seconds a request's PDFs may take together (counting and rendering every page).
DEFAULT_SECONDS = 300.0
#: The rendering process's address space, MiB (its Python, pdfium, the PDF and one page's bitmap).
DEFAULT_MEMORY_MB = 4096
#: The wall-clock deadline is this many times the CPU limit (a worker that waits, not computes).
WALL_FACTOR = 4.0
#: How often (seconds) the wait for the worker checks the request's ``cancelled``.
POLL = 0.05

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "render_worker.py")
#: ``python -c`` program that runs the worker script without putting its folder (or the current
#: one) first on ``sys.path``.
_BOOT = "import sys; sys.path.pop(0); p = sys.argv.pop(1); exec(compile(open(p).read(), p, 'exec'))"
#: pdfium's bitmap modes as Pillow's (mode, raw mode)
_MODES = {
    "BGR": ("RGB", "BGR"),
    "BGRA": ("RGBA", "BGRA"),
    "BGRX": ("RGB", "BGRX"),
    "RGB": ("RGB", "RGB"),
    "RGBA": ("RGBA", "RGBA"),
    "RGBX": ("RGB", "RGBX"),
    "L": ("L", "L"),
}


#: How a worker that reached its CPU limit ends (SIGXCPU at the soft limit, SIGKILL at the hard).
_CPU_SIGNALS = tuple(-getattr(signal, n) for n in ("SIGXCPU", "SIGKILL") if hasattr(signal, n))


class RenderCancelled(Exception):
    """The request was cancelled (its client went away) while its pages were read or rendered."""


@dataclass(frozen=True)
class RenderLimits:
    """What rendering one request may take (module docstring). Zero or less: no such limit."""

    page_seconds: float = DEFAULT_PAGE_SECONDS
    seconds: float = DEFAULT_SECONDS
    memory_mb: int = DEFAULT_MEMORY_MB
    #: render in a worker process that is killed at a limit (False: in this process, the limits
    #: checked between pages only)
    isolate: bool = True

    def __post_init__(self):
        for name in ("page_seconds", "seconds", "memory_mb"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(f"render limit {name} must be a number, got {value!r}")

    @property
    def page(self) -> float:
        return self.page_seconds if self.page_seconds > 0 else math.inf

    @property
    def total(self) -> float:
        return self.seconds if self.seconds > 0 else math.inf

    def to_json(self) -> str:
        return json.dumps({k: getattr(self, k) for k in ("page_seconds", "seconds", "memory_mb", "isolate")})

    @classmethod
    def from_json(cls, text: str | None) -> RenderLimits:
        """:meth:`to_json`'s text; empty: the defaults."""
        if not text:
            return cls()
        try:
            fields = json.loads(text)
            return cls(**{k: fields[k] for k in ("page_seconds", "seconds", "memory_mb", "isolate") if k in fields})
        except (ValueError, TypeError) as exc:
            raise ValueError(f"render limits must be RenderLimits JSON, got {text[:200]!r} ({exc})") from None


def _python() -> str:
    """The Python to run the worker with: this one (inside an embedding host, e.g. Triton's
    Python backend stub, ``sys.executable`` may be the host itself)."""
    candidates = [sys.executable, getattr(sys, "_base_executable", None)]
    v = sys.version_info
    for folder in (sys.exec_prefix, sys.base_exec_prefix):
        candidates += [
            os.path.join(folder, "bin", f"python{v.major}.{v.minor}"),
            os.path.join(folder, "bin", "python3"),
        ]
    for exe in candidates:
        if exe and os.path.basename(exe).lower().startswith("python") and os.access(exe, os.X_OK):
            return exe
    return sys.executable or "python3"


class Renderer:
    """One request's reading and rendering of PDFs (module docstring). ``cancelled``: says when
    the request is to stop (its client went away); ``clock``: wall-clock seconds (a test's fake);
    ``command``: the worker's command line (a test's fake worker), else this Python running
    :data:`WORKER`."""

    def __init__(
        self,
        limits: RenderLimits | None = None,
        *,
        cancelled: Callable[[], bool] | None = None,
        clock: Callable[[], float] = time.monotonic,
        command: list[str] | None = None,
    ):
        self.limits = limits or RenderLimits()
        self.cancelled = cancelled or (lambda: False)
        self.clock = clock
        self.command = command
        self.proc: subprocess.Popen | None = None
        self.cpu = 0.0  # CPU seconds of rendering so far (as the worker last said)
        self._earlier = 0.0  # CPU seconds of workers before this one
        self.started = clock()
        self._loaded = None  # the bytes object the worker has open

    # ---------------------------------------------------------------- lifetime
    def __enter__(self) -> Renderer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        self.close()

    def close(self) -> None:
        """Stop the worker (killed: it may be inside a page)."""
        proc, self.proc, self._loaded = self.proc, None, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        for stream in (proc.stdin, proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
        proc.wait()

    # ---------------------------------------------------------------- checks
    def check(self, name: str) -> None:
        """Before a page: :class:`RenderCancelled` when the request was cancelled, a
        ``DocumentError`` naming ``name`` when the request's rendering is past its wall-clock
        deadline."""
        from .pages import DocumentError

        if self.cancelled():
            self.close()
            raise RenderCancelled(f"{name}: rendering stopped, the request was cancelled")
        if self.clock() - self.started > self.limits.total * WALL_FACTOR:
            self.close()
            raise DocumentError(
                f"{name}: the request's pages took more than {self.limits.total * WALL_FACTOR:g} s to render "
                f"(the rendering limit is {self.limits.total:g} CPU seconds a request); send fewer or simpler pages"
            )

    # ---------------------------------------------------------------- the worker
    def _start(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            return
        self.close()
        self._earlier = self.cpu
        lim = self.limits
        spec = {
            "page_seconds": lim.page if lim.page < math.inf else 1e9,
            "seconds": max(lim.total - self.cpu, 1.0) if lim.total < math.inf else 1e9,
            "memory_mb": max(int(lim.memory_mb), 0),
            "max_pages": _max_pages(),
        }
        command = self.command or [_python(), "-S", "-c", _BOOT, WORKER]  # -S: sys.path comes from here
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # pypdfium2 where this process finds it
        self.proc = subprocess.Popen(
            [*command, json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            close_fds=True,
        )
        self._loaded = None

    def _over(self, name: str, what: str):
        """The ``DocumentError`` of a page over a limit; the worker is killed."""
        from .pages import DocumentError

        self.close()
        return DocumentError(f"{name}: {what}; the page is refused (its content takes too long to draw)")

    def _cpu_limit(self) -> tuple[float, str]:
        """The CPU seconds the next step may take and which limit that is."""
        lim = self.limits
        left = lim.total - self.cpu
        if left < lim.page:
            return max(left, 0.0), f"the request's {lim.total:g} CPU seconds of rendering"
        return lim.page, f"the page's {lim.page:g} CPU seconds of rendering"

    def _ask(self, name: str, header: dict, payload: bytes = b"") -> tuple[dict, bytes]:
        """Send one message to the worker and wait for its answer, within the limits."""
        self._start()
        proc = self.proc
        limit, which = self._cpu_limit()
        blob = json.dumps(dict(header, bytes=len(payload))).encode()
        try:
            proc.stdin.write(struct.pack(">I", len(blob)) + blob)
            if payload:
                proc.stdin.write(payload)
            proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # it died: said below, from its exit status
        deadline = self.clock() + (limit * WALL_FACTOR if limit < math.inf else math.inf)
        reader = _Frames(proc.stdout.fileno())
        while True:
            if self.cancelled():
                self.close()
                raise RenderCancelled(f"{name}: rendering stopped, the request was cancelled")
            if self.clock() > deadline:
                raise self._over(
                    name, f"rendering took more than {limit * WALL_FACTOR:g} s ({which} x {WALL_FACTOR:g})"
                )
            ready, _, _ = select.select([reader.fd], [], [], POLL)
            if ready and reader.read():
                break
            if reader.eof:
                code = proc.wait()
                if code in _CPU_SIGNALS:  # the kernel's CPU limit
                    raise self._over(name, f"rendering took more than {which}")
                self.close()
                raise _dead(name, code)
        head, data = reader.frame()
        if "cpu" in head:
            self.cpu = self._earlier + float(head["cpu"])
        if head.get("ok"):
            return head, data
        if head.get("memory"):
            raise self._over(name, f"rendering needs more than {self.limits.memory_mb} MiB of memory")
        return head, b""

    def open_pdf(self, data: bytes, name: str) -> tuple[int, list[tuple[float, float]]]:
        """The page count of a PDF's ``data`` and each page's size in points (rotation applied;
        none when there are more pages than a request may hold)."""
        from .pages import DocumentError, _declares_no_pages

        self.check(name)
        head, _ = self._ask(name, {"op": "open"}, data)
        if not head.get("ok"):
            self._loaded = None
            if _declares_no_pages(data):
                raise DocumentError(f"{name}: the PDF has 0 pages")
            raise DocumentError(f"{name}: not a readable PDF ({head.get('error')})")
        self._loaded = data
        sizes = [(float(w), float(h)) for w, h in head.get("sizes", [])]
        return int(head["pages"]), sizes

    def render_pdf_page(self, data: bytes, index: int, scale: float, name: str):
        """Page ``index`` of the PDF ``data`` rendered at ``scale`` (a ``PIL.Image``)."""
        from .pages import MAX_PIXELS, DocumentError, _pil

        if self._loaded is not data or self.proc is None or self.proc.poll() is not None:
            self.open_pdf(data, name)
        self.check(name)
        head, raw = self._ask(name, {"op": "render", "index": int(index), "scale": float(scale)})
        if not head.get("ok"):
            raise DocumentError(f"{name}: cannot be rendered ({head.get('error')})")
        try:
            w, h, stride = int(head["width"]), int(head["height"]), int(head["stride"])
            mode, raw_mode = _MODES[head["mode"]]
        except (KeyError, ValueError, TypeError):
            raise DocumentError(f"{name}: cannot be rendered (the renderer answered {head!r:.200})") from None
        if not (0 < w and 0 < h and w * h <= MAX_PIXELS and stride * h == len(raw)):
            raise DocumentError(f"{name}: cannot be rendered (a bitmap of {w}x{h} pixels, {len(raw)} bytes)")
        Image, _ = _pil()
        return Image.frombuffer(mode, (w, h), raw, "raw", raw_mode, stride, 1)


def _max_pages() -> int:
    from .pages import MAX_PAGES

    return MAX_PAGES


def _dead(name: str, code: int | None):
    from .pages import DocumentError

    how = f"signal {-code}" if code is not None and code < 0 else f"status {code}"
    return DocumentError(
        f"{name}: cannot be rendered (the rendering process ended with {how}: a damaged file, or more memory "
        "than the rendering limit)"
    )


class _Frames:
    """Reads one frame (4-byte length, JSON header, payload) from a pipe without blocking."""

    def __init__(self, fd: int):
        self.fd = fd
        self.buf = bytearray()
        self.eof = False
        self.need: int | None = None

    def read(self) -> bool:
        """Read what is there; True once a whole frame is in."""
        chunk = os.read(self.fd, 1 << 20)
        if not chunk:
            self.eof = True
            return False
        self.buf += chunk
        if self.need is None and len(self.buf) >= 4:
            (n,) = struct.unpack(">I", self.buf[:4])
            if len(self.buf) >= 4 + n:
                head = json.loads(self.buf[4 : 4 + n])
                self.need = 4 + n + int(head.get("bytes", 0))
        return self.need is not None and len(self.buf) >= self.need

    def frame(self) -> tuple[dict, bytes]:
        (n,) = struct.unpack(">I", self.buf[:4])
        head = json.loads(self.buf[4 : 4 + n])
        return head, bytes(self.buf[4 + n : self.need])
