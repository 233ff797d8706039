"""An image file's pages read and decoded with Pillow: the one definition of what an image page
may be (:data:`IMAGE_FORMATS`, :data:`~dash_trt.documents.limits.MAX_PIXELS` a frame,
:data:`~dash_trt.documents.limits.MAX_PAGES` frames) and of how a frame becomes an RGB page (EXIF
orientation applied, transparency flattened onto white). Used in the rendering worker
(:mod:`dash_trt.documents.render_worker`, which loads this module and :mod:`.limits` alone:
nothing else of dash_trt) and, with ``RenderLimits(isolate=False)``, in this process
(:mod:`dash_trt.documents.pages`). Needs nothing but Pillow and :mod:`.limits`."""

from __future__ import annotations

import io
import re
import warnings

from .limits import MAX_PAGES, MAX_PIXELS, DocumentError, PageError, _pil

__all__ = ["IMAGE_FORMATS", "ImageInfo", "probe_image", "decode_frame"]

#: The image formats a page may be (Pillow's names), as documented: Pillow knows many more (ICO,
#: TGA, PCX, SGI, EPS through Ghostscript ...), which are refused before it parses them. (Many
#: cameras' JPEGs are MPO files: Pillow's JPEG reader opens them, or its MPO one where it has one.)
IMAGE_FORMATS = ("PNG", "JPEG", "MPO", "TIFF", "WEBP", "BMP", "GIF")


def _formats() -> list[str]:
    """:data:`IMAGE_FORMATS` that this Pillow has readers for."""
    Image, _ = _pil()
    Image.init()
    return [f for f in IMAGE_FORMATS if f in Image.OPEN]


def _too_large(
    source: str, size: tuple[int, int] | None = None, pixels: int | None = None, limit: int = MAX_PIXELS
) -> DocumentError:
    """The one message for an image over ``limit`` pixels (its size, or Pillow's pixel count)."""
    what = f"{size[0]}x{size[1]} pixels" if size else f"{pixels:,} pixels" if pixels else "pixels"
    return DocumentError(f"{source}: image of {what} is larger than {limit:,} pixels")


def _reason(exc: Exception) -> str:
    """Pillow's reason without the reprs of the in-memory file it read (``<_io.BytesIO object at
    0x...>``, which names nothing the user sent)."""
    Image, _ = _pil()
    if isinstance(exc, Image.UnidentifiedImageError):
        return "its format is not recognised"
    text = re.sub(r"\s*<_io\.BytesIO object at 0x[0-9a-fA-F]+>", "", str(exc)).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


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


def _exif_swaps(img) -> bool:
    """Whether the image's EXIF orientation turns it by 90 degrees (5 to 8)."""
    try:
        return img.getexif().get(0x0112, 1) in (5, 6, 7, 8)
    except Exception:  # noqa: BLE001 - a broken EXIF block: _rgb names it when the page renders
        return False


class ImageInfo:
    """An image file's header as :func:`probe_image` read it: its (first) frame's ``size``, its
    ``frames``, each frame's size (``sizes``, as stored: before EXIF orientation) and whether the
    EXIF orientation swaps the sides (``swap``). ``sizes`` is empty when the first frame is over
    :data:`MAX_PIXELS` (the caller refuses the image, or the page alone)."""

    def __init__(self, size: tuple[int, int], frames: int, sizes: list[tuple[int, int]], swap: bool):
        self.size, self.frames, self.sizes, self.swap = size, frames, sizes, swap

    def to_dict(self) -> dict:
        sizes = [list(s) for s in self.sizes]
        return {"size": list(self.size), "frames": self.frames, "sizes": sizes, "swap": self.swap}

    @classmethod
    def from_dict(cls, d: dict) -> ImageInfo:
        """:meth:`to_dict`'s (a worker's answer: every number checked)."""
        size = _pair(d["size"])
        frames, swap = d["frames"], d["swap"]
        if not (isinstance(frames, int) and 0 < frames <= MAX_PAGES and isinstance(swap, bool)):
            raise ValueError(f"frames {frames!r}, swap {swap!r}")
        sizes = [_pair(s) for s in d["sizes"]]
        if sizes and len(sizes) != frames:
            raise ValueError(f"{len(sizes)} sizes of {frames} frames")
        return cls(size, frames, sizes, swap)


