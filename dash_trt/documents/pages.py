"""Page images from what users send: image files (PNG, JPEG, TIFF, WebP, BMP, GIF: each frame of
a multi-frame TIFF or GIF is a page) and PDFs, rendered with pypdfium2 (Apache-2.0/BSD; not
PyMuPDF, which is AGPL).

Every page comes out as an RGB ``PIL.Image``: EXIF orientation applied, transparency flattened
onto white, palette and grey images converted. A PDF page is rendered straight to the size the
model will look at (its longer side ``render_side`` pixels), never at a fixed DPI that a poster
would turn into a gigapixel bitmap. Errors name the file and page: :class:`DocumentError`.

:func:`open_pages` reads what a request holds without rendering or decoding a page: how many
pages, and each page's size in pixels (a PDF page's from its size in points, an image's from its
header). Every budget (pages, pixels a page, pixels a request) is checked there, and a caller
checks its own (image tokens a page and a prompt) from the sizes, before any page is rendered;
:meth:`PageSource.render` then renders one page at a time. :func:`load_pages` does both. With
``refuse_pages`` a page over its pixel budget is refused alone (:attr:`PageSource.refused` holds
the message) and the others go on.

PDFs are read and rendered by a :class:`~dash_trt.documents.render.Renderer` (one a request): in
a worker process (kept warm between requests by a
:class:`~dash_trt.documents.render.RenderWorkers`) held to a CPU-time and memory budget
(:class:`RenderLimits`) and killed when a page goes over it or the request is cancelled; pdfium
never parses an uploaded file in this process. Image files too: the worker reads their headers
and decodes their frames (:mod:`dash_trt.documents.images`, the one definition of the formats
allowed, the frame and pixel limits and the RGB conversion), and only the decoded page's RGB rows
come back; with ``RenderLimits(isolate=False)`` both happen in this process. Between pages
(images too) the renderer checks the request's cancellation and deadline.

A PDF is parsed once: its pages' renderers share one open PDFium document (PDFium re-reads the
cross-reference table on every open, which on a 2,000-page file costs ~11 ms a page against
0.3 ms for a page of a document kept open): the worker keeps it open between the pages of a
request (:meth:`~dash_trt.documents.render.Renderer.open_pdf`; the request's end closes what is
still open there before the worker serves another), and so does this process when it
renders itself (``RenderLimits(isolate=False)``). It is closed after its last page is rendered or
by :func:`close_pages`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from .images import IMAGE_FORMATS, ImageInfo, _rgb, _too_large, decode_frame, probe_image
from .limits import (
    MAX_PAGES,
    MAX_PIXELS,
    MAX_REQUEST_PIXELS,
    PIL_MAX_IMAGE_PIXELS,
    DocumentError,
    PageError,
    _declares_no_pages,
)
from .render import RenderCancelled, Renderer, RenderLimits

__all__ = [
    "DocumentError",
    "PageError",
    "Page",
    "PageSource",
    "open_pages",
    "load_pages",
    "close_pages",
    "render_pdf",
    "open_image",
    "MAX_PAGES",
    "MAX_PIXELS",
    "MAX_REQUEST_PIXELS",
    "IMAGE_FORMATS",
    "PIL_MAX_IMAGE_PIXELS",
    "Renderer",
    "RenderLimits",
    "RenderCancelled",
]

_PDF_MAGIC = b"%PDF-"


@dataclass
class Page:
    """One page: its RGB image and where it came from (``file.pdf page 3``). A prepared
    document's pages keep their size, not their bitmaps (``image`` None; the views are kept)."""

    image: object  # PIL.Image.Image, or None once let go
    source: str
    size: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.size is None and self.image is not None:
            self.size = self.image.size


@dataclass
class PageSource:
    """One page before it is rendered: where it comes from, its size in pixels as it will be
    rendered (``width``, ``height``), and how to render it (:meth:`render`, a :class:`Page`)."""

    source: str
    width: int
    height: int
    _render: Callable[[], object]
    #: why this page is refused (over a budget; ``refuse_pages``), None for a page to render
    refused: str | None = None
    _close: Callable[[], None] | None = None

    @property
    def size(self) -> tuple[int, int]:
        return self.width, self.height

    def render(self) -> Page:
        if self.refused is not None:
            raise DocumentError(self.refused)
        return Page(self._render(), self.source)

    def close(self) -> None:
        """Lets go of what rendering holds open (a PDF's parsed document, here or in the
        rendering worker); a later :meth:`render` opens it again."""
        if self._close is not None:
            self._close()


