"""``dash-trt ocr``: PDFs and images in, markdown out, one section per page.

    dash-trt ocr report.pdf scans/*.png --server 127.0.0.1:8001 --out out/
    dash-trt ocr report.pdf --checkpoint MODEL_FOLDER --out out/      # offline, in this process
    dash-trt ocr scans/ --files-from more.txt --checkpoint MODEL_FOLDER --out out/   # run again: resumes

Each input file is one document (one request): with ``--server`` it goes to the Triton document
model (``<model>_document``, written by ``dash-triton write`` for a checkpoint with a vision
tower and a tokenizer); with ``--checkpoint`` the same steps run here
(:class:`~dash_trt.serving.documents.DocumentOCR`). For ``NAME.pdf`` it writes ``OUT/NAME.md``
(every page under a ``<!-- page N: source -->`` comment) and ``OUT/NAME/page-0001.md`` ... (one
file a page), each written whole. With ``--server``, documents go out ``--concurrency`` at a
time, and a request the server could not take (UNAVAILABLE, a refused or lost connection) is
retried ``--retries`` times with a growing pause (0.5 s, doubling, at most 30 s); a failure to
reach the server names its URL. With ``--checkpoint`` the one model in this process takes
documents one at a time (``--concurrency`` above 1 is ignored, with a note). A document that
fails is reported with its reason (which names the page) and the others go on. A progress bar
counts documents (and pages read, skipped and failed); with ``--checkpoint`` a second one counts
the pages of the document being read. A folder given stands for the PDFs and images in it
(sorted; ``--recursive``: its subfolders' too); ``--files-from`` reads more paths, one a line.

Resume and retries: ``--out`` is a workspace. ``OUT/manifest.json``
(:mod:`dash_trt.documents.workspace`) names each document's input (path, size, sha256), the
options that change its text, its status, its pages' finish reasons and its files' digests, and
is written whole after each document (every file is written whole, through a temporary file). A
run again with the same ``--out`` skips a document whose entry is complete, whose input and
options are unchanged and whose files are there as written (``--no-resume``: every document is
done again). The unit is the document: one request reads all its pages, so its pages cannot be
generated again one by one and give the same text. A page that cannot be rendered or decoded
(a damaged page; not one over a rendering budget) is tried ``--max-page-retries`` more times
(1); then it is left out of the prompt and reported (finish reason ``error``), unless more than
``--max-page-error-rate`` of the document's pages (0.1) failed: then the document fails.

Every page has its own token budget, the same on both paths and on the server's other doors:
``--max-page-tokens`` (default 20000, :data:`~dash_trt.documents.budget.DEFAULT_MAX_PAGE_TOKENS`),
and the document as a whole ``(pages + 1) x (max-page-tokens + 1)`` unless ``--max-new-tokens``
says, held to what the model admits. A page that ran out of its budget (finish reason
``length``) is written but counted and named in the summary, and the exit status is 3; so is a
page refused alone (finish reason ``refused``: over the pixel or image-token budget; its record's
``error`` says why) while the document's other pages are transcribed, and a page that could not
be rendered (finish reason ``error``).
``--format jsonl`` prints one JSON record a page: the input file, page number, output file,
markdown, finish reason (``stop``, ``length``, ``guard``, ``refused``, ``error``), tokens and
seconds (a skipped document's from the manifest and its page files).

Exit codes: 0 every document transcribed, every page complete; 1 some failed (each listed);
2 bad arguments; 3 every document written, but some page ran out of its token budget, was
refused or could not be rendered (each named).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any, TextIO

from ..documents.budget import DEFAULT_MAX_PAGE_TOKENS
from ..documents.render import add_render_limit_arguments, render_limit_flags_given, render_limits_from_args
from ..documents.workspace import MANIFEST, Workspace, input_info, sha256_text
from ..fileio import atomic_write

__all__ = ["add_parser", "ocr_main", "DocumentOutcome"]

#: Statuses or messages (compared ignoring case) of a request that may succeed when sent again:
#: the server busy or not (yet) reachable, ``ConnectionRefusedError: ... Connection refused``, a
#: connection lost on the way.
RETRYABLE = ("unavailable", "503", "connection")
#: The pause before resend ``n`` (0-based): ``BACKOFF[0] * 2**n`` seconds, at most ``BACKOFF[1]``.
BACKOFF = (0.5, 30.0)
#: Documents in flight at once through a server unless --concurrency says otherwise.
DEFAULT_CONCURRENCY = 4
#: The exit status of a run that wrote every document but cut a page at its token budget.
EXIT_TRUNCATED = 3
EXIT_CODES = (
    "Exit codes: 0 every document transcribed, every page complete; 1 some failed (each listed); 2 bad "
    "arguments; 3 every document written, but some page ran out of its token budget, was refused or could not "
    "be rendered (each named). Resume: --out is a workspace; its manifest.json names each output's input, and a "
    "run again skips the documents already written from unchanged inputs with the same options (--no-resume: "
    "none); the unit is the document (one request reads all its pages, so a page alone cannot be done again "
    "and give the same text)."
)
#: Tries again of a page that could not be rendered or decoded, unless --max-page-retries says: one
#: covers a rendering process that died by chance (it is replaced); a damaged page fails the same
#: way every time, so more would only repeat the failure.
DEFAULT_PAGE_RETRIES = 1
#: The fraction of a document's pages that may fail with the document still written, unless
#: --max-page-error-rate says (olmOCR's pipeline discards a document past 0.004 of failed pages,
#: but its pages fail after 8 generation retries in large crawls; here a failed page is one that
#: cannot be rendered at all, and 0.004 would fail any document under 250 pages on its one
#: damaged page, which is what this budget is for).
DEFAULT_PAGE_ERROR_RATE = 0.1
#: What a folder given as an input stands for: the files in it with these extensions.
DOCUMENT_EXTENSIONS = (".pdf", ".png", ".jpg", ".jpeg", ".tif", ".tiff", ".webp", ".bmp", ".gif")


def _retryable(status: str | None, message: str) -> bool:
    text = f"{status or ''} {message}".lower()
    return any(s in text for s in RETRYABLE)


def _pause(attempt: int) -> float:
    return min(BACKOFF[1], BACKOFF[0] * 2**attempt)


@dataclass
class DocumentOutcome:
    path: str
    pages: list[dict[str, Any]] | None = None
    error: str | None = None
    attempts: int = 0
    #: not done again: its outputs and entry in the manifest were written by an earlier run
    skipped: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def truncated(self) -> list[int]:
        """The pages that ran out of their token budget (finish reason ``length``)."""
        return [p["page"] for p in self.pages or [] if p.get("finish_reason") == "length"]

    @property
    def refused(self) -> list[dict[str, Any]]:
        """The pages refused before the model read them (finish reason ``refused``; ``error``
        says why: over the pixel or image-token budget)."""
        return [p for p in self.pages or [] if p.get("finish_reason") == "refused"]

    @property
    def failed_pages(self) -> list[dict[str, Any]]:
        """The pages that could not be rendered after their retries (finish reason ``error``),
        left out of a document that was transcribed without them."""
        return [p for p in self.pages or [] if p.get("finish_reason") == "error"]


def add_parser(sub) -> argparse.ArgumentParser:
    o = sub.add_parser(
        "ocr",
        help="PDFs and images to markdown, one section per page (through a server or in this process)",
        description=__doc__.split("\n\n")[0],
        epilog=EXIT_CODES,
    )
    o.add_argument(
        "files",
        nargs="*",
        help="PDF or image files, each one document, or folders of them (their PDFs and images, sorted)",
    )
    o.add_argument("--files-from", metavar="PATH", help="more inputs, one path a line (# comments, blank lines)")
    o.add_argument("--recursive", action="store_true", help="a folder given: its subfolders' files too")
    where = o.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--server",
        metavar="URL",
        help="a Triton server's gRPC address (host:port; dash-triton serve's is 127.0.0.1:8001), or its HTTP "
        "address with --protocol http",
    )
    where.add_argument("--checkpoint", metavar="FOLDER", help="run the model here, from its checkpoint folder")
    o.add_argument(
        "--protocol",
        choices=("grpc", "http"),
        default="grpc",
        help="with --server: how to reach it (default %(default)s; dash-triton serve keys HTTP inference, so "
        "over http pass --admin-key-file)",
    )
    o.add_argument(
        "--admin-key-file",
        metavar="PATH",
        help="with --server over http: the admin key dash-triton serve --admin-key-file wrote",
    )
    o.add_argument(
        "--device", help="with --checkpoint: where the model runs (cpu, cuda, cuda:1; default: where it loads, the CPU)"
    )
    o.add_argument(
        "--dtype",
        choices=("float32", "float16", "bfloat16"),
        help="with --checkpoint: the model's dtype (default: the checkpoint's)",
    )
    o.add_argument(
        "--out",
        "-o",
        required=True,
        help=f"folder for the markdown (created); a workspace: its {MANIFEST} lets a run again skip the documents "
        "already written",
    )
    o.add_argument(
        "--no-resume",
        action="store_true",
        help=f"do every document again, whatever {MANIFEST} says was written",
    )
    o.add_argument(
        "--max-page-retries",
        type=int,
        help=f"with --checkpoint: tries again of a page that cannot be rendered or decoded ({DEFAULT_PAGE_RETRIES}; "
        "a page over a rendering budget is not tried again)",
    )
    add_render_limit_arguments(o, "the rendering worker", prefix="with --checkpoint: ", defaults=False)
    o.add_argument(
        "--max-page-error-rate",
        type=float,
        help=f"with --checkpoint: the fraction of a document's pages that may fail with the document still written "
        f"without them ({DEFAULT_PAGE_ERROR_RATE}; more fails it)",
    )
    o.add_argument("--model", default="dash", help="the repository's model name (NAME_document is called)")
    o.add_argument("--prompt", help="the instruction after the pages (default: the model's recipe)")
    o.add_argument(
        "--crop",
        choices=("auto", "on", "off"),
        default="auto",
        help="tiles of each page: auto (upstream's default: every page), on, off",
    )
    o.add_argument(
        "--max-new-tokens",
        type=int,
        help="tokens to generate a document (default: (pages + 1) x (--max-page-tokens + 1), within what the "
        "model admits)",
    )
    o.add_argument(
        "--max-page-tokens",
        type=int,
        help=f"each page's token budget: a page reaching it moves on to the next (default {DEFAULT_MAX_PAGE_TOKENS})",
    )
    o.add_argument("--max-page-image-tokens", type=int, help="refuse a page that takes more image tokens")
    o.add_argument("--no-page-guard", action="store_true", help="do not hold the answer to one section a page")
    o.add_argument("--no-repeat-ngram", type=int, help="n-gram size the answer may not repeat (default 35; 0 off)")
    o.add_argument("--no-repeat-window", type=int, help="... within this many tokens (default 128 / 1024)")
    o.add_argument(
        "--concurrency",
        type=int,
        help=f"with --server: documents in flight at once ({DEFAULT_CONCURRENCY}); with --checkpoint documents "
        f"run one at a time",
    )
    o.add_argument(
        "--retries",
        type=int,
        default=3,
        help="resends of a request the server could not take, a refused connection included (3; 0.5 s, "
        "doubling, between them)",
    )
    o.add_argument("--timeout", type=float, default=3600.0, help="seconds a document may take (%(default)s)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    o.add_argument(
        "--format",
        choices=("text", "json", "jsonl"),
        default="text",
        help="what to print: text (a summary), json (one JSON line a document), jsonl (one JSON record a page)",
    )
    o.add_argument("--json", action="store_true", help="the same as --format json")
    return o


def _stems(paths: Sequence[str]) -> list[str]:
    """Output names: each file's name without its extension, made unique (``a``, ``a-2``, ...,
    skipping a name another file has: ``a.pdf a.png a-2.pdf`` give ``a``, ``a-3``, ``a-2``)."""
    bases = [os.path.splitext(os.path.basename(p))[0] or "document" for p in paths]
    taken = {MANIFEST}  # the workspace's manifest
    out = []
    for i, stem in enumerate(bases):
        name, n = stem, 1
        # a name is free when no earlier file took it and no later file has it as its own
        while name in taken or (name != stem and name in bases[i + 1 :]):
            n += 1
            name = f"{stem}-{n}"
        taken.add(name)
        out.append(name)
    return out


def _write_text(path: str, text: str) -> str:
    """``text`` written whole at ``path``; its sha256."""

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8", newline="") as fh:
            fh.write(text)

    atomic_write(path, write)
    return sha256_text(text)


def page_file(out: str, stem: str, page: int) -> str:
    return os.path.join(out, stem, f"page-{page:04d}.md")


def write_outputs(out: str, stem: str, pages: list[dict[str, Any]]) -> dict[str, str]:
    """``OUT/STEM/page-NNNN.md`` and then ``OUT/STEM.md``, each written whole; their sha256 by
    their paths in ``OUT``. A symbolic link at ``OUT/STEM`` is refused (the pages would be written
    wherever it points)."""
    folder = os.path.join(out, stem)
    if os.path.islink(folder):
        raise OSError(f"{folder} is a symbolic link: not written through")
    os.makedirs(folder, exist_ok=True)
    digests = {}
    for p in pages:
        text = p["text"].rstrip() + "\n"
        digests[f"{stem}/page-{p['page']:04d}.md"] = _write_text(page_file(out, stem, p["page"]), text)
    body = "\n\n".join(f"<!-- page {p['page']}: {_page_note(p)} -->\n\n{p['text'].strip()}" for p in pages)
    digests[stem + ".md"] = _write_text(os.path.join(out, stem + ".md"), body + "\n")
    return digests


def _page_note(p: dict[str, Any]) -> str:
    """A page's comment in ``OUT/STEM.md``: its source, and why it was refused if it was."""
    why = {"refused": "refused", "error": "failed"}.get(p.get("finish_reason"))
    if why:
        return f"{p['source']} ({why}: {str(p.get('error') or '').replace('--', '- -')})"
    return p["source"]


