"""The model API in one import: configs, the built-in decoder, checkpoints, prompts and
generation (``from dash_trt import model as M``).

Nothing is defined here; each name lives where its concern does:

- :mod:`dash_trt.modeling`: the model contract (:class:`DashModel`, :class:`DashAttention`,
  :class:`DashRouter`, :class:`DashContext`, the graph's input names);
- :mod:`dash_trt.models.config`: the ``config.json`` (:class:`DashModelConfig`);
- :mod:`dash_trt.models.prompts`: the demo tokenizer, document prompts, token roles;
- :mod:`dash_trt.models.decoder`: the built-in decoder (:class:`DashForCausalLM`,
  :data:`DEMO_CONFIG`);
- :mod:`dash_trt.models.registry`: which class a config names, random weights;
- :mod:`dash_trt.models.checkpoint`: ``model.pt`` and Hugging Face folders;
- :mod:`dash_trt.serving.generate`: :func:`generate` on the serving runtime and its dense
  reference.
"""

from .modeling import (
    IMAGE_INPUTS,
    MODEL_INPUTS,
    DashAttention,
    DashContext,
    DashModel,
    DashRouter,
    ExportGraph,
    ModelContractError,
    image_feature_rows,
    token_role,
    token_roles,
)
from .models.checkpoint import CheckpointError, load_checkpoint, save_checkpoint, save_pretrained
from .models.config import DTYPES, DashModelConfig, ModelConfigError, load_model_config
from .models.decoder import DEMO_CONFIG, DashForCausalLM
from .models.prompts import check_prompts, detokenize, document_prompt, tokenize
from .models.registry import build_model, demo_model, random_model, resolve_model_class
from .serving.generate import Generation, PagedState, generate, reference_generate

__all__ = [
    "DashModelConfig",
    "ModelConfigError",
    "CheckpointError",
    "DashForCausalLM",
    "DashModel",
    "DashAttention",
    "DashRouter",
    "DashContext",
    "ExportGraph",
    "ModelContractError",
    "resolve_model_class",
    "build_model",
    "image_feature_rows",
    "MODEL_INPUTS",
    "IMAGE_INPUTS",
    "DTYPES",
    "DEMO_CONFIG",
    "demo_model",
    "random_model",
    "save_checkpoint",
    "save_pretrained",
    "load_checkpoint",
    "load_model_config",
    "tokenize",
    "detokenize",
    "document_prompt",
    "check_prompts",
    "token_role",
    "token_roles",
    "PagedState",
    "Generation",
    "generate",
    "reference_generate",
]
