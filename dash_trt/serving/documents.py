"""Documents in, text out, in one process: :class:`DocumentOCR` loads a checkpoint folder's
decoder, vision tower and tokenizer, and turns PDFs and images into one text section per page.

The steps are the ones the Triton document model runs (``dash-triton write`` puts it beside the
generation model): :class:`~dash_trt.documents.processor.DocumentProcessor` (pages, views,
prompt), the vision tower on each page's views (:func:`page_features`), generation with
upstream's decoding rules (:func:`~dash_trt.serving.rules.document_rules`: the page-count guard,
no-repeat n-grams), and :func:`~dash_trt.documents.processor.split_pages`.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..documents.budget import document_finish_reason, document_max_new_tokens, document_page_entries
from ..documents.pages import DocumentError
from ..documents.processor import DocumentOptions, DocumentProcessor, PreparedDocument, split_pages
from ..documents.render import RenderLimits
from ..documents.tokenizer import load_tokenizer
from ..models.checkpoint import load_checkpoint, load_vision_tower
from ..models.deepencoder import VisionTower
from .generate import generate
from .rules import DecodingRules, document_rules

__all__ = ["DocumentOCR", "PageText", "OCRResult", "page_features", "FeatureCache"]


@dataclass
class PageText:
    page: int  #: 1-based
    source: str  #: ``file.pdf page 3``
    text: str
    tokens: list[int] = field(default_factory=list)
    #: ``stop``, ``length`` (ran out of its budget) or ``guard`` (:mod:`dash_trt.documents.budget`)
    finish_reason: str = "stop"
    seconds: float = 0.0  #: the document's seconds shared out by the pages' tokens
    #: why the page was refused (finish reason ``refused``: over its pixel or image-token budget)
    error: str | None = None


@dataclass
class OCRResult:
    pages: list[PageText]
    prompt_tokens: int
    generated_tokens: int
    max_new_tokens: int = 0  #: the document's budget (the request's, or derived from the page budget)
    max_page_tokens: int = 0  #: each page's budget (the page guard's cap)

    @property
    def finish_reason(self) -> str:
        """``length`` when a page ran out of its budget, else ``stop``."""
        return document_finish_reason([p.finish_reason for p in self.pages])

    @property
    def truncated(self) -> list[int]:
        """The pages (1-based) that ran out of their budget."""
        return [p.page for p in self.pages if p.finish_reason == "length"]

    def markdown(self) -> str:
        """The pages as one markdown document, each under a ``<!-- page N: source -->`` comment."""
        return "\n\n".join(f"<!-- page {p.page}: {p.source} -->\n\n{p.text.strip()}" for p in self.pages) + "\n"


class FeatureCache:
    """Image features of pages by their view digest (an LRU of ``capacity`` pages)."""

    def __init__(self, capacity: int = 256):
        self.capacity = capacity
        self._items: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.hits = self.misses = 0

    def get(self, key: str) -> torch.Tensor | None:
        hit = self._items.get(key)
        if hit is None:
            self.misses += 1
            return None
        self.hits += 1
        self._items.move_to_end(key)
        return hit

    def put(self, key: str, value: torch.Tensor) -> None:
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)


#: Pages whose views go through the vision tower together when a document's views are rendered
#: as they are needed: the most pages' views alive at once (the tower batches at most 8 views of
#: one size a pass in any case).
FEATURE_CHUNK_PAGES = 4


def page_features(
    tower: VisionTower,
    doc: PreparedDocument,
    cache: FeatureCache | None = None,
    chunk: int = FEATURE_CHUNK_PAGES,
    progress: Callable[[int, int], None] | None = None,
) -> torch.Tensor:
    """The image features of a prepared document's pages, in prompt order [image tokens, hidden]
    (float32 on the CPU): each page's from the cache, the others from the tower
    (:meth:`~dash_trt.models.deepencoder.VisionTower.encode_pages`), ``chunk`` pages' views at a
    time as :meth:`~dash_trt.documents.processor.PreparedDocument.each_view` renders them, each
    chunk's views let go once encoded. The features are written into one tensor allocated for the
    whole prompt (its size is known from the pages' sizes); nothing else grows with the pages.

    The cache counts as a page-by-page loop would: a page repeated in the document (same key) is
    encoded once, a miss the first time and a hit after; every page is put back in page order,
    so the LRU order is the loop's too. A page that could not be rendered after its retries
    (:meth:`~dash_trt.documents.processor.PreparedDocument.each_view`) is left out: the document
    drops it (:meth:`~dash_trt.documents.processor.PreparedDocument.drop_failed`, its prompt
    rebuilt) and the features are those of the pages kept. ``progress(done, total)``: called as
    each page has been read (rendered, or failed)."""
    offsets = [0]
    for n in doc.page_tokens:
        offsets.append(offsets[-1] + n)
    out: torch.Tensor | None = None
    first: dict[str, int] = {}  # key -> the first page with it (its features are in ``out``)
    pending: list[tuple[int, str, object]] = []

    def place(i: int, f: torch.Tensor) -> None:
        nonlocal out
        if out is None:
            out = torch.empty(offsets[-1], f.shape[-1], dtype=torch.float32)
        out[offsets[i] : offsets[i + 1]] = f

    def flush() -> None:
        for (i, _, v), f in zip(pending, tower.encode_pages([v for _, _, v in pending])):
            if f.shape[0] != v.num_tokens:  # the processor's arithmetic and the tower's layout agree
                raise RuntimeError(f"the vision tower gave {f.shape[0]} features for {v.num_tokens} image tokens")
            place(i, f.float().cpu())
        pending.clear()

    total = len(doc.page_tokens)
    for i, key, views in doc.each_view():
        if progress is not None:
            progress(i + 1, total)
        if key in first:
            if cache is not None:
                cache.hits += 1  # the loop had it in the cache by now
            continue
        first[key] = i
        f = cache.get(key) if cache is not None else None
        if f is None:
            pending.append((i, key, views))
            if len(pending) >= max(1, chunk):
                flush()
        else:
            place(i, f)
        del views
    flush()
    if progress is not None:
        progress(total, total)
    for i, key in enumerate(doc.page_keys):
        if key is None:  # failed: dropped below
            continue
        if first[key] != i:  # a repeated page: the first one's features
            out[offsets[i] : offsets[i + 1]] = out[offsets[first[key]] : offsets[first[key] + 1]]
        if cache is not None:  # a copy: the cache never holds the whole prompt's tensor alive
            cache.put(key, out[offsets[i] : offsets[i + 1]].clone())
    if doc.failed:
        keep = doc.drop_failed()
        out = torch.cat([out[offsets[i] : offsets[i + 1]] for i in keep])
    return out


class DocumentOCR:
    """A checkpoint folder's document OCR: decoder, vision tower, tokenizer and processor (its
    rendering worker stays warm across documents: :meth:`close` stops it). ``render_limits``:
    what reading and rendering one document's PDFs may take (the defaults when None;
    ``dash-trt ocr --render-page-seconds`` and the like)."""

    def __init__(
        self,
        folder: str | os.PathLike,
        *,
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
        model: Any = None,
        tower: VisionTower | None = None,
        render_limits: RenderLimits | None = None,
    ):
        folder = os.fspath(folder)
        self.model = model if model is not None else load_checkpoint(folder)
        if dtype is not None:
            self.model = self.model.to(dtype)
        if device is not None:
            self.model = self.model.to(device)
        self.tower = tower if tower is not None else load_vision_tower(folder, self.model.config.to_dict())
        self.tower = self.tower.to(device=self.model.device)
        self.tokenizer = load_tokenizer(folder)
        self.processor = DocumentProcessor.for_config(self.tokenizer, self.model.config, render_limits)
        self.cache = FeatureCache()

    def close(self) -> None:
        """Stop the processor's rendering worker (:meth:`DocumentProcessor.close`; a later
        document starts another; ``contextlib.closing`` for a ``with``)."""
        self.processor.close()

    @property
    def config(self):
        return self.model.config

    def rules_for(self, pages: int, **overrides) -> DecodingRules:
        """Upstream's decoding rules for ``pages`` pages, with ``overrides``."""
        return document_rules(pages, **overrides)

    def prepare(self, sources: Sequence, options: DocumentOptions | None = None) -> PreparedDocument:
        return self.processor.prepare(sources, options)

    @torch.no_grad()
    def transcribe(
        self,
        sources: Sequence,
        options: DocumentOptions | None = None,
        *,
        max_new_tokens: int | None = None,
        rules: DecodingRules | dict[str, Any] | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> OCRResult:
        """One text section per page of ``sources`` (paths, bytes or ``(name, bytes)``). ``rules``:
        the decoding rules, or a dict of overrides of upstream's (:meth:`rules_for`; its
        ``max_page_tokens`` is each page's budget). ``max_new_tokens``: the document's budget;
        None: derived from the page budget
        (:func:`~dash_trt.documents.budget.document_max_new_tokens`), at most what the model's
        ``max_position_embeddings`` leaves after the prompt, as the document model does.
        ``progress(done, total)``: the pages read so far (:func:`page_features`)."""
        t0 = time.perf_counter()
        if isinstance(sources, (str, os.PathLike, bytes)):
            sources = [sources]
        # pages rendered one at a time as the tower takes them (page_features), not all first
        doc = self.processor.plan(sources, options)
        feats = page_features(self.tower, doc, self.cache, progress=progress)
        if not isinstance(rules, DecodingRules):
            rules = self.rules_for(len(doc.pages), **(rules or {}))
        if max_new_tokens is None:
            context = int(getattr(self.config, "max_position_embeddings", 0) or 0)
            room = context - len(doc.prompt_ids) + 1 if context > 0 else None
            max_new_tokens = document_max_new_tokens(len(doc.pages), rules.max_page_tokens, room)
        out = generate(
            self.model, [doc.prompt_ids], max_new_tokens, image_features=[feats], rules=rules, keep_logits=False
        )
        return self.result(doc, out.tokens[0], rules, max_new_tokens, time.perf_counter() - t0)

    def result(
        self,
        doc: PreparedDocument,
        tokens: Sequence[int],
        rules: DecodingRules | None = None,
        max_new_tokens: int = 0,
        seconds: float = 0.0,
    ) -> OCRResult:
        """An answer's tokens as one :class:`PageText` per page, each with how it ended under
        ``rules`` (upstream's for the document when None)."""
        cfg = self.config
        rules = rules if rules is not None else self.rules_for(len(doc.pages))
        sections = split_pages(tokens, cfg.page_token_id, cfg.eos_token_id, len(doc.pages))
        by_page = dict(zip(doc.page_numbers, sections))
        entries = document_page_entries(tokens, doc, self.tokenizer, cfg, rules, seconds)
        pages = [
            PageText(e["page"], e["source"], e["text"], by_page.get(e["page"], []), e["finish_reason"], e["seconds"])
            for e in entries
        ]
        for p, e in zip(pages, entries):
            p.error = e.get("error")
        return OCRResult(pages, len(doc.prompt_ids), len(tokens), max_new_tokens, rules.max_page_tokens)


def check_document(sources: Sequence) -> None:
    if not sources:
        raise DocumentError("no document given")
