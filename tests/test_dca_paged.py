"""The paged form of Dual Chunk Attention (dash_trt.attention.dca.paged) against the reference
dash_trt.attention.dca.reference.dual_chunk_attention: random ragged batches of chunked prefills and decode tokens
over shuffled block tables whose unwritten slots hold NaN, the cache contents against RoPE at
p mod c and the length scale written from their definition, chunked against one-shot prefill,
the pool's batch metadata, and the refusals."""

import math
import random

import pytest
import torch

from dash_trt.attention.dca.paged import DcaKVCache, paged_dual_chunk_attention, token_scale_lengths
from dash_trt.attention.dca.reference import DcaConfig, DcaConfigError, dual_chunk_attention
from dash_trt.serving.block_pool import KVBlockPool

# chunk_size C, local_size W (c = C - W), heads H / Hkv, head dim D, rotary dim, RoPE base,
# KV block size (divides c), original_max_position_embeddings (None: no length scaling)
CONFIGS = {
    # c = 8, blocks of 4, GQA groups of 2, scaling from 5 tokens on
    "c8": dict(C=12, W=4, H=4, Hkv=2, D=8, rd=8, theta=10000.0, bsz=4, l_orig=5),
    # c = 7 (one block per chunk), groups of 3, half the dims rotated, scaling from 9 tokens on
    "c7": dict(C=10, W=3, H=6, Hkv=2, D=8, rd=4, theta=50.0, bsz=7, l_orig=9),
    # c = 4 <= W (inter position 2c - 1 < C), blocks of 2, one KV head for two query heads, no scaling
    "c4": dict(C=10, W=6, H=2, Hkv=1, D=6, rd=6, theta=30.0, bsz=2, l_orig=None),
}
# float32 against the float32 reference; the half types against the reference run on the same
# half inputs (the cache rounds the rotated, scaled keys to the half type, the reference does not)
TOLERANCES = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=4e-3, rtol=4e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
}


def dca_cfg(cfg):
    return DcaConfig(cfg["C"], cfg["W"], cfg["l_orig"] or 0)


def s_of(cfg, length):
    """s(L) from its definition."""
    l_orig = cfg["l_orig"]
    return 1.0 if not l_orig else max(1.0, 0.1 * math.log(length / l_orig) + 1.0)


def written_length(prompt, pos):
    """The length a token at ``pos`` is scaled with: the prompt's for prompt tokens, pos + 1 after."""
    return prompt if pos < prompt else pos + 1


