"""The kernel library's C ABI, on any machine where it was built (no GPU needed):
the ctypes mirror of DashParams, supported sizes, and argument validation."""

import ctypes

import pytest
from conftest import require_kernels

from dash_trt.attention.dash import cuda  # noqa: E402

require_kernels(cuda.library_path())

pytestmark = pytest.mark.skipif(cuda.library_path() is None, reason="kernel library not built (no CUDA compiler)")


def _params(**kw):
    base = dict(
        num_tokens=4,
        num_seqs=1,
        num_heads=8,
        num_kv_heads=2,
        head_dim=128,
        index_dim=64,
        num_blocks=8,
        block_size=64,
        table_width=4,
        max_new_tokens=4,
        dtype=2,
        sparse_block_size=64,
        sparse_local_block=1,
        topk=12,
        route_scale=128.0,
        prior_floor=1e-4,
        sigma=1.0,
        rope_page_pairs=1,
        rope_tok_theta=10000.0,
        rope_page_theta=256.0,
    )
    base.update(kw)
    p = cuda.DashParams(**base)
    for name in (
        "q",
        "k",
        "v",
        "iq",
        "ik",
        "coords",
        "head_cls",
        "block_tables",
        "seq_lens",
        "query_start_loc",
        "prompt_lens",
        "key_cache",
        "value_cache",
        "index_key_cache",
        "image_page_cache",
        "summary_cache",
        "summary_pages_cache",
        "out",
    ):
        setattr(p, name, 256)  # never dereferenced by validation
    return p


def _validate(p):
    lib = cuda._library()
    lib.dash_validate.restype = ctypes.c_int
    lib.dash_validate.argtypes = [ctypes.POINTER(cuda.DashParams)]
    status = lib.dash_validate(ctypes.byref(p))
    return status, lib.dash_last_error_message().decode()


def test_binding_matches_the_header():
    lib = cuda._library()  # checks the ABI version, struct size and every field offset
    assert lib.dash_params_size() == ctypes.sizeof(cuda.DashParams)
    assert cuda.supported_head_dims() == (64, 128, 256)


def test_the_mirror_is_the_field_table_of_params_def():
    """The ctypes DashParams is built from the library's table, which is params.def row for row:
    the same names in the same order, each offset the one the compiler laid out."""
    import re
    from pathlib import Path

    table = (Path(__file__).resolve().parents[1] / "plugins" / "include" / "dash" / "params.def").read_text()
    rows = re.findall(r"^DASH_PARAM\(([^,]+), (\w+), (\w+),", table, flags=re.M)
    assert [name for name, _ in cuda.DashParams._fields_] == [name for _, name, _ in rows]
    ctype = {"int32_t": ctypes.c_int32, "float": ctypes.c_float, "size_t": ctypes.c_uint64}
    want = [ctypes.c_void_p if t.endswith("*") else ctype[t] for t, _, _ in rows]
    assert [t for _, t in cuda.DashParams._fields_] == want
    lib = cuda._library()
    for name, _ in cuda.DashParams._fields_:
        assert lib.dash_params_offset(name.encode()) == getattr(cuda.DashParams, name).offset
    assert lib.dash_params_offset(b"no_such_field") == -1


def test_a_library_whose_fields_the_binding_does_not_write_is_refused(monkeypatch):
    """A size, configuration, input or cache field the binding would leave unset (a new row in
    params.def the Python side does not know) stops the load with the group named."""
    lib = cuda._library()
    monkeypatch.setattr(cuda, "_CONFIG_FIELDS", cuda._CONFIG_FIELDS[:-1])
    with pytest.raises(cuda.DashKernelError, match=r"CONFIG fields are .*rope_page_mod"):
        cuda._params_layout(lib, "lib")
    monkeypatch.undo()
    monkeypatch.setattr(cuda, "_INPUT_FIELDS", (*cuda._INPUT_FIELDS, "no_such_input"))
    with pytest.raises(cuda.DashKernelError, match=r"INPUT fields .*no_such_input"):
        cuda._params_layout(lib, "lib")


