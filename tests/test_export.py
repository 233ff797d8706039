"""ONNX export: the DashAttention node and its local function, ONNX Runtime against
PyTorch, dynamic shapes, fp16/bf16, and ``dash-export``'s handling of bad input."""

import os
import signal
import subprocess
import sys

import numpy as np
import onnx
import pytest
import torch
from conftest import demo_config
from test_paged import DI, KV_HEADS, D, make_seq, page_gap_case, permuted_tables, ragged_steps

from dash_trt import export as E
from dash_trt import model as M
from dash_trt.attention.dash import attributes as A
from dash_trt.attention.dash import onnx as O
from dash_trt.attention.dash import paged as P
from dash_trt.attention.dash.config import CONFIG_SECTION, DashConfig
from dash_trt.attention.dash.ops import CACHE_FIELDS
from dash_trt.testing import TOLERANCES, fill_garbage, random_config

KV_BLOCK_SIZES = [1, 5, 8, 16]
SEEDS = [0, 1, 2]

# The ONNX function against the paged operator, same dtype: float32 differs only in
# summation order; float16 rounds rotated keys and the output once each, like the op.
FUNCTION_TOL = {torch.float32: (1e-5, 1e-5), torch.float16: TOLERANCES[torch.float16]}


# ------------------------------------------------------------- the local function
def run_function_and_paged(seqs, cfg, layer, block_size, gen, *, dtype=torch.float32, index_dtype=torch.int32):
    """Interleave ``seqs`` (random prefill chunks and decode steps) through the paged
    operator and, on the same batches, a one-node ONNX model run by ONNX Runtime (the
    local function), each with its own cache; compare outputs and every cache tensor
    after every step. Returns the number of steps."""
    onnx_types = {torch.float32: onnx.TensorProto.FLOAT, torch.float16: onnx.TensorProto.FLOAT16}
    index_types = {torch.int32: onnx.TensorProto.INT32, torch.int64: onnx.TensorProto.INT64}
    model = O.single_node_model(A.encode(cfg, layer), dtype=onnx_types[dtype], index_dtype=index_types[index_dtype])
    onnx.checker.check_model(model, full_check=True)
    run = O.run_function_ort(model)
    tables, num_blocks = permuted_tables(gen, seqs, block_size, extra_blocks=3, spare_columns=2)
    cache = P.DashKVCache.allocate(num_blocks, block_size, KV_HEADS, D, DI, cfg.sparse_block_size, dtype=dtype)
    fill_garbage(cache, gen)  # nothing may depend on unwritten slots
    onnx_cache = [getattr(cache, f).numpy().copy() for f in CACHE_FIELDS]
    steps = 0
    atol, rtol = FUNCTION_TOL[dtype]
    for pick, rows, qsl, lens, prompts in ragged_steps(gen, seqs):
        inputs = [torch.cat([getattr(seqs[i].x, f)[a:b] for i, a, b in rows]) for f in ("q", "k", "v", "iq", "ik")]
        inputs += [torch.cat([seqs[i].coords[a:b] for i, a, b in rows]).to(index_dtype), seqs[0].x.head_cls]
        meta = [tables[pick], torch.tensor(lens), torch.tensor(qsl), torch.tensor(prompts)]
        meta = [m.to(index_dtype) for m in meta]
        want = P.paged_dash_attention(*inputs, cache, *meta, sp=cfg, layer_idx=layer)
        res = run(*[t.numpy() for t in inputs], *onnx_cache, *[m.numpy() for m in meta])
        got = torch.from_numpy(res[0])
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, atol=atol, rtol=rtol, msg=lambda m, steps=steps: f"step {steps}: {m}")
        for name, arr in zip(CACHE_FIELDS, res[1:]):
            ref = getattr(cache, name)
            if ref.dtype.is_floating_point:
                torch.testing.assert_close(torch.from_numpy(arr), ref, atol=atol, rtol=rtol, msg=name)
            else:
                assert np.array_equal(arr, ref.numpy()), name
        onnx_cache = res[1:]
        steps += 1
    return steps


