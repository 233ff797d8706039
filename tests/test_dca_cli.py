"""The command-line tools on a Qwen2 and a Qwen2-MoE Dual Chunk Attention folder (a Hugging Face
folder whose config.json carries dual_chunk_attention_config): dash-export writes and checks the
ONNX file, dash-compare matches ONNX Runtime with PyTorch and names a checkpoint that does not fit,
dash-build refuses the op the plugin has no kernels for, before it needs TensorRT; a folder with
a sparse_attention_config.json is refused by dash-export, dash-compare and dash-triton write in
one line, exit 2."""

from __future__ import annotations

import json

import onnx
import pytest

from dash_trt import build as B
from dash_trt import compare as C
from dash_trt import export as E
from dash_trt.models import qwen2_dca as Q
from dash_trt.models.qwen2_dca import moe as M
from dash_trt.triton import cli as T

# Small steps on a 2-core machine run several times faster single-threaded (conftest.py).
pytestmark = pytest.mark.usefixtures("single_thread")


DCA = {"chunk_size": 32, "local_size": 8, "original_max_position_embeddings": 16}


#: the two model families: their tiny folder writers
WRITERS = {"qwen2": Q.write_tiny_qwen2_dca, "qwen2-moe": M.write_tiny_qwen2_moe_dca}


@pytest.fixture(scope="module", params=list(WRITERS))
def exported(tmp_path_factory, request):
    root = tmp_path_factory.mktemp("dca")
    folder = root / request.param
    WRITERS[request.param](folder, seed=6, rope_theta=1e6, dual_chunk_attention_config=DCA)
    out = root / "dca.onnx"
    return folder, out


def test_dash_export_writes_a_checked_file(exported, capsys):
    folder, out = exported
    assert E.main([str(folder), "--out", str(out), "--kv-block-size", "8", "--decode-steps", "5", "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "tokens equal" in text and "RESULT: exported; the checker and ONNX Runtime agree" in text
    model = onnx.load(str(out))
    assert [n.op_type for n in model.graph.node if n.domain == "dash_trt"] == ["DualChunkAttention"] * 2
    assert [f.name for f in model.functions] == ["DualChunkAttention"]


def test_dash_export_refuses_a_block_size_that_does_not_divide_the_chunk(exported, tmp_path, capsys):
    folder, _ = exported
    assert E.main([str(folder), "--out", str(tmp_path / "x.onnx"), "--kv-block-size", "16", "--quiet"]) == 2
    assert "must be a multiple of the KV block size 16" in capsys.readouterr().err
    assert not (tmp_path / "x.onnx").exists()


def test_dash_compare_matches_and_names_a_wrong_checkpoint(exported, tmp_path, capsys):
    folder, out = exported
    if not out.exists():
        pytest.skip("needs the export of the test above")
    report = tmp_path / "report.json"
    assert C.main([str(out), "--checkpoint", str(folder), "--json", str(report)]) == 0
    printed = capsys.readouterr().out
    assert "onnxrt vs pytorch" in printed and "no CUDA kernels of Dual Chunk Attention" in printed
    data = json.loads(report.read_text())
    assert data["passed"] and data["steps"] >= 3
    other = tmp_path / "three-layers"
    write = WRITERS[folder.name]
    write(other, seed=1, num_hidden_layers=3, dual_chunk_attention_config=DCA)
    assert C.main([str(out), "--checkpoint", str(other)]) == 2
    assert "was not exported from this checkpoint" in capsys.readouterr().err


def test_dash_build_refuses_dual_chunk_attention_before_tensorrt(exported, tmp_path, capsys):
    _, out = exported
    if not out.exists():
        pytest.skip("needs the export of the test above")
    assert B.main([str(out), "--out", str(tmp_path / "m.plan")]) == 2
    err = capsys.readouterr().err
    assert "dash_trt.DualChunkAttention nodes" in err and "no Dual Chunk Attention kernels" in err


@pytest.fixture(scope="module")
def sparse_folder(tmp_path_factory):
    """A Qwen2-MoE DCA folder shipping sparse_attention_config.json (as Qwen2.5-1M folders do)."""
    folder = tmp_path_factory.mktemp("sparse") / "qwen2-moe-dca"
    M.write_tiny_qwen2_moe_dca(folder, seed=2, dual_chunk_attention_config=DCA)
    (folder / "sparse_attention_config.json").write_text(json.dumps([{"0": ["vertical_and_slash", 1000, 6096, 0.9]}]))
    return folder


def _one_line_refusal(err: str, tool: str, folder) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"{tool}: error: ")
    assert f"{folder / 'sparse_attention_config.json'}: vLLM and SGLang merge this file" in lines[0]
    assert "dense only" in lines[0] and '"sparse_attention_enabled": false' in lines[0]


def test_the_tools_refuse_a_folder_with_a_sparse_attention_config(sparse_folder, tmp_path, capsys):
    out = tmp_path / "x.onnx"
    assert E.main([str(sparse_folder), "--out", str(out), "--kv-block-size", "8", "--quiet"]) == 2
    _one_line_refusal(capsys.readouterr().err, "dash-export", sparse_folder)
    assert not out.exists()
    onnx_file = tmp_path / "any.onnx"
    onnx_file.write_bytes(b"")
    assert C.main([str(onnx_file), "--checkpoint", str(sparse_folder)]) == 2
    _one_line_refusal(capsys.readouterr().err, "dash-compare", sparse_folder)
    repo = tmp_path / "repo"
    assert T.main(["write", str(sparse_folder), "--out", str(repo), "--kv-block-size", "8"]) == 2
    _one_line_refusal(capsys.readouterr().err, "dash-triton write", sparse_folder)
    assert not repo.exists()


@pytest.mark.parametrize("moe", [False, True])
def test_the_script_writes_a_tiny_dca_folder_the_tools_take(tmp_path, moe):
    """scripts/make_tiny_qwen2_dca.py, as scripts/make_tiny_unlimited_ocr2.py is for Unlimited-OCR-2:
    a folder dash-export takes (its DualChunkAttention nodes checked against PyTorch); a
    configuration the model refuses is one line, exit 2."""
    import os
    import subprocess
    import sys

    script = os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "make_tiny_qwen2_dca.py"
    )
    folder = tmp_path / "qwen2-dca"
    res = subprocess.run(
        [sys.executable, script, str(folder), "--seed", "3"] + (["--moe"] if moe else []),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "divide 24 (chunk_size - local_size)" in res.stdout
    config = json.loads((folder / "config.json").read_text())
    assert config["dual_chunk_attention_config"] == DCA and config["rope_theta"] == 1e6
    cls = M.Qwen2MoeDcaForCausalLM if moe else Q.Qwen2DcaForCausalLM
    assert type(Q.load_qwen2_dca(folder, model_class=cls)) is cls
    if not moe:  # the tools on both families: the tests above
        out = tmp_path / "dca.onnx"
        assert E.main([str(folder), "--out", str(out), "--kv-block-size", "8", "--decode-steps", "2", "--quiet"]) == 0
    bad = subprocess.run(
        [sys.executable, script, str(tmp_path / "bad"), "--local-size", "32"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 2 and "--local-size must be smaller than --chunk-size" in bad.stderr
