"""The serving runtime (dash_trt.serving.runner): the in-place op, one plan per step, O(1) page
coordinates, logits only where a token is chosen, no copy of the pool; on a GPU, decode
steps replayed from CUDA graphs bit for bit like the same steps run eagerly."""

import random

import pytest
import torch
from conftest import demo_config
from test_ops import _batch

from dash_trt import model as M
from dash_trt.attention.dash import attributes as A
from dash_trt.attention.dash import ops
from dash_trt.attention.dash.paged import DashBatch, PageCoordState, flat_cache_tensors, sequence_coords
from dash_trt.attention.dash.reference import ROLE_IMAGE, ROLE_PAGE, ROLE_TEXT
from dash_trt.serving.block_pool import CacheFullError, KVBlockPool
from dash_trt.serving.runner import PagedRuntime, RuntimeConfigError, greedy_tokens, pool_block_bytes
from dash_trt.serving.scheduler import new_pool

SEEDS = [0, 1, 2]


@pytest.fixture(scope="module")
def demo():
    return M.demo_model(seed=2)


def _prompts(cfg):
    return [
        M.document_prompt([20, 9, 14], "Read page 2.", cfg, preamble="Doc "),
        M.document_prompt([30], "Title?", cfg),
        M.document_prompt([5, 5, 5, 5], "", cfg),
    ]


# ---------------------------------------------------------------- coordinates
def _random_document(rng):
    roles = [ROLE_TEXT] * rng.randint(0, 3)
    for p in range(rng.randint(1, 4)):
        roles.append(ROLE_PAGE)
        roles += [ROLE_IMAGE] * rng.randint(0 if p else 1, 6)
        roles += [ROLE_TEXT] * (rng.randint(1, 3) if rng.random() < 0.3 else 0)
    return roles + [ROLE_TEXT] * rng.randint(0, 3)


@pytest.mark.parametrize("seed", SEEDS)
def test_coordinate_state_equals_coordinates_of_the_whole_sequence(seed):
    """Random documents (pages without images, text between pages, response <PAGE>
    markers that restart the page numbering): every generated token's coordinates from the
    O(1) state equal sequence_coords of the whole sequence."""
    rng = random.Random(seed)
    for _ in range(300):
        prompt = _random_document(rng)
        response = [rng.choice([ROLE_TEXT, ROLE_TEXT, ROLE_PAGE]) for _ in range(rng.randint(1, 24))]
        state, prompt_coords = PageCoordState.from_prompt(torch.tensor(prompt))
        got = [list(state.next(r)) for r in response]
        whole = sequence_coords(torch.tensor(prompt + response))
        assert torch.equal(prompt_coords, whole[: len(prompt)])
        assert got == whole[len(prompt) :].tolist(), (prompt, response)


def test_coordinate_state_refuses_an_image_token_and_a_bad_prompt():
    state, _ = PageCoordState.from_prompt(torch.tensor([ROLE_PAGE, ROLE_IMAGE, ROLE_TEXT]))
    with pytest.raises(ValueError, match="image token after the prompt"):
        state.next(ROLE_IMAGE)
    with pytest.raises(ValueError, match="no image token"):
        PageCoordState.from_prompt(torch.tensor([ROLE_TEXT, ROLE_PAGE]))


# ------------------------------------------------------------------ the pool
def test_pool_allocates_a_reservation_when_a_sequence_is_added():
    pool = KVBlockPool(10, 4)
    pool.add("a", prompt_length=5, reserve_tokens=9)  # 3 blocks now
    assert pool.num_seq_blocks("a") == 3 and pool.num_free_blocks == 7
    with pytest.raises(CacheFullError, match="needs 8 KV blocks, only 7"):
        pool.add("b", reserve_tokens=30)
    assert "b" not in pool and pool.num_free_blocks == 7  # nothing allocated
    host = pool.schedule_host([("a", 5)])
    assert host.block_tables.tolist() == [pool.blocks("a")] and host.seq_lens.tolist() == [5]
    batch = DashBatch.from_host(host, max_query_len=5)
    assert batch.block_tables.dtype == torch.int32 and batch.query_start_loc.tolist() == [0, 5]
    assert batch.max_query_len == 5 and batch.host is host
    pool.schedule([("a", 7)])  # 12 tokens: within the 3 blocks, the table does not change
    assert pool.num_seq_blocks("a") == 3 and pool.num_free_blocks == 7
    pool.schedule([("a", 1)])  # past them: one more block, as before
    assert pool.num_seq_blocks("a") == 4
    pool.free("a")
    assert pool.num_free_blocks == 10


