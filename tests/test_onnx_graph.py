"""The one ONNX interface reader (dash_trt.onnx_graph) that dash-compare, dash-build, the export
check and the Triton repository writer share."""

import sys

import onnx
import pytest
from onnx import TensorProto, helper

from dash_trt.onnx_graph import GraphReadError, read_graph


def _graph(path, key_dims=("num_kv_blocks", 16, 2, 64)):
    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["num_tokens"]),
        helper.make_tensor_value_info("past.0.key", TensorProto.FLOAT, list(key_dims)),
        helper.make_tensor_value_info("w", TensorProto.FLOAT, [2]),  # also an initializer: not an input
        helper.make_tensor_value_info("opaque", TensorProto.FLOAT, None),  # no shape
    ]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["num_logits", 100])]
    nodes = [
        helper.make_node("Identity", ["input_ids"], ["logits"]),
        helper.make_node("DashAttention", ["past.0.key"], ["a"], domain="dash_trt", plugin_namespace="", layer_idx=3),
        helper.make_node("Other", ["a"], ["b"], domain="dash_trt"),
        helper.make_node("DashAttention", ["b"], ["c"], domain="elsewhere"),
    ]
    init = [helper.make_tensor("w", TensorProto.FLOAT, [2], [1.0, 2.0])]
    model = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, init))
    helper.set_model_props(model, {"sparse_attention_config": "{}"})
    onnx.save(model, str(path))
    return str(path)


def test_inputs_outputs_nodes_and_metadata(tmp_path):
    g = read_graph(_graph(tmp_path / "m.onnx"))
    assert [t.name for t in g.inputs] == ["input_ids", "past.0.key", "opaque"]
    ids, key, opaque = g.inputs
    assert (ids.elem_type, ids.dims, ids.dim_names) == ("INT64", (-1,), ("num_tokens",))
    assert key.dims == (-1, 16, 2, 64) and key.dim_names == ("num_kv_blocks", None, None, None)
    assert opaque.dims is None
    assert g.outputs[0].dims == (-1, 100)
    assert g.dims() == (
        {"input_ids": [-1], "past.0.key": [-1, 16, 2, 64], "opaque": []},
        {"logits": [-1, 100]},
    )
    assert g.kv_block_size == 16
    # only the dash_trt domain's nodes; DashAttention ones with their attributes decoded
    assert [op for op, _ in g.domain_nodes] == ["DashAttention", "Other"]
    assert g.dash_nodes == [{"plugin_namespace": b"", "layer_idx": 3}]
    assert not g.has_dash_function
    assert g.metadata == {"sparse_attention_config": "{}"}


def test_a_dynamic_or_missing_block_size_is_none(tmp_path):
    assert read_graph(_graph(tmp_path / "d.onnx", ("n", "bs", 2, 64))).kv_block_size is None
    assert read_graph(_graph(tmp_path / "r.onnx", ("n", 16, 2))).kv_block_size is None


def test_unreadable_files_and_a_missing_onnx_package(tmp_path, monkeypatch):
    with pytest.raises(GraphReadError, match="ONNX file not found"):
        read_graph(tmp_path / "nope.onnx")
    (tmp_path / "junk.onnx").write_bytes(b"\x00\x01 not protobuf")
    with pytest.raises(GraphReadError, match="not a readable ONNX model"):
        read_graph(tmp_path / "junk.onnx")
    path = _graph(tmp_path / "m.onnx")
    monkeypatch.setitem(sys.modules, "onnx", None)
    with pytest.raises(GraphReadError, match="pip install onnx"):
        read_graph(path)
