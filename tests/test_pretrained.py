"""Hugging Face checkpoint folders (dash_trt.models.checkpoint) wherever a model.pt is accepted."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from dash_trt import export as E
from dash_trt import model as M
from dash_trt.model import CheckpointError

TIED = {**M.DEMO_CONFIG, "tie_word_embeddings": True}


def same_weights(a: M.DashForCausalLM, b: M.DashForCausalLM) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def hf_folder(path, model: M.DashForCausalLM, *, shards: int = 1, prefix: str = "model.") -> str:
    """A folder written the way transformers' save_pretrained writes a Llama-style model, by
    hand (not by dash_trt): 'model.' prefixes, lm_head.weight left out when tied, optional shards."""
    os.makedirs(path, exist_ok=True)
    cfg = model.config.to_dict()
    state = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            if not cfg["tie_word_embeddings"]:
                state[name] = tensor.clone()
            continue
        state[prefix + name] = tensor.clone()
    names = sorted(state)
    if shards == 1:
        save_file(state, os.path.join(path, "model.safetensors"))
    else:
        weight_map = {}
        for i in range(shards):
            part = {k: state[k] for k in names[i::shards]}
            fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            save_file(part, os.path.join(path, fname))
            weight_map.update({k: fname for k in part})
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as fh:
            json.dump({"metadata": {}, "weight_map": weight_map}, fh)
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    return str(path)


@pytest.mark.parametrize("shards", [1, 3])
def test_dash_export_reads_a_hugging_face_folder(tmp_path, capsys, shards):
    """The issue's first criterion: `dash-export DIR --out m.onnx` on a folder of config.json
    and safetensors with 'model.'-prefixed names and tied embeddings omitted, single and
    sharded; the export's ONNX Runtime check passes (exit 0)."""
    model = M.random_model(TIED, seed=3)
    folder = hf_folder(tmp_path / "hf", model, shards=shards)
    assert "lm_head.weight" not in {
        k for f in os.listdir(folder) if f.endswith(".safetensors") for k in load_file(os.path.join(folder, f))
    }
    loaded = M.load_checkpoint(folder)
    assert same_weights(model, loaded)
    assert loaded.lm_head.weight is loaded.embed_tokens.weight  # still tied
    out = tmp_path / "m.onnx"
    rc = E.main([folder, "--out", str(out), "--quiet"])
    assert rc == 0, capsys.readouterr().err
    assert out.is_file()


def test_save_pretrained_round_trip_single_and_sharded(tmp_path):
    model = M.demo_model(seed=1)
    assert M.save_pretrained(model, tmp_path / "one") == ["model.safetensors", "config.json"]
    written = M.save_pretrained(model, tmp_path / "many", max_shard_bytes=100_000)
    assert written[-2:] == ["model.safetensors.index.json", "config.json"] and len(written) > 3
    for folder in ("one", "many"):
        assert same_weights(model, M.load_checkpoint(tmp_path / folder))
    # names on disk are the Hugging Face ones
    assert all(k.startswith("model.") or k == "lm_head.weight" for k in load_file(tmp_path / "one/model.safetensors"))
    # a single safetensors file next to its config.json
    assert same_weights(model, M.load_checkpoint(tmp_path / "one/model.safetensors"))