# -------------------------------------------------------------- in-place op
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_inplace_opcheck(seed, dtype):
    args, cfg, _ = _batch(seed, dtype)
    counts = torch.diff(args[15])
    result = torch.library.opcheck(
        ops.paged_attention_inplace_op(), args, {"max_query_len": int(counts.max()), **A.encode(cfg, seed % 2)}
    )
    assert set(result.values()) == {"SUCCESS"}, result


@pytest.mark.parametrize("seed", SEEDS)
def test_inplace_op_writes_the_functional_ops_caches_where_they_are(seed):
    args, cfg, cache = _batch(seed)
    want_out, want_caches = ops.paged_attention(*args[:7], cache, *args[13:], cfg, 0)
    storage = [getattr(cache, f).data_ptr() for f in ops.CACHE_FIELDS]
    batch = DashBatch(*args[13:], max_query_len=int(torch.diff(args[15]).max()))
    out = ops.paged_attention_inplace(*args[:7], cache, batch, cfg, 0)
    assert torch.equal(out, want_out)
    for f, want, ptr in zip(ops.CACHE_FIELDS, want_caches, storage):
        assert torch.equal(getattr(cache, f), want), f
        assert getattr(cache, f).data_ptr() == ptr, f"{f} was reallocated"


def test_inplace_op_under_torch_compile():
    args, cfg, cache = _batch(1)
    eager_cache = cache.clone()
    attrs = A.encode(cfg, 0)

    def f(*a):
        return torch.ops.dash_trt.paged_attention_(*a, max_query_len=64, **attrs) * 2

    torch._dynamo.reset()
    try:
        got = torch.compile(f, fullgraph=True, backend="aot_eager", dynamic=True)(*args)
    finally:
        torch._dynamo.reset()
    compiled_caches = [getattr(cache, n).clone() for n in ops.CACHE_FIELDS]
    for n in ops.CACHE_FIELDS:  # rerun eagerly from the same starting cache
        getattr(cache, n).copy_(getattr(eager_cache, n))
    want = f(*args)
    assert torch.equal(got, want)
    for n, c in zip(ops.CACHE_FIELDS, compiled_caches):
        assert torch.equal(c, getattr(cache, n)), n


# --------------------------------------------------------------- the model
def test_logits_indices_score_only_those_rows(demo):
    cfg = demo.config
    prompt = M.document_prompt([7, 5], "?", cfg)
    state = M.PagedState(demo, 8, 16)
    state.pool.add(0, prompt_length=len(prompt))
    batch = state.pool.schedule([(0, len(prompt))])
    ids = torch.tensor(prompt)
    coords = sequence_coords(M.token_roles(prompt, cfg))
    with torch.no_grad():
        every = demo.export_forward(ids, coords, *batch.tensors(), torch.arange(len(prompt)), *state.tensors())[0]
        rows = torch.tensor([len(prompt) - 1, 3, 3])
        some = demo.export_forward(ids, coords, *batch.tensors(), rows, *state.tensors())[0]
    assert some.shape == (3, cfg.vocab_size)
    torch.testing.assert_close(some, every[rows], atol=1e-6, rtol=1e-6)


