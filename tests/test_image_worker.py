"""Issue 67 round 4 (b): image files are read and decoded in the rendering worker, under the same
limits as PDFs (Pillow never decodes an upload in the serving process): the same pages as decoding
here, a decompression bomb (a PNG of huge dimensions whose IDAT compresses to a few hundred KB,
made here with zlib) refused by the pixel check or the worker's memory limit without this
process's memory growing, and the warm worker replaced after a refusal as for a PDF."""

from __future__ import annotations

import io
import resource
import struct
import zlib

import pytest
from PIL import Image, ImageDraw

from dash_trt.documents.pages import DocumentError, load_pages, open_pages
from dash_trt.documents.render import Renderer, RenderLimits, RenderWorkers

pytest.importorskip("pypdfium2")


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_bomb(width: int, height: int) -> bytes:
    """A grey PNG of ``width`` x ``height`` zero pixels, its IDAT compressed row by row."""
    z = zlib.compressobj(9)
    row = bytes(width + 1)  # filter byte 0, then the row
    idat = b"".join(z.compress(row) for _ in range(height)) + z.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")


def _image(mode="RGB", size=(300, 200), colour="white"):
    im = Image.new(mode, size, colour)
    ImageDraw.Draw(im).text((10, 10), "a page", fill="black" if mode != "P" else 1)
    return im


def _bytes(im, fmt, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def samples() -> list[tuple[str, bytes]]:
    exif = Image.Exif()
    exif[0x0112] = 6  # turned 90 degrees: the page is upright once decoded
    rgba = _image("RGBA", (120, 90), (0, 0, 0, 0))
    frames = [_image("RGB", (200, 150)), _image("L", (100, 240))]
    return [
        ("a.png", _bytes(_image(), "PNG")),
        ("b.jpg", _bytes(_image("RGB", (320, 240)), "JPEG", exif=exif)),
        ("c.png", _bytes(rgba, "PNG")),
        ("d.tif", _bytes(frames[0], "TIFF", save_all=True, append_images=frames[1:])),
        ("e.gif", _bytes(_image("P", (64, 48), 0), "GIF", transparency=0)),
        ("f.webp", _bytes(_image(), "WEBP", lossless=True)),
        ("g.bmp", _bytes(_image("L"), "BMP")),
    ]


def test_an_image_decoded_in_the_worker_is_the_image_decoded_here():
    worker = load_pages(samples(), limits=RenderLimits())
    here = load_pages(samples(), limits=RenderLimits(isolate=False))
    assert (
        [p.source for p in worker]
        == [p.source for p in here]
        == [
            "a.png",
            "b.jpg",
            "c.png",
            "d.tif page 1",
            "d.tif page 2",
            "e.gif",
            "f.webp",
            "g.bmp",
        ]
    )
    for a, b in zip(worker, here):
        assert a.image.mode == b.image.mode == "RGB" and a.size == b.size
        assert a.image.tobytes() == b.image.tobytes(), a.source
    assert worker[1].size == (240, 320)  # EXIF orientation applied


def test_the_worker_reads_the_image_and_this_process_never_opens_it(monkeypatch):
    """Pillow's reader in this process is not called (only the worker's answer is turned into an image)."""
    from dash_trt.documents import pages as P

    def nowhere(*a, **k):
        raise AssertionError("decoded in the serving process")

    monkeypatch.setattr(P, "probe_image", nowhere)
    monkeypatch.setattr(P, "decode_frame", nowhere)
    monkeypatch.setattr(Image, "open", nowhere)
    pages = load_pages(samples()[:4])
    assert [p.size for p in pages] == [(300, 200), (240, 320), (120, 90), (200, 150), (100, 240)]


def _maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_a_bomb_over_the_pixel_limit_is_refused_in_the_worker_and_it_is_replaced():
    bomb = png_bomb(30_000, 30_000)  # 900 M pixels
    assert len(bomb) < 2_000_000
    with RenderWorkers(RenderLimits()) as workers:
        workers.warm()
        before, rss = workers.starts, _maxrss_mb()
        with Renderer(workers=workers) as renderer:
            with pytest.raises(DocumentError, match=r"bomb\.png: image of 900,000,000 pixels is larger than"):
                open_pages([("bomb.png", bomb)], renderer=renderer)
            assert renderer.proc is None  # the worker that refused it is not used again
        assert workers.starts == before + 1  # its successor, started at once
        with Renderer(workers=workers) as renderer:
            (page,) = open_pages([("ok.png", samples()[0][1])], renderer=renderer)
            assert page.render().image.size == (300, 200)
        assert workers.starts == before + 1  # the successor served it, warm
        assert _maxrss_mb() - rss < 100


def test_a_bomb_under_the_pixel_limit_is_refused_by_the_workers_memory_limit():
    """195 M pixels of grey (about 780 MB once RGB): within the pixel limit, over 256 MiB."""
    bomb = png_bomb(15_000, 13_000)
    assert len(bomb) < 1_000_000
    rss = _maxrss_mb()
    with RenderWorkers(RenderLimits(memory_mb=256)) as workers:
        with Renderer(workers=workers) as renderer:
            (page,) = open_pages([("bomb.png", bomb)], renderer=renderer)
            assert page.size == (15_000, 13_000)
            with pytest.raises(DocumentError, match=r"bomb\.png: rendering needs more than 256 MiB of memory"):
                page.render()
            assert renderer.proc is None
        with Renderer(workers=workers) as renderer:
            (page,) = open_pages([("ok.png", samples()[0][1])], renderer=renderer)
            assert page.render().image.size == (300, 200)
    assert _maxrss_mb() - rss < 100


def test_a_file_that_is_not_an_allowed_image_is_refused_by_the_worker():
    ico = _bytes(_image("RGB", (32, 32)), "ICO")
    with pytest.raises(DocumentError, match=r"x\.ico: not a supported image"):
        load_pages([("x.ico", ico)])