def _random_seqs(gen, n, dtype=torch.float32):
    seqs = []
    for j in range(n):
        pages = int(torch.randint(1, 5, (1,), generator=gen))
        response = int(torch.randint(3, 12, (1,), generator=gen))
        mode = ["none", "prompt", "short"][j % 3]
        # the first sequence decodes its whole response; the others start decoding anywhere
        decode_from = None if j == 0 else int(torch.randint(1, 90, (1,), generator=gen))
        seqs.append(
            make_seq(
                gen, pages, response, mode, int(torch.randint(1, 4, (1,), generator=gen)), decode_from, dtype=dtype
            )
        )
    return seqs


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("block_size", KV_BLOCK_SIZES)
def test_function_equals_paged_operator_on_random_batches(seed, block_size):
    gen = torch.Generator().manual_seed(100 * seed + block_size)
    layer = seed % 2
    cfg = random_config(gen, sparse_block_size=[4, 8][seed % 2], dash_topk_blocks=[5, 3, 16][seed])
    steps = run_function_and_paged(_random_seqs(gen, 1 + seed), cfg, layer, block_size, gen)
    assert steps >= 4  # prefill chunks then decode steps


@pytest.mark.parametrize("dtype, index_dtype", [(torch.float16, torch.int32), (torch.float32, torch.int64)])
def test_function_dtypes(dtype, index_dtype):
    gen = torch.Generator().manual_seed(7)
    cfg = random_config(gen, sparse_block_size=8, dash_topk_blocks=2)
    run_function_and_paged(_random_seqs(gen, 2, dtype=dtype), cfg, 0, 8, gen, dtype=dtype, index_dtype=index_dtype)


@pytest.mark.parametrize("block_size", [4, 16])
def test_function_routing_ties_go_to_the_lowest_index(block_size):
    """With iq = 0 every remote block scores exactly 0: the selection is decided by the
    tie rule alone (the lowest block index, among the page's blocks or among all), and the
    prior is uniform over the candidates in the top 16."""
    gen = torch.Generator().manual_seed(5)
    cfg = DashConfig.from_dict(
        {"sparse_block_size": 4, "sparse_local_block": 1, "sparse_index_dim": DI, "dash_topk_blocks": 3}
    )
    seqs = [make_seq(gen, 4, 10, "prompt", 2, None, max_images=9) for _ in range(2)]
    for s in seqs:
        s.x.iq.zero_()
    run_function_and_paged(seqs, cfg, 0, block_size, gen)
    # and the rules matter here: selecting 3 of the tied blocks is not selecting all
    x = seqs[0].x
    from dash_trt.attention.dash.reference import dash_attention

    few = dash_attention(x.q, x.k, x.v, x.iq, x.ik, x.roles, x.head_cls, cfg, 0, seqs[0].prompt)
    wide = DashConfig.from_dict({**cfg.to_dict(), "dash_topk_blocks": 16})
    all_ = dash_attention(x.q, x.k, x.v, x.iq, x.ik, x.roles, x.head_cls, wide, 0, seqs[0].prompt)
    assert not torch.allclose(few, all_)


def test_function_page_without_images_inside_a_block():
    """The rare candidate rule (a page strictly inside a block's page range that has
    no image token there) is resolved from the image pages, as in the paged operator."""
    gen, cfg, seq, _ = page_gap_case()
    run_function_and_paged([seq], cfg, 0, 8, gen)


# --------------------------------------------------------------- the exported model
@pytest.fixture(scope="module")
def demo32(tmp_path_factory):
    model = M.demo_model(seed=1)
    path = str(tmp_path_factory.mktemp("onnx32") / "demo.onnx")
    E.export_onnx(model, path, kv_block_size=16)
    return model, path


