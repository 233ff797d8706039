"""Loading a Qwen2 or Qwen2-MoE Dual Chunk Attention folder (a Hugging Face folder whose
``config.json`` carries ``dual_chunk_attention_config``): which class its config names
(:func:`dca_model_class`), :func:`load_dca`, and the family's loader for the tools
(:func:`load_dca_checkpoint`, what :func:`dash_trt.models.loader.load_model` runs for such a
folder). A folder with a ``sparse_attention_config.json`` that vLLM and SGLang would run sparse
is refused (:func:`dash_trt.attention.dca.reference.check_dense`)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from ...attention.dca.reference import CONFIG_KEY
from ..checkpoint import CONFIG_FILE, CheckpointError
from .model import MOE_MODEL_TYPE, Qwen2DcaForCausalLM, load_qwen2_dca
from .moe import Qwen2MoeDcaForCausalLM

__all__ = ["claims_config", "dca_model_class", "load_dca", "load_dca_checkpoint"]


def claims_config(config: Mapping[str, Any]) -> bool:
    """Whether a parsed ``config.json`` is a DCA folder's: it has a ``dual_chunk_attention_config``."""
    return config.get(CONFIG_KEY) is not None


def dca_model_class(config: Mapping[str, Any]) -> type[Qwen2DcaForCausalLM]:
    """The model class of a parsed DCA ``config.json``: Qwen2-MoE
    (:class:`~dash_trt.models.qwen2_dca.moe.Qwen2MoeDcaForCausalLM`) for ``model_type``
    ``qwen2_moe`` (or, without a ``model_type``, ``architectures[0]`` ``Qwen2MoeForCausalLM``);
    else Qwen2, whose config refuses any other ``model_type`` with a message."""
    model_type = config.get("model_type")
    if model_type is None:
        archs = config.get("architectures")
        if isinstance(archs, list) and archs and archs[0] == "Qwen2MoeForCausalLM":
            model_type = MOE_MODEL_TYPE
    if model_type == MOE_MODEL_TYPE:
        return Qwen2MoeDcaForCausalLM
    return Qwen2DcaForCausalLM


def load_dca(path: str | os.PathLike, *, dtype=None, device="cpu") -> Qwen2DcaForCausalLM:
    """A DCA folder's model, of the class its config names (:func:`dca_model_class`)."""
    folder = os.fspath(path)
    try:
        with open(os.path.join(folder, CONFIG_FILE), encoding="utf-8") as fh:
            raw = json.load(fh)
    except (OSError, ValueError):
        raw = {}  # the loader names what is wrong with the folder
    return load_qwen2_dca(folder, dtype=dtype, device=device, model_class=dca_model_class(raw))


def load_dca_checkpoint(
    path: str | os.PathLike, *, allow_pickle: bool = False, model_class: str | type | None = None
) -> Qwen2DcaForCausalLM:
    """A DCA folder's model for the tools (:func:`load_qwen2_dca`): ``model_class``, if given, must
    name the class the folder's config asks for, as the Triton service's ``module:Class`` does;
    ``allow_pickle`` does not apply (safetensors only)."""
    with open(os.path.join(os.fspath(path), CONFIG_FILE), encoding="utf-8") as fh:
        cls = dca_model_class(json.load(fh))
    if model_class not in (None, "", cls) and not str(model_class).endswith(f":{cls.__name__}"):
        raise CheckpointError(
            f"{os.fspath(path)} is a Dual Chunk Attention folder ({cls.__name__}); --model "
            f"{model_class} does not apply to it"
        )
    return load_qwen2_dca(path, model_class=cls)
