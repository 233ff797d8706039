"""dash-triton write: the model repository, every config.pbtxt parsed with Triton's own
ModelConfig schema (tritonclient ships it), the tensorrt_plan model's I/O from the ONNX
file, and the errors a user can run into."""

import filecmp
import importlib.util
import json
import os

# dependencies of the package and of its [test] extra: missing is a failure, not a skip
import onnx  # noqa: E402
import pytest
import torch
from conftest import demo_config
from google.protobuf import text_format  # noqa: E402  (protobuf comes with tritonclient[grpc])
from tritonclient.grpc import model_config_pb2  # noqa: E402  (Triton's model-config schema)

from dash_trt import model as M
from dash_trt import triton_protocol as P
from dash_trt.attention.dash.ops import CACHE_FIELDS
from dash_trt.serving.engine import EngineConfig
from dash_trt.triton import cli
from dash_trt.triton.repository import (
    NO_PLAN_MESSAGE,
    PYTHON_MODEL_SOURCE,
    Enum,
    RepositoryError,
    onnx_io,
    to_pbtxt,
    write_repository,
)


def parse_config(path) -> "model_config_pb2.ModelConfig":
    """Parse with Triton's schema: unknown fields, bad enums or types raise ParseError."""
    with open(path, encoding="utf-8") as fh:
        return text_format.Parse(fh.read(), model_config_pb2.ModelConfig())


@pytest.fixture(scope="module")
def model():
    return M.demo_model(seed=1)


def fake_export(model, path, kv_block_size=16, dtype=onnx.TensorProto.FLOAT):
    """An ONNX file with the exported graph's interface (dash_trt.export): names, types,
    symbolic axes; Identity nodes stand in for the model."""
    from onnx import TensorProto, helper

    c = model.config
    sbs = c.dash.sparse_block_size
    per = -(-kv_block_size // sbs)
    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["num_tokens"]),
        helper.make_tensor_value_info("coords", TensorProto.INT32, ["num_tokens", 4]),
        helper.make_tensor_value_info("block_tables", TensorProto.INT32, ["num_seqs", "block_table_width"]),
        helper.make_tensor_value_info("seq_lens", TensorProto.INT32, ["num_seqs"]),
        helper.make_tensor_value_info("query_start_loc", TensorProto.INT32, ["num_seqs + 1"]),
        helper.make_tensor_value_info("prompt_lens", TensorProto.INT32, ["num_seqs"]),
        helper.make_tensor_value_info("logits_indices", TensorProto.INT64, ["num_logits"]),
    ]
    shapes = {
        "key": (dtype, [kv_block_size, c.num_key_value_heads, c.head_dim]),
        "value": (dtype, [kv_block_size, c.num_key_value_heads, c.head_dim]),
        "index_key": (dtype, [kv_block_size, c.index_head_dim]),
        "image_page": (TensorProto.INT32, [kv_block_size]),
        "summary": (TensorProto.FLOAT, [per, c.index_head_dim]),
        "summary_pages": (TensorProto.INT32, [per, 3]),
    }
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["num_logits", c.vocab_size])]
    nodes = [helper.make_node("Identity", ["input_ids"], ["ids_copy"])]
    for layer in range(c.num_hidden_layers):
        for f in CACHE_FIELDS:
            t, dims = shapes[f]
            inputs.append(helper.make_tensor_value_info(f"past.{layer}.{f}", t, ["num_kv_blocks", *dims]))
            outputs.append(helper.make_tensor_value_info(f"present.{layer}.{f}", t, ["num_kv_blocks", *dims]))
            nodes.append(helper.make_node("Identity", [f"past.{layer}.{f}"], [f"present.{layer}.{f}"]))
    nodes.append(helper.make_node("Cast", ["ids_copy"], ["ids_f"], to=TensorProto.FLOAT))
    nodes.append(helper.make_node("Expand", ["ids_f", "shape"], ["logits"]))
    graph = helper.make_graph(
        nodes,
        "dash",
        inputs,
        outputs,
        initializer=[helper.make_tensor("shape", TensorProto.INT64, [2], [1, c.vocab_size])],
    )
    onnx.save(helper.make_model(graph), str(path))
    return str(path)


