"""Behaviours that a single-point bug could change with every other test still passing, pinned by
hand-derived values or by what vLLM 0.34.0's code defines: the MoE router (float32 logits, groups
with a greedy ``topk_method``, which layers are MoE), the page-count guard and the no-repeat
n-gram rule, the scheduler's decisions (where a preempted request goes back, the admission
watermark, a worst case of exactly the pool, ``prefill_chunk``, newly pinned cached blocks) and
the prefix hashes of a model without image tokens."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from dash_trt.documents.pages import DocumentError
from dash_trt.documents.prompt import document_prompt_ids
from dash_trt.documents.views import ViewSpec, check_page_tokens, image_token_count, page_views, tile_grid
from dash_trt.models import unlimited_ocr2 as U
from dash_trt.models.config import DashModelConfig
from dash_trt.models.deepencoder import assemble_page
from dash_trt.serving.block_pool import KVBlockPool, prefix_block_hashes
from dash_trt.serving.rules import DecodingRules, NoRepeatNGram, PageCountGuard, document_rules
from dash_trt.serving.scheduler import Scheduler


def moe_config(**change) -> U.MoEConfig:
    base = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)
    return U.MoEConfig(**{**base, **change})


# ------------------------------------------------------------------------------ MoE router
def test_moe_router_dtype_float32_routes_on_float32_logits():
    """vLLM's gate has out_dtype float32 with ``moe_router_dtype: "float32"``, else the model's
    dtype. In bfloat16 the logits 1 and 1 + 2^-10 round to the same value (a tie: the lower
    expert); in float32 expert 1 is the better one."""
    assert U.MoEConfig.from_config(DashModelConfig.from_dict(U.tiny_config())).router_float32 is False
    raw = U.tiny_config(overrides={"moe_router_dtype": "float32"})
    assert U.MoEConfig.from_config(DashModelConfig.from_dict(raw)).router_float32 is True
    x = torch.ones(1, 2, dtype=torch.bfloat16)
    picks = {}
    for f32 in (False, True):
        moe = U.MoE(2, moe_config(n_routed_experts=2, num_experts_per_tok=1, router_float32=f32)).to(torch.bfloat16)
        with torch.no_grad():
            moe.gate.weight.copy_(torch.tensor([[1.0, 0.0], [1.0, 2.0**-10]]))
        weights, ids = moe.route(x)
        picks[f32] = ids.item()
        if f32:  # softmax of (1, 1 + 2^-10) in float32: the weight of expert 1
            assert weights.item() == pytest.approx(1 / (1 + math.exp(-(2.0**-10))), abs=1e-7)
        else:
            assert weights.item() == 0.5
    assert picks == {False: 0, True: 1}


def test_a_greedy_router_with_groups_keeps_the_best_group_as_vllm_does():
    """vLLM 0.34.0 (deepseek_v2.py) builds the experts with use_grouped_topk=True and
    num_expert_group=n_group whatever topk_method says, so n_group > 1 limits a greedy router
    to the topk_group best groups. By hand: groups {0, 1} and {2, 3}; expert 0 (5) makes group 0
    the best; greedy without groups would take experts 0 and 2."""
    raw = U.tiny_config(
        experts=4, overrides={"topk_method": "greedy", "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2}
    )
    moe = U.MoEConfig.from_config(DashModelConfig.from_dict(raw))
    assert (moe.topk_method, moe.n_group, moe.topk_group) == ("greedy", 2, 1)
    logits = torch.log(torch.tensor([[5.0, 0.5, 4.0, 4.0]]))
    weights, ids = U.route_experts(logits, moe)
    assert ids.tolist() == [[0, 1]]
    assert torch.allclose(weights, torch.tensor([[5 / 13.5, 0.5 / 13.5]]))


@pytest.mark.parametrize(
    "first_k, freq, want",
    [(0, 1, [0, 1, 2, 3, 4, 5]), (1, 2, [2, 4]), (3, 2, [4]), (2, 3, [3]), (1, 1, [1, 2, 3, 4, 5])],
)
def test_moe_layers_are_from_first_k_dense_replace_every_moe_layer_freq(first_k, freq, want):
    """vLLM's DeepseekV2DecoderLayer: MoE where layer_idx >= first_k_dense_replace and
    layer_idx % moe_layer_freq == 0 (the index counted from 0, not from first_k_dense_replace)."""
    moe = moe_config(first_k_dense_replace=first_k, moe_layer_freq=freq)
    assert [i for i in range(6) if moe.is_moe_layer(i)] == want


def test_the_decoder_builds_moe_mlps_at_the_moe_layers():
    raw = U.tiny_config(5, hidden_size=32, heads=2, overrides={"first_k_dense_replace": 1, "moe_layer_freq": 2})
    cfg = DashModelConfig.from_dict(raw)
    moe = U.MoEConfig.from_config(cfg)
    assert (moe.first_k_dense_replace, moe.moe_layer_freq) == (1, 2)
    layers = [U.DecoderLayer(cfg, moe, i) for i in range(5)]
    assert [isinstance(layer.mlp, U.MoE) for layer in layers] == [False, False, True, False, True]


# ------------------------------------------------------------------------------ page guard
PAGE, EOS = 2, 1


def row(n=8, **values) -> torch.Tensor:
    x = torch.zeros(n)
    for k, v in values.items():
        x[int(k[1:])] = v
    return x


def test_the_page_length_counts_the_tokens_after_the_last_marker():
    """A page is the tokens since the last ``<PAGE>`` (vLLM: ``tail[::-1].index(page)``), counted
    over tails of several tokens and several markers as over single tokens."""
    g = PageCountGuard(PAGE, EOS, expected_pages=3, max_page_tokens=3)
    x = row()
    g([4, 2, 5, 2, 6, 7], x)  # two markers in one tail; the page after the last holds 2 tokens
    assert torch.isfinite(x[[0, 2, 3, 4, 5, 6, 7]]).all() and x[EOS] == -math.inf  # nothing forced
    x = row()
    g([4, 2, 5, 2, 6, 7, 3], x)  # the third token of that page: the cap, <PAGE> forced
    assert x[PAGE] == 0 and torch.isinf(x[[0, 1, 3, 4, 5, 6, 7]]).all()
    g2 = PageCountGuard(PAGE, EOS, expected_pages=3, max_page_tokens=3)
    for n in range(4):  # one token at a time: forced exactly when the page reaches 3 tokens
        x = row()
        g2([4, 2] + [5, 6, 7][:n], x)
        assert (x[PAGE] == 0 and bool(torch.isinf(x[[3, 4]]).all())) == (n == 3)


def test_the_page_guard_is_off_for_prompts_without_page_markers():
    """vLLM counts the prompt's ``<PAGE>`` markers; none (a single-page prompt) turns the guard
    off: EOS stays allowed and no page is capped."""
    rules = DecodingRules(page_guard=True, max_page_tokens=2)
    (guard,) = rules.processors([7, 3, 3, 5], PAGE, EOS)
    x = row(t1=5.0)
    guard([4, 4, 4, 4], x)
    assert x[EOS] == 5.0 and torch.isfinite(x).all()
    (guard,) = rules.processors([PAGE, 3, PAGE, 3, 5], PAGE, EOS)  # 2 pages: EOS masked before 2 markers
    x = row(t1=5.0)
    guard([4], x)
    assert x[EOS] == -math.inf
    x = row(t1=5.0)
    guard([4, 2, 4, 2], x)
    assert x[EOS] == 5.0


# ------------------------------------------------------------------------------ no-repeat n-grams
def test_no_repeat_ngram_matches_the_most_recent_tokens_and_the_last_ngram():
    r = NoRepeatNGram(3, window=0)
    assert r.banned([4, 1, 2, 1, 2]) == {1}  # the prefix is the last 2 tokens (1, 2); (1, 2, 1) seen
    assert r.banned([5, 5, 5]) == {5}  # the last complete n-gram counts too
    assert r.banned([1, 2, 3, 2, 1]) == set()  # (2, 1) never started an n-gram
    assert NoRepeatNGram(2, window=0).banned([3, 4, 3]) == {4}


def test_no_repeat_ngram_window_is_the_last_window_tokens():
    """DeepSeek-OCR's rule: n-grams starting at ``len - window`` or later."""
    seq = [1, 2, 3, 9, 9, 1, 2]
    assert NoRepeatNGram(3, window=7).banned(seq) == {3}  # the n-gram at 0 lies within the last 7
    assert NoRepeatNGram(3, window=6).banned(seq) == set()  # ... not within the last 6
    assert NoRepeatNGram(3, window=0).banned(seq) == {3}  # 0: all of them