def _options(a) -> tuple[dict[str, Any], dict[str, Any]]:
    rules = {
        "page_guard": False if a.no_page_guard else None,
        "max_page_tokens": a.max_page_tokens,
        "no_repeat_ngram": a.no_repeat_ngram,
        "no_repeat_window": a.no_repeat_window,
    }
    crop = {"auto": None, "on": True, "off": False}[a.crop]
    return {k: v for k, v in rules.items() if v is not None}, {"crop": crop}


def _remote(a, rules: dict[str, Any], crop: bool | None, sleep: Callable[[float], None] = time.sleep):
    from ..triton.client import DashClient, DashClientError

    key = None
    if a.admin_key_file:
        from ..triton.server import read_admin_key

        key = read_admin_key(a.admin_key_file)
    client = DashClient(
        a.server, protocol=a.protocol, model=a.model, timeout=a.timeout, concurrency=a.concurrency, admin_key=key
    )

    def run(path: str) -> DocumentOutcome:
        outcome = DocumentOutcome(path)
        with open(path, "rb") as fh:
            data = fh.read()
        if not data:  # as in this process (the server would not know the file's name)
            outcome.error = f"{os.path.basename(path)}: the file is empty"
            return outcome
        for attempt in range(a.retries + 1):
            outcome.attempts = attempt + 1
            try:
                answer = client.ocr(
                    data,
                    os.path.basename(path),
                    instruction=a.prompt,
                    crop=crop,
                    max_page_image_tokens=a.max_page_image_tokens,
                    max_new_tokens=a.max_new_tokens,
                    rules=rules,
                )
                outcome.pages = answer["pages"]
                outcome.error = None
                return outcome
            except DashClientError as exc:
                retry = _retryable(exc.status, str(exc))
                outcome.error = (
                    f"server {a.server} not reached or busy after {attempt + 1} attempt(s): {exc}"
                    if retry
                    else str(exc)
                )
                if not retry or attempt == a.retries:
                    return outcome
                sleep(_pause(attempt))
        return outcome

    return run, client.close


