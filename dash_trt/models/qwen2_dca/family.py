"""The Qwen2 / Qwen2-MoE Dual Chunk Attention family's record
(:class:`~dash_trt.models.interface.ModelFamily`), listed in
:data:`dash_trt.models.families.FAMILIES`: its check prompts, how an ONNX file is told apart from
the model, its Triton checkpoint (a Hugging Face folder), its loader and ``dash-export`` program,
and the backends it does not run on."""

from __future__ import annotations

import os

import torch

from ...onnx_graph import read_graph
from ..interface import CUDA_KERNELS, DOCUMENTS, TENSORRT, CheckPrompts, ModelFamily
from .export import run_export
from .load import claims_config, load_dca_checkpoint
from .model import Qwen2DcaForCausalLM, save_qwen2_dca

__all__ = ["DCA"]


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