def test_no_repeat_ngram_is_attached_when_on_and_none_overrides_keep_the_defaults():
    rules = document_rules(2, no_repeat_ngram=None, no_repeat_window=None, max_page_tokens=None, page_guard=None)
    assert (rules.page_guard, rules.no_repeat_ngram, rules.no_repeat_window) == (True, 35, 1024)
    assert rules.max_page_tokens == DecodingRules().max_page_tokens
    assert document_rules(1, no_repeat_ngram=None).no_repeat_window == 128
    procs = DecodingRules(no_repeat_ngram=3).processors([PAGE, 3], PAGE, EOS)
    assert [type(p) for p in procs] == [NoRepeatNGram]
    assert (procs[0].size, procs[0].window) == (3, 0)
    x = row()
    procs[0]([1, 2, 3, 1, 2], x)
    assert x[3] == -math.inf
    procs = document_rules(1).processors([PAGE, 3], PAGE, EOS)
    assert sorted(type(p).__name__ for p in procs) == ["NoRepeatNGram", "PageCountGuard"]
    (ngram,) = [p for p in procs if isinstance(p, NoRepeatNGram)]
    assert (ngram.size, ngram.window) == (35, 128)
    assert DecodingRules(no_repeat_ngram=0).processors([PAGE], PAGE, EOS) == []


