"""Page images from what users send: image files (PNG, JPEG, TIFF, WebP, BMP, GIF: each frame of
a multi-frame TIFF or GIF is a page) and PDFs, rendered with pypdfium2 (Apache-2.0/BSD; not
PyMuPDF, which is AGPL).

Every page comes out as an RGB ``PIL.Image``: EXIF orientation applied, transparency flattened
onto white, palette and grey images converted. A PDF page is rendered straight to the size the
model will look at (its longer side ``render_side`` pixels), never at a fixed DPI that a poster
would turn into a gigapixel bitmap. Errors name the file and page: :class:`DocumentError`.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["DocumentError", "Page", "load_pages", "render_pdf", "open_image", "MAX_PAGES", "MAX_PIXELS"]

#: A document larger than this is refused (one request holds every page's image tokens).
MAX_PAGES = 1000
#: An image larger than this (width x height) is refused before it is decoded (a decompression
#: bomb: a small file that decodes to gigabytes).
MAX_PIXELS = 200_000_000

_PDF_MAGIC = b"%PDF-"


class DocumentError(ValueError):
    """A document or page that cannot be read; the message names it."""


@dataclass
class Page:
    """One page: its RGB image and where it came from (``file.pdf page 3``)."""

    image: object  # PIL.Image.Image
    source: str

    @property
    def size(self) -> tuple[int, int]:
        return self.image.size


def _pil():
    try:
        from PIL import Image, ImageOps
    except ImportError:  # a declared dependency of the documents extra
        raise DocumentError("reading images needs Pillow (pip install 'dash-trt[documents]')") from None
    return Image, ImageOps


def _rgb(image, source: str):
    """RGB, EXIF orientation applied, transparency on white."""
    Image, ImageOps = _pil()
    try:
        image = ImageOps.exif_transpose(image)
    except Exception as exc:  # noqa: BLE001 - a broken EXIF block: say which page
        raise DocumentError(f"{source}: unreadable EXIF orientation ({exc})") from None
    if image.mode in ("RGBA", "LA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        white = Image.new("RGB", rgba.size, (255, 255, 255))
        white.paste(rgba, mask=rgba.getchannel("A"))
        return white
    return image.convert("RGB")


def open_image(data: bytes, source: str) -> list[Page]:
    """The pages of an image file's bytes (one per frame)."""
    Image, _ = _pil()
    try:  # Pillow reads the header only here, and refuses a decompression bomb itself
        img = Image.open(io.BytesIO(data))
        img.verify()  # structure check; the file must be reopened afterwards
        img = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as exc:
        raise DocumentError(f"{source}: image too large ({exc})") from None
    except Exception as exc:  # noqa: BLE001 - Pillow raises UnidentifiedImageError, OSError, SyntaxError ...
        raise DocumentError(
            f"{source}: not a supported image ({type(exc).__name__}: {exc}); send PNG, JPEG, TIFF, WebP, BMP, "
            f"GIF or a PDF"
        ) from None
    w, h = img.size
    if w * h > MAX_PIXELS:
        raise DocumentError(f"{source}: image of {w}x{h} pixels is larger than {MAX_PIXELS:,} pixels")
    if w < 1 or h < 1:
        raise DocumentError(f"{source}: image of {w}x{h} pixels is empty")
    frames = getattr(img, "n_frames", 1)
    if frames > MAX_PAGES:
        raise DocumentError(f"{source}: {frames} frames, more than {MAX_PAGES} pages")
    pages = []
    for i in range(frames):
        name = source if frames == 1 else f"{source} page {i + 1}"
        try:
            img.seek(i)
            img.load()
        except Exception as exc:  # noqa: BLE001 - a truncated frame
            raise DocumentError(f"{name}: cannot be decoded ({type(exc).__name__}: {exc})") from None
        pages.append(Page(_rgb(img.copy(), name), name))
    return pages


def _declares_no_pages(data: bytes) -> bool:
    """The file's page tree says it has no page (``/Type /Pages ... /Count 0``) and it holds no
    page object (read in the uncompressed objects only)."""
    import re

    return bool(re.search(rb"/Count\s*0(?![0-9])", data)) and not re.search(rb"/Type\s*/Page(?![a-zA-Z])", data)


def render_pdf(data: bytes, source: str, render_side: int) -> list[Page]:
    """Every page of a PDF rendered so that its longer side is ``render_side`` pixels."""
    try:
        import pypdfium2 as pdfium
    except ImportError:
        raise DocumentError("reading PDFs needs pypdfium2 (pip install 'dash-trt[documents]')") from None
    try:
        pdf = pdfium.PdfDocument(data)
    except Exception as exc:  # noqa: BLE001 - PdfiumError for damaged, encrypted or non-PDF data
        if _declares_no_pages(data):  # PDFium refuses to open a document without pages
            raise DocumentError(f"{source}: the PDF has 0 pages") from None
        raise DocumentError(f"{source}: not a readable PDF ({exc})") from None
    try:
        n = len(pdf)
        if n == 0:
            raise DocumentError(f"{source}: the PDF has 0 pages")
        if n > MAX_PAGES:
            raise DocumentError(f"{source}: {n} pages, more than {MAX_PAGES}")
        pages = []
        for i in range(n):
            name = f"{source} page {i + 1}"
            try:
                page = pdf[i]
                w, h = page.get_size()  # points, rotation applied
                if w <= 0 or h <= 0:
                    raise DocumentError(f"{name}: the page has no area ({w:g} x {h:g} points)")
                scale = render_side / max(w, h)
                image = page.render(scale=scale).to_pil()
                page.close()
            except DocumentError:
                raise
            except Exception as exc:  # noqa: BLE001 - a damaged page
                raise DocumentError(f"{name}: cannot be rendered ({type(exc).__name__}: {exc})") from None
            pages.append(Page(_rgb(image, name), name))
        return pages
    finally:
        pdf.close()


def load_pages(
    sources: Iterable[str | os.PathLike | bytes | tuple[str, bytes]], *, render_side: int = 1024
) -> list[Page]:
    """The pages of ``sources`` in order: paths, raw bytes, or ``(name, bytes)`` pairs, each a PDF
    (recognised by its ``%PDF-`` header) or an image file. PDF pages are rendered with their
    longer side ``render_side`` pixels. Raises :class:`DocumentError` naming the file and page."""
    pages: list[Page] = []
    for i, src in enumerate(sources):
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
        if data[:1024].lstrip()[:5] == _PDF_MAGIC:
            pages += render_pdf(data, name, render_side)
        else:
            pages += open_image(data, name)
        if len(pages) > MAX_PAGES:
            raise DocumentError(f"the request holds more than {MAX_PAGES} pages")
    if not pages:
        raise DocumentError("no pages: send at least one image or PDF page")
    return pages


def page_names(pages: Sequence[Page]) -> list[str]:
    return [p.source for p in pages]
