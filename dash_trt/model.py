"""A small but real decoder that uses DASH attention, its checkpoint format and greedy
generation over the paged cache.

Architecture (Llama-like): token embeddings; ``num_hidden_layers`` decoder layers, each
RMSNorm -> q/k/v projections plus the indexer projections ``iq``/``ik`` and the learned
``head_cls`` -> DASH attention (the torch custom op, :mod:`dash_trt.ops`) -> output
projection, residual; RMSNorm -> gated MLP (SiLU) -> residual; final RMSNorm; logits.
Image tokens are embedded from the token table: a real vision-language model would put
its vision encoder's features there; the attention and the cache do not care.

The configuration is a Hugging-Face-style ``config.json`` (:class:`DashModelConfig`)
whose ``dash_attention_config`` section is the :class:`~dash_trt.config.DashConfig`.
A checkpoint ``model.pt`` is ``{"config": <config.json dict>, "state_dict": ...}``
and is read with ``torch.load(weights_only=True)``; unpickling arbitrary objects (a
whole pickled module) needs ``allow_pickle=True`` (``dash-export --unsafe-load``).

The forward pass is the exported graph: ``forward(input_ids, coords, block_tables,
seq_lens, query_start_loc, prompt_lens, logits_indices, *caches) -> (logits, *new_caches)``
over a ragged batch of new tokens, six cache tensors per layer
(:data:`dash_trt.ops.CACHE_FIELDS`) in, updated ones out, logits only for the rows in
``logits_indices``. It is functional (the export form). Serving runs
:meth:`DashForCausalLM.forward_paged` instead: the same computation with the caches
written in place (the in-place op), driven by :mod:`dash_trt.runtime`; :func:`generate`
is greedy generation on that runtime.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pickle
import re
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import attributes as A
from . import fused as _fused
from .config import CONFIG_SECTION, DashConfig, DashConfigError
from .ops import CACHE_FIELDS, paged_attention, paged_attention_inplace
from .paged import (
    DashBatch,
    DashKVCache,
    KVBlockPool,
    assign_flat_cache_tensors,
    flat_cache_tensors,
)
from .reference import ROLE_IMAGE, ROLE_PAGE, ROLE_TEXT, dash_attention

__all__ = [
    "DashModelConfig",
    "ModelConfigError",
    "CheckpointError",
    "DashForCausalLM",
    "MODEL_INPUTS",
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
    "token_role",
    "token_roles",
    "PagedState",
    "Generation",
    "generate",
    "reference_generate",
]

#: Names of the forward pass's non-cache inputs, in order (also the ONNX input names).
#: ``logits_indices`` [N] int64 are the rows of the new tokens to score (vLLM's logits
#: indices: the last token of each sequence that samples), so no runtime materialises
#: [T, vocab] logits for prefill chunks; ``torch.arange(T)`` scores every token.
MODEL_INPUTS = ("input_ids", "coords", "block_tables", "seq_lens", "query_start_loc", "prompt_lens",
                "logits_indices")

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

ARCHITECTURE = "DashForCausalLM"
MODEL_TYPE = "dash_decoder"


class ModelConfigError(ValueError):
    """A model ``config.json`` is missing a key or holds a bad value."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be read (missing, corrupt, unsafe or inconsistent)."""