# ------------------------------------------------------------- the runtime
def test_generation_equals_the_functional_form_and_the_reference(demo):
    """The runtime (in place) and the same steps through the functional forward give the
    same tokens and logits; both equal the step-by-step dense reference."""
    prompts = _prompts(demo.config)

    def functional(inputs, caches):
        with torch.no_grad():
            out = demo.export_forward(*inputs.values(), *caches)
        return out[0], out[1:]

    for chunk, bs in ((None, 16), (13, 8), (7, 5)):
        got = M.generate(demo, prompts, 6, prefill_chunk=chunk, kv_block_size=bs, stop_at_eos=False)
        fun = M.generate(demo, prompts, 6, prefill_chunk=chunk, kv_block_size=bs, stop_at_eos=False, forward=functional)
        assert got.tokens == fun.tokens
        for a, b in zip(got.logits, fun.logits):
            assert torch.equal(a, b)
    want = M.reference_generate(demo, prompts, 6, stop_at_eos=False)
    assert got.tokens == want.tokens


def test_generation_options_keep_the_tokens(demo):
    """Split points, blocks taken as sequences grow from a shuffled pool of just the blocks they
    end with, NaN in every unwritten slot: the tokens and logits of the plain generation,
    the plan's prefill chunks those of the split points, the tables scattered; a pool too small
    for a prompt says the KV pool is full; the end id can be another than the config's."""
    prompts = _prompts(demo.config)
    want = M.generate(demo, prompts, 6, kv_block_size=8, stop_at_eos=False)
    need = [-(-(len(p) + 5) // 8) for p in prompts]
    kw = dict(kv_block_size=8, stop_at_eos=False, reserve_blocks=False, shuffle_seed=3, cache_fill=float("nan"))
    got = M.generate(demo, prompts, 6, prefill_chunk=[5, 17, 18], num_blocks=sum(need), **kw)
    assert got.tokens == want.tokens
    for a, b in zip(got.logits, want.logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert [n for _, n in got.batches[0]] == [5] * len(prompts)
    assert got.batches[1] == [(i, 12) for i in range(len(prompts))]
    assert [len(t) for t in got.block_tables] == need
    assert any(b != a + 1 for t in got.block_tables for a, b in zip(t, t[1:]))
    assert got.blocks_in_use == 0
    with pytest.raises(CacheFullError, match="the KV pool is full"):
        M.generate(demo, prompts[:1], 2, kv_block_size=8, num_blocks=1, reserve_blocks=False)
    with pytest.raises(ValueError, match="split points"):
        M.generate(demo, prompts, 2, prefill_chunk=[4, 4])
    eos = want.tokens[0][2]
    stop = M.generate(demo, prompts[:1], 6, kv_block_size=8, eos_token_id=eos)
    assert stop.tokens[0] == want.tokens[0][: want.tokens[0].index(eos) + 1]


def test_no_step_copies_the_pool(demo):
    """Every cache tensor keeps its storage over a whole generation, and a pool of 65,536
    blocks gives exactly the tokens of one of 64 blocks (each step costs its tokens, not the
    pool's size: nothing is measured, the functional op would copy ~1.4 GB a layer a step)."""
    prompts = _prompts(demo.config)
    small = M.generate(demo, prompts, 5, prefill_chunk=16, kv_block_size=16, num_blocks=64, stop_at_eos=False)
    rt = PagedRuntime(demo, 65536, 16, max_model_len=1024)
    storage = [t.data_ptr() for t in rt.tensors()]
    for i, p in enumerate(prompts):
        rt.add(i, p, len(p) + 4)
    tokens = {i: [] for i in range(len(prompts))}
    while any(len(t) < 5 for t in tokens.values()):
        plan = [(i, min(rt.seq(i).pending, 16)) for i in tokens if len(tokens[i]) < 5]
        for i, tok in rt.step(plan).tokens.items():
            tokens[i].append(tok)
        assert [t.data_ptr() for t in rt.tensors()] == storage
    assert [tokens[i] for i in range(len(prompts))] == small.tokens
    assert rt.steps == small.steps


@pytest.mark.parametrize("dtype,block", [(torch.float32, 16), (torch.bfloat16, 64), (torch.float16, 48)])
def test_pool_block_bytes_is_what_one_block_of_every_cache_takes(dtype, block):
    """The pool-sizing figure equals the bytes the runtime's caches take per block (pools of
    3 and 5 blocks differ by exactly two blocks' worth)."""
    model = M.demo_model(dtype=dtype)
    per = pool_block_bytes(model, block)

    def total(n):
        return sum(t.numel() * t.element_size() for t in flat_cache_tensors(model.allocate_cache(n, block)))

    assert total(5) - total(3) == 2 * per and total(1) == per
    c = model.config
    assert per > c.num_hidden_layers * block * 2 * c.num_key_value_heads * c.head_dim * model.dtype.itemsize


def test_padded_decode_steps_give_the_unpadded_tokens(demo):
    """The decode body that CUDA graphs capture (static buffers, rows padded to the bucket
    with idle sequences on scratch blocks, every row scored, one table width), run eagerly
    on the PyTorch operator: the same tokens as plain steps; sequences leave and the batch
    moves between buckets."""
    cfg = demo.config
    prompts = _prompts(cfg) + [M.document_prompt([3, 8], "Why?", cfg), M.document_prompt([12], "", cfg)]
    lengths = [9, 3, 6, 1, 5]
    want = [M.generate(demo, [p], n, kv_block_size=8).tokens[0] for p, n in zip(prompts, lengths)]
    rt = PagedRuntime(demo, 64, 8, max_model_len=160, max_num_seqs=5, decode_padding=True, graph_batch_sizes=(2, 4))
    assert rt.graph_batch_sizes == (2, 4, 5) and not rt.cuda_graphs and rt.table_width == 20
    assert PagedRuntime(demo, 8, 8, max_num_seqs=6).graph_batch_sizes == (1, 2, 4, 6)
    for i, p in enumerate(prompts):
        rt.add(i, p, len(p) + lengths[i] - 1)
    got = {i: [] for i in range(len(prompts))}
    buckets = set()
    while True:
        plan = [(i, min(rt.seq(i).pending, 24)) for i in got if i in rt]
        if not plan:
            break
        if all(n == 1 for _, n in plan):
            buckets.add(rt._bucket(len(plan)))
        for i, tok in rt.step(plan).tokens.items():
            got[i].append(tok)
            if len(got[i]) == lengths[i] or tok == cfg.eos_token_id:
                rt.free(i)
    assert [got[i] for i in range(len(prompts))] == want
    assert buckets >= {2, 4}
    assert rt.pool.num_free_blocks == 64  # idle rows never took a pool block


def test_padded_decode_steps_after_other_steps_use_the_current_lengths(demo):
    """Consecutive decode steps of the same sequences only advance the lengths in the static
    buffers; any other step in between (here a prefill chunk joins) makes the next decode step
    rebuild them. Tokens equal the unpadded runtime's for the same plans, and the lengths the
    padded body saw equal the pool's."""
    cfg = demo.config
    a, b, c = (M.document_prompt([9], "a", cfg), M.document_prompt([14, 3], "", cfg), M.document_prompt([20], "", cfg))
    plans = [
        [("a", len(a)), ("b", len(b))],
        [("a", 1), ("b", 1)],
        [("a", 1), ("b", 1)],
        [("a", 1), ("b", 1), ("c", 12)],
        [("a", 1), ("b", 1)],
        [("a", 1), ("b", 1), ("c", len(c) - 12)],
        [("a", 1), ("b", 1), ("c", 1)],
        [("a", 1), ("b", 1), ("c", 1)],
    ]
    runs = []
    for padding in (True, False):
        rt = PagedRuntime(demo, 32, 8, max_model_len=64, max_num_seqs=4, decode_padding=padding)
        for sid, p in (("a", a), ("b", b)):
            rt.add(sid, p, len(p) + 8)
        got = []
        for k, plan in enumerate(plans):
            if k == 3:
                rt.add("c", c, len(c) + 4)
            got.append(rt.step(plan).tokens)
            if padding and all(n == 1 for _, n in plan):
                st = rt._static[rt._bucket(len(plan))]
                assert st.host_views["seq_lens"][: len(plan)].tolist() == [rt.pool.length(s) for s, _ in plan]
        runs.append(got)
    assert runs[0] == runs[1]


def test_runtime_refuses_bad_plans(demo):
    prompt = _prompts(demo.config)[1]
    rt = PagedRuntime(demo, 16, 16)
    rt.add("a", prompt, len(prompt) + 2)
    with pytest.raises(ValueError, match="already exists"):
        rt.add("a", prompt, len(prompt))
    with pytest.raises(ValueError, match="less than the prompt"):
        rt.add("b", prompt, 3)
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        rt.add("b", prompt, 10**6)
    with pytest.raises(ValueError, match=f"{len(prompt) + 1} new tokens, {len(prompt)} are pending"):
        rt.step([("a", len(prompt) + 1)])
    with pytest.raises(ValueError, match="at least one sequence"):
        rt.step([])
    with pytest.raises(KeyError, match="nobody"):
        rt.step([("nobody", 1)])
    with pytest.raises(RuntimeConfigError, match="max_num_seqs"):
        PagedRuntime(demo, 16, 16, max_num_seqs=0)
    out = rt.step([("a", len(prompt))])
    assert list(out.tokens) == ["a"] and rt.seq("a").pending == 1


def test_runtime_runs_on_the_pool_it_is_handed(demo):
    """The scheduler owns the pool: a runtime handed one takes its sizes and allocates from it."""
    pool = new_pool(16, 16)
    rt = PagedRuntime(demo, pool=pool)
    assert rt.pool is pool and rt.kv_block_size == 16
    prompt = _prompts(demo.config)[1]
    rt.add("a", prompt, len(prompt))
    assert "a" in pool and pool.num_free_blocks == 16 - pool.num_seq_blocks("a")
    with pytest.raises(RuntimeConfigError, match="the pool it was handed has 16"):
        PagedRuntime(demo, 8, pool=pool)
    with pytest.raises(RuntimeConfigError, match="or pool="):
        PagedRuntime(demo)


def test_greedy_choice_masks_image_tokens_and_breaks_ties_low():
    logits = torch.zeros(2, 6)
    logits[0, 4] = 5.0  # the image token: never chosen
    logits[0, 1] = logits[0, 3] = 1.0  # a tie: the lower id
    logits[1, 5] = 2.0
    assert greedy_tokens(logits, 4).tolist() == [1, 5]


# --------------------------------------------------------------------- GPU
GPU_CONFIG = demo_config(
    3,
    hidden_size=256,
    head_dim=64,
    num_attention_heads=8,
    num_key_value_heads=2,
    intermediate_size=512,
    sparse_attention_config={"sparse_index_dim": 64},
)


def _gpu_model(dtype):
    from dash_trt.attention.dash import cuda

    if not torch.cuda.is_available() or cuda.library_path() is None:
        pytest.skip("needs a CUDA GPU and the kernel library")
    return M.random_model(GPU_CONFIG, seed=3, dtype=dtype).cuda()


def _documents(cfg, n, seed):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        pages = [int(x) for x in torch.randint(20, 90, (int(torch.randint(1, 4, (1,), generator=gen)),), generator=gen)]
        out.append(M.document_prompt(pages, f"Question {i}?", cfg))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_graphs_replay_bit_for_bit_like_eager_steps(dtype):
    model = _gpu_model(dtype)
    prompts = _documents(model.config, 11, seed=4)  # 11 sequences: the 16-row bucket, 5 idle rows
    runs = {}
    for graphs in (True, False):
        rt = PagedRuntime(model, 256, 16, max_model_len=512, max_num_seqs=16, cuda_graphs=graphs)
        assert rt.kernels, rt.kernels_reason
        for i, p in enumerate(prompts):
            rt.add(i, p, len(p) + 9)
        tokens, logits = {i: [] for i in range(len(prompts))}, {i: [] for i in range(len(prompts))}
        while any(len(t) < 10 for t in tokens.values()):
            plan = [(i, min(rt.seq(i).pending, 64)) for i in tokens if len(tokens[i]) < 10]
            out = rt.step(plan, return_logits=True)
            for i, tok in out.tokens.items():
                tokens[i].append(tok)
                logits[i].append(out.logits[i])
        # the pool's blocks (the scratch blocks past them hold whatever idle rows wrote)
        runs[graphs] = (tokens, logits, [t[:256].clone() for t in rt.tensors()], rt.graph_steps)
    (tg, lg, cg, ng), (te, le, ce, ne) = runs[True], runs[False]
    assert ng >= 8 and ne == 0  # decode steps came from graphs in one run only
    assert tg == te
    for i in tg:
        assert all(torch.equal(a, b) for a, b in zip(lg[i], le[i])), i
    for a, b in zip(cg, ce):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_cuda_runtime_tokens_equal_cpu_generation():
    """float32 on the kernels (CUDA cores) and on the CPU: the same greedy tokens."""
    model = _gpu_model(torch.float32)
    prompts = _documents(model.config, 4, seed=5)
    gpu = M.generate(model, prompts, 8, prefill_chunk=50, stop_at_eos=False)
    cpu = M.generate(M.random_model(GPU_CONFIG, seed=3), prompts, 8, prefill_chunk=50, stop_at_eos=False)
    assert gpu.tokens == cpu.tokens and gpu.graph_steps > 0


def _gpu_engine_config(**kw):
    from dash_trt.serving.engine import EngineConfig

    return EngineConfig(
        **{
            **dict(
                kv_block_size=16,
                num_blocks=512,
                max_model_len=4096,
                prefill_chunk=64,
                max_batch_tokens=256,
                max_num_seqs=8,
            ),
            **kw,
        }
    )


@pytest.mark.gpu
def test_engine_on_cuda_replays_graphs_like_eager_steps_and_sizes_its_pool_from_memory():
    """The serving engine with decode graphs gives the tokens of the same engine with every
    step eager (same plans, same shapes: the same bits); its pool can be sized from free memory."""
    from dash_trt.serving.engine import EngineConfig, GenerationEngine
    from dash_trt.serving.runner import PoolTooSmallError

    model = _gpu_model(torch.bfloat16)
    prompts = _documents(model.config, 6, seed=6)
    got = {}
    for graphs in (True, False):
        engine = GenerationEngine(model, _gpu_engine_config(cuda_graphs=graphs))
        engine.warmup()
        got[graphs] = engine.generate(prompts, 7, stop_at_eos=False)
        assert (engine.runtime.graph_steps > 0) == graphs
        del engine
    assert got[True] == got[False]
    engine = GenerationEngine(
        model,
        EngineConfig(
            kv_block_size=16,
            gpu_memory_fraction=0.3,
            max_model_len=4096,
            prefill_chunk=64,
            max_batch_tokens=256,
            max_num_seqs=8,
        ),
    )
    assert engine.num_blocks > 1000 and engine.stats()["kv_blocks_total"] == engine.num_blocks
    assert engine.generate(prompts, 7, stop_at_eos=False) == got[True]
    with pytest.raises(PoolTooSmallError, match="no room for the KV pool"):
        GenerationEngine(model, EngineConfig(kv_block_size=16, gpu_memory_fraction=1e-6))


@pytest.mark.gpu
def test_seeded_sampling_on_cuda_graphs_equals_eager_steps():
    """Per-request sampling on the GPU path: a seeded request draws from the rows of the
    decode graphs' logits, which are the eager steps' bits, so graphs and eager steps give the
    same sampled tokens (and the greedy requests batched with them the same greedy tokens)."""
    from dash_trt.serving.engine import GenerationEngine

    model = _gpu_model(torch.bfloat16)
    prompts = _documents(model.config, 4, seed=8)
    got = {}
    for graphs in (True, False):
        engine = GenerationEngine(model, _gpu_engine_config(cuda_graphs=graphs))
        engine.warmup()
        sampled = [
            engine.submit(p, 7, stop_at_eos=False, sampling={"temperature": 0.8, "top_p": 0.9, "seed": i})
            for i, p in enumerate(prompts[:2])
        ]
        greedy = [engine.submit(p, 7, stop_at_eos=False) for p in prompts[2:]]
        engine.run_until_idle()
        got[graphs] = ([r.result(timeout=0) for r in sampled], [r.result(timeout=0) for r in greedy])
        assert (engine.runtime.graph_steps > 0) == graphs
        del engine
    assert got[True] == got[False]