def same(a, b):
    """Bitwise equal, NaN included."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))


def rope_f64(x, pos, rd, theta):
    """Neox RoPE at ``pos`` in float64 (written here, not imported)."""
    half = rd // 2
    inv = theta ** (-torch.arange(half, dtype=torch.float64) * 2.0 / rd)
    ang = pos.double()[:, None] * inv[None, :]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x = x.double()
    x1, x2 = x[..., :half], x[..., half:rd]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rd:]), dim=-1)


class Seq:
    """One sequence: its whole q/k/v (float32), prompt length, total length and KV blocks."""

    def __init__(self, cfg, prompt, total, blocks, gen):
        self.prompt, self.total, self.blocks, self.done = prompt, total, blocks, 0
        self.q = 1.5 * torch.randn(total, cfg["H"], cfg["D"], generator=gen)
        self.k = 1.5 * torch.randn(total, cfg["Hkv"], cfg["D"], generator=gen)
        self.v = torch.randn(total, cfg["Hkv"], cfg["D"], generator=gen)

    def slots(self, bsz, positions):
        return torch.tensor([self.blocks[p // bsz] * bsz + p % bsz for p in positions])


class Scenario:
    """Sequences over a shuffled pool of KV blocks (a spare block no table holds), a cache full of NaN."""

    def __init__(self, cfg, lengths, dtype=torch.float32, seed=0):
        self.cfg, self.dtype = cfg, dtype
        self.rng = random.Random(seed)
        gen = torch.Generator().manual_seed(seed)
        bsz = cfg["bsz"]
        need = [-(-total // bsz) for _, total in lengths]
        ids = list(range(sum(need) + 2))
        self.rng.shuffle(ids)
        assert ids != sorted(ids)
        self.spare = ids[sum(need) :]
        self.seqs, at = [], 0
        for (prompt, total), n in zip(lengths, need):
            self.seqs.append(Seq(cfg, prompt, total, ids[at : at + n], gen))
            at += n
        self.width = max(need) + 1  # every table padded with -1
        self.cache = DcaKVCache.allocate(len(ids), bsz, cfg["Hkv"], cfg["D"], dtype=dtype)
        self.cache.key.fill_(float("nan"))
        self.cache.value.fill_(float("nan"))

    def batch(self, step):
        """Metadata and new tokens of ``step`` = [(seq, n_new), ...] (lengths advanced)."""
        tables = torch.full((len(step), self.width), -1, dtype=torch.int32)
        qsl, lens, prompts, rows = [0], [], [], []
        for i, (seq, n) in enumerate(step):
            tables[i, : len(seq.blocks)] = torch.tensor(seq.blocks, dtype=torch.int32)
            seq.done += n
            qsl.append(qsl[-1] + n)
            lens.append(seq.done)
            prompts.append(seq.prompt)
            rows.append(slice(seq.done - n, seq.done))
        cat = lambda name: torch.cat([getattr(s, name)[r] for (s, _), r in zip(step, rows)]).to(self.dtype)
        meta = dict(
            block_tables=tables,
            seq_lens=torch.tensor(lens, dtype=torch.int32),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            prompt_lens=torch.tensor(prompts, dtype=torch.int32),
        )
        return cat("q"), cat("k"), cat("v"), meta

    def call(self, step, cache=None):
        q, k, v, meta = self.batch(step)
        cfg = self.cfg
        cache = self.cache if cache is None else cache
        out = paged_dual_chunk_attention(
            q, k, v, cache, cfg=dca_cfg(cfg), rope_theta=cfg["theta"], rotary_dim=cfg["rd"], **meta
        )
        assert out.shape == q.shape and out.dtype == self.dtype
        return out, meta

    def reference(self, seq, n):
        """The reference rows of ``seq``'s last ``n`` tokens (its length is ``seq.done``)."""
        cfg, length = self.cfg, seq.done
        kw = dict(
            chunk_size=cfg["C"],
            local_size=cfg["W"],
            rope_theta=cfg["theta"],
            rotary_dim=cfg["rd"],
            original_max_position_embeddings=cfg["l_orig"],
        )
        q, k, v = (x.to(self.dtype) for x in (seq.q, seq.k, seq.v))
        outs = []
        first = length - n
        if first < seq.prompt:  # prompt rows: one call, queries and keys scaled by s(prompt)
            last = min(length, seq.prompt)
            outs.append(dual_chunk_attention(q[first:last], k[:last], v[:last], scale_length=seq.prompt, **kw))
            first = last
        for t in range(first, length):  # generated tokens, each as its own decode step
            kl = torch.tensor([written_length(seq.prompt, j) for j in range(t + 1)])
            outs.append(
                dual_chunk_attention(
                    q[t : t + 1], k[: t + 1], v[: t + 1], scale_length=t + 1, key_scale_lengths=kl, **kw
                )
            )
        return torch.cat(outs)

    def check_step(self, step, out, meta):
        tol = TOLERANCES[self.dtype]
        qsl = meta["query_start_loc"].tolist()
        for i, (seq, n) in enumerate(step):
            got = out[qsl[i] : qsl[i + 1]].float()
            want = self.reference(seq, n).float()
            where = f"seq {i} length {seq.done} n {n}"
            torch.testing.assert_close(got, want, **tol, msg=lambda m, where=where: f"{where}: {m}")

    def check_cache(self):
        """Every written slot against its definition; every other slot still NaN."""
        cfg, bsz = self.cfg, self.cfg["bsz"]
        c = cfg["C"] - cfg["W"]
        key_flat = self.cache.key.view(-1, cfg["Hkv"], cfg["D"])
        value_flat = self.cache.value.view(-1, cfg["Hkv"], cfg["D"])
        written = torch.zeros(key_flat.shape[0], dtype=torch.bool)
        tol = TOLERANCES[self.dtype]
        for seq in self.seqs:
            pos = torch.arange(seq.done)
            slots = seq.slots(bsz, range(seq.done))
            written[slots] = True
            scales = torch.tensor([s_of(cfg, written_length(seq.prompt, p)) for p in range(seq.done)])
            want = rope_f64(seq.k[: seq.done].to(self.dtype), pos % c, cfg["rd"], cfg["theta"])
            want = want * scales.double()[:, None, None]
            torch.testing.assert_close(key_flat[slots].double(), want, **tol)
            assert torch.equal(value_flat[slots], seq.v[: seq.done].to(self.dtype))
        assert torch.isnan(key_flat[~written]).all() and torch.isnan(value_flat[~written]).all()
        for b in self.spare:
            assert torch.isnan(self.cache.key[b]).all()


