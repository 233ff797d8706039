"""The model families the tools know (:class:`~dash_trt.models.interface.ModelFamily`), and
:func:`family_of`: DASH decoders (:class:`dash_trt.modeling.DashModel` and every subclass:
the built-in decoder, Unlimited-OCR-2, a user's class) and the Qwen2 / Qwen2-MoE models with
Dual Chunk Attention; :func:`family_of_checkpoint`, a checkpoint's."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from typing import Any

import torch

from ..modeling import DashModel, ModelContractError
from ..onnx_graph import read_graph
from .checkpoint import CONFIG_FILE, load_checkpoint, save_checkpoint
from .interface import CUDA_KERNELS, DOCUMENTS, TENSORRT, CheckPrompts, ModelFamily
from .prompts import check_prompts
from .qwen2_dca import Qwen2DcaForCausalLM, save_qwen2_dca
from .qwen2_dca_export import run_export
from .qwen2_dca_load import claims_config, load_dca_checkpoint

__all__ = ["FAMILIES", "DASH", "DCA", "family_of", "family_of_checkpoint"]


# ----------------------------------------------------------------------------- DASH decoders
def _dash_onnx_mismatches(model: DashModel, path: str | os.PathLike, kv_block_size: int | None) -> list[str]:
    return read_graph(path).mismatches(model, kv_block_size)


def _dash_contract(model: DashModel) -> None:
    """The attention layers the config promises, and image features of the config's
    ``image_feature_dim`` taken by ``embed_image_features`` (the built-in decoder passes through
    only features of the hidden size)."""
    model.dash_layers()
    if model.takes_image_features:
        with torch.no_grad():
            probe = torch.zeros(1, model.config.image_feature_dim, dtype=model.dtype, device=model.device)
            out = model.embed_image_features(probe)
        if tuple(out.shape) != (1, model.config.hidden_size):
            raise ModelContractError(
                f"{type(model).__name__}.embed_image_features maps [1, {model.config.image_feature_dim}] image "
                f"features to {list(out.shape)}, not [1, {model.config.hidden_size}] (hidden_size)"
            )


def _dash_save(model: DashModel, path: str, source: str | None) -> None:
    if source is not None:
        shutil.copyfile(source, path)
    else:
        save_checkpoint(model, path)


def _dash_load(path: str | os.PathLike, *, allow_pickle: bool = False, model_class: str | type | None = None):
    return load_checkpoint(path, allow_pickle=allow_pickle, model_class=model_class)


DASH = ModelFamily(
    label="DASH decoder",
    classes=(DashModel,),
    checkpoint_name="model.pt",
    check_prompts=check_prompts,
    onnx_mismatches=_dash_onnx_mismatches,
    save=_dash_save,
    load=_dash_load,
    check_contract=_dash_contract,
)


# ------------------------------------------------------------------ Dual Chunk Attention models
def _dca_prompts(model: Qwen2DcaForCausalLM, seed: int = 0) -> CheckPrompts:
    """Random tokens: one prompt across more than two chunks (intra, successive and inter
    attention), one shorter than a chunk; no image features."""
    span, vocab = model.config.dca.chunk_len, model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (2 * span + span // 2 + 3, max(2, span // 3))
    ]
    return prompts, None


def _dca_onnx_mismatches(model: Qwen2DcaForCausalLM, path: str | os.PathLike, kv_block_size: int | None) -> list[str]:
    past = [t.name for t in read_graph(path).inputs if t.name.startswith("past.")]
    want = model.cache_names("past")
    if past == want:
        return []
    return [
        f"its caches are {len(past)} inputs ({', '.join(past[:4])}...), the model's {len(want)} "
        "(a key and a value per layer)"
    ]


def _dca_save(model: Qwen2DcaForCausalLM, path: str, source: str | None) -> None:
    save_qwen2_dca(model, path)  # a Hugging Face folder, whatever the user loaded it from


DCA = ModelFamily(
    label="Dual Chunk Attention model",
    classes=(Qwen2DcaForCausalLM,),
    checkpoint_name="checkpoint",
    check_prompts=_dca_prompts,
    onnx_mismatches=_dca_onnx_mismatches,
    save=_dca_save,
    load=load_dca_checkpoint,
    claims=claims_config,
    export_command=run_export,
    unsupported={
        CUDA_KERNELS: "no CUDA kernels of Dual Chunk Attention",
        TENSORRT: "the plugin has no DualChunkAttention kernels",
        DOCUMENTS: "a Dual Chunk Attention model reads token ids, not documents",
    },
)

#: Every family, searched in order by :func:`family_of`.
FAMILIES: tuple[ModelFamily, ...] = (DASH, DCA)


def family_of(model: Any) -> ModelFamily:
    """The family ``model`` belongs to (ModelContractError if none)."""
    for family in FAMILIES:
        if family.owns(model):
            return family
    raise ModelContractError(
        f"{type(model).__name__} is not a model dash-trt knows: subclass dash_trt.modeling.DashModel "
        "(docs/models.md) or load a Qwen2 Dual Chunk Attention folder"
    )


def family_of_checkpoint(path: str | os.PathLike) -> ModelFamily:
    """The family of the checkpoint at ``path``: the first whose ``claims`` takes the folder's
    ``config.json``; else (a file, a folder without a readable JSON object there, one no family
    claims) :data:`DASH`, whose loader says what is wrong with it."""
    config = _folder_config(path)
    if config is not None:
        for family in FAMILIES:
            if family.claims is not None and family.claims(config):
                return family
    return DASH


def _folder_config(path: str | os.PathLike) -> Mapping[str, Any] | None:
    """The parsed ``config.json`` of a checkpoint folder, or None (no such file, not a JSON object)."""
    config = os.path.join(os.fspath(path), CONFIG_FILE)
    if not os.path.isfile(config):
        return None
    try:
        with open(config, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) else None