def test_export_nodes_domain_function_attributes(demo32):
    model, path = demo32
    E.check_onnx(path)
    m = onnx.load(path)
    custom = [n for n in m.graph.node if n.domain not in ("", "ai.onnx")]
    assert [(n.domain, n.op_type) for n in custom] == [(O.DOMAIN, O.OP_TYPE)] * model.config.num_hidden_layers
    assert {o.domain: o.version for o in m.opset_import} == {"": O.OPSET, O.DOMAIN: O.DOMAIN_VERSION}
    # one model-local function of the same domain and name, standard ops only
    assert [(f.domain, f.name) for f in m.functions] == [(O.DOMAIN, O.OP_TYPE)]
    fn = m.functions[0]
    assert {n.domain for n in fn.node} <= {""} and len(fn.node) > 100
    assert list(fn.input) == list(O.TENSOR_INPUTS) and len(fn.output) == 7
    assert set(fn.attribute) == {a.name for a in A.NODE_ATTRIBUTES}
    initializers = {i.name for i in m.graph.initializer}
    for layer, node in enumerate(custom):
        cfg, layer_idx = O.node_config(node)
        # FLOAT attributes hold float32: 1e-4 comes back as 9.9999997e-05
        want = model.config.dash.for_layer(layer).to_dict()
        for key, value in cfg.to_dict().items():
            assert value == (pytest.approx(want[key], rel=1e-7) if isinstance(value, float) else want[key]), key
        assert layer_idx == layer
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["plugin_version"] == A.PLUGIN_VERSION.encode()
        # TensorRT >= 10.15 imports the node as a plugin (not as its local function) only when it
        # carries a plugin_namespace attribute: a STRING, the creator's namespace ""
        namespace = next(a for a in node.attribute if a.name == "plugin_namespace")
        assert namespace.type == onnx.AttributeProto.STRING and namespace.s == A.PLUGIN_NAMESPACE.encode() == b""
        assert set(attrs) == {a.name for a in A.NODE_ATTRIBUTES}
        assert node.input[6] == f"model.layers.{layer}.self_attn.dash_router.head_cls" and node.input[6] in initializers
        assert list(node.input[7:13]) == [f"past.{layer}.{f}" for f in CACHE_FIELDS]
        assert list(node.output[1:]) == [f"present.{layer}.{f}" for f in CACHE_FIELDS]


def test_node_attributes_carry_each_config_value_under_its_own_name(tmp_path):
    """Every attribute of every exported node, read by name and compared with the value written
    out here (not through attributes.encode / decode, which a swap of two keys in both would
    pass): a config whose keys all differ, so no two attributes can trade values unseen."""
    import json

    with open(os.path.join(os.path.dirname(__file__), "..", "export", "configs", "demo.json")) as fh:
        config = json.load(fh)
    config["sparse_attention_config"] = {
        "sparse_block_size": 8,
        "sparse_local_block": 2,
        "sparse_index_dim": 32,
        "dash_topk_blocks": 7,
        "dash_sigma": 0.75,
        "dash_scaling_factor": 99.0,
        "dash_prior_floor": 0.25,
        "sparse_attention_freq": [1, 1],
        "dash_scale_per_layer": [12.5, 6.25],
        "dash_floor_per_layer": [0.0625, 0.125],
        "sparse_rope_page_pairs": 2,
        "sparse_rope_tok_theta": 500.0,
        "sparse_rope_page_theta": 16.0,
        "sparse_main_rope_tok_freq_mode": "truncate",
        "sparse_rope_tok_freq_mode": None,
        "sparse_rope_page_mod": 3,
        "dash_query_chunk": 5,
        "page_token_id": 256,
        "image_token_id": 257,
    }
    model = M.random_model(config, seed=0)
    path = str(tmp_path / "m.onnx")
    E.export_onnx(model, path, kv_block_size=16)
    want = {  # name -> (ONNX type, value as onnx.helper.get_attribute_value returns it)
        "sparse_block_size": ("INT", 8),
        "sparse_local_block": ("INT", 2),
        "sparse_index_dim": ("INT", 32),
        "dash_topk_blocks": ("INT", 7),
        "dash_sigma": ("FLOAT", 0.75),
        "sparse_rope_page_pairs": ("INT", 2),
        "sparse_rope_tok_theta": ("FLOAT", 500.0),
        "sparse_rope_page_theta": ("FLOAT", 16.0),
        "sparse_main_rope_tok_freq_mode": ("STRING", b"truncate"),
        "sparse_rope_tok_freq_mode": ("STRING", b""),
        "sparse_rope_page_mod": ("INT", 3),
        "dash_query_chunk": ("INT", 5),
        "image_token_id": ("INT", 257),
        "page_token_id": ("INT", 256),
        "plugin_version": ("STRING", b"2"),
        "plugin_namespace": ("STRING", b""),
    }
    # each node carries its own layer's scale and floor (the lists' entries), under the scalar keys' names
    per_layer = [
        {"dash_scaling_factor": ("FLOAT", 12.5), "dash_prior_floor": ("FLOAT", 0.0625)},
        {"dash_scaling_factor": ("FLOAT", 6.25), "dash_prior_floor": ("FLOAT", 0.125)},
    ]
    nodes = [n for n in onnx.load(path).graph.node if n.op_type == O.OP_TYPE]
    assert len(nodes) == 2
    for layer, node in enumerate(nodes):
        got = {
            a.name: (onnx.AttributeProto.AttributeType.Name(a.type), onnx.helper.get_attribute_value(a))
            for a in node.attribute
        }
        assert got == {**want, **per_layer[layer], "layer_idx": ("INT", layer)}, layer


