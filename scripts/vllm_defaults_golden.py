"""Make tests/data/vllm_defaults_golden.json: what vLLM 0.34.0's own code does for Unlimited-OCR-2's
defaults, for tests/test_vllm_defaults.py to check dash-trt against (the differences D1, D2, D5,
D8 and D11 of the fidelity review).

How the file was made (once; rerun it to check or to regenerate):

    pip download vllm==0.34.0 --no-deps -d /tmp/vllm && mkdir -p /tmp/vllm/x && cd /tmp/vllm/x \\
        && unzip -q ../vllm-0.34.0-*.whl && cd -
    python scripts/vllm_defaults_golden.py --vllm-root /tmp/vllm/x --out tests/data/vllm_defaults_golden.json

As scripts/vllm_golden.py does, the script reads vLLM's .py files from that unpacked wheel and
executes the classes and functions it names (parsed with ``ast``; their ``import`` statements,
annotations and decorators other than ``staticmethod``/``classmethod``/``property`` dropped), with
plain-Python or plain-torch stand-ins for what they import (transformers' ``ProcessorMixin`` and
``BatchFeature``, torchvision's ``ToTensor``/``Normalize``, vLLM's config, context and multimodal
item classes, a tokenizer). Neither vLLM nor its dependencies are installed or imported, and
dash-trt is not imported either. What each part ran:

- D1: ``UnlimitedOCRProcessingInfo`` (``models/unlimited_ocr.py``: ``get_hf_processor``,
  ``_get_max_crops``, ``get_num_image_tokens``) and ``UnlimitedOCRMultiModalProcessor.
  _get_prompt_updates`` (the ``effective_cropping`` rule and the placeholder expansion) for an
  Unlimited-OCR-2 config (``text_config.unlimited_ocr2`` true), and the HF processor it selects
  (``processors/unlimited_ocr.py`` ``UnlimitedOCR2Processor`` over ``processors/deepseek_ocr.py``
  ``DeepseekOCRProcessor.__call__``) on real PIL images; both must give the same counts.
- D2: ``grouped_topk`` (``layers/fused_moe/router/grouped_topk_router.py``, its ``torch.compile``
  decorator dropped: eager torch) on fixed logits, float32, on the CPU.
- D5: ``UnlimitedOCRConfig.__init__`` (``transformers_utils/configs/unlimited_ocr.py``: the
  default of an absent ``rswa_window``), ``UnlimitedOCRForCausalLMConfig.
  verify_and_update_model_config`` (``models/config.py``), and the two R-SWA statements of
  ``TritonAttentionMetadataBuilder`` (``v1/attention/backends/triton_attn.py``; DASH's metadata
  builder derives from it) that decide whether the prompt length reaches DASH attention.
- D11: the chat template vLLM falls back to for this model type
  (``transformers_utils/chat_templates/template_deepseek_ocr.jinja``, rendered with jinja2 as
  transformers does), the layout in ``PageCountGuardLogitsProcessor``'s docstring
  (``models/unlimited_ocr2.py``: vLLM builds no prompt text itself) and
  ``UnlimitedOCR2Renderer.validate_token_ids`` (``renderers/unlimited_ocr2.py``).
- D8: read, not run (``models/deepseek_v2.py``); the script only checks that the lines it cites
  are still there.

The JSON says per entry whether a value was "executed" or "read". Every vLLM file used is listed
with its sha256.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import re
import sys
import types
from pathlib import Path

import torch
from PIL import Image, ImageDraw, ImageOps

VLLM_VERSION = "0.34.0"

# ------------------------------------------------------------------------------ cases
#: D1: page sizes (width, height) and the documents made of them
PAGE_SIZES = [(1240, 1754), (640, 640), (500, 700), (2000, 1000)]
DOCUMENTS = [[size] for size in PAGE_SIZES] + [[size] * 3 for size in PAGE_SIZES]
DOCUMENTS.append([(1240, 1754), (500, 700), (2000, 1000)])
#: D1: the request's ``mm_processor_kwargs`` (none: vLLM's default crop mode)
REQUEST_KWARGS = {"default": {}, "crop_mode_false": {"crop_mode": False}}

#: D2: tokens, experts, experts a token, the logits' seed
ROUTING_TOKENS, ROUTING_EXPERTS, ROUTING_TOP_K, ROUTING_SEED = 12, 16, 3, 20240
#: D2: (topk_method, n_group, topk_group, norm_topk_prob, routed_scaling_factor); softmax scoring
ROUTING_CASES = [
    ("greedy", n_group, topk_group, norm, scale)
    for n_group, topk_group in ((4, 1), (4, 2), (1, 1))
    for norm in (False, True)
    for scale in (1.0, 2.5)
] + [("group_limited_greedy", 4, 1, False, 1.0)]

#: D5: the language model the configs describe (hidden 128, 4 heads, 2 layers: dash-trt's tiny
#: config) and (name, sparse_block_size, sparse_local_block, rswa_window or ABSENT)
ABSENT = "absent"
TEXT_CONFIG = {"num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 4}
RSWA_CASES = [
    ("window16_unset", 16, 1, ABSENT),
    ("window128_unset", 32, 4, ABSENT),
    ("window16_set16", 16, 1, 16),
    ("window16_set0", 16, 1, 0),
    ("window16_set128", 16, 1, 128),
]
PROMPT_TOKENS = 40

#: token ids of the stand-in tokenizer (dash-trt's tiny tokenizer uses the same four)
BOS_ID, EOS_ID, PAGE_ID, IMAGE_ID = 0, 1, 2, 3
BOS_TEXT = "<｜begin▁of▁sentence｜>"


# ------------------------------------------------------------------------------ running vLLM's source
class _Strip(ast.NodeTransformer):
    """Drop imports (the names come from the namespace), annotations (evaluated at definition
    time, and naming vLLM's types) and decorators other than staticmethod/classmethod/property."""

    KEEP = {"staticmethod", "classmethod", "property"}

    def visit_Import(self, node):
        return None

    visit_ImportFrom = visit_Import

    def _function(self, node):
        self.generic_visit(node)
        node.decorator_list = [d for d in node.decorator_list if isinstance(d, ast.Name) and d.id in self.KEEP]
        node.returns = None
        a = node.args
        for arg in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg]:
            if arg is not None:
                arg.annotation = None
        return node

    visit_FunctionDef = visit_AsyncFunctionDef = _function

    def visit_ClassDef(self, node):
        self.generic_visit(node)
        node.decorator_list = []
        return node

    def visit_AnnAssign(self, node):
        if node.value is None:
            return ast.Pass()
        return ast.Assign(targets=[node.target], value=node.value, lineno=node.lineno)

    def generic_visit(self, node):
        super().generic_visit(node)
        if isinstance(getattr(node, "body", None), list) and not node.body:  # held only imports
            node.body = [ast.Pass()]
        return node