# ------------------------------------------------------------------------------ scheduler
def _req(rid, prompt_len, max_new=4, hashes=None):
    return SimpleNamespace(
        id=rid,
        prompt=[5] * prompt_len,
        max_new_tokens=max_new,
        tokens=[],
        blocks_reserved=0,
        _hashes=hashes,
        _resume=None,
        _waited=False,
    )


def _scheduler(pool, on_demand=True, **kw):
    args = dict(num_blocks=pool.num_blocks, kv_block_size=pool.block_size, max_num_seqs=8)
    args.update(max_batch_tokens=1000, prefill_chunk=1000)
    args.update(kw)
    return Scheduler(pool, on_demand=on_demand, **args)


def _start(pool, sched):
    def start(req, cached):
        tokens = len(req.prompt) if sched.on_demand else len(req.prompt) + req.max_new_tokens - 1
        pool.add(req.id, len(req.prompt), reserve_tokens=tokens, cached_blocks=cached)

    return start


def test_a_preempted_request_goes_back_to_the_front_of_the_queue():
    pool = KVBlockPool(3, 4)
    sched = _scheduler(pool)
    a, b, c = _req("a", 4), _req("b", 4), _req("c", 8)
    for r in (a, b, c):
        sched.enqueue(r)
    assert sched.admit(_start(pool, sched)) == 2  # c (2 blocks + the watermark) waits
    assert [r.id for r in sched.waiting] == ["c"]
    assert pool.advance_within(["a", "b"], 4)  # both prompts written: each decode needs a block
    states = {r: SimpleNamespace(fed=4, prompt_len=4, pending=1) for r in ("a", "b")}
    preempted = []

    def preempt(req):
        preempted.append(req.id)
        pool.free(req.id)
        req._resume = object()

    plan = sched.plan(states.__getitem__, preempt)
    assert preempted == ["b"] and [(r.id, n) for r, n in plan] == [("a", 1)]
    assert [r.id for r in sched.waiting] == ["b", "c"]  # ahead of the one that never ran


