"""The DASH decoder: config.json, checkpoint round trip and safety, tokenizer, and
paged greedy generation against a step-by-step dense reference."""

import json
import os

import pytest
import torch

from dash_trt import model as M
from dash_trt.attention.dash.config import CONFIG_SECTION, DashConfig
from dash_trt.attention.dash.ops import CACHE_FIELDS

SMALL = {
    **M.DEMO_CONFIG,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    CONFIG_SECTION: {
        **M.DEMO_CONFIG[CONFIG_SECTION],
        "sparse_block_size": 8,
        "sparse_index_dim": 16,
        "dash_topk_blocks": 2,
        "sparse_attention_freq": [1, 1, 1],
        "dash_scale_per_layer": [16.0, 8.0, 32.0],
        "dash_floor_per_layer": [1e-4, 1e-3, 1e-2],
        "sparse_local_block": 2,
    },
}


@pytest.fixture(scope="module")
def small():
    return M.random_model(SMALL, seed=3)


def test_config_json_round_trip(tmp_path):
    cfg = M.DashModelConfig.from_dict(M.DEMO_CONFIG)
    d = cfg.to_dict()
    assert d["architectures"] == ["DashForCausalLM"] and CONFIG_SECTION in d
    path = tmp_path / "config.json"
    path.write_text(json.dumps(d))
    assert M.load_model_config(path) == cfg
    # the section is what DashConfig reads from a model config
    assert DashConfig.from_model_config(str(path)) == cfg.dash
    assert cfg.dash.dash_topk_blocks == 4 and cfg.dash.dash_scale_per_layer == (32.0, 16.0)
    assert cfg.index_head_dim == 32 and "index_head_dim" not in d


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda d: d.pop(CONFIG_SECTION), "no 'sparse_attention_config' section"),
        (
            lambda d: d.update(dash_attention_config=d.pop(CONFIG_SECTION)),
            "'dash_attention_config' section, the withdrawn schema",
        ),
        (
            lambda d: d.update(index_head_dim=16),
            "index_head_dim is 16, but sparse_attention_config.sparse_index_dim is 32",
        ),
        (lambda d: d.pop("hidden_size"), "missing key.*hidden_size"),
        (lambda d: d.update(num_key_value_heads=3), "multiple of num_key_value_heads"),
        (lambda d: d.update(head_dim=2), "head_dim 2 is too small"),
        (lambda d: d[CONFIG_SECTION].pop("image_token_id"), "must set image_token_id"),
        (lambda d: d[CONFIG_SECTION].update(page_token_id=999), "outside the vocabulary"),
        (lambda d: d[CONFIG_SECTION].update(dash_scale_per_layer=[1.0]), "lists 1 DASH layers, the model has 2"),
        (lambda d: d[CONFIG_SECTION].update(sparse_attention_freq=[1, 0]), "requires DASH in every decoder layer"),
        (lambda d: d[CONFIG_SECTION].update(sparse_topk_blocks=[1]), "withdrawn routing rule"),
        (lambda d: d[CONFIG_SECTION].update(dash_stage0="mean"), "requires dash_stage0='head_cls'"),
        (lambda d: d.update(torch_dtype="float64"), "torch_dtype"),
    ],
)
def test_config_errors(change, match):
    d = json.loads(json.dumps(M.DEMO_CONFIG))
    change(d)
    with pytest.raises(M.ModelConfigError, match=match):
        M.DashModelConfig.from_dict(d)


def test_tokenizer_and_prompts():
    cfg = M.DashModelConfig.from_dict(M.DEMO_CONFIG)
    ids = M.tokenize("Hi <PAGE><image*3>é<image>", cfg)
    assert ids == [72, 105, 32, 256, 257, 257, 257, 0xC3, 0xA9, 257]
    assert M.detokenize(ids, cfg) == "Hi <PAGE><image><image><image>é<image>"
    p = M.document_prompt([2, 1], "Q?", cfg, preamble="D:")
    assert M.token_roles(p, cfg).tolist() == [0, 0, 2, 1, 1, 2, 1, 0, 0]


def test_checkpoint_round_trip(tmp_path, small):
    path = tmp_path / "model.pt"
    M.save_checkpoint(small, path, config_json=True)
    assert json.loads((tmp_path / "config.json").read_text())[CONFIG_SECTION]["dash_scale_per_layer"] == [
        16.0,
        8.0,
        32.0,
    ]
    raw = torch.load(path, weights_only=True)
    assert set(raw) == {"config", "state_dict"}
    loaded = M.load_checkpoint(path)
    assert loaded.config == small.config
    for k, v in small.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    prompt = M.document_prompt([9, 12], "x", small.config)
    torch.testing.assert_close(
        loaded.reference_logits(prompt, len(prompt)), small.reference_logits(prompt, len(prompt)), atol=0, rtol=0
    )
    # a bare state dict with a separate config.json
    torch.save(small.state_dict(), tmp_path / "bare.pt")
    bare = M.load_checkpoint(tmp_path / "bare.pt", config=M.load_model_config(tmp_path / "config.json"))
    assert torch.equal(bare.lm_head.weight, small.lm_head.weight)
    with pytest.raises(M.CheckpointError, match="no 'config' entry"):
        M.load_checkpoint(tmp_path / "bare.pt")


def test_checkpoint_keeps_dtype(tmp_path):
    m = M.random_model(SMALL, seed=1, dtype=torch.float16)
    M.save_checkpoint(m, tmp_path / "h.pt")
    back = M.load_checkpoint(tmp_path / "h.pt")
    assert back.dtype == torch.float16 and back.config.torch_dtype == "float16"