class VllmSource:
    """vLLM's files in the unpacked wheel: read, parsed, run in part; the sha256 of each one used
    is kept for the JSON."""

    def __init__(self, root: Path):
        self.root = root / "vllm"
        if not (self.root / "model_executor").is_dir():
            raise SystemExit(f"{self.root} not found: unpack the vLLM {VLLM_VERSION} wheel and pass its folder")
        self.files: dict[str, str] = {}

    def text(self, rel: str) -> str:
        path = self.root / rel
        data = path.read_bytes()
        self.files[f"vllm/{rel}"] = hashlib.sha256(data).hexdigest()
        return data.decode("utf-8")

    def tree(self, rel: str) -> ast.Module:
        return ast.parse(self.text(rel), filename=f"vllm/{rel}")

    def run(self, rel: str, namespace: dict, names: set[str] | None = None) -> dict:
        """Execute the module's top-level statements (only the classes, functions and assignments
        of ``names`` if given) in ``namespace``; returns it."""
        tree = self.tree(rel)
        if names is not None:
            keep = []
            for node in tree.body:
                bound = {getattr(node, "name", None)} | {
                    t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)
                }
                if bound & names:
                    keep.append(node)
            missing = (
                names
                - {getattr(n, "name", None) for n in keep}
                - {t.id for n in keep for t in getattr(n, "targets", []) if isinstance(t, ast.Name)}
            )
            if missing:
                raise SystemExit(f"vllm/{rel}: {sorted(missing)} not found (another vLLM version?)")
            tree.body = keep
        tree = ast.fix_missing_locations(_Strip().visit(tree))
        namespace.setdefault("__name__", "vllm_" + rel.replace("/", "_").removesuffix(".py"))
        exec(compile(tree, f"vllm/{rel}", "exec"), namespace)  # noqa: S102 - a maintainer's check
        return namespace

    def statement(self, rel: str, cls: str, method: str, startswith: str) -> ast.Module:
        """The statement of ``cls.method`` whose source starts with ``startswith``, as a module."""
        tree = self.tree(rel)
        source = (self.root / rel).read_text(encoding="utf-8")
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name == cls:
                for fn in node.body:
                    if isinstance(fn, ast.FunctionDef) and fn.name == method:
                        for stmt in ast.walk(fn):
                            if isinstance(stmt, ast.stmt) and ast.get_source_segment(source, stmt).startswith(
                                startswith
                            ):
                                return ast.fix_missing_locations(ast.Module(body=[stmt], type_ignores=[]))
        raise SystemExit(f"vllm/{rel}: {cls}.{method} has no statement starting {startswith!r}")

    def cite(self, rel: str, needle: str) -> str:
        """``vllm/<rel>:<line>`` of the first line holding ``needle``."""
        return f"vllm/{rel}:{self.line_of(rel, needle)}"

    def line_of(self, rel: str, needle: str) -> int:
        for i, line in enumerate((self.root / rel).read_text(encoding="utf-8").splitlines(), 1):
            if needle in line:
                return i
        raise SystemExit(f"vllm/{rel}: {needle!r} not found (another vLLM version?)")


