"""The TensorRT backend of the serving runtime, against a stand-in of the ``tensorrt`` module
(it needs no TensorRT runtime): the engine's interface is checked against the model, every
input is bound with the step's shape, every ``present.*`` output to its ``past.*`` buffer (the
runtime's own cache tensors: in place), the logits to the rows the step scores."""

import sys
import types

import numpy as np
import pytest

from dash_trt import model as M
from dash_trt.attention.dash.ops import CACHE_FIELDS
from dash_trt.serving.runner import PagedRuntime
from dash_trt.serving.tensorrt import TensorRTBackend, TensorRTBackendError, TensorRTNotFound

CHOSEN = 65  # the token the stand-in engine's logits make greedy decoding pick


def fake_tensorrt(io_names, *, vocab=320, loads=True, registers=True, aliases=None):
    """A ``tensorrt`` module with the calls TensorRTBackend makes; the context records them and
    writes logits that make greedy decoding pick CHOSEN."""
    trt = types.ModuleType("tensorrt")

    class Mode:
        INPUT, OUTPUT = "input", "output"

    class DType:
        def __init__(self, name):
            self.name = name

        def __str__(self):
            return f"DataType.{self.name}"

    class Context:
        def __init__(self):
            self.shapes, self.addresses, self.runs = {}, {}, 0

        def set_input_shape(self, name, shape):
            self.shapes[name] = tuple(shape)
            return True

        def set_tensor_address(self, name, ptr):
            self.addresses[name] = ptr
            return True

        def execute_async_v3(self, stream):
            import ctypes

            self.runs += 1
            rows = self.shapes["logits_indices"][0]
            logits = np.ctypeslib.as_array((ctypes.c_float * (rows * vocab)).from_address(self.addresses["logits"]))
            logits[:] = 0.0
            logits.reshape(rows, vocab)[:, CHOSEN] = 1.0
            return True

    class Engine:
        num_io_tensors = len(io_names)

        def __init__(self):
            self.context = None

        def get_tensor_name(self, i):
            return io_names[i][0]

        def get_tensor_mode(self, name):
            return dict(io_names)[name]

        def get_tensor_dtype(self, name):
            return DType(
                "INT64"
                if name in ("input_ids", "logits_indices")
                else "INT32"
                if name in ("coords", "block_tables", "seq_lens", "query_start_loc", "prompt_lens")
                else "FLOAT"
            )

        def create_execution_context(self):
            self.context = Context()
            return self.context

        if aliases is not None:  # TensorRT >= 10.15 reports each output's aliased input

            def get_aliased_input_tensor(self, name):
                return aliases.get(name)

    class Registry:
        def load_library(self, path):
            return object() if loads else None

        def get_creator(self, name, version, namespace):
            return object() if registers else None

    class Runtime:
        def __init__(self, logger):
            pass

        def deserialize_cuda_engine(self, data):
            trt.last_engine = Engine()
            return trt.last_engine

    class Logger:
        WARNING = 2

        def __init__(self, level):
            pass

    trt.TensorIOMode, trt.Runtime, trt.Logger = Mode, Runtime, Logger
    trt.get_plugin_registry = lambda: Registry()
    return trt


def io_of(model):
    layers = model.config.num_hidden_layers
    ins = [(n, "input") for n in M.MODEL_INPUTS]
    ins += [(f"past.{i}.{f}", "input") for i in range(layers) for f in CACHE_FIELDS]
    outs = [("logits", "output")] + [(f"present.{i}.{f}", "output") for i in range(layers) for f in CACHE_FIELDS]
    return ins + outs


@pytest.fixture
def demo():
    return M.demo_model(seed=1)


def _install(monkeypatch, trt):
    monkeypatch.setitem(sys.modules, "tensorrt", trt)


