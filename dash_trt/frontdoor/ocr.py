"""``POST /v1/ocr``: uploaded PDFs and images (``multipart/form-data``, field ``file``, one or
more) as one document, with the optional fields ``prompt``, ``crop`` (auto, on, off),
``max_page_tokens`` (each page's token budget; default
:data:`~dash_trt.documents.budget.DEFAULT_MAX_PAGE_TOKENS`), ``max_tokens`` (the document's;
default derived from the page budget) and ``model``: one section per page (JSON), each with its
``finish_reason`` (``stop``, ``length``: it ran out of its budget, ``guard``), ``tokens`` and
``seconds``, and the document's ``finish_reason`` (``length`` when a page did)."""

from __future__ import annotations

import time
import uuid

from fastapi import Request

from .. import triton_protocol as P
from .endpoint import Endpoint, usage
from .models import APIError

__all__ = ["OCR"]

ROUTE = "/v1/ocr"
#: The form fields ``/v1/ocr`` takes.
FIELDS = frozenset({"file", "prompt", "crop", "max_tokens", "max_page_tokens", "model"})
_CROP = {"auto": None, "on": True, "off": False}


class OCR(Endpoint):
    """The handler of ``POST /v1/ocr``."""

    async def handle(self, request: Request):
        t0 = time.perf_counter()
        ctype = request.headers.get("content-type", "")
        if not ctype.startswith("multipart/form-data"):
            raise APIError("POST the files as multipart/form-data (field 'file', one or more)", status=415)
        if not self.backend.has_documents:
            raise APIError(f"this Triton does not serve {self.settings.model}{P.DOCUMENT_SUFFIX}", status=404)
        form = await request.form(max_files=P.MAX_DOCUMENT_FILES, max_fields=32)
        files = await _files(form)
        unknown = sorted(set(form) - FIELDS)
        if unknown:
            raise APIError(f"unknown field(s): {', '.join(unknown)}", param=unknown[0], code="unknown_parameter")
        self.check_model(form.get("model") or None)
        crop_text = form.get("crop", "auto")
        if crop_text not in ("auto", "on", "off"):
            raise APIError("crop must be auto, on or off", param="crop")
        limit, per_page = _count(form, "max_tokens"), _count(form, "max_page_tokens")
        rules = None if per_page is None else {"max_page_tokens": per_page}
        if isinstance(form.get("prompt"), str):
            self.check_text(form.get("prompt"), "prompt")
        result = await self.infer(
            request, self.backend.document(files, form.get("prompt") or None, limit, _CROP[crop_text], rules)
        )
        pages = result["pages"]
        self.metrics.pages.inc(len(pages))
        self.metrics.seconds.labels(ROUTE).observe(time.perf_counter() - t0)
        return {
            "id": f"ocr-{uuid.uuid4().hex}",
            "object": "ocr.result",
            "model": self.settings.model,
            "pages": pages,
            "finish_reason": result.get("finish_reason", "stop"),
            "usage": usage(
                result["prompt_tokens"],
                result["generated_tokens"],
                images=result.get("image_tokens"),
                pages=len(pages),
            ),
        }


def _count(form, name: str) -> int | None:
    """A token-count field: None when absent, else an integer in 1..2**20."""
    value = form.get(name)
    if value is None:
        return None
    if not str(value).isdigit() or not 1 <= int(value) <= 1 << 20:
        raise APIError(f"{name} must be an integer in 1..1048576", param=name)
    return int(value)


async def _files(form) -> list[tuple[str, bytes]]:
    """The uploads of the ``file`` field as ``(name, bytes)``."""
    uploads = form.getlist("file")
    if not uploads:
        raise APIError("no file: send the document as the form field 'file'", param="file")
    files = []
    for up in uploads:
        if isinstance(up, str):
            raise APIError("the 'file' field must be a file upload", param="file")
        files.append((up.filename or "document", await up.read()))
    return files
