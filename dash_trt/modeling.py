"""Putting DASH attention into any decoder: the drop-in :class:`DashAttention` module, the
per-pass :class:`DashContext`, and the :class:`DashModel` base class that defines the model
contract every tool (``dash-export``, the ONNX check, ``dash-compare``, ``dash-triton``, the
serving runtime) relies on.

The contract (``docs/models.md`` has a worked example). A model is a subclass of
:class:`DashModel` whose constructor takes its :class:`~dash_trt.model.DashModelConfig` (the
``config.json``: the usual Hugging Face keys, a ``sparse_attention_config`` section, and any
keys of the model's own, kept in ``config.extra``) and which implements:

- ``embed_input_ids(input_ids [T] int64) -> [T, H]``: the token embeddings;
- ``forward(inputs_embeds [T, H], dash: DashContext) -> hidden [T, H]``: the decoder body,
  in which each DASH layer calls its :class:`DashAttention` module with ``dash``;
- ``compute_logits(hidden [N, H]) -> logits [N, vocab]`` (final norm and output head);
- optionally ``embed_image_features(features [M, F]) -> [M, H]``: a vision projection for
  models whose config sets ``image_feature_dim`` (the default passes features of the hidden
  size through).

The model has exactly ``num_hidden_layers`` :class:`DashAttention` modules, with layer
indices ``0 .. num_hidden_layers - 1``; each is called once per pass. Everything else (names
of parameters, biases, the MLP, norms, tied embeddings) is the model's own. The tools never
call ``forward`` with anything but a :class:`DashContext`: the same model code runs

- exported (:meth:`DashModel.export_forward`, the flat functional signature of the ONNX
  graph: caches in, updated caches out, :data:`dash_trt.model.MODEL_INPUTS`),
- served (:meth:`DashModel.forward_paged`: the paged caches written in place),
- as the dense reference (:meth:`DashModel.reference_logits`: whole sequences, no cache).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .attention.dash import attributes as A
from .attention.dash.config import DashConfig
from .attention.dash.ops import CACHE_FIELDS, paged_attention, paged_attention_inplace
from .attention.dash.paged import DashBatch, DashKVCache, PageCoordState, TextCoordState
from .attention.dash.reference import ROLE_IMAGE, ROLE_PAGE, ROLE_TEXT, dash_attention

__all__ = [
    "token_role",
    "token_roles",
    "prompt_coordinates",
    "image_feature_rows",
    "DashAttention",
    "DashContext",
    "DashModel",
    "DashRouter",
    "RouterNorm",
    "ModelContractError",
    "merge_image_features",
    "MODEL_INPUTS",
    "IMAGE_INPUTS",
]

EXPORT, PAGED, REFERENCE = "export", "paged", "reference"

#: Names of the forward pass's non-cache inputs, in order (also the ONNX input names).
#: ``logits_indices`` [N] int64 are the rows of the new tokens to score (vLLM's logits
#: indices: the last token of each sequence that samples), so no runtime materialises
#: [T, vocab] logits for prefill chunks; ``torch.arange(T)`` scores every token.
MODEL_INPUTS = ("input_ids", "coords", "block_tables", "seq_lens", "query_start_loc", "prompt_lens", "logits_indices")
#: The inputs that follow MODEL_INPUTS in a model that takes image features (config
#: ``image_feature_dim``): ``image_features`` [M, image_feature_dim] (model dtype), and
#: ``image_feature_index`` [T] int64, for each new token its row of ``image_features`` or -1
#: (embedded from the token table).
IMAGE_INPUTS = ("image_features", "image_feature_index")


def token_role(token: int, config: Any) -> int:
    """The role of one token id (:func:`token_roles` for one token; ``config`` a model config)."""
    return ROLE_PAGE if token == config.page_token_id else ROLE_IMAGE if token == config.image_token_id else ROLE_TEXT


def token_roles(ids: Sequence[int] | torch.Tensor, config: Any) -> torch.Tensor:
    """Roles [S] (text 0, image 1, ``<PAGE>`` 2) of token ids."""
    ids = torch.as_tensor(ids, dtype=torch.long)
    roles = torch.full_like(ids, ROLE_TEXT)
    roles[ids == config.image_token_id] = ROLE_IMAGE
    roles[ids == config.page_token_id] = ROLE_PAGE
    return roles


def prompt_coordinates(ids: Sequence[int] | torch.Tensor, config: Any):
    """``(state, coords [S, 4] int32)`` of a prompt: its page coordinates and the state that
    continues them (:class:`~dash_trt.attention.dash.paged.PageCoordState`, which checks the pages), or, for a
    model without document pages (its config's ``page_token_id`` is None), token positions
    (:class:`~dash_trt.attention.dash.paged.TextCoordState`)."""
    if getattr(config, "page_token_id", None) is None:
        return TextCoordState.from_length(len(ids))
    return PageCoordState.from_prompt(token_roles(ids, config))


def image_feature_rows(ids: Sequence[int], config: Any, num_features: int) -> list[int]:
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


class ModelContractError(ValueError):
    """A model does not follow the contract (the message names what is wrong)."""


class DashContext:
    """What one forward pass needs besides the token embeddings: the step's batch metadata
    and the caches (or, for the dense reference, the token roles). Built by the tools, passed
    unchanged to every layer; a layer hands it to its :class:`DashAttention` module.

    Modes: ``export`` (caches in, updated caches collected in :attr:`new_caches`), ``paged``
    (caches written in place), ``reference`` (whole sequence, no cache)."""

    def __init__(
        self,
        mode: str,
        num_layers: int,
        *,
        coords: torch.Tensor | None = None,
        meta: Sequence[torch.Tensor] = (),
        caches: Sequence[Any] = (),
        batch: DashBatch | None = None,
        roles: torch.Tensor | None = None,
        prompt_length: int | None = None,
    ):
        self.mode = mode
        self.num_layers = int(num_layers)
        self.coords = coords
        self.meta = tuple(meta)  # block_tables, seq_lens, query_start_loc, prompt_lens (export)
        self.caches = list(caches)  # per layer: six tensors (export) or a DashKVCache (paged)
        self.batch = batch
        self.roles = roles
        self.prompt_length = prompt_length
        self.new_caches: list[tuple[torch.Tensor, ...] | None] = [None] * self.num_layers
        self.called = [False] * self.num_layers

    @classmethod
    def export(
        cls,
        coords,
        block_tables,
        seq_lens,
        query_start_loc,
        prompt_lens,
        flat_caches: Sequence[torch.Tensor],
        num_layers: int,
    ) -> DashContext:
        n = len(CACHE_FIELDS)
        if len(flat_caches) != n * num_layers:
            raise ValueError(f"expected {n * num_layers} cache tensors ({n} per layer), got {len(flat_caches)}")
        per_layer = [tuple(flat_caches[n * i : n * (i + 1)]) for i in range(num_layers)]
        return cls(
            EXPORT,
            num_layers,
            coords=coords,
            meta=(block_tables, seq_lens, query_start_loc, prompt_lens),
            caches=per_layer,
        )

    @classmethod
    def paged(cls, coords, batch: DashBatch, caches: Sequence[DashKVCache]) -> DashContext:
        return cls(PAGED, len(caches), coords=coords, batch=batch, caches=caches)

    @classmethod
    def reference(cls, roles: torch.Tensor, prompt_length: int | None, num_layers: int) -> DashContext:
        return cls(REFERENCE, num_layers, roles=roles, prompt_length=prompt_length)

    def attend(self, module: DashAttention, q, k, v, iq, ik, head_cls) -> torch.Tensor:
        i = module.layer_idx
        if not 0 <= i < self.num_layers:
            raise ModelContractError(
                f"DashAttention layer_idx {i} is outside 0..{self.num_layers - 1} (the "
                f"config's num_hidden_layers is {self.num_layers})"
            )
        if self.called[i]:
            raise ModelContractError(
                f"DashAttention layer {i} was called twice in one pass: each layer index "
                f"must belong to one module, called once"
            )
        self.called[i] = True
        if self.mode == EXPORT:
            out, new = paged_attention(
                q, k, v, iq, ik, self.coords, head_cls, self.caches[i], *self.meta, module.dash, i
            )
            self.new_caches[i] = new
            return out
        if self.mode == PAGED:
            return paged_attention_inplace(
                q, k, v, iq, ik, self.coords, head_cls, self.caches[i], self.batch, module.dash, i, attrs=module.attrs()
            )
        return dash_attention(q, k, v, iq, ik, self.roles, head_cls, module.dash, i, self.prompt_length)

    def check_complete(self) -> None:
        missing = [i for i, c in enumerate(self.called) if not c]
        if missing:
            raise ModelContractError(
                f"the forward pass never called DashAttention layer(s) {missing[:8]}: the "
                f"model must call every layer's DashAttention module once"
            )


class RouterNorm(nn.Module):
    """The DASH router's RMS norm, Gemma-style, as Unlimited-OCR-2 has it: float32, non-finite
    inputs set to 0, ``x * rsqrt(mean(x^2) + eps)`` clamped to +-1e4, times ``1 + weight``
    (the weight starts at zero), clamped again, back to the input's dtype."""

    #: The weight is an offset from 1 (random initialisation draws it around 0, not around 1).
    zero_centered = True

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nan_to_num(x.float(), nan=0.0, posinf=0.0, neginf=0.0)
        y = y * torch.rsqrt(y.square().mean(-1, keepdim=True) + self.eps)
        # NOTE: +-1e4 before and after the weight, as the checkpoint was trained.
        y = y.clamp(-1e4, 1e4) * (1 + self.weight.float())
        return y.clamp(-1e4, 1e4).to(x.dtype)


class DashRouter(nn.Module):
    """Unlimited-OCR-2's per-layer DASH router: the indexer's query and key projections
    (``q_proj``, ``k_proj``: hidden -> ``sparse_index_dim``, no bias), a :class:`RouterNorm` on
    each (``q_norm``, ``k_norm``) and the learned block-summary query ``head_cls`` [index_dim].
    The names are the checkpoint's (``...self_attn.dash_router.q_proj.weight``, ...,
    ``...self_attn.dash_router.head_cls``). It reads the same normalised hidden state as the
    layer's q/k/v projections; ``router(x)`` returns ``(iq, ik)`` for :class:`DashAttention`,
    with ``router.head_cls``."""

    def __init__(self, hidden_size: int, index_dim: int, eps: float):
        super().__init__()
        self.q_proj = nn.Linear(hidden_size, index_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, index_dim, bias=False)
        self.q_norm = RouterNorm(index_dim, eps)
        self.k_norm = RouterNorm(index_dim, eps)
        self.head_cls = nn.Parameter(torch.zeros(index_dim))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
        return self.q_norm(self.q_proj(x)), self.k_norm(self.k_proj(x))


class DashAttention(nn.Module):
    """DASH attention of one layer, as a drop-in for a decoder's attention core.

    It owns the layer's DASH configuration and index and no weights: the model computes the
    projections (with whatever names, biases or norms it has) and calls
    ``attn(q, k, v, iq, ik, head_cls, dash)`` with ``q`` [T, heads, head_dim], ``k``/``v`` [T,
    kv_heads, head_dim], the indexer's ``iq``/``ik`` [T, index_head_dim] and its learned
    ``head_cls`` [index_head_dim] (Unlimited-OCR-2's :class:`DashRouter` computes the three);
    it returns the attention output [T, heads, head_dim]. RoPE (token and page coordinates) is
    applied inside, from the context's coordinates.

    ``config`` is the model's :class:`~dash_trt.model.DashModelConfig` (the sizes come from it)
    or a :class:`~dash_trt.attention.dash.config.DashConfig` with the sizes given explicitly.
    """

    def __init__(
        self,
        config: Any,
        layer_idx: int,
        *,
        num_heads: int | None = None,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        index_head_dim: int | None = None,
    ):
        super().__init__()
        model_config = None if isinstance(config, DashConfig) else config
        self.dash: DashConfig = config if model_config is None else model_config.dash

        def size(given, key):
            if given is not None:
                return int(given)
            if model_config is None:
                raise ModelContractError(f"DashAttention with a DashConfig needs {key}= (or pass the model config)")
            return int(getattr(model_config, key))

        self.layer_idx = int(layer_idx)
        self.num_heads = size(num_heads, "num_attention_heads")
        self.num_kv_heads = size(num_kv_heads, "num_key_value_heads")
        self.head_dim = size(head_dim, "head_dim")
        self.index_head_dim = size(index_head_dim, "index_head_dim")
        if self.num_heads % self.num_kv_heads:
            raise ModelContractError(
                f"DashAttention layer {layer_idx}: {self.num_heads} heads are not a multiple "
                f"of {self.num_kv_heads} KV heads"
            )
        self._attrs: dict | None = None

    def attrs(self) -> dict:
        """The op's encoded configuration (built once)."""
        if self._attrs is None:
            self._attrs = A.encode(self.dash, self.layer_idx)
        return self._attrs

    def forward(self, q, k, v, iq, ik, head_cls, dash: DashContext) -> torch.Tensor:
        if not isinstance(dash, DashContext):
            raise ModelContractError(
                f"DashAttention layer {self.layer_idx} needs the DashContext the tools pass "
                f"to the model's forward, got {type(dash).__name__}"
            )
        t = q.shape[0]
        want = {
            "q": (q, (t, self.num_heads, self.head_dim)),
            "k": (k, (t, self.num_kv_heads, self.head_dim)),
            "v": (v, (t, self.num_kv_heads, self.head_dim)),
            "iq": (iq, (t, self.index_head_dim)),
            "ik": (ik, (t, self.index_head_dim)),
            "head_cls": (head_cls, (self.index_head_dim,)),
        }
        for name, (x, shape) in want.items():
            if x.dim() != len(shape) or any(isinstance(a, int) and a != b for a, b in zip(x.shape, shape)):
                raise ModelContractError(
                    f"DashAttention layer {self.layer_idx}: {name} is {list(x.shape)}, "
                    f"expected {list(shape)} (T, heads, head_dim as configured)"
                )
        # One float type for the node's activations (the ONNX schema's T; the TensorRT plugin
        # reads head_cls in q's type): a model keeping head_cls in another dtype is cast here.
        return dash.attend(self, q, k, v, iq, ik, head_cls.to(q.dtype))

    def extra_repr(self) -> str:
        return (
            f"layer_idx={self.layer_idx}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, index_head_dim={self.index_head_dim}"
        )


def merge_image_features(embeds: torch.Tensor, features: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``embeds`` [T, H] with row t replaced by ``features[index[t]]`` where ``index[t] >= 0``
    (``-1``: keep the token embedding). No host synchronisation and no data-dependent shape,
    so it exports to ONNX and runs in CUDA graphs; ``features`` may have 0 rows."""
    table = torch.cat([features.new_zeros(1, features.shape[1]), features.to(embeds.dtype)])
    rows = torch.index_select(table, 0, (index + 1).clamp(min=0))
    return torch.where((index >= 0).unsqueeze(-1), rows, embeds)


class DashModel(nn.Module):
    """Base class of DASH decoders: the model contract (module docstring) plus the toolkit's
    entry points built on it. Subclasses implement ``embed_input_ids``, ``forward`` and
    ``compute_logits`` (and ``embed_image_features`` to project image features)."""

    #: Prefix of the Hugging Face checkpoint names for this class's own names ("" : the same).
    checkpoint_prefix = ""
    #: Checkpoint tensors that are not this class's (regular expressions, searched in the
    #: checkpoint's names): dropped when loading instead of being reported as unexpected.
    checkpoint_ignore: tuple[str, ...] = ()
    #: The ``architectures[0]`` a saved config.json names (None: the class's name).
    architecture_name: str | None = None

    def __init__(self, config):
        super().__init__()
        self.config = config

    # ------------------------------------------------------------ the contract
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must implement embed_input_ids(input_ids) -> [T, H]")

    def forward(self, inputs_embeds: torch.Tensor, dash: DashContext) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must implement forward(inputs_embeds, dash) -> hidden")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must implement compute_logits(hidden) -> logits")

    def embed_image_features(self, features: torch.Tensor) -> torch.Tensor:
        """Image features [M, image_feature_dim] as decoder inputs [M, hidden_size]. The default
        passes features of the hidden size through (a vision encoder that already projects)."""
        if features.shape[-1] != self.config.hidden_size:
            raise ModelContractError(
                f"{type(self).__name__} takes image features of {self.config.hidden_size} "
                f"values (hidden_size), got {features.shape[-1]}; implement "
                f"embed_image_features to project them"
            )
        return features

    # --------------------------------------------------------------- toolkit
    @property
    def dtype(self) -> torch.dtype:
        return next(p.dtype for p in self.parameters() if p.is_floating_point())

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def takes_image_features(self) -> bool:
        return self.config.image_feature_dim is not None

    def input_names(self) -> tuple[str, ...]:
        """The exported graph's inputs before the caches."""
        return MODEL_INPUTS + (IMAGE_INPUTS if self.takes_image_features else ())

    def dash_layers(self) -> list[DashAttention]:
        """The :class:`DashAttention` modules by layer index (checked against the config)."""
        found = [m for m in self.modules() if isinstance(m, DashAttention)]
        n = self.config.num_hidden_layers
        idx = sorted(m.layer_idx for m in found)
        if idx != list(range(n)):
            raise ModelContractError(
                f"{type(self).__name__} has DashAttention modules with layer indices {idx[:12]}, the config's "
                f"num_hidden_layers is {n}: expected exactly one module for each of 0..{n - 1}"
            )
        c = self.config
        for m in found:
            got = (m.num_heads, m.num_kv_heads, m.head_dim, m.index_head_dim)
            want = (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.index_head_dim)
            if got != want:
                raise ModelContractError(
                    f"DashAttention layer {m.layer_idx} has heads, kv_heads, head_dim, index_head_dim {got}; the "
                    f"config says {want} (the caches and kernels are sized from the config)"
                )
        return sorted(found, key=lambda m: m.layer_idx)

    def cache_names(self, prefix: str) -> list[str]:
        """Flat names of the cache tensors (``{prefix}.{layer}.{field}``)."""
        return [f"{prefix}.{i}.{f}" for i in range(self.config.num_hidden_layers) for f in CACHE_FIELDS]

    def input_embeddings(
        self,
        input_ids: torch.Tensor,
        image_features: torch.Tensor | None = None,
        image_feature_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token embeddings, with image features put at the rows ``image_feature_index`` names."""
        x = self.embed_input_ids(input_ids)
        if image_features is not None and image_feature_index is not None:
            feats = self.embed_image_features(image_features.to(x.dtype))
            x = merge_image_features(x, feats, image_feature_index)
        return x

    def export_forward(
        self, input_ids, coords, block_tables, seq_lens, query_start_loc, prompt_lens, logits_indices, *rest
    ):
        """The exported graph's function: ``(logits [N, vocab] float32, *new caches)``. ``rest``
        is the caches, preceded by ``image_features, image_feature_index`` when the model takes
        image features (:attr:`takes_image_features`)."""
        feats = index = None
        if self.takes_image_features:
            feats, index, *rest = rest
        ctx = DashContext.export(
            coords, block_tables, seq_lens, query_start_loc, prompt_lens, rest, self.config.num_hidden_layers
        )
        hidden = self(self.input_embeddings(input_ids, feats, index), ctx)
        ctx.check_complete()
        return (self.logits(hidden, logits_indices), *[t for c in ctx.new_caches for t in c])

    def logits(self, hidden: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        """Float32 logits of the rows ``logits_indices`` of the last hidden states."""
        return self.compute_logits(torch.index_select(hidden, 0, logits_indices)).float()

    def forward_paged(
        self,
        input_ids: torch.Tensor,
        coords: torch.Tensor,
        batch: DashBatch,
        caches: Sequence[DashKVCache],
        logits_indices: torch.Tensor,
        image_features: torch.Tensor | None = None,
        image_feature_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The forward pass with every layer's cache written in place (the serving form of
        :meth:`export_forward`): the same ``batch`` for every layer, no copy of the pool, no
        host synchronisation on the CUDA kernels. Returns the logits [N, vocab] (float32)."""
        if len(caches) != self.config.num_hidden_layers:
            raise ValueError(f"expected {self.config.num_hidden_layers} layer caches, got {len(caches)}")
        ctx = DashContext.paged(coords, batch, caches)
        hidden = self(self.input_embeddings(input_ids, image_features, image_feature_index), ctx)
        return self.logits(hidden, logits_indices)

    def reference_logits(
        self,
        ids: Sequence[int] | torch.Tensor,
        prompt_length: int | None = None,
        image_features: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [S, vocab] of a whole sequence without a cache (dense reference attention,
        :func:`dash_trt.attention.dash.reference.dash_attention`); ``image_features`` [M, F] go to the
        sequence's image tokens in order (all of them, or none)."""
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.device)
        roles = token_roles(ids.cpu(), self.config).to(self.device)
        index = None
        if image_features is not None:
            index = torch.as_tensor(
                image_feature_rows(ids.cpu().tolist(), self.config, len(image_features)), device=self.device
            )
            image_features = image_features.to(self.device)
        ctx = DashContext.reference(roles, prompt_length, self.config.num_hidden_layers)
        hidden = self(self.input_embeddings(ids, image_features, index), ctx)
        ctx.check_complete()
        return self.compute_logits(hidden).float()

    def prefix_cacheable(self, kv_block_size: int) -> bool:
        """Whether completed prompt blocks of this size may be shared between requests: a KV
        block must hold whole sparse blocks, whose summaries are then final."""
        return kv_block_size % self.config.dash.sparse_block_size == 0

    def prefix_hash_seed(self, prompt_length: int) -> bytes:
        """What a cached prompt block depends on besides the tokens up to it (nothing here: the
        page coordinates of the cacheable blocks follow from those tokens)."""
        return b""

    def allocate_cache(
        self, num_blocks: int, kv_block_size: int, device: str | torch.device | None = None
    ) -> list[DashKVCache]:
        """One :class:`DashKVCache` per layer (on the model's device unless ``device``)."""
        c = self.config
        return [
            DashKVCache.allocate(
                num_blocks,
                kv_block_size,
                c.num_key_value_heads,
                c.head_dim,
                c.index_head_dim,
                c.dash.sparse_block_size,
                dtype=self.dtype,
                device=self.device if device is None else device,
            )
            for _ in range(c.num_hidden_layers)
        ]


class ExportGraph(nn.Module):
    """The module ``torch.onnx.export`` traces: ``forward`` is :meth:`DashModel.export_forward`
    (its parameters keep the model's names under ``model.``)."""

    def __init__(self, model: DashModel):
        super().__init__()
        self.model = model

    def forward(self, input_ids, coords, block_tables, seq_lens, query_start_loc, prompt_lens, logits_indices, *rest):
        return self.model.export_forward(
            input_ids, coords, block_tables, seq_lens, query_start_loc, prompt_lens, logits_indices, *rest
        )