# --------------------------------------------------------------------------- config
@dataclass(frozen=True)
class DashModelConfig:
    """The decoder's ``config.json`` (Hugging-Face style)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    index_head_dim: int
    intermediate_size: int
    dash: DashConfig
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    eos_token_id: int | None = None
    torch_dtype: str = "float32"

    _REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "index_head_dim", "intermediate_size")

    #: Upper bounds of the sizes (far above any real decoder; a typo such as 10**9 layers must
    #: be an error, not an allocation that runs until memory is gone).
    _LIMITS = {"vocab_size": 1 << 24, "hidden_size": 1 << 16, "num_hidden_layers": 1024, "num_attention_heads": 1024,
               "num_key_value_heads": 1024, "head_dim": 1024, "index_head_dim": 1024, "intermediate_size": 1 << 18}

    def __post_init__(self) -> None:
        for name in self._REQUIRED:
            val = getattr(self, name)
            if not isinstance(val, int) or isinstance(val, bool) or val <= 0:
                raise ModelConfigError(f"model config key '{name}' must be a positive integer, got {val!r}")
            if val > self._LIMITS[name]:
                raise ModelConfigError(f"model config key '{name}' is {val}, more than the supported "
                                       f"{self._LIMITS[name]}")
        if not isinstance(self.tie_word_embeddings, bool):
            raise ModelConfigError(f"tie_word_embeddings must be true or false, got {self.tie_word_embeddings!r}")
        eos = self.eos_token_id
        if eos is not None and (isinstance(eos, bool) or not isinstance(eos, int) or not 0 <= eos < self.vocab_size):
            raise ModelConfigError(f"eos_token_id must be a token id in 0..{self.vocab_size - 1} (or null), "
                                   f"got {eos!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if not (isinstance(self.rms_norm_eps, (int, float)) and math.isfinite(self.rms_norm_eps)
                and self.rms_norm_eps > 0):
            raise ModelConfigError(f"rms_norm_eps must be a positive number, got {self.rms_norm_eps!r}")
        if self.torch_dtype not in DTYPES:
            raise ModelConfigError(f"torch_dtype must be one of {sorted(DTYPES)}, got {self.torch_dtype!r}")
        try:
            self.dash.check_head_dim(self.head_dim, "head_dim")
            self.dash.check_head_dim(self.index_head_dim, "index_head_dim")
        except DashConfigError as exc:
            raise ModelConfigError(str(exc)) from None
        for name in ("image_token_id", "page_token_id"):
            tid = getattr(self.dash, name)
            if tid is None:
                raise ModelConfigError(f"'{CONFIG_SECTION}' must set {name} (prompts are built from it)")
            if not 0 <= tid < self.vocab_size:
                raise ModelConfigError(f"{name} {tid} is outside the vocabulary (0..{self.vocab_size - 1})")
        if self.dash.image_token_id == self.dash.page_token_id:
            raise ModelConfigError("image_token_id and page_token_id must differ")
        topk = self.dash.sparse_topk_blocks
        if isinstance(topk, tuple) and len(topk) < self.num_hidden_layers:
            raise ModelConfigError(
                f"sparse_topk_blocks lists {len(topk)} layers, the model has {self.num_hidden_layers}")

    @property
    def image_token_id(self) -> int:
        return self.dash.image_token_id

    @property
    def page_token_id(self) -> int:
        return self.dash.page_token_id

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.torch_dtype]

    def to_dict(self) -> dict[str, Any]:
        """The ``config.json`` content."""
        out: dict[str, Any] = {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE}
        for f in dataclasses.fields(self):
            if f.name != "dash":
                out[f.name] = getattr(self, f.name)
        out[CONFIG_SECTION] = self.dash.to_dict()
        return out

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], *, source: str = "model config") -> DashModelConfig:
        if not isinstance(config, Mapping):
            raise ModelConfigError(f"{source} must be a JSON object, got {type(config).__name__}")
        if CONFIG_SECTION not in config:
            raise ModelConfigError(
                f"{source} has no '{CONFIG_SECTION}' section: it does not describe a DASH attention "
                f"model (add the section with the sparse_* keys, see export/README.md)")
        try:
            dash = DashConfig.from_model_config(config)
        except DashConfigError as exc:
            raise ModelConfigError(f"{source}: {exc}") from None
        missing = [k for k in cls._REQUIRED if k not in config]
        if missing:
            raise ModelConfigError(f"{source} is missing key(s): {', '.join(missing)}")
        names = {f.name for f in dataclasses.fields(cls)} - {"dash"}
        values = {k: config[k] for k in names if k in config}
        return cls(dash=dash, **values)

    def replace(self, **changes) -> DashModelConfig:
        return dataclasses.replace(self, **changes)


def load_model_config(path: str | os.PathLike) -> DashModelConfig:
    """Read a ``config.json``."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except FileNotFoundError:
        raise ModelConfigError(f"model config not found: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelConfigError(f"model config {path} is not valid JSON: {exc}") from None
    return DashModelConfig.from_dict(data, source=path)


#: The built-in demo model: small enough to export and check in seconds on a CPU,
#: with the benchmark's routing shape scaled down (per-layer top-k, page bias).
DEMO_CONFIG: dict[str, Any] = {
    "architectures": [ARCHITECTURE],
    "model_type": MODEL_TYPE,
    "vocab_size": 320,
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "index_head_dim": 32,
    "intermediate_size": 256,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "eos_token_id": 258,
    "torch_dtype": "float32",
    CONFIG_SECTION: {
        "sparse_block_size": 16,
        "sparse_local_block": 1,
        "sparse_topk_blocks": [4, 2],
        "sparse_page_bias": 0.5,
        "sparse_rope_page_pairs": 1,
        "page_token_id": 256,
        "image_token_id": 257,
    },
}


# ------------------------------------------------------------------------ tokenizer
#: Byte-level text tokens are the byte values 0..255; special tokens come from the config.
_SPECIAL = re.compile(r"<PAGE>|<image(?:\*(\d+))?>")


def tokenize(text: str, config: DashModelConfig) -> list[int]:
    """Token ids of ``text``: UTF-8 bytes, with ``<PAGE>`` and ``<image>`` (or
    ``<image*N>`` for N image tokens) as the special tokens."""
    ids: list[int] = []
    pos = 0
    for m in _SPECIAL.finditer(text):
        ids += list(text[pos:m.start()].encode("utf-8"))
        if m.group(0) == "<PAGE>":
            ids.append(config.page_token_id)
        else:
            ids += [config.image_token_id] * int(m.group(1) or 1)
        pos = m.end()
    ids += list(text[pos:].encode("utf-8"))
    if any(i >= config.vocab_size for i in ids):
        raise ValueError(f"vocab_size {config.vocab_size} is too small for byte-level text")
    return ids


def detokenize(ids: Sequence[int], config: DashModelConfig) -> str:
    out, raw = [], bytearray()
    for i in ids:
        if 0 <= i < 256:
            raw.append(i)
            continue
        out.append(raw.decode("utf-8", "replace"))
        raw = bytearray()
        out.append({config.page_token_id: "<PAGE>", config.image_token_id: "<image>"}.get(i, f"<{i}>"))
    out.append(raw.decode("utf-8", "replace"))
    return "".join(out)


def document_prompt(image_tokens_per_page: Sequence[int], question: str, config: DashModelConfig,
                    preamble: str = "") -> list[int]:
    """``preamble <PAGE><image>... <PAGE><image>... question``."""
    pages = "".join(f"<PAGE><image*{n}>" for n in image_tokens_per_page)
    return tokenize(preamble + pages + question, config)


def token_role(token: int, config: DashModelConfig) -> int:
    """The role of one token id (:func:`token_roles` for one token)."""
    return ROLE_PAGE if token == config.page_token_id else ROLE_IMAGE if token == config.image_token_id else ROLE_TEXT


def token_roles(ids: Sequence[int] | torch.Tensor, config: DashModelConfig) -> torch.Tensor:
    """Roles [S] (text 0, image 1, ``<PAGE>`` 2) of token ids."""
    ids = torch.as_tensor(ids, dtype=torch.long)
    roles = torch.full_like(ids, ROLE_TEXT)
    roles[ids == config.image_token_id] = ROLE_IMAGE
    roles[ids == config.page_token_id] = ROLE_PAGE
    return roles


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


class DashAttention(nn.Module):
    """Projections around the DASH attention op for one layer."""

    def __init__(self, cfg: DashModelConfig, layer_idx: int):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.index_dim = cfg.index_head_dim
        self.sp = cfg.dash
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        self.iq_proj = nn.Linear(h, self.index_dim, bias=False)
        self.ik_proj = nn.Linear(h, self.index_dim, bias=False)
        self.head_cls = nn.Parameter(torch.zeros(self.index_dim))
        self._attrs: dict | None = None  # the op's encoded config, built on first use

    def project(self, x: torch.Tensor):
        t = x.shape[0]
        return (
            self.q_proj(x).view(t, self.num_heads, self.head_dim),
            self.k_proj(x).view(t, self.num_kv_heads, self.head_dim),
            self.v_proj(x).view(t, self.num_kv_heads, self.head_dim),
            self.iq_proj(x),
            self.ik_proj(x),
        )

    def forward(self, x, coords, caches, block_tables, seq_lens, query_start_loc, prompt_lens):
        q, k, v, iq, ik = self.project(x)
        out, new = paged_attention(q, k, v, iq, ik, coords, self.head_cls, caches, block_tables, seq_lens,
                                   query_start_loc, prompt_lens, self.sp, self.layer_idx)
        return self.o_proj(out.reshape(x.shape[0], -1)), new

    def forward_inplace(self, x, coords, cache: DashKVCache, batch: DashBatch):
        """The serving form: ``cache`` is written in place (no copy of the pool)."""
        if self._attrs is None:
            self._attrs = A.encode(self.sp, self.layer_idx)
        q, k, v, iq, ik = self.project(x)
        out = paged_attention_inplace(q, k, v, iq, ik, coords, self.head_cls, cache, batch, self.sp,
                                      self.layer_idx, self._attrs)
        return self.o_proj(out.reshape(x.shape[0], -1))

    def reference(self, x, roles, prompt_length):
        """Dense reference: the whole sequence at once (:func:`reference.dash_attention`)."""
        q, k, v, iq, ik = self.project(x)
        out = dash_attention(q, k, v, iq, ik, roles, self.head_cls, self.sp, self.layer_idx, prompt_length)
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
        self.self_attn = DashAttention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, coords, caches, *meta):
        a, new = self.self_attn(self.input_layernorm(x), coords, caches, *meta)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x)), new

    def forward_inplace(self, x, coords, cache, batch):
        x = x + self.self_attn.forward_inplace(self.input_layernorm(x), coords, cache, batch)
        return x + self.mlp(self.post_attention_layernorm(x))

    def reference(self, x, roles, prompt_length):
        x = x + self.self_attn.reference(self.input_layernorm(x), roles, prompt_length)
        return x + self.mlp(self.post_attention_layernorm(x))


