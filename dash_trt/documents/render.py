"""A request's PDFs read and rendered, and its image files read and decoded, within a CPU-time and
memory budget, in a process that can be killed: a small PDF whose page content inflates to
megabytes of drawing operators can keep pdfium busy for minutes inside one page, and nothing in
this process can interrupt it there; a small PNG can inflate to gigabytes of pixels.

Image files go the same way as PDFs (:meth:`Renderer.open_image`, :meth:`Renderer.decode_image_frame`):
the worker reads their headers (format allow-list, frame count, pixels:
:func:`~dash_trt.documents.images.probe_image`), keeps the file under an id, and decodes one frame
at a time to RGB rows (:func:`~dash_trt.documents.images.decode_frame`), under the same limits,
opening a file counting as a page; a file it refuses kills the worker as a damaged PDF does.

:class:`Renderer` (one a request, a context manager) takes a worker process
(:mod:`dash_trt.documents.render_worker`, run as a script of its own) the first time a PDF is
read, and gives it every PDF of the request in turn: it counts the pages, reads their sizes and
renders them one at a time. The worker is warm: :class:`RenderWorkers` (one a
:class:`~dash_trt.documents.processor.DocumentProcessor`, so one a Triton document model
instance and one a ``dash-trt ocr`` run) keeps it between requests, and a request that ends
normally gives it back with its PDFs closed (nothing of a request stays in the worker). A worker
that is killed is replaced in the background. The worker's limits (:class:`RenderLimits`) are
the kernel's (``RLIMIT_CPU``, ``RLIMIT_AS``), so they hold however busy the machine is: each
page (opening a PDF counts as a page) at most ``page_seconds`` of CPU, the request's PDFs
together at most ``seconds``, its address space at most ``memory_mb``. ``RLIMIT_CPU`` counts a
process's whole life, so before each unit of work the worker re-arms it to the unit's budget
(the smaller of the page's and what is left of the request's, counted here from the CPU time
the worker says each unit took) past the CPU it has used so far. Here, while waiting for the
worker, the renderer also checks a wall-clock deadline (:data:`WALL_FACTOR` times the CPU
limits, for a worker that waits instead of computing) and the request's ``cancelled`` (the
client went away): either kills the worker. Between pages (images too) it checks them again. A
page over its budget is a :class:`~dash_trt.documents.pages.DocumentError` naming the page and
the limit; a cancelled request :class:`RenderCancelled`. A worker is killed, never reused, also
when it fails (a damaged file), answers anything but the protocol, or does not close a PDF in
:data:`CLOSE_SECONDS`.

A PDF is parsed once a request: :meth:`Renderer.open_pdf` gives it an id, and the worker keeps
the document open under that id for the pages rendered after (their messages name the id, not
the bytes again) until :meth:`Renderer.close_pdf` (after its last page) or the request's end (which closes
every document the request opened before the worker goes back to :class:`RenderWorkers`); a
worker that let it go (it keeps at most a few documents open) says so, and the PDF is sent again.

The worker is the limits' enforcement, not a sandbox: it runs as this process's user, as it did
when it lived for one request.

Measured overhead (a 3-page PDF of A4 scans at 150 dpi rendered at 1280 px, median of 7 cold
and 21 warm requests, on 2 CPU cores shared with other work, load average about 5): 0.20 to
0.25 s in this process; through the worker 0.47 to 0.50 s for a request that starts one (one
Python, ``-S``, with pypdfium2 imported: about 0.2 s) and 0.28 to 0.30 s for a request that finds
it warm (each bitmap through a pipe). ``RenderLimits(isolate=False)`` renders in this process
instead (limits checked between pages only: a bomb page is not stopped).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from .images import ImageInfo
from .limits import MAX_PAGES, MAX_PIXELS, DocumentError, PageError, _declares_no_pages, _pil

__all__ = [
    "RenderLimits",
    "Renderer",
    "RenderWorkers",
    "RenderCancelled",
    "DEFAULT_PAGE_SECONDS",
    "DEFAULT_SECONDS",
    "DEFAULT_MEMORY_MB",
    "WALL_FACTOR",
    "add_render_limit_arguments",
    "render_limits_from_args",
    "render_limit_flags_given",
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
#: Wall-clock seconds a worker has to close a request's PDFs before it is killed instead of reused.
CLOSE_SECONDS = 5.0

_FOLDER = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(_FOLDER, "render_worker.py")
#: ``python -c`` program that runs the worker script without putting its folder (or the current
#: one) first on ``sys.path``.
_BOOT = "import sys; sys.path.pop(0); p = sys.argv.pop(1); exec(compile(open(p).read(), p, 'exec'))"
#: The longest JSON header a worker's answer may have, bytes.
_MAX_HEADER = 1 << 24
#: The worker's ids of the PDFs it opens: unique in this process, so no request's id ever names
#: another request's document in a worker they share in turn.
_IDS = itertools.count(1)
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


#: The command-line flags of :class:`RenderLimits`' fields (``dash-triton write``, ``dash-trt ocr``).
RENDER_LIMIT_FLAGS = {
    "page_seconds": "--render-page-seconds",
    "seconds": "--render-seconds",
    "memory_mb": "--render-memory-mb",
}


def add_render_limit_arguments(parser, subject: str, *, prefix: str = "", defaults: bool = True) -> None:
    """The flags of :data:`RENDER_LIMIT_FLAGS` on ``parser`` (one definition for every command
    that renders): ``subject`` names what renders (``NAME_document``), ``prefix`` starts each help
    (``with --checkpoint: ``). ``defaults=False``: a flag not given is None
    (:func:`render_limits_from_args` fills in the default), so a caller can tell it was given."""
    parser.add_argument(
        RENDER_LIMIT_FLAGS["page_seconds"],
        type=float,
        default=DEFAULT_PAGE_SECONDS if defaults else None,
        help=f"{prefix}CPU seconds {subject} may spend reading or rendering one PDF page (or image); a page over it "
        "is refused "
        f"({DEFAULT_PAGE_SECONDS:g}; 0: no limit)",
    )
    parser.add_argument(
        RENDER_LIMIT_FLAGS["seconds"],
        type=float,
        default=DEFAULT_SECONDS if defaults else None,
        help=f"{prefix}CPU seconds {subject} may spend on one request's PDFs and images together ({DEFAULT_SECONDS:g}; "
        "0: no limit)",
    )
    parser.add_argument(
        RENDER_LIMIT_FLAGS["memory_mb"],
        type=int,
        default=DEFAULT_MEMORY_MB if defaults else None,
        help=f"{prefix}memory (address space, MiB) of the process that renders one request's PDFs and images "
        f"({DEFAULT_MEMORY_MB}; 0: no limit)",
    )


def render_limits_from_args(a) -> RenderLimits:
    """The :class:`RenderLimits` of :func:`add_render_limit_arguments`' flags (None: the
    default). A flag that is not a finite number of zero or more raises ``ValueError`` naming it
    (the class itself takes any number, zero or less meaning no limit, for the JSON of
    repositories written before)."""
    defaults = RenderLimits()
    values = {}
    for field, flag in RENDER_LIMIT_FLAGS.items():
        value = getattr(a, _dest(flag))
        if value is None:
            value = getattr(defaults, field)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{flag} must be a finite number >= 0 (0: no limit), got {value!r}")
        values[field] = value
    return RenderLimits(**values)


def render_limit_flags_given(a) -> list[str]:
    """The flags of :func:`add_render_limit_arguments` (``defaults=False``) that were given."""
    return [flag for flag in RENDER_LIMIT_FLAGS.values() if getattr(a, _dest(flag), None) is not None]


def _dest(flag: str) -> str:
    """argparse's attribute name of ``flag``."""
    return flag.lstrip("-").replace("-", "_")


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


