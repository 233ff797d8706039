"""What both the page reader (:mod:`dash_trt.documents.pages`) and the rendering worker's driver
(:mod:`dash_trt.documents.render`) need, kept apart so that neither imports the other's module
for it: the error a document or page raises, the request's page and pixel limits, Pillow set up
with its decompression-bomb guard at :data:`MAX_PIXELS`, and the test for a PDF that declares no
page. :mod:`dash_trt.documents.pages` re-exports them (``from dash_trt.documents.pages import
DocumentError`` keeps working)."""

from __future__ import annotations

import re

__all__ = [
    "DocumentError",
    "PageError",
    "MAX_PAGES",
    "MAX_PIXELS",
    "MAX_REQUEST_PIXELS",
    "PIL_MAX_IMAGE_PIXELS",
]

#: A document larger than this is refused. Pages are rendered one at a time, so memory does not
#: bound it; the prompt does (one request holds every page's image tokens), and this keeps a
#: request's page list, prompt and per-page records to a size worth holding.
MAX_PAGES = 10_000
#: An image larger than this (width x height) is refused before it is decoded (a decompression
#: bomb: a small file that decodes to gigabytes). Pillow's own guard (``MAX_IMAGE_PIXELS``, about
#: 179 M pixels by default) is raised to this in :func:`_pil`, so that this limit is the one that
#: applies, with this module's message.
MAX_PIXELS = 200_000_000
#: The pages of one request together (width x height summed) may not be larger than this: a few
#: hundred KB of PDF or GIF can ask for many gigapixels, each page rendered or decoded in turn.
MAX_REQUEST_PIXELS = 20_000_000_000
#: Pillow's ``MAX_IMAGE_PIXELS`` as :func:`_pil` sets it (Pillow warns above it and refuses above
#: twice it): :data:`MAX_PIXELS`'s documented value.
PIL_MAX_IMAGE_PIXELS = MAX_PIXELS


class DocumentError(ValueError):
    """A document or page that cannot be read; the message names it."""


class PageError(DocumentError):
    """One page that could not be rendered or decoded (a damaged page, a rendering process that
    died or answered garbage), raised while the document's other pages may still be read: a caller
    may try the page again or leave it out (:attr:`DocumentOptions.page_retries
    <dash_trt.documents.processor.DocumentOptions.page_retries>`). A page over a rendering budget, a
    request past its deadline or cancelled is not one: those stop the request."""


def _pil():
    try:
        from PIL import Image, ImageOps
    except ImportError:  # a declared dependency of the documents extra
        raise DocumentError("reading images needs Pillow (pip install 'dash-trt[documents]')") from None
    # the one place Pillow's decompression-bomb guard is set: never below this module's limit (a
    # caller that lifted it, or switched it off with None, is left alone)
    if Image.MAX_IMAGE_PIXELS is not None and Image.MAX_IMAGE_PIXELS < PIL_MAX_IMAGE_PIXELS:
        Image.MAX_IMAGE_PIXELS = PIL_MAX_IMAGE_PIXELS
    return Image, ImageOps


def _declares_no_pages(data: bytes) -> bool:
    """The file's page tree says it has no page (``/Type /Pages ... /Count 0``) and it holds no
    page object (read in the uncompressed objects only)."""
    return bool(re.search(rb"/Count\s*0(?![0-9])", data)) and not re.search(rb"/Type\s*/Page(?![a-zA-Z])", data)