def _local(a, rules: dict[str, Any], crop: bool | None, pages_bar=None):
    import threading

    from ..documents.pages import DocumentError
    from ..documents.processor import DocumentOptions
    from ..models.config import DTYPES
    from ..serving.documents import DocumentOCR

    ocr = DocumentOCR(
        a.checkpoint,
        dtype=DTYPES[a.dtype] if a.dtype else None,
        device=a.device,
        render_limits=render_limits_from_args(a),
    )
    lock = threading.Lock()  # one model in this process: documents in turn

    def run(path: str) -> DocumentOutcome:
        outcome = DocumentOutcome(path, attempts=1)
        options = DocumentOptions(
            crop=crop,
            instruction=a.prompt,
            max_page_tokens=a.max_page_image_tokens,
            page_retries=a.max_page_retries,
            max_page_error_rate=a.max_page_error_rate,
        )
        try:
            with open(path, "rb") as fh:
                source = (os.path.basename(path), fh.read())  # named as the server names it
            with lock:
                progress = pages_bar(source[0]) if pages_bar is not None else None
                result = ocr.transcribe(
                    [source], options, max_new_tokens=a.max_new_tokens, rules=rules, progress=progress
                )
            outcome.pages = [
                {
                    "page": p.page,
                    "source": p.source,
                    "text": p.text,
                    "finish_reason": p.finish_reason,
                    "tokens": len(p.tokens),
                    "seconds": p.seconds,
                }
                | ({"error": p.error} if getattr(p, "error", None) else {})
                for p in result.pages
            ]
        except DocumentError as exc:
            outcome.error = str(exc)
        return outcome

    return run, ocr.close  # the run's end stops the rendering worker