def test_generation_models_parse_with_triton_schema(tmp_path, model):
    engine = EngineConfig(num_blocks=40, kv_block_size=8, prefill_chunk=32)
    written = write_repository(tmp_path / "repo", model, engine=engine)
    assert written.models == ["dash", "dash_stream"]
    assert NO_PLAN_MESSAGE in written.messages
    for name, decoupled in (("dash", False), ("dash_stream", True)):
        cfg = parse_config(tmp_path / "repo" / name / "config.pbtxt")
        assert cfg.name == name and cfg.backend == "python" and cfg.max_batch_size == 0
        assert cfg.model_transaction_policy.decoupled is decoupled
        assert [(i.name, model_config_pb2.DataType.Name(i.data_type), list(i.dims), i.optional) for i in cfg.input] == [
            (n, t, list(d), o) for n, t, d, o in P.INPUTS
        ]
        assert [(o.name, model_config_pb2.DataType.Name(o.data_type), list(o.dims)) for o in cfg.output] == [
            (n, t, list(d)) for n, t, d in P.OUTPUTS
        ]
        assert len(cfg.instance_group) == 1
        assert cfg.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_CPU
        assert cfg.instance_group[0].count == 1
        params = {k: v.string_value for k, v in cfg.parameters.items()}
        assert EngineConfig.from_json(params[P.PARAM_ENGINE]) == engine
        assert M.DashModelConfig.from_dict(json.loads(params[P.PARAM_MODEL_CONFIG])) == model.config
        assert params[P.PARAM_CHECKPOINT] == "model.pt" and params[P.PARAM_DEVICE] == "cpu"
        vdir = tmp_path / "repo" / name / "1"
        assert filecmp.cmp(vdir / "model.py", PYTHON_MODEL_SOURCE, shallow=False)
        loaded = M.load_checkpoint(vdir / "model.pt")
        assert loaded.config == model.config
        for k, v in model.state_dict().items():
            assert torch.equal(loaded.state_dict()[k], v), k
    assert "dash-triton serve" in (tmp_path / "repo" / "README.md").read_text()
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".dash-triton-")]  # no scratch left


def test_cuda_device_and_no_stream_model(tmp_path, model):
    written = write_repository(tmp_path / "repo", model, device="cuda", streaming=False, name="ocr")
    assert written.models == ["ocr"]
    cfg = parse_config(tmp_path / "repo" / "ocr" / "config.pbtxt")
    assert cfg.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_GPU
    assert not (tmp_path / "repo" / "ocr_stream").exists()


def test_data_parallel_engines_one_per_listed_gpu(tmp_path, model, capsys):
    write_repository(tmp_path / "repo", model, device="cuda", gpus=[0, 2])
    for name in ("dash", "dash_stream"):
        cfg = parse_config(tmp_path / "repo" / name / "config.pbtxt")
        group = cfg.instance_group[0]
        assert group.kind == model_config_pb2.ModelInstanceGroup.KIND_GPU and group.count == 1
        assert list(group.gpus) == [0, 2]  # Triton: one instance (engine, KV pool) on each
    for bad, device, message in (
        ([0, 0], "cuda", "distinct"),
        ([-1], "cuda", "distinct GPU ids"),
        ([0], "cpu", "--gpus needs --device cuda"),
    ):
        with pytest.raises(RepositoryError, match=message):
            write_repository(tmp_path / "bad", model, device=device, gpus=bad)
        assert not (tmp_path / "bad").exists()  # refused before anything is written
    assert cli.main(["write", "--demo", "--device", "cuda", "--gpus", "0,x", "--out", str(tmp_path / "r")]) == 2
    assert "--gpus must be comma-separated GPU ids" in capsys.readouterr().err
    assert cli.main(["write", "--demo", "--device", "cuda", "--gpus", "1", "--out", str(tmp_path / "r")]) == 0
    assert list(parse_config(tmp_path / "r" / "dash" / "config.pbtxt").instance_group[0].gpus) == [1]