def random_lengths(rng, c, n_seqs):
    """(prompt, total) pairs: short prompts decoded past 3c + 1, one long prompt, one a single token."""
    out = [(rng.randint(c - 2, 2 * c - 2), rng.randint(3 * c + 2, 4 * c + 1)) for _ in range(n_seqs - 2)]
    p = rng.randint(3 * c, 4 * c + 3)
    out.append((p, p + rng.randint(1, c + 2)))
    out.append((1, rng.randint(c + 2, 2 * c + 2)))
    return out


def run_random(scn, steps_out=None):
    """Steps of random subsets of the unfinished sequences, in random order: prefill chunks at
    random split points until each prompt is done, then one token per step."""
    rng = scn.rng
    decoded = set()
    while True:
        live = [s for s in scn.seqs if s.done < s.total]
        if not live:
            break
        rng.shuffle(live)
        pick = live[: rng.randint(1, len(live))]
        step = []
        for seq in pick:
            if seq.done < seq.prompt:
                n = rng.randint(1, seq.prompt - seq.done) if rng.random() < 0.7 else seq.prompt - seq.done
            else:
                n = 1
                decoded.add(seq.done)
            step.append((seq, n))
        out, meta = scn.call(step)
        scn.check_step(step, out, meta)
        if steps_out is not None:
            steps_out.append(len(step))
    return decoded


# --------------------------------------------------------------------- against the reference
@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_random_ragged_batches_match_reference(name, dtype):
    cfg = CONFIGS[name]
    c = cfg["C"] - cfg["W"]
    for seed in range(2 if dtype == torch.float32 else 1):
        rng = random.Random(100 + seed)
        scn = Scenario(cfg, random_lengths(rng, c, 4), dtype=dtype, seed=seed)
        sizes = []
        decoded = run_random(scn, sizes)
        # decode crossed chunk boundaries at k*c - 1, k*c, k*c + 1 for k = 2, 3; some steps were ragged
        assert {k * c + d for k in (2, 3) for d in (-1, 0, 1)} <= decoded
        assert max(sizes) > 1
        scn.check_cache()


@pytest.mark.parametrize("name", CONFIGS)
def test_decode_token_by_token_across_chunk_boundaries(name):
    """One sequence, prompt c - 2, decoded one token per call through positions k*c - 1, k*c,
    k*c + 1 for k = 1, 2, 3, next to a second sequence's chunked prefill in the same calls."""
    cfg = CONFIGS[name]
    c = cfg["C"] - cfg["W"]
    scn = Scenario(cfg, [(c - 2, 3 * c + 2), (3 * c + 1, 3 * c + 1)], seed=3)
    dec, pre = scn.seqs
    step = [(dec, dec.prompt)]
    while dec.done < dec.total:
        out, meta = scn.call(step)
        scn.check_step(step, out, meta)
        step = [(dec, 1)]
        if pre.done < pre.total:
            step.insert(0, (pre, min(3, pre.total - pre.done)))
    scn.check_cache()