def test_the_admission_watermark_is_one_block_on_a_small_pool_while_others_run():
    pool = KVBlockPool(10, 4)  # 1% of 10 blocks is 0: the watermark is still 1 block
    sched = _scheduler(pool)
    sched.enqueue(_req("a", 4))
    assert sched.admit(_start(pool, sched)) == 1
    big = _req("b", 36)  # 9 blocks: all that is free, none left for a's growth
    sched.enqueue(big)
    assert sched.admit(_start(pool, sched)) == 0 and big._waited
    sched.waiting.clear()
    sched.enqueue(_req("c", 32))  # 8 blocks and the watermark: fits
    assert sched.admit(_start(pool, sched)) == 1
    alone = KVBlockPool(10, 4)
    s2 = _scheduler(alone)
    s2.enqueue(_req("d", 40))  # nothing else runs: no watermark, the whole pool
    assert s2.admit(_start(alone, s2)) == 1


@pytest.mark.parametrize("max_new, admitted", [(5, 1), (6, 0)])
def test_a_worst_case_of_exactly_the_pool_is_admitted(max_new, admitted):
    pool = KVBlockPool(4, 4)
    sched = _scheduler(pool, on_demand=False)
    sched.enqueue(_req("a", 12, max_new=max_new))  # 12 + 5 - 1 = 16 tokens: the 4 blocks
    assert sched.admit(_start(pool, sched)) == admitted
    if admitted:
        assert sched.reserved == 4 and pool.num_free_blocks == 0


def test_a_prompt_is_fed_in_chunks_of_prefill_chunk():
    pool = KVBlockPool(8, 4)
    sched = _scheduler(pool, prefill_chunk=4, max_batch_tokens=100)
    a, b = _req("a", 10), _req("b", 3)
    sched.enqueue(a)
    sched.enqueue(b)
    sched.admit(_start(pool, sched))
    states = {
        "a": SimpleNamespace(fed=0, prompt_len=10, pending=10),
        "b": SimpleNamespace(fed=0, prompt_len=3, pending=3),
    }
    plan = sched.plan(states.__getitem__, lambda r: None)
    assert [(r.id, n) for r, n in plan] == [("a", 4), ("b", 3)]


def test_worst_case_admission_counts_the_cached_blocks_it_newly_pins():
    pool = KVBlockPool(4, 4)
    pool.add("x", reserve_tokens=4)
    pool.register("x", 0, b"h0")
    pool.free("x")  # block 0 cached, held by no sequence
    sched = _scheduler(pool, on_demand=False)
    sched.enqueue(_req("q", 4, max_new=9))  # 12 tokens: 3 blocks, the 3 never-registered ones
    assert sched.admit(_start(pool, sched)) == 1
    r = _req("r", 8, max_new=1, hashes=[b"h0"])  # 8 tokens: the cached block and 1 of its own
    sched.enqueue(r)
    # 3 reserved + 1 newly pinned + 1 own = 5 > 4 blocks: it waits
    assert sched.admit(_start(pool, sched)) == 0 and r._waited
    pool2 = KVBlockPool(5, 4)
    pool2.add("x", reserve_tokens=4)
    pool2.register("x", 0, b"h0")
    pool2.free("x")
    s2 = _scheduler(pool2, on_demand=False)
    s2.enqueue(_req("q", 4, max_new=9))
    s2.enqueue(_req("r", 8, max_new=1, hashes=[b"h0"]))
    assert s2.admit(_start(pool2, s2)) == 2  # 5 blocks: it fits
    assert pool2.num_pinned_blocks == 1 and not s2.check_invariants()


# ------------------------------------------------------------------------------ prefix hashes
def test_prefix_hashes_without_image_tokens_leave_the_last_prompt_token_to_compute():
    """Whole blocks, up to the prompt's second-to-last token: a prompt of exactly 2 blocks caches
    only the first (its last token is computed); one more token caches both."""
    assert len(prefix_block_hashes(list(range(8)), None, 4)) == 1
    assert len(prefix_block_hashes(list(range(9)), None, 4)) == 2
    assert len(prefix_block_hashes(list(range(4)), None, 4)) == 0
    a = prefix_block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], None, 4)
    b = prefix_block_hashes([1, 2, 3, 4, 5, 6, 7, 0, 9], None, 4)
    assert a[0] == b[0] and a[1] != b[1]  # the chain: a block's hash covers its tokens


