"""Prompts of a DASH decoder: the byte-level tokenizer of the demo model, document prompts
(``<PAGE>`` markers and ``<image>`` tokens), token roles and image-feature rows."""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch

from .config import DashModelConfig

__all__ = [
    "tokenize",
    "detokenize",
    "document_prompt",
    "check_prompts",
]


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


def check_prompts(model: torch.nn.Module, seed: int = 0) -> tuple[list[list[int]], list[torch.Tensor | None] | None]:
    """The prompts the export check and ``dash-compare`` run for ``model`` (a
    :class:`~dash_trt.modeling.DashModel`): two document prompts (3 and 2
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