@pytest.mark.parametrize(
    "dtype, triton_type",
    [
        (onnx.TensorProto.FLOAT, "TYPE_FP32"),
        (onnx.TensorProto.FLOAT16, "TYPE_FP16"),
        (onnx.TensorProto.BFLOAT16, "TYPE_BF16"),
    ],
)
def test_plan_model_from_onnx(tmp_path, model, dtype, triton_type):
    onnx_path = fake_export(model, tmp_path / "model.onnx", kv_block_size=16, dtype=dtype)
    (tmp_path / "model.plan").write_bytes(b"not a real engine: TensorRT is not installed here")
    (tmp_path / "libdash_trt_plugin_static.so").write_bytes(b"\x7fELF stand-in: registers itself")
    (tmp_path / "libdash_trt_plugin.so").write_bytes(b"\x7fELF stand-in: the plugin")
    written = write_repository(
        tmp_path / "repo",
        model,
        onnx=onnx_path,
        plan=str(tmp_path / "model.plan"),
        plugin=str(tmp_path / "libdash_trt_plugin_static.so"),
        plan_instances=2,
        plan_gpus=[0, 1],
    )
    assert written.models == ["dash", "dash_stream", "dash_plan"]
    assert NO_PLAN_MESSAGE not in written.messages
    lib = str(tmp_path / "repo" / "dash_plan" / "1" / "libdash_trt_plugin_static.so")
    # one library and one loading method: what Triton's TensorRT backend does (dlopen the
    # libraries of --backend-config=tensorrt,plugins=...); no LD_PRELOAD (it would load the
    # plugin before libnvinfer, and nothing would register)
    assert any(f"--backend-config=tensorrt,plugins={lib}" in m for m in written.messages)
    assert not any("LD_PRELOAD" in m for m in written.messages)
    plan_dir = tmp_path / "repo" / "dash_plan"
    cfg = parse_config(plan_dir / "config.pbtxt")
    assert cfg.platform == "tensorrt_plan" and cfg.max_batch_size == 0 and cfg.default_model_filename == "model.plan"
    ins = {i.name: (model_config_pb2.DataType.Name(i.data_type), list(i.dims)) for i in cfg.input}
    outs = {o.name: (model_config_pb2.DataType.Name(o.data_type), list(o.dims)) for o in cfg.output}
    c = model.config
    assert list(ins)[: len(M.MODEL_INPUTS)] == list(M.MODEL_INPUTS)
    assert ins["input_ids"] == ("TYPE_INT64", [-1])
    assert ins["coords"] == ("TYPE_INT32", [-1, 4])
    assert ins["block_tables"] == ("TYPE_INT32", [-1, -1])
    assert ins["query_start_loc"] == ("TYPE_INT32", [-1])
    assert ins["past.1.key"] == (triton_type, [-1, 16, c.num_key_value_heads, c.head_dim])
    assert ins["past.0.summary"] == ("TYPE_FP32", [-1, 1, c.index_head_dim])
    assert len(ins) == len(M.MODEL_INPUTS) + 6 * c.num_hidden_layers and len(outs) == 1 + 6 * c.num_hidden_layers
    assert outs["logits"] == ("TYPE_FP32", [-1, c.vocab_size])
    assert outs["present.0.image_page"] == ("TYPE_INT32", [-1, 16])
    group = cfg.instance_group[0]
    assert group.kind == model_config_pb2.ModelInstanceGroup.KIND_GPU
    assert group.count == 2 and list(group.gpus) == [0, 1]
    assert (plan_dir / "1" / "model.plan").read_bytes().startswith(b"not a real engine")
    assert (plan_dir / "1" / "libdash_trt_plugin_static.so").read_bytes().endswith(b"registers itself")
    assert (plan_dir / "1" / "libdash_trt_plugin.so").read_bytes().endswith(b"the plugin")
    text = (plan_dir / "config.pbtxt").read_text()
    readme = (tmp_path / "repo" / "README.md").read_text()
    for doc in (text, readme):
        assert "LD_PRELOAD" not in doc and "--backend-config=tensorrt,plugins=" in doc
        assert "libdash_trt_plugin_static.so" in doc and "ships the whole KV cache in and out" in doc.replace(
            "\n# ", " "
        )
    # either file of the build finds the other; a missing partner is named
    (tmp_path / "solo").mkdir()
    (tmp_path / "solo" / "libdash_trt_plugin.so").write_bytes(b"x")
    with pytest.raises(RepositoryError, match="libdash_trt_plugin_static.so"):
        write_repository(
            tmp_path / "repo2",
            model,
            onnx=onnx_path,
            plan=str(tmp_path / "model.plan"),
            plugin=str(tmp_path / "solo" / "libdash_trt_plugin.so"),
        )


