"""DashConfig: built from an sp dict or a config.json section, validated once."""

import json
import math

import pytest

from dash_trt.attention.dash.config import CONFIG_SECTION, REQUIRED_FLAGS, DashConfig, DashConfigError

BASE = {"sparse_block_size": 64, "sparse_local_block": 1, "sparse_index_dim": 128}


def test_defaults_follow_the_spec_table():
    cfg = DashConfig.from_dict(BASE)
    assert cfg.dash_topk_blocks == 12
    assert cfg.dash_sigma == 1.0
    assert cfg.dash_scaling_factor == 128.0
    assert cfg.dash_prior_floor == 1e-4
    assert cfg.dash_scale_per_layer is None and cfg.dash_floor_per_layer is None
    assert cfg.sparse_attention_freq is None
    assert cfg.sparse_rope_page_pairs == 1
    assert cfg.sparse_rope_tok_theta == 10000.0
    assert cfg.sparse_rope_page_theta == 256.0
    assert cfg.sparse_main_rope_tok_freq_mode is None
    assert cfg.sparse_rope_tok_freq_mode is None
    assert cfg.sparse_rope_page_mod == 0
    assert cfg.dash_query_chunk == 2048
    assert cfg.local_window == 64
    assert DashConfig.required_keys() == ("sparse_block_size", "sparse_local_block", "sparse_index_dim")
    assert all(getattr(cfg, k) == v for k, v in REQUIRED_FLAGS.items())
    assert cfg.routing(5) == (12, 1.0, 128.0, 1e-4)


def test_round_trip_through_json_and_model_config(tmp_path):
    sp = {
        **BASE,
        "dash_topk_blocks": 8,
        "sparse_attention_freq": [1, 0, 1],
        "dash_scale_per_layer": [64, 32.0],
        "dash_floor_per_layer": [1e-3, 1e-2],
        "dash_sigma": 0.5,
        "sparse_main_rope_tok_freq_mode": "truncate",
        "image_token_id": 5,
        "page_token_id": 6,
        **REQUIRED_FLAGS,
    }
    cfg = DashConfig.from_dict(sp)
    assert cfg.slot(2) == 1 and cfg.routing(2) == (8, 0.5, 32.0, 1e-2) and cfg.num_dash_layers == 2
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"hidden_size": 64, CONFIG_SECTION: cfg.to_dict()}))
    assert DashConfig.from_model_config(path) == cfg
    assert DashConfig.from_model_config(json.loads(path.read_text())) == cfg
    # one layer's config: what an exported node carries
    layer = cfg.for_layer(2)
    assert layer.dash_scaling_factor == 32.0 and layer.dash_prior_floor == 1e-2
    assert layer.dash_scale_per_layer is None and layer.sparse_attention_freq is None
    assert layer.routing(2) == cfg.routing(2)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"sparse_block_size": None}, "missing required key"),
        ({"sparse_index_dim": None}, "missing required key\\(s\\): sparse_index_dim"),
        ({"sparse_block_size": 0}, "'sparse_block_size' must be >= 1"),
        ({"sparse_local_block": -1}, "'sparse_local_block' must be >= 1"),
        ({"sparse_block_size": 4.0}, "must be an integer"),
        ({"sparse_block_size": True}, "must be an integer"),
        ({"dash_topk_blocks": 0}, "'dash_topk_blocks' must be >= 1"),
        ({"dash_sigma": 0.0}, "'dash_sigma' must be > 0"),
        ({"dash_sigma": math.nan}, "'dash_sigma' must be finite"),
        ({"dash_prior_floor": 0.0}, "'dash_prior_floor' must be > 0"),
        ({"dash_scaling_factor": math.inf}, "'dash_scaling_factor' must be finite"),
        ({"dash_scale_per_layer": 3.0}, "must be a list of numbers"),
        ({"dash_floor_per_layer": [1e-4, -1.0]}, "'dash_floor_per_layer' must be > 0"),
        ({"sparse_attention_freq": [1, 2]}, "must hold only 0 and 1"),
        ({"sparse_attention_freq": []}, "non-empty list"),
        ({"sparse_rope_tok_theta": math.inf}, "must be finite"),
        ({"sparse_rope_page_theta": 0.0}, "must be > 0"),
        ({"sparse_rope_page_theta": "256"}, "must be a number"),
        ({"sparse_main_rope_tok_freq_mode": "trunc"}, "must be one of"),
        ({"dash_query_chunk": 0}, "'dash_query_chunk' must be >= 1"),
        ({"sparse_rope_page_mod": -1}, "must not be negative"),
        # the flags Unlimited-OCR-2 fixes: refused with vLLM's reason
        ({"training_stage": "warmup"}, "Unlimited-OCR-2 requires training_stage='dash'"),
        ({"sparse_rope_mode": "1d"}, "Unlimited-OCR-2 requires sparse_rope_mode='page2d'"),
        ({"sparse_rope_page_span": 2}, "Unlimited-OCR-2 requires sparse_rope_page_span=0"),
        ({"use_sparse_attention": False}, "Unlimited-OCR-2 requires use_sparse_attention=True"),
        ({"dash_image_only": False}, "Unlimited-OCR-2 requires dash_image_only=True"),
        # the withdrawn rule's keys: refused with what replaced them
        ({"sparse_topk_blocks": 16}, "'sparse_topk_blocks' belongs to a withdrawn routing rule.*dash_topk_blocks"),
        ({"sparse_dense_layers": []}, "'sparse_dense_layers' belongs to a withdrawn routing rule"),
        ({"sparse_page_bias": 0.5}, "'sparse_page_bias' belongs to a withdrawn routing rule"),
    ],
)
def test_bad_values_name_the_key(change, match):
    sp = dict(BASE)
    for k, v in change.items():
        if v is None:
            sp.pop(k)
        else:
            sp[k] = v
    with pytest.raises(DashConfigError, match=match):
        DashConfig.from_dict(sp)


