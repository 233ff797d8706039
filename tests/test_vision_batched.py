"""The vision tower batched over pages and views (``VisionTower.encode_pages``) and its attention
through ``scaled_dot_product_attention``, against the algorithm it replaced: SAM's and CLIP's
explicit softmax, one page at a time (its global view as a batch of one, then its tiles), in
float64. And the document pipeline's feature cache around the batched pass."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from dash_trt.documents.processor import PreparedDocument
from dash_trt.documents.views import ViewSpec, page_views
from dash_trt.models import deepencoder as D
from dash_trt.serving.documents import FeatureCache, page_features

pytestmark = pytest.mark.usefixtures("single_thread")

N_EMBED = 48
GLOBAL, TILE = 256, 160  # the tiny tower's view sizes (tiny_deepencoder)


# ------------------------------------------------------------------------------ the old algorithm
def explicit_sam_attention(attn: D.SamAttention, x, rel_h_table, rel_w_table):
    """SamAttention.forward before SDPA, verbatim: scores, the relative-position terms, softmax."""
    b, h, w, _ = x.shape
    qkv = attn.qkv(x).reshape(b, h * w, 3, attn.heads, -1).permute(2, 0, 3, 1, 4)
    q, k, v = qkv.unbind(0)
    scores = (q * attn.scale) @ k.transpose(-2, -1)
    rq = q.reshape(b, attn.heads, h, w, -1)
    rel_h = torch.einsum("bnhwc,hkc->bnhwk", rq, rel_h_table)
    rel_w = torch.einsum("bnhwc,wkc->bnhwk", rq, rel_w_table)
    scores = scores.view(b, attn.heads, h, w, h, w) + rel_h[..., :, None] + rel_w[..., None, :]
    scores = scores.view(b, attn.heads, h * w, h * w).softmax(-1)
    out = (scores @ v).view(b, attn.heads, h, w, -1).permute(0, 2, 3, 1, 4).reshape(b, h, w, -1)
    return attn.proj(out)


def explicit_clip_attention(attn: D.ClipAttention, x):
    """ClipAttention.forward before SDPA, verbatim."""
    b, n, c = x.shape
    q, k, v = attn.qkv_proj(x).chunk(3, dim=-1)
    q, k, v = (t.view(b, n, attn.heads, -1).transpose(1, 2) for t in (q, k, v))
    scores = (q * (c // attn.heads) ** -0.5) @ k.transpose(-2, -1)
    out = scores.softmax(-1) @ v
    return attn.out_proj(out.transpose(1, 2).reshape(b, n, c))


def reference_page(tower: D.VisionTower, page) -> torch.Tensor:
    """VisionTower.page_features before batching, verbatim: one page's global view, then its tiles."""
    g = tower.encode(torch.as_tensor(page.global_view).unsqueeze(0))[0]
    tiles = None
    if page.grid[0] * page.grid[1] > 1:
        tiles = tower.encode(torch.as_tensor(page.crops))
    return D.assemble_page(g, tiles, page.grid, tower.image_newline, tower.view_seperator)


# ------------------------------------------------------------------------------ fixtures
def random_tower(seed: int = 0) -> D.VisionTower:
    cfg = D.DeepEncoderConfig.from_config({"vision_config": {"deepencoder": D.tiny_deepencoder(N_EMBED)}})
    tower = D.VisionTower(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in tower.named_parameters():
            std = 0.5 if "rel_pos" in name else 0.15  # relative positions large enough to matter
            p.copy_(torch.randn(p.shape, generator=g) * std)
            if name.endswith("norm1.weight") or name.endswith("norm2.weight") or "layer_norm" in name:
                p.add_(1.0)
    return tower


def random_page(grid: tuple[int, int], seed: int) -> SimpleNamespace:
    g = torch.Generator().manual_seed(seed)
    n = grid[0] * grid[1]
    crops = torch.randn(n if n > 1 else 0, 3, TILE, TILE, generator=g)
    view = torch.randn(3, GLOBAL, GLOBAL, generator=g)
    return SimpleNamespace(global_view=view.numpy(), crops=crops.numpy(), grid=grid)


#: no tiles, 2 x 3 and 3 x 2 tiles, a second 2 x 3 page and a second page without tiles (pages
#: of one shape that batching could swap), 2 x 1
GRIDS = [(1, 1), (2, 3), (3, 2), (2, 3), (1, 1), (2, 1)]


@pytest.fixture(scope="module")
def tower():
    return random_tower()


@pytest.fixture(scope="module")
def pages():
    return [random_page(grid, seed=10 + i) for i, grid in enumerate(GRIDS)]


@pytest.fixture(scope="module")
def reference(tower, pages):
    """The old algorithm's features of ``pages``, in float64 (a float64 copy of the tower)."""
    mp = pytest.MonkeyPatch()
    mp.setattr(D.SamAttention, "forward", explicit_sam_attention)
    mp.setattr(D.ClipAttention, "forward", explicit_clip_attention)
    try:
        ref = D.VisionTower(tower.config).double().eval()
        ref.load_state_dict(tower.state_dict())
        with torch.no_grad():
            return [reference_page(ref, p) for p in pages]
    finally:
        mp.undo()


def tokens(grid: tuple[int, int]) -> int:
    cols, rows = grid
    n = 4 * 5 + 1  # the 256 global view: 4 x 4 features, a newline a row, the separator
    return n + ((3 * cols + 1) * (3 * rows) if cols * rows > 1 else 0)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max() / want.double().abs().max())


