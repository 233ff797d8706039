"""docs/spec.md properties 1-5 and 7 on the PyTorch reference, plus hand-checked cases."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import DTYPES, SEEDS

from dash_trt.attention.dash import reference as R
from dash_trt.attention.dash.config import DashConfig, DashConfigError
from dash_trt.testing import TOLERANCES, compare_outputs, random_config, random_inputs, random_roles


def _run(x, cfg, layer=0, nq=None, prompt_length=None, **kw):
    nq = x.length if nq is None else nq
    return R.dash_attention(x.q[-nq:], x.k, x.v, x.iq[-nq:], x.ik, x.roles, x.head_cls, cfg, layer, prompt_length, **kw)


def _rope_all(x, cfg):
    tok, page, _, _ = R.page_coordinates(x.roles)
    return R.page_rope(x.q, tok, page, cfg, main=True), R.page_rope(x.k, tok, page, cfg, main=True)


# ----------------------------------------------------------------- coordinates
def test_page_coordinates_hand_example():
    # text <PAGE> img img text <PAGE> img | text text <PAGE> text  (prompt ends at the last image)
    roles = torch.tensor([0, 2, 1, 1, 0, 2, 1, 0, 0, 2, 0])
    tok, page, image_page, query_page = R.page_coordinates(roles)
    assert tok.tolist() == [0, 0, 1, 2, 3, 0, 1, 1, 2, 4, 5]
    assert page.tolist() == [0, 1, 1, 1, 1, 2, 2, 0, 0, 1, 1]
    assert image_page.tolist() == [-1, -1, 0, 0, -1, -1, 1, -1, -1, -1, -1]
    assert query_page.tolist() == [-1, 0, 0, 0, 0, 1, 1, -1, -1, 0, 0]


def test_page_coordinates_response_markers_past_last_page():
    # One page; the response has more <PAGE> markers than the prompt had pages.
    roles = torch.tensor([2, 1, 0, 2, 0, 2, 0])
    tok, page, image_page, query_page = R.page_coordinates(roles)
    assert tok.tolist() == [0, 1, 0, 2, 3, 2, 3]
    assert page.tolist() == [1, 1, 0, 1, 1, 1, 1]
    assert image_page.tolist() == [-1, 0, -1, -1, -1, -1, -1]
    assert query_page.tolist() == [0, 0, -1, 0, 0, 1, 1]


@pytest.mark.parametrize(
    "roles, match",
    [
        ([0, 0, 2, 0], "no image token"),
        ([0, 1, 1, 2, 0], "no <PAGE> marker before"),
        ([], "no image token"),
        ([0, 3, 1], "must be 0 \\(text\\), 1 \\(image\\) or 2"),
        ([0, 1, 2, 1, 1], "image token at position 1 comes before the first <PAGE> marker"),
    ],
)
def test_page_coordinates_rejects_prompts_without_pages(roles, match):
    with pytest.raises(ValueError, match=match):
        R.page_coordinates(torch.tensor(roles, dtype=torch.long))


def test_prompt_page_positions_hand_example():
    sp = {
        "sparse_block_size": 4,
        "sparse_local_block": 1,
        "sparse_index_dim": 8,
        "image_token_id": 7,
        "page_token_id": 9,
    }
    ids = [3, 9, 7, 7, 3, 9, 7, 3, 3, 9, 3]  # same roles as the hand example above
    rows = R.prompt_page_positions(ids, sp)
    assert rows.shape == (4, len(ids))
    assert rows[0].tolist() == [0, 0, 1, 2, 3, 0, 1, 1, 2, 4, 5]
    assert rows[1].tolist() == [0, 1, 1, 1, 1, 2, 2, 0, 0, 1, 1]  # query_page + 1
    assert rows[2].tolist() == [2] * len(ids)  # highest page coordinate
    # prompt tokens per page: page 0 -> 1, page 1 -> 4, page 2 -> 2
    assert rows[3].tolist() == [-2, -5, -5, -5, -5, -3, -3, -2, -2, -5, -5]


def test_prompt_page_positions_needs_token_ids():
    with pytest.raises(ValueError, match="image_token_id and page_token_id"):
        R.prompt_page_positions([1, 2], {"sparse_block_size": 4, "sparse_local_block": 1, "sparse_index_dim": 8})


def test_page_rope_matches_closed_form():
    """Pair i of a vector rotates by tok * theta**(-i/ntok) (token pairs) or by
    page * page_theta**(-j/pairs) (the last `pairs` pairs)."""
    cfg = DashConfig.from_dict(
        {
            "sparse_block_size": 4,
            "sparse_local_block": 1,
            "sparse_index_dim": 12,
            "sparse_rope_page_pairs": 2,
            "sparse_rope_page_theta": 16.0,
        }
    )
    dim = 12
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, dim, generator=gen, dtype=torch.float64).float()
    tok, page = torch.tensor([0, 5, 11]), torch.tensor([0, 1, 3])
    out = R.page_rope(x, tok, page, cfg, main=True)
    half, ntok = dim // 2, dim // 2 - 2
    for r in range(3):
        for i in range(half):
            if i < ntok:
                ang = tok[r].item() * 10000.0 ** (-i / ntok)
            else:
                ang = page[r].item() * 16.0 ** (-(i - ntok) / 2)
            a, b = x[r, i].item(), x[r, i + half].item()
            assert out[r, i].item() == pytest.approx(a * math.cos(ang) - b * math.sin(ang), abs=1e-5)
            assert out[r, i + half].item() == pytest.approx(b * math.cos(ang) + a * math.sin(ang), abs=1e-5)
    # truncate: token exponents divide by dim/2 instead of ntok
    cfg_t = DashConfig.from_dict({**cfg.to_dict(), "sparse_main_rope_tok_freq_mode": "truncate"})
    out_t = R.page_rope(x, tok, page, cfg_t, main=True)
    ang = tok[2].item() * 10000.0 ** (-1 / half)
    a, b = x[2, 1].item(), x[2, 1 + half].item()
    assert out_t[2, 1].item() == pytest.approx(a * math.cos(ang) - b * math.sin(ang), abs=1e-5)
    # the indexer mode is separate
    assert torch.equal(R.page_rope(x, tok, page, cfg_t, main=False), R.page_rope(x, tok, page, cfg, main=False))


# ----------------------------------------------------------------- properties
@pytest.mark.parametrize("seed", SEEDS)
def test_chunking_never_changes_output(seed):
    """Property 1 (docs/spec.md): any dash_query_chunk gives the same output."""
    gen = torch.Generator().manual_seed(seed)
    cfg = random_config(gen, dash_query_chunk=2048)
    x = random_inputs(gen, random_roles(gen, 4, response=12, response_markers=2))
    want, want_r = _run(x, cfg, return_routing=True)
    for chunk in (1, 3, 17):
        cfg_c = DashConfig.from_dict({**cfg.to_dict(), "dash_query_chunk": chunk})
        got, got_r = _run(x, cfg_c, return_routing=True)
        assert torch.equal(got_r.selected, want_r.selected)
        # A chunk's scores are one matrix product, whose rounding may depend on its rows; the
        # routing scale and the log prior amplify a 1-ulp score difference to ~1e-6 in the
        # output, so "never changes" holds to float32's tolerance, not bit for bit.
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("nq", [1, 7, None])
def test_query_suffix_equals_tail_of_full_run(seed, nq):
    """The queries are the last Q positions: a suffix run equals the tail of a full run."""
    gen = torch.Generator().manual_seed(seed)
    cfg = random_config(gen)
    x = random_inputs(gen, random_roles(gen, 3, response=9, response_markers=1))
    full = _run(x, cfg)
    n = x.length if nq is None else nq
    torch.testing.assert_close(_run(x, cfg, nq=n), full[-n:], atol=1e-6, rtol=1e-6)


def _causal_with_page_rope(x, cfg, heads, kv_heads, window=None):
    """Causal attention (float64) over the page-RoPE'd q and k; ``window``: only the last
    ``window`` positions up to each query."""
    q, k = _rope_all(x, cfg)
    g = heads // kv_heads
    s = x.length
    pos = torch.arange(s)
    mask = pos[None] <= pos[:, None]
    if window is not None:
        mask &= pos[None] > pos[:, None] - window
    return F.scaled_dot_product_attention(
        q.transpose(0, 1).double(),
        k.repeat_interleave(g, 1).transpose(0, 1).double(),
        x.v.repeat_interleave(g, 1).transpose(0, 1).double(),
        attn_mask=mask,
    ).transpose(0, 1)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (6, 3), (4, 1)])
def test_every_block_kept_with_equal_priors_is_causal_attention(seed, heads, kv_heads):
    """Property 2 (docs/spec.md): a one-page document of at most 16 blocks, K = 16 and routing
    scale 0 (every routing value 0, so entmax gives the candidates equal priors and the bias is
    0): every query reads every remote block (its page's image blocks are all the prompt's
    blocks; the response has no marker, so it falls back to every remote block), which is
    causal attention over the whole prefix."""
    gen = torch.Generator().manual_seed(seed)
    cfg = random_config(
        gen,
        sparse_block_size=4,
        sparse_local_block=1,
        dash_topk_blocks=16,
        dash_scaling_factor=0.0,
        sparse_attention_freq=[1, 1, 1],
        dash_scale_per_layer=None,
        dash_floor_per_layer=None,
    )
    roles = torch.tensor([R.ROLE_PAGE] + [R.ROLE_IMAGE] * 39 + [R.ROLE_TEXT] * 20)
    x = random_inputs(gen, roles, heads=heads, kv_heads=kv_heads)
    got, routing = _run(x, cfg, layer=2, return_routing=True)
    assert bool((routing.bias.abs() < 1e-6).all())
    torch.testing.assert_close(got.double(), _causal_with_page_rope(x, cfg, heads, kv_heads), atol=2e-5, rtol=2e-5)
    # and a layer keeping one block really is different (the check can fail)
    sparse = _run(
        x, DashConfig.from_dict({**cfg.to_dict(), "dash_topk_blocks": 1, "dash_scaling_factor": 128.0}), layer=0
    )
    assert (sparse.double() - _causal_with_page_rope(x, cfg, heads, kv_heads)).abs().max() > 1e-3


@pytest.mark.parametrize("seed", SEEDS)
def test_gqa_reads_kv_head_h_div_group(seed):
    """Property 3 (docs/spec.md): with Hkv < H, head h reads KV head h // (H // Hkv): same as repeating KV heads."""
    gen = torch.Generator().manual_seed(seed)
    cfg = random_config(gen)
    x = random_inputs(gen, random_roles(gen, 3, response=8), heads=6, kv_heads=2)
    got = _run(x, cfg)
    x.k, x.v = x.k.repeat_interleave(3, 1), x.v.repeat_interleave(3, 1)
    torch.testing.assert_close(got, _run(x, cfg), atol=1e-6, rtol=1e-6)
    # swapping the two KV heads changes heads 0-2 and 3-5 (not a no-op)
    x2 = random_inputs(torch.Generator().manual_seed(seed), x.roles, heads=6, kv_heads=2)
    a = _run(x2, cfg)
    x2.k, x2.v = x2.k.flip(1), x2.v.flip(1)
    b = _run(x2, cfg)
    assert (a - b).abs().amax(dim=(0, 2)).min() > 1e-3


