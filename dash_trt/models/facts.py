"""Size and memory facts of a model, from its config alone (the model is built on the meta
device: nothing is allocated, no weight is read): what ``dash-trt info CHECKPOINT`` prints."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..attention.dash.paged import CACHE_FIELDS
from .config import DTYPES, DashModelConfig, ModelConfigError, load_model_config
from .registry import architecture_name, build_model

__all__ = ["ModelFacts", "model_facts", "read_config"]


@dataclass(frozen=True)
class ModelFacts:
    architecture: str
    layers: int
    dtype: str
    #: every parameter, a tied one once
    parameters: int
    #: parameters one token runs through: all but the routed experts a token does not choose
    #: (n_routed_experts - num_experts_per_tok of them in each MoE layer); embeddings included
    active_parameters: int
    weight_bytes: int
    kv_block_size: int
    #: cache bytes of one token in one layer: keys and values, the DASH index key and image page,
    #: and its share of the sparse-block summaries
    kv_bytes_per_token_per_layer: float
    #: one KV block in every layer's cache
    block_bytes: int
    cache_bytes_by_field: dict[str, int]

    def pool(self, memory_bytes: float, reserve_bytes: float = 0.0) -> tuple[int, int]:
        """(KV blocks, tokens) that ``memory_bytes`` of device memory holds after the weights and
        ``reserve_bytes`` (activations, the CUDA context): 0 blocks when the weights do not fit."""
        blocks = max(0, int((memory_bytes - self.weight_bytes - reserve_bytes) // self.block_bytes))
        return blocks, blocks * self.kv_block_size

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def read_config(path: str | os.PathLike) -> DashModelConfig:
    """The config of a checkpoint folder, a ``config.json``, or a ``model.pt`` (its ``config``
    entry, read with ``torch.load(weights_only=True)``)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        return load_model_config(os.path.join(path, "config.json"))
    if path.endswith(".json"):
        return load_model_config(path)
    if not os.path.isfile(path):
        raise ModelConfigError(f"checkpoint not found: {path}")
    try:
        obj = torch.load(path, map_location="meta", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any failure means the file is not a model.pt
        raise ModelConfigError(f"{path} is not a readable model.pt: {type(exc).__name__}: {exc}") from None
    config = obj.get("config") if isinstance(obj, dict) else None
    if not isinstance(config, dict):
        raise ModelConfigError(f"{path} holds no 'config' entry; pass its config.json instead")
    return DashModelConfig.from_dict(json.loads(json.dumps(config)), source=path)


def model_facts(
    config: DashModelConfig,
    *,
    dtype: torch.dtype | None = None,
    kv_block_size: int = 16,
    model_class: str | type | None = None,
) -> ModelFacts:
    """The facts of ``config``'s model (its class from ``model_class`` or the config) in ``dtype``
    (default: the config's ``torch_dtype``) with KV blocks of ``kv_block_size`` tokens."""
    dtype = dtype or config.dtype
    with torch.device("meta"):
        model = build_model(config, model_class).to(dtype)
    params = sum(p.numel() for p in model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    idle = sum(m.unchosen_parameters() for m in model.modules() if hasattr(m, "unchosen_parameters"))
    caches = model.allocate_cache(1, kv_block_size, device="meta")
    by_field = {f: sum(getattr(c, f).numel() * getattr(c, f).element_size() for c in caches) for f in CACHE_FIELDS}
    block = sum(by_field.values())
    return ModelFacts(
        architecture=architecture_name(type(model)),
        layers=config.num_hidden_layers,
        dtype=next(k for k, v in DTYPES.items() if v == dtype),
        parameters=params,
        active_parameters=params - idle,
        weight_bytes=weight_bytes,
        kv_block_size=kv_block_size,
        kv_bytes_per_token_per_layer=block / kv_block_size / config.num_hidden_layers,
        block_bytes=block,
        cache_bytes_by_field=by_field,
    )
