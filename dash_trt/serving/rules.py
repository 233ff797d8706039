"""Decoding rules for long documents, as per-request logits processors: the page-count guard and
the windowed no-repeat n-gram rule of Unlimited-OCR-2's recipe.

Each rule edits one sequence's float32 logits row on the host, in place, before its token is
chosen (greedy or sampled), given the tokens the sequence has generated so far:

- :class:`PageCountGuard` (vLLM 0.34.0 ``models/unlimited_ocr2.py``, ``PageCountGuard``): the
  answer must hold exactly one ``<PAGE>`` marker for each one of the prompt. While fewer have
  been generated, EOS is masked (a page cannot end the answer early) unless nothing else is
  finite; once the count is reached EOS is allowed, and one marker too many forces EOS; a page
  (the tokens since the last marker) reaching ``max_page_tokens`` forces ``<PAGE>`` (or EOS on
  the last page). A forced token keeps its logit, every other becomes ``-inf``; a forced token
  that another rule has already masked is not forced. A prompt without markers turns it off.
- :class:`NoRepeatNGram` (DeepSeek-OCR's no-repeat n-gram processor): the token that would
  complete an n-gram already generated within the last ``window`` tokens is masked, so a
  sequence cannot loop over the same ``n`` tokens; ``whitelist`` tokens are never masked.

Defaults for a document (:func:`document_rules`): the guard on with
:data:`~dash_trt.documents.budget.DEFAULT_MAX_PAGE_TOKENS` (20000, vLLM's) tokens a page, n-grams
of 35 within 128 tokens for one page and 1024 for several (upstream's recipe).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from ..documents import budget as _budget
from ..documents.budget import DEFAULT_MAX_PAGE_TOKENS

__all__ = [
    "RulesError",
    "DecodingRules",
    "PageCountGuard",
    "NoRepeatNGram",
    "document_rules",
    "DEFAULT_MAX_PAGE_TOKENS",
]


class RulesError(ValueError):
    """Bad rule options (the message names the option)."""


def _force(logits: torch.Tensor, token: int) -> None:
    keep = logits[token].clone()
    if not bool(torch.isfinite(keep)):
        return  # another rule masked it: do not force it back
    logits.fill_(-math.inf)
    logits[token] = keep


class PageCountGuard:
    """One sequence's page count (module docstring)."""

    def __init__(self, page_token_id: int, eos_token_id: int, expected_pages: int, max_page_tokens: int):
        self.page = page_token_id
        self.eos = eos_token_id
        self.expected = expected_pages
        self.cap = max_page_tokens
        self.markers = 0
        self.page_len = 0
        self.scanned = 0

    def __call__(self, generated: Sequence[int], logits: torch.Tensor) -> None:
        if self.expected <= 0:
            return
        n = len(generated)
        if n > self.scanned:
            tail = list(generated[self.scanned :])
            found = tail.count(self.page)
            if found:
                self.markers += found
                self.page_len = tail[::-1].index(self.page)
            else:
                self.page_len += len(tail)
            self.scanned = n
        if self.markers > self.expected:
            _force(logits, self.eos)
        elif 0 < self.cap <= self.page_len:
            _force(logits, self.page if self.markers < self.expected else self.eos)
        elif self.markers < self.expected:
            finite = torch.isfinite(logits)
            finite[self.eos] = False
            if bool(finite.any()):
                logits[self.eos] = -math.inf


class NoRepeatNGram:
    """Masks the tokens that would repeat an n-gram of the last ``window`` generated tokens."""

    def __init__(self, size: int, window: int, whitelist: Iterable[int] = ()):
        self.size = size
        self.window = window
        self.whitelist = frozenset(whitelist)

    def banned(self, generated: Sequence[int]) -> set[int]:
        n = self.size
        if len(generated) < n:
            return set()
        prefix = tuple(generated[len(generated) - n + 1 :])
        start = max(0, len(generated) - self.window) if self.window > 0 else 0
        out = set()
        for i in range(start, len(generated) - n + 1):
            if tuple(generated[i : i + n - 1]) == prefix:
                out.add(generated[i + n - 1])
        return out - self.whitelist

    def __call__(self, generated: Sequence[int], logits: torch.Tensor) -> None:
        banned = self.banned(generated)
        if banned:
            logits[list(banned)] = -math.inf


@dataclass(frozen=True)
class DecodingRules:
    """A request's rules: the page-count guard (``page_guard``; its ``max_page_tokens``, <= 0: no
    cap) and the no-repeat n-gram rule (``no_repeat_ngram`` tokens, 0: off, within
    ``no_repeat_window`` generated tokens, 0: all of them)."""

    page_guard: bool = False
    max_page_tokens: int = DEFAULT_MAX_PAGE_TOKENS
    no_repeat_ngram: int = 0
    no_repeat_window: int = 0
    whitelist: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        for name in ("max_page_tokens", "no_repeat_ngram", "no_repeat_window"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or abs(v) > 1 << 31:
                raise RulesError(f"{name} must be an integer, got {v!r}")
        if self.no_repeat_ngram < 0 or self.no_repeat_window < 0:
            raise RulesError("no_repeat_ngram and no_repeat_window must be >= 0")
        if self.no_repeat_ngram == 1:
            raise RulesError("no_repeat_ngram of 1 would mask every token already generated; use 0 (off) or >= 2")
        if not isinstance(self.page_guard, bool):
            raise RulesError(f"page_guard must be true or false, got {self.page_guard!r}")

    @property
    def active(self) -> bool:
        return self.page_guard or self.no_repeat_ngram > 0

    def processors(self, prompt: Sequence[int], page_token_id: int, eos_token_id: int | None) -> list:
        """The logits processors of one sequence with ``prompt``."""
        out = []
        if self.no_repeat_ngram:
            out.append(NoRepeatNGram(self.no_repeat_ngram, self.no_repeat_window, self.whitelist))
        if self.page_guard:
            if eos_token_id is None:
                raise RulesError("the page-count guard needs the model's eos_token_id (its config sets none)")
            pages = sum(1 for t in prompt if t == page_token_id)
            out.append(PageCountGuard(page_token_id, eos_token_id, pages, self.max_page_tokens))
        return out


def document_rules(pages: int, **overrides) -> DecodingRules:
    """Upstream's defaults for a document of ``pages`` pages (module docstring), then ``overrides``."""
    base = {
        "page_guard": True,
        "max_page_tokens": _budget.DEFAULT_MAX_PAGE_TOKENS,  # read when called: the one owner's value
        "no_repeat_ngram": 35,
        "no_repeat_window": 128 if pages <= 1 else 1024,
    }
    base.update({k: v for k, v in overrides.items() if v is not None})
    return DecodingRules(**base)