def test_check_refuses_a_file_without_the_function(demo32, tmp_path):
    _, path = demo32
    m = onnx.load(path)
    del m.functions[:]
    onnx.save(m, str(tmp_path / "nofn.onnx"))
    with pytest.raises(E.ExportError, match="no local function dash_trt.DashAttention"):
        E.check_onnx(str(tmp_path / "nofn.onnx"))


def test_export_graph_interface_has_dynamic_axes(demo32):
    model, path = demo32
    m = onnx.load(path)

    def dims(vi):
        return [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]

    ins = {i.name: dims(i) for i in m.graph.input}
    outs = {o.name: dims(o) for o in m.graph.output}
    assert list(ins)[: len(M.MODEL_INPUTS)] == list(M.MODEL_INPUTS)
    assert ins["input_ids"] == ["num_tokens"] and ins["coords"] == ["num_tokens", 4]
    assert ins["logits_indices"] == ["num_logits"]
    assert ins["block_tables"] == ["num_seqs", "block_table_width"]
    assert ins["query_start_loc"] == ["num_seqs + 1"] and ins["prompt_lens"] == ["num_seqs"]
    c = model.config
    assert ins["past.1.key"] == ["num_kv_blocks", 16, c.num_key_value_heads, c.head_dim]
    assert ins["past.0.summary_pages"] == ["num_kv_blocks", 1, 3]
    assert outs["logits"] == ["num_logits", c.vocab_size]
    assert [n for n in outs if n != "logits"] == model.cache_names("present")
    assert len(ins) == len(M.MODEL_INPUTS) + 6 * c.num_hidden_layers


def test_ort_reproduces_pytorch_prefill_and_decode(demo32):
    model, path = demo32
    report = E.verify_onnx(path, model, kv_block_size=16, seed=3, decode_steps=4, prefill_chunk=33)
    assert report.ok, report.failures
    assert report.max_logit_err < 1e-4
    assert set(report.max_cache_err) == set(CACHE_FIELDS)
    assert report.max_cache_err["image_page"] == 0 and report.max_cache_err["summary_pages"] == 0
    assert report.steps >= 6  # chunked prefill steps, then decode steps
    assert {t for t, *_ in report.shapes} > {1, 2}  # prefill chunks, mixed and pure decode


