"""``dash-client`` against a served model it has no tokenizer for (a Dual Chunk Attention text
model): token ids go out as they are, over HTTP, gRPC and gRPC streaming; text prompts and
``--pages`` are refused with a line that says to send ids. A fake tritonclient module stands in
for the server (the real one: tests/test_dca_serving.py)."""

from __future__ import annotations

import io
import json
import types

import numpy as np
import pytest

from dash_trt import triton_protocol as P
from dash_trt.models.qwen2_dca import tiny_qwen2_dca_config
from dash_trt.triton import client as C

ANSWER = [7, 8, 9]


class _Input:
    def __init__(self, name, shape, dtype):
        self.name, self.shape, self.dtype = name, shape, dtype
        self.data = None

    def set_data_from_numpy(self, arr):
        self.data = arr


class _Output:
    def __init__(self, name):
        self.name = name


class _Result:
    def __init__(self, outputs, final=True):
        self.outputs = outputs
        flag = types.SimpleNamespace(bool_param=final)
        self.response = types.SimpleNamespace(parameters={"triton_final_response": flag})

    def as_numpy(self, name):
        return self.outputs.get(name)

    def get_response(self):
        return self.response


def _fake_module(config: dict, seen: list):
    """A tritonclient.http / .grpc stand-in serving ``config`` as the model's config.json and
    answering every generation with ANSWER (``seen``: the ids each request carried)."""

    def answer(inputs):
        (ids,) = [x.data for x in inputs if x.name == P.INPUT_IDS]
        seen.append([int(i) for i in ids.reshape(-1)])
        return _Result({P.OUTPUT_IDS: np.array(ANSWER, dtype=np.int64)})

    class Client:
        def __init__(self, url, **kw):
            self.url = url

        def is_server_live(self):
            return True

        def get_model_config(self, model, **kw):
            params = {P.PARAM_MODEL_CONFIG: {"string_value": json.dumps(config)}}
            return {"config": {"name": model, "parameters": params}}

        def infer(self, model, inputs, **kw):
            return answer(inputs)

        def start_stream(self, callback, **kw):
            self.callback = callback

        def async_stream_infer(self, model, inputs, **kw):
            for t in ANSWER:
                self.callback(_Result({P.OUTPUT_IDS: np.array([t], dtype=np.int64)}, final=False), None)
            answer(inputs)  # records the ids
            self.callback(_Result({}, final=True), None)

        def stop_stream(self):
            pass

        def close(self):
            pass

    return types.SimpleNamespace(InferenceServerClient=Client, InferInput=_Input, InferRequestedOutput=_Output)


@pytest.fixture
def dca_server(monkeypatch):
    seen: list = []
    module = _fake_module(tiny_qwen2_dca_config(), seen)
    monkeypatch.setattr(C, "_module", lambda protocol: module)
    return seen


def _run(*argv):
    out, err = io.StringIO(), io.StringIO()
    rc = C.main(["--url", "127.0.0.1:1", *argv], stdout=out, stderr=err)
    return rc, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("how", [["--protocol", "http"], [], ["--stream"]])  # [] is grpc, the default
def test_dash_client_sends_token_ids_to_a_dual_chunk_attention_model(dca_server, how):
    rc, out, err = _run("--ids", "3,10,17", "--max-new-tokens", "3", *how)
    assert rc == 0, err
    assert dca_server == [[3, 10, 17]]
    assert "tokens: 7 8 9" in out and "text:" not in out
    assert "prompt: 3 tokens; model 'dash" in err and "page" not in err
    rc, out, err = _run("--ids", "3,10,17", "--json", *how)
    assert rc == 0, err
    answer = json.loads(out)
    assert answer["tokens"] == ANSWER and answer["text"] is None and answer["prompt_tokens"] == 3


@pytest.mark.parametrize("prompt", [["--prompt", "<PAGE><image*4>Title?"], ["--pages", "4,4"]])
def test_dash_client_asks_for_token_ids_where_a_model_takes_only_those(dca_server, prompt):
    rc, out, err = _run(*prompt)
    assert rc == 1 and out == "" and dca_server == []
    (line,) = err.strip().splitlines()
    assert "is a Dual Chunk Attention text model: it takes token ids only (dash-client --ids" in line


def test_a_dca_config_is_named_a_token_id_model_not_told_to_add_dash_keys():
    """Issue D11: the config check says what a DCA folder is, where it used to say to add the
    sparse_attention_config section."""
    from dash_trt.models.config import DashModelConfig, ModelConfigError, TokenIdModelError

    with pytest.raises(TokenIdModelError) as info:
        DashModelConfig.from_dict(tiny_qwen2_dca_config(), source="config of qwen2-dca")
    text = str(info.value)
    assert "Dual Chunk Attention text model" in text and "token ids" in text and "sparse_*" not in text
    with pytest.raises(ModelConfigError, match=r"add the section with the sparse_\* keys"):
        DashModelConfig.from_dict({"vocab_size": 8}, source="config")
