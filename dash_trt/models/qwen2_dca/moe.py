"""Qwen2-MoE with Dual Chunk Attention in every layer (seed 002 covers Qwen2 and Qwen2-MoE; vLLM's
``Qwen2MoeModel`` passes ``dual_chunk_attention_config`` to its attention as ``Qwen2Model`` does).

The architecture and parameter names are Hugging Face's ``Qwen2MoeForCausalLM``
(``model_type`` ``qwen2_moe``). Everything but the feed-forward block is the Qwen2 DCA model
(:mod:`dash_trt.models.qwen2_dca.model`: embeddings, RMSNorms, q/k/v projections with bias, DCA, the
head), reused, not copied: :class:`Qwen2MoeDcaForCausalLM` subclasses
:class:`~dash_trt.models.qwen2_dca.model.Qwen2DcaForCausalLM` and only builds another ``mlp`` per
layer, so its three forms (reference, paged, export), caches, loading, saving, generation and
ONNX export are that model's, and every tool that takes the Qwen2 DCA model takes this one.

Layer ``i``'s ``mlp`` is the sparse block (:class:`Qwen2MoeSparseBlock`) when ``i`` is not in
``mlp_only_layers``, ``num_experts > 0`` and ``(i + 1) % decoder_sparse_step == 0``; else Qwen2's
gated MLP of ``intermediate_size`` (``mlp.{gate,up,down}_proj``). The sparse block of a token
``x`` (transformers' ``Qwen2MoeSparseMoeBlock``):

- the router ``mlp.gate`` (``Linear(hidden, num_experts)``, no bias) gives logits in the model
  dtype; their softmax over **all** experts in float32; the ``num_experts_per_tok`` highest
  probabilities (equal ones in index order), divided by their sum only when ``norm_topk_prob``;
  the weights cast to the model dtype;
- ``Σ_k weight_k · expert_{id_k}(x)`` over the chosen experts ``mlp.experts.{e}.{gate,up,down}_proj``
  (SiLU-gated MLPs of ``moe_intermediate_size``); each product in the model dtype, the sum in
  float32 (transformers sums in the model dtype: the same numbers in float32);
- plus ``sigmoid(mlp.shared_expert_gate(x)) · mlp.shared_expert(x)``: a gated MLP of
  ``shared_expert_intermediate_size`` that every token runs, scaled by a sigmoid gate
  (``Linear(hidden, 1)``, no bias).

The routed experts run in one of two forms of that sum (:attr:`Qwen2MoeSparseBlock.form`): each
expert on the tokens that chose it (``sparse``, eager), or every expert on every token with a
weight of 0 for the unchosen ones (``dense``), which is what the ONNX export traces
(``torch.compiler.is_exporting()``), as Unlimited-OCR-2's MoE does.
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..decoder import GatedMLP
from .model import (
    MOE_MODEL_TYPE,
    Qwen2DcaConfig,
    Qwen2DcaConfigError,
    Qwen2DcaForCausalLM,
    _int_key,
    init_random_weights,
    save_qwen2_dca,
    tiny_qwen2_dca_config,
)

__all__ = [
    "MODEL_TYPE",
    "ARCHITECTURE",
    "EXPERT_FORMS",
    "Qwen2MoeDcaConfig",
    "Qwen2MoeSparseBlock",
    "Qwen2MoeDcaForCausalLM",
    "route",
    "tiny_qwen2_moe_dca_config",
    "write_tiny_qwen2_moe_dca",
]

MODEL_TYPE = MOE_MODEL_TYPE
ARCHITECTURE = "Qwen2MoeForCausalLM"

#: The forms the routed experts run in (module docstring); ``None`` on the block picks.
EXPERT_FORMS = ("sparse", "dense")


# ------------------------------------------------------------------------------ config
def _bool_key(config: Mapping, key: str, default: bool, *, source: str) -> bool:
    value = config.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise Qwen2DcaConfigError(f"{source}: {key} must be true or false, got {value!r}")
    return value


@dataclass(frozen=True, kw_only=True)
class Qwen2MoeDcaConfig(Qwen2DcaConfig):
    """A Qwen2-MoE ``config.json`` with ``dual_chunk_attention_config``: the Qwen2 keys
    (:class:`~dash_trt.models.qwen2_dca.model.Qwen2DcaConfig`; ``intermediate_size``, the dense layers'
    MLP, defaults to transformers' 5632) and the mixture-of-experts keys, with transformers'
    ``Qwen2MoeConfig`` defaults where it has them."""

    MODEL_TYPE: ClassVar[str] = MODEL_TYPE
    ARCHITECTURE: ClassVar[str] = ARCHITECTURE
    INTERMEDIATE_DEFAULT: ClassVar[int | None] = 5632

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    @property
    def label(self) -> str:
        moe = sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers))
        return (
            f"Qwen2-MoE with Dual Chunk Attention ({self.num_experts} experts, {self.num_experts_per_tok} a token, "
            f"in {moe} of {self.num_hidden_layers} layers)"
        )

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` runs the sparse block (transformers' rule): not in
        ``mlp_only_layers``, and ``(layer_idx + 1) % decoder_sparse_step == 0``."""
        return layer_idx not in self.mlp_only_layers and (layer_idx + 1) % self.decoder_sparse_step == 0

    def static_sizes(self) -> set[int]:
        return super().static_sizes() | {
            self.num_experts,
            self.num_experts_per_tok,
            self.moe_intermediate_size,
            self.shared_expert_intermediate_size,
        }

    @classmethod
    def _fields(cls, config: Mapping[str, Any], source: str) -> dict[str, Any]:
        """The Qwen2 fields and the mixture-of-experts keys. Required: ``num_experts``,
        ``num_experts_per_tok`` (at most ``num_experts``), ``moe_intermediate_size``,
        ``shared_expert_intermediate_size``. Defaults: ``norm_topk_prob`` false,
        ``decoder_sparse_step`` 1, ``mlp_only_layers`` none. Refused: ``qkv_bias`` false (the
        attention is Qwen2's, with q/k/v biases)."""
        fields = super()._fields(config, source)
        moe = {
            k: _int_key(config, k, source=source)
            for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")
        }
        if moe["num_experts_per_tok"] > moe["num_experts"]:
            raise Qwen2DcaConfigError(
                f"{source}: num_experts_per_tok ({moe['num_experts_per_tok']}) must be at most num_experts "
                f"({moe['num_experts']})"
            )
        layers = fields["num_hidden_layers"]
        only = config.get("mlp_only_layers")
        only = [] if only is None else only
        if not isinstance(only, list) or any(
            not isinstance(i, numbers.Integral) or isinstance(i, bool) or not 0 <= i < layers for i in only
        ):
            raise Qwen2DcaConfigError(
                f"{source}: mlp_only_layers must be a list of layer indices in [0, {layers}), got {only!r}"
            )
        if config.get("qkv_bias") is False:
            raise Qwen2DcaConfigError(
                f"{source}: qkv_bias is false; the attention is Qwen2's, with q/k/v biases (as every Qwen2-MoE "
                "checkpoint has them)"
            )
        return dict(
            fields,
            **moe,
            norm_topk_prob=_bool_key(config, "norm_topk_prob", False, source=source),
            decoder_sparse_step=_int_key(config, "decoder_sparse_step", 1, source=source),
            mlp_only_layers=tuple(sorted({int(i) for i in only})),
        )

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out.update(
            num_experts=self.num_experts,
            num_experts_per_tok=self.num_experts_per_tok,
            moe_intermediate_size=self.moe_intermediate_size,
            shared_expert_intermediate_size=self.shared_expert_intermediate_size,
            norm_topk_prob=self.norm_topk_prob,
            decoder_sparse_step=self.decoder_sparse_step,
            mlp_only_layers=list(self.mlp_only_layers),
        )
        return out


def tiny_qwen2_moe_dca_config(**overrides: Any) -> dict[str, Any]:
    """A tiny Qwen2-MoE ``config.json``: the tiny Qwen2 one
    (:func:`~dash_trt.models.qwen2_dca.model.tiny_qwen2_dca_config`: hidden 64, 4 heads over 2 KV heads
    of dim 16, 2 layers, vocab 96, DCA chunk_size 32 / local_size 8) with 8 experts of width 32, 2 a
    token, a shared expert of width 48, every layer sparse; ``overrides`` replace keys."""
    config = tiny_qwen2_dca_config(
        architectures=[ARCHITECTURE],
        model_type=MODEL_TYPE,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        norm_topk_prob=False,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )
    config.update(overrides)
    return config


# ------------------------------------------------------------------------------ routing
def _top(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest of each row, equal values in index order: a stable sort in
    PyTorch; in an exported graph ONNX's TopK, which orders ties the same way (the exporter has
    no stable sort). transformers' ``torch.topk`` leaves the order of ties unspecified."""
    if torch.compiler.is_exporting():
        return torch.topk(x, k, dim=-1).indices
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :k]