def test_one_file_runs_other_token_counts_and_cache_sizes(demo32):
    """The export example had T=12, B=2, NB=7, W=4: other sizes run through the same file."""
    model, path = demo32
    cfg = model.config
    one = E.verify_onnx(
        path, model, num_blocks=23, decode_steps=2, prefill_chunk=None, prompts=[M.document_prompt([40, 17], "?", cfg)]
    )
    three = E.verify_onnx(
        path,
        model,
        num_blocks=41,
        decode_steps=2,
        prefill_chunk=19,
        prompts=[M.document_prompt([n], "q", cfg) for n in (30, 45, 12)],
    )
    # blocks are allocated when a sequence is added, so each run has one table width
    wide = E.verify_onnx(
        path, model, num_blocks=29, decode_steps=1, prefill_chunk=50, prompts=[M.document_prompt([90, 60], "", cfg)]
    )
    assert one.ok and three.ok and wide.ok, (one.failures, three.failures, wide.failures)
    shapes = one.shapes + three.shapes + wide.shapes
    tokens = {s[0] for s in shapes}
    assert len(tokens) >= 4 and 1 in tokens and 60 in tokens  # decode, chunks, a 60-token prefill
    assert {s[1] for s in shapes} >= {1, 3}  # sequences
    assert {s[2] for s in shapes} == {23, 41, 29}  # KV blocks in the cache
    assert len({s[3] for s in shapes}) >= 3  # block-table widths


def test_ort_catches_a_wrong_model(demo32):
    """The check can fail: the same file against a model with one changed weight."""
    model, path = demo32
    other = M.demo_model(seed=1)
    with torch.no_grad():
        other.layers[1].self_attn.dash_router.head_cls.mul_(-1.0)
    report = E.verify_onnx(path, other, decode_steps=1)
    assert not report.ok and any("summary" in f for f in report.failures)


def test_fp16_export(tmp_path):
    model = M.demo_model(seed=2, dtype=torch.float16)
    path = str(tmp_path / "demo16.onnx")
    E.export_onnx(model, path)
    E.check_onnx(path)
    m = onnx.load(path)
    types = {i.name: i.type.tensor_type.elem_type for i in m.graph.input}
    assert types["past.0.key"] == onnx.TensorProto.FLOAT16 and types["past.0.summary"] == onnx.TensorProto.FLOAT
    assert sum(n.op_type == O.OP_TYPE for n in m.graph.node) == 2
    report = E.verify_onnx(path, model, decode_steps=2)
    assert report.ok, report.failures
    assert 0 < report.max_logit_err < E.VERIFY_TOLERANCES[torch.float16][0]


# ---------------------------------------------------------------------- dash-export
def _run(argv, capsys):
    code = E.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_demo_with_external_data(tmp_path, capsys, monkeypatch):
    out = tmp_path / "m.onnx"
    monkeypatch.setattr(E, "EXTERNAL_DATA_THRESHOLD", 0)  # as if the model were over 2 GB
    code, stdout, stderr = _run(
        ["--demo", "--out", str(out), "--decode-steps", "2", "--save-checkpoint", str(tmp_path / "demo.pt")], capsys
    )
    assert code == 0, stderr
    assert "RESULT: exported; the checker and ONNX Runtime agree with PyTorch" in stdout
    assert "max |logits err|" in stdout and "[5/5]" in stderr
    assert sorted(os.listdir(tmp_path)) == ["demo.pt", "m.onnx", "m.onnx.data"]
    m = onnx.load(str(out), load_external_data=False)
    assert any(i.data_location == onnx.TensorProto.EXTERNAL for i in m.graph.initializer)
    # the saved checkpoint is the exported model, and loads safely
    assert M.load_checkpoint(tmp_path / "demo.pt").config == M.demo_model().config