# ------------------------------------------------------------------------------ stand-ins
class _ToTensor:
    def __call__(self, pic):
        import numpy as np

        return torch.from_numpy(np.array(pic, dtype=np.uint8)).permute(2, 0, 1).float().div(255)


class _Normalize:
    def __init__(self, mean, std):
        self.mean, self.std = torch.tensor(mean)[:, None, None], torch.tensor(std)[:, None, None]

    def __call__(self, x):
        return (x - self.mean) / self.std


class _Compose:
    def __init__(self, transforms):
        self.transforms = transforms

    def __call__(self, x):
        for t in self.transforms:
            x = t(x)
        return x


TORCHVISION_T = types.SimpleNamespace(ToTensor=_ToTensor, Normalize=_Normalize, Compose=_Compose)


class _BatchFeature(dict):
    def __init__(self, data=None, tensor_type=None):
        super().__init__(data or {})


class _ProcessorMixin:
    def __init__(self, tokenizer=None, **kwargs):
        self.init_kwargs = kwargs


class _Logger:
    def warning_once(self, *args, **kwargs):
        pass

    warning = info = debug = warning_once


class _Tokenizer:
    """The processor's tokenizer: ``<image>`` and ``<PAGE>`` special, any other text one token."""

    def __init__(self):
        self.vocab = {"<image>": IMAGE_ID, "<PAGE>": PAGE_ID}
        self.bos_token_id, self.eos_token_id = BOS_ID, EOS_ID
        self.pad_token, self.pad_token_id = "<pad>", 4
        self.padding_side = "right"
        self.pieces: dict[str, int] = {}

    def encode(self, text, add_special_tokens=False):
        ids = []
        for part in re.split(r"(<PAGE>)", text):
            if part == "<PAGE>":
                ids.append(PAGE_ID)
            elif part:
                ids.append(self.pieces.setdefault(part, 100 + len(self.pieces)))
        return ids


def processing_info(vllm: VllmSource, unlimited_ocr2: bool = True):
    """vLLM's UnlimitedOCRProcessingInfo and UnlimitedOCRMultiModalProcessor, over its processors."""
    ns = vllm.run(
        "transformers_utils/processors/deepseek_ocr.py",
        {
            "math": math,
            "torch": torch,
            "T": TORCHVISION_T,
            "Image": Image,
            "ImageOps": ImageOps,
            "BatchFeature": _BatchFeature,
            "LlamaTokenizerFast": object,
            "ProcessorMixin": _ProcessorMixin,
            "Literal": object,
        },
    )
    procs = vllm.run(
        "transformers_utils/processors/unlimited_ocr.py",
        {
            "Image": Image,
            "ImageOps": ImageOps,
            "init_logger": lambda name: _Logger(),
            "DeepseekOCRProcessor": ns["DeepseekOCRProcessor"],
        },
    )

    class ProcessingInfoBase:
        def __init__(self, ctx):
            self.ctx = ctx

    class MultiModalProcessorBase:
        def __init__(self, info):
            self.info = info

    class ImageEmbeddingItems:
        pass

    class ImageProcessorItems:
        def __init__(self, sizes):
            self.sizes = sizes

        def __len__(self):
            return len(self.sizes)

        def get_image_size(self, i):
            w, h = self.sizes[i]
            return types.SimpleNamespace(width=w, height=h)

    class PromptReplacement:
        def __init__(self, modality, target, replacement):
            self.modality, self.target, self.replacement = modality, target, replacement

    model = vllm.run(
        "model_executor/models/unlimited_ocr.py",
        {
            "math": math,
            "BASE_SIZE": ns["BASE_SIZE"],
            "IMAGE_SIZE": ns["IMAGE_SIZE"],
            "CROP_MODE": ns["CROP_MODE"],
            "count_tiles": ns["count_tiles"],
            "DeepseekOCRProcessingInfo": ProcessingInfoBase,
            "DeepseekOCRMultiModalProcessor": MultiModalProcessorBase,
            "UnlimitedOCRConfig": "UnlimitedOCRConfig",
            "UnlimitedOCR2Processor": procs["UnlimitedOCR2Processor"],
            "UnlimitedOCRProcessor": procs["UnlimitedOCRProcessor"],
            "ImageEmbeddingItems": ImageEmbeddingItems,
            "ImageProcessorItems": ImageProcessorItems,
            "PromptReplacement": PromptReplacement,
        },
        names={
            "_UNLIMITED_OCR_MAX_CROPS",
            "_UNLIMITED_OCR2_MAX_CROPS",
            "UnlimitedOCRProcessingInfo",
            "UnlimitedOCRMultiModalProcessor",
        },
    )
    hf_config = types.SimpleNamespace(text_config=types.SimpleNamespace(unlimited_ocr2=unlimited_ocr2))

    class Ctx:
        """The input context: no model-level mm_processor_kwargs, so the request's are the merged ones."""

        def get_hf_config(self, cls=None):
            return hf_config

        def get_hf_processor(self, cls, **kwargs):
            return cls(tokenizer=_Tokenizer(), **kwargs)

        def get_merged_mm_kwargs(self, kwargs):
            return dict(kwargs)

    info = model["UnlimitedOCRProcessingInfo"](Ctx())
    return info, model["UnlimitedOCRMultiModalProcessor"](info), ImageProcessorItems, ns