class _Stop(Exception):
    """The wait for the worker's answer ended without one: ``why`` is ``cancelled``, ``late`` (the
    wall-clock deadline) or ``ended`` (the process ended, with status ``code``)."""

    def __init__(self, why: str, code: int | None = None):
        super().__init__(why)
        self.why, self.code = why, code


class _Worker:
    """One worker process (:mod:`dash_trt.documents.render_worker`) and the pipes to it."""

    def __init__(self, command: list[str], spec: dict):
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

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """Killed (it may be inside a page) and waited for: no zombie is left."""
        proc = self.proc
        if proc.poll() is None:
            proc.kill()
        for stream in (proc.stdin, proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
        proc.wait()

    def send(self, header: dict, payload: bytes = b"") -> None:
        """Write one message, waiting for no answer (a worker that died says so at the next
        :meth:`exchange`, from its exit status)."""
        proc = self.proc
        blob = json.dumps(dict(header, bytes=len(payload))).encode()
        try:
            proc.stdin.write(struct.pack(">I", len(blob)) + blob)
            if payload:
                proc.stdin.write(payload)
            proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):  # ValueError: its pipe is closed
            pass

    def exchange(
        self, header: dict, payload: bytes, *, deadline: float, clock: Callable[[], float], cancelled
    ) -> tuple[dict, bytes]:
        """Send one message and wait for the answer until ``clock()`` passes ``deadline`` or
        ``cancelled()`` (:class:`_Stop`). A garbled answer raises ``ValueError``."""
        proc = self.proc
        self.send(header, payload)
        reader = _Frames(proc.stdout.fileno())
        while True:
            if cancelled():
                raise _Stop("cancelled")
            if clock() > deadline:
                raise _Stop("late")
            ready, _, _ = select.select([reader.fd], [], [], POLL)
            if ready and reader.read():
                return reader.frame()
            if reader.eof:
                raise _Stop("ended", proc.wait())


