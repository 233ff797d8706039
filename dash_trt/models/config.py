"""A DASH decoder's ``config.json`` (Hugging Face style): :class:`DashModelConfig`.

The usual Hugging Face keys, the ``sparse_attention_config`` section (a
:class:`~dash_trt.attention.dash.config.DashConfig`, Unlimited-OCR-2's schema), and any keys of the model's
own, kept in :attr:`DashModelConfig.extra`.

Two layouts are read. Flat: the decoder's keys at the top (``vocab_size``, ``hidden_size``,
...), as ``transformers`` writes a causal LM. Nested (DeepSeek-VL2 style, the Unlimited-OCR
family): the language model's keys in a ``language_config`` section beside ``vision_config``
and ``projector_config``, with ``sparse_attention_config`` and ``rswa_window`` at the top; there
``head_dim`` is ``hidden_size / num_attention_heads`` and the image features a request carries
are the projector's output, ``hidden_size`` values a row. Either layout is written back as it
was read.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..attention.dash.config import CONFIG_SECTION, DashConfig, DashConfigError, missing_section_message
from ..attention.errors import ModelConfigError  # defined below the attention families, which use it

__all__ = [
    "DashModelConfig",
    "ModelConfigError",
    "TokenIdModelError",
    "load_model_config",
    "DTYPES",
    "ARCHITECTURE",
    "MODEL_TYPE",
]


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


ARCHITECTURE = "DashForCausalLM"


MODEL_TYPE = "dash_decoder"


#: The language model's section of a nested (DeepSeek-VL2 style) config.json.
LANGUAGE_SECTION = "language_config"


#: The section a Dual Chunk Attention (Qwen) model's config.json carries instead of DASH's.
DCA_SECTION = "dual_chunk_attention_config"


class TokenIdModelError(ModelConfigError):
    """The config describes a Dual Chunk Attention text model: one that takes and returns token
    ids, not a DASH document model (no pages, no images, no tokenizer here)."""


def token_id_model_message(source: str) -> str:
    return (
        f"{source} describes a Dual Chunk Attention text model ('{DCA_SECTION}'), not a DASH document "
        f"model: it takes and returns token ids (no documents, images or text prompts); send it token "
        f"ids through its Triton service (dash-triton write, then dash-client --ids; docs/dca_model.md)"
    )


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
    #: Tokens of generated text that a generated token attends to besides the prompt (vLLM's
    #: R-SWA ``rswa_window``): None or the local window (``sparse_local_block x
    #: sparse_block_size``): each sequence's prompt length is passed to DASH attention, so
    #: remote reads stop at the prompt and generated tokens are read through the local window
    #: only; 0: no prompt length is passed (every past token may be routed to).
    rswa_window: int | None = None
    #: Every other key of the config.json (a user's model reads its own keys here; a nested
    #: config's ``language_config`` section is here too).
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
        window = self.dash.sparse_local_block * self.dash.sparse_block_size
        if self.rswa_window not in (None, 0, window) or isinstance(self.rswa_window, bool):
            raise ModelConfigError(
                f"rswa_window must be unset, 0 (no prompt length: generated tokens may be routed to) or "
                f"{window} (sparse_local_block x sparse_block_size), got {self.rswa_window!r}"
            )

    def prompt_length(self, prompt_tokens: int) -> int | None:
        """The ``prompt_length`` DASH attention gets for a prompt of ``prompt_tokens`` tokens
        (:attr:`rswa_window`): the prompt's length, or None when ``rswa_window`` is 0."""
        return None if self.rswa_window == 0 else int(prompt_tokens)

    @property
    def nested(self) -> bool:
        """Read from (and written as) a nested, DeepSeek-VL2-style config.json."""
        return isinstance(self.extra.get(LANGUAGE_SECTION), Mapping)

    @property
    def language(self) -> Mapping[str, Any]:
        """The ``language_config`` section of a nested config (empty for a flat one)."""
        section = self.extra.get(LANGUAGE_SECTION)
        return section if isinstance(section, Mapping) else {}

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
        """A config.json key: a field of this class, else one of :attr:`extra`, else one of the
        :attr:`language` section's."""
        if key in self._FIELDS:
            return getattr(self, key)
        if key in self.extra:
            return self.extra[key]
        return self.language.get(key, default)

    def to_dict(self) -> dict[str, Any]:
        """The ``config.json`` content, in the layout it was read in."""
        if self.nested:
            out = dict(self.extra)
            lang = dict(self.language)
            for name in _LANGUAGE_KEYS:
                value = getattr(self, name)
                if name == "head_dim" and value == self.hidden_size // self.num_attention_heads:
                    lang.pop(name, None)  # derived, as the nested layout has it
                    continue
                lang[name] = value
            out[LANGUAGE_SECTION] = lang
            if self.rswa_window is not None:
                out["rswa_window"] = self.rswa_window
            out[CONFIG_SECTION] = self.dash.to_dict()
            return out
        builtin = self.architecture == ARCHITECTURE
        out: dict[str, Any] = {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE} if builtin else {}
        out.update(self.extra)
        for f in dataclasses.fields(self):
            if f.name not in ("dash", "extra") and not (
                f.name in ("image_feature_dim", "rswa_window") and getattr(self, f.name) is None
            ):
                out[f.name] = getattr(self, f.name)
        out[CONFIG_SECTION] = self.dash.to_dict()
        return out

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], *, source: str = "model config") -> DashModelConfig:
        if not isinstance(config, Mapping):
            raise ModelConfigError(f"{source} must be a JSON object, got {type(config).__name__}")
        if CONFIG_SECTION not in config and isinstance(config.get(DCA_SECTION), Mapping):
            raise TokenIdModelError(token_id_model_message(source))
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
        if isinstance(config.get(LANGUAGE_SECTION), Mapping):
            return cls._from_nested(config, dash, source)
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

    @classmethod
    def _from_nested(cls, config: Mapping[str, Any], dash: DashConfig, source: str) -> DashModelConfig:
        lang = config[LANGUAGE_SECTION]
        where = f"{source}: {LANGUAGE_SECTION}"
        required = [k for k in cls._REQUIRED if k not in ("head_dim",)]
        missing = [k for k in required if k not in lang]
        if missing:
            raise ModelConfigError(f"{where} is missing key(s): {', '.join(missing)}")
        values = {k: lang[k] for k in _LANGUAGE_KEYS if k in lang}
        values.setdefault("num_key_value_heads", lang["num_attention_heads"])
        heads, hidden = lang["num_attention_heads"], lang["hidden_size"]
        if "head_dim" not in values:
            if not (isinstance(heads, int) and isinstance(hidden, int) and heads > 0 and hidden % heads == 0):
                raise ModelConfigError(
                    f"{where}: hidden_size ({hidden!r}) must be a multiple of num_attention_heads ({heads!r})"
                )
            values["head_dim"] = hidden // heads
        if "eos_token_id" not in values and isinstance(config.get("eos_token_id"), int):
            values["eos_token_id"] = config["eos_token_id"]
        if "torch_dtype" not in values:  # transformers 5 writes "dtype"; the top level may carry it
            found = [d.get(k) for d in (lang, config) for k in ("dtype", "torch_dtype") if d.get(k) in DTYPES]
            if found:
                values["torch_dtype"] = found[0]
        extra = {k: v for k, v in config.items() if k not in (CONFIG_SECTION, "rswa_window")}
        return cls(
            dash=dash,
            extra=extra,
            image_feature_dim=hidden if isinstance(hidden, int) else None,
            rswa_window=config.get("rswa_window"),
            **values,
        )

    def replace(self, **changes) -> DashModelConfig:
        """A copy with some fields changed (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)


#: The config.json keys that are fields of DashModelConfig (the others go to ``extra``).
DashModelConfig._FIELDS = frozenset(f.name for f in dataclasses.fields(DashModelConfig)) - {"dash", "extra"}

#: The fields a nested config keeps in its ``language_config`` section.
_LANGUAGE_KEYS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "rms_norm_eps",
    "tie_word_embeddings",
    "eos_token_id",
    "torch_dtype",
)


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
