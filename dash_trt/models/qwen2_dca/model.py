"""Qwen2 with Dual Chunk Attention in every layer: the model Qwen's 1M-token checkpoints
(Qwen2.5-7B/14B-Instruct-1M) describe, in PyTorch, three ways (docs/dca_model.md).

The architecture and parameter names are Hugging Face's ``Qwen2ForCausalLM``:
``model.embed_tokens``; per layer ``model.layers.{i}.input_layernorm`` (RMSNorm),
``self_attn.{q,k,v}_proj`` (with bias), ``self_attn.o_proj`` (no bias),
``post_attention_layernorm``, ``mlp.{gate,up,down}_proj`` (SiLU-gated, no bias); ``model.norm``;
``lm_head`` (the embedding table when ``tie_word_embeddings``). Grouped-query heads
(``num_key_value_heads``), ``head_dim = hidden_size // num_attention_heads`` unless the config
gives ``head_dim``, neox RoPE of base ``rope_theta`` over the whole head. The attention is Dual
Chunk Attention (:mod:`dash_trt.attention.dca.reference`) configured by the config's ``dual_chunk_attention_config``
(:meth:`dash_trt.attention.dca.reference.DcaConfig.from_model_config`); RoPE is applied inside it, at the DCA
positions.

The three forms share the weights and everything outside the attention:

- :meth:`Qwen2DcaForCausalLM.reference_logits`: a whole sequence, no cache, through
  :func:`dash_trt.attention.dca.reference.dual_chunk_attention`;
- :meth:`Qwen2DcaForCausalLM.forward_paged`: a ragged batch of prefill chunks and decode tokens
  over one :class:`~dash_trt.attention.dca.paged.DcaKVCache` per layer, written in place by the in-place
  op ``dash_trt::dual_chunk_attention_``; logits only for the rows asked for;
- :meth:`Qwen2DcaForCausalLM.export_forward`: the same with the functional op (caches in, new
  caches out), what :func:`~dash_trt.models.qwen2_dca.export.export_program` hands to
  ``torch.onnx.export``; each layer becomes one ``dash_trt.DualChunkAttention`` node and the file
  carries its standard-ops function (:mod:`dash_trt.attention.dca.onnx`), so ONNX Runtime runs it.

:func:`load_qwen2_dca` reads a Hugging Face folder (``config.json`` and ``model.safetensors`` or
its shards; a Qwen2-MoE one as :class:`~dash_trt.models.qwen2_dca.moe.Qwen2MoeDcaForCausalLM`, the
subclass that only builds another feed-forward block; a folder whose
``sparse_attention_config.json`` vLLM and SGLang would run sparse is refused),
:func:`save_qwen2_dca` writes one, :func:`write_tiny_qwen2_dca` writes a random-weight one for
tests. :func:`generate` is greedy generation over a paged cache, a thin wrapper of
:func:`dash_trt.serving.generate.generate` (chunked prefill at any split points, then one token
per step, block tables drawn from a shuffled pool); :func:`reference_generate`, the independent
check the paged forms are tested against, recomputes the whole sequence at every step instead.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from ...attention.dca import ops as dca_ops
from ...attention.dca.paged import DcaKVCache
from ...attention.dca.reference import CONFIG_KEY, DcaConfig, DcaConfigError, dual_chunk_attention, read_model_config
from ...fileio import atomic_write
from ..checkpoint import CONFIG_FILE, WEIGHTS_FILE, CheckpointError, read_folder
from ..decoder import GatedMLP, RMSNorm

__all__ = [
    "MODEL_TYPE",
    "ARCHITECTURE",
    "GRAPH_INPUTS",
    "Qwen2DcaConfigError",
    "Qwen2DcaConfig",
    "Qwen2DcaForCausalLM",
    "tiny_qwen2_dca_config",
    "init_random_weights",
    "load_qwen2_dca",
    "save_qwen2_dca",
    "write_tiny_qwen2_dca",
    "DcaGeneration",
    "generate",
    "reference_generate",
]

MODEL_TYPE = "qwen2"
ARCHITECTURE = "Qwen2ForCausalLM"
#: Qwen2-MoE's ``model_type``: :func:`load_qwen2_dca` reads Qwen2 and Qwen2-MoE folders (seed 002
#: covers both), its class by ``model_type`` (:func:`dash_trt.models.qwen2_dca.load.dca_model_class`,
#: :mod:`dash_trt.models.qwen2_dca.moe`).
MOE_MODEL_TYPE = "qwen2_moe"

#: The exported graph's inputs before the caches (``past.{layer}.key``, ``past.{layer}.value``).
GRAPH_INPUTS = ("input_ids", "block_tables", "seq_lens", "query_start_loc", "prompt_lens", "logits_indices")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

#: A functional forward: ``forward(inputs, caches) -> (logits [N, vocab], new caches)``, with
#: ``inputs`` the :data:`GRAPH_INPUTS` by name and ``caches`` flat (layer 0 key, layer 0 value, ...).
ForwardFn = Callable[[dict, list], tuple[torch.Tensor, Sequence[torch.Tensor]]]


class Qwen2DcaConfigError(DcaConfigError):
    """A Qwen2 Dual Chunk Attention model config that cannot be run."""


# ------------------------------------------------------------------------------ config
_REQUIRED = object()


def _int_key(config: Mapping, key: str, default: Any = _REQUIRED, *, source: str) -> int:
    value = config.get(key)
    if value is None:
        if default is _REQUIRED:
            raise Qwen2DcaConfigError(f"{source} is missing the required key {key!r} (a Qwen2 model config)")
        value = default
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value <= 0:
        raise Qwen2DcaConfigError(f"{source}: {key!r} must be a positive int, got {value!r}")
    return int(value)


def _float_key(config: Mapping, key: str, default: float, *, source: str) -> float:
    value = config.get(key)
    if value is None:
        value = default
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    if not ok:
        raise Qwen2DcaConfigError(f"{source}: {key!r} must be a positive finite number, got {value!r}")
    return float(value)


def _rope_theta(config: Mapping, source: str) -> float:
    """``rope_theta`` (transformers 4.x) or ``rope_parameters.rope_theta`` (5.x); RoPE scaling of
    any kind is refused: with DCA the rotation positions stay below ``chunk_size`` by design."""
    scaling = config.get("rope_scaling")
    if scaling:
        raise Qwen2DcaConfigError(
            f"{source}: rope_scaling {scaling!r} cannot be combined with Dual Chunk Attention (DCA keeps every "
            "relative distance within chunk_size; vLLM's first DCA integration refused the combination too); "
            "remove rope_scaling"
        )
    theta = config.get("rope_theta")
    params = config.get("rope_parameters")
    if params is not None:
        if not isinstance(params, Mapping):
            raise Qwen2DcaConfigError(f"{source}: rope_parameters must be a JSON object, got {params!r}")
        kind = params.get("rope_type", params.get("type", "default"))
        if kind != "default":
            raise Qwen2DcaConfigError(
                f"{source}: rope_parameters.rope_type {kind!r} cannot be combined with Dual Chunk Attention "
                "(only 'default' RoPE)"
            )
        if params.get("rope_theta") is not None:
            if theta is not None and theta != params["rope_theta"]:
                raise Qwen2DcaConfigError(
                    f"{source}: rope_theta ({theta!r}) and rope_parameters.rope_theta ({params['rope_theta']!r}) differ"
                )
            theta = params["rope_theta"]
    return _float_key({"rope_theta": theta}, "rope_theta", 10000.0, source=source)


@dataclass(frozen=True)
class Qwen2DcaConfig:
    """The parts of a Qwen2 ``config.json`` the model uses, validated on construction by
    :meth:`from_dict` (``raw`` keeps the whole dict, written back by :meth:`to_dict`)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    dca: DcaConfig
    torch_dtype: str = "float32"
    eos_token_id: int | None = None
    raw: dict = field(default_factory=dict, compare=False, hash=False, repr=False)
    #: What the serving runtime reads of a model config: a text decoder has no document pages,
    #: no image tokens and takes no image features.
    page_token_id = None
    image_token_id = None
    image_feature_dim = None

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.torch_dtype]

    def prompt_length(self, n: int) -> int:
        """The prompt length the attention op is given for a prompt of ``n`` tokens: all of it
        (the length scale of the prompt's queries and keys is ``s(n)``)."""
        return int(n)

    #: ``model_type`` and ``architectures[0]`` of the config.json this class reads and writes.
    MODEL_TYPE: ClassVar[str] = MODEL_TYPE
    ARCHITECTURE: ClassVar[str] = ARCHITECTURE
    #: ``intermediate_size`` when config.json has none (required for Qwen2: every layer's MLP).
    INTERMEDIATE_DEFAULT: ClassVar[int | None] = None

    @property
    def label(self) -> str:
        """What the tools print for the model (e.g. dash-export's progress)."""
        return "Qwen2 with Dual Chunk Attention"

    def static_sizes(self) -> set[int]:
        """The model's fixed sizes (the export picks dynamic sizes that differ from each)."""
        c = self
        return {c.num_key_value_heads, c.head_dim, c.num_attention_heads, c.hidden_size, c.vocab_size} | {
            c.intermediate_size,
            c.num_hidden_layers,
        }

    @classmethod
    def from_dict(
        cls, config: Mapping[str, Any], *, source: str = "model config", folder: str | os.PathLike | None = None
    ) -> Qwen2DcaConfig:
        """Read and check a parsed ``config.json`` (``folder``: the model folder it came from,
        where a ``sparse_attention_config.json`` is looked for). Required:
        ``dual_chunk_attention_config`` (with ``chunk_size`` and ``local_size``), ``vocab_size``,
        ``hidden_size``, ``intermediate_size``, ``num_hidden_layers``, ``num_attention_heads``.
        Defaults as ``transformers``' ``Qwen2Config``: ``num_key_value_heads`` = the attention
        heads, ``rms_norm_eps`` 1e-6, ``rope_theta`` 10000, ``tie_word_embeddings`` false. Refused:
        another ``model_type``, ``hidden_act`` other than silu, ``rope_scaling``, a sliding window
        in use, a config vLLM and SGLang would run with the sparse DCA mode
        (:func:`dash_trt.attention.dca.reference.check_dense`)."""
        if not isinstance(config, Mapping):
            raise Qwen2DcaConfigError(f"{source} must be a JSON object, got {type(config).__name__}")
        # "not a Dual Chunk Attention model", the sparse mode (in the section or beside the weights), ...
        dca = DcaConfig.from_model_config(config, folder=folder)
        return cls(dca=dca, raw=dict(config), **cls._fields(config, source))

    @classmethod
    def _fields(cls, config: Mapping[str, Any], source: str) -> dict[str, Any]:
        """Every field but ``dca`` and ``raw``, read and checked (a subclass adds its keys)."""
        model_type = config.get("model_type", cls.MODEL_TYPE)
        if model_type != cls.MODEL_TYPE:
            raise Qwen2DcaConfigError(
                f"{source}: model_type is {model_type!r}; this model is {cls.ARCHITECTURE} (model_type "
                f"{cls.MODEL_TYPE!r}) with Dual Chunk Attention (the loader reads model_type {MODEL_TYPE!r} and "
                f"{MOE_MODEL_TYPE!r})"
            )
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise Qwen2DcaConfigError(f"{source}: hidden_act must be 'silu' (Qwen2's gated MLP), got {act!r}")
        if config.get("use_sliding_window"):
            raise Qwen2DcaConfigError(
                f"{source}: use_sliding_window is true; sliding-window attention is not implemented with Dual Chunk "
                "Attention (Qwen2.5-1M sets it to false)"
            )
        ints = {
            k: _int_key(config, k, source=source)
            for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
        }
        default = _REQUIRED if cls.INTERMEDIATE_DEFAULT is None else cls.INTERMEDIATE_DEFAULT
        ints["intermediate_size"] = _int_key(config, "intermediate_size", default, source=source)
        heads = ints["num_attention_heads"]
        kv_heads = _int_key(config, "num_key_value_heads", heads, source=source)
        if heads % kv_heads:
            raise Qwen2DcaConfigError(
                f"{source}: num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
            )
        if config.get("head_dim") is not None:
            head_dim = _int_key(config, "head_dim", source=source)
        elif ints["hidden_size"] % heads:
            raise Qwen2DcaConfigError(
                f"{source}: hidden_size ({ints['hidden_size']}) is not a multiple of num_attention_heads ({heads}) "
                "and no head_dim is given"
            )
        else:
            head_dim = ints["hidden_size"] // heads
        if head_dim % 2:
            raise Qwen2DcaConfigError(f"{source}: head_dim must be even for rotary embeddings, got {head_dim}")
        tie = config.get("tie_word_embeddings", False)
        if not isinstance(tie, bool):
            raise Qwen2DcaConfigError(f"{source}: tie_word_embeddings must be true or false, got {tie!r}")
        dtype = config.get("torch_dtype", config.get("dtype")) or "float32"
        if dtype not in _DTYPES:
            raise Qwen2DcaConfigError(f"{source}: torch_dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        eos = config.get("eos_token_id")
        if isinstance(eos, list):  # several end ids: the first one stops generation here
            eos = eos[0] if eos else None
        if eos is not None and (not isinstance(eos, numbers.Integral) or isinstance(eos, bool) or eos < 0):
            raise Qwen2DcaConfigError(f"{source}: eos_token_id must be a non-negative int, got {eos!r}")
        return dict(
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=_float_key(config, "rms_norm_eps", 1e-6, source=source),
            rope_theta=_rope_theta(config, source),
            tie_word_embeddings=tie,
            torch_dtype=dtype,
            eos_token_id=None if eos is None else int(eos),
            **ints,
        )

    @classmethod
    def from_model_config(cls, config: Mapping[str, Any] | str | os.PathLike) -> Qwen2DcaConfig:
        """:meth:`from_dict` of a parsed ``config.json``, the path of that file, or the model
        folder holding it (where a ``sparse_attention_config.json`` is looked for too)."""
        if isinstance(config, Mapping):
            return cls.from_dict(config)
        raw, path = read_model_config(config)  # missing file, bad JSON: named after the file
        if raw.get(CONFIG_KEY) is None:  # named after the file too
            raise Qwen2DcaConfigError(f"{path} has no {CONFIG_KEY!r}: not a Dual Chunk Attention model")
        return cls.from_dict(raw, source=path, folder=os.path.dirname(path))

    def to_dict(self) -> dict[str, Any]:
        """The ``config.json`` of this config (the keys read here, over the original ones)."""
        out = dict(self.raw)
        out.update(
            architectures=[self.ARCHITECTURE],
            model_type=self.MODEL_TYPE,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            hidden_act="silu",
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            tie_word_embeddings=self.tie_word_embeddings,
            torch_dtype=self.torch_dtype,
            use_sliding_window=False,
        )
        out[CONFIG_KEY] = {**(self.raw.get(CONFIG_KEY) or {}), **self.dca.to_dict()}
        if self.eos_token_id is not None and "eos_token_id" not in out:
            out["eos_token_id"] = self.eos_token_id
        return out


def tiny_qwen2_dca_config(**overrides: Any) -> dict[str, Any]:
    """A tiny ``config.json`` (hidden 64, 4 heads over 2 KV heads of dim 16, 2 layers, vocab 96,
    DCA chunk_size 32 / local_size 8, length scaling off); ``overrides`` replace keys
    (``dual_chunk_attention_config`` as a whole)."""
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "vocab_size": 96,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "torch_dtype": "float32",
        "eos_token_id": 95,
        CONFIG_KEY: {"chunk_size": 32, "local_size": 8, "original_max_position_embeddings": 0},
    }
    config.update(overrides)
    return config