def _kill_all(workers: list[_Worker]) -> None:
    while workers:
        workers.pop().kill()


class RenderWorkers:
    """Warm worker processes for one model instance's requests (one :class:`DocumentProcessor
    <dash_trt.documents.processor.DocumentProcessor>`): a request's :class:`Renderer` takes an
    idle one (or starts one) and gives it back when the request ends, healthy, with its PDF
    closed. A worker that was killed (a page over its budget, a cancel, the deadline, a failure
    or a garbled answer) is replaced at once in the background (``prestart``). At most ``keep``
    idle workers are kept: requests rendering at the same time each get their own, and the
    surplus is stopped when they end. :meth:`close` (also a context manager, and when the object
    is collected or the interpreter exits) stops the idle ones; a worker still in use is stopped
    when its request ends. ``command``: the worker's command line (a test's fake worker)."""

    def __init__(
        self,
        limits: RenderLimits | None = None,
        *,
        command: list[str] | None = None,
        keep: int = 1,
        prestart: bool = True,
    ):
        self.limits = limits or RenderLimits()
        self.command = command
        self.keep = max(int(keep), 0)
        self.prestart = prestart
        self.closed = False
        self.starts = 0  # worker processes started so far
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _kill_all, self._idle)

    def __enter__(self) -> RenderWorkers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _spawn(self) -> _Worker:
        spec = {"memory_mb": max(int(self.limits.memory_mb), 0), "max_pages": MAX_PAGES, "documents": _FOLDER}
        command = self.command or [_python(), "-S", "-c", _BOOT, WORKER]  # -S: sys.path comes from here
        worker = _Worker(command, spec)
        self.starts += 1
        return worker

    def _keep(self, worker: _Worker) -> bool:
        """Put ``worker`` among the idle ones if there is room (False: it is not kept)."""
        with self._lock:
            if self.closed or len(self._idle) >= self.keep:
                return False
            self._idle.append(worker)
            return True

    def warm(self) -> None:
        """Start a worker now (none idle, the limits isolate), so the next request pays no start."""
        with self._lock:
            wanted = self.limits.isolate and not self.closed and not self._idle and self.keep > 0
        if wanted:
            worker = self._spawn()
            if not self._keep(worker):
                worker.kill()

    def take(self) -> _Worker:
        """An idle worker that is alive, else a new one (also once closed: it is stopped when given back)."""
        while True:
            with self._lock:
                worker = self._idle.pop() if self._idle else None
            if worker is None:
                return self._spawn()
            if worker.alive():
                return worker
            worker.kill()  # it ended while idle: waited for

    def give(self, worker: _Worker) -> None:
        """A request is done with a healthy ``worker``: kept idle, or stopped."""
        if not (worker.alive() and self._keep(worker)):
            worker.kill()

    def discard(self, worker: _Worker) -> None:
        """Stop ``worker`` (killed, waited for) and, with ``prestart``, start its successor."""
        worker.kill()
        if self.prestart:
            self.warm()

    def close(self) -> None:
        """Stop the idle workers; no more are kept."""
        with self._lock:
            self.closed = True
            idle = list(self._idle)
            self._idle.clear()
        _kill_all(idle)