@pytest.mark.parametrize("seed", SEEDS)
def test_prompt_length_limits_remote_reads_and_summaries(seed):
    """Property 4 (docs/spec.md): tokens past prompt_length are read only through the local window."""
    gen = torch.Generator().manual_seed(seed)
    cfg = random_config(gen, sparse_block_size=4, sparse_local_block=1, dash_topk_blocks=16)
    # No response marker: the last query's page is -1, so it competes over every remote block
    # (a query on a page reads only that page's image blocks, never generated ones).
    x = random_inputs(gen, random_roles(gen, 3, response=40, response_markers=0))
    s, local = x.length, cfg.local_window
    prompt = s - 40 + 3  # mid-block, inside the response
    base = _run(x, cfg, prompt_length=prompt, nq=1)
    # Perturb every generated token outside the last query's local window.
    y = random_inputs(torch.Generator().manual_seed(seed + 100), x.roles)
    lo, hi = prompt, s - local
    for name in ("k", "v", "ik"):
        t = getattr(x, name).clone()
        t[lo:hi] = getattr(y, name)[lo:hi]
        setattr(y, name, t)
    y.q, y.iq, y.head_cls = x.q, x.iq, x.head_cls
    torch.testing.assert_close(_run(y, cfg, prompt_length=prompt, nq=1), base, atol=0, rtol=0)
    # Without prompt_length those tokens are read (so the check above can fail) ...
    assert (_run(y, cfg, nq=1) - _run(x, cfg, nq=1)).abs().max() > 1e-3
    # ... and the local window still covers generated tokens.
    z_k = x.k.clone()
    z_k[s - 1] += 1.0
    z = random_inputs(gen, x.roles)
    z.q, z.k, z.v, z.iq, z.ik, z.head_cls = x.q, z_k, x.v, x.iq, x.ik, x.head_cls
    assert (_run(z, cfg, prompt_length=prompt, nq=1) - base).abs().max() > 1e-4
    # prompt_length=0 leaves only the local window: causal attention over the window
    only_local = _run(x, cfg, prompt_length=0)
    window = _causal_with_page_rope(x, cfg, x.q.shape[1], x.k.shape[1], window=local)
    torch.testing.assert_close(only_local.double(), window, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("seed", SEEDS)
def test_dtypes_output_dtype_and_fp32_softmax(dtype, seed):
    """Property 5 (docs/spec.md): output dtype is q's; low precision stays within tolerance of fp32.
    (float32 against itself would compare the reference with itself: its independent check is
    tests/test_oracle.py.)"""
    gen = torch.Generator().manual_seed(seed)
    # A small routing scale: the prior's log amplifies the indexer's rounding in q's dtype
    # (scores off by ~1e-3 in fp16 move a bias by ~0.1 at the default scale), which is the
    # model's own sensitivity, not an error; docs/spec.md "Comparing".
    cfg = random_config(
        gen, dash_scaling_factor=0.5, dash_scale_per_layer=None, dash_floor_per_layer=None, sparse_attention_freq=None
    )
    x32 = random_inputs(gen, random_roles(gen, 3, response=6))
    x = random_inputs(torch.Generator().manual_seed(seed), x32.roles)
    for name in ("q", "k", "v", "iq", "ik", "head_cls"):
        setattr(x, name, getattr(x32, name).to(dtype))
    got, got_r = _run(x, cfg, return_routing=True)
    assert got.dtype == dtype
    # the fp32 reference on the same (rounded) values
    for name in ("q", "k", "v", "iq", "ik", "head_cls"):
        setattr(x32, name, getattr(x, name).float())
    want, want_r = _run(x32, cfg, return_routing=True)
    report = compare_outputs(got, want, got_r, want_r, dtype=dtype)
    assert report.ok, str(report)


def test_backend_other_than_reference_is_refused():
    gen = torch.Generator().manual_seed(0)
    x = random_inputs(gen, random_roles(gen, 1))
    with pytest.raises(ValueError, match="TRITON_ATTN"):
        _run(x, random_config(gen), backend="FLASH_ATTN")


# ----------------------------------------------------------------- bad input (docs/spec.md property 7)
def _good(gen=None):
    gen = gen or torch.Generator().manual_seed(0)
    cfg = random_config(gen)
    return cfg, random_inputs(gen, random_roles(gen, 2))


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda x: setattr(x, "roles", torch.zeros_like(x.roles)), "no image token"),
        (lambda x: setattr(x, "k", x.k[:-1]), "v must have shape"),
        (lambda x: setattr(x, "v", x.v[:, :, :-2]), "v must have shape"),
        (lambda x: setattr(x, "ik", x.ik[:, :-2]), "iq must have shape"),
        (lambda x: setattr(x, "roles", x.roles[:-1]), "roles must have shape"),
        (lambda x: setattr(x, "head_cls", x.head_cls[:-1]), "head_cls must have shape"),
        (
            lambda x: (
                (setattr(x, "k", x.k[:, :3].contiguous()), setattr(x, "v", x.v[:, :3].contiguous()))
                if x.k.shape[1] > 3
                else (setattr(x, "k", torch.cat([x.k] * 3, 1)[:, :3]), setattr(x, "v", torch.cat([x.v] * 3, 1)[:, :3]))
            ),
            "multiple of KV heads",
        ),
        (lambda x: setattr(x, "k", x.k.half()), "k must have dtype"),
    ],
)
def test_bad_inputs_raise_clear_errors(mutate, match):
    cfg, x = _good()
    mutate(x)
    with pytest.raises(ValueError, match=match):
        _run(x, cfg)