def _check_args(a, err: TextIO) -> int:
    """2 with one line on ``err`` for arguments that do not go together; 0 otherwise (the
    defaults filled in)."""
    if (a.concurrency is not None and a.concurrency < 1) or a.retries < 0:
        print("dash-trt ocr: error: --concurrency must be >= 1 and --retries >= 0", file=err)
        return 2
    if (a.max_page_retries is not None and a.max_page_retries < 0) or not (
        a.max_page_error_rate is None or 0.0 <= a.max_page_error_rate <= 1.0
    ):
        print("dash-trt ocr: error: --max-page-retries must be >= 0 and --max-page-error-rate in [0, 1]", file=err)
        return 2
    try:
        render_limits_from_args(a)  # the flags' one check (dash-triton write's)
    except ValueError as exc:
        print(f"dash-trt ocr: error: {exc}", file=err)
        return 2
    if a.concurrency is None:
        a.concurrency = DEFAULT_CONCURRENCY if a.server else 1
    elif a.checkpoint and a.concurrency > 1:
        print(
            f"dash-trt ocr: note: --concurrency {a.concurrency} is for --server; with --checkpoint the model in "
            f"this process takes documents one at a time",
            file=err,
        )
        a.concurrency = 1
    if a.server and (a.max_page_retries is not None or a.max_page_error_rate is not None):
        print(
            "dash-trt ocr: note: --max-page-retries and --max-page-error-rate are for --checkpoint; the server's "
            "document model fails a document on a page it cannot render",
            file=err,
        )
    given = render_limit_flags_given(a)
    if a.server and given:
        print(
            f"dash-trt ocr: note: {' and '.join(given)} are for --checkpoint; the server's document model renders "
            "within its own limits (dash-triton write's flags of the same names)",
            file=err,
        )
    if a.max_page_retries is None:
        a.max_page_retries = DEFAULT_PAGE_RETRIES
    if a.max_page_error_rate is None:
        a.max_page_error_rate = DEFAULT_PAGE_ERROR_RATE
    if a.server and (a.device or a.dtype):
        print("dash-trt ocr: error: --device and --dtype are for --checkpoint (a server runs its own)", file=err)
        return 2
    return 0


