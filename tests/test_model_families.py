"""The model contract's families (dash_trt.models.families): each model finds its family, the
tools ask the family instead of naming model classes."""

from __future__ import annotations

import ast
import pathlib

import pytest

from dash_trt.modeling import ModelContractError
from dash_trt.models import qwen2_dca as Q
from dash_trt.models.families import DASH, DCA, FAMILIES, family_of, family_of_checkpoint
from dash_trt.models.interface import CUDA_KERNELS, DOCUMENTS, TENSORRT, ServedModel
from dash_trt.models.registry import demo_model

ROOT = pathlib.Path(__file__).resolve().parents[1] / "dash_trt"


def _dca_model():
    return Q.init_random_weights(Q.Qwen2DcaForCausalLM(Q.Qwen2DcaConfig.from_dict(Q.tiny_qwen2_dca_config())), 0)


def test_each_model_finds_its_family_and_both_serve():
    dash, dca = demo_model(), _dca_model()
    assert family_of(dash) is DASH and family_of(dca) is DCA
    assert isinstance(dash, ServedModel) and isinstance(dca, ServedModel)
    with pytest.raises(ModelContractError, match="not a model dash-trt knows"):
        family_of(object())


def test_only_dca_refuses_the_kernel_backends():
    assert DASH.refuse([CUDA_KERNELS, TENSORRT, DOCUMENTS]) is None
    assert DCA.refuse([TENSORRT]) == DCA.unsupported[TENSORRT]
    assert DCA.refuse([]) is None
    assert DASH.checkpoint_name != DCA.checkpoint_name


def test_check_prompts_of_each_family():
    dash, dca = demo_model(), _dca_model()
    prompts, _ = DASH.check_prompts(dash, 0)
    assert len(prompts) == 2 and all(prompts)
    prompts, features = DCA.check_prompts(dca, 0)
    span = dca.config.dca.chunk_len
    assert features is None and len(prompts[0]) > 2 * span and len(prompts[1]) < span  # crosses chunks
    assert DCA.check_prompts(dca, 0) == (prompts, None)  # seeded


def test_dca_save_writes_a_loadable_folder(tmp_path):
    model = _dca_model()
    DCA.save(model, str(tmp_path / DCA.checkpoint_name), None)
    again = Q.load_qwen2_dca(tmp_path / DCA.checkpoint_name)
    assert all((a == b).all() for a, b in zip(model.state_dict().values(), again.state_dict().values()))


@pytest.mark.parametrize("module", ["compare.py", "triton/repository.py", "export.py"])
def test_tools_ask_the_family_not_the_model_class(module):
    """compare, the repository writer and dash-export import no concrete model module."""
    tree = ast.parse((ROOT / module).read_text())
    imported = {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    concrete = {"models.qwen2_dca", "models.qwen2_moe_dca", "models.unlimited_ocr2", "models.decoder"}
    names = {m.lstrip(".") for m in imported}
    assert not {m for m in names for c in concrete if m == c or m.startswith(c + ".")}


def test_a_checkpoint_finds_its_family(tmp_path):
    """A folder whose config.json has a dual_chunk_attention_config is the DCA family's, with its
    own dash-export program; anything else (a file, a folder without a readable config, a DASH
    folder) is the DASH family's, whose loader says what is wrong with it."""
    folder = tmp_path / "dca"
    Q.write_tiny_qwen2_dca(folder, dual_chunk_attention_config={"chunk_size": 32, "local_size": 8})
    assert family_of_checkpoint(folder) is DCA and DCA.export_command is not None
    assert DASH.export_command is None
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    (tmp_path / "list").mkdir()
    (tmp_path / "list" / "config.json").write_text("[1]")
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "config.json").write_text('{"dual_chunk_attention_config": null}')
    for path in ("model.pt", "missing", "bad", "list", "plain"):
        assert family_of_checkpoint(tmp_path / path) is DASH, path


@pytest.mark.parametrize("module", ["export.py", "models/loader.py", "triton/cli.py", "compare.py"])
def test_the_tools_name_no_family(module):
    """dash-export, the loader, dash-triton and dash-compare dispatch through the families: none
    names Dual Chunk Attention."""
    text = (ROOT / module).read_text().lower()
    assert "dca" not in text and "dual chunk" not in text


def test_a_family_config_error_is_a_model_config_error():
    """The tools catch one base for every family's config errors."""
    from dash_trt.attention.dca.reference import DcaConfigError
    from dash_trt.models.config import ModelConfigError

    assert issubclass(DcaConfigError, ModelConfigError) and issubclass(Q.Qwen2DcaConfigError, ModelConfigError)
    assert issubclass(DcaConfigError, ValueError)


def test_the_families_import_no_onnx():
    """A family's export program imports the ONNX modules when dash-export runs it: loading a model
    (the serving runtime, the Triton backend) needs no onnx import."""
    import subprocess
    import sys

    code = (
        "import sys, dash_trt.models.loader, dash_trt.models.families; "
        "print(sorted(m for m in sys.modules if m == 'onnx' or m.startswith('onnx.')))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "[]"


def test_every_family_is_distinct():
    assert len({f.checkpoint_name for f in FAMILIES}) == len(FAMILIES)


def test_a_dca_repository_is_not_told_to_build_a_tensorrt_engine(tmp_path):
    """dash-triton write of a DCA model says why there is no engine instead of how to build one
    (a new user's D14)."""
    from dash_trt.serving.engine import EngineConfig
    from dash_trt.triton.repository import NO_PLAN_MESSAGE, write_repository

    written = write_repository(tmp_path / "repo", _dca_model(), engine=EngineConfig(kv_block_size=8), warmup=False)
    assert NO_PLAN_MESSAGE not in written.messages
    assert f"no TensorRT engine: {DCA.unsupported[TENSORRT]}" in written.messages