def test_cli_bfloat16_checks_through_float32(tmp_path, capsys):
    out = tmp_path / "bf16.onnx"
    code, stdout, stderr = _run(["--demo", "--dtype", "bfloat16", "--out", str(out), "--decode-steps", "1"], capsys)
    assert code == 0, stderr
    assert "checked as a float32 export" in stdout
    m = onnx.load(str(out))
    assert {i.type.tensor_type.elem_type for i in m.graph.input if i.name.endswith(".key")} == {
        onnx.TensorProto.BFLOAT16
    }
    assert os.listdir(tmp_path) == ["bf16.onnx"]


def test_without_onnxruntime_export_refuses_the_check_and_names_both_distributions(tmp_path, capsys, monkeypatch):
    # neither onnxruntime nor onnxruntime-gpu: importing the module fails, find_spec finds none
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    real = E.importlib.util.find_spec
    monkeypatch.setattr(E.importlib.util, "find_spec", lambda n, *a: None if n == "onnxruntime" else real(n, *a))
    out = tmp_path / "m.onnx"
    code, stdout, stderr = _run(["--demo", "--out", str(out), "-q"], capsys)
    assert code == E.EXIT_BAD_INPUT
    assert "ONNX Runtime is not installed" in stderr and "dash-trt[ort]" in stderr and "dash-trt[ort-gpu]" in stderr
    assert "--no-verify" in stderr and os.listdir(tmp_path) == []
    with pytest.raises(O.OnnxRuntimeMissing, match=r"dash-trt\[ort-gpu\]"):
        O.import_onnxruntime()
    # --no-verify exports without it (onnx.checker only)
    code, stdout, stderr = _run(["--demo", "--out", str(out), "-q", "--no-verify"], capsys)
    assert code == 0, stderr
    assert "ONNX Runtime check skipped" in stdout and os.listdir(tmp_path) == ["m.onnx"]


def test_the_package_depends_on_neither_onnxruntime_distribution():
    """onnxruntime and onnxruntime-gpu write the same module: a hard dependency on either would
    replace the other on install. Both are extras ([ort], [ort-gpu]), and only extras."""
    import re
    from importlib.metadata import requires

    reqs = requires("dash-trt") or []
    ort = [r for r in reqs if re.match(r"onnxruntime(-gpu)?\b", r)]
    assert ort, reqs
    assert all("extra ==" in r for r in ort), ort
    extras = {re.search(r'extra == "([^"]+)"', r).group(1) for r in ort if r.startswith("onnxruntime")}
    assert {"ort", "ort-gpu"} <= extras, ort
    gpu = [r for r in ort if r.startswith("onnxruntime-gpu")]
    assert gpu and all('extra == "ort-gpu"' in r for r in gpu)


def test_cli_mismatch_exits_1_and_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(E.VERIFY_TOLERANCES, torch.float32, (0.0, 0.0))  # fp32 rounding now "differs"
    out = tmp_path / "m.onnx"
    code, stdout, stderr = _run(["--demo", "--out", str(out), "--decode-steps", "1", "-q"], capsys)
    assert code == E.EXIT_MISMATCH
    assert "does not reproduce PyTorch" in stderr and "was not written" in stderr
    assert os.listdir(tmp_path) == []


def _checkpoints(tmp_path):
    small = M.random_model(demo_config(1))
    paths = {}
    (tmp_path / "corrupt.pt").write_bytes(b"\x80\x02not a checkpoint at all")
    paths["corrupt"] = tmp_path / "corrupt.pt"
    torch.save(small, tmp_path / "module.pt")
    paths["module"] = tmp_path / "module.pt"
    cfg = small.config.to_dict()
    del cfg[CONFIG_SECTION]
    torch.save({"config": cfg, "state_dict": small.state_dict()}, tmp_path / "nodash.pt")
    paths["nodash"] = tmp_path / "nodash.pt"
    (tmp_path / "nodash.json").write_text(__import__("json").dumps(cfg))
    paths["nodash_json"] = tmp_path / "nodash.json"
    M.save_checkpoint(small, tmp_path / "good.pt")
    paths["good"] = tmp_path / "good.pt"
    return paths


