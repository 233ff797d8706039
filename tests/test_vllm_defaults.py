"""dash-trt's Unlimited-OCR-2 defaults against what vLLM 0.34.0's own code does
(tests/data/vllm_defaults_golden.json, made by scripts/vllm_defaults_golden.py from vLLM's source;
its entries say what was executed and what read): D1 every page of a document tiled, D2 experts
grouped whenever n_group > 1, D5 an unset rswa_window read as 128, D8 an untied lm_head, D11 the
prompt's layout and instructions."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from PIL import Image, ImageDraw

from dash_trt import model as M
from dash_trt.documents.processor import DocumentOptions, DocumentProcessor
from dash_trt.documents.prompt import DEFAULT_INSTRUCTION, SINGLE_PAGE_INSTRUCTION, document_prompt_ids
from dash_trt.documents.tokenizer import TextTokenizer
from dash_trt.documents.views import ViewSpec, image_token_count, tile_grid
from dash_trt.models import unlimited_ocr2 as U
from dash_trt.models.config import DashModelConfig

GOLDEN = json.loads((Path(__file__).parent / "data" / "vllm_defaults_golden.json").read_text(encoding="utf-8"))
D1 = GOLDEN["D1_multi_page_crop"]
D2 = GOLDEN["D2_grouped_routing"]
D5 = GOLDEN["D5_rswa_window"]
D8 = GOLDEN["D8_lm_head"]
D11 = GOLDEN["D11_prompt"]

#: the tiny tokenizer's ids (U.TINY_SPECIAL_TOKENS), the same as the golden script's stand-in
BOS_ID, PAGE_ID, IMAGE_ID = 0, 2, 3
#: vLLM's mm_processor_kwargs (the golden's request names) -> dash-trt's DocumentOptions.crop
CROP = {"default": None, "crop_mode_false": False}
#: float32 routing weights: vLLM's grouped_topk and route_experts compute the same float32 ops
WEIGHT_ATOL = 1e-6


def _doc_id(doc) -> str:
    return "+".join(f"{w}x{h}" for w, h in doc["pages"])


@pytest.fixture(scope="module")
def tokenizer():
    return TextTokenizer(U.tiny_tokenizer(), {"bos_token": U.TINY_SPECIAL_TOKENS[0]})


def encode_segments(tokenizer, segments) -> list[int]:
    """Token ids of golden segments: "[BOS]", a text piece (tokenized on its own, as vLLM's
    processor does) or an int (a run of that many image tokens)."""
    ids: list[int] = []
    for s in segments:
        if s == "[BOS]":
            ids.append(BOS_ID)
        elif isinstance(s, int):
            ids += [IMAGE_ID] * s
        else:
            ids += tokenizer.encode(s)
    return ids


def with_placeholders(tokenizer, ids: list[int]) -> str:
    """A prompt's text with each run of image tokens written as one ``<image>``."""
    out, text = [], []
    for i, t in enumerate(ids):
        if t != IMAGE_ID:
            text.append(t)
        elif i == 0 or ids[i - 1] != IMAGE_ID:
            out += [tokenizer.decode(text), "<image>"]
            text = []
    return "".join(out) + tokenizer.decode(text)


