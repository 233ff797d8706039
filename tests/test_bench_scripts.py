"""The benchmark scripts (bench/) load and agree with each other: what one takes from another
exists there. They need a GPU to run; a broken import would otherwise surface only on one."""

import ast
import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
SCRIPTS = sorted(p for p in BENCH.glob("*.py") if not p.name.startswith("_"))


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(f"bench_script_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _uses_of_bench_dash(tree: ast.AST) -> set[str]:
    """Names a script takes from bench_dash: ``from bench_dash import x`` and ``B.x`` where
    ``import bench_dash as B``."""
    names, aliases = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "bench_dash":
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.Import):
            aliases |= {a.asname or a.name for a in node.names if a.name == "bench_dash"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            names.add(node.attr)
    return names


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_bench_script_takes_from_bench_dash_only_what_it_has(path, monkeypatch):
    names = _uses_of_bench_dash(ast.parse(path.read_text()))
    if not names:
        pytest.skip("takes nothing from bench_dash")
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("bench_dash", None)
    bench_dash = _load(BENCH / "bench_dash.py")
    missing = sorted(n for n in names if not hasattr(bench_dash, n))
    assert not missing, f"{path.name} uses bench_dash.{', '.join(missing)}, which bench_dash.py does not define"


def test_the_check_finds_a_missing_name():
    tree = ast.parse("import bench_dash as B\nfrom bench_dash import time_ms\nB.decode_step(1)\n")
    assert _uses_of_bench_dash(tree) == {"time_ms", "decode_step"}


@pytest.mark.parametrize("value", ["x", "1,two", "1.5"])
def test_bench_dash_refuses_a_malformed_ab_mma_list_before_it_needs_a_gpu(value, monkeypatch, capsys):
    """``--ab-mma`` takes comma-separated warpgroup_mma values; anything else is an argument
    error at once (exit 2, the value named), not after the decode cases have run."""
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("bench_dash", None)
    bench_dash = _load(BENCH / "bench_dash.py")
    monkeypatch.setattr(sys, "argv", ["bench_dash.py", "--prefill-only", "--ab-mma", value])
    with pytest.raises(SystemExit) as exc:
        bench_dash.main()
    assert exc.value.code == 2
    assert f"--ab-mma: comma-separated integers, got {value!r}" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--ab", "block_major_warpgroups=1;warpgroups=2", "--tuning / --ab: unknown tuning knob 'warpgroups'"),
        ("--ab", "block_major_warpgroups=one", "--tuning / --ab: invalid literal for int()"),
        ("--tuning", "chunk=5", "--tuning / --ab: unknown tuning knob 'chunk'"),
        ("--only", "mixed,decodes", "--only: choose from decode, mixed, prefill, got 'mixed,decodes'"),
    ],
)
def test_bench_dash_refuses_unknown_knobs_before_it_needs_a_gpu(flag, value, message, monkeypatch, capsys):
    """``--tuning`` and each ``--ab`` variant name dash_trt.attention.dash.cuda.Tuning knobs, ``--only`` kinds of
    case; an unknown name or a value that is not an integer is an argument error at once (exit
    2), not a traceback after the first cases have run."""
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("bench_dash", None)
    bench_dash = _load(BENCH / "bench_dash.py")
    monkeypatch.setattr(sys, "argv", ["bench_dash.py", "--prefill-only", flag, value])
    with pytest.raises(SystemExit) as exc:
        bench_dash.main()
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