def close_pages(pages: Iterable[PageSource]) -> None:
    """:meth:`PageSource.close` of each page (a PDF's pages share one document: closed once)."""
    for p in pages:
        p.close()


def _image_sources(
    data: bytes, source: str, renderer: Renderer | None = None, refuse: bool = False
) -> list[PageSource]:
    """The pages of an image file's bytes (one per frame), their sizes read from the headers
    (:func:`~dash_trt.documents.images.probe_image`), in ``renderer``'s worker process (in this
    process without one, or when it renders in-process), which also decodes each page when it is
    rendered. ``refuse``: a page over :data:`MAX_PIXELS` comes back refused
    (:attr:`PageSource.refused`) instead of raising."""
    isolated = renderer is not None and renderer.limits.isolate
    if isolated:
        info = renderer.open_image(data, source, refuse, MAX_PIXELS)
    else:
        info = probe_image(data, source, refuse, MAX_PIXELS)
    try:
        return _frames(data, source, info, renderer, refuse, isolated)
    except BaseException:
        if isolated:
            renderer.close_pdf(data)
        raise


def _frames(
    data: bytes, source: str, info: ImageInfo, renderer: Renderer | None, refuse: bool, isolated: bool
) -> list[PageSource]:
    """:func:`_image_sources`' pages of what :func:`probe_image` read."""
    if not info.sizes:  # the first frame is over MAX_PIXELS
        if refuse:
            refused = str(_too_large(source, info.size, limit=MAX_PIXELS))
            return [PageSource(source, *info.size, _refused_render, refused)]
        raise _too_large(source, info.size, limit=MAX_PIXELS)
    frames = info.frames

    def frame(i: int, name: str):
        def render():
            if renderer is not None:
                renderer.check(name)
            if isolated:
                try:
                    image = renderer.decode_image_frame(data, i, name)
                finally:
                    if i == frames - 1:  # the worker lets go of the file after its last page
                        renderer.close_pdf(data)
                return image
            try:
                return decode_frame(data, i, name)
            except MemoryError:
                raise PageError(f"{name}: cannot be decoded (MemoryError)") from None

        return render

    close = (lambda: renderer.close_pdf(data)) if isolated else None
    out = []
    for i, (fw, fh) in enumerate(info.sizes):
        name = source if frames == 1 else f"{source} page {i + 1}"
        refused = str(_too_large(name, (fw, fh), limit=MAX_PIXELS)) if fw * fh > MAX_PIXELS else None
        size = (fh, fw) if info.swap else (fw, fh)
        out.append(PageSource(name, *size, frame(i, name), refused, _close=close))
    return out


def _refused_render():  # never called: a refused page's render() raises its message
    raise AssertionError("a refused page is not rendered")


def open_image(data: bytes, source: str) -> list[Page]:
    """The pages of an image file's bytes (one per frame)."""
    return [p.render() for p in _image_sources(data, source)]


def _pdf_sources(data: bytes, source: str, render_side: int, renderer: Renderer | None = None) -> list[PageSource]:
    """The pages of a PDF, each to be rendered with its longer side ``render_side`` pixels: their
    count and sizes read from the document (no page rendered), by ``renderer``'s worker process
    (in this process when it renders in-process). The document stays open, in the worker or here
    (:class:`_OpenPdf`), for the pages' renderers until the last page is rendered or the pages
    are closed (:func:`close_pages`)."""
    if renderer is None or not renderer.limits.isolate:
        return _pdf_sources_here(data, source, render_side, renderer)
    n, sizes = renderer.open_pdf(data, source)

    def close() -> None:
        renderer.close_pdf(data)

    try:
        _check_count(n, source)
        out = []
        for i, (w, h) in enumerate(sizes):
            name = f"{source} page {i + 1}"
            make = lambda scale, i=i, name=name: _isolated(renderer, data, i, n, scale, name)  # noqa: E731
            out.append(_sized(name, w, h, render_side, make, close))
        return out
    except BaseException:
        close()
        raise


