"""The model families the tools know (:class:`~dash_trt.models.interface.ModelFamily`), and
:func:`family_of`: DASH decoders (:class:`dash_trt.modeling.DashModel` and every subclass:
the built-in decoder, Unlimited-OCR-2, a user's class), declared here, and the Qwen2 /
Qwen2-MoE models with Dual Chunk Attention, whose record lives beside them (their package's
``family`` module); :func:`family_of_checkpoint`, a checkpoint's."""

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
from .interface import ModelFamily
from .prompts import check_prompts
from .qwen2_dca.family import DCA

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