def _folder(folder: str, recursive: bool) -> list[str]:
    """The PDFs and images in ``folder`` (:data:`DOCUMENT_EXTENSIONS`, hidden files left out),
    sorted; with ``recursive`` then each subfolder's, in order."""
    found = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".")) if recursive else []
        for name in sorted(files):
            path = os.path.join(root, name)
            if not name.startswith(".") and name.lower().endswith(DOCUMENT_EXTENSIONS) and os.path.isfile(path):
                found.append(path)
    return found


def _inputs(a) -> tuple[list[str], str | None]:
    """The documents of a run: each file named, each folder's PDFs and images (:func:`_folder`),
    then ``--files-from``'s paths (folders likewise); or why there are none to run."""
    given = list(a.files)
    if a.files_from:
        try:
            with open(a.files_from, encoding="utf-8") as fh:
                given += [s for s in (line.strip() for line in fh) if s and not s.startswith("#")]
        except (OSError, UnicodeDecodeError) as exc:
            return [], f"--files-from {a.files_from}: {getattr(exc, 'strerror', None) or exc}"
    if not given:
        return [], "no input: name PDF or image files, folders of them, or --files-from"
    files, missing, empty = [], [], []
    for f in given:
        if os.path.isdir(f):
            found = _folder(f, a.recursive)
            files += found
            if not found:
                empty.append(f)
        elif os.path.isfile(f):
            files.append(f)
        else:
            missing.append(f)
    if missing:
        return [], f"no such file: {', '.join(missing)}"
    if empty:
        return [], f"no PDF or image in {', '.join(empty)}" + ("" if a.recursive else " (--recursive: subfolders)")
    return files, None


