"""The Dual Chunk Attention kernels (dash_trt.attention.dca.kernels, Triton) against the paged
PyTorch operator, on random ragged batches: compiled on a GPU when there is one, else run by
Triton's interpreter on the CPU (tests/conftest.py turns it on before Triton is imported)."""

import os

import pytest
import torch

from dash_trt.attention.dca import kernels as K
from dash_trt.attention.dca.paged import DcaKVCache, paged_dual_chunk_attention
from dash_trt.attention.dca.reference import DcaConfig, DcaConfigError

try:
    import triton  # noqa: F401
except ImportError:  # pragma: no cover - CI installs it (the test extra)
    if os.environ.get("DASH_REQUIRE_TRITON_KERNELS"):
        raise
    pytest.skip("the kernels need Triton (pip install triton)", allow_module_level=True)

#: where the kernels run: the GPU's compiled kernels, else the interpreter on the CPU
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the interpreter turns loop bounds into scalars the way NumPy deprecates
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:triton.runtime.interpreter")
if DEVICE == "cpu" and not K._interpreted():
    pytest.skip("no GPU and TRITON_INTERPRET is not set (tests/conftest.py sets it)", allow_module_level=True)


#: chunk 48, local 16: chunk length c = 32; blocks of 8 tokens
CFG = DcaConfig(48, 16, 20)
H, HKV, D, BSZ, NB = 4, 2, 16, 8, 64


def _batch(news_and_lens, dtype, seed=0, *, heads=H, kv_heads=HKV):
    """A ragged batch: (new tokens, length after the call) per sequence, random block tables
    over a cache filled with random keys and values."""
    g = torch.Generator().manual_seed(seed)
    b = len(news_and_lens)
    width = max(-(-n // BSZ) for _, n in news_and_lens) + 1
    perm = torch.randperm(NB, generator=g)
    tables = torch.full((b, width), -1, dtype=torch.int32)
    used = 0
    for s, (_, length) in enumerate(news_and_lens):
        nb = -(-length // BSZ)
        tables[s, :nb] = perm[used : used + nb].int()
        used += nb
    cache = DcaKVCache.allocate(NB, BSZ, kv_heads, D, dtype)
    cache.key.copy_(torch.randn(cache.key.shape, generator=g))
    cache.value.copy_(torch.randn(cache.value.shape, generator=g))
    t = sum(n for n, _ in news_and_lens)
    q = torch.randn(t, heads, D, generator=g).to(dtype)
    k = torch.randn(t, kv_heads, D, generator=g).to(dtype)
    v = torch.randn(t, kv_heads, D, generator=g).to(dtype)
    counts = torch.tensor([n for n, _ in news_and_lens])
    qsl = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).int()
    seq_lens = torch.tensor([n for _, n in news_and_lens], dtype=torch.int32)
    # prompts: some sequences still in their prompt (scaled by its length), some decoding
    prompts = torch.tensor([max(1, n - 2 * (s % 2) * 5) for s, (_, n) in enumerate(news_and_lens)], dtype=torch.int32)
    out = q, k, v, cache.key, cache.value, tables, seq_lens, qsl, prompts
    q, k, v, key, value, tables, seq_lens, qsl, prompts = (x.to(DEVICE) for x in out)
    return q, k, v, DcaKVCache(key, value), tables, seq_lens, qsl, prompts


def _both(batch, **kw):
    q, k, v, cache, tables, seq_lens, qsl, prompts = batch
    ref_cache, got_cache = cache.clone(), cache.clone()
    ref = paged_dual_chunk_attention(q, k, v, ref_cache, tables, seq_lens, qsl, CFG, prompt_lens=prompts)
    got = K.paged_dca(q, k, v, got_cache, tables, seq_lens, qsl, CFG, prompt_lens=prompts, **kw)
    return ref, got, ref_cache, got_cache


#: a long prefill over four chunks, a chunk of a chunked prefill, a decode token, an empty sequence
RAGGED = [(70, 70), (5, 90), (1, 41), (0, 10)]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.float16, 1e-2), (torch.bfloat16, 4e-2)])
def test_kernels_equal_the_paged_operator_on_a_ragged_batch(dtype, tol):
    ref, got, ref_cache, got_cache = _both(_batch(RAGGED, dtype))
    assert got.dtype == dtype and got.shape == ref.shape
    assert (got.float() - ref.float()).abs().max().item() < tol
    # the cache written exactly as the operator writes it
    assert torch.equal(ref_cache.key, got_cache.key) and torch.equal(ref_cache.value, got_cache.value)


def test_the_result_does_not_depend_on_the_split_count():
    batch = _batch(RAGGED, torch.float32, seed=1)
    ref, one = _both(batch)[:2]
    for splits in (2, 3, 8):
        got = _both(batch, splits=splits)[1]
        assert (got - one).abs().max().item() < 2e-6, splits
    assert (one - ref).abs().max().item() < 2e-5


def test_decode_steps_across_a_chunk_boundary_with_grouped_heads():
    """decode=True: one token a sequence, tiles from the device alone; positions around the
    chunk boundaries (31, 32, 63, 64 and 95 keys before the token), 8 query heads on 2 KV heads."""
    steps = [(1, n) for n in (32, 33, 64, 65, 96)]
    batch = _batch(steps, torch.float32, seed=2, heads=8)
    for splits in (1, 4):
        ref, got, ref_cache, got_cache = _both(batch, decode=True, splits=splits)
        assert (got - ref).abs().max().item() < 2e-5
        assert torch.equal(ref_cache.key, got_cache.key)