NCU_CSV = """==PROF== Connected to process 1 (python3)
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","1","python3","h","void unnamed>::write_kernel<__nv_bfloat16>(DashParams, Workspace)","1","7","(128, 1, 1)","(4096, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","75,800,000"
"0","1","python3","h","void unnamed>::write_kernel<__nv_bfloat16>(DashParams, Workspace)","1","7","(128, 1, 1)","(4096, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","byte","66,100,000"
"0","1","python3","h","void unnamed>::write_kernel<__nv_bfloat16>(DashParams, Workspace)","1","7","(128, 1, 1)","(4096, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","ns","66,496"
"7","1","python3","h","void unnamed>::block_attend_kernel<__nv_bfloat16, 128, 2>(DashParams, Plan, Workspace, int)","1","7","(256, 1, 1)","(20488, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","508,100,000"
"7","1","python3","h","void unnamed>::block_attend_kernel<__nv_bfloat16, 128, 2>(DashParams, Plan, Workspace, int)","1","7","(256, 1, 1)","(20488, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","byte","1,770,300,000"
"7","1","python3","h","void unnamed>::block_attend_kernel<__nv_bfloat16, 128, 2>(DashParams, Plan, Workspace, int)","1","7","(256, 1, 1)","(20488, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","ns","930,600"
==PROF== Disconnected from process 1
"""


def test_ncu_dram_tables_every_kernel_and_sums_the_call(tmp_path, capsys):
    """bench/ncu_dram.py --kernels on an ncu --csv file: a row a launch (the function's name and
    template arguments, whatever namespace ncu prints), the call's totals and its bytes at a
    streaming rate; a missing, binary or empty file and a rate of 0 are error messages, not
    tracebacks."""
    ncu_dram = _load(BENCH / "ncu_dram.py")
    path = tmp_path / "ncu.csv"
    path.write_text(NCU_CSV)
    assert ncu_dram.main(["--kernels", str(path), "--read-gbs", "4000"]) == 0
    out = capsys.readouterr().out
    assert "| 0: write_kernel<__nv_bfloat16> | 66.5 | 75.8 | 66.1 |" in out
    assert "| 7: block_attend_kernel<__nv_bfloat16, 128, 2> | 930.6 | 508.1 | 1770.3 |" in out
    assert "2 kernel launches, 997.1 us; DRAM read 0.584 GB, written 1.836 GB, 2.420 GB in all (76% writes)" in out
    assert "at 4000 GB/s (every byte as fast as a streaming read): 0.605 ms" in out
    assert ncu_dram.main(["--kernels", str(tmp_path / "absent.csv")]) == 2
    assert "cannot read" in capsys.readouterr().err
    binary = tmp_path / "ncu.ncu-rep"
    binary.write_bytes(bytes(range(128, 256)))
    assert ncu_dram.main(["--kernels", str(binary)]) == 2
    assert "is not text (expected the output of ncu --csv)" in capsys.readouterr().err
    (tmp_path / "log.csv").write_text("==PROF== no kernels were profiled\n")
    assert ncu_dram.main(["--kernels", str(tmp_path / "log.csv")]) == 1
    assert "no kernel metrics" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        ncu_dram.main(["--kernels", str(path), "--read-gbs", "0"])
    assert exc.value.code == 2 and "--read-gbs must be a positive rate" in capsys.readouterr().err


@pytest.mark.parametrize("layers, quick", [(8, False), (3, False), (8, True)])
def test_bench_generate_s_model_config_is_valid_for_any_layer_count(layers, quick, monkeypatch):
    """bench_generate's model (the benchmark config with --layers decoder layers) passes the
    model config's checks (DASH in every layer), so the GPU run does not stop at its first line."""
    monkeypatch.syspath_prepend(str(BENCH))
    module = _load(BENCH / "bench_generate.py")
    from dash_trt.models.config import DashModelConfig

    cfg = DashModelConfig.from_dict(module.bench_config(layers, "bfloat16", quick=quick))
    assert cfg.num_hidden_layers == (2 if quick else layers)