def output_options(a) -> dict[str, Any]:
    """The options that change a document's text, as the manifest records them: a document
    written under others is done again."""
    if a.checkpoint:
        backend: dict[str, Any] = {"checkpoint": os.path.abspath(a.checkpoint), "dtype": a.dtype}
    else:
        backend = {"server_model": a.model}
    return {
        "backend": backend,
        "prompt": a.prompt,
        "crop": a.crop,
        "max_new_tokens": a.max_new_tokens,
        "max_page_tokens": a.max_page_tokens,
        "max_page_image_tokens": a.max_page_image_tokens,
        "page_guard": not a.no_page_guard,
        "no_repeat_ngram": a.no_repeat_ngram,
        "no_repeat_window": a.no_repeat_window,
    }


def _skipped(path: str, entry: dict[str, Any], out: str, stem: str) -> DocumentOutcome | None:
    """A document an earlier run wrote: its pages from the manifest, each page's markdown from
    its file (None: a page file that cannot be read; the document is done again)."""
    pages = []
    try:
        for p in entry["pages"]:
            with open(page_file(out, stem, int(p["page"])), encoding="utf-8", newline="") as fh:
                text = fh.read()
            pages.append(dict(p, text=text[:-1] if text.endswith("\n") else text))
    except (OSError, KeyError, TypeError, ValueError, UnicodeDecodeError):
        return None
    return DocumentOutcome(path, pages=pages, skipped=True)


class _Bars:
    """The progress bars on ``err``: documents (with pages read, skipped and failed), and with
    ``pages`` a second one for the pages of the document being read."""

    def __init__(self, total: int, err: TextIO, disable: bool, pages: bool):
        try:
            from tqdm import tqdm
        except ImportError:  # a declared dependency of the documents extra
            tqdm = None
        self.docs = tqdm(total=total, unit="doc", file=err, disable=disable) if tqdm else None
        self.pages = None
        if tqdm and pages:
            self.pages = tqdm(total=0, unit="page", file=err, disable=disable, leave=False, position=1)
        self.counts = {"pages": 0, "skipped": 0, "failed": 0}

    def document(self, name: str) -> Callable[[int, int], None] | None:
        """The pages bar's callback for the document ``name`` (``progress(done, total)``)."""
        bar = self.pages
        if bar is None:
            return None
        bar.reset(total=0)
        bar.set_description(name[:40], refresh=False)

        def progress(done: int, total: int) -> None:
            bar.total, bar.n = total, done
            bar.refresh()

        return progress

    def done(self, o: DocumentOutcome) -> None:
        self.counts["pages"] += len(o.pages or [])
        self.counts["skipped"] += o.skipped
        self.counts["failed"] += not o.ok
        if self.docs is not None:
            self.docs.update(1)
            self.docs.set_postfix(self.counts)

    def close(self) -> None:
        for bar in (self.pages, self.docs):
            if bar is not None:
                bar.close()