# ------------------------------------------------------------------------------ model
#: attend(layer, q [T, H, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, H, D], unrotated inputs
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Qwen2DcaAttention(nn.Module):
    """Qwen2's projections (q, k, v with bias; o without) around an attention function."""

    def __init__(self, cfg: Qwen2DcaConfig, layer_idx: int):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=True)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=True)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=True)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)

    def forward(self, x: torch.Tensor, attend: AttendFn) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        out = attend(self.layer_idx, q, k, v)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


#: build_mlp(config, layer_idx) -> the layer's feed-forward module (``mlp.`` in Hugging Face names)
BuildMlpFn = Callable[[Qwen2DcaConfig, int], nn.Module]


class Qwen2DcaDecoderLayer(nn.Module):
    """RMSNorm, the attention, residual; RMSNorm, the feed-forward ``mlp`` (Qwen2's gated MLP, or
    what ``build_mlp`` makes: Qwen2-MoE's sparse block), residual."""

    def __init__(self, cfg: Qwen2DcaConfig, layer_idx: int, build_mlp: BuildMlpFn | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Qwen2DcaAttention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = (build_mlp or _gated_mlp)(cfg, layer_idx)

    def forward(self, x: torch.Tensor, attend: AttendFn) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), attend)
        return x + self.mlp(self.post_attention_layernorm(x))


