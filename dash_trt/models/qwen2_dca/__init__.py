"""Qwen2 and Qwen2-MoE with Dual Chunk Attention in every layer (docs/dca_model.md), one module
each part:

- :mod:`.model`: the Qwen2 model (config, the three forms, loading and saving Hugging Face
  folders, greedy generation through :func:`dash_trt.serving.generate.generate`, and its cache-free
  reference);
- :mod:`.moe`: Qwen2-MoE, the subclass that only builds another feed-forward block;
- :mod:`.load`: which class a folder's config names, and the family's loader;
- :mod:`.export`: the ONNX export, ONNX Runtime as a forward function, and the family's
  ``dash-export`` program;
- :mod:`.family`: the family's record, listed in :data:`dash_trt.models.families.FAMILIES`.

The package gives the names the single module ``dash_trt.models.qwen2_dca`` gave (the model's
and the export's); ``dash_trt.models.qwen2_moe_dca`` is :mod:`.moe` itself
(:mod:`dash_trt._moved`).
"""

from __future__ import annotations

from .export import Qwen2DcaExportGraph, export_onnx, export_program, ort_forward
from .model import (
    ARCHITECTURE,
    GRAPH_INPUTS,
    MODEL_TYPE,
    MOE_MODEL_TYPE,
    DcaGeneration,
    ForwardFn,
    Qwen2DcaConfig,
    Qwen2DcaConfigError,
    Qwen2DcaForCausalLM,
    generate,
    init_random_weights,
    load_qwen2_dca,
    reference_generate,
    save_qwen2_dca,
    tiny_qwen2_dca_config,
    write_tiny_qwen2_dca,
)

__all__ = [
    "MODEL_TYPE",
    "ARCHITECTURE",
    "MOE_MODEL_TYPE",
    "GRAPH_INPUTS",
    "ForwardFn",
    "Qwen2DcaConfigError",
    "Qwen2DcaConfig",
    "Qwen2DcaForCausalLM",
    "Qwen2DcaExportGraph",
    "tiny_qwen2_dca_config",
    "init_random_weights",
    "load_qwen2_dca",
    "save_qwen2_dca",
    "write_tiny_qwen2_dca",
    "DcaGeneration",
    "generate",
    "reference_generate",
    "export_program",
    "export_onnx",
    "ort_forward",
]