def _finish(fut, path: str, stem: str, info: dict[str, Any], options: dict[str, Any], ws: Workspace, out: str):
    """A document's outcome once run: its files written, then its manifest entry (a document
    that failed gets one too, saying so). One document's failure (a file that cannot be read,
    an output that cannot be written) is that document's, listed; the others go on."""
    try:
        o = fut.result()
        if o.ok:
            digests = write_outputs(out, stem, o.pages)
            ws.record(stem, info, options, pages=o.pages, outputs=digests)
        else:
            ws.record(stem, info, options, error=o.error)
    except OSError as exc:
        o = DocumentOutcome(path, error=f"{path}: {exc.strerror or exc}")
    return o


def ocr_main(a, out: TextIO, err: TextIO, *, sleep: Callable[[float], None] = time.sleep) -> int:
    """``sleep``: how to pause between resends (a test passes one that records the pauses)."""
    code = _check_args(a, err)
    if code:
        return code
    files, problem = _inputs(a)
    if problem:
        print(f"dash-trt ocr: error: {problem}", file=err)
        return 2
    if os.path.exists(a.out) and not os.path.isdir(a.out):
        print(f"dash-trt ocr: error: --out {a.out} is a file, not a folder", file=err)
        return 2
    os.makedirs(a.out, exist_ok=True)
    stems, options = _stems(files), output_options(a)
    ws = Workspace.load(a.out)
    if ws.note:
        print(f"dash-trt ocr: note: {ws.note}", file=err)
    outcomes: dict[int, DocumentOutcome] = {}
    infos: dict[int, dict[str, Any]] = {}
    for i, f in enumerate(files):
        try:
            infos[i] = input_info(f)
        except OSError as exc:
            outcomes[i] = DocumentOutcome(f, error=f"{f}: {exc.strerror or exc}")
            continue
        entry = None if a.no_resume else ws.reusable(stems[i], infos[i], options)
        skipped = _skipped(f, entry, a.out, stems[i]) if entry is not None else None
        if skipped is not None:
            outcomes[i] = skipped
    todo = [i for i in range(len(files)) if i not in outcomes]
    bars: list[_Bars] = []  # made once the model or server is there (nothing shown before an error)
    try:
        run, close = _backend(a, sleep, lambda name: bars[0].document(name)) if todo else (None, lambda: None)
    except Exception as exc:  # noqa: BLE001 - a server that cannot be reached, a checkpoint that cannot load
        print(f"dash-trt ocr: error: {exc}", file=err)
        return 2
    bars.append(_Bars(len(files), err, a.no_progress, pages=bool(a.checkpoint)))
    for o in outcomes.values():
        bars[0].done(o)
    try:
        _run(a, run, todo, files, stems, infos, options, ws, outcomes, bars[0])
    finally:
        bars[0].close()
        close()
    done = [outcomes[i] for i in sorted(outcomes)]
    report(done, [stems[i] for i in sorted(outcomes)], a, out)
    if any(not o.ok for o in done):
        return 1
    return EXIT_TRUNCATED if any(o.truncated or o.refused or o.failed_pages for o in done) else 0


def _backend(a, sleep: Callable[[float], None], pages_bar: Callable[[str], Any]):
    """``run(path) -> DocumentOutcome`` and ``close()``: through the server or the model here."""
    rules, opts = _options(a)
    if a.server:
        return _remote(a, rules, opts["crop"], sleep)
    return _local(a, rules, opts["crop"], pages_bar)