def test_a_wrong_rotation_is_caught():
    """The check can fail: the same keys with the successive and inter rotations swapped in the
    reference give a different answer, which the kernels do not match."""
    batch = _batch([(70, 70)], torch.float32, seed=3)
    ref, got = _both(batch)[:2]
    wrong = DcaConfig(48, 8, 20)  # another chunk length: other regions and rotations
    q, k, v, cache, tables, seq_lens, qsl, prompts = batch
    # block size 8 divides 40, so the operator runs; its answer differs
    other = paged_dual_chunk_attention(q, k, v, cache.clone(), tables, seq_lens, qsl, wrong, prompt_lens=prompts)
    assert (got - ref).abs().max().item() < 2e-5
    assert (other - got).abs().max().item() > 1e-2


def test_tiles_never_cross_a_chunk_boundary():
    seqs, rows = K._tiles([0, 70, 75], [70, 90], 32, 8)
    starts = {0: 0, 1: 70}
    lens = {0: 70, 1: 90}
    ends = {0: 70, 1: 75}
    bounds = list(zip(seqs, rows)) + [(None, None)]
    covered = []
    for (s, r), (s2, r2) in zip(bounds, bounds[1:]):
        stop = r2 if s2 == s else ends[s]
        assert 0 < stop - r <= 8
        first = lens[s] - (ends[s] - r)
        last = lens[s] - (ends[s] - stop) - 1
        assert first // 32 == last // 32
        covered += list(range(r, stop))
        assert r >= starts[s]
    assert covered == list(range(75))


def test_bad_arguments_are_refused():
    q, k, v, cache, tables, seq_lens, qsl, prompts = _batch([(3, 10), (2, 20)], torch.float32)
    with pytest.raises(DcaConfigError, match="one new token"):
        K.paged_dca(q, k, v, cache, tables, seq_lens, qsl, CFG, prompt_lens=prompts, decode=True)
    with pytest.raises(DcaConfigError, match="splits"):
        K.paged_dca(q, k, v, cache, tables, seq_lens, qsl, CFG, prompt_lens=prompts, splits=0)
    with pytest.raises(DcaConfigError, match="block size"):
        K.paged_dca(q, k, v, cache, tables, seq_lens, qsl, DcaConfig(30, 10), prompt_lens=prompts)
    q64, k64, v64 = q.double(), k.double(), v.double()
    cache64 = DcaKVCache(cache.key.double(), cache.value.double())
    with pytest.raises(DcaConfigError, match="float32, float16 or bfloat16"):
        K.paged_dca(q64, k64, v64, cache64, tables, seq_lens, qsl, CFG, prompt_lens=prompts)


def test_decode_splits_fill_the_gpu_within_bounds():
    assert K.decode_splits(1, 4, 131072, sms=132) == 64
    assert K.decode_splits(64, 4, 131072, sms=132) == 1
    assert K.decode_splits(1, 4, 4096, sms=132) == 2  # at least 2048 keys a split
    assert K.decode_splits(8, 4, 131072, sms=132) == 8


@pytest.mark.skipif(DEVICE != "cuda", reason="the op picks the kernels for CUDA tensors")
@pytest.mark.parametrize("news", [RAGGED, [(1, n) for n in (32, 33, 64, 65, 96)]])
def test_the_inplace_op_runs_the_kernels_on_cuda(news):
    from dash_trt.attention.dca import ops

    q, k, v, cache, tables, seq_lens, qsl, prompts = _batch(news, torch.float32, seed=4)
    ref_cache = DcaKVCache(cache.key.cpu(), cache.value.cpu())
    ref = paged_dual_chunk_attention(
        q.cpu(), k.cpu(), v.cpu(), ref_cache, tables.cpu(), seq_lens.cpu(), qsl.cpu(), CFG, prompt_lens=prompts.cpu()
    )
    got = ops.dual_chunk_attention_inplace(q, k, v, cache, tables, seq_lens, qsl, CFG, prompt_lens=prompts)
    assert (got.cpu() - ref).abs().max().item() < 2e-5
    # written as the CPU operator writes it (CUDA's and the CPU's cos/sin may differ in a last bit)
    assert (cache.key.cpu() - ref_cache.key).abs().max().item() < 1e-5
    assert torch.equal(cache.value.cpu(), ref_cache.value)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs")
def test_a_captured_decode_step_replays_equal_to_eager_across_chunk_boundaries():
    """paged_dca(decode=True, check=False) reads nothing on the host: captured once in a CUDA
    graph at one length, replayed at lengths on both sides of chunk boundaries (c = 32), each
    replay equal to the eager call on the same cache."""
    q, k, v, cache, tables, seq_lens, qsl, prompts = _batch([(1, 100)], torch.float32, seed=5, heads=8)
    prompts.fill_(1)  # every step a generated token, scaled by its own length
    kw = dict(prompt_lens=prompts, decode=True, check=False, splits=4)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (compiles) outside the capture
        K.paged_dca(q, k, v, cache.clone(), tables, seq_lens, qsl, CFG, **kw)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = K.paged_dca(q, k, v, cache, tables, seq_lens, qsl, CFG, **kw)
    g = torch.Generator(device="cuda").manual_seed(6)
    for n in (31, 32, 33, 64, 65, 96):
        seq_lens.fill_(n)
        for t in (q, k, v):
            t.copy_(torch.randn(t.shape, generator=g, device="cuda"))
        before = cache.clone()
        graph.replay()
        want = K.paged_dca(q, k, v, before, tables, seq_lens, qsl, CFG, prompt_lens=prompts, decode=True, splits=4)
        torch.cuda.synchronize()
        assert torch.equal(out, want), n
        assert torch.equal(cache.key, before.key), n
