"""A document's token budget, the same on every path (``dash-trt ocr`` offline and through a
server, the Triton document model, chat and ``/v1/ocr``), and how each page of an answer ended.

- :data:`DEFAULT_MAX_PAGE_TOKENS`: the tokens one page may take, 20000. It is vLLM's cap for
  Unlimited-OCR-2 (``DEFAULT_MAX_PAGE_TOKENS`` of ``models/unlimited_ocr2.py``), which the page
  guard (:class:`~dash_trt.serving.rules.PageCountGuard`) enforces: a page reaching it moves on
  to the next. A request's ``max_page_tokens`` overrides it.
- :func:`document_max_new_tokens`: the tokens a whole document may take when the request names
  no total: ``(pages + 1) x (max_page_tokens + 1)``, every page's budget and its ``<PAGE>``
  marker, as much again for text before the first marker (which the guard also lets run to the
  page budget) and the end. That is the most the guard lets an answer hold, so the total never
  cuts a page the guard would let go on: each page has its own budget. It is held to what the
  model admits (its context, a server's ``max_new_tokens`` limit); pages the answer then does
  not reach, or cuts, say ``length``.
- :func:`finish_reasons`: how each page of an answer ended: ``stop`` (the model ended it),
  ``length`` (it ran out of its budget: the page budget, or the document's total before or
  inside it) or ``guard`` (the answer went on past the last page with a ``<PAGE>`` marker too
  many, which the page guard ended there; without the guard the surplus stays in the last
  page). A ``length`` page is never complete.
- :func:`page_entries`: one record a page (its number, source, text, finish reason, tokens and
  seconds) as the document model, ``/v1/ocr`` and ``dash-trt ocr --format jsonl`` give them. A
  page refused before the model saw it (over its pixel or image-token budget) has its record
  too, in its place: finish reason ``refused``, no text, and ``error``, the reason; so has a
  page that could not be rendered, with finish reason ``error``
  (:attr:`~dash_trt.documents.processor.DocumentOptions.max_page_error_rate`).

Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .processor import split_pages

__all__ = [
    "DEFAULT_MAX_PAGE_TOKENS",
    "FINISH_REASONS",
    "document_max_new_tokens",
    "finish_reasons",
    "page_entries",
    "document_finish_reason",
    "REFUSED",
    "ERROR",
]

#: The tokens one page may take unless a request says otherwise (vLLM's Unlimited-OCR-2 cap).
DEFAULT_MAX_PAGE_TOKENS = 20000
#: A page's finish reasons (module docstring).
FINISH_REASONS = ("stop", "length", "guard", "refused", "error")
#: The finish reason of a page refused before generation (over a budget; its record's ``error``).
REFUSED = "refused"
#: The finish reason of a page that could not be rendered or decoded, after its retries, left out
#: of a document that was transcribed without it (its record's ``error``).
ERROR = "error"


def document_max_new_tokens(pages: int, max_page_tokens: int | None = None, room: int | None = None) -> int:
    """The tokens a document of ``pages`` pages may take: ``(pages + 1) x (max_page_tokens + 1)``
    (:data:`DEFAULT_MAX_PAGE_TOKENS` when None or <= 0, no cap), at most ``room`` (what the
    model admits after the prompt) when given, and at least 1."""
    per_page = max_page_tokens if max_page_tokens is not None and max_page_tokens > 0 else DEFAULT_MAX_PAGE_TOKENS
    total = (max(pages, 1) + 1) * (per_page + 1)
    if room is not None:
        total = min(total, room)
    return max(total, 1)


def finish_reasons(
    tokens: Sequence[int],
    page_token_id: int,
    eos_token_id: int | None,
    pages: int,
    max_page_tokens: int = DEFAULT_MAX_PAGE_TOKENS,
    page_guard: bool = True,
) -> list[str]:
    """How each of ``pages`` pages of an answer (its generated ``tokens``) ended (module
    docstring). ``max_page_tokens`` and ``page_guard``: the rules it was generated under (a page
    that reached the guard's cap ran out of its budget)."""
    ended = bool(tokens) and eos_token_id is not None and tokens[-1] == eos_token_id
    lengths = [0]  # text tokens before the first marker, then after each marker
    for t in tokens:
        if t == page_token_id:
            lengths.append(0)
        elif t != eos_token_id:
            lengths[-1] += 1
    markers = len(lengths) - 1
    cap = max_page_tokens if page_guard and max_page_tokens > 0 else 0

    def full(n: int) -> bool:
        return 0 < cap <= n

    out = []
    for page in range(1, pages + 1):
        if page > max(markers, 1):  # the answer never reached this page
            out.append("stop" if ended else "length")
            continue
        last = page if markers >= page else 0  # the page's own section (page 1: maybe unmarked)
        if page == pages and markers > pages:
            out.append("guard" if ended else "length")
        elif (last == markers and not ended) or full(lengths[last]) or (page == 1 and full(lengths[0])):
            out.append("length")
        else:
            out.append("stop")
    return out


def document_finish_reason(reasons: Sequence[str]) -> str:
    """A whole answer's finish reason: ``length`` when a page ran out of its budget, else ``stop``."""
    return "length" if "length" in reasons else "stop"


def page_entries(
    tokens: Sequence[int],
    sources: Sequence[str],
    decode: Callable[[list[int]], str],
    page_token_id: int,
    eos_token_id: int | None,
    *,
    max_page_tokens: int = DEFAULT_MAX_PAGE_TOKENS,
    page_guard: bool = True,
    seconds: float = 0.0,
) -> list[dict[str, Any]]:
    """One record a page of an answer: ``page`` (1-based), ``source``, ``text`` (``decode`` of
    its section), ``finish_reason``, ``tokens`` (its section's token count) and ``seconds``: the
    document's ``seconds`` shared out among its pages by their tokens (each counted one more, so
    a page with none still has its part of reading the document). One request generates every
    page, so a page's seconds are that share, not a separate measurement."""
    pages = len(sources)
    sections = split_pages(tokens, page_token_id, eos_token_id, pages)
    reasons = finish_reasons(tokens, page_token_id, eos_token_id, pages, max_page_tokens, page_guard)
    weight = sum(len(s) + 1 for s in sections) or 1
    return [
        {
            "page": i + 1,
            "source": source,
            "text": decode(sec),
            "finish_reason": reason,
            "tokens": len(sec),
            "seconds": round(seconds * (len(sec) + 1) / weight, 6),
        }
        for i, (source, sec, reason) in enumerate(zip(sources, sections, reasons))
    ]


def document_page_entries(tokens: Sequence[int], doc, tokenizer, config, rules, seconds: float = 0.0) -> list[dict]:
    """:func:`page_entries` of a processed document's answer: its pages' sources, the
    tokenizer's text without special tokens, the model config's page and end ids, and the
    decoding ``rules``' page budget and guard (what the serving pipeline and the Triton document
    model both report)."""
    entries = page_entries(
        tokens,
        [p.source for p in doc.pages],
        lambda sec: tokenizer.decode(sec, skip_special_tokens=True),
        config.page_token_id,
        config.eos_token_id,
        max_page_tokens=rules.max_page_tokens,
        page_guard=rules.page_guard,
        seconds=seconds,
    )
    left_out = [*getattr(doc, "refused", ()), *getattr(doc, "failed", ())]
    return with_refused(entries, getattr(doc, "page_numbers", None), left_out)


def with_refused(entries: list[dict[str, Any]], numbers: Sequence[int] | None, refused: Sequence) -> list[dict]:
    """The records of the pages the model read (``entries``, numbered 1, 2, ... among themselves)
    given their ``numbers`` in the document, with a record for each refused page (objects with
    ``page``, ``source``, ``message`` and maybe ``finish_reason``, ``refused`` when they have
    none) in its place."""
    if numbers:
        for e, n in zip(entries, numbers):
            e["page"] = n
    for r in refused:
        entries.append(
            {"page": r.page, "source": r.source, "text": "", "tokens": 0, "seconds": 0.0}
            | {"finish_reason": getattr(r, "finish_reason", REFUSED)}
            | {"error": r.message}
        )
    return sorted(entries, key=lambda e: e["page"])