# ------------------------------------------------------------------------------ documents
def test_a_page_that_fits_a_tile_on_one_side_only_is_still_tiled():
    """vLLM's processor keeps one view only when both sides are <= image_size."""
    spec = ViewSpec()  # 1024 global, 640 tiles: 16 x 17 + 1 = 273 tokens, tiles of 10 x 10
    assert tile_grid(640, 640, spec) == (1, 1)
    assert tile_grid(640, 1300, spec) == (1, 2)  # aspect 0.49: (1, 2) before the equal (2, 4)
    assert tile_grid(1300, 640, spec) == (2, 1)
    assert image_token_count(640, 1300, spec, crop=True) == 273 + (10 * 1 + 1) * (10 * 2)
    assert image_token_count(640, 640, spec, crop=True) == 273


def test_tiles_are_cut_and_assembled_row_by_row():
    from PIL import Image

    spec = ViewSpec(base_size=64, image_size=32, patch_size=16, downsample_ratio=2)
    im = Image.new("RGB", (64, 64))
    for k, color in enumerate([(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 255)]):
        im.paste(color, ((k % 2) * 32, (k // 2) * 32, (k % 2 + 1) * 32, (k // 2 + 1) * 32))
    views = page_views(im, spec, crop=True)
    assert views.grid == (2, 2)
    means = [tuple(round(float(c)) for c in crop.reshape(3, -1).mean(1)) for crop in views.crops]
    assert means == [(1, -1, -1), (-1, 1, -1), (-1, -1, 1), (1, 1, 1)]  # top left, top right, ...
    # vLLM's _assemble_patch_grid: view(rows, cols, q, q, d).permute(0, 2, 1, 3, 4), newline per row
    tiles = torch.arange(6.0).view(6, 1, 1)  # 3 x 2 tiles of q = 1: tile t is t
    out = assemble_page(torch.tensor([[100.0]]), tiles, (3, 2), torch.tensor([-1.0]), torch.tensor([-2.0]))
    assert out.view(-1).tolist() == [0, 1, 2, -1, 3, 4, 5, -1, 100, -1, -2]
    a, b = [10.0, 11.0, 12.0, 13.0], [20.0, 21.0, 22.0, 23.0]  # q = 2, 2 x 1 tiles
    out = assemble_page(
        torch.tensor([[100.0]]), torch.tensor([a, b]).view(2, 4, 1), (2, 1), torch.tensor([-1.0]), torch.tensor([-2.0])
    )
    assert out.view(-1).tolist() == [10, 11, 20, 21, -1, 12, 13, 22, 23, -1, 100, -1, -2]


def test_a_page_of_exactly_the_image_token_limit_is_accepted():
    n = image_token_count(640, 1300, ViewSpec(), crop=True)
    assert check_page_tokens(640, 1300, ViewSpec(max_page_tokens=n), crop=True) == n
    with pytest.raises(DocumentError, match=f"more than the {n - 1} a page may take"):
        check_page_tokens(640, 1300, ViewSpec(max_page_tokens=n - 1), crop=True)


@pytest.fixture(scope="module")
def tokenizer():
    from dash_trt.documents.tokenizer import TextTokenizer

    return TextTokenizer(U.tiny_tokenizer(), {"bos_token": U.TINY_SPECIAL_TOKENS[0]})


def test_one_page_gets_the_single_page_instruction(tokenizer):
    one = document_prompt_ids(tokenizer, [2], image_token_id=3, page_token_id=2)
    assert one == [0, 2, 3, 3] + tokenizer.encode("document parsing.")
    two = document_prompt_ids(tokenizer, [1, 1], image_token_id=3, page_token_id=2)
    assert two == [0, 2, 3, 2, 3] + tokenizer.encode("Multi page parsing.")


def test_a_document_chat_template_gets_the_generation_prompt(tokenizer):
    from dash_trt.documents.tokenizer import TextTokenizer

    template = "{% for m in messages %}U:{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
    tok = TextTokenizer(tokenizer.tokenizer, tokenizer.config, template)
    ids = document_prompt_ids(tok, [1], image_token_id=3, page_token_id=2, instruction="Go.")
    assert ids == tokenizer.encode("U:") + [2, 3] + tokenizer.encode("Go.\nA:")