class DashForCausalLM(nn.Module):
    """The decoder. ``forward`` is the exported graph (see the module docstring)."""

    def __init__(self, config: DashModelConfig):
        super().__init__()
        self.config = config
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

    def cache_names(self, prefix: str) -> list[str]:
        """Flat names of the cache tensors (``{prefix}.{layer}.{field}``)."""
        return [f"{prefix}.{i}.{f}" for i in range(len(self.layers)) for f in CACHE_FIELDS]

    def forward(self, input_ids, coords, block_tables, seq_lens, query_start_loc, prompt_lens, logits_indices,
                *caches):
        """Logits [N, vocab] (float32) of the rows ``logits_indices`` of the new tokens, and
        the updated caches (the functional, exported form)."""
        n = len(CACHE_FIELDS)
        if len(caches) != n * len(self.layers):
            raise ValueError(f"expected {n * len(self.layers)} cache tensors ({n} per layer), got {len(caches)}")
        x = self.embed_tokens(input_ids)
        new: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            x, c = layer(x, coords, caches[n * i:n * (i + 1)], block_tables, seq_lens, query_start_loc, prompt_lens)
            new.extend(c)
        return (self.logits(x, logits_indices), *new)

    def logits(self, hidden: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        """Float32 logits of the rows ``logits_indices`` of the last hidden states."""
        return self.lm_head(self.norm(torch.index_select(hidden, 0, logits_indices))).float()

    def forward_paged(self, input_ids: torch.Tensor, coords: torch.Tensor, batch: DashBatch,
                      caches: Sequence[DashKVCache], logits_indices: torch.Tensor) -> torch.Tensor:
        """The forward pass with every layer's cache written in place (the serving form of
        :meth:`forward`): the same ``batch`` for every layer, no copy of the pool, no host
        synchronisation on the CUDA kernels. Returns the logits [N, vocab] (float32)."""
        if len(caches) != len(self.layers):
            raise ValueError(f"expected {len(self.layers)} layer caches, got {len(caches)}")
        x = self.embed_tokens(input_ids)
        for layer, cache in zip(self.layers, caches):
            x = layer.forward_inplace(x, coords, cache, batch)
        return self.logits(x, logits_indices)

    def reference_logits(self, ids: Sequence[int] | torch.Tensor, prompt_length: int | None = None) -> torch.Tensor:
        """Logits [S, vocab] of a whole sequence without a cache (dense reference
        attention, :func:`dash_trt.reference.dash_attention`)."""
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.device)
        roles = token_roles(ids.cpu(), self.config).to(self.device)
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer.reference(x, roles, prompt_length)
        return self.lm_head(self.norm(x)).float()

    def allocate_cache(self, num_blocks: int, kv_block_size: int,
                       device: str | torch.device | None = None) -> list[DashKVCache]:
        """One :class:`DashKVCache` per layer (on the model's device unless ``device``)."""
        c = self.config
        return [DashKVCache.allocate(num_blocks, kv_block_size, c.num_key_value_heads, c.head_dim,
                                     c.index_head_dim, c.dash.sparse_block_size, dtype=self.dtype,
                                     device=self.device if device is None else device) for _ in self.layers]


