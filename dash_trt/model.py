"""A small but real decoder that uses DASH attention, its checkpoint format and greedy
generation over the paged cache.

Architecture (Llama-like): token embeddings; ``num_hidden_layers`` decoder layers, each
RMSNorm -> q/k/v projections plus Unlimited-OCR-2's DASH router (:class:`~dash_trt.modeling.
DashRouter`: the indexer's ``iq``/``ik`` and the learned ``head_cls``) -> DASH attention (the
torch custom op, :mod:`dash_trt.ops`) -> output projection, residual; RMSNorm -> gated MLP
(SiLU) -> residual; final RMSNorm; logits.
Image tokens are embedded from the token table: a real vision-language model would put
its vision encoder's features there; the attention and the cache do not care.

The configuration is a Hugging-Face-style ``config.json`` (:class:`DashModelConfig`)
whose ``sparse_attention_config`` section is the :class:`~dash_trt.config.DashConfig`.
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
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import fused as _fused
from .config import CONFIG_SECTION, DashConfig, DashConfigError, missing_section_message
from .modeling import (
    IMAGE_INPUTS,
    MODEL_INPUTS,
    DashAttention,
    DashContext,
    DashModel,
    DashRouter,
    ExportGraph,
    ModelContractError,
)
from .paged import KVBlockPool, assign_flat_cache_tensors, flat_cache_tensors
from .reference import ROLE_IMAGE, ROLE_PAGE, ROLE_TEXT

__all__ = [
    "DashModelConfig",
    "ModelConfigError",
    "CheckpointError",
    "DashForCausalLM",
    "DashModel",
    "DashAttention",
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
    intermediate_size: int
    dash: DashConfig
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    eos_token_id: int | None = None
    torch_dtype: str = "float32"
    #: Values per image feature row a request may carry for its ``<image>`` tokens (what the
    #: vision encoder produces; the model's ``embed_image_features`` maps them to hidden_size).
    #: None: the model takes none, image tokens are embedded from the token table.
    image_feature_dim: int | None = None
    #: Every other key of the config.json (a user's model reads its own keys here).
    extra: Mapping[str, Any] = field(default_factory=dict, hash=False)

    _REQUIRED = (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "intermediate_size",
    )

    #: Upper bounds of the sizes (far above any real decoder; a typo such as 10**9 layers must
    #: be an error, not an allocation that runs until memory is gone).
    _LIMITS = {
        "vocab_size": 1 << 24,
        "hidden_size": 1 << 16,
        "num_hidden_layers": 1024,
        "num_attention_heads": 1024,
        "num_key_value_heads": 1024,
        "head_dim": 1024,
        "intermediate_size": 1 << 18,
    }

    def __post_init__(self) -> None:
        for name in self._REQUIRED:
            val = getattr(self, name)
            if not isinstance(val, int) or isinstance(val, bool) or val <= 0:
                raise ModelConfigError(f"model config key '{name}' must be a positive integer, got {val!r}")
            if val > self._LIMITS[name]:
                raise ModelConfigError(
                    f"model config key '{name}' is {val}, more than the supported {self._LIMITS[name]}"
                )
        if not isinstance(self.tie_word_embeddings, bool):
            raise ModelConfigError(f"tie_word_embeddings must be true or false, got {self.tie_word_embeddings!r}")
        eos = self.eos_token_id
        if eos is not None and (isinstance(eos, bool) or not isinstance(eos, int) or not 0 <= eos < self.vocab_size):
            raise ModelConfigError(
                f"eos_token_id must be a token id in 0..{self.vocab_size - 1} (or null), got {eos!r}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if not (
            isinstance(self.rms_norm_eps, (int, float)) and math.isfinite(self.rms_norm_eps) and self.rms_norm_eps > 0
        ):
            raise ModelConfigError(f"rms_norm_eps must be a positive number, got {self.rms_norm_eps!r}")
        ifd = self.image_feature_dim
        if ifd is not None and (isinstance(ifd, bool) or not isinstance(ifd, int) or not 0 < ifd <= 1 << 16):
            raise ModelConfigError(
                f"image_feature_dim must be a positive integer up to {1 << 16} (or null), got {ifd!r}"
            )
        if not isinstance(self.extra, Mapping):
            raise ModelConfigError(f"extra must be a mapping of config keys, got {type(self.extra).__name__}")
        if self.torch_dtype not in DTYPES:
            raise ModelConfigError(f"torch_dtype must be one of {sorted(DTYPES)}, got {self.torch_dtype!r}")
        try:
            self.dash.check_head_dim(self.head_dim, "head_dim")
            self.dash.check_head_dim(self.index_head_dim, "sparse_index_dim")
            self.dash.check_layers(self.num_hidden_layers)
        except DashConfigError as exc:
            raise ModelConfigError(str(exc)) from None
        if self.index_head_dim > self._LIMITS["head_dim"]:
            raise ModelConfigError(
                f"sparse_index_dim is {self.index_head_dim}, more than the supported {self._LIMITS['head_dim']}"
            )
        for name in ("image_token_id", "page_token_id"):
            tid = getattr(self.dash, name)
            if tid is None:
                raise ModelConfigError(f"'{CONFIG_SECTION}' must set {name} (prompts are built from it)")
            if not 0 <= tid < self.vocab_size:
                raise ModelConfigError(f"{name} {tid} is outside the vocabulary (0..{self.vocab_size - 1})")
        if self.dash.image_token_id == self.dash.page_token_id:
            raise ModelConfigError("image_token_id and page_token_id must differ")

    @property
    def index_head_dim(self) -> int:
        """The DASH indexer's width (``sparse_attention_config.sparse_index_dim``)."""
        return self.dash.sparse_index_dim

    @property
    def image_token_id(self) -> int:
        return self.dash.image_token_id

    @property
    def page_token_id(self) -> int:
        return self.dash.page_token_id

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.torch_dtype]

    @property
    def architecture(self) -> str:
        """The model class's name (``architectures[0]`` of the config.json)."""
        arch = self.extra.get("architectures")
        return arch[0] if isinstance(arch, list) and arch and isinstance(arch[0], str) else ARCHITECTURE

    def get(self, key: str, default: Any = None) -> Any:
        """A config.json key: a field of this class, else one of :attr:`extra`."""
        if key in self._FIELDS:
            return getattr(self, key)
        return self.extra.get(key, default)

    def to_dict(self) -> dict[str, Any]:
        """The ``config.json`` content."""
        builtin = self.architecture == ARCHITECTURE
        out: dict[str, Any] = {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE} if builtin else {}
        out.update(self.extra)
        for f in dataclasses.fields(self):
            if f.name not in ("dash", "extra") and not (
                f.name == "image_feature_dim" and self.image_feature_dim is None
            ):
                out[f.name] = getattr(self, f.name)
        out[CONFIG_SECTION] = self.dash.to_dict()
        return out

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], *, source: str = "model config") -> DashModelConfig:
        if not isinstance(config, Mapping):
            raise ModelConfigError(f"{source} must be a JSON object, got {type(config).__name__}")
        if CONFIG_SECTION not in config:
            raise ModelConfigError(
                missing_section_message(config, source)
                + (
                    ""
                    if "dash_attention_config" in config
                    else ": it does not describe a DASH attention model (add the section with the sparse_* keys, "
                    "see export/README.md)"
                )
            )
        try:
            dash = DashConfig.from_model_config(config)
        except DashConfigError as exc:
            raise ModelConfigError(f"{source}: {exc}") from None
        missing = [k for k in cls._REQUIRED if k not in config]
        if missing:
            raise ModelConfigError(f"{source} is missing key(s): {', '.join(missing)}")
        if "index_head_dim" in config and config["index_head_dim"] != dash.sparse_index_dim:
            raise ModelConfigError(
                f"{source}: index_head_dim is {config['index_head_dim']!r}, but "
                f"{CONFIG_SECTION}.sparse_index_dim is {dash.sparse_index_dim} (the indexer's "
                f"width is that key; leave index_head_dim out)"
            )
        values = {k: config[k] for k in cls._FIELDS if k in config}
        extra = {
            k: v for k, v in config.items() if k not in cls._FIELDS and k not in (CONFIG_SECTION, "index_head_dim")
        }
        return cls(dash=dash, extra=extra, **values)

    def replace(self, **changes) -> DashModelConfig:
        """A copy with some fields changed (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)


#: The config.json keys that are fields of DashModelConfig (the others go to ``extra``).
DashModelConfig._FIELDS = frozenset(f.name for f in dataclasses.fields(DashModelConfig)) - {"dash", "extra"}


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


# ------------------------------------------------------------------------ tokenizer
#: Byte-level text tokens are the byte values 0..255; special tokens come from the config.
_SPECIAL = re.compile(r"<PAGE>|<image(?:\*(\d+))?>")


def tokenize(text: str, config: DashModelConfig) -> list[int]:
    """Token ids of ``text``: UTF-8 bytes, with ``<PAGE>`` and ``<image>`` (or
    ``<image*N>`` for N image tokens) as the special tokens."""
    ids: list[int] = []
    pos = 0
    for m in _SPECIAL.finditer(text):
        ids += list(text[pos : m.start()].encode("utf-8"))
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


def document_prompt(
    image_tokens_per_page: Sequence[int], question: str, config: DashModelConfig, preamble: str = ""
) -> list[int]:
    """``preamble <PAGE><image>... <PAGE><image>... question``."""
    pages = "".join(f"<PAGE><image*{n}>" for n in image_tokens_per_page)
    return tokenize(preamble + pages + question, config)


def check_prompts(model: DashModel, seed: int = 0) -> tuple[list[list[int]], list[torch.Tensor | None] | None]:
    """The prompts the export check and ``dash-compare`` run: two document prompts (3 and 2
    pages of 8-47 image tokens each) and, for a model that takes image features, random
    features for the first prompt's image tokens and none for the second's (token embeddings)."""
    cfg = model.config
    gen = torch.Generator().manual_seed(seed)

    def pages(n):
        return [int(x) for x in torch.randint(8, 48, (n,), generator=gen)]

    prompts = [
        document_prompt(pages(3), "Summarise page 2.", cfg, preamble="Doc: "),
        document_prompt(pages(2), "Title?", cfg),
    ]
    if not model.takes_image_features:
        return prompts, None
    n_img = sum(t == cfg.image_token_id for t in prompts[0])
    return prompts, [torch.randn(n_img, cfg.image_feature_dim, generator=gen).to(model.dtype), None]


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


def image_feature_rows(ids: Sequence[int], config: DashModelConfig, num_features: int) -> list[int]:
    """For each token of ``ids``, the row of the sequence's image features it takes: the i-th
    ``<image>`` token row i, every other token -1 (its token embedding). ``num_features`` must
    equal the number of image tokens (a feature for each, in order)."""
    rows, n = [], 0
    for t in ids:
        if t == config.image_token_id:
            rows.append(n)
            n += 1
        else:
            rows.append(-1)
    if n != num_features:
        raise ValueError(
            f"the prompt has {n} image tokens and {num_features} image feature rows: give one row "
            f"per <image> token, in order"
        )
    return rows


# --------------------------------------------------------------------------- models
#: Module-name prefix of model classes loaded from a file (``--model path/file.py:Class``).
USER_MODULE_PREFIX = "dash_trt_user_model_"

#: Entry-point group under which installed packages register DASH model classes by name (the
#: name is the config.json's ``architectures[0]``).
MODEL_ENTRY_POINTS = "dash_trt.models"


def resolve_model_class(spec: str | type | None = None, config: DashModelConfig | None = None) -> type[DashModel]:
    """The model class to build: ``spec`` (a class, ``"package.module:Class"`` or
    ``"path/to/file.py:Class"``), else the class the config's ``architectures[0]`` names
    (``DashForCausalLM``, or one registered under the ``dash_trt.models`` entry points).
    Raises :class:`ModelContractError` with what to do."""
    if isinstance(spec, type):
        cls = spec
    elif spec:
        cls = _import_class(spec)
    else:
        arch = config.architecture if config is not None else ARCHITECTURE
        if arch == ARCHITECTURE:
            return DashForCausalLM
        from importlib.metadata import entry_points

        found = [ep for ep in entry_points(group=MODEL_ENTRY_POINTS) if ep.name == arch]
        if not found:
            raise ModelContractError(
                f"the config names the architecture {arch!r}, which is neither {ARCHITECTURE} nor registered under "
                f"the '{MODEL_ENTRY_POINTS}' entry points: pass the class (dash-export --model module:Class or "
                f"path/to/file.py:Class)"
            )
        cls = found[0].load()
    if not (isinstance(cls, type) and issubclass(cls, DashModel)):
        raise ModelContractError(f"{spec or cls!r} is not a dash_trt.modeling.DashModel subclass (see docs/models.md)")
    return cls


def _import_class(spec: str) -> type:
    import importlib
    import importlib.util

    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ModelContractError(f"--model {spec!r}: expected module:Class or path/to/file.py:Class")
    try:
        if module_name.endswith(".py") or os.sep in module_name:
            path = os.path.abspath(module_name)
            if not os.path.isfile(path):
                raise ModelContractError(f"--model {spec!r}: {module_name} is not a file")
            name = USER_MODULE_PREFIX + re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
            loaded = sys.modules.get(name)
            if loaded is None or getattr(loaded, "__file__", None) != path:
                mod_spec = importlib.util.spec_from_file_location(name, path)
                loaded = importlib.util.module_from_spec(mod_spec)
                sys.modules[name] = loaded
                mod_spec.loader.exec_module(loaded)
            module = loaded
        else:
            module = importlib.import_module(module_name)
    except ModelContractError:
        raise
    except ImportError as exc:
        raise ModelContractError(f"--model {spec!r}: cannot import {module_name}: {exc}") from None
    except Exception as exc:  # the user's module raised while importing
        raise ModelContractError(
            f"--model {spec!r}: importing {module_name} failed: {type(exc).__name__}: {exc}"
        ) from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ModelContractError(f"--model {spec!r}: {module_name} has no {attr}") from None


def model_class_spec(cls: type) -> str:
    """``module:Class`` for a class (what a repository records)."""
    return f"{cls.__module__}:{cls.__qualname__}"


def build_model(config: DashModelConfig, model_class: str | type | None = None) -> DashModel:
    """An untrained model of ``config`` (its class from ``model_class`` or the config), checked
    against the contract (one DashAttention module per layer, sizes as configured)."""
    cls = resolve_model_class(model_class, config)
    try:
        model = cls(config)
    except ModelContractError:
        raise
    except Exception as exc:
        raise ModelContractError(f"{cls.__name__}(config) failed: {type(exc).__name__}: {exc}") from None
    model.dash_layers()
    return model


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


def _init_weights(model: DashModel, gen: torch.Generator) -> None:
    """Random weights with O(1) activations and logits (fan-in scaled), so that greedy
    decoding and top-k routing are not decided by float rounding: norm weights near 1,
    embedding tables and other vectors N(0, 1), biases N(0, 0.1), matrices N(0, 1/fan_in); the
    weights of norms applied as ``1 + weight`` (``zero_centered``, the DASH router's) N(0, 0.1)."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    norm_modules = [
        m for n, m in model.named_modules() if "norm" in type(m).__name__.lower() or "norm" in n.split(".")[-1]
    ]
    norms = {id(p): getattr(m, "zero_centered", False) for m in norm_modules for p in m.parameters(recurse=False)}
    with torch.no_grad():
        for name, p in model.named_parameters():
            kw = {"generator": gen, "device": gen.device, "dtype": torch.float32}
            if id(p) in norms and p.ndim == 1 and not name.endswith("bias"):
                p.copy_((0.0 if norms[id(p)] else 1.0) + 0.1 * torch.randn(p.shape, **kw))
            elif p.ndim == 2 and id(p) not in embeddings:
                p.copy_(torch.randn(p.shape, **kw) / math.sqrt(p.shape[1]))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, **kw))
            else:
                p.copy_(torch.randn(p.shape, **kw))