@pytest.mark.parametrize(
    "args, match",
    [
        (lambda p, o: [str(p["good"].parent / "missing.pt"), "--out", o], "checkpoint not found"),
        (lambda p, o: [str(p["corrupt"]), "--out", o], "not a readable PyTorch checkpoint"),
        (lambda p, o: [str(p["module"]), "--out", o], "pickled Python objects.*--unsafe-load"),
        (lambda p, o: [str(p["nodash"]), "--out", o], "no 'sparse_attention_config' section"),
        (lambda p, o: ["--random-init", str(p["nodash_json"]), "--out", o], "no 'sparse_attention_config' section"),
        (lambda p, o: [str(p["good"]), "--out", str(p["good"]) + "/m.onnx"], "cannot write .*is a file, not a folder"),
        (
            lambda p, o: [str(p["good"]), "--out", str(p["good"].parent / "no" / "m.onnx")],
            "cannot write .*does not exist",
        ),
        (lambda p, o: [str(p["good"]), "--out", str(p["good"].parent)], "cannot write .*is a directory"),
    ],
    ids=[
        "missing",
        "corrupt",
        "pickled-module",
        "no-dash-section",
        "no-dash-section-json",
        "out-under-a-file",
        "out-folder-missing",
        "out-is-a-folder",
    ],
)
def test_cli_bad_input_exits_2_with_a_clear_message(tmp_path, capsys, args, match):
    paths = _checkpoints(tmp_path)
    before = sorted(os.listdir(tmp_path))
    code, stdout, stderr = _run(args(paths, str(tmp_path / "out.onnx")), capsys)
    assert code == E.EXIT_BAD_INPUT
    assert stderr.count("dash-export: error:") == 1
    import re

    assert re.search(match, stderr), stderr
    assert "Traceback" not in stderr
    assert sorted(os.listdir(tmp_path)) == before  # nothing written, no temporary files


def test_cli_failure_while_writing_leaves_no_file(tmp_path, capsys, monkeypatch):
    def half_written(model, path, **kw):
        with open(path, "wb") as fh:
            fh.write(b"\x08\x0a half a model")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(E, "export_onnx", half_written)
    code, _, stderr = _run(["--demo", "--out", str(tmp_path / "m.onnx")], capsys)
    assert code == E.EXIT_BAD_INPUT and "No space left on device" in stderr
    assert os.listdir(tmp_path) == []

    def exporter_bug(model, path, **kw):
        raise RuntimeError("exporter crashed")

    monkeypatch.setattr(E, "export_onnx", exporter_bug)
    code, _, stderr = _run(["--demo", "--out", str(tmp_path / "m.onnx")], capsys)
    assert code == E.EXIT_EXPORT_FAILED and "export failed: RuntimeError: exporter crashed" in stderr
    assert "Traceback" not in stderr and os.listdir(tmp_path) == []
    # --verbose: the exporter's traceback, for the bug report
    code, _, stderr = _run(["--demo", "--out", str(tmp_path / "m.onnx"), "--verbose"], capsys)
    assert code == E.EXIT_EXPORT_FAILED and "Traceback (most recent call last)" in stderr
    assert "in exporter_bug" in stderr and os.listdir(tmp_path) == []