def _init_weights(model: DashForCausalLM, gen: torch.Generator) -> None:
    """Random weights with O(1) activations and logits (fan-in scaled), so that greedy
    decoding and top-k routing are not decided by float rounding."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            kw = {"generator": gen, "device": gen.device, "dtype": torch.float32}
            if name.endswith("layernorm.weight") or name == "norm.weight":
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, **kw))
            elif p.ndim == 2 and "embed_tokens" not in name:
                p.copy_(torch.randn(p.shape, **kw) / math.sqrt(p.shape[1]))
            else:
                p.copy_(torch.randn(p.shape, **kw))


def random_model(config: DashModelConfig | Mapping[str, Any], *, seed: int = 0,
                 dtype: torch.dtype | None = None, device: str | torch.device | None = None) -> DashForCausalLM:
    """A model of ``config`` with random weights (for demos, tests and benchmarks).
    ``device`` builds and fills it there (a GPU's generator: other numbers than the CPU's,
    and seconds instead of minutes for a billion-parameter benchmark model)."""
    if not isinstance(config, DashModelConfig):
        config = DashModelConfig.from_dict(config)
    device = torch.device(device) if device is not None else torch.device("cpu")
    dtype = dtype or config.dtype
    with torch.device(device):
        model = DashForCausalLM(config).to(dtype)
    _init_weights(model, torch.Generator(device=device).manual_seed(seed))
    return model.eval()


def demo_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> DashForCausalLM:
    """The built-in random demo model (:data:`DEMO_CONFIG`)."""
    return random_model(DEMO_CONFIG, seed=seed, dtype=dtype)


# ------------------------------------------------------------------------ checkpoint
def _atomic_write(path: str, write: Callable[[str], None]) -> None:
    """Write through a temporary file in the same folder, then rename it into place."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=os.path.basename(path), dir=folder)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def save_checkpoint(model: DashForCausalLM, path: str | os.PathLike, *, config_json: bool = False) -> None:
    """Write ``model.pt`` = ``{"config": ..., "state_dict": ...}`` atomically (and a
    ``config.json`` beside it if asked)."""
    path = os.fspath(path)
    config = model.config.replace(torch_dtype=next(k for k, v in DTYPES.items() if v == model.dtype)).to_dict()
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    _atomic_write(path, lambda tmp: torch.save({"config": config, "state_dict": state}, tmp))
    if config_json:
        target = os.path.join(os.path.dirname(os.path.abspath(path)), "config.json")

        def dump(tmp: str) -> None:
            with open(tmp, "w", encoding="utf-8") as fh:
                json.dump(config, fh, indent=2)
                fh.write("\n")

        _atomic_write(target, dump)