@pytest.mark.parametrize("dim_name", ["D", "Di"])
def test_head_dim_too_small_for_page_pairs(dim_name):
    gen = torch.Generator().manual_seed(0)
    cfg = random_config(gen, sparse_rope_page_pairs=4, index_dim=16 if dim_name == "D" else 8)
    kw = {"head_dim": 8} if dim_name == "D" else {"index_dim": 8}
    x = random_inputs(gen, random_roles(gen, 2), **kw)
    with pytest.raises(DashConfigError, match=f"{dim_name} 8 is too small"):
        _run(x, cfg)


def test_indexer_width_must_be_the_configs_index_dim():
    gen = torch.Generator().manual_seed(0)
    cfg = random_config(gen, index_dim=32)
    x = random_inputs(gen, random_roles(gen, 2), index_dim=16)
    with pytest.raises(DashConfigError, match="indexer dim Di is 16, the config's sparse_index_dim is 32"):
        _run(x, cfg)


def test_layer_that_is_not_a_dash_layer_is_refused():
    gen = torch.Generator().manual_seed(0)
    cfg = random_config(gen, sparse_attention_freq=[1, 0], dash_scale_per_layer=None, dash_floor_per_layer=None)
    x = random_inputs(gen, random_roles(gen, 2))
    with pytest.raises(DashConfigError, match="layer 1 is not a DASH layer"):
        _run(x, cfg, layer=1)
    with pytest.raises(DashConfigError, match="no entry for layer 2"):
        _run(x, cfg, layer=2)