def test_keys_nothing_reads_are_kept_and_named_once():
    """A real checkpoint's section may carry keys of its training: accepted, listed in one
    warning, kept in to_dict, not compared; strict=True refuses them."""
    with pytest.warns(UserWarning, match="not used by dash-trt, nor by vLLM's DASH layer: future_key, warmup"):
        cfg = DashConfig.from_dict({**BASE, "future_key": 1, "warmup": {"steps": 3}})
    assert cfg.sparse_block_size == 64 and cfg.ignored_keys == {"future_key": 1, "warmup": {"steps": 3}}
    assert cfg.to_dict()["warmup"] == {"steps": 3} and cfg == DashConfig.from_dict(BASE)
    with pytest.raises(DashConfigError, match="not used by dash-trt"):
        DashConfig.from_dict({**BASE, "sparse_blok_size": 64}, strict=True)


def test_layer_map_and_per_layer_lists():
    cfg = DashConfig.from_dict({**BASE, "sparse_attention_freq": [1, 0, 1], "dash_scale_per_layer": [1.0, 2.0]})
    assert [cfg.slot(i) for i in (0, 2)] == [0, 1]
    with pytest.raises(DashConfigError, match="layer 1 is not a DASH layer"):
        cfg.routing(1)
    with pytest.raises(DashConfigError, match="sparse_attention_freq lists 3 layers, no entry for layer 3"):
        cfg.routing(3)
    with pytest.raises(DashConfigError, match="Unlimited-OCR-2 requires DASH in every decoder layer"):
        cfg.check_layers(3)
    short = DashConfig.from_dict({**BASE, "dash_floor_per_layer": [1e-4]})
    with pytest.raises(DashConfigError, match="dash_floor_per_layer lists 1 DASH layers, the model has 2"):
        short.check_layers(2)
    with pytest.raises(DashConfigError, match="layer_idx must be a non-negative integer"):
        short.routing(-1)