def test_save_pretrained_replaces_an_earlier_save_whole(tmp_path):
    """Saving unsharded over a sharded save leaves no stale shards or index behind (they
    would contradict the new weights), and the reverse leaves no model.safetensors."""
    a, b = M.demo_model(seed=1), M.demo_model(seed=2)
    M.save_pretrained(a, tmp_path, max_shard_bytes=100_000)
    M.save_pretrained(b, tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    assert same_weights(b, M.load_checkpoint(tmp_path))
    M.save_pretrained(a, tmp_path, max_shard_bytes=100_000)
    assert "model.safetensors" not in os.listdir(tmp_path)
    assert same_weights(a, M.load_checkpoint(tmp_path))


def test_tied_embeddings_are_written_once(tmp_path):
    model = M.random_model(TIED, seed=4)
    M.save_pretrained(model, tmp_path)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    back = M.load_checkpoint(tmp_path)
    assert same_weights(model, back) and back.lm_head.weight is back.embed_tokens.weight


def test_dtype_follows_the_weights(tmp_path):
    model = M.demo_model(seed=1).to(torch.bfloat16)
    M.save_pretrained(model, tmp_path)
    assert json.load(open(tmp_path / "config.json"))["torch_dtype"] == "bfloat16"
    assert M.load_checkpoint(tmp_path).dtype == torch.bfloat16


def test_names_without_the_prefix_load_too(tmp_path):
    model = M.demo_model(seed=5)
    assert same_weights(model, M.load_checkpoint(hf_folder(tmp_path, model, prefix="")))


def test_folder_with_a_model_pt(tmp_path):
    model = M.demo_model(seed=6)
    M.save_checkpoint(model, tmp_path / "model.pt", config_json=True)
    assert same_weights(model, M.load_checkpoint(tmp_path))


def _broken(tmp_path, what: str) -> str:
    folder = hf_folder(tmp_path / "f", M.random_model(TIED, seed=7), shards=2)
    index = os.path.join(folder, "model.safetensors.index.json")
    if what == "no config":
        os.unlink(os.path.join(folder, "config.json"))
    elif what == "no weights":
        for f in os.listdir(folder):
            if f != "config.json":
                os.unlink(os.path.join(folder, f))
    elif what == "missing shard":
        os.unlink(os.path.join(folder, "model-00002-of-00002.safetensors"))
    elif what == "corrupt shard":
        with open(os.path.join(folder, "model-00001-of-00002.safetensors"), "r+b") as fh:
            fh.write(b"\xff" * 16)
    elif what == "index out of step":
        data = json.load(open(index))
        data["weight_map"]["model.norm.weight"] = (
            "model-00001-of-00002.safetensors"
            if data["weight_map"]["model.norm.weight"].startswith("model-00002")
            else "model-00002-of-00002.safetensors"
        )
        json.dump(data, open(index, "w"))
    elif what == "shard outside":
        data = json.load(open(index))
        data["weight_map"]["model.norm.weight"] = "../x.safetensors"
        json.dump(data, open(index, "w"))
    elif what == "bad index":
        open(index, "w").write("{not json")
    elif what in ("wrong config", "wrong shape"):
        cfg = json.load(open(os.path.join(folder, "config.json")))
        if what == "wrong config":
            sp = cfg["sparse_attention_config"]
            cfg["num_hidden_layers"], sp["sparse_attention_freq"] = 3, [1, 1, 1]
            sp["dash_scale_per_layer"], sp["dash_floor_per_layer"] = (
                sp["dash_scale_per_layer"] * 2,
                sp["dash_floor_per_layer"] * 2,
            )
        else:
            cfg["intermediate_size"] = 200
        json.dump(cfg, open(os.path.join(folder, "config.json"), "w"))
    return folder


@pytest.mark.parametrize(
    "what, match",
    [
        ("no config", "has no config.json"),
        ("no weights", "has no model.safetensors or model.safetensors.index.json"),
        ("missing shard", "weights file not found: .*model-00002-of-00002"),
        ("corrupt shard", "not a readable safetensors file"),
        ("index out of step", "does not hold what model.safetensors.index.json maps to it"),
        ("shard outside", "shards must be files in the folder"),
        ("bad index", "shard index .* is not valid JSON"),
        ("wrong config", "weights do not match the config: missing layers.2"),
        ("wrong shape", r"layers.0.mlp.down_proj.weight is \[128, 256\] in the checkpoint, \[128, 200\] in the model"),
    ],
)
def test_broken_folders_are_refused_with_the_reason(tmp_path, what, match):
    with pytest.raises(CheckpointError, match=match):
        M.load_checkpoint(_broken(tmp_path, what))


def test_dash_export_on_a_broken_folder_exits_2(tmp_path, capsys):
    rc = E.main([_broken(tmp_path, "missing shard"), "--out", str(tmp_path / "m.onnx"), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and "weights file not found" in err and "Traceback" not in err
    assert not (tmp_path / "m.onnx").exists()


def test_a_safetensors_file_needs_its_config(tmp_path):
    model = M.demo_model(seed=8)
    save_file({k: v for k, v in model.state_dict().items()}, tmp_path / "w.safetensors")
    with pytest.raises(CheckpointError, match="holds no config"):
        M.load_checkpoint(tmp_path / "w.safetensors")
    assert same_weights(model, M.load_checkpoint(tmp_path / "w.safetensors", config=M.DEMO_CONFIG))


def test_a_name_given_twice_is_refused(tmp_path):
    model = M.demo_model(seed=9)
    folder = hf_folder(tmp_path, model)
    state = load_file(os.path.join(folder, "model.safetensors"))
    state["norm.weight"] = state["model.norm.weight"].clone()
    save_file(state, os.path.join(folder, "model.safetensors"))
    with pytest.raises(CheckpointError, match="'norm.weight' is present twice"):
        M.load_checkpoint(folder)


def test_dash_export_save_pretrained(tmp_path):
    rc = E.main(
        [
            "--demo",
            "--out",
            str(tmp_path / "m.onnx"),
            "--no-verify",
            "--quiet",
            "--save-pretrained",
            str(tmp_path / "hf"),
        ]
    )
    assert rc == 0
    assert same_weights(M.demo_model(), M.load_checkpoint(tmp_path / "hf"))


def test_dash_triton_write_takes_a_hugging_face_folder(tmp_path):
    """The repository's generation model gets a model.pt of the folder's model (the Python
    backend reads model.pt); its weights are the folder's."""
    from dash_trt.triton import cli

    model = M.random_model(TIED, seed=10)
    folder = hf_folder(tmp_path / "hf", model, shards=2)
    assert cli.main(["write", folder, "--out", str(tmp_path / "repo")]) == 0
    ckpts = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "repo") for f in fs if f == "model.pt"]
    assert ckpts and all(same_weights(model, M.load_checkpoint(c)) for c in ckpts)


def test_a_damaged_model_pt_gets_the_unpicklers_reason_not_torchs_advice(tmp_path):
    """torch's message for a damaged file advises weights_only=False (unpickling untrusted
    code, which mends nothing); the error gives the unpickler's reason instead."""
    bad = tmp_path / "model.pt"
    bad.write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="not a readable PyTorch checkpoint") as info:
        M.load_checkpoint(bad)
    assert "weights_only" not in str(info.value) and "file an issue" not in str(info.value)


def test_a_pickle_that_runs_code_is_called_unsafe(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo should-not-run",))

    torch.save({"config": M.DEMO_CONFIG, "state_dict": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(CheckpointError, match=r"is unsafe: unpickling it would call posix.system") as info:
        M.load_checkpoint(tmp_path / "evil.pt")
    assert "corrupt" not in str(info.value) and "do not load it with --unsafe-load" in str(info.value)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weights_are_named(tmp_path, bad):
    model = M.demo_model(seed=12)
    with torch.no_grad():
        model.layers[1].self_attn.q_proj.weight[3, 4] = bad
    M.save_pretrained(model, tmp_path)
    with pytest.raises(
        CheckpointError,
        match=r"1 weight tensor\(s\) hold NaN or inf values "
        r"\(model.layers.1.self_attn.q_proj.weight|layers.1.self_attn.q_proj.weight",
    ):
        M.load_checkpoint(tmp_path)
