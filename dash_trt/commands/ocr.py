"""``dash-trt ocr``: PDFs and images in, markdown out, one section per page.

    dash-trt ocr report.pdf scans/*.png --server 127.0.0.1:8001 --out out/
    dash-trt ocr report.pdf --checkpoint MODEL_FOLDER --out out/      # offline, in this process

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
counts documents.

Every page has its own token budget, the same on both paths and on the server's other doors:
``--max-page-tokens`` (default 20000, :data:`~dash_trt.documents.budget.DEFAULT_MAX_PAGE_TOKENS`),
and the document as a whole ``(pages + 1) x (max-page-tokens + 1)`` unless ``--max-new-tokens``
says, held to what the model admits. A page that ran out of its budget (finish reason
``length``) is written but counted and named in the summary, and the exit status is 3; so is a
page refused alone (finish reason ``refused``: over the pixel or image-token budget; its record's
``error`` says why) while the document's other pages are transcribed.
``--format jsonl`` prints one JSON record a page: the input file, page number, output file,
markdown, finish reason (``stop``, ``length``, ``guard``), tokens and seconds.

Exit codes: 0 every document transcribed, every page complete; 1 some failed (each listed);
2 bad arguments; 3 every document written, but some page ran out of its token budget or was
refused (each named).
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
    "arguments; 3 every document written, but some page ran out of its token budget or was refused (each "
    "named)."
)


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


def add_parser(sub) -> argparse.ArgumentParser:
    o = sub.add_parser(
        "ocr",
        help="PDFs and images to markdown, one section per page (through a server or in this process)",
        description=__doc__.split("\n\n")[0],
        epilog=EXIT_CODES,
    )
    o.add_argument("files", nargs="+", help="PDF or image files; each is one document")
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
    o.add_argument("--out", "-o", required=True, help="folder for the markdown (created)")
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
    taken = set()
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


def _write_text(path: str, text: str) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)

    atomic_write(path, write)


def page_file(out: str, stem: str, page: int) -> str:
    return os.path.join(out, stem, f"page-{page:04d}.md")


def write_outputs(out: str, stem: str, pages: list[dict[str, Any]]) -> None:
    """``OUT/STEM.md`` and ``OUT/STEM/page-NNNN.md``. A symbolic link at ``OUT/STEM`` is refused
    (the pages would be written wherever it points)."""
    folder = os.path.join(out, stem)
    if os.path.islink(folder):
        raise OSError(f"{folder} is a symbolic link: not written through")
    os.makedirs(folder, exist_ok=True)
    for p in pages:
        _write_text(page_file(out, stem, p["page"]), p["text"].rstrip() + "\n")
    body = "\n\n".join(f"<!-- page {p['page']}: {_page_note(p)} -->\n\n{p['text'].strip()}" for p in pages)
    _write_text(os.path.join(out, stem + ".md"), body + "\n")


def _page_note(p: dict[str, Any]) -> str:
    """A page's comment in ``OUT/STEM.md``: its source, and why it was refused if it was."""
    if p.get("finish_reason") == "refused":
        return f"{p['source']} (refused: {str(p.get('error') or '').replace('--', '- -')})"
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


def _local(a, rules: dict[str, Any], crop: bool | None):
    import threading

    from ..documents.pages import DocumentError
    from ..documents.processor import DocumentOptions
    from ..models.config import DTYPES
    from ..serving.documents import DocumentOCR

    ocr = DocumentOCR(a.checkpoint, dtype=DTYPES[a.dtype] if a.dtype else None, device=a.device)
    lock = threading.Lock()  # one model in this process: documents in turn

    def run(path: str) -> DocumentOutcome:
        outcome = DocumentOutcome(path, attempts=1)
        options = DocumentOptions(crop=crop, instruction=a.prompt, max_page_tokens=a.max_page_image_tokens)
        try:
            with open(path, "rb") as fh:
                source = (os.path.basename(path), fh.read())  # named as the server names it
            with lock:
                result = ocr.transcribe([source], options, max_new_tokens=a.max_new_tokens, rules=rules)
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


def ocr_main(a, out: TextIO, err: TextIO, *, sleep: Callable[[float], None] = time.sleep) -> int:
    """``sleep``: how to pause between resends (a test passes one that records the pauses)."""
    if (a.concurrency is not None and a.concurrency < 1) or a.retries < 0:
        print("dash-trt ocr: error: --concurrency must be >= 1 and --retries >= 0", file=err)
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
    if a.server and (a.device or a.dtype):
        print("dash-trt ocr: error: --device and --dtype are for --checkpoint (a server runs its own)", file=err)
        return 2
    missing = [f for f in a.files if not os.path.isfile(f)]
    if missing:
        print(f"dash-trt ocr: error: no such file: {', '.join(missing)}", file=err)
        return 2
    if os.path.exists(a.out) and not os.path.isdir(a.out):
        print(f"dash-trt ocr: error: --out {a.out} is a file, not a folder", file=err)
        return 2
    os.makedirs(a.out, exist_ok=True)
    rules, opts = _options(a)
    try:
        run, close = _remote(a, rules, opts["crop"], sleep) if a.server else _local(a, rules, opts["crop"])
    except Exception as exc:  # noqa: BLE001 - a server that cannot be reached, a checkpoint that cannot load
        print(f"dash-trt ocr: error: {exc}", file=err)
        return 2
    stems = _stems(a.files)
    outcomes: list[tuple[int, DocumentOutcome]] = []
    try:
        from tqdm import tqdm
    except ImportError:  # a declared dependency of the documents extra
        tqdm = None
    bar = tqdm(total=len(a.files), unit="doc", file=err, disable=a.no_progress) if tqdm else None
    try:
        with ThreadPoolExecutor(max_workers=a.concurrency) as pool:
            futures = {pool.submit(run, f): i for i, f in enumerate(a.files)}
            for fut in as_completed(futures):
                i = futures[fut]
                try:  # one document's failure (a file that cannot be read, an output that
                    # cannot be written) is that document's, listed; the others go on
                    o = fut.result()
                    if o.ok:
                        write_outputs(a.out, stems[i], o.pages)
                except OSError as exc:
                    o = DocumentOutcome(a.files[i], error=f"{a.files[i]}: {exc.strerror or exc}")
                outcomes.append((i, o))
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(failed=sum(not x.ok for _, x in outcomes))
    finally:
        if bar is not None:
            bar.close()
        close()
    outcomes = [o for _, o in sorted(outcomes, key=lambda x: x[0])]
    report(outcomes, stems, a, out)
    failed = [o for o in outcomes if not o.ok]
    if failed:
        return 1
    return EXIT_TRUNCATED if any(o.truncated or o.refused for o in outcomes) else 0


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
    notes = [f"{cut} cut at their token budget"] * bool(cut) + [f"{refused} refused"] * bool(refused)
    cut_text = f" ({', '.join(notes)})" if notes else ""
    print(
        f"{len(outcomes) - len(failed)} of {len(outcomes)} documents, {pages} pages{cut_text}, written to {a.out}",
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
    for o in failed:
        print(f"FAILED {o.path}: {o.error}", file=out)