def page_image(width: int, height: int) -> Image.Image:
    im = Image.new("RGB", (width, height), "white")
    ImageDraw.Draw(im).rectangle((width // 8, height // 8, width // 2, height // 3), fill="black")
    return im


# ------------------------------------------------------------------------------ D1
def golden_d1(vllm: VllmSource) -> dict:
    info, mm, Items, ns = processing_info(vllm)
    # the effective_cropping rule itself, from _get_prompt_updates' source
    rule = vllm.statement(
        "model_executor/models/unlimited_ocr.py",
        "UnlimitedOCRMultiModalProcessor",
        "_get_prompt_updates",
        "effective_cropping =",
    )
    documents = []
    for sizes in DOCUMENTS:
        entry = {"pages": [list(s) for s in sizes]}
        images = [page_image(*s) for s in sizes]
        for name, kwargs in REQUEST_KWARGS.items():

            class MMItems:
                def get_items(self, modality, types_, _sizes=sizes):
                    return Items(_sizes)

            (update,) = mm._get_prompt_updates(MMItems(), kwargs, None)
            expanded = [update.replacement(i) for i in range(len(sizes))]
            assert all(set(r) == {IMAGE_ID} for r in expanded)
            counts = [len(r) for r in expanded]
            scope = {"crop_mode": kwargs.get("crop_mode", ns["CROP_MODE"]), "images": Items(sizes), "self": mm}
            exec(compile(rule, "effective_cropping", "exec"), scope)  # noqa: S102
            effective = scope["effective_cropping"]
            by_info = [info.get_num_image_tokens(image_width=w, image_height=h, cropping=effective) for w, h in sizes]
            processor = info.get_hf_processor(**kwargs)
            out = processor(prompt="<PAGE><image>" * len(sizes), images=images, **kwargs)
            hf_counts = list(out["num_image_tokens"])
            grids = [list(map(int, g)) for g in out["images_spatial_crop"].tolist()]
            if not counts == by_info == hf_counts:
                raise SystemExit(f"vLLM's paths disagree for {sizes} {kwargs}: {counts} {by_info} {hf_counts}")
            entry[name] = {
                "effective_cropping": bool(effective),
                "image_tokens": counts,
                "total": sum(counts),
                "grids": grids,
                "processor_max_crops": processor.max_crops,
            }
        documents.append(entry)
    return {
        "source": "executed",
        "what": (
            "image tokens per page of a request with the pages' <image> placeholders, Unlimited-OCR-2 config "
            "(text_config.unlimited_ocr2 true): UnlimitedOCRMultiModalProcessor._get_prompt_updates (its "
            "effective_cropping rule and get_num_image_tokens) and the HF processor get_hf_processor selects "
            "(UnlimitedOCR2Processor.__call__ on PIL images), which agree; 'default' is a request without "
            "mm_processor_kwargs, 'crop_mode_false' one with {'crop_mode': false}; grids are "
            "images_spatial_crop (tiles across, down; [1, 1]: no tiles)"
        ),
        "vllm": {
            "effective_cropping": vllm.cite(
                "model_executor/models/unlimited_ocr.py", "effective_cropping = bool(crop_mode)"
            ),
            "CROP_MODE": ns["CROP_MODE"],
            "BASE_SIZE": ns["BASE_SIZE"],
            "IMAGE_SIZE": ns["IMAGE_SIZE"],
        },
        "documents": documents,
    }


# ------------------------------------------------------------------------------ D2
def routing_logits() -> list[list[float]]:
    gen = torch.Generator().manual_seed(ROUTING_SEED)
    raw = torch.randn(ROUTING_TOKENS, ROUTING_EXPERTS, generator=gen) * 2.0
    return [[round(float(x), 3) for x in row] for row in raw]


def golden_d2(vllm: VllmSource) -> dict:
    envs = types.SimpleNamespace(VLLM_USE_FUSED_MOE_GROUPED_TOPK=True, VLLM_BATCH_INVARIANT=False)
    platform = types.SimpleNamespace(is_cuda=lambda: False, is_xpu=lambda: False)

    def fused_grouped_topk(*args, **kwargs):
        raise AssertionError("the fused CUDA path is not taken without e_score_correction_bias")

    ns = vllm.run(
        "model_executor/layers/fused_moe/router/grouped_topk_router.py",
        {"torch": torch, "envs": envs, "current_platform": platform, "fused_grouped_topk": fused_grouped_topk},
        names={"grouped_topk"},
    )
    logits_list = routing_logits()
    logits = torch.tensor(logits_list, dtype=torch.float32)
    hidden = torch.zeros(ROUTING_TOKENS, 1)
    cases = []
    for method, n_group, topk_group, norm, scale in ROUTING_CASES:
        kwargs = dict(
            topk=ROUTING_TOP_K,
            renormalize=norm,
            num_expert_group=n_group,
            topk_group=topk_group,
            scoring_func="softmax",
            routed_scaling_factor=scale,
        )
        weights, ids = ns["grouped_topk"](hidden, logits, **kwargs)
        assert weights.dtype == torch.float32 and ids.dtype == torch.int32
        # torch.topk(sorted=False): the order within a token is unspecified; stored by weight
        rows = [sorted(zip(w, i), key=lambda p: (-p[0], p[1])) for w, i in zip(weights.tolist(), ids.tolist())]
        cases.append(
            {
                "config": {
                    "topk_method": method,
                    "n_group": n_group,
                    "topk_group": topk_group,
                    "norm_topk_prob": norm,
                    "routed_scaling_factor": scale,
                    "scoring_func": "softmax",
                    "n_routed_experts": ROUTING_EXPERTS,
                    "num_experts_per_tok": ROUTING_TOP_K,
                },
                "grouped_topk_kwargs": kwargs,
                "ids": [[i for _, i in row] for row in rows],
                "weights": [[w for w, _ in row] for row in rows],
            }
        )
    rel = "model_executor/models/deepseek_v2.py"
    return {
        "source": "executed",
        "what": (
            "vLLM's grouped_topk (torch.compile dropped; float32 logits on the CPU) on the logits below "
            "(tokens x experts), for the config keys of each case as DeepseekV2MoE passes them: "
            "use_grouped_topk=True, num_expert_group=n_group, topk_group=topk_group, renormalize=norm_topk_prob, "
            "whatever topk_method says (the function takes none; deepseek_v2.py reads topk_method only for "
            "noaux_tc). ids and weights of each token ordered by descending weight: grouped_topk calls "
            "torch.topk with sorted=False (VLLM_BATCH_INVARIANT unset), so its own order is unspecified"
        ),
        "scaling_note": (
            "weights are what grouped_topk returns when given routed_scaling_factor (the weights times the "
            "factor). On CUDA, DeepseekV2MoE is built with apply_routed_scale_to_output=True (unless ROCm "
            "AITER), so fused_moe/layer.py passes 1.0 to the router and moe_runner.py "
            "_maybe_apply_routed_scale_to_output multiplies the routed experts' output by the factor "
            "instead: the same product, another rounding order"
        ),
        "n_group_1_note": (
            "with n_group 1 and topk_group 1, router_factory.py may pick a non-grouped router (FusedTopKRouter "
            "when the scale is handled downstream; CPURouter on the CPU); grouped_topk with one group, "
            "run here, selects the same experts"
        ),
        "vllm": {
            "use_grouped_topk": vllm.cite(rel, "use_grouped_topk=True"),
            "num_expert_group": vllm.cite(rel, "num_expert_group=getattr(config"),
        },
        "logits": logits_list,
        "cases": cases,
    }


# ------------------------------------------------------------------------------ D5
def golden_d5(vllm: VllmSource) -> dict:
    class DeepseekVLV2Config:
        """transformers' config: keyword arguments become attributes; ``language_config`` the text config."""

        def __init__(self, **kwargs):
            for k, v in kwargs.items():
                setattr(self, k, v)
            self.text_config = types.SimpleNamespace(**kwargs.get("language_config", {}))

    configs = vllm.run(
        "transformers_utils/configs/unlimited_ocr.py",
        {"DeepseekVLV2Config": DeepseekVLV2Config},
        names={"UnlimitedOCRConfig"},
    )
    verify = vllm.run(
        "model_executor/models/config.py",
        {"logger": _Logger()},
        names={"VerifyAndUpdateConfig", "UnlimitedOCRForCausalLMConfig"},
    )["UnlimitedOCRForCausalLMConfig"].verify_and_update_model_config
    rel = "v1/attention/backends/triton_attn.py"
    builder_init = vllm.statement(rel, "TritonAttentionMetadataBuilder", "__init__", "if self.rswa_window is not None")
    builder_build = vllm.statement(
        rel, "TritonAttentionMetadataBuilder", "build", "if self.rswa_window is not None and rswa_prefix_lens"
    )
    head_dim = TEXT_CONFIG["hidden_size"] // TEXT_CONFIG["num_attention_heads"]
    cases = []
    for name, block, local, rswa in RSWA_CASES:
        sparse = {
            "training_stage": "dash",
            "dash_stage0": "head_cls",
            "sparse_main_rope_mode": "page2d",
            "sparse_rope_mode": "page2d",
            "sparse_rope_page_span": 0,
            "use_sparse_attention": True,
            "image_bucket_constraint": True,
            "dash_image_only": True,
            "sparse_attention_freq": [1] * TEXT_CONFIG["num_hidden_layers"],
            "sparse_index_dim": head_dim,
            "dash_sigma": 1.0,
            "dash_topk_blocks": 4,
            "sparse_block_size": block,
            "sparse_local_block": local,
        }
        raw = {"language_config": dict(TEXT_CONFIG), "sparse_attention_config": sparse}
        if rswa != ABSENT:
            raw["rswa_window"] = rswa
        hf_config = configs["UnlimitedOCRConfig"](**raw)
        read_as = hf_config.rswa_window
        model_config = types.SimpleNamespace(hf_config=hf_config, model_arch_config=types.SimpleNamespace())
        case = {
            "name": name,
            "sparse_block_size": block,
            "sparse_local_block": local,
            "window": block * local,
            "rswa_window": rswa,
            "config_reads_it_as": read_as,
        }
        try:
            verify(model_config)
        except ValueError as exc:
            case.update(accepted=False, error=str(exc))
            cases.append(case)
            continue
        effective = model_config.model_arch_config.rswa_window
        # what the attention metadata builder then hands DASH attention as prompt lengths
        self = types.SimpleNamespace(rswa_window=effective, persistent_rswa_prefix_lens=None, device="cpu")
        scope = {
            "self": self,
            "torch": torch,
            "vllm_config": types.SimpleNamespace(scheduler_config=types.SimpleNamespace(max_num_seqs=4)),
            "device": "cpu",
        }
        exec(compile(builder_init, rel, "exec"), scope)  # noqa: S102
        metadata = types.SimpleNamespace(rswa_prefix_lens=None, rswa_window=None)  # the dataclass's defaults
        scope.update(attn_metadata=metadata, rswa_prefix_lens=torch.tensor([PROMPT_TOKENS]), num_reqs=1)
        exec(compile(builder_build, rel, "exec"), scope)  # noqa: S102
        passed = metadata.rswa_prefix_lens
        case.update(
            accepted=True,
            error=None,
            effective_rswa_window=effective,
            prompt_length=None if passed is None else int(passed[0]),
        )
        cases.append(case)
    cfg_rel = "model_executor/models/config.py"
    return {
        "source": "executed",
        "what": (
            "an Unlimited-OCR-2 config.json (language_config hidden 128, 4 heads, 2 layers; a "
            "sparse_attention_config with the required flags and the block sizes below) with rswa_window absent "
            "or set: UnlimitedOCRConfig(**config) (config_reads_it_as: the attribute an absent key gets), then "
            "UnlimitedOCRForCausalLMConfig.verify_and_update_model_config (accepted, or its error), "
            "effective_rswa_window (model_config.rswa_window afterwards; null: full KV), and the prompt length "
            f"DASH attention gets for a {PROMPT_TOKENS}-token prompt (TritonAttentionMetadataBuilder's R-SWA "
            "statements; null: none)"
        ),
        "vllm": {
            "default": vllm.cite("transformers_utils/configs/unlimited_ocr.py", "rswa_window: int = 128"),
            "check": vllm.cite(cfg_rel, "if requested not in (None, 0, window)"),
            "prompt_lengths": vllm.cite(rel, "if self.rswa_window is not None and rswa_prefix_lens"),
        },
        "prompt_tokens": PROMPT_TOKENS,
        "cases": cases,
    }


# ------------------------------------------------------------------------------ D11
def golden_d11(vllm: VllmSource) -> dict:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    rel = "model_executor/models/unlimited_ocr2.py"
    tree = vllm.tree(rel)
    doc = next(
        ast.get_docstring(n)
        for n in ast.walk(tree)
        if isinstance(n, ast.ClassDef) and n.name == "PageCountGuardLogitsProcessor"
    )
    found = re.search(r"\(``(.+?)``\)", " ".join(doc.split()))
    if not found:
        raise SystemExit(f"vllm/{rel}: PageCountGuardLogitsProcessor's docstring names no layout")
    layout = found.group(1)
    instruction = ast.literal_eval(layout.split("+", 1)[1].strip())
    template_rel = "transformers_utils/chat_templates/template_deepseek_ocr.jinja"
    template = vllm.text(template_rel)
    registry_rel = "transformers_utils/chat_templates/registry.py"
    vllm.text(registry_rel)
    fallback = vllm.cite(registry_rel, '"unlimited-ocr": CHAT_TEMPLATES_DIR / "template_deepseek_ocr.jinja"')

    def render(content: str) -> str:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)  # as transformers renders
        return env.from_string(template).render(
            messages=[{"role": "user", "content": content}], bos_token=BOS_TEXT, add_generation_prompt=True
        )

    class HfRenderer:
        def validate_token_ids(self, token_ids, *, parameter=None):
            pass

    class VLLMValidationError(ValueError):
        def __init__(self, message, parameter=None):
            super().__init__(message)

    renderer_cls = vllm.run(
        "renderers/unlimited_ocr2.py",
        {"HfRenderer": HfRenderer, "VLLMValidationError": VLLMValidationError, "cast": lambda t, x: x},
        names={"UnlimitedOCR2Renderer"},
    )["UnlimitedOCR2Renderer"]
    renderer = renderer_cls.__new__(renderer_cls)
    renderer.model_config = types.SimpleNamespace(
        hf_config=types.SimpleNamespace(sparse_attention_config={"page_token_id": PAGE_ID, "image_token_id": IMAGE_ID})
    )

    def accepts(segments: list) -> dict:
        """vLLM's renderer on token ids: BOS, then the segments (text, or a run of image tokens)."""
        ids, tok = [BOS_ID], _Tokenizer()
        for s in segments:
            ids += [IMAGE_ID] * s if isinstance(s, int) else tok.encode(s)
        try:
            renderer.validate_token_ids(ids)
        except VLLMValidationError as exc:
            return {"segments": ["[BOS]", *segments], "accepted": False, "error": str(exc)}
        return {"segments": ["[BOS]", *segments], "accepted": True}

    info, _, _, _ = processing_info(vllm)

    def processor_segments(content: str, sizes: list[tuple[int, int]]) -> list:
        """The token ids vLLM's HF processor makes of ``content`` and pages of ``sizes``, as segments."""
        processor = info.get_hf_processor()
        ids = processor(prompt=content, images=[page_image(*s) for s in sizes])["input_ids"][0].tolist()
        text = {v: k for k, v in processor.tokenizer.pieces.items()} | {BOS_ID: "[BOS]", PAGE_ID: "<PAGE>"}
        segments: list = []
        for t in ids:
            if t == IMAGE_ID and segments and isinstance(segments[-1], int):
                segments[-1] += 1
            else:
                segments.append(1 if t == IMAGE_ID else text[t])
        return segments

    prompts = {}
    for pages in (1, 3):
        if pages > 1:
            content = eval(layout, {"__builtins__": {}}, {"n_pages": pages})  # noqa: S307 - vLLM's docstring
            sizes = [(1240, 1754)] * pages
            prompts[str(pages)] = {
                "instruction": instruction,
                "content": content,
                "rendered": render(content),
                "page_sizes": [list(s) for s in sizes],
                "processor_segments": processor_segments(content, sizes),
            }
        else:
            prompts[str(pages)] = {
                "instruction": None,
                "content": None,
                "note": (
                    "vLLM 0.34.0 defines no single-page text: the layout above is the multi-page one, and the "
                    "prompt is the user's; its renderer requires <PAGE><image> for every page, one page too "
                    "(renderer_checks)"
                ),
            }
    checks = [
        accepts(["<PAGE>", 7, "<PAGE>", 5, "<PAGE>", 3, instruction]),
        accepts(["<PAGE>", 7, "document parsing."]),
        accepts([7, "document parsing."]),
        accepts(["<PAGE>", 7, "\n", 5, "document parsing."]),
    ]
    return {
        "source": "executed",
        "what": (
            "vLLM builds no prompt text: the multi-page layout is the one PageCountGuardLogitsProcessor's "
            "docstring gives (read, evaluated for n_pages), rendered through the chat template vLLM falls back "
            "to for model_type unlimited-ocr (executed with jinja2 as transformers renders it: bos_token + "
            "content); processor_segments: the token ids UnlimitedOCR2Processor makes of the content and pages "
            "of page_sizes (BOS once, each text piece tokenized on its own); renderer_checks: "
            "UnlimitedOCR2Renderer.validate_token_ids on expanded token ids (segments: text, or an int = a run "
            "of that many image tokens)"
        ),
        "vllm": {
            "layout": vllm.cite(rel, "In the multi-page layout"),
            "chat_template_fallback": fallback,
            "renderer": vllm.cite("renderers/unlimited_ocr2.py", "def _validate_pages"),
        },
        "layout": layout,
        "bos_token": BOS_TEXT,
        "multi_page_instruction": instruction,
        "single_page_instruction": None,
        "prompts": prompts,
        "renderer_checks": checks,
    }


# ------------------------------------------------------------------------------ D8
def golden_d8(vllm: VllmSource) -> dict:
    rel = "model_executor/models/deepseek_v2.py"
    source = vllm.text(rel)
    tree = ast.parse(source)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DeepseekV2ForCausalLM")
    body = ast.get_source_segment(source, cls)
    if "self.lm_head = ParallelLMHead(" not in body or re.search(r"\btie", body):
        raise SystemExit(f"vllm/{rel}: DeepseekV2ForCausalLM changed; read it again")
    for other in ("model_executor/models/unlimited_ocr.py", "model_executor/models/deepseek_ocr.py"):
        if "tie_word_embeddings" in vllm.text(other) or "tie_weights" in vllm.text(other):
            raise SystemExit(f"vllm/{other} mentions tying; read it again")
    vllm.text("model_executor/model_loader/weight_tying.py")
    vllm.text("config/model.py")
    return {
        "source": "read",
        "ties_lm_head": False,
        "what": (
            "DeepseekV2ForCausalLM (what UnlimitedOCR2TextForCausalLM derives from) always builds its own "
            "ParallelLMHead and reads no tie_word_embeddings; DeepseekOCRForCausalLM maps the checkpoint's "
            "lm_head. to language_model.lm_head. and neither ties. With lm_head.weight absent the default "
            "loader raises 'Following weights were not initialized from checkpoint'"
        ),
        "retie_note": (
            "vLLM's generic ModelConfig.maybe_untie_word_embeddings / maybe_retie_word_embeddings "
            "(config/model.py, model_loader/weight_tying.py) share the two tensors' storage after loading only "
            "when the config says tied and the loaded lm_head equals the embeddings bit for bit: the same values, "
            "so no change in output"
        ),
        "vllm": {
            "lm_head": vllm.cite(rel, "self.lm_head = ParallelLMHead("),
        },
    }


# ------------------------------------------------------------------------------ output
def dumps(obj, indent: int = 0) -> str:
    """JSON with lists of numbers or short strings on one line."""
    pad = "  " * indent
    if isinstance(obj, dict):
        if not obj:
            return "{}"
        items = [f"{pad}  {json.dumps(k)}: {dumps(v, indent + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if isinstance(obj, list):
        flat = all(not isinstance(x, (dict, list)) for x in obj)
        if flat:
            return json.dumps(obj, ensure_ascii=False)
        if all(isinstance(x, list) and all(not isinstance(y, (dict, list)) for y in x) for x in obj):
            if len(json.dumps(obj)) <= 60:
                return json.dumps(obj, ensure_ascii=False)
            rows = [f"{pad}  {json.dumps(x, ensure_ascii=False)}" for x in obj]
            return "[\n" + ",\n".join(rows) + f"\n{pad}]"
        items = [f"{pad}  {dumps(x, indent + 1)}" for x in obj]
        return "[\n" + ",\n".join(items) + f"\n{pad}]"
    return json.dumps(obj, ensure_ascii=False)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-root", type=Path, required=True, help="folder holding the unpacked vllm-0.34.0 wheel")
    ap.add_argument("--out", type=Path, default=Path("tests/data/vllm_defaults_golden.json"))
    args = ap.parse_args(argv)
    vllm = VllmSource(args.vllm_root)
    version = re.search(r"__version__ = version = '([^']+)'", vllm.text("_version.py")).group(1)
    if version != VLLM_VERSION:
        raise SystemExit(f"the wheel is vLLM {version}, not {VLLM_VERSION}")
    out = {
        "vllm_version": version,
        "made_by": "scripts/vllm_defaults_golden.py (its docstring says how)",
        "D1_multi_page_crop": golden_d1(vllm),
        "D2_grouped_routing": golden_d2(vllm),
        "D5_rswa_window": golden_d5(vllm),
        "D8_lm_head": golden_d8(vllm),
        "D11_prompt": golden_d11(vllm),
    }
    out["vllm_files"] = dict(sorted(vllm.files.items()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(dumps(out) + "\n", encoding="utf-8")
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