def test_console_script_exit_code(tmp_path):
    """The installed entry point reports through its exit status."""
    proc = subprocess.run(
        [sys.executable, "-m", "dash_trt.export", str(tmp_path / "none.pt"), "--out", str(tmp_path / "m.onnx")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "dash-export: error: checkpoint not found" in proc.stderr
    assert os.listdir(tmp_path) == []


def test_cli_usage_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        E.main(["--out", str(tmp_path / "m.onnx")])
    assert e.value.code == 2 and "give a checkpoint" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        E.main(["--demo", "--out", str(tmp_path / "m.onnx"), "--kv-block-size", "0"])
    assert e.value.code == 2 and "--kv-block-size must be >= 1" in capsys.readouterr().err


def test_cli_old_torch_is_told_clearly(tmp_path, capsys, monkeypatch):
    assert E.exporter_available() is None  # this torch can export
    monkeypatch.setattr(E, "exporter_available", lambda: "torch 2.4.0 has no dynamo ONNX exporter")
    code, _, stderr = _run(["--demo", "--out", str(tmp_path / "m.onnx")], capsys)
    assert code == E.EXIT_EXPORT_FAILED and "torch 2.4.0 has no dynamo ONNX exporter" in stderr
    assert os.listdir(tmp_path) == []


def test_function_reductions_name_non_negative_axes():
    """ONNX Runtime before 1.32 leaves a tensor with a zero-size dimension unreduced when the
    axis is negative (the summaries of a decode step that completes no block have C = 0): every
    reduction of the function names its axes as non-negative numbers."""
    fn = O.dash_attention_function()
    consts = {
        n.output[0]: onnx.numpy_helper.to_array(n.attribute[0].t)
        for n in fn.node
        if n.op_type == "Constant" and n.attribute[0].name == "value"
    }
    reductions = [n for n in fn.node if n.op_type.startswith("Reduce") and len(n.input) > 1 and n.input[1]]
    assert reductions
    for n in reductions:
        axes = np.asarray(consts[n.input[1]])
        assert (axes >= 0).all(), f"{n.op_type} {n.name or n.output[0]} reduces over axes {axes.tolist()}"


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
@pytest.mark.parametrize("wrapped", [False, True])
def test_cli_interrupted_export_leaves_nothing(tmp_path, capsys, monkeypatch, sig, code, wrapped):
    """SIGTERM or Ctrl-C while the file is being written: exit 128 + signal, no temporary
    folder, no output, one line saying so; also when the exporter turns the interruption into
    its own error (torch's "file an issue" message)."""
    real = E.export_onnx

    def interrupted(model, path, **kw):
        real(model, path, **kw)  # a partly written temporary file exists now
        if not wrapped:
            os.kill(os.getpid(), sig)
        try:
            os.kill(os.getpid(), sig)
        except BaseException as exc:
            raise RuntimeError("please file an issue with PyTorch") from exc

    monkeypatch.setattr(E, "export_onnx", interrupted)
    out = tmp_path / "m.onnx"
    rc = E.main(["--demo", "--out", str(out), "--quiet"])
    err = capsys.readouterr().err
    assert rc == code and f"interrupted ({signal.Signals(sig).name}); nothing was written" in err
    assert "file an issue" not in err and os.listdir(tmp_path) == []


def test_cli_removes_the_stale_data_file_of_an_earlier_export(tmp_path, capsys):
    out = tmp_path / "m.onnx"
    assert E.main(["--demo", "--out", str(out), "--quiet", "--no-verify", "--external-data", "always"]) == 0
    assert (tmp_path / "m.onnx.data").is_file()
    assert E.main(["--demo", "--out", str(out), "--quiet", "--no-verify", "--external-data", "never"]) == 0
    assert sorted(os.listdir(tmp_path)) == ["m.onnx"]
    assert "removed m.onnx.data of an earlier export" in capsys.readouterr().err
    E.check_onnx(out)


def test_the_schema_ties_head_cls_to_the_activations_type():
    """head_cls is in q's float type (the plugin reads it so): the schema's type inference refuses
    a node whose head_cls is float32 beside float16 activations; DashAttention casts a model's
    head_cls to q's dtype before the node."""
    from onnx import TensorProto

    cfg = DashConfig.from_dict({"sparse_block_size": 16, "sparse_local_block": 1, "sparse_index_dim": 32})
    model = O.single_node_model(A.encode(cfg, 0), dtype=TensorProto.FLOAT16)
    onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)  # consistent: accepted
    head = next(i for i in model.graph.input if i.name == "head_cls")
    head.type.tensor_type.elem_type = TensorProto.FLOAT
    with pytest.raises(onnx.shape_inference.InferenceError, match="head_cls|T"):
        onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
