"""Random-weight Unlimited-OCR-2 checkpoint folders in the published layout, for tests and
``scripts/make_tiny_unlimited_ocr2.py``: the decoder and a tiny vision tower in sharded
safetensors with their index, and a trained tiny tokenizer. Above the checkpoint IO and the
registry it uses (it is not imported by them)."""

from __future__ import annotations

import json
import os

import torch

from .checkpoint import save_pretrained
from .config import LANGUAGE_SECTION
from .deepencoder import DeepEncoderConfig, VisionTower
from .registry import init_weights, random_model
from .unlimited_ocr2 import TINY_SPECIAL_TOKENS, tiny_config, tiny_tokenizer

__all__ = ["write_tiny_checkpoint"]


def write_tiny_checkpoint(folder, *, seed: int = 0, max_shard_bytes: int | None = 400_000, **config) -> list[str]:
    """A random-weight checkpoint folder in the published layout: :func:`tiny_config` (``config``
    passed on), the decoder and a tiny vision tower in sharded safetensors with their index, and
    the tokenizer (``tokenizer.json`` and ``tokenizer_config.json``). Returns the files written."""
    raw = tiny_config(**config)
    model = random_model(raw, seed=seed)
    tower = VisionTower(DeepEncoderConfig.from_config(raw))
    init_weights(tower, torch.Generator().manual_seed(seed + 1))
    extra = {"model." + k: v for k, v in tower.state_dict().items()}
    files = save_pretrained(model, folder, max_shard_bytes=max_shard_bytes, extra_tensors=extra)
    tok = tiny_tokenizer(raw[LANGUAGE_SECTION]["vocab_size"])
    tok.save(os.path.join(folder, "tokenizer.json"))
    bos, eos = TINY_SPECIAL_TOKENS[:2]
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as fh:
        json.dump({"bos_token": bos, "eos_token": eos, "tokenizer_class": "LlamaTokenizerFast"}, fh, indent=2)
    return files + ["tokenizer.json", "tokenizer_config.json"]