def random_model(
    config: DashModelConfig | Mapping[str, Any],
    *,
    seed: int = 0,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    model_class: str | type | None = None,
) -> DashModel:
    """A model of ``config`` with random weights (for demos, tests and benchmarks); its class
    from ``model_class`` or the config (:func:`resolve_model_class`). ``device`` builds and
    fills it there (a GPU's generator: other numbers than the CPU's, and seconds instead of
    minutes for a billion-parameter benchmark model)."""
    if not isinstance(config, DashModelConfig):
        config = DashModelConfig.from_dict(config)
    device = torch.device(device) if device is not None else torch.device("cpu")
    dtype = dtype or config.dtype
    with torch.device(device):
        model = build_model(config, model_class).to(dtype)
    _init_weights(model, torch.Generator(device=device).manual_seed(seed))
    return model.eval()


def demo_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> DashModel:
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


def saved_config(model: DashModel) -> dict[str, Any]:
    """The config.json of ``model`` as saved: its dtype and its class's name as the architecture."""
    c = model.config
    return c.replace(
        torch_dtype=next(k for k, v in DTYPES.items() if v == model.dtype),
        extra={**c.extra, "architectures": [type(model).__name__]},
    ).to_dict()


def save_checkpoint(model: DashModel, path: str | os.PathLike, *, config_json: bool = False) -> None:
    """Write ``model.pt`` = ``{"config": ..., "state_dict": ...}`` atomically (and a
    ``config.json`` beside it if asked)."""
    path = os.fspath(path)
    config = saved_config(model)
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    _atomic_write(path, lambda tmp: torch.save({"config": config, "state_dict": state}, tmp))
    if config_json:
        target = os.path.join(os.path.dirname(os.path.abspath(path)), "config.json")

        def dump(tmp: str) -> None:
            with open(tmp, "w", encoding="utf-8") as fh:
                json.dump(config, fh, indent=2)
                fh.write("\n")

        _atomic_write(target, dump)


