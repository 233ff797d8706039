"""Documents in, text out: page images and PDFs (made here), views and image-token counts, the
tokenizer (trained here) with incremental decoding, the prompt and chat templates, the decoding
rules on hand-made logits, the vision tower's layout, and the whole pipeline (a PDF in, one
section per page out) offline and through the real Triton server."""

from __future__ import annotations

import io
import json
import math
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from conftest import running_triton, write_tiny_unlimited_ocr2
from PIL import Image, ImageDraw

from dash_trt.documents.pages import DocumentError, load_pages, open_pages
from dash_trt.documents.processor import DocumentOptions, split_pages
from dash_trt.documents.prompt import PromptError, document_prompt_ids
from dash_trt.documents.tokenizer import IncrementalDecoder, TextTokenizer, load_tokenizer
from dash_trt.documents.views import ViewSpec, image_token_count, page_views, tile_grid
from dash_trt.models import deepencoder as D
from dash_trt.models.unlimited_ocr2 import TINY_SPECIAL_TOKENS, tiny_tokenizer
from dash_trt.serving.rules import DecodingRules, NoRepeatNGram, PageCountGuard, document_rules

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def page_image(w: int, h: int, text: str = "page", color="white") -> Image.Image:
    im = Image.new("RGB", (w, h), color)
    ImageDraw.Draw(im).text((10, 10), text, fill="black")
    return im


def pdf_bytes(images) -> bytes:
    buf = io.BytesIO()
    images[0].save(buf, "PDF", save_all=True, append_images=list(images[1:]), resolution=72.0)
    return buf.getvalue()


def png_bytes(im: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, "PNG", **kw)
    return buf.getvalue()


# ------------------------------------------------------------------------------ pages
def test_pdf_pages_are_rendered_to_the_view_size():
    data = pdf_bytes([page_image(600, 800), page_image(800, 400), page_image(500, 500)])
    pages = load_pages([("doc.pdf", data)], render_side=1024)
    assert [p.size for p in pages] == [(768, 1024), (1024, 512), (1024, 1024)]
    assert [p.source for p in pages] == ["doc.pdf page 1", "doc.pdf page 2", "doc.pdf page 3"]
    assert all(p.image.mode == "RGB" for p in pages)


def test_images_are_oriented_and_flattened(tmp_path):
    rgba = Image.new("RGBA", (40, 20), (255, 0, 0, 0))  # fully transparent red: white after flattening
    rgba.putpixel((0, 0), (0, 0, 255, 255))
    (page,) = load_pages([("a.png", png_bytes(rgba))])
    assert page.image.mode == "RGB" and page.image.getpixel((1, 1)) == (255, 255, 255)
    assert page.image.getpixel((0, 0)) == (0, 0, 255)
    im = page_image(40, 20)
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to display
    buf = io.BytesIO()
    im.save(buf, "JPEG", exif=exif)
    (page,) = load_pages([("b.jpg", buf.getvalue())])
    assert page.size == (20, 40)
    grey = Image.new("L", (8, 8), 128)
    (page,) = load_pages([("c.png", png_bytes(grey))])
    assert page.image.getpixel((0, 0)) == (128, 128, 128)
    path = tmp_path / "d.png"
    path.write_bytes(png_bytes(im))
    assert load_pages([str(path)])[0].source == str(path)


def test_unreadable_documents_get_one_line_naming_them(tmp_path, monkeypatch):
    with pytest.raises(DocumentError, match=r"^x\.pdf: not a readable PDF"):
        load_pages([("x.pdf", b"%PDF-1.7 this is not a pdf")])
    with pytest.raises(DocumentError, match=r"^notes\.txt: not a supported image .*send PNG, JPEG"):
        load_pages([("notes.txt", b"hello, world")])
    import pypdfium2 as pdfium

    empty = pdfium.PdfDocument.new()
    buf = io.BytesIO()
    empty.save(buf)
    empty.close()
    with pytest.raises(DocumentError, match=r"^empty\.pdf: the PDF has 0 pages"):
        load_pages([("empty.pdf", buf.getvalue())])
    with pytest.raises(DocumentError, match=r"^e\.png: the file is empty"):
        load_pages([("e.png", b"")])
    with pytest.raises(DocumentError, match="(?i)no such file"):
        load_pages([str(tmp_path / "missing.pdf")])
    from dash_trt.documents import pages as pages_mod

    monkeypatch.setattr(pages_mod, "MAX_PIXELS", 100)
    with pytest.raises(DocumentError, match=r"^big\.png: image too large|^big\.png: image of 20x20 pixels"):
        load_pages([("big.png", png_bytes(page_image(20, 20)))])