@pytest.mark.parametrize("name", CONFIGS)
def test_chunked_prefill_at_any_split_equals_one_shot(name):
    cfg = CONFIGS[name]
    c = cfg["C"] - cfg["W"]
    lengths = [(3 * c + 5, 3 * c + 5), (2 * c + 1, 2 * c + 1)]
    one = Scenario(cfg, lengths, seed=5)
    whole, meta = one.call([(s, s.prompt) for s in one.seqs])
    qsl = meta["query_start_loc"].tolist()
    want = [whole[qsl[0] : qsl[1]], whole[qsl[1] : qsl[2]]]
    rng = random.Random(9)
    for trial in range(4):
        scn = Scenario(cfg, lengths, seed=5)  # same data, same tables
        got = [[], []]
        while any(s.done < s.prompt for s in scn.seqs):
            step = [(s, rng.randint(1, min(c + 3, s.prompt - s.done))) for s in scn.seqs if s.done < s.prompt]
            if trial % 2:
                step.reverse()
            out, meta = scn.call(step)
            qsl = meta["query_start_loc"].tolist()
            for i, (seq, _) in enumerate(step):
                got[scn.seqs.index(seq)].append(out[qsl[i] : qsl[i + 1]])
        for i in range(2):
            torch.testing.assert_close(torch.cat(got[i]), want[i], atol=1e-6, rtol=1e-6)
        assert same(scn.cache.key, one.cache.key) and same(scn.cache.value, one.cache.value)