def _pair(value) -> tuple[int, int]:
    w, h = value
    if not (isinstance(w, int) and isinstance(h, int) and w >= 0 and h >= 0):
        raise ValueError(f"a size {value!r}")
    return w, h


def probe_image(data: bytes, source: str, refuse: bool = False, max_pixels: int = MAX_PIXELS) -> ImageInfo:
    """An image file's frames and their sizes, read from its headers (no pixel decoded). Raises
    :class:`DocumentError` naming ``source`` for a file that is not one of :data:`IMAGE_FORMATS`,
    an empty image, too many frames, or a frame over :data:`MAX_PIXELS` (the first frame's comes
    back as empty ``sizes``; a later frame's raises unless ``refuse``). ``max_pixels``: the pixel
    limit (the caller's :data:`MAX_PIXELS`)."""
    Image, _ = _pil()
    try:  # Pillow reads the header only here
        with warnings.catch_warnings():
            # between MAX_PIXELS and twice it Pillow warns and opens the header: refused below
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=_formats())
            img.verify()  # structure check; the file must be reopened afterwards
            img = Image.open(io.BytesIO(data), formats=_formats())
    except Image.DecompressionBombError as exc:  # more than twice MAX_PIXELS: Pillow refused it
        count = re.search(r"\((\d+) pixels\)", str(exc))
        raise _too_large(source, pixels=int(count.group(1)) if count else None, limit=max_pixels) from None
    except Exception as exc:  # noqa: BLE001 - Pillow raises UnidentifiedImageError, OSError, SyntaxError ...
        raise DocumentError(
            f"{source}: not a supported image ({_reason(exc)}); send PNG, JPEG, TIFF, WebP, BMP, GIF or a PDF"
        ) from None
    w, h = img.size
    if w * h > max_pixels:
        return ImageInfo((w, h), 1, [], False)
    if w < 1 or h < 1:
        raise DocumentError(f"{source}: image of {w}x{h} pixels is empty")
    frames = getattr(img, "n_frames", 1)
    if frames > MAX_PAGES:
        raise DocumentError(f"{source}: {frames} frames, more than {MAX_PAGES} pages")
    # NOTE: EXIF orientation may swap a frame's sides; the size is the upright one
    swap = _exif_swaps(img)
    sizes = [(w, h)] * frames
    if frames > 1 and img.format != "GIF":  # a TIFF's pages may differ (a GIF's frames share its screen)
        sizes = []
        for i in range(frames):
            try:
                img.seek(i)  # the frame's header, not its pixels
            except Exception as exc:  # noqa: BLE001 - a truncated file
                raise DocumentError(f"{source} page {i + 1}: cannot be read ({_reason(exc)})") from None
            fw, fh = img.size
            if fw * fh > max_pixels and not refuse:
                raise _too_large(f"{source} page {i + 1}", (fw, fh), limit=max_pixels)
            sizes.append((fw, fh))
    return ImageInfo((w, h), frames, sizes, swap)


def decode_frame(data: bytes, index: int, name: str):
    """Frame ``index`` of an image file decoded to an RGB ``PIL.Image`` (:func:`_rgb`); a frame
    that cannot be decoded is a :class:`PageError` naming ``name``."""
    Image, _ = _pil()
    try:
        with Image.open(io.BytesIO(data), formats=_formats()) as im:
            im.seek(index)
            im.load()
            return _rgb(im.copy(), name)
    except (DocumentError, MemoryError):
        raise
    except Exception as exc:  # noqa: BLE001 - a truncated frame
        raise PageError(f"{name}: cannot be decoded ({_reason(exc)})") from None