def test_workspace_and_selected_width():
    lib = cuda._library()
    p = _params()
    size = ctypes.c_size_t(0)
    assert lib.dash_workspace_size(ctypes.byref(p), ctypes.byref(size)) == 0
    assert size.value > 0
    assert lib.dash_max_selected(ctypes.byref(p)) == 4  # min(topk 12, 16, 4 blocks of 64 in 4*64 tokens)
    assert lib.dash_max_selected(ctypes.byref(_params(table_width=10))) == 10
    assert lib.dash_max_selected(ctypes.byref(_params(table_width=40))) == 12
    assert lib.dash_max_selected(ctypes.byref(_params(table_width=40, topk=30))) == 16  # K of the top 16


@pytest.mark.parametrize(
    "change, status, message",
    [
        ({"head_dim": 96}, 2, "unsupported head dim: 96"),
        ({"num_heads": 6, "num_kv_heads": 4}, 1, "must be a multiple of KV heads"),
        ({"num_heads": 64, "num_kv_heads": 2}, 2, "unsupported GQA group size: 32"),
        ({"block_size": 96}, 2, "KV block size 96 is not a whole multiple of the sparse block size 64"),
        ({"index_dim": 7}, 2, "unsupported index dim: 7"),
        ({"rope_page_pairs": 32, "index_dim": 64}, 1, "larger than twice sparse_rope_page_pairs"),
        ({"route_scale": float("nan")}, 1, "route_scale must be finite"),
        ({"prior_floor": 0.0}, 1, "prior_floor must be finite and > 0"),
        ({"sigma": -1.0}, 1, "sigma must be finite and > 0"),
        ({"topk": 0}, 1, "topk (dash_topk_blocks) must be >= 1, got 0"),
        ({"rope_tok_theta": 0.0}, 1, "rope_tok_theta and rope_page_theta"),
        ({"dtype": 7}, 2, "unsupported dtype code: 7"),
        ({"sparse_local_block": 0}, 1, "sparse_local_block must be positive"),
        ({"table_width": 100000}, 0, ""),  # 100000 sparse blocks: the fused routing scores them in chunks
        (
            {"table_width": 1000000},
            2,
            "context too long for the routing stage: 1000000 sparse blocks per sequence "
            "(table_width * block_size / sparse_block_size); at most 331520",
        ),
        ({"table_width": 10000, "topk": 20000}, 0, ""),  # K is at most 16: the routing stage's size is bounded
        (
            {"tune_block_major_warpgroups": 3},
            1,
            "tune_block_major_warpgroups must be 0 (the plan picks), 1 or 2, got 3",
        ),
        ({"tune_block_major_warpgroups": -1}, 1, "tune_block_major_warpgroups must be 0"),
        ({"tune_block_major_ctas": -1}, 1, "tune_block_major_ctas must be 0 (one CTA a work item) or > 0, got -1"),
        ({"tune_block_major_ctas": 1}, 0, ""),
    ],
)
def test_validation_messages(change, status, message):
    got, text = _validate(_params(**change))
    assert got == status and message in text, text


def test_null_tensor_is_refused():
    p = _params()
    p.q = None
    assert _validate(p) == (1, "a tensor pointer is NULL")


def _plan(p):
    lib = cuda._library()
    plan = cuda.DashPlan()
    status = lib.dash_plan(ctypes.byref(p), ctypes.byref(plan))
    return status, plan, lib.dash_last_error_message().decode()