def save_pretrained(model: DashForCausalLM, folder: str | os.PathLike, *, max_shard_bytes: int | None = None) -> list[str]:
    """Write ``model`` as a Hugging Face folder (``config.json`` + safetensors, sharded above
    ``max_shard_bytes``); see :func:`dash_trt.pretrained.save_pretrained`."""
    from . import pretrained as HF

    try:
        return HF.save_pretrained(model, folder, max_shard_bytes=max_shard_bytes)
    except HF.PretrainedError as exc:
        raise CheckpointError(str(exc)) from None


def load_checkpoint(path: str | os.PathLike, *, allow_pickle: bool = False,
                    config: DashModelConfig | Mapping[str, Any] | None = None) -> DashForCausalLM:
    """Read a checkpoint: a ``model.pt``; a Hugging Face folder (``config.json`` with
    ``model.safetensors`` or sharded safetensors and their index, :mod:`dash_trt.pretrained`;
    or with a ``model.pt``); or one ``.safetensors`` file with the ``config.json`` beside it.
    ``config`` (a ``config.json`` dict or :class:`DashModelConfig`) overrides the checkpoint's
    own, so a bare state dict plus a ``config.json`` works too.

    Uses ``torch.load(weights_only=True)``: tensors and plain containers only. A file
    holding other Python objects (e.g. a pickled module) is refused unless
    ``allow_pickle=True``: unpickling can run arbitrary code, only do it for files you
    trust. Raises :class:`CheckpointError` or :class:`ModelConfigError` with a message
    that says what is wrong.
    """
    from . import pretrained as HF

    path = os.fspath(path)
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint not found: {path}")
    try:
        if os.path.isdir(path):
            torch_file, config_file = os.path.join(path, HF.TORCH_FILE), os.path.join(path, HF.CONFIG_FILE)
            if not HF.is_pretrained_folder(path) and os.path.isfile(torch_file):  # a folder holding model.pt
                if config is None and os.path.isfile(config_file):
                    config = load_model_config(config_file)
                return load_checkpoint(torch_file, allow_pickle=allow_pickle, config=config)
            state, folder_config = HF.read_folder(path)  # or the error that says what is missing
            return _from_state(path, state, config if config is not None else folder_config)
        if path.endswith(".safetensors"):
            if config is None:
                beside = os.path.join(os.path.dirname(os.path.abspath(path)), HF.CONFIG_FILE)
                if not os.path.isfile(beside):
                    raise CheckpointError(f"{path}: a safetensors file holds no config; put the model's "
                                          f"{HF.CONFIG_FILE} beside it or pass it (dash-export --config)")
                config = load_model_config(beside)
            return _from_state(path, HF.to_local_names(HF.read_safetensors(path)), config)
    except HF.PretrainedError as exc:
        raise CheckpointError(str(exc)) from None
    try:
        obj = torch.load(path, map_location="cpu", weights_only=not allow_pickle)
    except pickle.UnpicklingError as exc:
        # The weights-only unpickler names the first class it refused ("Unsupported
        # global: GLOBAL pkg.Class"); any other unpickling error is a damaged file.
        blocked = re.search(r"unsupported GLOBAL ([\w.]+) whose module ([\w.]+) is blocked", str(exc))
        if blocked:
            raise CheckpointError(
                f"{path} is unsafe: unpickling it would call {blocked.group(1)} (module {blocked.group(2)}), which "
                f"runs code on this machine; a checkpoint holds tensors, so the file is malicious or broken. It was "
                f"not loaded; do not load it with --unsafe-load (allow_pickle=True), which would make that call") from None
        found = re.search(r"(?:Unsupported global: GLOBAL|unsupported GLOBAL) ([\w.]+)", str(exc))
        if found:
            raise CheckpointError(
                f"{path} holds pickled Python objects ({found.group(1)}; for example a whole nn.Module), which the safe "
                f"loader (torch.load(weights_only=True)) refuses. Save it as "
                f"{{'config': ..., 'state_dict': ...}} (dash_trt.model.save_checkpoint), or, only if you "
                f"trust the file, pass --unsafe-load (allow_pickle=True): unpickling can run arbitrary "
                f"code.") from None
        # Not torch's advice to drop weights_only (that would unpickle untrusted code, and
        # does not mend a damaged file): the unpickler's own reason.
        why = re.search(r"WeightsUnpickler error:\s*(.+?)(?:\n\n|$)", str(exc), re.S)
        raise CheckpointError(f"{path} is not a readable PyTorch checkpoint (corrupt or truncated?): "
                              f"{' '.join(why.group(1).split()) if why else _first_line(exc)}") from None
    except Exception as exc:  # zip errors, EOF, bad magic number, ...
        raise CheckpointError(f"{path} is not a readable PyTorch checkpoint (corrupt or truncated?): "
                              f"{type(exc).__name__}: {_first_line(exc)}") from None

    if isinstance(obj, DashForCausalLM):  # only reachable with allow_pickle
        model = obj
        if config is not None:
            raise CheckpointError(f"{path} holds a whole model; a separate config cannot be applied to it")
        return model.eval()
    if isinstance(obj, nn.Module):
        raise CheckpointError(f"{path} holds a {type(obj).__name__}, not a {ARCHITECTURE}")
    if not isinstance(obj, Mapping):
        raise CheckpointError(f"{path} holds a {type(obj).__name__}; expected a dict with 'config' and "
                              f"'state_dict'")
    if "state_dict" in obj:
        state, ckpt_config = obj["state_dict"], obj.get("config")
    elif all(isinstance(v, torch.Tensor) for v in obj.values()) and obj:
        state, ckpt_config = obj, None  # a bare state dict
    else:
        raise CheckpointError(f"{path} has no 'state_dict' entry (keys: {sorted(map(str, obj))[:8]})")
    if config is None:
        if ckpt_config is None:
            raise CheckpointError(f"{path} has no 'config' entry; pass the model's config.json "
                                  f"(dash-export --config)")
        config = ckpt_config
    if not isinstance(state, Mapping):
        raise CheckpointError(f"{path}: 'state_dict' is a {type(state).__name__}, expected a dict of tensors")
    return _from_state(path, state, config)