def _gated_mlp(cfg: Qwen2DcaConfig, layer_idx: int) -> nn.Module:
    return GatedMLP(cfg.hidden_size, cfg.intermediate_size)


class Qwen2DcaModel(nn.Module):
    """The decoder stack (``model.`` in Hugging Face names)."""

    def __init__(self, cfg: Qwen2DcaConfig, build_mlp: BuildMlpFn | None = None):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen2DcaDecoderLayer(cfg, i, build_mlp) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, attend: AttendFn) -> torch.Tensor:
        """Hidden states [T, hidden] after the last layer (before the final norm)."""
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, attend)
        return x


class Qwen2DcaForCausalLM(nn.Module):
    """Qwen2 with Dual Chunk Attention (see the module docstring). ``state_dict()`` names are
    Hugging Face's; with ``tie_word_embeddings`` ``lm_head.weight`` is ``model.embed_tokens.weight``.

    The model contract every DCA model follows (the tools take any subclass): a subclass sets
    :attr:`config_class` and overrides :meth:`build_mlp` (Qwen2-MoE,
    :class:`dash_trt.models.qwen2_dca.moe.Qwen2MoeDcaForCausalLM`); the attention, the three forms,
    the caches, loading, saving, generation and the export are these."""

    #: The config this model takes (:func:`load_qwen2_dca` reads a folder's with it).
    config_class: ClassVar[type[Qwen2DcaConfig]] = Qwen2DcaConfig

    def __init__(self, config: Qwen2DcaConfig):
        super().__init__()
        if not isinstance(config, self.config_class):
            raise TypeError(f"config must be a {self.config_class.__name__}, got {type(config).__name__}")
        self.config = config
        self.model = Qwen2DcaModel(config, self.build_mlp)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        #: the DCA op's scalars (rotary over the whole head, softmax scale head_dim ** -0.5)
        self.dca_attributes = dca_ops.encode(config.dca, rope_theta=config.rope_theta)

    def build_mlp(self, config: Qwen2DcaConfig, layer_idx: int) -> nn.Module:
        """Layer ``layer_idx``'s feed-forward module (``model.layers.{i}.mlp``): Qwen2's SiLU-gated MLP."""
        return _gated_mlp(config, layer_idx)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def _logits(self, hidden: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        if rows is not None:
            hidden = torch.index_select(hidden, 0, rows)
        return self.lm_head(self.model.norm(hidden)).float()

    # ------------------------------------------------------------- reference (no cache)
    def reference_logits(self, input_ids: Sequence[int] | torch.Tensor, prompt_len: int | None = None) -> torch.Tensor:
        """Float32 logits [S, vocab] of a whole sequence, no cache, through
        :func:`dash_trt.attention.dca.reference.dual_chunk_attention`.

        ``prompt_len`` says how each token is length-scaled (only matters with
        ``original_max_position_embeddings`` set): None, the sequence is one prompt prefilled at
        once (every token by ``s(S)``); ``P``, the first ``P`` tokens are a prompt (by ``s(P)``;
        ``P`` may exceed ``S``, a prefix of a longer prompt as in a chunked prefill) and every later
        token was generated, decoded alone (by ``s(t + 1)``). That is what the paged cache holds
        after :func:`generate`, so these logits are the paged model's for the same tokens."""
        ids = torch.as_tensor(input_ids, dtype=torch.long, device=self.device)
        if ids.ndim != 1 or ids.numel() == 0:
            raise ValueError(f"input_ids must be a non-empty 1-D sequence, got shape {list(ids.shape)}")
        s = ids.numel()
        if prompt_len is not None and (
            isinstance(prompt_len, bool) or not isinstance(prompt_len, int) or prompt_len < 1
        ):
            raise ValueError(f"prompt_len must be None or a positive int, got {prompt_len!r}")
        dca = self.config.dca
        kw = dict(
            chunk_size=dca.chunk_size,
            local_size=dca.local_size,
            rope_theta=self.config.rope_theta,
            original_max_position_embeddings=dca.original_max_position_embeddings,
        )

        def attend(_layer, q, k, v):
            if prompt_len is None:
                return dual_chunk_attention(q, k, v, **kw)
            p = min(prompt_len, s)
            if p == s or not dca.scaled:
                return dual_chunk_attention(q, k, v, **kw, scale_length=max(prompt_len, s))
            # the prompt's rows in one call; each generated row with its own query scale and the
            # scales its keys were written with
            lengths = torch.cat([torch.full((p,), p), torch.arange(p + 1, s + 1)])
            out = [dual_chunk_attention(q[:p], k[:p], v[:p], **kw, scale_length=p)]
            for i in range(p, s):
                out.append(
                    dual_chunk_attention(
                        q[i : i + 1],
                        k[: i + 1],
                        v[: i + 1],
                        **kw,
                        scale_length=i + 1,
                        key_scale_lengths=lengths[: i + 1],
                    )
                )
            return torch.cat(out)

        with torch.no_grad():
            return self._logits(self.model(ids, attend))

    def forward(self, input_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """:meth:`reference_logits` of one prompt."""
        return self.reference_logits(input_ids)

    # ------------------------------------------------------------------ paged, in place
    def allocate_cache(
        self, num_blocks: int, kv_block_size: int, *, device: str | torch.device | None = None, fill: float = 0.0
    ) -> list[DcaKVCache]:
        """One :class:`DcaKVCache` per layer in the model's dtype, every slot ``fill``. The KV
        block size must divide the chunk length (:meth:`DcaConfig.check_kv_block_size`)."""
        self.config.dca.check_kv_block_size(kv_block_size)
        c = self.config
        caches = [
            DcaKVCache.allocate(
                num_blocks,
                kv_block_size,
                c.num_key_value_heads,
                c.head_dim,
                dtype=self.dtype,
                device=self.device if device is None else device,
            )
            for _ in range(c.num_hidden_layers)
        ]
        if fill != 0.0:
            for cache in caches:
                cache.key.fill_(fill)
                cache.value.fill_(fill)
        return caches

    def prefix_cacheable(self, kv_block_size: int) -> bool:
        """Always (whole KV blocks of prompt tokens): a block's keys depend on the tokens up to it
        and on the length scale of its whole prompt, which :meth:`prefix_hash_seed` adds to its hash."""
        return True

    def prefix_hash_seed(self, prompt_length: int) -> bytes:
        """The length scale ``s(P)`` every key of a prompt of ``P`` tokens was multiplied by (its
        exact float64 bytes): blocks are shared between prompts with the same scale only, e.g. all
        prompts no longer than ``original_max_position_embeddings`` (scale 1)."""
        return struct.pack("<d", self.config.dca.length_scale(prompt_length))

    def forward_paged(
        self,
        input_ids: torch.Tensor,
        coords: torch.Tensor | None,
        batch: Any,
        caches: Sequence[DcaKVCache],
        logits_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """A ragged batch over the paged caches, written in place (the serving runtime's call of
        every model, :class:`dash_trt.serving.backends.TorchBackend`; ``coords``, the page
        coordinates of a DASH model, are not used: positions come from ``batch``): ``input_ids`` [T] the new
        tokens of every sequence in ``batch.query_start_loc`` order; ``batch`` anything with the
        four tensors ``block_tables`` [B, W], ``seq_lens`` [B] (after this call),
        ``query_start_loc`` [B+1] and ``prompt_lens`` [B] (a :class:`dash_trt.attention.dash.paged.DashBatch`,
        what :meth:`KVBlockPool.schedule` returns, will do); one cache per layer. Returns float32
        logits of the rows ``logits_indices`` [N] (every row if None)."""
        if len(caches) != self.config.num_hidden_layers:
            raise ValueError(f"expected {self.config.num_hidden_layers} layer caches, got {len(caches)}")
        tables, lens, qsl, prompts = batch.block_tables, batch.seq_lens, batch.query_start_loc, batch.prompt_lens
        op = dca_ops.dual_chunk_attention_inplace_op()
        attrs = self.dca_attributes

        def attend(layer, q, k, v):
            cache = caches[layer]
            return op(q, k, v, cache.key, cache.value, tables, lens, qsl, prompts, **attrs)

        with torch.no_grad():
            return self._logits(self.model(input_ids, attend), logits_indices)

    # --------------------------------------------------------------- functional (export)
    def export_forward(
        self, input_ids, block_tables, seq_lens, query_start_loc, prompt_lens, logits_indices, *caches
    ) -> tuple[torch.Tensor, ...]:
        """The exported graph's function: ``(logits [N, vocab] float32, *new caches)``, the caches
        flat (layer 0 key, layer 0 value, layer 1 key, ...). Each layer calls the functional op,
        so the inputs are never written."""
        n = self.config.num_hidden_layers
        if len(caches) != 2 * n:
            raise ValueError(f"expected {2 * n} cache tensors (a key and a value per layer), got {len(caches)}")
        op = dca_ops.dual_chunk_attention_op()
        attrs = self.dca_attributes
        new: list[torch.Tensor] = [None] * (2 * n)  # type: ignore[list-item]

        def attend(layer, q, k, v):
            out, new[2 * layer], new[2 * layer + 1] = op(
                q,
                k,
                v,
                caches[2 * layer],
                caches[2 * layer + 1],
                block_tables,
                seq_lens,
                query_start_loc,
                prompt_lens,
                **attrs,
            )
            return out

        hidden = self.model(input_ids, attend)
        return (self._logits(hidden, logits_indices), *new)

    def cache_names(self, prefix: str) -> list[str]:
        """``{prefix}.{layer}.key``, ``{prefix}.{layer}.value`` for every layer (graph order)."""
        return [f"{prefix}.{i}.{f}" for i in range(self.config.num_hidden_layers) for f in ("key", "value")]


# ------------------------------------------------------------------------- weights
def init_random_weights(model: Qwen2DcaForCausalLM, seed: int = 0) -> Qwen2DcaForCausalLM:
    """Random weights from ``seed``, scaled so that a tiny model's logits spread over a few units
    (greedy choices are then far from ties): embeddings N(0, 1), projection weights
    N(0, 1/fan_in), biases N(0, 0.1^2), norm weights 1 + N(0, 0.1^2)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                new = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
            elif name.endswith(".bias"):
                new = 0.1 * torch.randn(p.shape, generator=gen)
            elif name == "model.embed_tokens.weight":
                new = torch.randn(p.shape, generator=gen)
            else:
                new = torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1])
            p.copy_(new.to(p.dtype))
    return model


#: Tensors some checkpoints carry that the model does not use (a RoPE table saved as a buffer).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def _few(names: Sequence[str], n: int = 4) -> str:
    more = f" and {len(names) - n} more" if len(names) > n else ""
    return ", ".join(names[:n]) + more


def load_qwen2_dca(
    folder: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    model_class: type[Qwen2DcaForCausalLM] | None = None,
) -> Qwen2DcaForCausalLM:
    """The model of a Hugging Face folder: ``config.json`` with ``dual_chunk_attention_config``
    and ``model.safetensors`` (or shards with their index), as ``model_class`` (default Qwen2,
    :class:`Qwen2DcaConfig`, which refuses another ``model_type``; :func:`dash_trt.models.qwen2_dca.load.load_dca`
    picks the class from the folder's config, Qwen2-MoE too). ``dtype`` defaults to the
    config's ``torch_dtype``. Raises :class:`Qwen2DcaConfigError` for the config (also for a
    ``sparse_attention_config.json`` beside the weights that vLLM and SGLang would run sparse:
    :func:`dash_trt.attention.dca.reference.check_dense`) and :class:`~dash_trt.models.checkpoint.CheckpointError` for
    the weights (missing, unexpected, of the wrong shape)."""
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise CheckpointError(f"model folder not found: {folder}")
    cls = model_class or Qwen2DcaForCausalLM
    config = cls.config_class.from_model_config(folder)
    state, _ = read_folder(folder)
    with torch.device("meta"):
        model = cls(config)
    want = {k: v.shape for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        del want["lm_head.weight"]
        head = state.pop("lm_head.weight", None)
        emb = state.get("model.embed_tokens.weight")
        if head is not None and emb is not None and not torch.equal(head, emb):
            raise CheckpointError(
                f"{folder}: tie_word_embeddings is true but lm_head.weight differs from model.embed_tokens.weight"
            )
    for k in [k for k in state if k.endswith(_IGNORED_SUFFIXES)]:
        del state[k]
    missing = sorted(set(want) - set(state))
    unexpected = sorted(set(state) - set(want))
    wrong = [
        f"{k} is {list(state[k].shape)}, expected {list(s)}"
        for k, s in want.items()
        if k in state and state[k].shape != s
    ]
    if missing or unexpected or wrong:
        parts = [f"missing {_few(missing)}"] if missing else []
        parts += [f"unexpected {_few(unexpected)}"] if unexpected else []
        parts += wrong[:3]
        raise CheckpointError(f"{folder}: the weights do not match config.json: " + "; ".join(parts))
    if dtype is not None and dtype not in _DTYPES.values():
        raise ValueError(f"dtype must be one of {list(_DTYPES.values())}, got {dtype}")
    # allocated once, in the final dtype and place; load_state_dict casts what it copies
    model = model.to(dtype or config.dtype).to_empty(device=device)
    if config.tie_word_embeddings:  # to_empty gave the two names separate storage
        model.lm_head.weight = model.model.embed_tokens.weight
    model.load_state_dict(state, strict=not config.tie_word_embeddings)
    return model.eval()


def save_qwen2_dca(model: Qwen2DcaForCausalLM, folder: str | os.PathLike) -> list[str]:
    """Write ``config.json`` (with the model's dtype) and ``model.safetensors`` into ``folder``,
    each whole and renamed into place; a tied ``lm_head.weight`` is not stored. Returns the
    files written."""
    from safetensors.torch import save_file

    folder = os.fspath(folder)
    os.makedirs(folder, exist_ok=True)
    dtype_name = next((k for k, v in _DTYPES.items() if v == model.dtype), None)
    if dtype_name is None:
        raise ValueError(f"cannot save a {model.dtype} model: config.json's torch_dtype is one of {sorted(_DTYPES)}")
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        del state["lm_head.weight"]
    config = {**model.config.to_dict(), "torch_dtype": dtype_name}
    atomic_write(os.path.join(folder, WEIGHTS_FILE), lambda tmp: save_file(state, tmp, metadata={"format": "pt"}))

    def dump(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(config, fh, indent=2)
            fh.write("\n")

    atomic_write(os.path.join(folder, CONFIG_FILE), dump)
    return [WEIGHTS_FILE, CONFIG_FILE]


def write_tiny_qwen2_dca(folder: str | os.PathLike, *, seed: int = 0, **overrides: Any) -> list[str]:
    """A random-weight Hugging Face folder (``config.json``, ``model.safetensors``) of
    :func:`tiny_qwen2_dca_config` (``overrides`` passed on), weights by
    :func:`init_random_weights`. Returns the files written."""
    config = Qwen2DcaConfig.from_dict(tiny_qwen2_dca_config(**overrides))
    model = init_random_weights(Qwen2DcaForCausalLM(config), seed)
    return save_qwen2_dca(model.to(config.dtype), folder)


# ----------------------------------------------------------------------- generation
@dataclass
class DcaGeneration:
    """What :func:`generate` (or :func:`reference_generate`) produced, per prompt: the generated
    ids and the float32 logits [n, vocab] that chose each; per step the plan."""

    tokens: list[list[int]]
    logits: list[torch.Tensor]
    #: per step, (prompt index, new tokens) of every sequence in the batch
    plans: list[list[tuple[int, int]]] = field(default_factory=list)
    #: per prompt, the physical KV blocks it held, in logical order
    block_tables: list[list[int]] = field(default_factory=list)


def _chunks(prompt_len: int, prefill: int | Sequence[int] | None) -> list[int]:
    """Sizes of the prefill chunks of a prompt (:func:`dash_trt.serving.generate.prefill_chunks`)."""
    from ...serving.generate import prefill_chunks

    return prefill_chunks(prompt_len, prefill)


def generate(
    model: Qwen2DcaForCausalLM,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    prefill: int | Sequence[int] | None = None,
    kv_block_size: int = 8,
    num_blocks: int | None = None,
    seed: int = 0,
    eos_token_id: int | None = None,
    forward: ForwardFn | None = None,
    cache_fill: float = 0.0,
) -> DcaGeneration:
    """Greedy generation over a paged cache: :func:`dash_trt.serving.generate.generate` (the
    serving runtime every model generates through) with this function's arguments and defaults,
    kept for callers of ``dash_trt.models.qwen2_dca.generate`` for this release (its import of
    the serving package, which stands above the models, goes with it); it has no loop of its own.

    ``prefill`` None prefills a prompt at once, an int in chunks of that size, a list of split
    points (token indices, increasing) at those points. Each prompt's blocks are allocated
    when it is added, the rest as it grows, from a pool of ``num_blocks`` (default: what every
    sequence needs, plus 2) in an order shuffled by ``seed``, and given back when a sequence
    finishes; the cache starts as ``cache_fill`` everywhere (NaN shows that no unwritten slot
    is read). A sequence ends after ``max_new_tokens`` tokens or at ``eos_token_id`` (None:
    never early). Ties go to the lower id.

    The model runs in place (:meth:`Qwen2DcaForCausalLM.forward_paged`) unless ``forward`` (a
    :data:`ForwardFn`, e.g. :func:`~dash_trt.models.qwen2_dca.export.ort_forward` of an exported
    file) takes the caches and returns new ones."""
    from ...serving.generate import generate as serving_generate

    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    model.config.dca.check_kv_block_size(kv_block_size)
    if num_blocks is None:
        num_blocks = sum(-(-(len(p) + max_new_tokens - 1) // kv_block_size) for p in prompts) + 2
    out = serving_generate(
        model,
        prompts,
        max_new_tokens,
        prefill_chunk=prefill,
        kv_block_size=kv_block_size,
        num_blocks=num_blocks,
        stop_at_eos=eos_token_id is not None,
        eos_token_id=eos_token_id,
        forward=forward,
        reserve_blocks=False,
        shuffle_seed=seed,
        cache_fill=cache_fill,
    )
    return DcaGeneration(out.tokens, out.logits, plans=out.batches, block_tables=out.block_tables)


def reference_generate(
    model: Qwen2DcaForCausalLM,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    eos_token_id: int | None = None,
) -> DcaGeneration:
    """:func:`generate` without a cache: every step recomputes the whole sequence with
    :meth:`Qwen2DcaForCausalLM.reference_logits` (told the prompt length, so every token is
    length-scaled as the paged cache scales it) and takes the last row's greedy choice."""
    out = DcaGeneration([], [])
    for p in prompts:
        seq, gen, rows = [int(t) for t in p], [], []
        for _ in range(max_new_tokens):
            row = model.reference_logits(seq, prompt_len=len(p))[-1]
            tok = int(torch.argmax(row))
            gen.append(tok)
            rows.append(row)
            seq.append(tok)
            if tok == eos_token_id:
                break
        out.tokens.append(gen)
        out.logits.append(torch.stack(rows))
    return out