def test_too_many_queries_and_bad_prompt_length():
    cfg, x = _good()
    with pytest.raises(ValueError, match="queries"):
        R.dash_attention(torch.cat([x.q, x.q]), x.k, x.v, torch.cat([x.iq, x.iq]), x.ik, x.roles, x.head_cls, cfg, 0)
    with pytest.raises(ValueError, match="prompt_length"):
        _run(x, cfg, prompt_length=-3)


def test_low_precision_tolerances_are_declared_for_every_dtype():
    assert set(TOLERANCES) == set(DTYPES)


def test_compare_outputs_refuses_a_corrupted_selection_of_a_real_problem():
    """The comparison rule on a real routing (random problem, the reference's own scores): the
    reference's selection passes against itself; one token's block replaced by an id past the
    last block, another's by a negative id, are two routing mismatches, not near ties, even with
    the outputs equal."""
    gen = torch.Generator().manual_seed(4)
    cfg = DashConfig.from_dict(
        {
            "sparse_block_size": 4,
            "sparse_local_block": 1,
            "sparse_index_dim": 16,
            "dash_topk_blocks": 2,
            "sparse_rope_page_pairs": 1,
        }
    )
    x = random_inputs(gen, random_roles(gen, 4, response=6))
    out, routing = _run(x, cfg, return_routing=True)
    assert compare_outputs(out, out.clone(), routing, routing).ok
    sel = routing.selected.clone()
    rows = [i for i in range(sel.shape[0]) if (sel[i] >= 0).sum() == 2]
    assert len(rows) >= 2
    sel[rows[0], 1] = routing.values.shape[1]
    sel[rows[1], 1] = -5
    report = compare_outputs(out, out.clone(), R.Routing(sel), routing)
    assert not report.ok and report.routing_mismatch == 2 and report.near_ties == 0, str(report)