def png(width: int, height: int) -> bytes:
    im = Image.new("RGB", (width, height), "white")
    ImageDraw.Draw(im).rectangle((width // 8, height // 8, width // 2, height // 3), fill="black")
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue()


# ------------------------------------------------------------------------------ D1
def test_the_golden_holds_the_published_example():
    (doc,) = [d for d in D1["documents"] if d["pages"] == [[1240, 1754]] * 3]
    assert doc["default"]["image_tokens"] == [903, 903, 903] and doc["default"]["total"] == 2709
    assert all(d["default"]["effective_cropping"] for d in D1["documents"])  # vLLM crops every page


@pytest.mark.parametrize("request_name", list(CROP))
@pytest.mark.parametrize("doc", D1["documents"], ids=_doc_id)
def test_image_tokens_per_page_as_vllm(doc, request_name):
    want = doc[request_name]
    pages = [tuple(p) for p in doc["pages"]]
    spec = ViewSpec()
    assert spec.max_crops == want["processor_max_crops"]
    crop = DocumentOptions(crop=CROP[request_name]).crop_for(len(pages))
    assert crop is want["effective_cropping"]
    assert [image_token_count(w, h, spec, crop) for w, h in pages] == want["image_tokens"]
    assert [list(tile_grid(w, h, spec)) if crop else [1, 1] for w, h in pages] == want["grids"]


PROCESSOR_CASES = [
    ([[1240, 1754]] * 3, "default"),
    ([[1240, 1754]], "default"),
    ([[1240, 1754], [500, 700], [2000, 1000]], "default"),
    ([[1240, 1754], [500, 700], [2000, 1000]], "crop_mode_false"),
]


@pytest.mark.parametrize(
    "pages, request_name", PROCESSOR_CASES, ids=[f"{_doc_id({'pages': p})}-{r}" for p, r in PROCESSOR_CASES]
)
def test_the_document_processor_counts_as_vllm(tokenizer, pages, request_name):
    (doc,) = [d for d in D1["documents"] if d["pages"] == pages]
    want = doc[request_name]
    processor = DocumentProcessor(tokenizer, image_token_id=IMAGE_ID, page_token_id=PAGE_ID)
    sources = [(f"page{i + 1}.png", png(w, h)) for i, (w, h) in enumerate(pages)]
    prepared = processor.prepare(sources, DocumentOptions(crop=CROP[request_name]))
    assert prepared.crop is want["effective_cropping"]
    assert prepared.page_tokens == want["image_tokens"]
    assert [list(v.grid) for v in prepared.views] == want["grids"]
    assert [len(v.crops) for v in prepared.views] == [w * h if w * h > 1 else 0 for w, h in want["grids"]]
    assert prepared.prompt_ids.count(IMAGE_ID) == want["total"]
    if pages == [[1240, 1754]] * 3 and request_name == "default":
        assert sum(prepared.page_tokens) == 2709
        # and the whole prompt is the one vLLM's processor makes of the multi-page layout
        assert D11["prompts"]["3"]["page_sizes"] == pages
        assert prepared.prompt_ids == encode_segments(tokenizer, D11["prompts"]["3"]["processor_segments"])


# ------------------------------------------------------------------------------ D2
def test_the_golden_routing_cases_are_grouped():
    """The grouped cases choose other experts than the ungrouped ones on the same logits, so the
    routing test below fails if dash-trt stops grouping."""

    def ids(n_group, topk_group, norm, scale):
        (case,) = [
            c
            for c in D2["cases"]
            if c["config"]["topk_method"] == "greedy"
            and (c["config"]["n_group"], c["config"]["topk_group"]) == (n_group, topk_group)
            and c["config"]["norm_topk_prob"] == norm
            and c["config"]["routed_scaling_factor"] == scale
        ]
        return case["ids"]

    for norm in (False, True):
        for scale in (1.0, 2.5):
            assert ids(4, 1, norm, scale) != ids(1, 1, norm, scale)
            assert ids(4, 2, norm, scale) != ids(1, 1, norm, scale)


def _case_id(case) -> str:
    c = case["config"]
    return (
        f"{c['topk_method']}-g{c['n_group']}k{c['topk_group']}-"
        f"{'norm' if c['norm_topk_prob'] else 'raw'}-x{c['routed_scaling_factor']}"
    )


@pytest.mark.parametrize("case", D2["cases"], ids=_case_id)
def test_routing_as_vllms_grouped_topk(case):
    c = case["config"]
    keys = ("topk_method", "n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor", "scoring_func")
    raw = U.tiny_config(
        experts=c["n_routed_experts"],
        experts_per_token=c["num_experts_per_tok"],
        overrides={k: c[k] for k in keys},
    )
    moe = U.MoEConfig.from_config(DashModelConfig.from_dict(raw))
    logits = torch.tensor(D2["logits"], dtype=torch.float32)
    weights, ids = U.route_experts(logits, moe)
    # dash-trt orders a token's experts by descending weight, as the golden stores them
    assert ids.tolist() == case["ids"]
    torch.testing.assert_close(weights, torch.tensor(case["weights"]), rtol=0, atol=WEIGHT_ATOL)


# ------------------------------------------------------------------------------ D5
@pytest.mark.parametrize("case", D5["cases"], ids=lambda c: c["name"])
def test_rswa_window_accepted_or_refused_as_vllm(case):
    raw = U.tiny_config()
    raw["sparse_attention_config"] = {
        **raw["sparse_attention_config"],
        "sparse_block_size": case["sparse_block_size"],
        "sparse_local_block": case["sparse_local_block"],
    }
    del raw["rswa_window"]
    if case["rswa_window"] != "absent":
        raw["rswa_window"] = case["rswa_window"]
    if not case["accepted"]:
        with pytest.raises(ValueError, match="rswa_window"):
            M.random_model(raw)
        return
    cfg = M.random_model(raw).config
    window = cfg.dash.sparse_local_block * cfg.dash.sparse_block_size
    assert window == case["window"]
    # dash-trt's rswa_window: unset or the window -> R-SWA over that window; 0 -> full KV (vLLM's None)
    effective = None if cfg.rswa_window == 0 else window
    assert effective == case["effective_rswa_window"]
    assert cfg.prompt_length(D5["prompt_tokens"]) == case["prompt_length"]


# ------------------------------------------------------------------------------ D8
def test_lm_head_is_untied_as_in_vllm():
    assert D8["ties_lm_head"] is False
    raw = U.tiny_config(overrides={"tie_word_embeddings": True})
    raw["tie_word_embeddings"] = True
    model = M.random_model(raw, seed=1)
    assert model.config.tie_word_embeddings is True  # the config does ask for tying
    assert model.lm_head.weight is not model.embed_tokens.weight
    assert model.lm_head.weight.data_ptr() != model.embed_tokens.weight.data_ptr()
    assert not torch.equal(model.lm_head.weight, model.embed_tokens.weight)
    names = {n for n, _ in model.named_parameters()}
    assert {"lm_head.weight", "embed_tokens.weight"} <= names


# ------------------------------------------------------------------------------ D11
def test_the_multi_page_prompt_is_vllms(tokenizer):
    want = D11["prompts"]["3"]
    assert DEFAULT_INSTRUCTION == D11["multi_page_instruction"] == want["instruction"]
    counts = [s for s in want["processor_segments"] if isinstance(s, int)]
    ids = document_prompt_ids(tokenizer, counts, image_token_id=IMAGE_ID, page_token_id=PAGE_ID)
    assert ids == encode_segments(tokenizer, want["processor_segments"])
    assert tokenizer.bos_token == D11["bos_token"]
    assert with_placeholders(tokenizer, ids) == want["rendered"]  # bos_token + content, vLLM's fallback template


def test_the_single_page_prompt_has_vllms_layout(tokenizer):
    """vLLM defines no single-page instruction (the golden's is null); dash-trt's is the model
    README's "document parsing." (pinned here, not a vLLM value). The layout around it is the one
    vLLM's renderer accepts for one page: [BOS] <PAGE> image tokens, then the text."""
    assert D11["single_page_instruction"] is None and D11["prompts"]["1"]["instruction"] is None
    assert SINGLE_PAGE_INSTRUCTION == "document parsing."
    (accepted,) = [c for c in D11["renderer_checks"] if c["accepted"] and c["segments"].count("<PAGE>") == 1]
    assert accepted["segments"][:2] == ["[BOS]", "<PAGE>"] and isinstance(accepted["segments"][2], int)
    n = accepted["segments"][2]
    ids = document_prompt_ids(tokenizer, [n], image_token_id=IMAGE_ID, page_token_id=PAGE_ID)
    assert ids == encode_segments(tokenizer, [*accepted["segments"][:3], SINGLE_PAGE_INSTRUCTION])
    # vLLM's renderer refuses an image run without its <PAGE> (renderer_checks): dash-trt puts one
    # before every page's run
    assert any(not c["accepted"] for c in D11["renderer_checks"])
    for counts in ([n], [n, 5], [n, 5, 3]):
        ids = document_prompt_ids(tokenizer, counts, image_token_id=IMAGE_ID, page_token_id=PAGE_ID)
        starts = [i for i, t in enumerate(ids) if t == IMAGE_ID and ids[i - 1] != IMAGE_ID]
        assert len(starts) == len(counts) and all(ids[i - 1] == PAGE_ID for i in starts)