def route(logits: torch.Tensor, k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, k] in the logits' dtype, expert ids [T, k] int64)`` from the router's
    logits [T, E]: softmax over all experts in float32, the k highest, divided by their sum with
    ``norm_topk_prob``, cast back to the logits' dtype (transformers' ``Qwen2MoeTopKRouter``)."""
    probs = torch.softmax(logits.float(), dim=-1)
    ids = _top(probs, k)
    weights = probs.gather(1, ids)
    if norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights.to(logits.dtype), ids


# ------------------------------------------------------------------------------ modules
class Qwen2MoeSparseBlock(nn.Module):
    """Qwen2-MoE's sparse feed-forward block (module docstring), Hugging Face names: ``gate``,
    ``experts.{e}``, ``shared_expert``, ``shared_expert_gate``."""

    def __init__(self, cfg: Qwen2MoeDcaConfig):
        super().__init__()
        h = cfg.hidden_size
        self.num_experts_per_tok = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.gate = nn.Linear(h, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(GatedMLP(h, cfg.moe_intermediate_size) for _ in range(cfg.num_experts))
        self.shared_expert = GatedMLP(h, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(h, 1, bias=False)
        #: one of :data:`EXPERT_FORMS`, or None: dense while exporting, sparse otherwise
        self.form: str | None = None

    def form_for(self) -> str:
        """The form this call runs in (:attr:`form`, or dense while exporting, else sparse)."""
        if self.form is not None:
            if self.form not in EXPERT_FORMS:
                raise ValueError(f"form is {self.form!r}; one of {EXPERT_FORMS} or None")
            return self.form
        return "dense" if torch.compiler.is_exporting() else "sparse"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> [T, hidden] in ``x``'s dtype."""
        weights, ids = route(self.gate(x), self.num_experts_per_tok, self.norm_topk_prob)
        if self.form_for() == "dense":
            routed = self.dense_experts(x, weights, ids)
        else:
            routed = self.sparse_experts(x, weights, ids)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return routed.to(x.dtype) + shared

    def sparse_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Σ_k weight_k · expert_{id_k}(x) [T, hidden] float32, each expert run on the tokens that
        chose it (a host synchronisation per call: eager only)."""
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in torch.unique(ids).tolist():
            tok, slot = torch.nonzero(ids == e, as_tuple=True)
            y = self.experts[e](x[tok]) * weights[tok, slot, None]
            out.index_add_(0, tok, y.float())
        return out

    def dense_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The same sum with every expert run on every token (batched products over the experts'
        stacked weights; a weight of 0 for the experts a token did not choose): no data-dependent
        shapes, so it exports."""
        gate = torch.stack([e.gate_proj.weight for e in self.experts])  # [E, I, H]
        up = torch.stack([e.up_proj.weight for e in self.experts])
        down = torch.stack([e.down_proj.weight for e in self.experts])  # [E, H, I]
        xs = x.unsqueeze(0)  # [1, T, H]
        h = F.silu(torch.matmul(xs, gate.transpose(1, 2))) * torch.matmul(xs, up.transpose(1, 2))  # [E, T, I]
        y = torch.matmul(h, down.transpose(1, 2))  # [E, T, H]
        dense = torch.zeros(x.shape[0], len(self.experts), dtype=weights.dtype, device=x.device)
        dense = dense.scatter(1, ids, weights)  # [T, E]
        return (dense.t().unsqueeze(-1) * y).float().sum(0)