def test_plan_model_dims_and_memory_come_from_the_build_profile(tmp_path, model, capsys):
    """dash-build (here --print-trtexec --out, which writes the same record as a build) leaves
    model.plan.profile.json; dash-triton write --plan writes the dims the profile fixes (a KV
    pool of 64 blocks, as Triton's TensorRT backend allocates every binding at the profile's
    maximum) and says how much memory that is. Without the record it says it cannot tell."""
    from dash_trt import build as B

    onnx_path = fake_export(model, tmp_path / "model.onnx", kv_block_size=16, dtype=onnx.TensorProto.FLOAT16)
    plan = tmp_path / "model.plan"
    (tmp_path / "libdash_trt_plugin_static.so").write_bytes(b"\x7fELF stand-in")
    (tmp_path / "libdash_trt_plugin.so").write_bytes(b"\x7fELF stand-in")
    kwargs = dict(onnx=onnx_path, plan=str(plan), plugin=str(tmp_path / "libdash_trt_plugin_static.so"))
    plan.write_bytes(b"not a real engine")
    written = write_repository(tmp_path / "bare", model, **kwargs)
    assert any("no model.plan.profile.json beside the plan" in m for m in written.messages)
    assert parse_config(tmp_path / "bare" / "dash_plan" / "config.pbtxt").input[-1].dims[0] == -1

    argv = [onnx_path, "--plugin", "lib.so", "--print-trtexec", "--out", str(plan), "--max-blocks", "64,64,64"]
    assert B.main([*argv, "--max-tokens", "8", "--max-seqs", "2", "--max-context", "64"]) == 0
    err = capsys.readouterr().err
    record = json.loads((tmp_path / "model.plan.profile.json").read_text())
    c = model.config
    per = -(-16 // c.dash.sparse_block_size)  # summaries per KV block
    per_block = 2 * (2 * 16 * c.num_key_value_heads * c.head_dim * 2 + 16 * c.index_head_dim * 2 + 16 * 4)
    per_block += 2 * per * (c.index_head_dim * 4 + 3 * 4)  # inputs and outputs: every binding is allocated
    assert record["kv_block_bytes"] == per_block * c.num_hidden_layers and record["kv_blocks"] == 64
    assert f"{record['binding_bytes'] / 2**30:.2f} GiB per model instance" in err
    written = write_repository(tmp_path / "repo", model, **kwargs)
    cfg = parse_config(tmp_path / "repo" / "dash_plan" / "config.pbtxt")
    ins = {i.name: list(i.dims) for i in cfg.input}
    outs = {o.name: list(o.dims) for o in cfg.output}
    assert ins["past.1.key"] == [64, 16, c.num_key_value_heads, c.head_dim]
    assert outs["present.0.image_page"] == [64, 16]
    assert ins["input_ids"] == [-1] and ins["block_tables"] == [-1, -1]  # not fixed by the profile
    assert any(f"allocates {record['binding_bytes'] / 2**30:.2f} GiB per instance" in m for m in written.messages)
    (tmp_path / "model.plan.profile.json").write_text("{not json")
    with pytest.raises(RepositoryError, match="not a dash-build profile record"):
        write_repository(tmp_path / "repo3", model, **kwargs)


@pytest.mark.skipif(
    importlib.util.find_spec("dash_trt.export") is None,
    reason="dash_trt.export (dash-export) comes with the export branch",
)
def test_plan_model_from_a_real_export(tmp_path, model):  # pragma: no cover - runs once export is merged
    from dash_trt.export import export_onnx

    path = str(tmp_path / "model.onnx")
    export_onnx(model, path, kv_block_size=16)
    ins, outs = onnx_io(path)
    want_in, want_out = onnx_io(fake_export(model, tmp_path / "fake.onnx"))
    assert ins == want_in and outs == want_out


def test_plan_needs_onnx_and_plugin_and_matching_model(tmp_path, model, monkeypatch):
    # no plugin in "this installation" either (a checkout's build folders may hold one)
    monkeypatch.setenv("DASH_TRT_PLUGIN", str(tmp_path / "absent" / "libdash_trt_plugin.so"))
    plan = tmp_path / "model.plan"
    plan.write_bytes(b"x")
    plugin = tmp_path / "libdash_trt_plugin_static.so"
    plugin.write_bytes(b"x")
    (tmp_path / "libdash_trt_plugin.so").write_bytes(b"x")
    with pytest.raises(RepositoryError, match="needs --plan, --onnx .* and --plugin"):
        write_repository(tmp_path / "a", model, plan=str(plan), plugin=str(plugin))
    with pytest.raises(RepositoryError, match="needs --plan, --onnx .* and --plugin"):
        write_repository(tmp_path / "a", model, plan=str(plan), onnx=fake_export(model, tmp_path / "m.onnx"))
    # an ONNX file of another model (3 layers, other vocabulary, KV blocks of 32)
    other = M.random_model(demo_config(3, vocab_size=400, sparse_attention_config={"dash_topk_blocks": 2}))
    with pytest.raises(
        RepositoryError, match="KV blocks of 32 tokens.*caches for 3 layers, the checkpoint has 2.*400 classes"
    ):
        write_repository(
            tmp_path / "a",
            model,
            onnx=fake_export(other, tmp_path / "o.onnx", kv_block_size=32),
            plan=str(plan),
            plugin=str(plugin),
        )
    with pytest.raises(RepositoryError, match="plan not found or empty"):
        write_repository(
            tmp_path / "a",
            model,
            onnx=fake_export(model, tmp_path / "m.onnx"),
            plan=str(tmp_path / "missing.plan"),
            plugin=str(plugin),
        )
    with pytest.raises(RepositoryError, match="ONNX file not found"):
        onnx_io(tmp_path / "nope.onnx")
    (tmp_path / "junk.onnx").write_bytes(b"\x00\x01 not protobuf")
    with pytest.raises(RepositoryError, match="not a readable ONNX model"):
        onnx_io(tmp_path / "junk.onnx")
    assert not (tmp_path / "a").exists()


def test_existing_output_and_atomic_failure(tmp_path, model, monkeypatch):
    out = tmp_path / "repo"
    write_repository(out, model, streaming=False)
    with pytest.raises(RepositoryError, match="already exists .*--force"):
        write_repository(out, model)
    # a failure half-way leaves the old repository as it was and no scratch folder
    import dash_trt.triton.repository as R

    def broken(*a, **kw):
        raise OSError("disk full")

    monkeypatch.setattr(R, "to_pbtxt", broken)
    with pytest.raises(OSError, match="disk full"):
        write_repository(out, model, force=True)
    assert parse_config(out / "dash" / "config.pbtxt").name == "dash"
    assert sorted(os.listdir(tmp_path)) == ["repo"]
    monkeypatch.undo()
    write_repository(out, model, force=True)
    assert (out / "dash_stream" / "config.pbtxt").exists()


def test_pbtxt_strings_round_trip(tmp_path):
    tricky = 'quote " backslash \\ newline \n tab \t unicode é 页 {"json": [1, 2]}'
    text = to_pbtxt(
        {
            "# ": "a comment\nover two lines",
            "name": tricky,
            "backend": "python",
            "max_batch_size": 0,
            "input": [{"name": "x", "data_type": Enum("TYPE_INT64"), "dims": [-1, 4], "optional": True}],
            "parameters": [{"key": "k", "value": {"string_value": tricky}}],
        }
    )
    cfg = text_format.Parse(text, model_config_pb2.ModelConfig())
    assert cfg.name == tricky and cfg.parameters["k"].string_value == tricky
    assert list(cfg.input[0].dims) == [-1, 4] and cfg.input[0].optional


def test_cli_write(tmp_path, model, capsys):
    ckpt = tmp_path / "model.pt"
    M.save_checkpoint(model, ckpt)
    onnx_path = fake_export(model, tmp_path / "model.onnx", kv_block_size=8)
    rc = cli.main(
        [
            "write",
            str(ckpt),
            "--out",
            str(tmp_path / "repo"),
            "--onnx",
            onnx_path,
            "--num-blocks",
            "99",
            "--max-new-tokens",
            "7",
            "--no-kv-on-demand",
            "--max-pages-in-flight",
            "12",
        ]
    )
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "no --plan given" in captured.err and "models dash, dash_stream" in captured.out
    engine = EngineConfig.from_json(
        parse_config(tmp_path / "repo" / "dash" / "config.pbtxt").parameters[P.PARAM_ENGINE].string_value
    )
    assert engine.kv_block_size == 8  # taken from the ONNX graph
    assert engine.num_blocks == 99 and engine.default_max_new_tokens == 7
    assert engine.kv_on_demand is False and EngineConfig().kv_on_demand is True
    assert engine.max_pages_in_flight == 12 and EngineConfig().max_pages_in_flight == 0
    assert filecmp.cmp(ckpt, tmp_path / "repo" / "dash" / "1" / "model.pt", shallow=False)
    # errors: exit code 2 with a message
    assert cli.main(["write", str(ckpt), "--out", str(tmp_path / "repo")]) == 2
    assert "already exists" in capsys.readouterr().err
    assert cli.main(["write", str(tmp_path / "nope.pt"), "--out", str(tmp_path / "r2")]) == 2
    assert "checkpoint not found" in capsys.readouterr().err
    assert cli.main(["write", "--demo", "--out", str(tmp_path / "r3"), "--num-blocks", "0"]) == 2
    assert "'num_blocks' must be a positive integer" in capsys.readouterr().err
    assert cli.main(["write", "--out", str(tmp_path / "r4")]) == 2
    assert "give a checkpoint" in capsys.readouterr().err
    assert cli.main(["serve", str(tmp_path / "missing")]) == 2
    assert "model repository not found" in capsys.readouterr().err


def test_the_server_is_located_without_importing_pytriton():
    """pytriton's package imports its own server stack (gevent, zmq, aiohttp...), which a
    machine with only the binary's needs lacks: the binary is found by the package's path."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from dash_trt.triton.server import find_tritonserver, TritonUnavailable\n"
        "try:\n"
        "    dist = find_tritonserver()\n"
        "    print('found', dist.binary.endswith('bin/tritonserver'))\n"
        "except TritonUnavailable as exc:\n"
        "    print('unavailable', exc)\n"
        "print('imported', 'pytriton' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "imported False" in out, out
    assert "found True" in out or "unavailable" in out, out


def test_force_replaces_only_a_repository_it_wrote(tmp_path, model):
    """`--force` never deletes a folder that is not a dash-triton repository (issue: `write
    --out . --force` emptied a working folder): a folder with other files, or a file, is
    refused and left as it was; an empty folder or a marked repository is replaced."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    with pytest.raises(RepositoryError, match="replaces only a repository that dash-triton wrote"):
        write_repository(work, model, streaming=False, force=True)
    assert os.listdir(work) == ["notes.txt"] and (work / "notes.txt").read_text() == "mine"
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(RepositoryError, match="is a file"):
        write_repository(afile, model, force=True)
    empty = tmp_path / "empty"
    empty.mkdir()
    write_repository(empty, model, streaming=False, force=True)
    assert (empty / ".dash-trt-repository").is_file()
    write_repository(empty, model, streaming=False, force=True)  # its own repository: replaced whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "empty", "work"]  # no scratch left


def test_force_replaces_a_repository_triton_has_served(tmp_path, model):
    """Triton's Python backend writes __pycache__/*.pyc beside a served model.py: --force still
    replaces the repository; anything else in such a folder is the user's and refuses it."""
    out = tmp_path / "repo"
    write_repository(out, model, streaming=False)
    cache = out / "dash" / "1" / "__pycache__"
    cache.mkdir()
    (cache / "model.cpython-312.pyc").write_bytes(b"\x00" * 64)
    write_repository(out, model, streaming=False, force=True)
    assert not cache.exists() and (out / "dash" / "1" / "model.py").is_file()
    cache.mkdir()
    (cache / "notes.txt").write_text("mine")
    with pytest.raises(RepositoryError, match=r"did not write there.*__pycache__/notes\.txt"):
        write_repository(out, model, streaming=False, force=True)
    assert (cache / "notes.txt").read_text() == "mine"


def test_force_replaces_only_what_it_wrote(tmp_path, model):
    """A repository with a file this tool did not write there (in any folder), a file changed
    since, or a marker planted in a user's folder (no list of what was written, or a list that
    does not match) is refused and left as it was."""
    from dash_trt.triton.repository import MARKER

    out = tmp_path / "repo"
    write_repository(out, model, streaming=False)
    (out / "dash" / "notes.txt").write_text("mine")
    with pytest.raises(RepositoryError, match=r"holds what dash-triton did not write there.*dash/notes\.txt"):
        write_repository(out, model, streaming=False, force=True)
    assert (out / "dash" / "notes.txt").read_text() == "mine"
    (out / "dash" / "notes.txt").unlink()
    with open(out / "dash" / "config.pbtxt", "a") as fh:
        fh.write("# my edit\n")
    with pytest.raises(RepositoryError, match=r"or changed since: dash/config\.pbtxt"):
        write_repository(out, model, streaming=False, force=True)
    assert (out / "dash" / "config.pbtxt").read_text().endswith("# my edit\n")
    # a marker planted among user files: the old one-line marker, then a copied one
    user = tmp_path / "user"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    (user / MARKER).write_text("A Triton model repository written by `dash-triton write`\n")
    with pytest.raises(RepositoryError, match="does not list what dash-triton wrote there"):
        write_repository(user, model, streaming=False, force=True)
    (user / MARKER).write_text((tmp_path / "repo" / MARKER).read_text())
    with pytest.raises(RepositoryError, match="did not write there, or changed since: notes.txt"):
        write_repository(user, model, streaming=False, force=True)
    assert sorted(os.listdir(user)) == sorted([MARKER, "notes.txt"]) and (user / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_repository_modes_follow_the_umask_or_private(tmp_path, model, umask):
    """Files and folders get the umask's modes (a server running as another user can read a
    repository written under umask 022; the temporary folder's 0700 and the checkpoint's 0600
    are not kept); --private makes everything the owner's only."""
    import stat

    def modes(root):
        found = {}
        for path in [root, *root.rglob("*")]:
            found[str(path.relative_to(root))] = stat.S_IMODE(path.stat().st_mode)
        return found

    old = os.umask(umask)
    try:
        write_repository(tmp_path / "repo", model, streaming=False)
        write_repository(tmp_path / "private", model, streaming=False, private=True)
    finally:
        os.umask(old)
    got = modes(tmp_path / "repo")
    assert got["."] == 0o777 & ~umask and got["dash/1"] == 0o777 & ~umask, got
    assert got["dash/1/model.pt"] == 0o666 & ~umask and got["dash/config.pbtxt"] == 0o666 & ~umask, got
    assert set(got.values()) == {0o777 & ~umask, 0o666 & ~umask}, got
    got = modes(tmp_path / "private")
    assert {m for p, m in got.items() if (tmp_path / "private" / p).is_dir()} == {0o700}, got
    assert {m for p, m in got.items() if (tmp_path / "private" / p).is_file()} == {0o600}, got


def test_write_checks_the_model_contract_the_server_would_refuse(tmp_path, capsys):
    """A DashForCausalLM whose image_feature_dim (24) is not its hidden size (128) cannot take its
    image features: the server refused it only when loading it (and Triton then exited); write
    refuses it, exit 2, and writes nothing. With the hidden size as the dim it is written."""
    from dash_trt.models.config import DashModelConfig

    bad = M.random_model(DashModelConfig.from_dict(demo_config(image_feature_dim=24)), seed=0)
    M.save_checkpoint(bad, tmp_path / "bad.pt")
    assert cli.main(["write", str(tmp_path / "bad.pt"), "--out", str(tmp_path / "repo")]) == 2
    err = capsys.readouterr().err
    assert "takes image features of 128 values (hidden_size), got 24" in err, err
    assert sorted(os.listdir(tmp_path)) == ["bad.pt"]
    good = M.random_model(DashModelConfig.from_dict(demo_config(image_feature_dim=128)), seed=0)
    write_repository(tmp_path / "repo", good, streaming=False)


def test_write_hints_name_what_write_takes(tmp_path, model, capsys):
    """What dash-triton write says to do about a checkpoint it cannot load works with write: a
    model.pt without its config -> a folder with it as model.pt beside config.json (which write
    then takes); an architecture that is not built in -> --model, an option write has (it named
    dash-export's)."""
    import json
    import shutil

    bare = tmp_path / "bare.pt"
    torch.save({"state_dict": model.state_dict()}, bare)
    assert cli.main(["write", str(bare), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "give a folder holding it as model.pt beside the model's config.json" in err, err
    folder = tmp_path / "folder"
    folder.mkdir()
    shutil.copy(bare, folder / "model.pt")
    (folder / "config.json").write_text(json.dumps(model.config.to_dict()))
    assert cli.main(["write", str(folder), "--out", str(tmp_path / "r"), "--no-stream-model"]) == 0, capsys.readouterr()
    capsys.readouterr()
    (folder / "config.json").write_text(json.dumps({**model.config.to_dict(), "architectures": ["NotBuiltIn"]}))
    assert cli.main(["write", str(folder), "--out", str(tmp_path / "r2")]) == 2
    err = capsys.readouterr().err
    assert "pass the class with --model module:Class" in err and "dash-triton write" in err, err
    # ... and write takes --model (here a module that does not exist: its own error, not "unrecognized")
    assert cli.main(["write", str(folder), "--model", "no_such_module:Model", "--out", str(tmp_path / "r2")]) == 2
    assert "cannot import no_such_module" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["a$(touch pwned)b", "x;y", "with space", "q'uote", "back`tick`"])
def test_paths_a_shell_would_run_are_refused(tmp_path, model, name, capsys):
    """Triton's Python backend starts a model's stub through a shell with the model's path in
    it: write and serve refuse paths with shell metacharacters instead of letting it run them."""
    from dash_trt.triton import cli

    with pytest.raises(RepositoryError, match="starts its models through a shell"):
        write_repository(tmp_path / name, model, streaming=False)
    assert not (tmp_path / name).exists() and not (tmp_path / "pwned").exists()
    (tmp_path / name).mkdir()
    assert cli.main(["serve", str(tmp_path / name)]) == 2
    assert "starts its models through a shell" in capsys.readouterr().err


class _WatchedServer:
    """A stand-in for TritonServer in `dash-triton serve`'s watch loop: one model worker (pid
    4242), a server that is alive or already exited (killed by SIGABRT) at the first poll."""

    def __init__(self, alive: bool):
        self._alive, self.calls = alive, []
        self.log_path, self.http_url, self.grpc_url, self.metrics_port = "/x/log", "h", "g", None
        self.returncode = None if alive else -6
        self.leftovers = {"workers": [], "shm": []}

    def __call__(self, *args, **kwargs):  # constructed by serve_main
        return self

    def start(self, timeout, cancel=None):
        self.calls.append("start")

    def workers(self):
        return {4242: "/r/dash/1/model.py"}

    def alive(self):
        return self._alive

    def log_tail(self):
        return "terminate called after throwing an instance of 'PythonBackendException'"

    def drain(self, grace):
        self.calls.append("drain")
        return True, []

    def stop(self, kill=False):
        self.calls.append(f"stop(kill={kill})")
        self._alive = False
        return -9

    def cleanup(self):
        self.calls.append("cleanup")


@pytest.mark.parametrize("server_alive", [True, False])
def test_serve_names_a_dead_worker_even_when_the_server_went_with_it(tmp_path, monkeypatch, capsys, server_alive):
    """A model worker found dead: serve names it and exits 3, whether tritonserver still runs
    (serve kills it) or Triton's Python backend already aborted the server in the same poll
    interval (seen on a CPU machine: the stub's death raised an uncaught exception in Triton)."""
    from dash_trt.triton import server as S

    fake = _WatchedServer(alive=server_alive)
    monkeypatch.setattr(S, "TritonServer", fake)
    monkeypatch.setattr(S, "process_info", lambda pid: None)  # the worker is gone
    assert cli.main(["serve", str(tmp_path)]) == 3
    err = capsys.readouterr().err
    assert "a model worker died (pid 4242, /r/dash/1/model.py)" in err, err
    if server_alive:
        assert fake.calls == ["start", "stop(kill=True)", "cleanup"]  # the only model: nothing to drain
    else:
        assert "and tritonserver exited (killed by SIGABRT)" in err and "PythonBackendException" in err, err
        assert fake.calls == ["start", "cleanup"]