class Renderer:
    """One request's reading and rendering of PDFs (module docstring). ``workers``: the
    :class:`RenderWorkers` to take a worker from and give it back to (None: a worker of this
    request's own, stopped when it ends); ``cancelled``: says when the request is to stop (its
    client went away); ``clock``: wall-clock seconds (a test's fake); ``command``: the worker's
    command line (a test's fake worker) when there is no ``workers``."""

    def __init__(
        self,
        limits: RenderLimits | None = None,
        *,
        cancelled: Callable[[], bool] | None = None,
        clock: Callable[[], float] = time.monotonic,
        command: list[str] | None = None,
        workers: RenderWorkers | None = None,
    ):
        self._own = workers is None
        self.worker: _Worker | None = None
        #: the PDFs open in the worker for this request: id(bytes) -> (the bytes, the worker's id)
        self._docs: dict[int, tuple[bytes, int]] = {}
        self.limits = limits or (workers.limits if workers is not None else RenderLimits())
        if workers is None:
            workers = RenderWorkers(self.limits, command=command, keep=0, prestart=False)
        elif workers.limits.memory_mb != self.limits.memory_mb:
            raise ValueError(
                f"the workers' memory limit is {workers.limits.memory_mb} MiB, the request's {self.limits.memory_mb}"
            )
        self.workers = workers
        self.cancelled = cancelled or (lambda: False)
        self.clock = clock
        self.cpu = 0.0  # CPU seconds of this request's rendering so far (as the worker said)
        self.started = clock()

    @property
    def proc(self) -> subprocess.Popen | None:
        """The worker process this request holds (None: none yet, or it was killed)."""
        return self.worker.proc if self.worker is not None else None

    # ---------------------------------------------------------------- lifetime
    def __enter__(self) -> Renderer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):  # a request that was never closed: its worker is not trusted again
        worker = getattr(self, "worker", None)
        if worker is not None:
            self.worker = None
            worker.kill()
        if getattr(self, "_own", False):
            self.workers.close()

    def close(self) -> None:
        """The request is over: its worker, healthy, closes every PDF the request opened and goes
        back to :attr:`workers` (or is stopped: a worker of its own, one that is not answering or
        says it still holds a document)."""
        worker = self.worker
        self.worker, self._docs = None, {}
        if worker is not None:
            if not self._own and worker.alive() and self._let_go(worker):
                self.workers.give(worker)
            else:
                worker.kill()
        if self._own:
            self.workers.close()

    def _let_go(self, worker: _Worker) -> bool:
        """The worker closes the request's PDFs (True: it said so in time, none left open)."""
        try:
            head, _ = worker.exchange(
                {"op": "close"}, b"", deadline=self.clock() + CLOSE_SECONDS, clock=self.clock, cancelled=lambda: False
            )
        except (_Stop, ValueError, TypeError, KeyError, struct.error):
            return False
        return head.get("ok") is True and head.get("open") == 0

    def _kill(self) -> None:
        """Kill this request's worker (inside a page, or not to be trusted again)."""
        worker, self.worker, self._docs = self.worker, None, {}
        if worker is not None:
            self.workers.discard(worker)

    # ---------------------------------------------------------------- checks
    def check(self, name: str) -> None:
        """Before a page: :class:`RenderCancelled` when the request was cancelled, a
        ``DocumentError`` naming ``name`` when the request's rendering is past its wall-clock
        deadline."""
        if self.cancelled():
            self._kill()
            raise RenderCancelled(f"{name}: rendering stopped, the request was cancelled")
        if self.clock() - self.started > self.limits.total * WALL_FACTOR:
            self._kill()
            raise DocumentError(
                f"{name}: the request's pages took more than {self.limits.total * WALL_FACTOR:g} s to render "
                f"(the rendering limit is {self.limits.total:g} CPU seconds a request); send fewer or simpler pages"
            )

    # ---------------------------------------------------------------- the worker
    def _start(self) -> _Worker:
        """This request's worker: the one it holds, else one taken from :attr:`workers`."""
        if self.worker is not None and not self.worker.alive():
            self._kill()
        if self.worker is None:
            self.worker = self.workers.take()
            self._docs = {}
        return self.worker

    def _over(self, name: str, what: str, why: str = "its content takes too long to draw"):
        """The ``DocumentError`` of a page over a limit; the worker is killed."""
        self._kill()
        return DocumentError(f"{name}: {what}; the page is refused ({why})")

    def _cpu_limit(self) -> tuple[float, str]:
        """The CPU seconds the next step may take and which limit that is."""
        lim = self.limits
        left = lim.total - self.cpu
        if left < lim.page:
            return max(left, 0.0), f"the request's {lim.total:g} CPU seconds of rendering"
        return lim.page, f"the page's {lim.page:g} CPU seconds of rendering"

    def _ask(self, name: str, header: dict, payload: bytes = b"") -> tuple[dict, bytes]:
        """Send one message to the worker and wait for its answer, within the limits: the worker
        arms its CPU limit to ``cpu`` seconds past what it has used before it starts."""
        limit, which = self._cpu_limit()
        if limit <= 0:
            raise self._over(name, f"rendering took more than {which}")
        worker = self._start()
        wall = limit * WALL_FACTOR if limit < math.inf else math.inf
        try:
            head, data = worker.exchange(
                dict(header, cpu=limit if limit < math.inf else None),
                payload,
                deadline=self.clock() + wall,
                clock=self.clock,
                cancelled=self.cancelled,
            )
            cpu = float(head.get("cpu", 0.0))
            if not 0.0 <= cpu < math.inf:
                raise ValueError(f"CPU seconds {cpu!r}")
        except _Stop as stop:
            if stop.why == "cancelled":
                self._kill()
                raise RenderCancelled(f"{name}: rendering stopped, the request was cancelled") from None
            if stop.why == "late":
                raise self._over(name, f"rendering took more than {wall:g} s ({which} x {WALL_FACTOR:g})") from None
            if stop.code in _CPU_SIGNALS:  # the kernel's CPU limit
                raise self._over(name, f"rendering took more than {which}") from None
            self._kill()
            raise _dead(name, stop.code) from None
        except (ValueError, TypeError, KeyError, AttributeError, struct.error) as exc:  # not the protocol
            self._kill()
            raise PageError(f"{name}: cannot be rendered (the rendering process answered garbage: {exc})") from None
        self.cpu += cpu
        if head.get("ok") is True or head.get("closed") is True:  # closed: the PDF is sent again
            return head, data
        self._kill()  # a worker that failed (a damaged file, no memory left) is not used again
        if head.get("memory"):
            raise self._over(
                name, f"rendering needs more than {self.limits.memory_mb} MiB of memory", "it takes too much memory"
            )
        return head, b""

    def open_pdf(self, data: bytes, name: str) -> tuple[int, list[tuple[float, float]]]:
        """The page count of a PDF's ``data`` and each page's size in points (rotation applied;
        none when there are more pages than a request may hold). The worker keeps the document
        open for :meth:`render_pdf_page` until :meth:`close_pdf`."""
        self.close_pdf(data)
        self.check(name)
        doc = next(_IDS)
        head, _ = self._ask(name, {"op": "open", "id": doc}, data)
        if not head.get("ok"):
            if _declares_no_pages(data):
                raise DocumentError(f"{name}: the PDF has 0 pages")
            raise DocumentError(f"{name}: not a readable PDF ({head.get('error')})")
        try:
            count, sizes = int(head["pages"]), [(float(w), float(h)) for w, h in head.get("sizes", [])]
        except (KeyError, ValueError, TypeError):
            self._kill()
            raise DocumentError(f"{name}: not a readable PDF (the renderer answered {head!r:.200})") from None
        self._docs[id(data)] = (data, doc)
        return count, sizes

    def close_pdf(self, data: bytes) -> None:
        """The worker lets go of the PDF ``data`` (no answer awaited; nothing when it is not open)."""
        entry = self._docs.pop(id(data), None)
        if entry is not None and self.worker is not None and self.worker.alive():
            self.worker.send({"op": "close", "id": entry[1]})

    def render_pdf_page(self, data: bytes, index: int, scale: float, name: str):
        """Page ``index`` of the PDF ``data`` rendered at ``scale`` (a ``PIL.Image``); the PDF is
        opened in the worker first unless it has it open already."""
        for _ in range(2):  # a second time when the worker had let the document go
            entry = self._docs.get(id(data))
            if entry is None or entry[0] is not data or self.worker is None or not self.worker.alive():
                self.open_pdf(data, name)
                entry = self._docs[id(data)]
            self.check(name)
            head, raw = self._ask(name, {"op": "render", "id": entry[1], "index": int(index), "scale": float(scale)})
            if not head.get("closed"):
                break
            self._docs.pop(id(data), None)
        if not head.get("ok"):
            raise PageError(f"{name}: cannot be rendered ({head.get('error')})")
        return self._bitmap(name, head, raw, "rendered")

    def _bitmap(self, name: str, head: dict, raw: bytes, done: str):
        """The ``PIL.Image`` of a worker's bitmap answer (checked: a garbled one kills the worker)."""
        try:
            w, h, stride = int(head["width"]), int(head["height"]), int(head["stride"])
            mode, raw_mode = _MODES[head["mode"]]
        except (KeyError, ValueError, TypeError):
            self._kill()
            raise PageError(f"{name}: cannot be {done} (the renderer answered {head!r:.200})") from None
        if not (0 < w and 0 < h and w * h <= MAX_PIXELS and stride * h == len(raw)):
            self._kill()
            raise PageError(f"{name}: cannot be {done} (a bitmap of {w}x{h} pixels, {len(raw)} bytes)")
        Image, _ = _pil()
        return Image.frombuffer(mode, (w, h), raw, "raw", raw_mode, stride, 1)

    # ---------------------------------------------------------------- images
    def open_image(self, data: bytes, name: str, refuse: bool = False, max_pixels: int = MAX_PIXELS) -> ImageInfo:
        """An image file's frames and sizes (:func:`~dash_trt.documents.images.probe_image`, in
        the worker, within the limits: a file it refuses is that function's
        ``DocumentError``). The worker keeps the file under an id for
        :meth:`decode_image_frame` until :meth:`close_pdf`, as a PDF."""
        self.close_pdf(data)
        self.check(name)
        doc = next(_IDS)
        ask = {"op": "image", "id": doc, "name": name, "refuse": bool(refuse), "max_pixels": int(max_pixels)}
        head, _ = self._ask(name, ask, data)
        if not head.get("ok"):
            raise DocumentError(str(head.get("refused") or f"{name}: not a readable image ({head.get('error')})"))
        try:
            info = ImageInfo.from_dict(head["image"])
        except (KeyError, ValueError, TypeError):
            self._kill()
            raise DocumentError(f"{name}: not a readable image (the renderer answered {head!r:.200})") from None
        self._docs[id(data)] = (data, doc)
        return info

    def decode_image_frame(self, data: bytes, index: int, name: str):
        """Frame ``index`` of the image file ``data`` decoded to RGB in the worker
        (:func:`~dash_trt.documents.images.decode_frame`; a ``PIL.Image``); the file is sent to
        the worker first unless it has it already."""
        for _ in range(2):  # a second time when the worker had let the file go
            entry = self._docs.get(id(data))
            if entry is None or entry[0] is not data or self.worker is None or not self.worker.alive():
                self.open_image(data, name, refuse=True)  # held again, its pages known
                entry = self._docs[id(data)]
            self.check(name)
            head, raw = self._ask(name, {"op": "decode", "id": entry[1], "index": int(index), "name": name})
            if not head.get("closed"):
                break
            self._docs.pop(id(data), None)
        if not head.get("ok"):
            message = head.get("refused") or f"{name}: cannot be decoded ({head.get('error')})"
            raise (PageError if head.get("page", True) else DocumentError)(str(message))
        return self._bitmap(name, head, raw, "decoded")


