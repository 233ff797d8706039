"""dash-compare: the PyTorch reference vs ONNX Runtime through polygraphy's comparator, on the
demo export; a corrupted or foreign file fails loudly."""

import json
import re

import numpy as np
import onnx
import pytest
from conftest import demo_config
from onnx import numpy_helper

from dash_trt import compare as C
from dash_trt import export as E
from dash_trt import model as M


@pytest.fixture(scope="module")
def demo_onnx(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("cmp") / "demo.onnx")
    E.export_onnx(M.demo_model(seed=0), path, kv_block_size=16)
    return path


def test_onnxrt_matches_the_reference(demo_onnx, tmp_path, capsys):
    report, ins, outs = tmp_path / "r.json", tmp_path / "in.json", tmp_path / "ref.json"
    rc = C.main(
        [
            demo_onnx,
            "--demo",
            "--no-cuda",
            "--json",
            str(report),
            "--save-inputs",
            str(ins),
            "--save-outputs",
            str(outs),
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "RESULT: all backends match the reference" in text
    r = json.loads(report.read_text())
    assert r["runners"] == ["pytorch", "onnxrt"] and r["reference"] == "pytorch" and r["passed"]
    assert r["steps"] >= 4  # chunked prefill and decode steps
    stats = r["outputs"]["onnxrt"]
    assert set(stats) >= {"logits", "present.0.key", "present.1.summary_pages"}
    assert stats["logits"]["max_abs"] < 1e-4 and stats["present.0.image_page"]["max_abs"] == 0
    assert all(s["passed"] for s in stats.values())
    assert "tensorrt" in r["skipped"]
    # the saved feeds and reference outputs load with polygraphy, one per step
    from polygraphy.comparator import RunResults
    from polygraphy.json import load_json

    feeds = load_json(str(ins))
    ref = RunResults.load(str(outs))
    assert len(feeds) == r["steps"] and len(ref[0][1]) == r["steps"]
    assert set(feeds[0]) >= {"input_ids", "coords", "past.0.key"}


def test_the_ecosystem_s_graph_tools_work_on_the_export(demo_onnx, tmp_path, capsys):
    """onnx-graphsurgeon imports and exports the file (every attribute round-trips; the copy
    runs in ONNX Runtime with the same outputs), and ``polygraphy check lint`` passes with the
    feeds dash-compare saves (the supported way to run polygraphy on it: random feeds index
    outside the block tables' cache)."""
    import subprocess
    import sys

    import onnx_graphsurgeon as gs
    import onnxruntime as ort

    graph = gs.import_onnx(onnx.load(demo_onnx))
    copy = tmp_path / "surgeon.onnx"
    onnx.save(gs.export_onnx(graph), str(copy))
    ins = tmp_path / "in.json"
    assert C.main([demo_onnx, "--demo", "--no-cuda", "--save-inputs", str(ins)]) == 0
    capsys.readouterr()
    from polygraphy.json import load_json

    feeds = load_json(str(ins))[0]
    a = ort.InferenceSession(demo_onnx, providers=["CPUExecutionProvider"]).run(None, feeds)
    b = ort.InferenceSession(str(copy), providers=["CPUExecutionProvider"]).run(None, feeds)
    assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))
    # the polygraphy command (its console script's body), in this interpreter
    polygraphy = [sys.executable, "-c", "import sys; from polygraphy.tools import main; sys.exit(main())"]
    r = subprocess.run(
        [*polygraphy, "check", "lint", demo_onnx, "--load-inputs", str(ins), "-o", str(tmp_path / "lint.json")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads((tmp_path / "lint.json").read_text())
    assert not report["summary"]["failing"] and len(report["summary"]["passing"]) > 100
    assert not [e for e in report["lint_entries"] if e.get("level") in ("exception", "error")]
    # random feeds (what plain `polygraphy run --onnxrt` makes) index outside the cache: the
    # reason to load dash-compare's feeds
    r = subprocess.run([*polygraphy, "check", "lint", demo_onnx], capture_output=True, text=True, timeout=600)
    assert r.returncode != 0
    with pytest.raises(SystemExit):
        C.main(["--help"])
    assert "polygraphy check lint model.onnx --load-inputs inputs.json" in capsys.readouterr().out.replace("\n", " ")


def test_corrupted_weights_fail_loudly(demo_onnx, tmp_path, capsys):
    m = onnx.load(demo_onnx)
    biggest = max(
        (i for i in m.graph.initializer if i.data_type == onnx.TensorProto.FLOAT), key=lambda i: np.prod(i.dims)
    )
    arr = numpy_helper.to_array(biggest).copy()
    arr += 0.05
    biggest.CopyFrom(numpy_helper.from_array(arr, biggest.name))
    bad = tmp_path / "bad.onnx"
    onnx.save(m, str(bad))
    report = tmp_path / "r.json"
    rc = C.main([str(bad), "--demo", "--no-cuda", "--json", str(report)])
    out = capsys.readouterr().out
    assert rc == 1 and "MISMATCH" in out
    r = json.loads(report.read_text())
    assert not r["passed"] and not r["outputs"]["onnxrt"]["logits"]["passed"]


def test_a_different_model_is_a_mismatch(demo_onnx, capsys):
    assert C.main([demo_onnx, "--demo", "--seed", "1", "--no-cuda"]) == 1
    assert "MISMATCH" in capsys.readouterr().out


@pytest.mark.parametrize(
    "case, match",
    [
        ("truncated", "not a readable ONNX model|cannot load"),
        ("missing", "no such file"),
        ("engine", "no such file|TensorRT not found"),
    ],
)
def test_bad_input_is_exit_code_2(demo_onnx, tmp_path, capsys, case, match):
    import re

    args = [demo_onnx, "--demo", "--no-cuda"]
    if case == "truncated":
        data = open(demo_onnx, "rb").read()
        (tmp_path / "t.onnx").write_bytes(data[: len(data) // 3])
        args[0] = str(tmp_path / "t.onnx")
    elif case == "missing":
        args[0] = str(tmp_path / "nope.onnx")
    else:
        args += ["--engine", str(tmp_path / "model.plan")]
    assert C.main(args) == 2
    assert re.search(match, capsys.readouterr().err)


def test_engine_without_tensorrt_is_a_clear_error(demo_onnx, tmp_path, capsys):
    try:
        import tensorrt  # noqa: F401

        pytest.skip("TensorRT is installed here")
    except ImportError:
        pass
    plan = tmp_path / "model.plan"
    plan.write_bytes(b"not an engine")
    assert C.main([demo_onnx, "--demo", "--no-cuda", "--engine", str(plan), "--plugin", "x.so"]) == 2
    assert "TensorRT not found" in capsys.readouterr().err


def test_in_place_runner_gives_the_functional_runners_outputs(demo_onnx):
    """The runner of the serving form (``pytorch-cuda`` on a GPU; here on the CPU, where its
    in-place op runs the PyTorch paged operator) gives the functional model's logits and
    caches on every step of a chunked generation, carrying its caches between steps and
    refreshing them when the feed's pool changes."""
    import torch

    in_names, out_names, kv_block_size = C._onnx_io(demo_onnx)
    model = M.demo_model(seed=0)
    ref = C.TorchRunner(model, in_names, out_names, "ref")
    inplace = C.InPlaceTorchRunner(model, in_names, out_names, "inplace")
    n_in = in_names.index(next(n for n in in_names if n.startswith("past.")))
    steps = []

    def forward(inputs, caches):
        feed = dict(zip(in_names, [C._to_numpy(v) for v in inputs.values()][:n_in] + [C._to_numpy(c) for c in caches]))
        want, got = ref.infer_impl(feed), inplace.infer_impl(feed)
        for name in out_names:
            np.testing.assert_allclose(got[name], want[name], rtol=0, atol=1e-6, err_msg=name)
        steps.append(len(inputs["input_ids"]))
        return C._to_torch(want[out_names[0]]), [C._to_torch(want[n]) for n in out_names[1:]]

    # the second generation starts from fresh caches of the same shapes (copied in), the third has another pool
    for num_blocks in (None, None, 40):
        M.generate(
            model,
            C.default_prompts(model, 0),
            3,
            prefill_chunk=40,
            kv_block_size=kv_block_size,
            num_blocks=num_blocks,
            stop_at_eos=False,
            forward=forward,
        )
    assert len(steps) >= 8 and max(steps) > 2
    assert inplace.caches[0].key.shape[0] == 40 and inplace.caches[0].key.dtype == torch.float32


@pytest.mark.parametrize(
    "change, match",
    [
        ({"num_hidden_layers": 3}, "the graph has caches for 2 layers, the checkpoint has 3"),
        ({"head_dim": 16}, r"past.0.key is \[NB, 16, 2, 32\] in the graph, \[NB, 16, 2, 16\] for the checkpoint"),
        ({"vocab_size": 300}, "logits of 320 classes, the checkpoint's vocab_size is 300"),
    ],
)
def test_a_checkpoint_of_another_model_is_named_in_one_line(demo_onnx, tmp_path, capsys, change, match):
    """dash-compare with the checkpoint of a different model: exit 2 and one line saying how
    it differs from the graph (no KeyError or ONNX Runtime shape error from inside a run)."""
    cfg = demo_config(change.get("num_hidden_layers"), **{k: v for k, v in change.items() if k != "num_hidden_layers"})
    ckpt = tmp_path / "other.pt"
    M.save_checkpoint(M.random_model(cfg), ckpt)
    rc = C.main([demo_onnx, "--checkpoint", str(ckpt)])
    err = capsys.readouterr().err
    assert rc == 2 and re.search(match, err) and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("flag", ["--json", "--save-inputs", "--save-outputs"])
def test_an_output_folder_that_does_not_exist_is_refused_before_the_run(demo_onnx, tmp_path, capsys, flag):
    rc = C.main([demo_onnx, "--demo", "--no-cuda", flag, str(tmp_path / "missing" / "x.json")])
    captured = capsys.readouterr()
    assert rc == 2 and "does not exist" in captured.err and "against the PyTorch reference" not in captured.out
