"""Document prefix caching: completed document blocks shared between requests through the KV
pool (reference-counted, kept after their sequence, evicted least recently used), and the
engine prefilling only what is not cached, with the tokens of a run without the cache."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from dash_trt import model as M
from dash_trt.serving.block_pool import CacheFullError, KVBlockPool, prefix_block_hashes
from dash_trt.serving.engine import EngineConfig, GenerationEngine


# ----------------------------------------------------------------------------- the pool
def _check_invariants(pool: KVBlockPool, held: dict) -> None:
    """Every block is exactly one of: free, cached and unheld (LRU), held by sequences."""
    in_rows = {b for sid in held for b in pool.blocks(sid)}
    free, lru = set(pool._free), set(pool._lru)
    assert not (free & lru) and not (free & in_rows) and not (lru & in_rows)
    assert len(free) + len(lru) + len(in_rows) == pool.num_blocks
    refs = {}
    for sid in held:
        for b in pool.blocks(sid):
            refs[b] = refs.get(b, 0) + 1
    assert all(pool._ref[b] == n for b, n in refs.items()) and all(pool._ref[b] == 0 for b in free | lru)
    owned = {b for sid in held for j, b in enumerate(pool.blocks(sid)) if j >= pool._shared[sid]}
    assert pool.num_pinned_blocks == len(in_rows - owned)
    assert lru <= set(pool._hash_of)


def test_a_registered_block_is_shared_kept_and_evicted_last_used_first():
    pool = KVBlockPool(6, 4)
    pool.add("a", reserve_tokens=12)  # blocks 0 1 2
    for i, h in enumerate([b"h0", b"h1"]):
        assert pool.register("a", i, h)
    assert not pool.register("a", 2, b"h0")  # that hash has its block
    pool.add("b", reserve_tokens=12, cached_blocks=pool.match([b"h0", b"h1", b"h2"]))
    assert pool.blocks("b")[:2] == [0, 1] and pool.length("b") == 8 and pool.num_free_blocks == 2
    pool.free("a")
    assert pool.num_pinned_blocks == 2  # held by b only through the cache
    _check_invariants(pool, {"b": 1})
    pool.free("b")
    assert pool.num_pinned_blocks == 0 and pool.num_free_blocks == 6 and pool.num_cached_blocks == 2
    assert pool.match([b"h0", b"h1"]) == [0, 1]
    pool.match([b"h0"])  # h0 used last: h1's block goes first
    pool.add("c", reserve_tokens=20)  # 5 blocks: 4 never registered, then the LRU one
    assert 1 in pool.blocks("c") and pool.match([b"h0", b"h1"]) == [0]
    with pytest.raises(CacheFullError):
        pool.add("d", reserve_tokens=8)
    _check_invariants(pool, {"c": 1})


def test_random_pool_operations_keep_every_block_accounted_for():
    rng = random.Random(7)
    pool = KVBlockPool(40, 4)
    held: dict = {}
    hashes = [bytes([i]) for i in range(30)]
    for step in range(3000):
        op = rng.random()
        if op < 0.45 and len(held) < 12:
            sid = step
            prefix = pool.match(hashes[: rng.randrange(0, 8)])
            want = rng.randrange(len(prefix), len(prefix) + 6) * 4
            try:
                pool.add(sid, reserve_tokens=want, cached_blocks=prefix)
            except CacheFullError:
                continue
            held[sid] = 1
            for i in range(len(prefix), min(pool.num_seq_blocks(sid), 8)):
                if rng.random() < 0.7:
                    pool.register(sid, i, hashes[i])
        elif held:
            sid = rng.choice(list(held))
            pool.free(sid)
            del held[sid]
        if step % 50 == 0:
            _check_invariants(pool, held)
    for sid in list(held):
        pool.free(sid)
    assert pool.num_free_blocks == pool.num_blocks and pool.num_pinned_blocks == 0


# ------------------------------------------------------------------------ the hashes
def test_hashes_cover_whole_blocks_up_to_the_last_image_token():
    cfg = M.demo_model().config
    doc = M.document_prompt([20, 20], "", cfg)  # 42 tokens, the last image at 41
    bs = 8
    h = prefix_block_hashes(doc + list(b"What is the total?"), cfg.image_token_id, bs)
    assert len(h) == 42 // bs  # 5 whole blocks end at or before the last image
    other = prefix_block_hashes(doc + list(b"Title?"), cfg.image_token_id, bs)
    assert h == other  # the question does not enter the document's blocks
    changed = list(doc)
    changed[3] = cfg.image_token_id if changed[3] != cfg.image_token_id else cfg.page_token_id
    assert prefix_block_hashes(changed + list(b"?"), cfg.image_token_id, bs)[0] != h[0]
    assert prefix_block_hashes(doc, cfg.image_token_id, bs) == h[: (len(doc) - 1) // bs]  # a token is left to compute
    f1, f2 = torch.randn(40, 5), torch.randn(40, 5)
    a = prefix_block_hashes(doc + [65], cfg.image_token_id, bs, f1)
    assert a != h and a != prefix_block_hashes(doc + [65], cfg.image_token_id, bs, f2)
    assert a == prefix_block_hashes(doc + [66], cfg.image_token_id, bs, f1.clone())


# --------------------------------------------------------------------------- engines
def _engines(model, **kw):
    base = dict(num_blocks=96, kv_block_size=16, prefill_chunk=64, max_batch_tokens=256, default_max_new_tokens=6)
    base.update(kw)
    return (
        GenerationEngine(model, EngineConfig(**base, prefix_caching=True)),
        GenerationEngine(model, EngineConfig(**base, prefix_caching=False)),
    )


def test_eight_questions_on_one_document_compute_only_their_own_tokens():
    model = M.demo_model(seed=2)
    cfg = model.config
    doc = M.document_prompt([40, 33, 25], "", cfg, preamble="Invoice ")
    questions = [
        "What is the total?",
        "Who signed page 2?",
        "Title?",
        "Summarise page 3.",
        "Date?",
        "How many pages?",
        "Is there a table?",
        "Currency?",
    ]
    prompts = [doc + list(q.encode()) for q in questions]
    cached_engine, plain = _engines(model)
    want = plain.generate(prompts, 6, stop_at_eos=False)
    first = cached_engine.generate(prompts[:1], 6, stop_at_eos=False)
    rest = [cached_engine.submit(p, 6, stop_at_eos=False) for p in prompts[1:]]
    cached_engine.run_until_idle()
    assert first + [r.result(timeout=0) for r in rest] == want
    shared = (len(doc) // 16) * 16  # every whole block of the document
    assert [r.prompt_cached for r in rest] == [shared] * 7
    stats = cached_engine.stats()
    assert stats["prompt_tokens_cached"] == 7 * shared
    assert stats["prompt_tokens_computed"] == sum(map(len, prompts)) - 7 * shared
    assert plain.stats()["prompt_tokens_cached"] == 0
    assert stats["kv_blocks_reserved"] == 0 and stats["kv_blocks_pinned"] == 0  # nothing owned any more
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["kv_blocks_cached"] >= len(doc) // 16


def test_random_documents_and_questions_give_the_tokens_of_a_run_without_the_cache():
    """Many requests in flight at once over a pool too small to keep every document: shared
    prefixes, evictions, documents that are a prefix of others, chunked prefill."""
    model = M.demo_model(seed=5)
    cfg = model.config
    rng = random.Random(11)
    docs = [
        M.document_prompt([rng.randrange(5, 40) for _ in range(rng.randrange(1, 4))], "", cfg, preamble=f"Doc{d} ")
        for d in range(6)
    ]
    docs.append(docs[0] + M.document_prompt([17], "", cfg)[0:18])  # doc 0 with one more page
    prompts = [
        rng.choice(docs) + list(rng.choice([b"Total?", b"Title of page 1", b"Who?", b"Sum the table."]))
        for _ in range(40)
    ]
    cached_engine, plain = _engines(model, num_blocks=40, prefill_chunk=24, max_batch_tokens=96, max_num_seqs=6)
    want = plain.generate(prompts, 5, stop_at_eos=False)
    got = cached_engine.generate(prompts, 5, stop_at_eos=False)
    assert got == want
    stats = cached_engine.stats()
    assert stats["prompt_tokens_cached"] > 0 and stats["kv_blocks_reserved"] == 0 and stats["kv_blocks_pinned"] == 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_image_features_are_part_of_what_is_shared():
    cfg = M.DashModelConfig.from_dict({**M.DEMO_CONFIG, "image_feature_dim": 128})
    model = M.random_model(cfg, seed=1)
    doc = M.document_prompt([40], "", cfg)
    gen = torch.Generator().manual_seed(0)
    f1, f2 = torch.randn(40, 128, generator=gen), torch.randn(40, 128, generator=gen)
    cached_engine, plain = _engines(model)
    p = doc + list(b"Title?")
    runs = [(f1, "same"), (f1, "same"), (f2, "other"), (None, "none")]
    got, want, hits = [], [], []
    for feats, _ in runs:
        req = cached_engine.submit(p, 5, stop_at_eos=False, image_features=feats)
        cached_engine.run_until_idle()
        got.append(req.result(timeout=0))
        hits.append(req.prompt_cached)
        want.append(plain.generate([p], 5, stop_at_eos=False, image_features=[feats])[0])
    assert got == want
    assert hits == [0, 32, 0, 0]  # only the same document with the same features hits


def test_turning_the_cache_off():
    model = M.demo_model(seed=2)
    _, plain = _engines(model)
    assert plain.runtime.prefix_caching is False and plain.stats()["prefix_caching"] is False
    from dash_trt.serving.engine import EngineConfigError

    with pytest.raises(EngineConfigError, match="'prefix_caching' must be true or false, got 'yes'"):
        EngineConfig(prefix_caching="yes")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible to torch)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefix_cache_on_the_cuda_kernels(dtype):
    """On the kernels, the same requests in the same order with and without the cache. float32:
    the same tokens. bfloat16: a cached request's prefill steps hold fewer tokens, so its GEMMs
    round differently; the first token of every request agrees."""
    from dash_trt.attention.dash import cuda as dcuda

    if not dcuda.available():
        pytest.skip("the kernel library is not built")
    conf = dict(
        M.DEMO_CONFIG, head_dim=64, index_head_dim=64, num_attention_heads=8, hidden_size=512, intermediate_size=1024
    )
    model = M.random_model(conf, seed=4, dtype=dtype, device="cuda")
    cfg = model.config
    rng = np.random.default_rng(3)
    docs = [M.document_prompt([int(x) for x in rng.integers(30, 300, 3)], "", cfg) for _ in range(3)]
    prompts = [docs[i % 3] + list(f"Question {i}?".encode()) for i in range(12)]
    cached_engine, plain = _engines(
        model, num_blocks=512, kv_block_size=32, prefill_chunk=256, max_batch_tokens=512, max_model_len=2048
    )
    assert cached_engine.runtime.kernels, cached_engine.runtime.kernels_reason
    runs = {}
    for name, engine in (("cached", cached_engine), ("plain", plain)):
        reqs = []
        for group in (prompts[:3], prompts[3:]):  # the documents first, then questions on them
            reqs += [engine.submit(p, 8, stop_at_eos=False) for p in group]
            engine.run_until_idle()
        runs[name] = [r.result(timeout=0) for r in reqs]
    assert cached_engine.stats()["prompt_tokens_cached"] >= 9 * 32
    if dtype == torch.float32:
        assert runs["cached"] == runs["plain"]
    else:
        assert [t[0] for t in runs["cached"]] == [t[0] for t in runs["plain"]]


def test_text_after_the_last_image_is_never_shared():
    """A caption after page 1 is document text in a prompt that has a page 2 after it, and
    question text (other coordinates) in one that ends there: its blocks must not be shared."""
    model = M.demo_model(seed=3)
    cfg = model.config
    doc = M.document_prompt([31], "", cfg)  # 32 tokens: two whole blocks of 16
    caption = list(b"Caption of the first page, long enough for two blocks.")
    short = doc + caption + list(b"Q?")
    longer = doc + caption + M.document_prompt([20], "Q?", cfg)
    cached_engine, plain = _engines(model)
    want = plain.generate([short, longer], 6, stop_at_eos=False)
    a = cached_engine.submit(short, 6, stop_at_eos=False)
    cached_engine.run_until_idle()
    b = cached_engine.submit(longer, 6, stop_at_eos=False)
    cached_engine.run_until_idle()
    assert [a.result(timeout=0), b.result(timeout=0)] == want
    assert b.prompt_cached == 32  # the document's blocks, not the caption's