def _sized(
    name: str,
    w: float,
    h: float,
    render_side: int,
    make: Callable[[float], Callable[[], object]],
    close: Callable[[], None] | None = None,
) -> PageSource:
    """A PDF page of ``w`` x ``h`` points rendered with its longer side ``render_side`` pixels
    (``make(scale)``: its render function; ``close``: lets go of its open document)."""
    if not (w > 0 and h > 0):
        raise DocumentError(f"{name}: the page has no area ({w:g} x {h:g} points)")
    scale = render_side / max(w, h)
    # pypdfium2 renders ceil(points x scale) pixels a side
    return PageSource(name, math.ceil(w * scale), math.ceil(h * scale), make(scale), _close=close)


def _check_count(n: int, source: str) -> None:
    if n == 0:
        raise DocumentError(f"{source}: the PDF has 0 pages")
    if n > MAX_PAGES:
        raise DocumentError(f"{source}: {n} pages, more than {MAX_PAGES}")


def _isolated(renderer: Renderer, data: bytes, index: int, count: int, scale: float, name: str):
    def render():
        try:
            image = renderer.render_pdf_page(data, index, scale, name)
        finally:
            if index == count - 1:  # the worker lets go of the document after its last page
                renderer.close_pdf(data)
        return _rgb(image, name)

    return render


def _pdf_sources_here(data: bytes, source: str, render_side: int, renderer: Renderer | None) -> list[PageSource]:
    """:func:`_pdf_sources` in this process (``RenderLimits(isolate=False)``)."""
    pdf = _OpenPdf(data, source, renderer)
    try:
        doc = pdf.document()
        n = len(doc)
        _check_count(n, source)
        out = []
        for i in range(n):
            name = f"{source} page {i + 1}"
            try:
                page = doc[i]
                w, h = page.get_size()  # points, rotation applied
                page.close()
            except Exception as exc:  # noqa: BLE001 - a damaged page
                raise DocumentError(f"{name}: cannot be read ({type(exc).__name__}: {exc})") from None
            make = lambda scale, i=i, name=name: pdf.renderer(i, n, scale, name)  # noqa: E731
            out.append(_sized(name, w, h, render_side, make, pdf.close))
        return out
    except BaseException:
        pdf.close()
        raise


class _OpenPdf:
    """One PDF's bytes and, once opened, its PDFium document in this process, shared by its pages'
    renderers: opened on first use, closed after the last page is rendered (or by :meth:`close`),
    opened again if a page is rendered after that."""

    def __init__(self, data: bytes, source: str, renderer: Renderer | None = None):
        self.data, self.source, self.checker = data, source, renderer
        self._doc = None

    def document(self):
        if self._doc is None:
            self._doc = _open_pdf(_pdfium(), self.data, self.source)
        return self._doc

    def close(self) -> None:
        if self._doc is not None:
            doc, self._doc = self._doc, None
            doc.close()

    def renderer(self, index: int, count: int, scale: float, name: str):
        def render():
            if self.checker is not None:
                self.checker.check(name)
            try:
                page = self.document()[index]
                try:
                    bitmap = page.render(scale=scale)
                finally:
                    page.close()
            except DocumentError:
                raise
            except Exception as exc:  # noqa: BLE001 - a damaged page
                raise PageError(f"{name}: cannot be rendered ({type(exc).__name__}: {exc})") from None
            finally:
                if index == count - 1:
                    self.close()
            try:  # the PIL image may share the bitmap's buffer: converted (copied) before it is freed
                return _rgb(bitmap.to_pil(), name)
            finally:
                bitmap.close()

        return render


def _pdfium():
    try:
        import pypdfium2 as pdfium
    except ImportError:
        raise DocumentError("reading PDFs needs pypdfium2 (pip install 'dash-trt[documents]')") from None
    return pdfium


def _open_pdf(pdfium, data: bytes, source: str):
    try:
        return pdfium.PdfDocument(data)
    except Exception as exc:  # noqa: BLE001 - PdfiumError for damaged, encrypted or non-PDF data
        if _declares_no_pages(data):  # PDFium refuses to open a document without pages
            raise DocumentError(f"{source}: the PDF has 0 pages") from None
        raise DocumentError(f"{source}: not a readable PDF ({exc})") from None