def _png_header(w: int, h: int) -> bytes:
    """A PNG of ``w`` x ``h`` pixels as far as its header goes (no pixel data: never decoded)."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", w, h, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


def test_the_documented_pixel_limit_is_the_one_that_applies(recwarn):
    """Issue D15: Pillow's own guard refused anything over 178,956,970 pixels with its message, so
    the documented 200 M pixels a page was never reached. Up to MAX_PIXELS an image is read, without
    a warning; over it, by a little or by far, the one documented message."""
    from dash_trt.documents.pages import MAX_PIXELS, open_pages

    assert MAX_PIXELS == 200_000_000
    (page,) = open_pages([("wide.png", _png_header(19000, 10000))])  # 190 M pixels
    assert page.size == (19000, 10000)
    assert not [w for w in recwarn if "decompression" in str(w.message).lower()]
    with pytest.raises(DocumentError, match=r"^big\.png: image of 20000x10001 pixels is larger than 200,000,000"):
        open_pages([("big.png", _png_header(20000, 10001))])
    with pytest.raises(DocumentError, match=r"^huge\.png: image of 600,000,000 pixels is larger than 200,000,000"):
        open_pages([("huge.png", _png_header(30000, 20000))])


def test_an_unreadable_image_is_not_described_by_an_in_memory_file():
    """Issue D16: 'cannot identify image file <_io.BytesIO object at 0x...>' named nothing sent."""
    with pytest.raises(DocumentError) as info:
        load_pages([("notes.txt", b"hello, world")])
    text = str(info.value)
    assert "BytesIO" not in text and "0x" not in text
    assert text.startswith("notes.txt: not a supported image (its format is not recognised); send PNG")


# ------------------------------------------------------------------------------ views
def test_a_page_limit_below_the_global_view_does_not_advise_turning_crop_mode_off():
    """Issue D16: a limit below the global view's tokens refuses every page, tiled or not; the
    message says so instead of 'send the page without crop mode'."""
    from dash_trt.documents.views import check_page_tokens

    spec = ViewSpec(256, 160, max_crops=6, max_page_tokens=10)  # the global view: 4 x 5 + 1 = 21
    for crop in (True, False):
        with pytest.raises(DocumentError) as info:
            check_page_tokens(742, 960, spec, crop, "doc.pdf page 1")
        text = str(info.value)
        assert "without crop mode" not in text and "smaller" not in text
        assert text.endswith("more than the 10 a page may take; every page takes at least the global view's 21: "
                             "allow at least that many")  # fmt: skip
    spec = ViewSpec(256, 160, max_crops=6, max_page_tokens=30)  # tiles are what is over
    with pytest.raises(DocumentError, match=r"84 image tokens .* 2 x 3 tiles\), more than the 30 .* without crop mode"):
        check_page_tokens(742, 960, spec, True, "doc.pdf page 1")


def test_image_token_counts_by_hand():
    spec = ViewSpec()  # 1024 global, 640 tiles, 16 px patches, 4x downsampling: 16 and 10 features a side
    assert image_token_count(500, 640, spec, crop=True) == 16 * 17 + 1  # fits one tile: the global view only
    assert image_token_count(1700, 2200, spec, crop=False) == 273
    # 1700 x 2200: aspect 0.77; among the grids of 2-16 tiles, 3 x 4 is the closest (0.75)
    assert tile_grid(1700, 2200, spec) == (3, 4)
    assert image_token_count(1700, 2200, spec, crop=True) == 273 + (10 * 3 + 1) * (10 * 4)
    # a tie between 1 x 2 and 2 x 4 (both 0.5): the larger grid when the page has more than half its pixels
    assert tile_grid(700, 1400, spec) == (1, 2)
    assert tile_grid(1400, 2800, spec) == (2, 4)
    tiny = ViewSpec(base_size=256, image_size=160, max_crops=6)  # 4 and 3 features a side
    assert image_token_count(100, 100, tiny, crop=True) == 4 * 5 + 1
    assert image_token_count(300, 500, tiny, crop=True) == 21 + (3 * 2 + 1) * (3 * 3)


def test_views_pad_resize_cut_and_normalise():
    spec = ViewSpec(base_size=256, image_size=160, max_crops=6)
    im = Image.new("RGB", (300, 500), (255, 255, 255))
    im.paste((0, 0, 0), (0, 0, 150, 250))  # top-left quarter black
    v = page_views(im, spec, crop=True)
    assert v.grid == (2, 3) and v.crops.shape == (6, 3, 160, 160) and v.global_view.shape == (3, 256, 256)
    assert v.num_tokens == 84
    assert v.global_view[:, 128, 0].tolist() == pytest.approx([(127 / 255 - 0.5) / 0.5] * 3)  # pad: the mean's grey
    assert v.global_view[:, 200, 170].tolist() == [1.0, 1.0, 1.0]  # white inside the page
    # tiles row by row: tile 0 (top-left) black at its corner, tile 1 (top-right) white there
    assert v.crops[0, :, 5, 5].tolist() == [-1.0, -1.0, -1.0] and v.crops[1, :, 5, 150].tolist() == [1.0, 1.0, 1.0]
    assert page_views(im, spec, crop=False).crops.shape == (0, 3, 160, 160)
    budget = ViewSpec(base_size=256, image_size=160, max_crops=6, max_page_tokens=50)
    with pytest.raises(DocumentError, match=r"scan\.png: 300x500 pixels take 84 image tokens \(4 x 5 \+ 1 .*"
                       r"\+ \(3 x 2 \+ 1\) x \(3 x 3\) for 2 x 3 tiles\), more than the 50"):  # fmt: skip
        page_views(im, budget, crop=True, source="scan.png")


# ------------------------------------------------------------------------------ tokenizer
@pytest.fixture(scope="module")
def tokenizer():
    tok = TextTokenizer(tiny_tokenizer(), {"bos_token": TINY_SPECIAL_TOKENS[0], "eos_token": TINY_SPECIAL_TOKENS[1]})
    return tok


TEXTS = ["naïve café – 東京 ✓ → € ½", "# Title\n\n| a | b |\n| --- | --- |", "Zürich, Kraków 🚀 and Ελλάδα"]


def test_tokenizer_round_trips(tokenizer):
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.token_id("<PAGE>"), tokenizer.token_id("<image>")) == (
        0,
        1,
        2,
        3,
    )
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
    assert tokenizer.encode("<PAGE>x")[0] == 2  # special tokens written in text are recognised


def test_incremental_decoding_never_emits_half_a_character(tokenizer):
    for text in TEXTS:
        ids = tokenizer.encode(text)
        dec = IncrementalDecoder(tokenizer)
        pieces = [dec.push(t) for t in ids] + [dec.flush()]
        assert "".join(pieces) == text
        assert not any("\ufffd" in p for p in pieces)
    # a stream cut inside a character: held back, then the full decode's replacement at the end
    ids = tokenizer.encode("東")
    dec = IncrementalDecoder(tokenizer)
    got = "".join(dec.push(t) for t in ids[:-1])
    assert got == "" and dec.flush() == tokenizer.decode(ids[:-1])


def test_a_folder_tokenizer_and_its_errors(tmp_path, tokenizer):
    with pytest.raises(Exception, match="has no tokenizer.json"):
        load_tokenizer(tmp_path)
    tokenizer.tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": {"content": TINY_SPECIAL_TOKENS[0]}}))
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}User: {{ messages[0]['content'] }}\nAssistant:")
    tok = load_tokenizer(tmp_path)
    assert tok.bos_id == 0 and tok.chat_template.startswith("{{ bos_token }}")


# ------------------------------------------------------------------------------ prompt
def test_the_prompt_layout(tokenizer):
    ids = document_prompt_ids(tokenizer, [5, 3], image_token_id=3, page_token_id=2)
    instruction = tokenizer.encode("Multi page parsing.")
    assert ids == [0, 2] + [3] * 5 + [2] + [3] * 3 + instruction
    one = document_prompt_ids(tokenizer, [4], image_token_id=3, page_token_id=2, instruction="Read it.")
    assert one == [0, 2, 3, 3, 3, 3] + tokenizer.encode("Read it.")
    with pytest.raises(PromptError, match="may not contain '<image>'"):
        document_prompt_ids(tokenizer, [4], image_token_id=3, page_token_id=2, instruction="<image>")
    with pytest.raises(PromptError, match="2 page markers for 1 pages"):
        document_prompt_ids(tokenizer, [4], image_token_id=3, page_token_id=2, instruction="<PAGE>")


def test_chat_templates_render_in_a_sandbox(tokenizer):
    tok = TextTokenizer(tokenizer.tokenizer, tokenizer.config, "{{ bos_token }}User: {{ messages[0]['content'] }}\nA:")
    ids = document_prompt_ids(tok, [2], image_token_id=3, page_token_id=2, instruction="Go.")
    assert ids == [0] + tokenizer.encode("User: ") + [2, 3, 3] + tokenizer.encode("Go.\nA:")
    evil = TextTokenizer(tokenizer.tokenizer, tokenizer.config, "{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(PromptError, match="the chat template failed"):
        document_prompt_ids(evil, [2], image_token_id=3, page_token_id=2)


# ------------------------------------------------------------------------------ rules
def row(n=8, **values) -> torch.Tensor:
    x = torch.zeros(n)
    for k, v in values.items():
        x[int(k[1:])] = v
    return x


PAGE, EOS = 2, 1


def test_page_guard_by_hand():
    g = PageCountGuard(PAGE, EOS, expected_pages=2, max_page_tokens=3)
    x = row(t1=5.0)  # EOS is the best token, but no page is marked yet: masked
    g([4], x)
    assert x[EOS] == -math.inf and x[4] == 0
    x = row()
    g([4, 5, 6], x)  # the first page (before any marker) reached 3 tokens: <PAGE> forced, its logit kept
    assert x[PAGE] == 0 and torch.isinf(x[[0, 1, 3, 4, 5, 6, 7]]).all()
    x = row(t1=5.0)
    g([4, 5, 6, 2, 7], x)  # 1 of 2 markers: EOS still masked
    assert x[EOS] == -math.inf
    x = row(t1=5.0)
    g([4, 5, 6, 2, 7, 2], x)  # 2 of 2: EOS allowed again
    assert x[EOS] == 5.0
    x = row()
    g([4, 5, 6, 2, 7, 2, 4, 4, 4], x)  # the last page at its cap: EOS forced
    assert x[EOS] == 0 and x[PAGE] == -math.inf
    x = row()
    g([4, 5, 6, 2, 7, 2, 2], x)  # one marker too many: EOS forced
    assert x[EOS] == 0 and torch.isinf(x[[0, 2, 3]]).all()
    blocked = row(t1=-math.inf)
    PageCountGuard(PAGE, EOS, 1, 2)([2, 4, 4], blocked)  # EOS masked by another rule: not forced back
    assert blocked[EOS] == -math.inf and blocked[4] == 0
    only = torch.full((8,), -math.inf)
    only[EOS] = 1.0
    PageCountGuard(PAGE, EOS, 3, 0)([4], only)  # EOS the only finite token: kept
    assert only[EOS] == 1.0
    off = row(t1=5.0)
    PageCountGuard(PAGE, EOS, 0, 3)([4, 4, 4, 4], off)  # a prompt without markers: no guard
    assert off[EOS] == 5.0


def test_no_repeat_ngram_by_hand():
    r = NoRepeatNGram(3, window=0)
    assert r.banned([1, 2, 3, 1, 2]) == {3}  # (1, 2) was followed by 3
    assert r.banned([1, 2, 3, 1, 2, 4, 1, 2]) == {3, 4}
    assert NoRepeatNGram(3, window=5).banned([1, 2, 3, 9, 9, 9, 1, 2]) == set()  # outside the last 5 tokens
    assert NoRepeatNGram(3, window=0, whitelist={3}).banned([1, 2, 3, 1, 2]) == set()
    x = row()
    r([1, 2, 3, 1, 2], x)
    assert x[3] == -math.inf and x[4] == 0
    rules = document_rules(1)
    assert (rules.page_guard, rules.no_repeat_ngram, rules.no_repeat_window) == (True, 35, 128)
    assert document_rules(3).no_repeat_window == 1024
    assert document_rules(3, no_repeat_ngram=0).no_repeat_ngram == 0
    with pytest.raises(ValueError, match="no_repeat_ngram of 1"):
        DecodingRules(no_repeat_ngram=1)


def test_answers_split_into_one_section_a_page():
    assert split_pages([2, 5, 6, 2, 7, 1], 2, 1, 2) == [[5, 6], [7]]
    assert split_pages([9, 2, 5, 2, 7], 2, 1, 2) == [[9, 5], [7]]  # text before the first marker: page 1
    assert split_pages([2, 5], 2, 1, 3) == [[5], [], []]  # cut short: empty pages
    assert split_pages([2, 5, 2, 6, 2, 7], 2, 1, 2) == [[5], [6, 7]]  # surplus to the last page
    assert split_pages([], 2, 1, 1) == [[]]


# ------------------------------------------------------------------------------ vision tower
def test_assemble_page_lays_tiles_and_newlines_out_as_the_tokens():
    d = 2
    g = torch.arange(4 * d, dtype=torch.float32).view(4, d) + 100  # a 2 x 2 global view
    tiles = torch.arange(2 * 1 * 4 * d, dtype=torch.float32).view(2, 4, d)  # 2 x 1 tiles of 2 x 2 features
    nl, sep = torch.full((d,), -1.0), torch.full((d,), -2.0)
    out = D.assemble_page(g, tiles, (2, 1), nl, sep)
    # the grid's feature row 0: tile 0's row 0 (0, 2), tile 1's row 0 (8, 10), a newline; then row 1;
    # the global view's rows with their newlines; the separator
    want = [0, 2, 8, 10, -1, 4, 6, 12, 14, -1, 100, 102, -1, 104, 106, -1, -2]
    assert out[:, 0].tolist() == want


def test_windowed_sam_block_is_global_attention_within_each_window():
    torch.manual_seed(0)
    blk = D.SamBlock(8, 2, window=3, size=6)
    for p in blk.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(1, 5, 4, 8)  # padded to 6 x 6, four 3 x 3 windows
    rel = D.rel_table(blk.attn.rel_pos_h, 3), D.rel_table(blk.attn.rel_pos_w, 3)
    got = blk(x, *rel)
    normed = torch.nn.functional.pad(blk.norm1(x), (0, 0, 0, 2, 0, 1))
    attn = torch.zeros(1, 6, 6, 8)
    for i in range(2):
        for j in range(2):
            win = normed[:, 3 * i : 3 * i + 3, 3 * j : 3 * j + 3]
            attn[:, 3 * i : 3 * i + 3, 3 * j : 3 * j + 3] = blk.attn(win, *rel)
    y = x + attn[:, :5, :4]
    want = y + blk.mlp(blk.norm2(y))
    torch.testing.assert_close(got, want)


def test_relative_position_tables_by_hand():
    rel = torch.arange(5 * 2, dtype=torch.float32).view(5, 2)  # trained for size 3: offsets -2..2
    t = D.rel_table(rel, 3)
    for q in range(3):
        for k in range(3):
            assert t[q, k].tolist() == rel[q - k + 2].tolist()
    assert D.rel_table(rel, 5).shape == (5, 5, 2)  # resized to 9 entries first


def test_tower_state_fuses_separate_clip_projections():
    q, k, v = (torch.full((4, 4), float(i)) for i in range(3))
    state = {
        "model.vision_model.transformer.layers.0.self_attn.q_proj.weight": q,
        "model.vision_model.transformer.layers.0.self_attn.k_proj.weight": k,
        "model.vision_model.transformer.layers.0.self_attn.v_proj.weight": v,
        "model.vision_model.embeddings.position_ids": torch.zeros(1, 3),
        "model.layers.0.mlp.gate.weight": torch.zeros(2, 2),
    }
    out = D.tower_state(state)
    assert list(out) == ["vision_model.transformer.layers.0.self_attn.qkv_proj.weight"]
    assert (
        out["vision_model.transformer.layers.0.self_attn.qkv_proj.weight"][:, 0].tolist() == [0] * 4 + [1] * 4 + [2] * 4
    )


# ------------------------------------------------------------------------------ the pipeline
@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_unlimited_ocr2(tmp_path_factory, "uocr2docs")


@pytest.fixture(scope="module")
def ocr(folder):
    from dash_trt.serving.documents import DocumentOCR

    return DocumentOCR(folder)


def three_pages() -> bytes:
    return pdf_bytes([page_image(300, 400, "one"), page_image(400, 300, "two"), page_image(350, 350, "three")])


def test_a_pdf_gives_one_section_a_page_offline(ocr):
    doc = ocr.prepare([("doc.pdf", three_pages())])
    # every page tiled by default, one page or several (vLLM 0.34.0's Unlimited-OCR-2)
    spec = ocr.processor.spec
    tiled = [image_token_count(*p.size, spec, crop=True) for p in doc.pages]
    assert doc.crop is True and doc.page_tokens == tiled and min(tiled) > 21
    assert ocr.prepare([("doc.pdf", three_pages())], DocumentOptions(crop=False)).page_tokens == [21, 21, 21]
    assert doc.prompt_ids.count(ocr.config.page_token_id) == 3
    result = ocr.transcribe([("doc.pdf", three_pages())], max_new_tokens=24, rules={"max_page_tokens": 6})
    assert [p.page for p in result.pages] == [1, 2, 3]
    assert [p.source for p in result.pages] == ["doc.pdf page 1", "doc.pdf page 2", "doc.pdf page 3"]
    # the guard forced a <PAGE> after every 6 tokens (random weights never choose one): 3 markers in
    # 24 tokens, the 6 before the first marker going with page 1, the answer cut in page 3
    assert result.generated_tokens == 24 and [len(p.tokens) for p in result.pages] == [12, 6, 3]
    assert ocr.cache.misses >= 3
    again = ocr.transcribe([("doc.pdf", three_pages())], max_new_tokens=24, rules={"max_page_tokens": 6})
    assert [p.text for p in again.pages] == [p.text for p in result.pages] and ocr.cache.hits >= 3
    single = ocr.prepare([("one.png", png_bytes(page_image(300, 500)))])
    assert single.crop is True and single.page_tokens == [84]  # a single page: tiles
    with pytest.raises(DocumentError, match=r"one\.png: 300x500 pixels take 84 image tokens"):
        ocr.prepare([("one.png", png_bytes(page_image(300, 500)))], DocumentOptions(max_page_tokens=40))


def test_every_page_has_its_own_budget_by_default_offline(ocr, monkeypatch):
    """Issue D1: in process a document had 2048 tokens in all and the page guard 20000 a page, so
    page 1 took them all and the other pages were empty. By default every page now has the one
    page budget (set small here: random weights run every page to it) and the document the total
    derived from it; a budget given per request takes its place the same way."""
    from dash_trt.documents import budget as B

    monkeypatch.setattr(B, "DEFAULT_MAX_PAGE_TOKENS", 5)
    result = ocr.transcribe([("doc.pdf", three_pages())])
    assert result.max_page_tokens == 5 and result.max_new_tokens == (3 + 1) * (5 + 1)
    # 5 tokens before the first marker (page 1's), then 5 a page, each ended at its budget
    assert [len(p.tokens) for p in result.pages] == [10, 5, 5]
    assert result.generated_tokens == 24 and result.truncated == [1, 2, 3] and result.finish_reason == "length"
    given = ocr.transcribe([("doc.pdf", three_pages())], rules={"max_page_tokens": 3})
    assert given.max_new_tokens == 16 and [len(p.tokens) for p in given.pages] == [6, 3, 3]
    # a total given by the request is used as it is: the pages it does not reach say length
    short = ocr.transcribe([("doc.pdf", three_pages())], max_new_tokens=8, rules={"max_page_tokens": 3})
    assert [len(p.tokens) for p in short.pages] == [6, 0, 0] and short.truncated == [1, 2, 3]


def test_dash_trt_ocr_in_process_reports_pages_cut_at_their_budget(folder, tmp_path):
    """--checkpoint with a tiny page budget: every page is written, each record of --format
    jsonl says length with its tokens, the summary counts and names them, and the exit status
    is 3 (written but truncated)."""
    doc = tmp_path / "doc.pdf"
    doc.write_bytes(three_pages())

    def ocr_cli(*extra):
        cmd = [sys.executable, "-m", "dash_trt.commands.info", "ocr", str(doc), "--checkpoint", str(folder)]
        cmd += ["--out", str(tmp_path / "out"), "--no-progress", "--max-page-tokens", "4", *extra]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)

    res = ocr_cli("--format", "jsonl")
    assert res.returncode == 3, res.stdout + res.stderr
    records = [json.loads(line) for line in res.stdout.splitlines()]
    assert [r["page"] for r in records] == [1, 2, 3] and all(r["file"] == str(doc) for r in records)
    assert [(r["finish_reason"], r["tokens"]) for r in records] == [("length", 8), ("length", 4), ("length", 4)]
    for r in records:
        assert isinstance(r["seconds"], float) and r["seconds"] >= 0 and r["source"].startswith("doc.pdf page ")
        assert open(r["output"], encoding="utf-8").read() == r["markdown"].rstrip() + "\n"
    res = ocr_cli()
    assert res.returncode == 3, res.stdout + res.stderr
    assert "1 of 1 documents, 3 pages (3 cut at their token budget)" in res.stdout
    assert f"TRUNCATED {doc}: page(s) 1-3 ran out of tokens" in res.stdout


def test_dash_trt_ocr_through_the_real_server_equals_offline(ocr, folder, tmp_path):
    """The Done-when of the documents issue on CPU: a 3-page PDF through dash-trt ocr and the real
    Triton server gives 3 sections, equal to offline generation with the same processor; a page
    over the budget, a corrupt PDF, an unsupported image and a PDF with 0 pages each get one line
    naming them, while the good document sent beside them is answered."""
    import pypdfium2 as pdfium

    files = {
        "report.pdf": three_pages(),
        "corrupt.pdf": b"%PDF-1.7\n1 0 obj garbage",
        "notes.txt": b"not an image",
        "large.png": png_bytes(page_image(200, 1200)),  # 1 x 6 tiles: over a budget the report's pages fit
    }
    empty = pdfium.PdfDocument.new()
    buf = io.BytesIO()
    empty.save(buf)
    empty.close()
    files["empty.pdf"] = buf.getvalue()
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    repo = tmp_path / "repo"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "dash_trt.triton.cli",
            "write",
            str(folder),
            "--out",
            str(repo),
            "--num-blocks",
            "64",
            "--torch-threads",
            "1",
            "--no-stream-model",
            "--document-instances",
            "2",
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert (repo / "dash_document" / "1" / "vision.safetensors").is_file()
    umask = os.umask(0)
    os.umask(umask)
    for f in (repo / "dash_document" / "1").iterdir():  # readable by a server of another user (umask's)
        assert (f.stat().st_mode & 0o777) == 0o666 & ~umask, f
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:  # no total given: both ways derive it from the page budget, (3 + 1) x (6 + 1)
        want = ocr.transcribe([("report.pdf", files["report.pdf"])], rules={"max_page_tokens": 6})
    finally:
        torch.set_num_threads(threads)
    assert want.max_new_tokens == 28 and [len(p.tokens) for p in want.pages] == [12, 6, 6]
    out = tmp_path / "out"
    with running_triton(repo, tmp_path / "tritonserver.log") as srv:
        res = subprocess.run(
            [
                sys.executable,
                "-m",
                "dash_trt.commands.info",
                "ocr",
                *(str(tmp_path / f) for f in files),
                "--server",
                srv.grpc_url,  # gRPC: the default protocol
                "--out",
                str(out),
                "--max-page-tokens",
                "6",
                "--max-page-image-tokens",
                "90",
                "--concurrency",
                "5",
                "--no-progress",
                "--json",
            ],  # fmt: skip
            capture_output=True,
            text=True,
            timeout=600,
            cwd=ROOT,
        )
        jsonl = subprocess.run(
            [sys.executable, "-m", "dash_trt.commands.info", "ocr", str(tmp_path / "report.pdf")]
            + ["--server", srv.grpc_url, "--out", str(tmp_path / "out-jsonl"), "--max-page-tokens", "6"]
            + ["--no-progress", "--format", "jsonl"],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=ROOT,
        )
    assert res.returncode == 1, res.stdout + res.stderr  # some documents failed, each named
    lines = {os.path.basename(r["file"]): r for r in map(json.loads, res.stdout.splitlines())}
    assert lines["report.pdf"]["ok"] and lines["report.pdf"]["pages"] == 3
    assert "corrupt.pdf: not a readable PDF" in lines["corrupt.pdf"]["error"]
    assert "notes.txt: not a supported image" in lines["notes.txt"]["error"]
    assert "empty.pdf: the PDF has 0 pages" in lines["empty.pdf"]["error"]
    assert re.search(
        r"large\.png: 200x1200 pixels take 93 image tokens .* more than the 90", lines["large.png"]["error"]
    )
    got = [(out / "report" / f"page-{i:04d}.md").read_text() for i in (1, 2, 3)]
    assert got == [p.text.rstrip() + "\n" for p in want.pages]
    combined = (out / "report.md").read_text()
    assert combined.count("<!-- page ") == 3 and "<!-- page 2: report.pdf page 2 -->" in combined
    assert not (out / "corrupt.md").exists()
    assert lines["report.pdf"]["length_pages"] == [1, 2, 3]  # every page ran to its budget of 6
    # one record a page, the server's finish reasons and token counts, the same as offline
    records = [json.loads(x) for x in jsonl.stdout.splitlines()]
    assert jsonl.returncode == 3, jsonl.stdout + jsonl.stderr  # written, but pages cut at their budget
    assert [r["markdown"].rstrip() + "\n" for r in records] == got
    assert [(r["page"], r["finish_reason"], r["tokens"]) for r in records] == [
        (p.page, p.finish_reason, len(p.tokens)) for p in want.pages
    ]
    assert all(isinstance(r["seconds"], float) for r in records)


def test_the_vision_tower_exports_and_compares(folder, tmp_path):
    """dash-export --vision writes one graph a view size, each checked in ONNX Runtime, and
    dash-compare checks a graph against the checkpoint's tower through polygraphy."""
    out = tmp_path / "vision"
    res = subprocess.run(
        [sys.executable, "-m", "dash_trt.export", str(folder), "--vision", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert sorted(p.name for p in out.glob("*.onnx")) == ["vision_160.onnx", "vision_256.onnx"]
    assert "trtexec --onnx=" in res.stdout and "ONNX Runtime vs PyTorch max |err|" in res.stdout
    # self-contained: nothing left of the temporary files, and each graph (with its weights file,
    # if it has one) runs from another folder
    names = sorted(p.name for p in out.iterdir())
    assert set(names) <= {f"vision_{s}.onnx{d}" for s in (160, 256) for d in ("", ".data")}, names
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    for name in names:
        (moved / name).write_bytes((out / name).read_bytes())
    import onnxruntime as ort

    sess = ort.InferenceSession(str(moved / "vision_160.onnx"), providers=["CPUExecutionProvider"])
    assert sess.run(None, {sess.get_inputs()[0].name: np.zeros((1, 3, 160, 160), np.float32)})[0].shape == (1, 9, 128)
    res = subprocess.run(
        [sys.executable, "-m", "dash_trt.compare", str(out / "vision_160.onnx"), "--checkpoint", str(folder)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "all backends match the reference" in res.stdout
    from dash_trt.export import VisionGraph
    from dash_trt.models.checkpoint import load_vision_tower
    from dash_trt.onnx_graph import read_graph

    graph = read_graph(out / "vision_256.onnx")
    assert [t.name for t in graph.outputs] == ["features", "image_newline", "view_separator"]
    assert graph.inputs[0].dims == (-1, 3, 256, 256)
    tower = load_vision_tower(folder)
    assert VisionGraph(tower, 256)(torch.zeros(1, 3, 256, 256))[0].shape == (1, 16, 128)


def test_dash_trt_ocr_in_process_takes_a_device_and_dtype(ocr, folder, tmp_path):
    """dash-trt ocr --checkpoint runs the model where --device says, in --dtype: on the CPU in
    float32 it writes offline generation's text; a device that does not exist, or --device with
    --server, is one line and exit 2."""
    doc = tmp_path / "one.png"
    doc.write_bytes(png_bytes(page_image(300, 400, "device")))
    want = ocr.transcribe([("one.png", doc.read_bytes())], max_new_tokens=8, rules={"max_page_tokens": 6})

    def ocr_cli(*extra):
        return subprocess.run(
            [sys.executable, "-m", "dash_trt.commands.info", "ocr", str(doc), "--out", str(tmp_path / "out")]
            + ["--no-progress", "--max-new-tokens", "8", "--max-page-tokens", "6", *extra],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=ROOT,
        )

    res = ocr_cli("--checkpoint", str(folder), "--device", "cpu", "--dtype", "float32")
    assert res.returncode == 3, res.stdout + res.stderr  # written; the page ran to its budget of 6
    assert want.pages[0].text.strip()  # random weights still write something
    assert (tmp_path / "out" / "one" / "page-0001.md").read_text().strip() == want.pages[0].text.strip()
    bad = ocr_cli("--checkpoint", str(folder), "--device", "nodevice")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "dash-trt ocr: error:" in bad.stderr
    mixed = ocr_cli("--server", "127.0.0.1:1", "--device", "cuda")
    assert mixed.returncode == 2 and "--device and --dtype are for --checkpoint" in mixed.stderr


def test_ocr_output_names_are_unique_whatever_the_files_are_called():
    from dash_trt.commands.ocr import _stems

    assert _stems(["x/a.pdf", "y/a.png", "a-2.pdf"]) == ["a", "a-3", "a-2"]
    assert _stems(["a.pdf", "a.pdf", "a-2.png"]) == ["a", "a-3", "a-2"]
    names = _stems([f"d{i % 3}/r.pdf" for i in range(7)] + ["r-2.png", "r-4.tif"])
    assert len(set(names)) == len(names) and names[-2:] == ["r-2", "r-4"]


def test_dash_trt_ocr_lists_a_document_it_cannot_write_and_writes_the_others(folder, tmp_path):
    """One output that cannot be written (a file where its folder goes) or must not be (a
    symbolic link at its name, pointing outside --out) fails that document alone, listed, exit 1;
    the other documents are written; nothing is written through the link; --out naming a file is
    one line, exit 2."""
    docs = []
    for name in ("good", "blocked", "link"):
        (tmp_path / f"{name}.png").write_bytes(png_bytes(page_image(120, 150, name)))
        docs.append(str(tmp_path / f"{name}.png"))
    out, outside = tmp_path / "out", tmp_path / "outside"
    out.mkdir()
    outside.mkdir()
    (out / "blocked").write_text("a file where the pages' folder goes")
    (out / "link").symlink_to(outside, target_is_directory=True)

    def ocr_cli(*args):
        cmd = [sys.executable, "-m", "dash_trt.commands.info", "ocr", *args, "--checkpoint", str(folder)]
        cmd += ["--max-new-tokens", "4", "--no-progress", "--json"]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)

    res = ocr_cli(*docs, "--out", str(out))
    assert res.returncode == 1, res.stdout + res.stderr
    lines = {os.path.basename(r["file"]): r for r in map(json.loads, res.stdout.splitlines())}
    assert lines["good.png"]["ok"] and (out / "good" / "page-0001.md").is_file() and (out / "good.md").is_file()
    assert not lines["blocked.png"]["ok"] and "blocked.png" in lines["blocked.png"]["error"]
    assert not lines["link.png"]["ok"] and "symbolic link" in lines["link.png"]["error"]
    assert list(outside.iterdir()) == []
    res = ocr_cli(docs[0], "--out", str(out / "good.md"))
    assert res.returncode == 2 and "is a file, not a folder" in res.stderr and res.stderr.count("\n") == 1


def _blank_pdf(pages: int, w: float = 612, h: float = 792) -> bytes:
    import pypdfium2 as pdfium

    pdf = pdfium.PdfDocument.new()
    for _ in range(pages):
        pdf.new_page(w, h)
    buf = io.BytesIO()
    pdf.save(buf)
    pdf.close()
    return buf.getvalue()


@pytest.fixture
def renders(monkeypatch):
    """How many pages were rendered or decoded (PageSource.render calls)."""
    from dash_trt.documents import pages as P

    calls = []
    real = P.PageSource.render
    monkeypatch.setattr(P.PageSource, "render", lambda self: calls.append(self.source) or real(self))
    return calls


def test_budgets_are_checked_before_any_page_is_rendered(tokenizer, renders, monkeypatch):
    """Issue 67 N1: a small PDF of hundreds of pages, a page over its token budget and a GIF of many
    large frames are refused from their sizes alone: not one page rendered or decoded. An accepted
    document renders each page once and keeps its views, not its bitmaps."""
    from dash_trt.documents import pages as P
    from dash_trt.documents.processor import DocumentProcessor

    proc = DocumentProcessor(tokenizer, image_token_id=3, page_token_id=2, spec=ViewSpec(256, 160, max_crops=6))
    many = _blank_pdf(300)
    assert len(many) < 200_000
    with pytest.raises(DocumentError, match=r"the prompt of 300 page\(s\) is .* more than the 4000"):
        proc.prepare([("many.pdf", many)], max_prompt_tokens=4000)
    proc.prepare([("fits.pdf", _blank_pdf(1))], DocumentOptions(max_page_tokens=90))  # 2 x 3 tiles: 84
    with pytest.raises(DocumentError, match=r"big\.pdf page 1: 742x960 pixels take 84 .* more than the 30"):
        proc.prepare([("big.pdf", _blank_pdf(3))], DocumentOptions(max_page_tokens=30))
    assert renders == ["fits.pdf page 1"]  # only the page of the document that fitted
    frames = [Image.new("RGB", (900, 900), (i, 0, 0)) for i in range(12)]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:])
    monkeypatch.setattr(P, "MAX_REQUEST_PIXELS", 5_000_000)  # 12 x 810,000 pixels is over it
    with pytest.raises(DocumentError, match=r"anim\.gif: the request's pages together take more than 5,000,000"):
        proc.prepare([("anim.gif", buf.getvalue())])
    renders.clear()
    doc = proc.prepare([("three.pdf", _blank_pdf(3, 300, 400))])
    assert renders == [f"three.pdf page {i}" for i in (1, 2, 3)]
    assert all(p.image is None and p.size == (720, 960) for p in doc.pages) and len(doc.views) == 3
    assert doc.page_tokens == [image_token_count(720, 960, proc.spec, crop=True)] * 3 == [84] * 3


def test_a_tiff_s_pages_of_different_sizes_are_read_before_decoding(tokenizer):
    """Each page of a multi-page TIFF has its own size (read from its header before any page is
    decoded); an EXIF-rotated image is counted upright."""
    from dash_trt.documents.pages import open_pages

    buf = io.BytesIO()
    page_image(300, 400).save(buf, "TIFF", save_all=True, append_images=[page_image(500, 200)])
    pages = open_pages([("scan.tif", buf.getvalue())])
    assert [(p.source, p.size) for p in pages] == [("scan.tif page 1", (300, 400)), ("scan.tif page 2", (500, 200))]
    assert [p.render().size for p in pages] == [(300, 400), (500, 200)]
    rotated = io.BytesIO()
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to view
    page_image(400, 300).save(rotated, "JPEG", exif=exif)
    (page,) = open_pages([("photo.jpg", rotated.getvalue())])
    assert page.size == (300, 400) == page.render().size


@pytest.mark.parametrize("fmt", ["ICO", "TGA", "PCX", "SGI", "PPM", "EPS"])
def test_only_the_documented_image_formats_are_read(fmt):
    """Issue 67 N8: Pillow reads many formats (EPS through Ghostscript); a page may be PNG, JPEG,
    TIFF, WebP, BMP or GIF only, anything else refused by name before Pillow parses it."""
    if fmt == "EPS":
        data = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n"
    else:
        buf = io.BytesIO()
        page_image(32, 32).save(buf, fmt)
        data = buf.getvalue()
    with pytest.raises(DocumentError, match=r"scan: not a supported image .* send PNG, JPEG, TIFF, WebP, BMP, GIF"):
        load_pages([("scan", data)])
    for ok in ("PNG", "JPEG", "TIFF", "WEBP", "BMP", "GIF"):
        buf = io.BytesIO()
        page_image(32, 32).save(buf, ok)
        assert load_pages([("scan", buf.getvalue())])[0].size == (32, 32), ok


@pytest.mark.parametrize("isolate", [True, False], ids=["worker", "in-process"])
def test_a_pdf_is_opened_once_and_its_pages_rendered_one_at_a_time(tokenizer, monkeypatch, isolate):
    """Issue 69 item 1: a long PDF is parsed once (PDFium re-read the whole cross-reference table
    for every page before, quadratic in the pages), and its pages are rendered one at a time as
    their views are taken: at no point is more than one page's bitmap, or more than one page's
    views, alive (CPython frees them as soon as they are dropped). Through the rendering worker
    (the default) the worker keeps the document open between the pages: the PDF's bytes go to it
    once, each page's message names the document's id; in process one PDFium document serves
    every page."""
    import gc
    import weakref

    from dash_trt.documents import pages as P
    from dash_trt.documents import render as R
    from dash_trt.documents.processor import DocumentProcessor

    opens, sent = [], []
    real_open, real_ask = P._open_pdf, R.Renderer._ask
    monkeypatch.setattr(P, "_open_pdf", lambda *a: opens.append(a[-1]) or real_open(*a))

    def ask(self, name, header, payload=b""):
        sent.append((header["op"], len(payload)))
        if header["op"] == "open":
            opens.append(name)
        return real_ask(self, name, header, payload)

    monkeypatch.setattr(R.Renderer, "_ask", ask)
    images = []
    real_page_views = __import__("dash_trt.documents.processor", fromlist=["x"]).page_views

    def watched(image, *a, **kw):
        images.append(weakref.ref(image))
        return real_page_views(image, *a, **kw)

    monkeypatch.setattr("dash_trt.documents.processor.page_views", watched)
    proc = DocumentProcessor(
        tokenizer,
        image_token_id=3,
        page_token_id=2,
        spec=ViewSpec(256, 160, max_crops=6),
        render_limits=R.RenderLimits(isolate=isolate),
    )
    doc = proc.plan([("long.pdf", _blank_pdf(30))])
    assert doc.views == [] and len(doc.pages) == 30 and opens == ["long.pdf"]
    views = []
    gc.disable()  # refcounts alone free them: no collection hides a page held by mistake
    try:
        for i, _key, v in doc.each_view():
            assert sum(r() is not None for r in images) == 0, f"a bitmap outlives its views (page {i + 1})"
            assert len(images) == i + 1
            # the generator lets go of a page's views before it renders the next
            assert sum(r() is not None for r in views) == 0, f"page {i}'s views are held"
            views.append(weakref.ref(v))
            del v
    finally:
        gc.enable()
    assert opens == ["long.pdf"] and len(doc.page_keys) == 30
    if isolate:  # the bytes once, then 30 renders that name the open document
        assert sent[0][0] == "open" and sent[0][1] > 0 and sent[1:] == [("render", 0)] * 30
        # the request ended with its last page: its documents closed, the worker given back warm
        assert doc.renderer.proc is None and doc.renderer._docs == {} and len(proc.render_workers._idle) == 1
    else:
        assert sent == []
    assert doc.sources[0].close() is None  # closed after the last page: closing again is harmless
    proc.close()


def test_a_planned_request_ends_with_its_documents_closed_and_the_worker_warm(tokenizer):
    """plan keeps the request's renderer (its PDF open in the worker) with the document;
    PreparedDocument.close ends the request: the worker goes back warm, holding no document, and
    the next request is rendered by the same process."""
    from dash_trt.documents.processor import DocumentProcessor

    with DocumentProcessor(tokenizer, image_token_id=3, page_token_id=2, spec=ViewSpec(256, 160, max_crops=6)) as proc:
        doc = proc.plan([("a.pdf", _blank_pdf(3))])
        pid = doc.renderer.proc.pid
        assert len(doc.renderer._docs) == 1
        doc.close()
        assert doc.renderer.proc is None and doc.renderer._docs == {}
        (worker,) = proc.render_workers._idle
        head, _ = worker.exchange(
            {"op": "close"}, b"", deadline=time.monotonic() + 30, clock=time.monotonic, cancelled=lambda: False
        )
        assert worker.pid == pid and head == {"ok": True, "open": 0, "bytes": 0}
        doc = proc.plan([("b.pdf", _blank_pdf(2))])
        assert doc.renderer.proc.pid == pid and len(list(doc.each_view())) == 2
        assert doc.renderer.proc is None
    assert worker.proc.poll() is not None and not proc.render_workers._idle


def test_the_worker_keeps_each_pdf_of_a_request_open_and_reopens_one_it_let_go(monkeypatch):
    """Several PDFs: each is opened (its bytes sent) once for counting and stays open in the
    worker for its pages; past the worker's MAX_OPEN documents the oldest is let go, and a page
    of it is answered "closed": the renderer sends the PDF again and renders the page."""
    from dash_trt.documents import render as R
    from dash_trt.documents import render_worker as W

    opened = []
    real_ask = R.Renderer._ask

    def ask(self, name, header, payload=b""):
        if header["op"] == "open":
            opened.append(name)
        return real_ask(self, name, header, payload)

    monkeypatch.setattr(R.Renderer, "_ask", ask)
    pdfs = [(f"d{i}.pdf", _blank_pdf(2)) for i in range(W.MAX_OPEN + 1)]
    with R.Renderer() as renderer:
        pages = open_pages(pdfs[:2], render_side=256, renderer=renderer)
        assert [p.render().size for p in pages] == [(198, 256)] * 4 and opened == ["d0.pdf", "d1.pdf"]
        assert renderer._docs == {}  # each closed in the worker after its last page
        opened.clear()
        pages = open_pages(pdfs, render_side=256, renderer=renderer)
        assert len(opened) == W.MAX_OPEN + 1
        assert pages[0].render().size == (198, 256)  # d0 was let go in the worker: sent again
        assert opened[-1] == "d0.pdf page 1" and len(opened) == W.MAX_OPEN + 2
        assert pages[-1].render().size == (198, 256)  # the last one still open there
        assert len(opened) == W.MAX_OPEN + 2


def test_a_page_over_its_budget_is_refused_alone(ocr, monkeypatch):
    """Issue 69 item 1: a page over the image budget is refused with its message, in its place in
    the per-page records (finish reason ``refused``), and left out of the prompt; the other pages
    are transcribed. Only when every page is refused does the document fail."""
    from dash_trt.documents import pages as P

    square, letter = page_image(500, 500, "square"), page_image(612, 792, "letter")
    data = pdf_bytes([square, letter, square])
    opts = DocumentOptions(max_page_tokens=70)  # letter: 2 x 3 tiles, 84 tokens; square: 2 x 2, 63
    doc = ocr.processor.plan([("mixed.pdf", data)], opts)
    assert doc.page_numbers == [1, 3] and doc.page_tokens == [63, 63] and len(doc.pages) == 2
    (r,) = doc.refused
    assert r.page == 2
    assert re.match(r"mixed\.pdf page 2: \d+x960 pixels take 84 image tokens .* more than the 70", r.message)
    result = ocr.transcribe([("mixed.pdf", data)], opts, max_new_tokens=12, rules={"max_page_tokens": 4})
    assert [p.page for p in result.pages] == [1, 2, 3]
    assert [p.finish_reason for p in result.pages][1] == "refused" and result.pages[1].error == r.message
    assert result.pages[1].text == "" and result.pages[0].tokens and result.pages[2].tokens
    assert result.pages[2].source == "mixed.pdf page 3"
    with pytest.raises(DocumentError, match=r"every page is refused: mixed\.pdf page 1: .* \(and 2 more\)"):
        ocr.processor.plan([("mixed.pdf", data)], DocumentOptions(max_page_tokens=30))
    monkeypatch.setattr(P, "MAX_PIXELS", 100_000)  # the pixel budget likewise, page by page
    small, big = png_bytes(page_image(200, 200)), png_bytes(page_image(400, 400))
    pages = P.open_pages([("a.png", small), ("b.png", big), ("c.png", small)], refuse_pages=True)
    assert [p.refused for p in pages][::2] == [None, None]
    assert pages[1].refused == "b.png: image of 400x400 pixels is larger than 100,000 pixels"
    with pytest.raises(DocumentError, match=r"^b\.png: image of 400x400 pixels is larger"):
        P.open_pages([("a.png", small), ("b.png", big)])  # without refuse_pages: the request