def _from_state(path: str, state: Mapping[str, torch.Tensor], config) -> DashForCausalLM:
    """The model of ``config`` with the weights ``state`` (the module's names). With tied
    embeddings ``lm_head.weight`` may be absent (it is the embedding table). The dtype is
    the weights' where they agree, else the config's ``torch_dtype``."""
    if not isinstance(config, DashModelConfig):
        config = DashModelConfig.from_dict(config, source=f"config of {path}")
    nonfinite = [k for k, v in state.items()
                 if isinstance(v, torch.Tensor) and v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if nonfinite:
        raise CheckpointError(f"{path}: {len(nonfinite)} weight tensor(s) hold NaN or inf values "
                              f"({_few(nonfinite, 3)}); the model would compute NaN logits")
    model = DashForCausalLM(config)
    expected = model.state_dict()
    wrong = [f"{k} is {list(v.shape)} in the checkpoint, {list(expected[k].shape)} in the model"
             for k, v in state.items() if k in expected and isinstance(v, torch.Tensor) and v.shape != expected[k].shape]
    if wrong:
        raise CheckpointError(f"{path}: weights do not match the config: {_few(wrong, 3)}")
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or result.unexpected_keys:
        raise CheckpointError(
            f"{path}: weights do not match the config: missing {_few(missing)}, "
            f"unexpected {_few(result.unexpected_keys)}")
    dtypes = {v.dtype for v in state.values() if isinstance(v, torch.Tensor) and v.is_floating_point()}
    return model.to(dtypes.pop() if len(dtypes) == 1 else config.dtype).eval()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _few(keys: Sequence[str], n: int = 5) -> str:
    if not keys:
        return "none"
    more = f" and {len(keys) - n} more" if len(keys) > n else ""
    return ", ".join(keys[:n]) + more


# ----------------------------------------------------------------------- generation
class PagedState:
    """The paged cache of every layer (one :class:`DashKVCache` each, one
    :class:`KVBlockPool` and so one block table shared by all layers)."""

    def __init__(self, model: DashForCausalLM, num_blocks: int, kv_block_size: int):
        self.pool = KVBlockPool(num_blocks, kv_block_size)
        self.caches = model.allocate_cache(num_blocks, kv_block_size)

    def tensors(self) -> list[torch.Tensor]:
        return flat_cache_tensors(self.caches)

    def update(self, tensors: Sequence[torch.Tensor]) -> None:
        assign_flat_cache_tensors(self.caches, tensors)


#: forward(inputs: dict of MODEL_INPUTS, caches: list) -> (logits [N, V], new caches): a
#: functional backend (the exported graph's interface; :class:`dash_trt.runtime.PagedRuntime`).
ForwardFn = Callable[[dict, list], tuple[torch.Tensor, Sequence[torch.Tensor]]]


@dataclass
class Generation:
    """Result of :func:`generate`: per sequence, the generated ids and the logits
    [n, vocab] that chose each of them."""

    tokens: list[list[int]]
    logits: list[torch.Tensor]
    steps: int = 0
    batches: list[list[tuple[int, int]]] = field(default_factory=list)  #: (sequence, new tokens) per step
    blocks_in_use: int = 0  #: KV blocks still held at the end (0 once every sequence finished)
    graph_steps: int = 0  #: decode steps replayed from a CUDA graph


def _greedy(logits: torch.Tensor, config: DashModelConfig) -> int:
    """The greedy choice for one row of logits [vocab] (:func:`dash_trt.runtime.greedy_tokens`)."""
    from .runtime import greedy_tokens

    return int(greedy_tokens(logits[None], config.image_token_id)[0])


def generate(model: DashForCausalLM, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
             prefill_chunk: int | None = None, kv_block_size: int = 16, num_blocks: int | None = None,
             stop_at_eos: bool = True, forward: ForwardFn | None = None, cuda_graphs: bool | None = None,
             keep_logits: bool = True) -> Generation:
    """Greedy generation over the paged cache, on the serving runtime
    (:class:`dash_trt.runtime.PagedRuntime`: caches written in place, logits only for the
    tokens chosen, decode steps replayed from CUDA graphs on the kernels).

    Every step is one batch: each sequence contributes its next prefill chunk (of up to
    ``prefill_chunk`` tokens; the whole prompt if None) or its next decode token, so
    prefill chunks and decode steps of different sequences mix. Each sequence's blocks for
    its prompt and ``max_new_tokens - 1`` generated tokens are allocated up front
    (``num_blocks`` defaults to their sum). ``forward`` replaces the model call with a
    functional one (the ONNX check runs another runtime on the same steps);
    ``cuda_graphs=False`` runs decode steps eagerly; ``keep_logits=False`` skips copying
    the chosen rows' logits to the host.
    """
    from .runtime import PagedRuntime

    cfg = model.config
    prompts = [list(map(int, p)) for p in prompts]
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate needs at least one non-empty prompt")
    if prefill_chunk is not None and prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
    reserve = [len(p) + max(max_new_tokens, 1) - 1 for p in prompts]
    if num_blocks is None:
        num_blocks = sum(-(-r // kv_block_size) for r in reserve) + 1
    runtime = PagedRuntime(model, num_blocks, kv_block_size, forward=forward, max_model_len=max(reserve),
                           max_num_seqs=len(prompts), cuda_graphs=cuda_graphs)
    n = len(prompts)
    for i, p in enumerate(prompts):
        runtime.add(i, p, reserve[i])
    finished = [max_new_tokens <= 0] * n
    result = Generation([[] for _ in range(n)], [])
    logits_out: list[list[torch.Tensor]] = [[] for _ in range(n)]
    while True:
        plan = []
        for i in range(n):
            if finished[i]:
                continue
            left = runtime.seq(i).pending
            plan.append((i, left if prefill_chunk is None else min(left, prefill_chunk)))
        if not plan:
            break
        step = runtime.step(plan, return_logits=keep_logits)
        result.steps += 1
        result.batches.append(plan)
        for i, tok in step.tokens.items():
            result.tokens[i].append(tok)
            if keep_logits:
                logits_out[i].append(step.logits[i])
            if len(result.tokens[i]) >= max_new_tokens or (stop_at_eos and tok == cfg.eos_token_id):
                finished[i] = True
                runtime.free(i)
    result.blocks_in_use = runtime.pool.num_blocks - runtime.pool.num_free_blocks
    result.logits = [torch.stack(x) if x else torch.empty(0, cfg.vocab_size) for x in logits_out]
    result.graph_steps = runtime.graph_steps
    return result


def reference_generate(model: DashForCausalLM, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                       stop_at_eos: bool = True) -> Generation:
    """Step-by-step reference for :func:`generate`: every token re-runs the whole
    sequence through the dense reference attention, no cache."""
    cfg = model.config
    tokens, logits = [], []
    for p in prompts:
        hist, gen, lg = list(p), [], []
        with torch.no_grad():
            for _ in range(max_new_tokens):
                last = model.reference_logits(hist, len(p))[-1].float().cpu()
                tok = _greedy(last, cfg)
                gen.append(tok)
                lg.append(last)
                hist.append(tok)
                if stop_at_eos and tok == cfg.eos_token_id:
                    break
        tokens.append(gen)
        logits.append(torch.stack(lg) if lg else torch.empty(0, cfg.vocab_size))
    return Generation(tokens, logits)