def _dead(name: str, code: int | None):
    how = f"signal {-code}" if code is not None and code < 0 else f"status {code}"
    return PageError(
        f"{name}: cannot be rendered (the rendering process ended with {how}: a damaged file, or more memory "
        "than the rendering limit)"
    )


class _Frames:
    """Reads one frame (4-byte length, JSON header, payload) from a pipe without blocking; an
    answer that is not one frame raises ``ValueError``."""

    def __init__(self, fd: int):
        self.fd = fd
        self.buf = bytearray()
        self.eof = False
        self.need: int | None = None
        self.head: dict | None = None
        self.start = 0

    def read(self) -> bool:
        """Read what is there; True once a whole frame is in."""
        chunk = os.read(self.fd, 1 << 20)
        if not chunk:
            self.eof = True
            return False
        self.buf += chunk
        if self.need is None and len(self.buf) >= 4:
            (n,) = struct.unpack(">I", self.buf[:4])
            if n > _MAX_HEADER:
                raise ValueError(f"a header of {n} bytes")
            if len(self.buf) >= 4 + n:
                head = json.loads(self.buf[4 : 4 + n])
                size = head.get("bytes", 0) if isinstance(head, dict) else None
                if not isinstance(size, int) or size < 0:
                    raise ValueError(f"a header {head!r:.200}")
                self.head, self.start, self.need = head, 4 + n, 4 + n + size
        if self.need is not None and len(self.buf) > self.need:
            raise ValueError(f"{len(self.buf) - self.need} bytes past the answer")
        return self.need is not None and len(self.buf) >= self.need

    def frame(self) -> tuple[dict, bytes]:
        return self.head, bytes(self.buf[self.start : self.need])