def test_steps_bind_the_caches_in_place(monkeypatch, tmp_path, demo):
    trt = fake_tensorrt(io_of(demo))
    _install(monkeypatch, trt)
    (tmp_path / "m.plan").write_bytes(b"plan")
    backend = TensorRTBackend(str(tmp_path / "m.plan"), "lib.so", device="cpu")
    rt = PagedRuntime(demo, 32, 16, backend=backend)
    prompts = [M.document_prompt([10, 7], "Q?", demo.config), M.document_prompt([9], "", demo.config)]
    for i, p in enumerate(prompts):
        rt.add(i, p, len(p) + 3)
    out = rt.step([(0, len(prompts[0])), (1, 6)])  # a prefill and a partial prefill
    assert out.tokens == {0: CHOSEN}
    ctx = trt.last_engine.context
    # every cache: present bound to past, and that is the runtime's own tensor
    for i, cache in enumerate(rt.caches):
        for f in CACHE_FIELDS:
            t = getattr(cache, f)
            assert ctx.addresses[f"past.{i}.{f}"] == ctx.addresses[f"present.{i}.{f}"] == t.data_ptr()
            assert ctx.shapes[f"past.{i}.{f}"] == tuple(t.shape)
    t = len(prompts[0]) + 6
    assert ctx.shapes["input_ids"] == (t,) and ctx.shapes["coords"] == (t, 4)
    assert ctx.shapes["query_start_loc"] == (3,) and ctx.shapes["logits_indices"] == (1,)  # one sampling row
    out = rt.step([(0, 1), (1, rt.seq(1).pending)])  # a decode token and the rest of the prompt
    assert out.tokens == {0: CHOSEN, 1: CHOSEN} and ctx.shapes["logits_indices"] == (2,)
    assert ctx.runs == 2 and [t.data_ptr() for t in rt.tensors()] == [
        ctx.addresses[f"past.{i}.{f}"] for i in range(len(rt.caches)) for f in CACHE_FIELDS
    ]


def test_engine_that_does_not_fit_the_model(monkeypatch, tmp_path, demo):
    io = [x for x in io_of(demo) if x[0] != "present.1.summary"]
    _install(monkeypatch, fake_tensorrt(io))
    (tmp_path / "m.plan").write_bytes(b"plan")
    rt = PagedRuntime(demo, 8, 16, backend=TensorRTBackend(str(tmp_path / "m.plan"), "lib.so", device="cpu"))
    p = M.document_prompt([4], "", demo.config)
    rt.add(0, p, len(p))
    with pytest.raises(TensorRTBackendError, match="does not match the model .* no present.1.summary"):
        rt.step([(0, len(p))])


def test_plugin_and_package_problems_are_named(monkeypatch, tmp_path, demo):
    (tmp_path / "m.plan").write_bytes(b"plan")
    _install(monkeypatch, fake_tensorrt(io_of(demo), registers=False))
    with pytest.raises(TensorRTBackendError, match="registers no DashAttention v2 creator"):
        TensorRTBackend(str(tmp_path / "m.plan"), "lib.so", device="cpu")
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    with pytest.raises(TensorRTNotFound, match="TensorRT not found"):
        TensorRTBackend(str(tmp_path / "m.plan"), "lib.so")


def test_runtime_device_is_only_for_backends(demo):
    from dash_trt.serving.runner import RuntimeConfigError

    with pytest.raises(RuntimeConfigError, match="only a backend"):
        PagedRuntime(demo, 8, 16, device="meta")
    assert np.asarray([0]).size == 1


def test_the_engine_s_aliases_are_checked_before_binding(monkeypatch, tmp_path, demo):
    """An engine that reports present.* aliased to its past.* (or to nothing: TensorRT copied
    around the plugin) is bound in place; one that aliases an output to another input is refused."""
    (tmp_path / "m.plan").write_bytes(b"plan")
    p = M.document_prompt([4], "", demo.config)
    layers = demo.config.num_hidden_layers
    good = {f"present.{i}.{f}": f"past.{i}.{f}" for i in range(layers) for f in CACHE_FIELDS}
    for aliases in (good, {**good, "present.0.key": None}):
        _install(monkeypatch, fake_tensorrt(io_of(demo), aliases=aliases))
        rt = PagedRuntime(demo, 8, 16, backend=TensorRTBackend(str(tmp_path / "m.plan"), "lib.so", device="cpu"))
        rt.add(0, p, len(p))
        rt.step([(0, len(p))])
    _install(monkeypatch, fake_tensorrt(io_of(demo), aliases={**good, "present.1.key": "past.1.value"}))
    rt = PagedRuntime(demo, 8, 16, backend=TensorRTBackend(str(tmp_path / "m.plan"), "lib.so", device="cpu"))
    rt.add(0, p, len(p))
    with pytest.raises(TensorRTBackendError, match="aliases present.1.key to past.1.value, not to past.1.key"):
        rt.step([(0, len(p))])