# ------------------------------------------------------------------------------ the tests
def test_batched_pages_equal_the_old_per_page_algorithm_in_float64(tower, pages, reference):
    got = tower.encode_pages(pages, max_batch=64)
    assert len(got) == len(pages)
    for g, want, p in zip(got, reference, pages):
        assert g.dtype == torch.float32 and g.shape == want.shape == (tokens(p.grid), N_EMBED)
        assert rel_err(g, want) < 1e-5
        torch.testing.assert_close(g.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    # the comparison could tell pages apart: each page's features are far from every other's of
    # its shape (a mix-up or a reordering would be off by about the features' size)
    for i in range(len(pages)):
        for j in range(len(pages)):
            if i != j and got[i].shape == got[j].shape:
                assert rel_err(got[i], reference[j]) > 0.05
    # a tile's features land in its place: the tiles' rows come first, row by row
    cols, rows = pages[1].grid
    tile_feats = reference_page_tiles(tower, pages[1])
    grid_rows = got[1][: 3 * rows * (3 * cols + 1)].view(3 * rows, 3 * cols + 1, N_EMBED)
    for r in range(rows):
        for c in range(cols):
            block = grid_rows[3 * r : 3 * r + 3, 3 * c : 3 * c + 3].reshape(9, N_EMBED)
            torch.testing.assert_close(block, tile_feats[r * cols + c], rtol=1e-5, atol=1e-5)


def reference_page_tiles(tower, page) -> torch.Tensor:
    with torch.no_grad():
        return tower.encode(torch.as_tensor(page.crops))


def test_small_batches_equal_one_batch(tower, pages, reference):
    one = tower.encode_pages(pages, max_batch=64)
    for max_batch in (1, 2, 5):
        got = tower.encode_pages(pages, max_batch=max_batch)
        for g, o, want in zip(got, one, reference):
            torch.testing.assert_close(g, o, rtol=1e-5, atol=1e-5 * float(o.abs().max()))
            assert rel_err(g, want) < 1e-5
    # one page through page_features is the batched path on that page
    for p, want in zip(pages[:3], reference):
        assert rel_err(tower.page_features(p.global_view, p.crops, p.grid), want) < 1e-5
    assert tower.encode_pages([]) == []


def test_pages_in_any_order_and_company_give_the_same_features(tower, pages):
    full = tower.encode_pages(pages, max_batch=3)
    order = [4, 2, 0, 5, 3, 1]
    shuffled = tower.encode_pages([pages[i] for i in order], max_batch=3)
    for k, i in enumerate(order):
        torch.testing.assert_close(shuffled[k], full[i], rtol=1e-5, atol=1e-5 * float(full[i].abs().max()))


def test_encode_pages_refuses_bad_input(tower, pages):
    with pytest.raises(ValueError, match="max_batch must be at least 1"):
        tower.encode_pages(pages, max_batch=0)
    bad = SimpleNamespace(global_view=pages[1].global_view, crops=pages[1].crops[:5], grid=(2, 3))
    with pytest.raises(ValueError, match="a page of 2 x 3 tiles has 5 crops"):
        tower.encode_pages([pages[0], bad])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sdpa_attention_equals_the_explicit_formula(dtype):
    torch.manual_seed(3)
    sam = D.SamAttention(32, 4, size=6).to(dtype)
    clip = D.ClipAttention(32, 4).to(dtype)
    for p in (*sam.parameters(), *clip.parameters()):
        torch.nn.init.normal_(p, std=0.4)
    tol = {torch.float32: 1e-5, torch.float64: 1e-12}[dtype]
    errs = []
    with torch.no_grad():
        for h, w in ((6, 6), (5, 3), (1, 4)):  # square, and H != W (the two tables' roles apart)
            rel = D.rel_table(sam.rel_pos_h, h), D.rel_table(sam.rel_pos_w, w)
            x = torch.randn(3, h, w, 32, dtype=dtype)
            got, want = sam(x, *rel), explicit_sam_attention(sam, x, *rel)
            errs.append(rel_err(got, want))
            torch.testing.assert_close(got, want, rtol=tol, atol=tol * float(want.abs().max()))
        x = torch.randn(2, 17, 32, dtype=dtype)
        got, want = clip(x), explicit_clip_attention(clip, x)
        errs.append(rel_err(got, want))
        torch.testing.assert_close(got, want, rtol=tol, atol=tol * float(want.abs().max()))
    assert max(errs) < tol
    # the relative-position terms matter here: without them the result is far off
    with torch.no_grad():
        zero = D.rel_table(torch.zeros_like(sam.rel_pos_h), 6)
        x = torch.randn(1, 6, 6, 32, dtype=dtype)
        rel = D.rel_table(sam.rel_pos_h, 6), D.rel_table(sam.rel_pos_w, 6)
        assert rel_err(sam(x, zero, zero), sam(x, *rel)) > 0.01


# ------------------------------------------------------------------------------ the pipeline's cache
def loop_page_features(tower, doc, cache=None) -> torch.Tensor:
    """serving.documents.page_features before batching, verbatim: page by page."""
    parts = []
    for v, key in zip(doc.views, doc.page_keys):
        f = cache.get(key) if cache is not None else None
        if f is None:
            f = reference_page(tower, v).float().cpu()
            assert f.shape[0] == v.num_tokens
            if cache is not None:
                cache.put(key, f)
        parts.append(f)
    return torch.cat(parts)


def noise_image(w: int, h: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def document(keys: list[str]) -> PreparedDocument:
    """Pages named by ``keys`` (a key repeated: the same page again): A 2 x 3 tiles, B 3 x 2, C none."""
    spec = ViewSpec(base_size=GLOBAL, image_size=TILE, max_crops=6)
    images = {"A": noise_image(300, 500, 1), "B": noise_image(500, 300, 2), "C": noise_image(120, 100, 3)}
    views = [page_views(images[k], spec, crop=True) for k in keys]
    assert all(v.grid == {"A": (2, 3), "B": (3, 2), "C": (1, 1)}[k] for k, v in zip(keys, views))
    return PreparedDocument([], views, [], [v.num_tokens for v in views], True, list(keys))


def test_document_features_with_a_cache_count_and_equal_the_loop(tower, monkeypatch):
    keys = ["A", "B", "A", "C", "B"]
    doc = document(keys)
    uncached = page_features(tower, doc)
    assert uncached.dtype == torch.float32 and uncached.device.type == "cpu"
    assert uncached.shape == (sum(v.num_tokens for v in doc.views), N_EMBED)
    with torch.no_grad():
        loop_cache = FeatureCache()
        want = loop_page_features(tower, doc, loop_cache)
    assert rel_err(uncached, want) < 1e-5

    cache = FeatureCache()
    first = page_features(tower, doc, cache)
    assert torch.equal(first, uncached)
    assert (cache.hits, cache.misses) == (loop_cache.hits, loop_cache.misses) == (2, 3)
    assert list(cache._items) == list(loop_cache._items) == ["A", "C", "B"]  # the loop's LRU order
    again = page_features(tower, doc, cache)
    assert torch.equal(again, uncached) and (cache.hits, cache.misses) == (7, 3)

    # a document with one page cached and one not: the cached one is not encoded again
    cache2 = FeatureCache()
    page_features(tower, document(["C"]), cache2)
    calls = []
    encode_pages = tower.encode_pages

    def counting(pages, **kw):
        calls.append(len(pages))
        return encode_pages(pages, **kw)

    monkeypatch.setattr(tower, "encode_pages", counting)
    mixed = page_features(tower, document(["C", "A", "C"]), cache2)
    monkeypatch.undo()
    assert calls == [1] and (cache2.hits, cache2.misses) == (2, 2)
    assert rel_err(mixed, page_features(tower, document(["C", "A", "C"]))) < 1e-5  # batched apart: not bit for bit


def test_document_features_check_the_token_count(tower):
    doc = document(["A", "C"])
    doc.views[1].num_tokens += 1
    with pytest.raises(RuntimeError, match="the vision tower gave 21 features for 22 image tokens"):
        page_features(tower, doc)


@pytest.mark.gpu
def test_bf16_on_the_gpu_is_close_to_float64(pages, reference):
    tower = random_tower().to("cuda", torch.bfloat16)
    got = tower.encode_pages(pages, max_batch=4)
    for g, want in zip(got, reference):
        assert g.device.type == "cuda" and g.dtype == torch.bfloat16
        assert rel_err(g.float().cpu(), want) < 0.05
    fp32 = random_tower().to("cuda")
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # cuDNN's default is TF32
    try:
        got = fp32.encode_pages(pages, max_batch=4)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    for g, want in zip(got, reference):
        assert rel_err(g.cpu(), want) < 1e-5
