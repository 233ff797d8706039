"""The built-in DASH decoder, :class:`DashForCausalLM`, and the demo model's config.

Architecture (Llama-like): token embeddings; ``num_hidden_layers`` decoder layers, each
RMSNorm -> q/k/v projections plus Unlimited-OCR-2's DASH router (:class:`~dash_trt.modeling.
DashRouter`: the indexer's ``iq``/``ik`` and the learned ``head_cls``) -> DASH attention (the
torch custom op, :mod:`dash_trt.attention.dash.ops`) -> output projection, residual; RMSNorm -> gated MLP
(SiLU) -> residual; final RMSNorm; logits. Image tokens are embedded from the token table or
take image features (``image_feature_dim``); the attention and the cache do not care.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import fused as _fused
from ..attention.dash.config import CONFIG_SECTION
from ..modeling import DashAttention, DashContext, DashModel, DashRouter
from .config import ARCHITECTURE, MODEL_TYPE, DashModelConfig

__all__ = ["DashForCausalLM", "DEMO_CONFIG", "RMSNorm"]


#: The built-in demo model: small enough to export and check in seconds on a CPU, its
#: ``sparse_attention_config`` in Unlimited-OCR-2's schema (flags included; per-layer scale and
#: floor; K of 4 so that a short document still routes).
DEMO_CONFIG: dict[str, Any] = {
    "architectures": [ARCHITECTURE],
    "model_type": MODEL_TYPE,
    "vocab_size": 320,
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 256,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "eos_token_id": 258,
    "torch_dtype": "float32",
    CONFIG_SECTION: {
        "training_stage": "dash",
        "dash_stage0": "head_cls",
        "use_sparse_attention": True,
        "sparse_attention_freq": [1, 1],
        "sparse_block_size": 16,
        "sparse_local_block": 1,
        "sparse_index_dim": 32,
        "dash_topk_blocks": 4,
        "dash_sigma": 1.0,
        "dash_scale_per_layer": [32.0, 16.0],
        "dash_floor_per_layer": [1e-4, 1e-3],
        "sparse_main_rope_mode": "page2d",
        "sparse_rope_mode": "page2d",
        "sparse_rope_page_span": 0,
        "sparse_rope_page_pairs": 1,
        "image_bucket_constraint": True,
        "dash_image_only": True,
        "page_token_id": 256,
        "image_token_id": 257,
    },
}


# --------------------------------------------------------------------------- modules
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: normalise in float32 whatever the model dtype. On a GPU one fused pass with the
        # same roundings (dash_trt.fused), else these five.
        fused_out = _fused.rms_norm(x, self.weight, self.eps) if x.is_cuda else None
        if fused_out is not None:
            return fused_out
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight


class DashSelfAttention(nn.Module):
    """Projections around DASH attention for one layer (the drop-in
    :class:`~dash_trt.modeling.DashAttention` calls the op)."""

    def __init__(self, cfg: DashModelConfig, layer_idx: int):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        self.dash_router = DashRouter(h, cfg.index_head_dim, cfg.rms_norm_eps)
        self.attn = DashAttention(cfg, layer_idx)

    def project(self, x: torch.Tensor):
        t = x.shape[0]
        iq, ik = self.dash_router(x)
        return (
            self.q_proj(x).view(t, self.num_heads, self.head_dim),
            self.k_proj(x).view(t, self.num_kv_heads, self.head_dim),
            self.v_proj(x).view(t, self.num_kv_heads, self.head_dim),
            iq,
            ik,
        )

    def forward(self, x: torch.Tensor, dash: DashContext) -> torch.Tensor:
        q, k, v, iq, ik = self.project(x)
        out = self.attn(q, k, v, iq, ik, self.dash_router.head_cls, dash)
        return self.o_proj(out.reshape(x.shape[0], -1))


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        gate, up = self.gate_proj(x), self.up_proj(x)
        act = _fused.silu_mul(gate, up) if x.is_cuda else None
        return self.down_proj(act if act is not None else F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DashModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DashSelfAttention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, dash: DashContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), dash)
        return x + self.mlp(self.post_attention_layernorm(x))


class DashForCausalLM(DashModel):
    """The built-in decoder: one model that follows the contract of
    :class:`~dash_trt.modeling.DashModel` (see the module docstring)."""

    #: Hugging Face names put the decoder under ``model.`` (``lm_head`` stays at the top).
    checkpoint_prefix = "model."

    def __init__(self, config: DashModelConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, inputs_embeds: torch.Tensor, dash: DashContext) -> torch.Tensor:
        x = inputs_embeds
        for layer in self.layers:
            x = layer(x, dash)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))