def save_pretrained(model: DashModel, folder: str | os.PathLike, *, max_shard_bytes: int | None = None) -> list[str]:
    """Write ``model`` as a Hugging Face folder (``config.json`` + safetensors, sharded above
    ``max_shard_bytes``); see :func:`dash_trt.pretrained.save_pretrained`."""
    from . import pretrained as HF

    try:
        return HF.save_pretrained(model, folder, max_shard_bytes=max_shard_bytes)
    except HF.PretrainedError as exc:
        raise CheckpointError(str(exc)) from None


def load_checkpoint(
    path: str | os.PathLike,
    *,
    allow_pickle: bool = False,
    config: DashModelConfig | Mapping[str, Any] | None = None,
    model_class: str | type | None = None,
) -> DashModel:
    """Read a checkpoint: a ``model.pt``; a Hugging Face folder (``config.json`` with
    ``model.safetensors`` or sharded safetensors and their index, :mod:`dash_trt.pretrained`;
    or with a ``model.pt``); or one ``.safetensors`` file with the ``config.json`` beside it.
    ``config`` (a ``config.json`` dict or :class:`DashModelConfig`) overrides the checkpoint's
    own, so a bare state dict plus a ``config.json`` works too. ``model_class`` (a class or
    ``module:Class``) is the model to build, by default the config's architecture
    (:func:`resolve_model_class`).

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
                return load_checkpoint(torch_file, allow_pickle=allow_pickle, config=config, model_class=model_class)
            state, folder_config = HF.read_folder(path)  # or the error that says what is missing
            return _from_state(path, state, config if config is not None else folder_config, model_class)
        if path.endswith(".safetensors"):
            if config is None:
                beside = os.path.join(os.path.dirname(os.path.abspath(path)), HF.CONFIG_FILE)
                if not os.path.isfile(beside):
                    raise CheckpointError(
                        f"{path}: a safetensors file holds no config; put the model's "
                        f"{HF.CONFIG_FILE} beside it or pass it (dash-export --config)"
                    )
                config = load_model_config(beside)
            return _from_state(path, HF.read_safetensors(path), config, model_class)
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
                f"not loaded; do not load it with --unsafe-load (allow_pickle=True), which would make that call"
            ) from None
        found = re.search(r"(?:Unsupported global: GLOBAL|unsupported GLOBAL) ([\w.]+)", str(exc))
        if found:
            raise CheckpointError(
                f"{path} holds pickled Python objects ({found.group(1)}; for example a whole nn.Module), "
                f"which the safe "
                f"loader (torch.load(weights_only=True)) refuses. Save it as "
                f"{{'config': ..., 'state_dict': ...}} (dash_trt.model.save_checkpoint), or, only if you "
                f"trust the file, pass --unsafe-load (allow_pickle=True): unpickling can run arbitrary "
                f"code."
            ) from None
        # Not torch's advice to drop weights_only (that would unpickle untrusted code, and
        # does not mend a damaged file): the unpickler's own reason.
        why = re.search(r"WeightsUnpickler error:\s*(.+?)(?:\n\n|$)", str(exc), re.S)
        raise CheckpointError(
            f"{path} is not a readable PyTorch checkpoint (corrupt or truncated?): "
            f"{' '.join(why.group(1).split()) if why else _first_line(exc)}"
        ) from None
    except Exception as exc:  # zip errors, EOF, bad magic number, ...
        raise CheckpointError(
            f"{path} is not a readable PyTorch checkpoint (corrupt or truncated?): "
            f"{type(exc).__name__}: {_first_line(exc)}"
        ) from None

    if isinstance(obj, DashModel):  # only reachable with allow_pickle
        model = obj
        if config is not None:
            raise CheckpointError(f"{path} holds a whole model; a separate config cannot be applied to it")
        return model.eval()
    if isinstance(obj, nn.Module):
        raise CheckpointError(f"{path} holds a {type(obj).__name__}, not a DashModel (docs/models.md)")
    if not isinstance(obj, Mapping):
        raise CheckpointError(f"{path} holds a {type(obj).__name__}; expected a dict with 'config' and 'state_dict'")
    if "state_dict" in obj:
        state, ckpt_config = obj["state_dict"], obj.get("config")
    elif all(isinstance(v, torch.Tensor) for v in obj.values()) and obj:
        state, ckpt_config = obj, None  # a bare state dict
    else:
        raise CheckpointError(f"{path} has no 'state_dict' entry (keys: {sorted(map(str, obj))[:8]})")
    if config is None:
        if ckpt_config is None:
            raise CheckpointError(f"{path} has no 'config' entry; pass the model's config.json (dash-export --config)")
        config = ckpt_config
    if not isinstance(state, Mapping):
        raise CheckpointError(f"{path}: 'state_dict' is a {type(state).__name__}, expected a dict of tensors")
    return _from_state(path, state, config, model_class)


def _from_state(path: str, state: Mapping[str, torch.Tensor], config, model_class=None) -> DashModel:
    """The model of ``config`` with the weights ``state``, named as the module names them or
    with the class's Hugging Face prefix (``model.`` for :class:`DashForCausalLM`). A tied
    weight (``lm_head.weight`` with tied embeddings) may be absent: the tensor it shares is
    loaded. The dtype is the weights' where they agree, else the config's ``torch_dtype``."""
    from . import pretrained as HF

    if not isinstance(config, DashModelConfig):
        config = DashModelConfig.from_dict(config, source=f"config of {path}")
    nonfinite = [
        k
        for k, v in state.items()
        if isinstance(v, torch.Tensor) and v.is_floating_point() and not bool(torch.isfinite(v).all())
    ]
    if nonfinite:
        raise CheckpointError(
            f"{path}: {len(nonfinite)} weight tensor(s) hold NaN or inf values "
            f"({_few(nonfinite, 3)}); the model would compute NaN logits"
        )
    try:
        model = build_model(config, model_class)
    except ModelContractError as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    expected = model.state_dict()
    try:
        state = HF.match_names(state, set(expected), type(model).checkpoint_prefix)
    except HF.PretrainedError as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    wrong = [
        f"{k} is {list(v.shape)} in the checkpoint, {list(expected[k].shape)} in the model"
        for k, v in state.items()
        if k in expected and isinstance(v, torch.Tensor) and v.shape != expected[k].shape
    ]
    if wrong:
        raise CheckpointError(f"{path}: weights do not match the config: {_few(wrong, 3)}")
    result = model.load_state_dict(state, strict=False)
    shared: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        shared.setdefault(id(p), []).append(name)
    loaded = set(state)
    tied = {n for names in shared.values() if len(names) > 1 and loaded & set(names) for n in names}
    missing = [k for k in result.missing_keys if k not in tied]
    if missing or result.unexpected_keys:
        raise CheckpointError(
            f"{path}: weights do not match the config: missing {_few(missing)}, "
            f"unexpected {_few(result.unexpected_keys)}"
        )
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

    def __init__(self, model: DashModel, num_blocks: int, kv_block_size: int):
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


def generate(
    model: DashModel,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    prefill_chunk: int | None = None,
    kv_block_size: int = 16,
    num_blocks: int | None = None,
    stop_at_eos: bool = True,
    forward: ForwardFn | None = None,
    cuda_graphs: bool | None = None,
    keep_logits: bool = True,
    image_features: Sequence[torch.Tensor | None] | None = None,
) -> Generation:
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
    the chosen rows' logits to the host. ``image_features`` gives each prompt its image
    features ([image tokens, image_feature_dim], or None for token embeddings).
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
    runtime = PagedRuntime(
        model,
        num_blocks,
        kv_block_size,
        forward=forward,
        max_model_len=max(reserve),
        max_num_seqs=len(prompts),
        cuda_graphs=cuda_graphs,
    )
    n = len(prompts)
    feats = list(image_features) if image_features is not None else [None] * n
    if len(feats) != n:
        raise ValueError(f"image_features has {len(feats)} entries for {n} prompts")
    for i, p in enumerate(prompts):
        runtime.add(i, p, reserve[i], image_features=feats[i])
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


def reference_generate(
    model: DashModel,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    stop_at_eos: bool = True,
    image_features: Sequence[torch.Tensor | None] | None = None,
) -> Generation:
    """Step-by-step reference for :func:`generate`: every token re-runs the whole
    sequence through the dense reference attention, no cache."""
    cfg = model.config
    tokens, logits = [], []
    feats = list(image_features) if image_features is not None else [None] * len(prompts)
    for p, f in zip(prompts, feats):
        hist, gen, lg = list(p), [], []
        with torch.no_grad():
            for _ in range(max_new_tokens):
                last = model.reference_logits(hist, len(p), f)[-1].float().cpu()
                tok = _greedy(last, cfg)
                gen.append(tok)
                lg.append(last)
                hist.append(tok)
                if stop_at_eos and tok == cfg.eos_token_id:
                    break
        tokens.append(gen)
        logits.append(torch.stack(lg) if lg else torch.empty(0, cfg.vocab_size))
    return Generation(tokens, logits)