def test_model_config_errors(tmp_path):
    with pytest.raises(DashConfigError, match="not found"):
        DashConfig.from_model_config(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(DashConfigError, match="not valid JSON"):
        DashConfig.from_model_config(bad)
    no_section = tmp_path / "plain.json"
    no_section.write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(DashConfigError, match=f"no '{CONFIG_SECTION}' section"):
        DashConfig.from_model_config(no_section)
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"dash_attention_config": {"sparse_block_size": 4, "sparse_local_block": 1}}))
    with pytest.raises(
        DashConfigError,
        match="'dash_attention_config' section, the withdrawn schema .* rename it 'sparse_attention_config'",
    ):
        DashConfig.from_model_config(old)
    with pytest.raises(DashConfigError, match="must be a mapping"):
        DashConfig.from_dict([("sparse_block_size", 4)])


@pytest.mark.parametrize(
    "dim, pairs, ok", [(4, 1, True), (4, 2, False), (6, 2, True), (7, 1, False), (128, 63, True), (128, 64, False)]
)
def test_head_dim_check(dim, pairs, ok):
    cfg = DashConfig.from_dict({**BASE, "sparse_rope_page_pairs": pairs})
    if ok:
        cfg.check_head_dim(dim)
    else:
        with pytest.raises(DashConfigError, match=str(dim)):
            cfg.check_head_dim(dim)


def test_config_is_immutable():
    cfg = DashConfig.from_dict(BASE)
    import dataclasses

    with pytest.raises(dataclasses.FrozenInstanceError, match="sparse_block_size"):
        cfg.sparse_block_size = 8  # type: ignore[misc]


def test_docs_spec_lists_every_config_key_with_its_default():
    """docs/spec.md's configuration table is the users' definition of the keys: it names
    every DashConfig key (and no other), with DashConfig's defaults."""
    import dataclasses
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "spec.md").read_text()
    table = text.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`"):
            for key in re.findall(r"`(\w+)`", cells[0]):
                rows[key] = cells[2]
    assert set(rows) == set(DashConfig.keys())
    for f in dataclasses.fields(DashConfig):
        if f.default is dataclasses.MISSING or f.name not in rows:
            continue
        want = {None: {"unset", "none"}, (): {"[]"}}.get(f.default, {str(f.default)})
        assert rows[f.name] in want, (f.name, rows[f.name], f.default)
    assert all(rows[k] == "required" for k in DashConfig.required_keys())


@pytest.mark.parametrize(
    "change, match",
    [
        ({"tie_word_embeddings": "no"}, "tie_word_embeddings must be true or false"),
        ({"eos_token_id": "x"}, "eos_token_id must be a token id"),
        ({"eos_token_id": 10**9}, "eos_token_id must be a token id"),
        ({"num_hidden_layers": 10**9}, "'num_hidden_layers' is 1000000000, more than the supported 1024"),
        ({"vocab_size": 1 << 30}, "more than the supported"),
    ],
)
def test_model_config_values_are_checked(change, match):
    from dash_trt import model as M

    with pytest.raises(M.ModelConfigError, match=match):
        M.DashModelConfig.from_dict({**M.DEMO_CONFIG, **change})


@pytest.mark.parametrize(
    "change, match",
    [
        ({"num_blocks": 10**9}, "'num_blocks' is 1000000000, more than the supported"),
        ({"kv_block_size": 1 << 20}, "'kv_block_size'"),
        ({"max_model_len": 1 << 30}, "'max_model_len' must be an integer in"),
    ],
)
def test_engine_config_sizes_are_bounded(change, match):
    from dash_trt.serving.engine import EngineConfig, EngineConfigError

    with pytest.raises(EngineConfigError, match=match):
        EngineConfig(**change)


def test_serve_and_client_refuse_out_of_range_numbers(capsys):
    from dash_trt.triton import cli
    from dash_trt.triton import client as C

    with pytest.raises(SystemExit) as e:
        cli.main(["serve", ".", "--http-port", "99999"])
    assert e.value.code == 2 and "port must be 1..65535, got 99999" in capsys.readouterr().err
    assert C.main(["--prompt", "x", "--max-new-tokens", "4294967299"]) == 2
    assert "--max-new-tokens must be 1..2147483647" in capsys.readouterr().err
