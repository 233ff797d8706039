#!/usr/bin/env python3
"""Peak resident memory of ``dash-trt ocr --checkpoint`` on generated PDFs of N pages.

    python3 bench/bench_pdf_rss.py --pages 10 200 2000 [--folder TINY] [--crop on|off]

Each N runs in a fresh process (``ru_maxrss`` is a process's peak): it writes an N-page PDF
(pypdfium2, blank US-letter pages with a line of text each), then runs ``ocr_main`` (the command's
offline path: :class:`~dash_trt.serving.documents.DocumentOCR` on the tiny random-weight
checkpoint of ``scripts/make_tiny_unlimited_ocr2.py``, the pages rendered, cut into views and
through the vision tower, the per-page records and files written) with **generation stubbed**:
``generate`` returns ``<PAGE> x x`` a page at once. A 2,000-page prompt is over the tiny model's
8,192 positions (and any real model's context) until page windows exist, and the CPU decoder
would take hours; what is measured is everything up to the decoder and after it.

Prints one JSON line an N: pages, seconds, RSS after the model loaded and peak RSS (MiB), the
peak RSS of the PDF rendering worker (a process of its own, :mod:`dash_trt.documents.render`;
the largest, read before each is stopped), and the prompt's image features (the model's input
for the whole document, which grows with the pages).
``--root`` imports dash_trt from another checkout (to measure a baseline)."""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import subprocess
import sys
import tempfile
import time


def make_pdf(path: str, pages: int) -> None:
    import pypdfium2 as pdfium
    import pypdfium2.raw as raw

    pdf = pdfium.PdfDocument.new()
    font = raw.FPDFText_LoadStandardFont(pdf, b"Helvetica")
    for i in range(pages):
        page = pdf.new_page(612, 792)
        text = raw.FPDFPageObj_NewTextObj(pdf, b"Helvetica", 24.0)
        words = f"Page {i + 1} of {pages}"
        buf = (words + "\0").encode("utf-16-le")
        raw.FPDFText_SetText(text, (raw.FPDF_WCHAR * (len(buf) // 2)).from_buffer_copy(buf))
        raw.FPDFPageObj_Transform(text, 1, 0, 0, 1, 72, 700)
        raw.FPDFPage_InsertObject(page, text)
        raw.FPDFPage_GenerateContent(page)
        page.close()
    del font
    buf = io.BytesIO()
    pdf.save(buf)
    pdf.close()
    with open(path, "wb") as fh:
        fh.write(buf.getvalue())


def rss_mib() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def vm_hwm_mib(pid: int) -> float:
    """A live process's peak RSS (``VmHWM``; ``ru_maxrss`` of a child would count the parent's pages
    it had between fork and exec)."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def one(pages: int, folder: str, crop: str, root: str | None) -> dict:
    if root:
        sys.meta_path[:] = [f for f in sys.meta_path if "skbc" not in type(f).__module__]
        sys.path.insert(0, root)
    import torch

    import dash_trt
    import dash_trt.serving.documents as S
    from dash_trt.commands.ocr import add_parser, ocr_main

    torch.set_num_threads(2)
    seen = {}

    def generate(model, prompts, max_new_tokens, image_features=None, rules=None, keep_logits=False):
        cfg = model.config
        seen["features"] = tuple(image_features[0].shape)
        seen["prompt"] = len(prompts[0])
        n = prompts[0].count(cfg.page_token_id)
        tokens = [t for _ in range(n) for t in (cfg.page_token_id, 100, 101)] + [cfg.eos_token_id]
        return type("Out", (), {"tokens": [tokens]})()

    S.generate = generate
    workers = []  # each rendering worker's peak RSS (VmHWM), read before it is stopped
    try:
        import dash_trt.documents.render as R

        close = R.Renderer.close

        def watched_close(self):
            if self.proc is not None and self.proc.poll() is None:
                workers.append(vm_hwm_mib(self.proc.pid))
            close(self)

        R.Renderer.close = watched_close
    except ImportError:  # a checkout from before the rendering worker
        pass
    with tempfile.TemporaryDirectory() as tmp:
        pdf = os.path.join(tmp, f"doc{pages}.pdf")
        make_pdf(pdf, pages)
        size = os.path.getsize(pdf)
        parser = argparse.ArgumentParser()
        add_parser(parser.add_subparsers(dest="cmd"))
        argv = ["ocr", pdf, "--checkpoint", folder, "--out", os.path.join(tmp, "out"), "--no-progress"]
        a = parser.parse_args(argv + ["--crop", crop, "--format", "json"])
        # the model loads in ocr_main; its RSS is read by a first, one-page run
        warm = os.path.join(tmp, "warm.pdf")
        make_pdf(warm, 1)
        w = parser.parse_args(["ocr", warm, "--checkpoint", folder, "--out", os.path.join(tmp, "w"), "--no-progress"])
        ocr_main(w, io.StringIO(), io.StringIO())
        loaded = rss_mib()
        out, err = io.StringIO(), io.StringIO()
        t0 = time.perf_counter()
        rc = ocr_main(a, out, err)
        seconds = time.perf_counter() - t0
        written = len(os.listdir(os.path.join(tmp, "out", f"doc{pages}"))) if rc in (0, 3) else 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    feats = seen.get("features", (0, 0))
    return {
        "pages": pages,
        "pdf_bytes": size,
        "crop": crop,
        "rc": rc,
        "error": err.getvalue().strip()[-300:] or None if rc not in (0, 3) else None,
        "report": out.getvalue().strip()[-300:],
        "page_files": written,
        "seconds": round(seconds, 1),
        "rss_after_load_mib": round(loaded, 1),
        "peak_rss_mib": round(peak, 1),
        "worker_peak_rss_mib": round(max(workers, default=0.0), 1),
        "prompt_tokens": seen.get("prompt"),
        "feature_mib": round(feats[0] * feats[1] * 4 / 2**20, 1),
        "dash_trt": os.path.dirname(dash_trt.__file__),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pages", type=int, nargs="+", default=[10, 200, 2000])
    p.add_argument("--folder", help="a tiny checkpoint folder (default: one written to a temporary folder)")
    p.add_argument("--crop", choices=("on", "off", "auto"), default="auto")
    p.add_argument("--root", help="import dash_trt from this checkout")
    p.add_argument("--one", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one is not None:
        print(json.dumps(one(a.one, a.folder, a.crop, a.root)))
        return 0
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as tmp:
        folder = a.folder
        if folder is None:
            folder = os.path.join(tmp, "tiny")
            script = os.path.join(here, "scripts", "make_tiny_unlimited_ocr2.py")
            subprocess.run([sys.executable, script, folder], check=True, capture_output=True)
        for n in a.pages:
            cmd = [sys.executable, os.path.abspath(__file__), "--one", str(n), "--folder", folder, "--crop", a.crop]
            res = subprocess.run(cmd + (["--root", a.root] if a.root else []), capture_output=True, text=True)
            line = res.stdout.strip().splitlines()[-1] if res.stdout.strip() else ""
            print(line or json.dumps({"pages": n, "failed": res.returncode, "stderr": res.stderr[-800:]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