def test_bench_kv_on_demand_runs_on_cpu_and_checks_its_answers(tmp_path, capsys):
    """The KV-policy benchmark on a small pool: both policies answer as each request alone, on
    demand runs more requests at once, and the JSON says so (nothing about speed is checked)."""
    import json

    module = _load(BENCH / "bench_kv_on_demand.py")
    out = tmp_path / "kv.json"
    argv = ["--requests", "10", "--num-blocks", "30", "--max-new-tokens", "48", "--stop-after", "6"]
    assert module.main([*argv, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    worst, demand = result["policies"]["worst case"], result["policies"]["on demand"]
    assert worst["answers_equal_alone"] and demand["answers_equal_alone"]
    assert worst["pool_free_after"] and demand["pool_free_after"]
    assert worst["preempted"] == 0 and demand["peak_running"] > worst["peak_running"]
    assert "| on demand |" in capsys.readouterr().out


def test_bench_pages_runs_on_cpu_and_its_figures_add_up(tmp_path, capsys):
    """bench_pages on the CPU at toy sizes (dash-trt's runtime on the PyTorch operator and the
    dense peer): the dash path's tokens equal the cache-free reference's, every case has both
    paths' figures, and pages/s is the pages over the tower, prefill and decode times it
    reports (nothing about speed is checked)."""
    import json

    module = _load(BENCH / "bench_pages.py")
    out = tmp_path / "pages.json"
    argv = ["--device", "cpu", "--quick", "--paths", "dash,dense", "--cases", "1x2,2x1", "--steps", "3"]
    argv += ["--answer-end", "1x2", "--full", "2x1", "--parts", "--check", "--json", str(out)]
    assert module.main(argv) == 0
    result = json.loads(out.read_text())
    agree = result["check"]["agree"]["dash vs reference"]
    assert agree["equal_prefix"] == [agree["length"]] * 2
    tower = result["parts"]["tower"][0]
    assert tower["tokens_per_page"] > 0 and tower["pages_per_s"] > 0
    moe = {r["form"]: r for r in result["parts"]["moe"] if r["tokens"] == 64}
    assert set(moe) == {"grouped", "sparse", "dense"} and all(r["rel_err_vs_loop"] < 1e-5 for r in moe.values())
    assert abs(sum(result["parts"]["shares"][k] for k in ("attention", "experts", "rest")) - 1) < 1e-6
    busy = result["parts"]["busy"]
    assert busy["wall_ms"] > 0 and busy["gpu_ms"] is None and busy["steps"] == 8  # no device to be busy on a CPU
    per_page = tower["ms"] / tower["pages"] / 1e3
    for case in result["cases"]:
        assert set(case["paths"]) == {"dash", "dense"}
        for r in case["paths"].values():
            pages = case["pages"] * case["batch"]
            if r["pages_per_s_how"].startswith("full run"):
                decode = r["decode_s"]
            else:
                decode = (case["answer_tokens"] - 1) * (r["step_ms"] + r["step_end_ms"]) / 2e3
            assert r["pages_per_s"] == pytest.approx(pages / (per_page * pages + r["prefill_s"] + decode))
            assert r["ttft_last_s"] <= r["prefill_s"] + 1e-6
    assert "| 1 p x 2 | dash |" in capsys.readouterr().out


def _fake_fa3(q, k, v, *, max_seqlen_q, cu_seqlens_q, max_seqlen_k, softmax_scale, causal, fa_version,
              cu_seqlens_k=None, seqused_k=None, block_table=None, num_splits=None):  # fmt: skip
    """vLLM's ``flash_attn_varlen_func`` in the two forms dense-fa3 calls, in float32 on a CPU,
    checking the arguments as FA3 takes them: int32 offsets, a paged cache [pages, 16, H, D] with
    a block table and used lengths for decode, contiguous keys with offsets for prefill."""
    import torch

    assert fa_version == 3 and causal and cu_seqlens_q.dtype == torch.int32
    g = q.shape[1] // k.shape[-2]

    def attend(qq, kk, vv):  # the last len(qq) keys are the queries', bottom-right causal
        n, m = qq.shape[0], kk.shape[0]
        logits = torch.einsum("qhd,khd->hqk", qq.float(), kk.float().repeat_interleave(g, 1)) * softmax_scale
        mask = torch.arange(m)[None, :] <= torch.arange(m - n, m)[:, None]
        p = logits.masked_fill(~mask, -float("inf")).softmax(-1)
        return torch.einsum("hqk,khd->qhd", p, vv.float().repeat_interleave(g, 1)).to(qq.dtype)

    if block_table is None:  # prefill: one sequence's chunk
        assert k.dim() == 3 and int(cu_seqlens_k[-1]) == k.shape[0] == max_seqlen_k and seqused_k is None
        return attend(q, k, v)
    assert k.dim() == 4 and k.shape[1] == 16 and num_splits == 0 and seqused_k.dtype == torch.int32
    assert block_table.shape[1] * 16 == max_seqlen_k and max_seqlen_q == 1
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        used = int(seqused_k[b])
        keys = k[block_table[b].long()].flatten(0, 1)[:used]
        vals = v[block_table[b].long()].flatten(0, 1)[:used]
        out[b : b + 1] = attend(q[b : b + 1], keys, vals)
    return out


def test_bench_pages_dense_fa3_computes_the_dense_peer_s_tokens():
    """dense-fa3's calls into FlashAttention 3 (its page view of the cache, block table, used
    lengths and prefill offsets), through a CPU stand-in of vLLM's function that checks them:
    the same greedy tokens as the dense FA2 path, prefill and decode; without the library the
    path is reported unavailable, not a crash."""
    import types

    import torch

    module = _load(BENCH / "bench_pages.py")
    conf = module.published_config(quick=True)
    model = module.M.random_model(conf, seed=0, dtype=torch.float32, device=torch.device("cpu"))
    fake = types.SimpleNamespace(fa_unavailable=None, fa3=_fake_fa3, segments="stand-in")
    clock = module.Clock(torch.device("cpu"))
    got = module.check_paths(model, ["dense", "dense-fa3"], fake, 32768, 60, 64, torch.device("cpu"), clock)
    (agree,) = got["agree"].values()  # "dense vs dense-fa3": the one pair checked
    assert agree["equal_prefix"] == [agree["length"]] * 2, got["tokens"]
    with pytest.raises(module.PathUnavailable, match="FlashAttention 3"):
        module.make_path("dense-fa3", model, 1, 64, 64, None, 32768)


def test_bench_pages_busy_time_is_the_union_of_device_intervals():
    """Overlapping and nested kernel intervals count once, CPU events not at all."""
    import types

    import torch

    module = _load(BENCH / "bench_pages.py")
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def ev(a, b, kind=cuda):
        return types.SimpleNamespace(device_type=kind, time_range=types.SimpleNamespace(start=a, end=b))

    prof = types.SimpleNamespace(
        events=lambda: [ev(0, 100), ev(50, 150), ev(60, 70), ev(300, 400), ev(0, 1000, cpu), ev(500, 500)]
    )
    assert module.busy_ms(prof) == 0.25  # (0-150) + (300-400) us


def test_bench_dash_published_shape_is_the_checkpoint_s_dash_layer(monkeypatch):
    """``--shape published`` sets every constant the cases read from one Unlimited-OCR-2 layer's
    configuration (10 MHA heads of 128, blocks of 32 in KV blocks of 64, keep 12 of 16, scale
    32, floor 1e-4), and the fewest-bytes model counts K + 1 blocks of 32."""
    monkeypatch.syspath_prepend(str(BENCH))
    bench_dash = _load(BENCH / "bench_dash.py")
    bench_dash.use_shape("published")
    b = bench_dash
    assert (b.H, b.HKV, b.G, b.D, b.DI, b.SBS, b.KVB, b.KEEP) == (10, 10, 1, 128, 128, 32, 64, 12)
    assert tuple(b.CFG.routing(0)) == (12, 1.0, 32.0, 1e-4)
    traffic = b.decode_traffic([8192])
    assert traffic["kv_bytes"] == 10 * (12 + 1) * 32 * 128 * 2 * 2
    b.use_shape("legacy")
    assert (b.H, b.HKV, b.SBS, b.KVB, b.KEEP) == (32, 8, 64, 64, 16)


def test_bench_dash_time_budget_skips_the_cases_left():
    bench_dash = _load(BENCH / "bench_dash.py")
    done = bench_dash.Rows(None)
    done.add(lambda x, y=0: x + y, 1, y=2)
    assert list(done) == [3] and done.skipped == 0
    spent = bench_dash.Rows(-1.0)
    spent.add(lambda: pytest.fail("a case ran after its budget"))
    assert list(spent) == [] and spent.skipped == 1


@pytest.mark.filterwarnings("ignore::DeprecationWarning:triton.runtime.interpreter")  # the kernels' column
def test_bench_dca_runs_on_cpu_and_its_peers_compute_dca(tmp_path, capsys):
    """bench_dca on the CPU at toy sizes: the brute-force peer (three attentions per chunk and
    a log-sum-exp merge) and the dense peer agree with dash-trt's DCA reference before anything
    is timed, every path has figures at every length, and the table is written (nothing about
    speed is checked)."""
    import json

    module = _load(BENCH / "bench_dca.py")
    out = tmp_path / "dca.json"
    argv = ["--device", "cpu", "--lengths", "100", "--chunk-size", "40", "--local-size", "8"]
    argv += ["--original-max-position-embeddings", "32", "--heads", "4", "--kv-heads", "2", "--head-dim", "16"]
    argv += ["--dtype", "float32", "--reps", "1", "--rounds", "1", "--json", str(out)]  # no --png: no matplotlib in CI
    assert module.main(argv) == 0
    result = json.loads(out.read_text())
    # dash-trt's kernels run under Triton's interpreter on the CPU (tests/conftest.py)
    kernels = {"dash-trt prefill", "dash-trt decode"} if module.kernels.available() else set()
    assert set(result["check"]) == {"seed prefill", "seed decode", "dense prefill", "dense decode"} | kernels
    assert max(result["check"].values()) < 1e-4
    assert [(r["kind"], r["chunks"]) for r in result["rows"]] == [("prefill", 4), ("decode", 4)]
    for row in result["rows"]:
        assert set(row["paths"]) == {"seed", "dense", "dash-trt", "torch"}
        if not kernels:
            assert "Triton" in row["paths"].pop("dash-trt")["skipped"]
        assert all(p["ms"]["median"] > 0 for p in row["paths"].values())
    assert "| 100 | 4 |" in capsys.readouterr().out


def test_bench_dca_seed_peer_equals_the_reference_over_three_regions():
    """The brute-force peer, at toy sizes with all three regions in play (keys in the query's
    chunk, the one before and earlier ones), equals the reference for prefill and decode; a
    peer that rotated a region wrongly would not (checked: the inter region rotated like the
    successive one differs)."""
    import torch

    module = _load(BENCH / "bench_dca.py")
    shape = {"heads": 2, "kv_heads": 1, "head_dim": 8, "rope_theta": 1e4}
    x = module.Layer(70, module.DcaConfig(16, 4), shape, torch.float32, torch.device("cpu"), seed=3)
    ref = module.torch_prefill(x)
    assert (module.seed_prefill(x) - ref).abs().max() < 1e-5
    assert (module.seed_decode(x) - ref[-1]).abs().max() < 1e-5
    wrong = module.Layer(70, module.DcaConfig(16, 4), shape, torch.float32, torch.device("cpu"), seed=3)
    wrong.cfg = type("Wrong", (), {})()
    cfg = module.DcaConfig(16, 4)
    wrong.cfg.chunk_len, wrong.cfg.length_scale = cfg.chunk_len, cfg.length_scale

    def positions(p):
        r = cfg.positions(p)
        return r._replace(inter=r.successive)

    wrong.cfg.positions = positions
    assert (module.seed_prefill(wrong) - ref).abs().max() > 1e-3