class Qwen2MoeDcaForCausalLM(Qwen2DcaForCausalLM):
    """Qwen2-MoE with Dual Chunk Attention: the Qwen2 DCA model (its attention, decoder layers,
    forms, caches, export) with :class:`Qwen2MoeSparseBlock` as the ``mlp`` of the layers
    :meth:`Qwen2MoeDcaConfig.is_moe_layer` names."""

    config_class: ClassVar[type[Qwen2DcaConfig]] = Qwen2MoeDcaConfig

    def build_mlp(self, config: Qwen2DcaConfig, layer_idx: int) -> nn.Module:
        if config.is_moe_layer(layer_idx):
            return Qwen2MoeSparseBlock(config)
        return super().build_mlp(config, layer_idx)

    def moe_blocks(self) -> list[Qwen2MoeSparseBlock]:
        """The sparse blocks, in layer order."""
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, Qwen2MoeSparseBlock)]

    def set_expert_form(self, form: str | None) -> None:
        """Every sparse block's :attr:`Qwen2MoeSparseBlock.form` (None: dense while exporting,
        sparse otherwise)."""
        if form is not None and form not in EXPERT_FORMS:
            raise ValueError(f"form is {form!r}; one of {EXPERT_FORMS} or None")
        for block in self.moe_blocks():
            block.form = form


def write_tiny_qwen2_moe_dca(folder: str | os.PathLike, *, seed: int = 0, **overrides: Any) -> list[str]:
    """A random-weight Hugging Face folder (``config.json``, ``model.safetensors``) of
    :func:`tiny_qwen2_moe_dca_config` (``overrides`` passed on), weights by
    :func:`~dash_trt.models.qwen2_dca.model.init_random_weights`. Returns the files written."""
    config = Qwen2MoeDcaConfig.from_dict(tiny_qwen2_moe_dca_config(**overrides))
    model = init_random_weights(Qwen2MoeDcaForCausalLM(config), seed)
    return save_qwen2_dca(model.to(config.dtype), folder)