def test_plan_gives_the_workspace_size_and_runs_only_its_own_shape():
    lib = cuda._library()
    p = _params(num_tokens=3000, max_new_tokens=3000, num_blocks=64, table_width=8)
    status, plan, _ = _plan(p)
    size = ctypes.c_size_t(0)
    assert status == 0 and lib.dash_workspace_size(ctypes.byref(p), ctypes.byref(size)) == 0
    assert lib.dash_plan_workspace_size(ctypes.byref(plan)) == size.value > 0
    # other pointers are fine; another size, configuration or tuning field is refused
    # before any device work (no GPU needed to see it)
    for change in ({"num_tokens": 2999}, {"topk": 8}, {"table_width": 9}, {"tune_attend_ctas": 64}):
        q = _params(**{**dict(num_tokens=3000, max_new_tokens=3000, num_blocks=64, table_width=8), **change})
        assert lib.dash_run_plan(ctypes.byref(q), ctypes.byref(plan), None) == 1
        assert "differ from the plan" in lib.dash_last_error_message().decode()
    # dash_plan_matches says which params a plan serves (the plugin re-plans on a mismatch)
    lib.dash_plan_matches.restype = ctypes.c_int32
    assert lib.dash_plan_matches(ctypes.byref(p), ctypes.byref(plan)) == 1
    assert lib.dash_plan_matches(ctypes.byref(_params(num_tokens=4)), ctypes.byref(plan)) == 0
    assert lib.dash_plan_matches(ctypes.byref(p), ctypes.byref(cuda.DashPlan())) == 0
    # a plan that dash_plan did not fill
    assert lib.dash_run_plan(ctypes.byref(p), ctypes.byref(cuda.DashPlan()), None) == 1
    assert "not filled by dash_plan" in lib.dash_last_error_message().decode()
    # an empty call with its own plan launches nothing and succeeds anywhere
    e = _params(num_tokens=0, max_new_tokens=0)
    status, eplan, _ = _plan(e)
    assert status == 0 and lib.dash_run_plan(ctypes.byref(e), ctypes.byref(eplan), None) == 0


def test_plans_are_kept_per_device(monkeypatch):
    """A plan depends on the GPU it was made for (SM count, shared memory), so one shape on two
    devices is planned twice, each under its own device, and a repeat on either is a hit."""
    import contextlib

    import torch
    from conftest import demo_config

    from dash_trt.attention.dash.config import CONFIG_SECTION, as_config

    lib = cuda._library()
    made_on = []
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext(made_on.append(d.index)))
    monkeypatch.setattr(cuda, "_PLANS", type(cuda._PLANS)())
    sizes = (4, 1, 8, 2, 128, 64, 8, 64, 4, 4, 2)
    cfg = as_config(demo_config(2)[CONFIG_SECTION])
    for index in (0, 1, 0, 1):
        p, plan, size = cuda._planned(lib, sizes, cfg, 0, cuda.Tuning(), torch.device("cuda", index))
        assert p.num_tokens == 4 and size > 0
    assert made_on == [0, 1] and [key[0] for key in cuda._PLANS] == [0, 1]


def test_tuning_fields_reach_the_plan():
    """The knobs are parameters (no environment variable): turning the block-major prefill
    off or splitting it into smaller passes changes the workspace a 3000-token call needs."""
    lib = cuda._library()

    def size(**tune):
        p = _params(num_tokens=3000, max_new_tokens=3000, num_blocks=64, table_width=8, **tune)
        status, plan, text = _plan(p)
        assert status == 0, text
        return lib.dash_plan_workspace_size(ctypes.byref(plan))

    default, off, small = size(), size(tune_block_major_min_tokens=-1), size(tune_block_major_chunk=500)
    assert default != off and small < default
    assert size(tune_block_major_min_tokens=1024) == default  # the documented default, spelt out
    assert cuda.Tuning.parse("block_major_chunk=500, front_writer=2") == cuda.Tuning(
        block_major_chunk=500, front_writer=2
    )
    with pytest.raises(ValueError, match="unknown tuning knob 'chunk'"):
        cuda.Tuning.parse("chunk=5")


def test_query_major_tiles_are_planned_where_compiled():
    """The block-major prefill's query-major tiles (head dims 64 and 128, fp16 / bf16) add
    their masks to the workspace; tile_share_min < 0 turns them off, a threshold leaves the
    size alone; head dim 256 and float32 plan none."""
    lib = cuda._library()

    def size(**kw):
        p = _params(**{**dict(num_tokens=3000, max_new_tokens=3000, num_blocks=64, table_width=8), **kw})
        status, plan, text = _plan(p)
        assert status == 0, text
        return lib.dash_plan_workspace_size(ctypes.byref(plan))

    for d in (64, 128):
        on, off = size(head_dim=d), size(head_dim=d, tune_tile_share_min=-1)
        assert on > off and size(head_dim=d, tune_tile_share_min=5) == on
        # masks of ceil(3000 / 32) tiles (G = 4: 32 tokens a tile), 128 blocks x 4 words, twice
        assert on - off >= 94 * 128 * 4 * 4 * 2
    assert size(head_dim=256) == size(head_dim=256, tune_tile_share_min=-1)
    # the warpgroup MMA tiles (sm_90a) need no buffer of their own: the workspace is the same either way
    assert size(head_dim=128, tune_warpgroup_mma=-1) == size(head_dim=128)
    assert size(head_dim=128, tune_block_major_warpgroups=1) == size(head_dim=128, tune_block_major_warpgroups=2)
    # nor the grid of block-major CTAs: work items are listed per pass whatever serves them
    assert size(head_dim=128, tune_block_major_ctas=1) == size(head_dim=128)
    # nor the overlap of the two tile kernels
    assert size(head_dim=128, tune_tile_overlap=-1) == size(head_dim=128)
    assert size(dtype=0) == size(dtype=0, tune_tile_share_min=-1)