def _run(a, run, todo, files, stems, infos, options, ws, outcomes, bars) -> None:
    """The documents ``todo`` (indices into ``files``) run and written, each outcome put in
    ``outcomes`` as it comes. A run stopped midway (an interrupt) leaves the manifest naming the
    documents written so far; the documents not started are cancelled."""
    if not todo:
        return
    pool = ThreadPoolExecutor(max_workers=a.concurrency)
    try:
        futures = {pool.submit(run, files[i]): i for i in todo}
        for fut in as_completed(futures):
            i = futures[fut]
            outcomes[i] = _finish(fut, files[i], stems[i], infos[i], options, ws, a.out)
            bars.done(outcomes[i])
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _pages_text(pages: list[int]) -> str:
    """``3``, ``2, 5`` or ``2-17`` (runs of consecutive pages joined)."""
    runs: list[list[int]] = []
    for p in pages:
        if runs and p == runs[-1][-1] + 1:
            runs[-1].append(p)
        else:
            runs.append([p])
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def report(outcomes: list[DocumentOutcome], stems: list[str], a, out: TextIO) -> None:
    """What ``--format`` says: a summary (failed documents and pages cut at their budget named),
    one JSON line a document, or one JSON record a page."""
    fmt = "json" if a.json else a.format
    if fmt == "json":
        for o, stem in zip(outcomes, stems):
            line = {"file": o.path, "ok": o.ok, "pages": len(o.pages or []), "error": o.error}
            line.update(length_pages=o.truncated, refused_pages=[p["page"] for p in o.refused])
            line.update(error_pages=[p["page"] for p in o.failed_pages], skipped=o.skipped)
            line.update(output=os.path.join(a.out, stem + ".md") if o.ok else None)
            out.write(json.dumps(line) + "\n")
        return
    if fmt == "jsonl":
        for o, stem in zip(outcomes, stems):
            if not o.ok:
                out.write(json.dumps({"file": o.path, "page": None, "error": o.error}) + "\n")
                continue
            for p in o.pages:
                record = {"file": o.path, "page": p["page"], "source": p["source"]}
                record["output"] = page_file(a.out, stem, p["page"])
                record["markdown"] = p["text"]
                for key in ("finish_reason", "tokens", "seconds"):
                    record[key] = p.get(key)
                if p.get("error"):
                    record["error"] = p["error"]
                out.write(json.dumps(record, ensure_ascii=False) + "\n")
        return
    failed = [o for o in outcomes if not o.ok]
    pages = sum(len(o.pages) for o in outcomes if o.ok)
    cut = sum(len(o.truncated) for o in outcomes if o.ok)
    refused = sum(len(o.refused) for o in outcomes if o.ok)
    lost = sum(len(o.failed_pages) for o in outcomes if o.ok)
    notes = [f"{cut} cut at their token budget"] * bool(cut) + [f"{refused} refused"] * bool(refused)
    notes += [f"{lost} could not be rendered"] * bool(lost)
    cut_text = f" ({', '.join(notes)})" if notes else ""
    skipped = sum(o.skipped for o in outcomes)
    again = f"; {skipped} written by an earlier run, not done again (--no-resume: do them)" if skipped else ""
    print(
        f"{len(outcomes) - len(failed)} of {len(outcomes)} documents, {pages} pages{cut_text}, written to {a.out}"
        + again,
        file=out,
    )
    for o in outcomes:
        if o.ok and o.truncated:
            print(
                f"TRUNCATED {o.path}: page(s) {_pages_text(o.truncated)} ran out of tokens (finish reason length; "
                f"raise --max-page-tokens or --max-new-tokens)",
                file=out,
            )
        for p in o.refused if o.ok else []:
            print(f"REFUSED {o.path} page {p['page']}: {p.get('error')}", file=out)
        for p in o.failed_pages if o.ok else []:
            print(f"PAGE FAILED {o.path} page {p['page']}: {p.get('error')}", file=out)
    for o in failed:
        print(f"FAILED {o.path}: {o.error}", file=out)
