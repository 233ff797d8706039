"""dash-build without TensorRT: argument errors, the no-TensorRT message, profile derivation,
the equivalent trtexec command and the engine summary. Building itself needs TensorRT and a
GPU and is not tested here (the ``trt`` marker would select it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dash_trt import build as B
from dash_trt.build import InputSpec, Limit, ProfileError

# The export interface (dash_trt/export.py on the export branch): T tokens, B sequences,
# NB KV blocks of 16 tokens, W block-table width.
EXPORT_INPUTS = [
    InputSpec("input_ids", (-1,), ("num_tokens",)),
    InputSpec("coords", (-1, 4), ("num_tokens", None)),
    InputSpec("block_tables", (-1, -1), ("num_seqs", "block_table_width")),
    InputSpec("seq_lens", (-1,), ("num_seqs",)),
    InputSpec("query_start_loc", (-1,), ("num_seqs + 1",)),
    InputSpec("prompt_lens", (-1,), ("num_seqs",)),
    InputSpec("logits_indices", (-1,), ("num_logits",)),
    InputSpec("past.0.key", (-1, 16, 2, 64), ("num_kv_blocks", None, None, None)),
    InputSpec("past.0.image_page", (-1, 16), ("num_kv_blocks", None)),
    InputSpec("past.0.summary_pages", (-1, 1, 3), ("num_kv_blocks", None, None)),
]


@pytest.fixture
def files(tmp_path):
    model = tmp_path / "model.onnx"
    plugin = tmp_path / "libdash_trt_plugin.so"
    model.write_bytes(b"not parsed before TensorRT is found")
    plugin.write_bytes(b"\x7fELF")
    return model, plugin, tmp_path / "model.plan"


@pytest.fixture
def no_tensorrt(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # `import tensorrt` raises ImportError


def test_without_tensorrt_a_message_and_exit_code_2(files, no_tensorrt, capsys):
    model, plugin, out = files
    assert B.main([str(model), "--plugin", str(plugin), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "TensorRT not found: pip install tensorrt" in err
    assert "Traceback" not in err
    assert not out.exists()


def test_console_script_without_tensorrt(files):
    """The installed entry point, in a fresh interpreter: no traceback, exit code 2."""
    model, plugin, out = files
    code = (
        "import sys; sys.modules['tensorrt'] = None; from dash_trt.build import main; "
        f"sys.exit(main([{str(model)!r}, '--plugin', {str(plugin)!r}, '--out', {str(out)!r}]))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "TensorRT not found" in r.stderr and "Traceback" not in r.stderr


def test_entry_point_is_declared():
    from importlib.metadata import entry_points

    scripts = {e.name: e.value for e in entry_points(group="console_scripts")}
    # a packaging regression fails here (it used to skip): the metadata must declare the command
    assert scripts.get("dash-build") == "dash_trt.build:main", "dash-build is not declared (pyproject.toml scripts)"


@pytest.mark.parametrize(
    "version, extra, message",
    [
        ("10.7.0.23", [], "TensorRT 10.7.0.23 is installed; the DashAttention plugin needs TensorRT >= 10.8"),
        ("11.1.0.106", ["--fp16"], "builds strongly typed engines only"),
        ("10.8.0.43", ["--bf16"], "builds strongly typed engines only"),
    ],
)
def test_unusable_tensorrt_versions(files, monkeypatch, capsys, version, extra, message):
    import types

    monkeypatch.setitem(sys.modules, "tensorrt", types.SimpleNamespace(__version__=version))
    model, plugin, out = files
    assert B.main([str(model), "--plugin", str(plugin), "--out", str(out), *extra]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["missing.onnx", "--plugin", "{plugin}", "--out", "{out}"], "model not found: missing.onnx"),
        (["{model}", "--plugin", "nope.so", "--out", "{out}"], "plugin library not found: nope.so"),
        (["{model}", "--plugin", "{plugin}"], "--out is required"),
        (["{model}", "--plugin", "{plugin}", "--out", "/no/such/dir/m.plan"], "the folder of --out does not exist"),
        (["{model}", "--plugin", "{plugin}", "--out", "{out}", "--fp16"], "export the model in float16 or bfloat16"),
        (["{model}", "--plugin", "{plugin}", "--out", "{out}", "--kv-pool-gib", "1", "--max-blocks", "9"], "drop"),
        (["{model}", "--plugin", "{plugin}", "--out", "{out}", "--kv-pool-gib", "-1"], "positive number of GiB"),
        (["{model}", "--plugin", "{plugin}", "--out", "{out}", "--config", "nope.json"], "config not found"),
        (["{model}", "--plugin", "{plugin}", "--out", "{out}", "--workspace", "0"], "--workspace must be >= 1"),
        (["{model}", "--plugin", "{plugin}", "--out", "{plugin}"], "is --plugin: the engine would overwrite it"),
        (["{model}", "--plugin", "{plugin}", "--out", "{model}"], "is the model: the engine would overwrite it"),
        (["{model}", "--out", "{out}"], "no TensorRT plugin library in this installation: pass --plugin"),
    ],
)
def test_argument_errors_exit_2(files, no_tensorrt, capsys, monkeypatch, argv, message):
    model, plugin, out = files
    monkeypatch.setenv("DASH_TRT_PLUGIN", str(out.parent / "absent.so"))  # no plugin installed
    argv = [a.format(model=model, plugin=plugin, out=out) for a in argv]
    assert B.main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["0", "a", "1,2", "8,4,16", "-1,1,2", "1,2,3,4"])
def test_bad_limits_are_usage_errors(files, capsys, bad):
    model, plugin, out = files
    with pytest.raises(SystemExit) as e:
        B.main([str(model), "--plugin", str(plugin), "--out", str(out), "--max-tokens", bad])
    assert e.value.code == 2
    assert "--max-tokens" in capsys.readouterr().err


def test_bad_shape_override_is_a_usage_error(files, capsys):
    model, plugin, out = files
    for bad in ("x:1:2", "x:1x2:1:1", "x:4:2:8", "x:a:b:c"):
        with pytest.raises(SystemExit) as e:
            B.main([str(model), "--plugin", str(plugin), "--out", str(out), "--shape", bad])
        assert e.value.code == 2


def test_limit_parsing():
    assert Limit.parse("8192", default_opt=lambda m: 256) == Limit(1, 256, 8192)
    assert Limit.parse("100", default_opt=lambda m: 256) == Limit(1, 100, 100)
    assert Limit.parse("2,16,64") == Limit(2, 16, 64)
    assert Limit(1, 2, 3).shifted(1) == Limit(2, 3, 4)
    with pytest.raises(ValueError, match="need 0 <= min <= opt <= max and max >= 1, got 64,16,4"):
        Limit.parse("64,16,4")


def test_dim_roles():
    assert B.dim_role("num_tokens") == ("tokens", 0)
    assert B.dim_role("num_seqs + 1") == ("seqs", 1)
    assert B.dim_role("(num_seqs+1)") == ("seqs", 1)
    assert B.dim_role("num_kv_blocks") == ("blocks", 0)
    assert B.dim_role("block_table_width") == ("width", 0)
    assert B.dim_role("s0") is None and B.dim_role(None) is None


def test_profile_from_the_export_interface():
    limits = B.derive_limits(EXPORT_INPUTS, tokens=Limit(1, 64, 4096), seqs=Limit(1, 8, 32), max_context=1000)
    assert limits["width"] == Limit(1, 63, 63)  # ceil(1000 / 16): 4096 > 1000, so opt = max
    assert limits["blocks"] == Limit(1, 8 * 63, 32 * 63)
    shapes = B.profile_shapes(EXPORT_INPUTS, limits)
    assert shapes["input_ids"] == ((1,), (64,), (4096,))
    assert shapes["coords"] == ((1, 4), (64, 4), (4096, 4))
    assert shapes["block_tables"] == ((1, 1), (8, 63), (32, 63))
    assert shapes["query_start_loc"] == ((2,), (9,), (33,))
    assert shapes["past.0.key"] == ((1, 16, 2, 64), (504, 16, 2, 64), (2016, 16, 2, 64))
    assert shapes["past.0.summary_pages"][2] == (2016, 1, 3)
    # rows scored: a few per step when serving, every new token in the checks
    assert shapes["logits_indices"] == ((1,), (8,), (4096,))


def test_default_limits_and_context():
    limits = B.derive_limits(EXPORT_INPUTS)
    assert limits["tokens"] == Limit(1, 256, 8192) and limits["seqs"] == Limit(1, 16, 64)
    assert limits["width"] == Limit(1, 4096 // 16, 32768 // 16)


def test_config_checks_the_kv_block_size():
    cfg = B.DashConfig.from_dict({"sparse_block_size": 32, "sparse_local_block": 1, "sparse_index_dim": 64})
    with pytest.raises(ProfileError, match="KV block size 16 is not a whole multiple of sparse_block_size 32"):
        B.derive_limits(EXPORT_INPUTS, config=cfg)


def test_unknown_dynamic_dims_need_an_explicit_shape():
    inputs = EXPORT_INPUTS + [InputSpec("pixel_values", (-1, 3), ("s7", None))]
    limits = B.derive_limits(EXPORT_INPUTS)
    with pytest.raises(ProfileError, match=r"input pixel_values dim 0 \(named 's7'\).*--shape pixel_values"):
        B.profile_shapes(inputs, limits)
    shapes = B.profile_shapes(inputs, limits, {"pixel_values": ((1, 3), (2, 3), (4, 3))})
    assert shapes["pixel_values"] == ((1, 3), (2, 3), (4, 3))
    with pytest.raises(ProfileError, match="fixed at 3"):
        B.profile_shapes(inputs, limits, {"pixel_values": ((1, 2), (2, 3), (4, 3))})
    with pytest.raises(ProfileError, match="does not have: nope"):
        B.profile_shapes(inputs, limits, {"nope": ((1,), (1,), (1,))})


def test_table_width_needs_a_cache_input_or_a_limit():
    inputs = [s for s in EXPORT_INPUTS if not s.name.startswith("past.")]
    with pytest.raises(ProfileError, match="--max-table-width"):
        B.derive_limits(inputs)
    assert B.derive_limits(inputs, width=Limit(1, 4, 8))["blocks"] == Limit(1, 64, 512)


def test_trtexec_command():
    limits = B.derive_limits(EXPORT_INPUTS, tokens=Limit(1, 64, 4096), seqs=Limit(1, 8, 32), max_context=1000)
    shapes = B.profile_shapes(EXPORT_INPUTS[:3], limits)
    cmd = B.trtexec_command("m.onnx", "lib.so", "m.plan", shapes, timing_cache="t.cache", workspace_mib=4096)
    flat = cmd.replace(" \\\n    ", " ")
    assert flat.startswith("trtexec --onnx=m.onnx --dynamicPlugins=lib.so ")
    assert "--minShapes=input_ids:1,coords:1x4,block_tables:1x1 " in flat
    assert "--optShapes=input_ids:64,coords:64x4,block_tables:8x63 " in flat
    assert "--maxShapes=input_ids:4096,coords:4096x4,block_tables:32x63 " in flat
    for flag in (
        "--stronglyTyped",
        "--preview=+aliasedPluginIO1003",
        "--timingCacheFile=t.cache",
        "--memPoolSize=workspace:4096M",
        "--skipInference",
        "--saveEngine=m.plan",
    ):
        assert flag in flat
    plain = B.trtexec_command("m.onnx", "lib.so", "m.plan", shapes, aliasing=False)
    assert "--stronglyTyped" in plain and "--preview" not in plain  # strongly typed whatever else is asked


def test_trtexec_command_follows_the_tensorrt_version():
    """trtexec's options per release (samples/common/sampleOptions.cpp): --stronglyTyped on 10.x
    (11.x has only strong typing and no --fp16/--bf16); --enablePluginOverride exists from 10.15
    and is needed only for nodes without plugin_namespace; paths are shell-quoted."""
    limits = B.derive_limits(EXPORT_INPUTS, tokens=Limit(1, 64, 4096), seqs=Limit(1, 8, 32), max_context=1000)
    shapes = B.profile_shapes(EXPORT_INPUTS[:3], limits)
    v11 = B.trtexec_command("m.onnx", "lib.so", "m.plan", shapes, trt_version=(11, 1))
    assert "--stronglyTyped" not in v11 and "--preview=+aliasedPluginIO1003" in v11
    assert "--stronglyTyped" in B.trtexec_command("m.onnx", "lib.so", "m.plan", shapes, trt_version=(10, 16))
    assert "--enablePluginOverride" in B.trtexec_command(
        "m.onnx", "l.so", "p", shapes, trt_version=(10, 15), plugin_override=True
    )
    assert "--enablePluginOverride" not in B.trtexec_command(
        "m.onnx", "l.so", "p", shapes, trt_version=(10, 8), plugin_override=True
    )
    assert "--enablePluginOverride" not in B.trtexec_command("m.onnx", "l.so", "p", shapes, trt_version=(11, 1))
    hostile = B.trtexec_command("my model $(rm -rf x).onnx", "lib;ls.so", "out plan", shapes)
    flat = hostile.replace(" \\\n    ", " ")
    assert "--onnx='my model $(rm -rf x).onnx'" in flat and "--dynamicPlugins='lib;ls.so'" in flat
    assert "--saveEngine='out plan'" in flat


def test_engine_summary():
    info = {
        "Layers": [
            {
                "Name": "/layers.0/attn/DashAttention",
                "LayerType": "PluginV3",
                "Inputs": [{"Name": "q"}],
                "Outputs": [{"Name": "out"}],
            },
            {
                "Name": "copy of past.0.key",
                "LayerType": "Reformat",
                "Inputs": [{"Name": "past.0.key"}],
                "Outputs": [{"Name": "past.0.key copy"}],
            },
            {"Name": "matmul", "LayerType": "Myelin"},
        ]
    }
    lines = B.summarize_engine(json.dumps(info))
    assert lines[0] == "3 layers: 1 PluginV3, 1 Reformat, 1 Myelin"
    assert "DashAttention plugin layers: 1" in lines
    assert "copy/reformat layers: 1" in lines
    assert any("past.0.key -> past.0.key copy" in line for line in lines)
    assert B.summarize_engine({"Layers": ["a", "b"]})[0].startswith("2 layers (names only")
    assert B.summarize_engine({})[0] == "engine inspector: no layer information"


# ------------------------------------------------------------------- with the onnx package
def _tiny_onnx(path, *, kv_block=16, metadata=True, node=False, present=False):
    import onnx  # a dependency of the package: missing is a failure, not a skip
    from onnx import TensorProto, helper

    def vi(name, elem, dims):
        return helper.make_tensor_value_info(name, elem, dims)

    inputs = [
        vi("input_ids", TensorProto.INT64, ["num_tokens"]),
        vi("coords", TensorProto.INT32, ["num_tokens", 4]),
        vi("block_tables", TensorProto.INT32, ["num_seqs", "block_table_width"]),
        vi("query_start_loc", TensorProto.INT32, ["num_seqs + 1"]),
        vi("past.0.key", TensorProto.FLOAT16, ["num_kv_blocks", kv_block, 2, 64]),
    ]
    outputs = [vi("ids_out", TensorProto.INT64, ["num_tokens"])]
    nodes = [helper.make_node("Identity", ["input_ids"], ["ids_out"])]
    if present:
        outputs.append(vi("present.0.key", TensorProto.FLOAT16, ["num_kv_blocks", kv_block, 2, 64]))
        nodes.append(helper.make_node("Identity", ["past.0.key"], ["present.0.key"]))
    if node:
        nodes.append(
            helper.make_node(
                "DashAttention",
                ["coords"],
                ["unused"],
                domain="dash_trt",
                sparse_block_size=32,
                sparse_local_block=1,
                sparse_index_dim=64,
                dash_topk_blocks=4,
                layer_idx=0,
                sparse_main_rope_tok_freq_mode="",
                plugin_version="2",
                **({} if node == "no-namespace" else {"plugin_namespace": ""}),
            )
        )
    graph = helper.make_graph(nodes, "tiny", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("dash_trt", 1)])
    if metadata:
        helper.set_model_props(
            model,
            {
                "sparse_attention_config": json.dumps(
                    {"sparse_block_size": 16, "sparse_local_block": 1, "sparse_index_dim": 64}
                )
            },
        )
    onnx.save(model, str(path))
    return path


def test_print_trtexec_reads_the_model(tmp_path, capsys, no_tensorrt, monkeypatch):
    monkeypatch.chdir(tmp_path)  # --out t.plan: its profile record lands beside it
    model = _tiny_onnx(tmp_path / "tiny.onnx")
    code = B.main(
        [
            str(model),
            "--plugin",
            "build/libdash_trt_plugin.so",
            "--print-trtexec",
            "--out",
            "t.plan",
            "--max-tokens",
            "1,32,512",
            "--max-seqs",
            "4",
            "--max-context",
            "256",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    flat = out.replace(" \\\n    ", " ")
    assert "--dynamicPlugins=build/libdash_trt_plugin.so" in flat
    assert ("--maxShapes=input_ids:512,coords:512x4,block_tables:4x16,query_start_loc:5,past.0.key:64x16x2x64 ") in flat
    assert "--saveEngine=t.plan" in flat
    assert (tmp_path / "t.plan.profile.json").is_file() and not (tmp_path / "t.plan").exists()


def test_print_trtexec_needs_no_plugin_file(tmp_path, capsys, no_tensorrt, monkeypatch):
    """--print-trtexec only prints: with no --plugin and none installed, the command names the
    library to build (a note says so) instead of refusing."""
    monkeypatch.setenv("DASH_TRT_PLUGIN", str(tmp_path / "absent.so"))  # no plugin found anywhere
    model = _tiny_onnx(tmp_path / "tiny.onnx")
    assert B.main([str(model), "--print-trtexec", "--max-tokens", "32", "--max-seqs", "2", "--max-context", "64"]) == 0
    out, err = capsys.readouterr()
    assert f"--dynamicPlugins={B.PLUGIN_PLACEHOLDER}" in out.replace(" \\\n    ", " ")
    assert "no TensorRT plugin library in this installation" in err
    assert B.main([str(model), "--out", str(tmp_path / "m.plan")]) == 2  # building still needs it
    assert "no TensorRT plugin library" in capsys.readouterr().err


@pytest.mark.parametrize("source", ["metadata", "node"])
def test_print_trtexec_checks_the_config(tmp_path, capsys, source):
    model = _tiny_onnx(tmp_path / "tiny.onnx", kv_block=24, metadata=source == "metadata", node=source == "node")
    assert B.main([str(model), "--plugin", "x.so", "--print-trtexec"]) == 2
    sbs = 16 if source == "metadata" else 32
    assert f"KV block size 24 is not a whole multiple of sparse_block_size {sbs}" in capsys.readouterr().err


def test_print_trtexec_per_version_and_for_old_exports(tmp_path, capsys, no_tensorrt):
    marked = _tiny_onnx(tmp_path / "marked.onnx", node=True)
    old = _tiny_onnx(tmp_path / "old.onnx", node="no-namespace")
    base = ["--plugin", "lib.so", "--print-trtexec", "--max-tokens", "8", "--max-seqs", "2", "--max-context", "64"]
    assert B.main([str(marked), *base, "--trt-version", "10.15"]) == 0
    out, err = capsys.readouterr()
    assert "--enablePluginOverride" not in out and "--stronglyTyped" in out
    assert B.main([str(old), *base, "--trt-version", "10.15"]) == 0
    out, err = capsys.readouterr()
    assert "--enablePluginOverride" in out and "no plugin_namespace attribute" in err
    assert B.main([str(marked), *base, "--trt-version", "11.1", "--fp16"]) == 2
    assert "strongly typed engines only" in capsys.readouterr().err
    assert B.main([str(marked), *base, "--trt-version", "10.7"]) == 2
    assert "needs TensorRT >= 10.8" in capsys.readouterr().err
    assert B.main([str(marked), *base]) == 0  # no tensorrt package: says which version it assumed
    assert "the command is for TensorRT 10.8 (the oldest supported" in capsys.readouterr().err
    assert B.main([str(marked), *base, "--trt-version", "eleven"]) == 2
    assert "--trt-version must be MAJOR.MINOR" in capsys.readouterr().err


def test_print_trtexec_without_onnx(files, monkeypatch, capsys):
    model, plugin, _ = files
    monkeypatch.setitem(sys.modules, "onnx", None)
    assert B.main([str(model), "--plugin", str(plugin), "--print-trtexec"]) == 2
    assert "pip install onnx" in capsys.readouterr().err


@pytest.mark.trt
def test_real_tensorrt_refuses_a_missing_plugin(files):
    """With TensorRT installed: the argument checks run before TensorRT is touched."""
    model, _, out = files
    assert B.main([str(model), "--plugin", os.fspath(out) + ".so", "--out", str(out)]) == 2


def test_loading_the_plugin_is_checked():
    """dash-build and dash-compare both use load_plugin_library: a library TensorRT cannot load,
    or one that registers no DashAttention creator, is an error with a message."""

    class Registry:
        def __init__(self, handle, creator):
            self.handle, self.creator = handle, creator

        def load_library(self, path):
            if self.handle == "raise":
                raise RuntimeError("dlopen failed: undefined symbol")
            return self.handle

        def get_creator(self, name, version, namespace):
            # the creator plugins/trt/dash_plugin.h registers (kPluginName, kPluginVersion, no namespace)
            return self.creator if (name, version, namespace) == ("DashAttention", "2", "") else None

    class Loaded(Registry):  # the library was loaded before in this process: its creator is there
        def load_library(self, path):
            raise AssertionError("loaded twice: TensorRT would refuse the second registration")

    assert B.load_plugin_library(Loaded(None, object()), "p.so") is None
    assert "could not load p.so: dlopen failed" in B.load_plugin_library(Registry("raise", None), "p.so")
    assert "could not load p.so (see the TensorRT log" in B.load_plugin_library(Registry(None, None), "p.so")
    assert "registers no DashAttention v2 creator" in B.load_plugin_library(Registry(object(), None), "p.so")
    header = (Path(__file__).resolve().parents[1] / "plugins" / "trt" / "dash_plugin.h").read_text()
    assert 'kPluginVersion = "2";' in header and 'kPluginName = "DashAttention";' in header


def test_image_feature_inputs_get_a_profile_from_zero_rows_to_one_per_token():
    """A model that takes image features (docs/models.md) exports two more inputs; their
    dims have roles, so no --shape is needed and a step without features (0 rows) fits."""
    inputs = EXPORT_INPUTS + [
        InputSpec("image_features", (-1, 40), ("num_image_features", None)),
        InputSpec("image_feature_index", (-1,), ("num_tokens",)),
    ]
    limits = B.derive_limits(inputs, tokens=Limit(1, 128, 4096))
    shapes = B.profile_shapes(inputs, limits)
    assert shapes["image_features"] == ((0, 40), (128, 40), (4096, 40))
    assert shapes["image_feature_index"] == shapes["input_ids"] == ((1,), (128,), (4096,))


def test_io_memory_and_the_kv_pool_budget(tmp_path, capsys, no_tensorrt):
    """What Triton's TensorRT backend allocates (every input and output at the profile's maximum),
    printed and recorded beside --out; --kv-pool-gib sizes the block count to a budget."""
    model = _tiny_onnx(tmp_path / "tiny.onnx", present=True)
    out = tmp_path / "t.plan"
    base = [str(model), "--plugin", "lib.so", "--print-trtexec", "--out", str(out)]
    small = ["--max-tokens", "8", "--max-seqs", "2", "--max-context", "64"]  # table width 4
    assert B.main([*base, *small, "--kv-pool-gib", "0.5"]) == 0
    stdout, err = capsys.readouterr()
    per_block = 2 * 16 * 2 * 64 * 2  # past.0.key and present.0.key, float16
    blocks = 2**29 // per_block
    assert f"past.0.key:{blocks}x16x2x64 " in stdout.replace(" \\\n    ", " ") + " "
    total = 8 * 8 + 8 * 4 * 4 + 2 * 4 * 4 + 3 * 4 + 8 * 8 + blocks * per_block
    record = json.loads((tmp_path / "t.plan.profile.json").read_text())
    assert record["binding_bytes"] == total and record["kv_blocks"] == blocks and record["kv_block_bytes"] == per_block
    assert record["profile"]["past.0.key"][2] == [blocks, 16, 2, 64]
    assert f"{total / 2**30:.2f} GiB per model instance, of which the KV caches 0.50 GiB ({blocks} blocks" in err
    # the default profile: seqs.max x width.max blocks (64 x 2048 for a 32k context)
    assert B.main([str(model), "--plugin", "lib.so", "--print-trtexec"]) == 0
    err = capsys.readouterr().err
    assert "of which the KV caches 1.00 GiB (131072 blocks x 8.0 KiB" in err
    assert not (tmp_path / "model.plan.profile.json").exists()  # no --out: nothing written
    assert B.main([*base, *small, "--kv-pool-gib", "0.000001"]) == 2
    assert "one KV block takes" in capsys.readouterr().err


def test_unknown_output_sizes_are_named():
    inputs = [InputSpec("x", (-1,), ("num_tokens",), "FLOAT")]
    outputs = [InputSpec("y", (-1, -1), ("num_tokens", "data_dependent"), "FLOAT")]
    limits = B.derive_limits(EXPORT_INPUTS, tokens=Limit(1, 4, 16), seqs=Limit(1, 2, 4), max_context=64)
    memory = B.binding_memory(inputs, outputs, limits, B.profile_shapes(inputs, limits))
    assert memory.total == 16 * 4 and memory.unknown == ("y",)
    assert "at least 0.00 GiB" in memory.describe() and "not known before the build: y" in memory.describe()


class _FakeEngine:
    def __init__(self, aliases, has_api=True):
        self._aliases = aliases
        self.num_io_tensors = 1 + len(aliases)
        self.device_memory_size_v2 = 3 * 2**20
        if has_api:
            self.get_aliased_input_tensor = lambda name: self._aliases.get(name)

    def get_tensor_name(self, i):
        return (["past.0.key", *self._aliases])[i]

    def get_tensor_mode(self, name):
        return "TensorIOMode.OUTPUT" if name in self._aliases else "TensorIOMode.INPUT"


def test_aliasing_is_reported_as_the_engine_says():
    """dash-build prints each output's aliased input (getAliasedInputTensor, 10.15+), that one has
    none (TensorRT may copy around the plugin), or that this TensorRT cannot say; and the engine's
    device memory."""
    both = _FakeEngine({"present.0.key": "past.0.key", "logits": None})
    assert B.engine_aliases(both) == {"present.0.key": "past.0.key", "logits": None}
    lines = B.describe_engine_io(both)
    assert lines[:2] == ["aliased outputs: 1 of 2", "  present.0.key -> past.0.key"]
    assert "engine device memory (activations and workspace, besides the I/O): 3.0 MiB" in lines
    none = B.describe_engine_io(_FakeEngine({"present.0.key": None}))
    assert any("no alias reported for 1 present.* output(s) (present.0.key" in line for line in none)
    old = B.describe_engine_io(_FakeEngine({"present.0.key": None}, has_api=False))
    assert B.engine_aliases(_FakeEngine({}, has_api=False)) is None and "not reported by this TensorRT" in old[0]


def test_help_and_print_trtexec_need_no_torch(tmp_path):
    """dash-build --help and --print-trtexec (which finds the installation's plugin) in an
    interpreter where torch cannot be imported."""
    model = _tiny_onnx(tmp_path / "tiny.onnx")
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['tensorrt'] = None\n"
        "import os; os.environ['DASH_TRT_PLUGIN'] = sys.argv[2]\n"
        "from dash_trt.build import main\n"
        "rc = main([sys.argv[1], '--print-trtexec', '--max-context', '64'])\n"
        "try:\n    main(['--help'])\nexcept SystemExit as e:\n    rc = rc or e.code\n"
        "sys.exit(rc)"
    )
    plugin = tmp_path / "libdash_trt_plugin.so"
    plugin.write_bytes(b"\x7fELF")
    r = subprocess.run(
        [sys.executable, "-c", code, str(model), str(plugin)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert f"--dynamicPlugins={plugin}" in r.stdout and "usage: dash-build" in r.stdout


def test_a_plugin_of_another_tensorrt_major_is_refused(tmp_path, capsys, no_tensorrt, monkeypatch):
    """The plugin registers its creator only in a TensorRT of the major it was built for: a
    command for another major is refused, naming both; with no tensorrt package the command is
    for the plugin's own version."""
    from dash_trt import libraries

    marked = _tiny_onnx(tmp_path / "m.onnx", node=True)
    plugin = tmp_path / "libdash_trt_plugin.so"
    plugin.write_bytes(b"\x7fELF")
    monkeypatch.setattr(libraries, "plugin_tensorrt_version", lambda path: (11, 1))
    base = [str(marked), "--plugin", str(plugin), "--print-trtexec", "--max-context", "64"]
    assert B.main([*base, "--trt-version", "10.16"]) == 2
    err = capsys.readouterr().err
    assert "built against TensorRT 11.1 headers and the command is for TensorRT 10.16" in err
    assert B.main(base) == 0
    out, err = capsys.readouterr()
    assert "the command is for TensorRT 11.1 (the plugin was built for it" in err and "--stronglyTyped" not in out