def test_planning_needs_no_pointers_running_does():
    """A plan (and the workspace size) is made from the shape alone, with every pointer NULL
    (the Python binding plans a shape once, before any tensor of it exists); a run needs them."""
    lib = cuda._library()
    base = dict(
        num_tokens=4,
        num_seqs=1,
        num_heads=8,
        num_kv_heads=2,
        head_dim=128,
        index_dim=64,
        num_blocks=8,
        block_size=64,
        table_width=4,
        max_new_tokens=4,
        dtype=2,
        sparse_block_size=64,
        sparse_local_block=1,
        topk=12,
        route_scale=128.0,
        prior_floor=1e-4,
        sigma=1.0,
        rope_page_pairs=1,
        rope_tok_theta=10000.0,
        rope_page_theta=256.0,
    )
    bare = cuda.DashParams(**base)
    status, plan, text = _plan(bare)
    assert status == 0, text
    size = ctypes.c_size_t(0)
    assert lib.dash_workspace_size(ctypes.byref(bare), ctypes.byref(size)) == 0 and size.value > 0
    assert lib.dash_run_plan(ctypes.byref(bare), ctypes.byref(plan), None) == 1
    assert lib.dash_last_error_message().decode() == "a tensor pointer is NULL"
    assert _validate(bare) == (1, "a tensor pointer is NULL")


def test_the_library_routes_by_unlimited_ocr2s_rule():
    """The kernels route by the function's rule (docs/spec.md, route_blocks): the library says so
    (dash_routing_rule), and the bias rows (bias_out) are as wide as the selection rows."""
    lib = cuda._library()
    assert cuda.routing_rule() == cuda.ROUTING_UNLIMITED_OCR2
    p = _params()
    assert lib.dash_max_selected(ctypes.byref(p)) == 4  # min(topk 12, 16, the 4 blocks of a 4-wide table)
    assert lib.dash_max_selected(ctypes.byref(_params(table_width=40))) == 12
    fields = cuda._params_layout(lib, "lib")[1]
    assert fields["bias_out"] == "DEBUG" and fields["selected_out"] == "DEBUG"


def test_check_sizes_asks_the_library_for_every_layer():
    """A runtime's sizes are checked when it is built: what the kernels run passes, a block
    table too wide for the routing stage and an unsupported head dim are refused with the
    library's message (no device work, so no GPU needed)."""
    import torch

    from dash_trt.model import demo_model

    sp = demo_model().config.dash  # sparse blocks of 16
    cuda.check_sizes(8, 2, 64, 64, 100, 64, 10, sp, torch.bfloat16, 2)
    cuda.check_sizes(8, 2, 64, 64, 100, 64, 10000, sp, torch.bfloat16, 2)  # 40000 sparse blocks
    with pytest.raises(
        cuda.DashKernelError,
        match=r"layer 0: 1000000 blocks .*context too long for the routing stage: "
        r"4000000 sparse blocks",
    ):
        cuda.check_sizes(8, 2, 64, 64, 100, 64, 1000000, sp, torch.bfloat16, 2)
    with pytest.raises(cuda.DashKernelError, match="unsupported head dim: 48"):
        cuda.check_sizes(8, 2, 48, 64, 100, 64, 10, sp, torch.bfloat16, 2)


def test_kernel_library_reports_its_architectures():
    archs = cuda.compiled_architectures()
    assert archs, "the library was built with the architectures query"
    assert all(a.startswith(("sm_", "compute_")) or a in ("native", "all", "all-major") for a in archs)
