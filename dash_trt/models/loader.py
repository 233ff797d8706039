"""Which loader a checkpoint needs: the one entry point of the tools that serve any model.

A Hugging Face folder whose ``config.json`` carries ``dual_chunk_attention_config`` is a
Qwen2 decoder with Dual Chunk Attention (:mod:`dash_trt.models.qwen2_dca`); anything else is
a DASH checkpoint (:func:`dash_trt.models.checkpoint.load_checkpoint`).
"""

from __future__ import annotations

import json
import os

from ..dca import CONFIG_KEY
from .checkpoint import CONFIG_FILE, CheckpointError, load_checkpoint
from .qwen2_dca import Qwen2DcaForCausalLM, load_qwen2_dca

__all__ = ["is_dca_folder", "load_model"]


def is_dca_folder(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a folder whose ``config.json`` has a ``dual_chunk_attention_config``."""
    config = os.path.join(os.fspath(path), CONFIG_FILE)
    if not os.path.isfile(config):
        return False
    try:
        with open(config, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError, UnicodeDecodeError):
        return False  # load_checkpoint says what is wrong with it
    return isinstance(data, dict) and data.get(CONFIG_KEY) is not None


def load_model(path: str | os.PathLike, *, allow_pickle: bool = False, model_class: str | type | None = None):
    """The model of a checkpoint: a DCA folder (:func:`~dash_trt.models.qwen2_dca.load_qwen2_dca`)
    or a DASH checkpoint (:func:`~dash_trt.models.checkpoint.load_checkpoint`, with
    ``allow_pickle`` and ``model_class``)."""
    if is_dca_folder(path):
        if model_class not in (None, "", Qwen2DcaForCausalLM) and not str(model_class).endswith(":Qwen2DcaForCausalLM"):
            raise CheckpointError(
                f"{os.fspath(path)} is a Dual Chunk Attention folder (Qwen2DcaForCausalLM); --model "
                f"{model_class} does not apply to it"
            )
        return load_qwen2_dca(path)
    return load_checkpoint(path, allow_pickle=allow_pickle, model_class=model_class)