def render_pdf(data: bytes, source: str, render_side: int, *, limits: RenderLimits | None = None) -> list[Page]:
    """Every page of a PDF rendered so that its longer side is ``render_side`` pixels, within
    ``limits`` (:class:`RenderLimits`, the defaults when None)."""
    with Renderer(limits) as renderer:
        return [p.render() for p in _pdf_sources(data, source, render_side, renderer)]


def open_pages(
    sources: Iterable[str | os.PathLike | bytes | tuple[str, bytes]],
    *,
    render_side: int = 1024,
    renderer: Renderer | None = None,
    refuse_pages: bool = False,
) -> list[PageSource]:
    """The pages of ``sources`` in order, not rendered (module docstring): paths, raw bytes, or
    ``(name, bytes)`` pairs, each a PDF (recognised by its ``%PDF-`` header) or an image file. The
    request's budgets (:data:`MAX_PAGES` pages, :data:`MAX_PIXELS` a page,
    :data:`MAX_REQUEST_PIXELS` together) are checked here. ``renderer``: the request's
    (:class:`Renderer`; the caller closes it), else one with the default limits, closed when the
    pages are let go. Raises :class:`DocumentError` naming the file and page, and
    :class:`RenderCancelled` when ``renderer``'s request is cancelled; with ``refuse_pages`` a page
    over :data:`MAX_PIXELS` is refused alone (:attr:`PageSource.refused`) and does not count
    towards the request's pixels."""
    renderer = renderer if renderer is not None else Renderer()
    pages: list[PageSource] = []
    try:
        pixels = 0
        for i, src in enumerate(sources):
            name, data = _read_source(i, src)
            if data[:1024].lstrip()[:5] == _PDF_MAGIC:
                more = _pdf_sources(data, name, render_side, renderer)
            else:
                more = _image_sources(data, name, renderer, refuse_pages)
            pages += more
            if len(pages) > MAX_PAGES:
                raise DocumentError(f"the request holds more than {MAX_PAGES} pages")
            for p in more:
                if p.refused is None and p.width * p.height > MAX_PIXELS:
                    p.refused = (
                        f"{p.source}: rendered at {p.width}x{p.height} pixels, larger than {MAX_PIXELS:,} pixels"
                    )
                if p.refused is not None and not refuse_pages:
                    raise DocumentError(p.refused)
                pixels += p.width * p.height if p.refused is None else 0
            if pixels > MAX_REQUEST_PIXELS:
                raise DocumentError(
                    f"{name}: the request's pages together take more than {MAX_REQUEST_PIXELS:,} pixels; "
                    f"send fewer pages"
                )
        if not pages:
            raise DocumentError("no pages: send at least one image or PDF page")
    except BaseException:
        close_pages(pages)
        raise
    return pages


def _read_source(i: int, src) -> tuple[str, bytes]:
    """A source's name and bytes (a path is read)."""
    if isinstance(src, tuple):
        name, data = src
    elif isinstance(src, (bytes, bytearray, memoryview)):
        name, data = f"document {i + 1}", bytes(src)
    else:
        name = os.fspath(src)
        try:
            with open(name, "rb") as fh:
                data = fh.read()
        except OSError as exc:
            raise DocumentError(f"{name}: {exc.strerror or exc}") from None
    if not data:
        raise DocumentError(f"{name}: the file is empty")
    return name, data


def load_pages(
    sources: Iterable[str | os.PathLike | bytes | tuple[str, bytes]],
    *,
    render_side: int = 1024,
    limits: RenderLimits | None = None,
) -> list[Page]:
    """The pages of ``sources`` in order, rendered (:func:`open_pages`, then each page's
    :meth:`PageSource.render`) within ``limits`` (:class:`RenderLimits`, the defaults when
    None). PDF pages are rendered with their longer side ``render_side`` pixels. Raises
    :class:`DocumentError` naming the file and page."""
    with Renderer(limits) as renderer:
        return [p.render() for p in open_pages(sources, render_side=render_side, renderer=renderer)]


def page_names(pages: Sequence[Page]) -> list[str]:
    return [p.source for p in pages]