def test_several_generated_tokens_in_one_call_equal_one_at_a_time():
    cfg = CONFIGS["c8"]
    a = Scenario(cfg, [(6, 20)], seed=8)
    b = Scenario(cfg, [(6, 20)], seed=8)
    a.call([(a.seqs[0], 6)])
    b.call([(b.seqs[0], 6)])
    many, _ = a.call([(a.seqs[0], 14)])
    ones = torch.cat([b.call([(b.seqs[0], 1)])[0] for _ in range(14)])
    torch.testing.assert_close(many, ones, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(many, a.reference(a.seqs[0], 14), atol=1e-5, rtol=1e-5)
    assert same(a.cache.key, b.cache.key) and same(a.cache.value, b.cache.value)


def test_scaling_is_visible_at_these_tolerances():
    """The scenario's scaling matters far beyond the float32 tolerance: a prefill chunk scaled by
    s(length reached) instead of s(prompt), or a decode key by s(prompt) instead of s(t + 1),
    would fail the comparisons above."""
    cfg = CONFIGS["c8"]
    scn = Scenario(cfg, [(20, 26)], seed=4)
    seq = scn.seqs[0]
    kw = dict(chunk_size=12, local_size=4, rope_theta=cfg["theta"], original_max_position_embeddings=cfg["l_orig"])
    chunk, _ = scn.call([(seq, 9)])
    wrong = dual_chunk_attention(seq.q[:9], seq.k[:9], seq.v[:9], **kw)  # scale_length 9, not 20
    assert (chunk - wrong).abs().max() > 1e-3
    scn.call([(seq, 11)])
    for _ in range(6):
        out, _ = scn.call([(seq, 1)])
    n = seq.done
    recompute = dual_chunk_attention(seq.q[n - 1 : n], seq.k[:n], seq.v[:n], scale_length=n, **kw)
    assert (out - recompute).abs().max() > 1e-4
    assert (out - scn.reference(seq, 1)).abs().max() < 1e-5


def test_no_scaling_needs_no_prompt_lens_and_equals_plain_dca():
    cfg = CONFIGS["c4"]  # l_orig None
    scn = Scenario(cfg, [(9, 9), (5, 5)], seed=6)
    q, k, v, meta = scn.batch([(s, s.prompt) for s in scn.seqs])
    del meta["prompt_lens"]
    out = paged_dual_chunk_attention(q, k, v, scn.cache, cfg=dca_cfg(cfg), rope_theta=cfg["theta"], **meta)
    for i, seq in enumerate(scn.seqs):
        rows = slice(0, 9) if i == 0 else slice(9, 14)
        want = dual_chunk_attention(seq.q, seq.k, seq.v, chunk_size=10, local_size=6, rope_theta=cfg["theta"])
        torch.testing.assert_close(out[rows], want, atol=1e-5, rtol=1e-5)


def test_through_the_block_pool_metadata():
    """The pool's schedule (DashBatch: block tables, seq_lens, query_start_loc, prompt_lens) drives
    the paged call directly: two prompts prefilled in chunks, then decoded together."""
    cfg = CONFIGS["c8"]
    bsz = cfg["bsz"]
    pool = KVBlockPool(num_blocks=24, block_size=bsz)
    gen = torch.Generator().manual_seed(12)
    seqs = {"a": Seq(cfg, 11, 30, [], gen), "b": Seq(cfg, 17, 22, [], gen)}
    for sid, seq in seqs.items():
        pool.add(sid, prompt_length=seq.prompt)
    cache = DcaKVCache.allocate(24, bsz, cfg["Hkv"], cfg["D"])
    cache.key.fill_(float("nan"))
    cache.value.fill_(float("nan"))
    scn = Scenario(cfg, [(1, 1)])  # for its reference only
    plan = [[("a", 5), ("b", 9)], [("b", 8), ("a", 6)]] + [[("a", 1), ("b", 1)]] * 5 + [[("a", 1)]] * 14
    for step in plan:
        batch = pool.schedule(step)
        rows = [seqs[sid] for sid, _ in step]
        for (_, n), seq in zip(step, rows):
            seq.done += n
        new = [torch.cat([getattr(s, f)[s.done - n : s.done] for s, (_, n) in zip(rows, step)]) for f in "qkv"]
        out = paged_dual_chunk_attention(*new, cache, cfg=dca_cfg(cfg), rope_theta=cfg["theta"], **batch.kwargs())
        qsl = batch.query_start_loc.tolist()
        for i, ((_, n), seq) in enumerate(zip(step, rows)):
            torch.testing.assert_close(out[qsl[i] : qsl[i + 1]], scn.reference(seq, n), atol=1e-5, rtol=1e-5)


def test_token_scale_lengths():
    pos = torch.arange(10)
    assert token_scale_lengths(pos, 4).tolist() == [4, 4, 4, 4, 5, 6, 7, 8, 9, 10]
    assert token_scale_lengths(pos, None).tolist() == list(range(1, 11))
    assert token_scale_lengths(pos, 20).tolist() == [20] * 10


def test_cache_allocate_and_clone():
    cache = DcaKVCache.allocate(5, 4, 2, 8, dtype=torch.float16)
    assert cache.key.shape == cache.value.shape == (5, 4, 2, 8) and cache.key.dtype == torch.float16
    assert (cache.num_blocks, cache.block_size) == (5, 4)
    twin = cache.clone()
    twin.key.fill_(1.0)
    assert not cache.key.any() and twin.key.data_ptr() != cache.key.data_ptr()
    with pytest.raises(DcaConfigError, match="num_blocks must be a positive int, got 0"):
        DcaKVCache.allocate(0, 4, 2, 8)
    with pytest.raises(DcaConfigError, match="block_size must be a positive int, got 2.0"):
        DcaKVCache.allocate(5, 2.0, 2, 8)
    with pytest.raises(DcaConfigError, match="cache dtype must be one of"):
        DcaKVCache.allocate(5, 4, 2, 8, dtype=torch.int32)


# --------------------------------------------------------------------- refusals
def test_bad_inputs_refused_and_cache_untouched():
    cfg = CONFIGS["c8"]  # c = 8, blocks of 4, scaling on
    scn = Scenario(cfg, [(6, 6), (9, 9)], seed=2)
    a, b = scn.seqs
    q, k, v, meta = scn.batch([(a, 6), (b, 9)])
    good = dict(q=q, k=k, v=v, cache=scn.cache, cfg=dca_cfg(cfg), rope_theta=cfg["theta"], **meta)
    bt = meta["block_tables"]
    overlap = bt.clone()
    overlap[1, 0] = overlap[0, 0]
    twice = bt.clone()
    twice[1, 1] = twice[1, 0]
    outside = bt.clone()
    outside[1, 2] = 99
    hole = bt.clone()
    hole[0, 0] = -1
    cases = [
        (dict(cache=DcaKVCache.allocate(20, 3, 2, 8)), r"12 - 4 = 8 must be a multiple of the KV block size 3"),
        (dict(cache=DcaKVCache.allocate(20, 16, 2, 8)), r"8 must be a multiple of the KV block size 16"),
        (dict(cache=DcaKVCache.allocate(20, 4, 1, 8)), r"cache holds \[\*, \*, 1, 8\] .* k has \[2, 8\]"),
        (dict(cache=DcaKVCache.allocate(20, 4, 2, 8, dtype=torch.float16)), r"cache dtype torch.float16 differs"),
        (dict(cache=(scn.cache.key, scn.cache.value)), r"cache must be a DcaKVCache, got tuple"),
        (
            dict(cache=DcaKVCache(scn.cache.key, scn.cache.value[:, :2])),
            r"cache.value must have shape \[\d+, 4, 2, 8\]",
        ),
        (dict(cfg={"chunk_size": 12, "local_size": 4}), r"cfg must be a DcaConfig, got dict"),
        (dict(q=q[0]), r"q must have shape \[\*, \*, \*\], got \[4, 8\]"),
        (dict(q=q.long()), r"q must have dtype in"),
        (dict(k=k.half()), r"k must have dtype in \['torch.float32'\], got torch.float16"),
        (dict(k=k[:-1]), r"k must have shape \[15, \*, 8\]"),
        (dict(v=v[:, :1]), r"v must have shape \[15, 2, 8\]"),
        (dict(q=q[:, :3]), r"query heads \(3\) must be a multiple of KV heads \(2\)"),
        (dict(rotary_dim=3), r"rotary_dim must be an even int in \[2, head_dim=8\], got 3"),
        (dict(rope_theta=-1.0), r"rope_theta must be a positive number"),
        (dict(softmax_scale=0), r"softmax_scale must be None or a positive number"),
        (dict(block_tables=bt.float()), r"block_tables must have dtype in"),
        (dict(block_tables=bt[0]), r"block_tables must have shape \[\*, \*\]"),
        (dict(seq_lens=meta["seq_lens"][:1]), r"seq_lens must have shape \[2\]"),
        (dict(query_start_loc=torch.tensor([0, 6], dtype=torch.int32)), r"query_start_loc must have shape \[3\]"),
        (dict(query_start_loc=torch.tensor([0, 6, 14], dtype=torch.int32)), r"rise from 0 to the number.*\(15\)"),
        (dict(query_start_loc=torch.tensor([0, 10, 15], dtype=torch.int32)), r"sequence 0: 10 new tokens but"),
        (dict(seq_lens=torch.tensor([6, 80], dtype=torch.int32)), r"sequence 1: context of 80 tokens is longer"),
        (dict(seq_lens=torch.tensor([6, -1], dtype=torch.int32)), r"seq_lens\[1\] must be >= 0, got -1"),
        (dict(block_tables=outside), r"block_tables\[1, 2\] = 99 is outside the cache \(0..\d+\)"),
        (dict(block_tables=hole), r"block_tables\[0, 0\] = -1 is outside the cache"),
        (dict(block_tables=twice), r"block_tables\[1\] holds a KV block twice among its first 3 blocks"),
        (dict(block_tables=overlap), r"two new tokens map to the same cache slot"),
        (dict(prompt_lens=None), r"sequence 0: with length scaling on .* no prompt_lens given"),
        (dict(prompt_lens=torch.tensor([6, 0], dtype=torch.int32)), r"sequence 1: .* prompt_lens\[1\] is 0"),
        (dict(prompt_lens=torch.tensor([6, -2], dtype=torch.int32)), r"prompt_lens\[1\] must be -1 \(none\) or >= 0"),
        (dict(prompt_lens=torch.tensor([6.0, 9.0])), r"prompt_lens must have dtype in"),
    ]
    key, value = scn.cache.key.clone(), scn.cache.value.clone()
    for change, message in cases:
        with pytest.raises(DcaConfigError, match=message):
            paged_dual_chunk_attention(**(good | change))
        assert same(scn.cache.key, key) and same(scn.cache.value, value)
    paged_dual_chunk_attention(**good)  # and the unchanged call runs


def test_empty_call():
    cfg = CONFIGS["c8"]
    cache = DcaKVCache.allocate(4, 4, 2, 8)
    out = paged_dual_chunk_attention(
        torch.zeros(0, 4, 8),
        torch.zeros(0, 2, 8),
        torch.zeros(0, 2, 8),
        cache,
        torch.zeros(0, 1, dtype=torch.int32),
        torch.zeros(0, dtype=torch.int32),
        torch.zeros(1, dtype=torch.int32),
        dca_cfg(cfg),
        prompt_lens=torch.zeros(0, dtype=torch.int32),
    )
    assert out.shape == (0, 4, 8) and not cache.key.any()