def test_checkpoint_bad_files(tmp_path, small):
    with pytest.raises(M.CheckpointError, match="checkpoint not found"):
        M.load_checkpoint(tmp_path / "nope.pt")
    (tmp_path / "corrupt.pt").write_bytes(b"PK\x03\x04 definitely not a zip archive" * 10)
    with pytest.raises(M.CheckpointError, match="not a readable PyTorch checkpoint"):
        M.load_checkpoint(tmp_path / "corrupt.pt")
    # a truncated real checkpoint
    M.save_checkpoint(small, tmp_path / "good.pt")
    data = (tmp_path / "good.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(M.CheckpointError, match="not a readable PyTorch checkpoint"):
        M.load_checkpoint(tmp_path / "cut.pt")
    # weights that do not fit the config
    state = dict(small.state_dict())
    state.pop("lm_head.weight")
    torch.save({"config": small.config.to_dict(), "state_dict": state}, tmp_path / "partial.pt")
    with pytest.raises(M.CheckpointError, match="missing lm_head.weight"):
        M.load_checkpoint(tmp_path / "partial.pt")
    # a config without the DASH section
    cfg = small.config.to_dict()
    del cfg[CONFIG_SECTION]
    torch.save({"config": cfg, "state_dict": small.state_dict()}, tmp_path / "nodash.pt")
    with pytest.raises(M.ModelConfigError, match="no 'sparse_attention_config' section"):
        M.load_checkpoint(tmp_path / "nodash.pt")


def test_pickled_module_needs_opt_in(tmp_path, small):
    path = tmp_path / "module.pt"
    torch.save(small, path)  # a whole pickled nn.Module
    with pytest.raises(M.CheckpointError, match="--unsafe-load") as e:
        M.load_checkpoint(path)
    assert "weights_only=True" in str(e.value) and "dash_trt.models.decoder.DashForCausalLM" in str(e.value)
    # a damaged pickle is not mistaken for one
    (tmp_path / "bad.pt").write_bytes(b"\x80\x02garbage that is no pickle")
    with pytest.raises(M.CheckpointError, match="not a readable PyTorch checkpoint"):
        M.load_checkpoint(tmp_path / "bad.pt")
    loaded = M.load_checkpoint(path, allow_pickle=True)
    assert isinstance(loaded, M.DashForCausalLM)
    assert torch.equal(loaded.embed_tokens.weight, small.embed_tokens.weight)


def test_atomic_save_leaves_nothing_on_failure(tmp_path, small, monkeypatch):
    def broken_save(obj, f, *a, **kw):
        with open(f, "wb") as fh:
            fh.write(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        M.save_checkpoint(small, tmp_path / "model.pt")
    assert os.listdir(tmp_path) == []


def _prompts(cfg):
    return [
        M.document_prompt([20, 9, 14], "Read page 2.", cfg, preamble="Doc "),
        M.document_prompt([30], "Title?", cfg),
        M.document_prompt([5, 5, 5, 5], "", cfg),
    ]


@pytest.mark.parametrize("prefill_chunk, kv_block_size", [(None, 16), (13, 8), (7, 5)])
def test_generation_equals_step_by_step_reference(small, prefill_chunk, kv_block_size):
    prompts = _prompts(small.config)
    got = M.generate(small, prompts, 6, prefill_chunk=prefill_chunk, kv_block_size=kv_block_size, stop_at_eos=False)
    want = M.reference_generate(small, prompts, 6, stop_at_eos=False)
    assert got.tokens == want.tokens
    for a, b in zip(got.logits, want.logits):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=2e-4)
    # chunked prefill and decode of different sequences were mixed in one batch
    if prefill_chunk:
        assert any(len({n > 1 for _, n in step}) == 2 for step in got.batches)
    assert all(len(t) == 6 for t in got.tokens)
    assert small.config.image_token_id not in sum(got.tokens, [])


def test_generation_stops_at_eos_and_frees_blocks(small):
    cfg = small.config
    prompts = _prompts(cfg)[:2]
    first = M.reference_generate(small, prompts, 1, stop_at_eos=False).tokens
    small_eos = M.DashForCausalLM(cfg.replace(eos_token_id=first[0][0]))
    small_eos.load_state_dict(small.state_dict())
    got = M.generate(small_eos.eval(), prompts, 5, stop_at_eos=True)
    assert got.tokens[0] == [first[0][0]]
    assert 1 <= len(got.tokens[1]) <= 5
    assert got.blocks_in_use == 0


def test_forward_rejects_wrong_cache_count(small):
    state = M.PagedState(small, 4, 8)
    with pytest.raises(ValueError, match=f"expected {len(CACHE_FIELDS) * 3} cache tensors"):
        small.export_forward(
            torch.zeros(1, dtype=torch.long),
            torch.zeros(1, 4, dtype=torch.int32),
            *[torch.zeros(1, 1, dtype=torch.int32)] + [torch.zeros(1, dtype=torch.int32)] * 3,
            *state.tensors()[:-1],
        )


def test_example_configs_in_export_folder_are_valid():
    folder = os.path.join(os.path.dirname(__file__), "..", "export", "configs")
    demo = M.load_model_config(os.path.join(folder, "demo.json"))
    assert demo == M.DashModelConfig.from_dict(M.DEMO_CONFIG)
    bench = M.load_model_config(os.path.join(folder, "benchmark.json"))
    # the kernel benchmark's attention shape
    assert (bench.num_attention_heads, bench.num_key_value_heads, bench.head_dim, bench.index_head_dim) == (
        32,
        8,
        128,
        128,
    )
    d = bench.dash
    assert (d.sparse_block_size, d.sparse_local_block, d.routing(0).topk) == (64, 1, 16)
