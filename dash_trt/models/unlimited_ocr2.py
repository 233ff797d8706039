"""Unlimited-OCR-2's language model: a DeepSeek-V2 mixture-of-experts decoder with DASH attention
in every layer (:class:`UnlimitedOCR2ForCausalLM`, ``architectures: ["UnlimitedOCRForCausalLM"]``).

Written from the architecture as vLLM 0.34.0 serves it (``models/unlimited_ocr.py``,
``deepseek_v2.py``, ``transformers_utils/configs/deepseek_vl2.py``, ``models/config.py``),
without depending on vLLM:

- the config.json is nested (DeepSeek-VL2 style, :mod:`dash_trt.models.config`): the decoder's
  keys in ``language_config`` (``model_type`` ``"unlimited-ocr"``), ``sparse_attention_config``
  and ``rswa_window`` at the top;
- attention is plain multi-head attention (``use_mla`` false, ``qk_nope_head_dim`` and
  ``qk_rope_head_dim`` 0): ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` without bias,
  ``head_dim = hidden_size / num_attention_heads``, one DASH router a layer
  (``self_attn.dash_router``) whose width ``sparse_index_dim`` equals ``head_dim``; the page
  RoPE is DASH's own (no other rotary embedding);
- each layer is pre-norm: RMSNorm, attention, residual; RMSNorm, MLP, residual. The first
  ``first_k_dense_replace`` layers (and those off ``moe_layer_freq``) have a dense SiLU-gated MLP
  of ``intermediate_size``; the others a mixture of experts (:class:`MoE`): ``n_routed_experts``
  SiLU-gated experts of ``moe_intermediate_size``, ``num_experts_per_tok`` of them a token, chosen
  by a linear ``gate`` (:func:`route_experts`), plus ``n_shared_experts`` shared experts every
  token runs (one gated MLP of ``n_shared_experts x moe_intermediate_size``);
- checkpoint names as published (``model.layers.N.mlp.experts.E.gate_proj.weight``,
  ``model.layers.N.mlp.gate.weight``, ``model.layers.N.mlp.shared_experts.up_proj.weight``,
  ``model.layers.N.self_attn.dash_router.head_cls``, ``lm_head.weight``, ...). The vision tower's
  tensors (``model.sam_model.``, ``model.vision_model.``, ``model.projector.``,
  ``model.image_newline``, ``model.view_seperator``) are not this decoder's; the image features
  it takes for its ``<image>`` tokens are the projector's output (``hidden_size`` values a row).
  The unused warm-up indexer (``.indexer.``) is dropped, as vLLM drops it.

The mixture of experts has three forms of one function (:data:`EXPERT_FORMS`; tests compare
each with a float64 formulation):

- ``grouped``: the token-expert pairs sorted by expert and every expert's rows multiplied in one
  grouped GEMM (``torch.nn.functional.grouped_mm``) for gate/up and one for down, over the
  experts' weights stacked once ([E, 2I, H] and [E, H, I], vLLM's ``w13``/``w2``). Nothing
  depends on the data but the offsets, which stay on the device: no host synchronisation, so it
  runs in the decode CUDA graphs and in eager steps alike, and computes only the chosen experts.
  On CUDA the GEMMs are PyTorch's CUTLASS kernels for bf16 on sm_90/sm_100 (:func:`grouped_native`);
  elsewhere PyTorch's fallback loops over the experts (same numbers, a host synchronisation: the
  CPU tests run this form through it).
- ``sparse``: each expert on the tokens that chose it, in eager PyTorch (a host synchronisation
  per layer; the CPU default).
- ``dense``: every expert on every token, weighted by the routing weights (zero for the experts
  a token did not choose): what ONNX export traces, and what a CUDA graph captures where the
  grouped GEMM is not native (``n_routed_experts / num_experts_per_tok`` times the routed FLOPs:
  10.7x for the published sizes).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import fused as _fused
from ..attention.dash.config import CONFIG_SECTION
from ..modeling import DashContext, DashModel
from .config import LANGUAGE_SECTION, DashModelConfig, ModelConfigError
from .decoder import DashSelfAttention, GatedMLP, RMSNorm
from .deepencoder import tiny_deepencoder

__all__ = [
    "ARCHITECTURE",
    "EXPERT_FORMS",
    "grouped_native",
    "MODEL_TYPE",
    "MoEConfig",
    "MoE",
    "route_experts",
    "UnlimitedOCR2ForCausalLM",
    "tiny_config",
    "tiny_tokenizer",
    "TINY_SPECIAL_TOKENS",
]

#: ``architectures[0]`` and ``model_type`` of the published checkpoints.
ARCHITECTURE = "UnlimitedOCRForCausalLM"
MODEL_TYPE = "unlimited-ocr"

SCORING_FUNCS = ("softmax", "sigmoid")
#: What vLLM 0.34.0's Unlimited-OCR config reads an unset ``rswa_window`` as
#: (``transformers_utils/configs/unlimited_ocr.py``); only a window of this size may leave it unset.
VLLM_RSWA_DEFAULT = 128
TOPK_METHODS = ("greedy", "group_limited_greedy")


def _lang_error(key: str, value: Any, want: str) -> ModelConfigError:
    return ModelConfigError(f"{LANGUAGE_SECTION}.{key} is {value!r}; Unlimited-OCR-2 needs {want}")


@dataclass(frozen=True)
class MoEConfig:
    """The mixture-of-experts keys of ``language_config`` (DeepSeek-V2's names), checked."""

    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    #: the gate's logits in float32 (``moe_router_dtype: "float32"``), else in the model's dtype
    router_float32: bool = False

    @classmethod
    def from_config(cls, cfg: DashModelConfig) -> MoEConfig:
        get = cfg.language.get if cfg.nested else cfg.extra.get

        def integer(key: str, default: int | None = None, low: int = 1) -> int:
            value = get(key, default)
            if value is None and default is None:
                raise ModelConfigError(f"{LANGUAGE_SECTION} is missing key {key!r} (a DeepSeek-V2 MoE key)")
            if value is None:
                value = default
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise _lang_error(key, value, f"an integer >= {low}")
            return value

        experts = integer("n_routed_experts")
        topk = integer("num_experts_per_tok")
        if topk > experts:
            raise _lang_error("num_experts_per_tok", topk, f"at most n_routed_experts ({experts})")
        method = get("topk_method", "greedy")
        if method not in TOPK_METHODS:
            raise _lang_error(
                "topk_method", method, f"one of {TOPK_METHODS} (noaux_tc is DeepSeek-V3's, not this family's)"
            )
        scoring = get("scoring_func", "softmax")
        if scoring not in SCORING_FUNCS:
            raise _lang_error("scoring_func", scoring, f"one of {SCORING_FUNCS}")
        n_group = integer("n_group", 1) if get("n_group") is not None else 1
        topk_group = integer("topk_group", 1) if get("topk_group") is not None else 1
        if experts % n_group or topk_group > n_group:
            raise _lang_error(
                "n_group", n_group, f"a divisor of n_routed_experts ({experts}) and >= topk_group ({topk_group})"
            )
        if topk > topk_group * (experts // n_group):
            raise _lang_error("num_experts_per_tok", topk, "at most the experts of topk_group groups")
        scale = get("routed_scaling_factor", 1.0)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
            raise _lang_error("routed_scaling_factor", scale, "a positive number")
        norm = get("norm_topk_prob", False)
        if not isinstance(norm, bool):
            raise _lang_error("norm_topk_prob", norm, "true or false")
        router_dtype = get("moe_router_dtype")
        if router_dtype not in (None, "float32"):
            raise _lang_error("moe_router_dtype", router_dtype, 'null or "float32"')
        return cls(
            n_routed_experts=experts,
            num_experts_per_tok=topk,
            moe_intermediate_size=integer("moe_intermediate_size"),
            n_shared_experts=integer("n_shared_experts", 0, low=0) if get("n_shared_experts") is not None else 0,
            first_k_dense_replace=integer("first_k_dense_replace", 0, low=0),
            moe_layer_freq=integer("moe_layer_freq", 1),
            norm_topk_prob=norm,
            routed_scaling_factor=float(scale),
            scoring_func=scoring,
            topk_method=method,
            # vLLM 0.34.0 groups whenever n_group > 1, whatever topk_method says
            # (deepseek_v2.py: use_grouped_topk=True, num_expert_group=n_group)
            n_group=n_group,
            topk_group=topk_group,
            router_float32=router_dtype == "float32",
        )

    def is_moe_layer(self, layer_idx: int) -> bool:
        """vLLM's rule: a MoE layer from ``first_k_dense_replace`` on, every ``moe_layer_freq``-th."""
        return layer_idx >= self.first_k_dense_replace and layer_idx % self.moe_layer_freq == 0


def check_architecture(cfg: DashModelConfig) -> None:
    """The fixed parts of the architecture (ModelConfigError naming the key otherwise)."""
    lang = cfg.language if cfg.nested else cfg.extra
    fixed = {
        "use_mla": (False, "false (plain multi-head attention)"),
        "qk_nope_head_dim": (0, "0 (no MLA)"),
        "qk_rope_head_dim": (0, "0 (no MLA; DASH's page RoPE is the only rotation)"),
        "hidden_act": ("silu", '"silu"'),
        "attention_bias": (False, "false"),
    }
    for key, (value, want) in fixed.items():
        if key in lang and lang[key] != value:
            raise _lang_error(key, lang[key], want)
    for key in ("q_lora_rank",):
        if lang.get(key) is not None:
            raise _lang_error(key, lang[key], "null (no low-rank query projection)")
    heads = lang.get("num_attention_heads", cfg.num_attention_heads)
    if "head_dim" in lang and lang["head_dim"] * heads != lang.get("hidden_size", cfg.hidden_size):
        raise _lang_error("head_dim", lang["head_dim"], "hidden_size / num_attention_heads (vLLM derives it so)")
    window = cfg.dash.sparse_local_block * cfg.dash.sparse_block_size
    if cfg.rswa_window is None and window != VLLM_RSWA_DEFAULT:
        raise ModelConfigError(
            f"rswa_window is unset: vLLM 0.34.0 reads that as {VLLM_RSWA_DEFAULT}, which it refuses for this "
            f"model's window of {window} (sparse_local_block x sparse_block_size); set rswa_window to {window} "
            f"(generated tokens read the prompt's blocks and that window) or 0 (full KV)"
        )
    if cfg.index_head_dim != cfg.head_dim:
        raise ModelConfigError(
            f"{CONFIG_SECTION}.sparse_index_dim is {cfg.index_head_dim}; Unlimited-OCR-2 requires index_dim == "
            f"head_dim ({cfg.head_dim})"
        )


# ------------------------------------------------------------------------------ routing
def _top(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest of each row, equal values in index order: a stable sort in
    PyTorch; in an exported graph ONNX's TopK, which orders ties the same way by definition
    (the exporter has no stable sort)."""
    if torch.compiler.is_exporting():
        return torch.topk(x, k, dim=-1).indices
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :k]


def route_experts(logits: torch.Tensor, moe: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts of each token and their weights, from the gate's logits [T, E]:
    ``(weights [T, k] float32, ids [T, k] int64)``.

    Scores are ``softmax`` (or ``sigmoid``) of the logits in float32. With ``n_group > 1`` (either
    ``topk_method``, as vLLM 0.34.0 groups)
    keeps the ``topk_group`` groups (of ``n_routed_experts / n_group`` consecutive experts) with
    the highest best score; the token's k experts are the highest scores among the kept ones
    (a stable sort: equal scores go to the lower index, as ONNX's TopK orders them; vLLM's
    ``torch.topk`` leaves ties unspecified). Weights are those scores, divided by their sum
    with ``norm_topk_prob``, times ``routed_scaling_factor`` (vLLM's ``grouped_topk``)."""
    logits = logits.float()
    scores = logits.softmax(-1) if moe.scoring_func == "softmax" else logits.sigmoid()
    choose = scores
    if moe.n_group > 1:
        t = scores.shape[0]
        groups = scores.view(t, moe.n_group, -1).max(-1).values
        keep = _top(groups, moe.topk_group)
        mask = torch.zeros_like(groups).scatter(1, keep, 1.0).bool()
        mask = mask.unsqueeze(-1).expand(t, moe.n_group, scores.shape[1] // moe.n_group).reshape(t, -1)
        choose = scores.masked_fill(~mask, float("-inf"))
    ids = _top(choose, moe.num_experts_per_tok)
    weights = scores.gather(1, ids)
    if moe.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights * moe.routed_scaling_factor, ids


#: The forms the routed experts run in (module docstring); ``None`` on :attr:`MoE.form` picks.
EXPERT_FORMS = ("grouped", "sparse", "dense")

_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_native(x: torch.Tensor) -> bool:
    """Whether ``x``'s grouped GEMM runs as one kernel with no host synchronisation: PyTorch's
    CUTLASS path (CUDA, bf16, compute capability 9.x or 10.x). Elsewhere PyTorch falls back to a
    loop over the experts that reads the offsets on the host (correct, not capturable)."""
    if _grouped_mm is None or not x.is_cuda or x.dtype != torch.bfloat16:
        return False
    return torch.cuda.get_device_capability(x.device)[0] in (9, 10)


class MoE(nn.Module):
    """DeepSeek-V2's mixture of experts: the ``gate``, ``n_routed_experts`` gated experts and the
    shared experts (module docstring for the three forms the routed experts run in)."""

    def __init__(self, hidden: int, moe: MoEConfig):
        super().__init__()
        self.moe = moe
        self.gate = nn.Linear(hidden, moe.n_routed_experts, bias=False)
        self.experts = nn.ModuleList(GatedMLP(hidden, moe.moe_intermediate_size) for _ in range(moe.n_routed_experts))
        self.shared_experts = (
            GatedMLP(hidden, moe.moe_intermediate_size * moe.n_shared_experts) if moe.n_shared_experts else None
        )
        #: one of :data:`EXPERT_FORMS`, or None: dense while exporting; grouped where it is native
        #: (:func:`grouped_native`); dense while capturing a CUDA graph; sparse otherwise
        self.form: str | None = None
        self._stack: tuple | None = None  # (the experts' weight pointers, w13, w2)

    def unchosen_parameters(self) -> int:
        """Parameters of the routed experts one token does not run (for the active-parameter count)."""
        routed = sum(p.numel() for p in self.experts.parameters())
        return routed * (self.moe.n_routed_experts - self.moe.num_experts_per_tok) // self.moe.n_routed_experts

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.gate.weight
        logits = F.linear(x.float(), w.float()) if self.moe.router_float32 else F.linear(x, w)
        return route_experts(logits, self.moe)

    def form_for(self, x: torch.Tensor) -> str:
        """The form this call runs in (:attr:`form`, or the rule it documents)."""
        if self.form is not None:
            if self.form not in EXPERT_FORMS:
                raise ValueError(f"MoE.form is {self.form!r}; one of {EXPERT_FORMS} or None")
            return self.form
        if torch.compiler.is_exporting():
            return "dense"
        if grouped_native(x):
            return "grouped"
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return "dense"
        return "sparse"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        form = self.form_for(x)
        weights, ids = self.route(x)
        if form == "grouped":
            routed = self.grouped_experts(x, weights, ids)
        elif form == "dense":
            routed = self.dense_experts(x, weights, ids)
        else:
            routed = self.sparse_experts(x, weights, ids)
        out = routed.to(x.dtype)
        return out if self.shared_experts is None else out + self.shared_experts(x)

    def sparse_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Σ_k weight_k · expert_{id_k}(x), each expert run on the tokens that chose it (float32 sum)."""
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in torch.unique(ids).tolist():
            tok, slot = torch.nonzero(ids == e, as_tuple=True)
            y = self.experts[e](x[tok]).float() * weights[tok, slot, None]
            out.index_add_(0, tok, y)
        return out

    def stacked_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The routed experts' weights stacked: ``w13`` [E, 2I, H] (each expert's gate rows, then
        its up rows) and ``w2`` [E, H, I] (down). Made once and kept while the experts' weights
        stay as they are (a parameter moved or written in place restacks). On a GPU the experts'
        parameters then become views of the stacks, so the weights are held once; on the CPU they
        keep their own storage (a checkpoint is saved from them as is)."""
        params = [p for e in self.experts for p in (e.gate_proj.weight, e.up_proj.weight, e.down_proj.weight)]
        ptrs = tuple((p.data_ptr(), p._version) for p in params)
        if self._stack is not None and self._stack[0] == ptrs:
            return self._stack[1], self._stack[2]
        if params[0].is_cuda and torch.cuda.is_current_stream_capturing():
            # Not made before the capture (its warm-up ran another form): stack inside the graph,
            # every replay, rather than keep tensors of the graph's private pool.
            w13 = torch.stack([torch.cat([e.gate_proj.weight, e.up_proj.weight]) for e in self.experts])
            return w13, torch.stack([e.down_proj.weight for e in self.experts])
        with torch.no_grad():
            w13 = torch.stack([torch.cat([e.gate_proj.weight, e.up_proj.weight]) for e in self.experts])
            w2 = torch.stack([e.down_proj.weight for e in self.experts])
            if w13.is_cuda:
                inter = self.moe.moe_intermediate_size
                for i, e in enumerate(self.experts):
                    e.gate_proj.weight.data = w13[i, :inter]
                    e.up_proj.weight.data = w13[i, inter:]
                    e.down_proj.weight.data = w2[i]
                ptrs = tuple((p.data_ptr(), p._version) for p in params)
        self._stack = (ptrs, w13, w2)
        return w13, w2

    def grouped_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The same sum with the (token, expert) pairs sorted by expert and each expert's rows
        multiplied in one grouped GEMM (module docstring); the k products of a token summed in
        float32 in a fixed order (no atomics: the same bits every run)."""
        t, k = ids.shape
        w13, w2 = self.stacked_weights()
        inter = self.moe.moe_intermediate_size
        sorted_ids, order = torch.sort(ids.reshape(-1), stable=True)
        rows = torch.div(order, k, rounding_mode="floor")  # the token of each sorted pair
        experts = torch.arange(self.moe.n_routed_experts, device=x.device, dtype=sorted_ids.dtype)
        offs = torch.searchsorted(sorted_ids, experts, right=True).to(torch.int32)  # each group's end
        xs = x.index_select(0, rows)
        h = _grouped_mm(xs, w13.transpose(1, 2), offs=offs)  # [T*k, 2I]
        gate, up = h[:, :inter], h[:, inter:]
        act = _fused.silu_mul(gate, up) if x.is_cuda else None
        y = _grouped_mm(act if act is not None else F.silu(gate) * up, w2.transpose(1, 2), offs=offs)  # [T*k, H]
        per_pair = torch.empty_like(y).index_copy_(0, order, y)  # back to (token, slot) order
        return (per_pair.view(t, k, -1).float() * weights.unsqueeze(-1)).sum(1)

    def dense_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The same sum with every expert run on every token (batched matrix products over the
        stacked expert weights; a weight of 0 for the experts a token did not choose)."""
        if torch.compiler.is_exporting():  # the graph stacks the experts' own initialisers
            gate = torch.stack([e.gate_proj.weight for e in self.experts])  # [E, I, H]
            up = torch.stack([e.up_proj.weight for e in self.experts])
            down = torch.stack([e.down_proj.weight for e in self.experts])  # [E, H, I]
        else:
            w13, down = self.stacked_weights()
            gate, up = w13.split(self.moe.moe_intermediate_size, dim=1)
        xs = x.unsqueeze(0)  # [1, T, H]
        h = F.silu(torch.matmul(xs, gate.transpose(1, 2))) * torch.matmul(xs, up.transpose(1, 2))  # [E, T, I]
        y = torch.matmul(h, down.transpose(1, 2)).float()  # [E, T, H]
        dense = torch.zeros(x.shape[0], len(self.experts), dtype=torch.float32, device=x.device)
        dense = dense.scatter(1, ids, weights)  # [T, E]
        return (dense.t().unsqueeze(-1) * y).sum(0)


# ------------------------------------------------------------------------------ layers
class DecoderLayer(nn.Module):
    def __init__(self, cfg: DashModelConfig, moe: MoEConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DashSelfAttention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = (
            MoE(cfg.hidden_size, moe)
            if moe.is_moe_layer(layer_idx)
            else GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        )

    def forward(self, x: torch.Tensor, dash: DashContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), dash)
        return x + self.mlp(self.post_attention_layernorm(x))


class UnlimitedOCR2ForCausalLM(DashModel):
    """Unlimited-OCR-2's decoder (module docstring): the toolkit's model contract over the
    published checkpoint layout."""

    architecture_name = ARCHITECTURE
    checkpoint_prefix = "model."
    #: Checkpoint tensors that are not this decoder's (regular expressions, searched): the vision
    #: tower's and the unused warm-up indexer.
    checkpoint_ignore = (
        r"^model\.(sam_model|vision_model|projector)\.",
        r"^model\.(image_newline|view_seperator)$",
        r"\.indexer\.",
    )

    def __init__(self, config: DashModelConfig):
        super().__init__(config)
        check_architecture(config)
        self.moe_config = MoEConfig.from_config(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, self.moe_config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # NOTE: never tied, whatever tie_word_embeddings says: vLLM 0.34.0's DeepSeek-V2 keeps its
        # own lm_head and loads lm_head.weight (a folder without it is refused as missing it).
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

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

    def set_expert_form(self, form: str | None) -> None:
        """Run every MoE layer's routed experts in ``form`` (one of :data:`EXPERT_FORMS`), or as
        :attr:`MoE.form` documents (None)."""
        if form is not None and form not in EXPERT_FORMS:
            raise ValueError(f"expert form {form!r}: one of {EXPERT_FORMS} or None")
        for m in self.modules():
            if isinstance(m, MoE):
                m.form = form


# ------------------------------------------------------------------------------ tiny configs
def tiny_config(
    layers: int = 2,
    *,
    hidden_size: int = 128,
    heads: int = 4,
    experts: int = 8,
    experts_per_token: int = 2,
    shared_experts: int = 2,
    vocab_size: int = 320,
    overrides: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A small config.json in the published layout (nested sections; DeepSeek-V2 MoE keys;
    ``sparse_attention_config`` with Unlimited-OCR-2's fixed flags; byte-level text ids below
    256 and the special tokens above), for random-weight test checkpoints. ``overrides`` update
    the ``language_config`` keys."""
    head_dim = hidden_size // heads
    lang = {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "moe_intermediate_size": hidden_size // 2,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "n_routed_experts": experts,
        "n_shared_experts": shared_experts,
        "num_experts_per_tok": experts_per_token,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "norm_topk_prob": False,
        "routed_scaling_factor": 1.0,
        "scoring_func": "softmax",
        "topk_method": "greedy",
        "n_group": 1,
        "topk_group": 1,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "use_mla": False,
        "qk_nope_head_dim": 0,
        "qk_rope_head_dim": 0,
        "v_head_dim": 0,
        "kv_lora_rank": None,
        "q_lora_rank": None,
        "max_position_embeddings": 8192,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    lang.update(overrides or {})
    return {
        "rswa_window": 16,  # the local window (1 block of 16): set, as vLLM requires for any but 128
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "tile_tag": "2D",
        "global_view_pos": "head",
        "candidate_resolutions": [[1024, 1024]],
        "vision_config": {"deepencoder": tiny_deepencoder(hidden_size)},
        "projector_config": {"projector_type": "linear", "input_dim": 64, "n_embed": hidden_size},
        LANGUAGE_SECTION: lang,
        CONFIG_SECTION: {
            "training_stage": "dash",
            "dash_stage0": "head_cls",
            "use_sparse_attention": True,
            "sparse_attention_freq": [1] * layers,
            "sparse_block_size": 16,
            "sparse_local_block": 1,
            "sparse_index_dim": head_dim,
            "dash_topk_blocks": 4,
            "dash_sigma": 1.0,
            "dash_scale_per_layer": [32.0] * layers,
            "dash_floor_per_layer": [1e-4] * layers,
            "sparse_main_rope_mode": "page2d",
            "sparse_rope_mode": "page2d",
            "sparse_rope_page_span": 0,
            "sparse_rope_page_pairs": 1,
            "image_bucket_constraint": True,
            "dash_image_only": True,
            "page_token_id": 2,
            "image_token_id": 3,
        },
        "torch_dtype": "float32",
    }


#: The tiny tokenizer's special tokens, ids 0-3 (DeepSeek's BOS and EOS spellings).
TINY_SPECIAL_TOKENS = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<PAGE>", "<image>")

_TINY_CORPUS = (
    "The quick brown fox jumps over the lazy dog. Invoice 2024-07 total: 1,234.56 EUR, due in 30 days.",
    "# Annual report\n\n## Results\n\n| item | value |\n| --- | --- |\n| revenue | 12.5 |\n| cost | 7.25 |",
    "Multi page parsing. Convert the document to markdown. Page 1 of 3. Table of contents.",
    "naïve café – Zürich, Kraków, 東京, Ελλάδα: ✓ → € © ½",
)


def tiny_tokenizer(vocab_size: int = 320):
    """A byte-level BPE tokenizer trained on a fixed corpus (``tokenizers``): ids 0-3 the
    :data:`TINY_SPECIAL_TOKENS`, every byte representable, ``vocab_size`` ids in all."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(TINY_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(_TINY_CORPUS) * 40, trainer)
    return tok
