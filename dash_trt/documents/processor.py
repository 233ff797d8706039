"""A document's model inputs from its files, without torch: pages, views, the prompt's token ids,
and the split of a generated answer into one section per page.

:class:`DocumentProcessor` is the one processor every front end runs (offline
:class:`~dash_trt.serving.documents.DocumentOCR`, the Triton document model, tests), so they
build the same prompt for the same pages.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from .pages import DocumentError, Page, PageError, PageSource, Renderer, RenderLimits, close_pages, open_pages
from .prompt import document_prompt_ids
from .render import RenderWorkers
from .views import PageViews, ViewSpec, check_page_tokens, page_views

__all__ = ["DocumentOptions", "PreparedDocument", "Refusal", "DocumentProcessor", "split_pages", "CROP_AUTO"]

#: ``crop``: the model's upstream default: every page tiled (vLLM 0.34.0's Unlimited-OCR-2 crops
#: each page of a request independently, one page or many).
CROP_AUTO = None


@dataclass(frozen=True)
class DocumentOptions:
    """What a user may choose for a document."""

    #: True: tiles for every page larger than a tile; False: global views only; None: upstream's
    #: default, which for Unlimited-OCR-2 is True for one page and for many (:data:`CROP_AUTO`)
    crop: bool | None = CROP_AUTO
    #: the instruction after the pages (None: "Multi page parsing." for several pages, "document
    #: parsing." for one: the model's README)
    instruction: str | None = None
    #: image tokens one page may take (None: no limit but the prompt's)
    max_page_tokens: int | None = None
    #: the longer side, in pixels, of a rendered PDF page
    render_side: int | None = None
    #: times a page that could not be rendered or decoded (a :class:`~dash_trt.documents.pages.PageError`:
    #: a damaged page, a rendering process that died) is tried again before it counts as failed
    page_retries: int = 0
    #: the fraction of a document's pages that may fail (after their retries) with the document
    #: still transcribed, each failed page left out of the prompt and reported (finish reason
    #: ``error``); more fails the document. 0: the first failed page fails it (its own message).
    max_page_error_rate: float = 0.0

    def crop_for(self, pages: int) -> bool:
        """Whether a document of ``pages`` pages is tiled: :attr:`crop`, else upstream's default
        (vLLM 0.34.0: ``crop_mode and (one image or Unlimited-OCR-2)``, crop mode on)."""
        return self.crop if self.crop is not None else True


@dataclass
class Refusal:
    """A page left out of a document's prompt: its number in the document (1-based), its source
    and why (over a budget of pixels or of image tokens, or it could not be rendered: the message
    names it), and its finish reason (``refused``; ``error`` for a page that failed)."""

    page: int
    source: str
    message: str
    finish_reason: str = "refused"


@dataclass
class PreparedDocument:
    """A document's pages as the model sees them: the pages it reads (``pages``, sizes kept,
    bitmaps let go), their views (``views``: all of them after
    :meth:`DocumentProcessor.prepare`; empty after :meth:`DocumentProcessor.plan`, which leaves
    them to :meth:`each_view`, one page at a time), the prompt, each page's image tokens and view
    digest, and the pages refused one by one (``refused``: left out of the prompt). A planned
    document holds its request's :class:`~dash_trt.documents.render.Renderer` (its PDFs open in
    the rendering worker, which serves no other request meanwhile) until :meth:`each_view` has
    rendered every page, or :meth:`close` (which ends the request and gives the worker back)."""

    pages: list[Page]
    views: list[PageViews]
    prompt_ids: list[int]
    #: image tokens of each page, in order
    page_tokens: list[int]
    crop: bool
    #: each page's view digest (sha256 of its pixels and grid): the key of its image features
    page_keys: list[str] = field(default_factory=list)
    #: pages left out, each with its message (:class:`Refusal`)
    refused: list[Refusal] = field(default_factory=list)
    #: each page's number in the document (1-based; refused pages skipped); empty: 1, 2, ...
    numbers: list[int] = field(default_factory=list)
    #: the pages not yet rendered (:meth:`DocumentProcessor.plan`), for :meth:`each_view`
    sources: list[PageSource] = field(default_factory=list, repr=False)
    spec: ViewSpec | None = field(default=None, repr=False)
    #: the request's renderer (:meth:`DocumentProcessor.plan`), closed after the last page
    renderer: Renderer | None = field(default=None, repr=False)
    #: pages that could not be rendered after their retries (finish reason ``error``), left out by
    #: :meth:`drop_failed`
    failed: list[Refusal] = field(default_factory=list)
    #: the document's pages, refused ones included (what :attr:`max_page_error_rate` counts)
    total_pages: int = 0
    page_retries: int = 0
    max_page_error_rate: float = 0.0
    #: the prompt's token ids for the given pages' image-token counts (:meth:`drop_failed`)
    prompt_for: Callable[[list[int]], list[int]] | None = field(default=None, repr=False)

    @property
    def names(self) -> list[str]:
        return [p.source for p in self.pages]

    @property
    def page_numbers(self) -> list[int]:
        return self.numbers or list(range(1, len(self.pages) + 1))

    def each_view(self) -> Iterator[tuple[int, str, PageViews]]:
        """Each page's index, view digest and views, in order: from :attr:`views` when they are
        held, else each page rendered, cut into its views and its bitmap let go before the next
        (only the views of the page being yielded are alive here). Fills :attr:`page_keys`.

        A page that cannot be rendered (:class:`~dash_trt.documents.pages.PageError`) is tried
        :attr:`page_retries` more times; then it is not yielded, its key is None and it joins
        :attr:`failed` (:meth:`drop_failed` takes it out of the prompt), unless that makes more
        than :attr:`max_page_error_rate` of the document's pages: then the document fails (with
        a rate of 0, with the page's own error)."""
        if self.views:
            if not self.page_keys:
                self.page_keys = [_digest(v) for v in self.views]
            yield from ((i, k, v) for i, (k, v) in enumerate(zip(self.page_keys, self.views)))
            return
        self.page_keys = keys = []
        try:
            for i, p in enumerate(self.sources):
                v = self._render(i, p)
                keys.append(None if v is None else _digest(v))
                if v is None:
                    continue
                yield i, keys[-1], v
                del v  # not held while the next page renders
        finally:
            self.close()

    def _render(self, i: int, p: PageSource) -> PageViews | None:
        """Page ``i``'s views, tried again on a :class:`PageError`; None once it has failed."""
        tries = max(0, int(self.page_retries)) + 1
        for _ in range(tries):
            try:
                return _render_views(p, self.spec, self.crop, self.page_tokens[i])
            except PageError as exc:
                error = exc
        times = f" ({tries} attempts)" if tries > 1 else ""
        self.failed.append(Refusal(self.page_numbers[i], p.source, f"{error}{times}", "error"))
        total = max(self.total_pages, len(self.pages), 1)
        if len(self.failed) / total > self.max_page_error_rate:
            if self.max_page_error_rate <= 0:
                raise error
            raise DocumentError(
                f"{len(self.failed)} of {total} pages could not be rendered, more than the "
                f"{self.max_page_error_rate:g} of its pages a document may lose: "
                + "; ".join(r.message for r in self.failed)
            )
        return None

    def drop_failed(self) -> list[int]:
        """Takes the pages of :attr:`failed` out of the document (its pages, numbers, image
        tokens, keys and the prompt, rebuilt for the pages left) and gives the indices,
        among the pages as they were, of those kept. Raises :class:`DocumentError` when none is."""
        gone = {r.page for r in self.failed}
        numbers = self.page_numbers
        keep = [i for i, n in enumerate(numbers) if n not in gone]
        if len(keep) == len(numbers):
            return keep
        if not keep:
            raise DocumentError(f"every page failed: {self.failed[0].message}")
        self.pages = [self.pages[i] for i in keep]
        self.page_tokens = [self.page_tokens[i] for i in keep]
        if len(self.page_keys) == len(numbers):
            self.page_keys = [self.page_keys[i] for i in keep]
        if len(self.sources) == len(numbers):
            self.sources = [self.sources[i] for i in keep]
        self.numbers = [numbers[i] for i in keep]
        if self.prompt_for is not None:
            self.prompt_ids = self.prompt_for(self.page_tokens)
        return keep

    def close(self) -> None:
        """The request ends: its PDFs are closed in the rendering worker, which goes back to the
        processor's :class:`~dash_trt.documents.render.RenderWorkers` for the next request (killed
        instead if it cannot be trusted again); idempotent."""
        close_pages(self.sources)
        if self.renderer is not None:
            self.renderer.close()


def _render_views(p: PageSource, spec: ViewSpec, crop: bool, count: int) -> PageViews:
    """One page rendered and cut into its views; its bitmap is let go on return."""
    page = p.render()
    views = page_views(page.image, spec, crop, page.source)
    if views.num_tokens != count:  # the size read and the size rendered
        raise PageError(f"{page.source}: rendered at {page.size}, read as {p.size}: cannot be counted")
    return views


def _digest(v: PageViews) -> str:
    h = hashlib.sha256()
    h.update(repr((v.grid, v.global_view.shape, v.crops.shape)).encode())
    h.update(v.global_view.tobytes())
    h.update(v.crops.tobytes())
    return h.hexdigest()


class DocumentProcessor:
    """Files to model inputs for one model: its view sizes (:class:`ViewSpec` from its config),
    its special tokens and its tokenizer; ``render_limits``: what reading and rendering one
    request's PDFs may take (:class:`~dash_trt.documents.render.RenderLimits`, the defaults
    when None). Its requests are rendered, one after another, by a warm worker process
    (:attr:`render_workers`, :class:`~dash_trt.documents.render.RenderWorkers`), started with the
    first PDF: :meth:`close` (or ``with``) stops it."""

    def __init__(
        self,
        tokenizer,
        *,
        image_token_id: int,
        page_token_id: int,
        spec: ViewSpec | None = None,
        render_limits: RenderLimits | None = None,
    ):
        self.tokenizer = tokenizer
        self.image_token_id = int(image_token_id)
        self.page_token_id = int(page_token_id)
        self.spec = spec or ViewSpec()
        self.render_limits = render_limits or RenderLimits()
        self.render_workers = RenderWorkers(self.render_limits)

    def close(self) -> None:
        """Stop the rendering worker (a later request starts one of its own)."""
        self.render_workers.close()

    def __enter__(self) -> DocumentProcessor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @classmethod
    def for_config(cls, tokenizer, config, render_limits: RenderLimits | None = None) -> DocumentProcessor:
        """For a model config (:class:`~dash_trt.models.config.DashModelConfig`)."""
        return cls(
            tokenizer,
            image_token_id=config.image_token_id,
            page_token_id=config.page_token_id,
            spec=ViewSpec.from_config(config),
            render_limits=render_limits,
        )

    def render_side(self, options: DocumentOptions) -> int:
        """PDF pages are rendered with their longer side this long: the tiles' grid at most
        ``max_crops`` tiles a side in crop mode, the global view's size otherwise."""
        if options.render_side is not None:
            return int(options.render_side)
        s = self.spec
        return max(s.base_size, s.image_size * s.max_crops) if options.crop is not False else s.base_size

    def prepare(self, sources: Iterable, options: DocumentOptions | None = None, **budget) -> PreparedDocument:
        """Pages, views and prompt of ``sources`` (:meth:`plan`, with its ``max_prompt_tokens``
        and ``cancelled``; then every page's views, all of them held at once, which for a long
        document is what :meth:`plan` and :meth:`PreparedDocument.each_view` avoid)."""
        doc = self.plan(sources, options, **budget)
        views = [v for _, _, v in doc.each_view()]
        doc.drop_failed()
        doc.views = views
        return doc

    def plan(
        self,
        sources: Iterable,
        options: DocumentOptions | None = None,
        *,
        max_prompt_tokens: int | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> PreparedDocument:
        """Pages and prompt of ``sources``, no page rendered
        (:func:`~dash_trt.documents.pages.open_pages`; the views come one page at a time from
        :meth:`PreparedDocument.each_view`). A page over its pixel budget or taking more than
        ``options.max_page_tokens`` image tokens is refused alone (:attr:`PreparedDocument.refused`,
        its message naming the page and the arithmetic) and left out of the prompt; the others go
        on. Raises :class:`DocumentError` when every page is refused or the prompt takes more than
        ``max_prompt_tokens``, or naming the page and the limit when reading or rendering goes
        over :attr:`render_limits`; :class:`~dash_trt.documents.render.RenderCancelled` when
        ``cancelled()`` says so (checked between pages and while one renders: the rendering
        process is killed). The request's renderer stays with the document for
        :meth:`PreparedDocument.each_view`."""
        options = options or DocumentOptions()
        renderer = Renderer(self.render_limits, cancelled=cancelled, workers=self.render_workers)
        every: list[PageSource] = []
        try:
            # every budget from the pages' sizes first: nothing is rendered for a refused request
            every = open_pages(sources, render_side=self.render_side(options), renderer=renderer, refuse_pages=True)
            crop = options.crop_for(len(every))
            spec = self.spec
            if options.max_page_tokens is not None:
                spec = ViewSpec(**{**spec.__dict__, "max_page_tokens": int(options.max_page_tokens)})
            pages, counts, numbers, refused = [], [], [], []
            for number, p in enumerate(every, 1):
                try:
                    if p.refused is not None:
                        raise DocumentError(p.refused)
                    counts.append(check_page_tokens(p.width, p.height, spec, crop, p.source))
                except DocumentError as exc:
                    refused.append(Refusal(number, p.source, str(exc)))
                    continue
                pages.append(p)
                numbers.append(number)
            if not pages:
                more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
                raise DocumentError(f"every page is refused: {refused[0].message}{more}")
            prompt_for = functools.partial(
                document_prompt_ids,
                self.tokenizer,
                image_token_id=self.image_token_id,
                page_token_id=self.page_token_id,
                instruction=options.instruction,
            )
            ids = prompt_for(counts)
            if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
                raise DocumentError(_too_long(pages, counts, len(ids), max_prompt_tokens, crop))
        except BaseException:
            close_pages(every)
            renderer.close()
            raise
        held = [Page(None, p.source, size=p.size) for p in pages]
        return PreparedDocument(
            held,
            [],
            ids,
            counts,
            crop,
            refused=refused,
            numbers=numbers,
            sources=pages,
            spec=spec,
            renderer=renderer,
            total_pages=len(every),
            page_retries=options.page_retries,
            max_page_error_rate=options.max_page_error_rate,
            prompt_for=prompt_for,
        )


def _too_long(pages: Sequence[PageSource], counts: Sequence[int], total: int, limit: int, crop: bool) -> str:
    """The message for a prompt of ``total`` tokens over ``limit``: the page where it runs out."""
    text = total - sum(counts)
    over, running = len(pages), 0
    for i, n in enumerate(counts):
        running += n
        if running + text > limit:
            over = i + 1
            break
    return (
        f"the prompt of {len(pages)} page(s) is {total} tokens ({' + '.join(map(str, counts))} image tokens "
        f"+ {text} text tokens), more than the {limit} this model serves; "
        f"it is exceeded at {pages[over - 1].source}: send fewer pages a request"
        + ("" if not crop else " or turn crop mode off")
    )


def split_pages(tokens: Sequence[int], page_token_id: int, eos_token_id: int | None, pages: int) -> list[list[int]]:
    """An answer's tokens as one list per page. The answer marks each page with a ``<PAGE>`` token
    before it (the page-count guard keeps exactly ``pages`` of them); text before the first marker
    goes with the first page, EOS is dropped. An answer with fewer markers (no guard, or cut by
    max_new_tokens) gives empty lists for the pages it did not reach; one with more puts the
    surplus in the last page."""
    body = [t for t in tokens if t != eos_token_id] if eos_token_id is not None else list(tokens)
    sections: list[list[int]] = [[]]
    for t in body:
        if t == page_token_id:
            sections.append([])
        else:
            sections[-1].append(t)
    head, marked = sections[0], sections[1:]
    if not marked:
        marked = [[]]
    marked[0] = head + marked[0]
    if len(marked) > pages:
        tail = [t for s in marked[pages - 1 :] for t in s]
        marked = marked[: pages - 1] + [tail]
    return marked + [[] for _ in range(pages - len(marked))]


def check_sources(sources: Sequence) -> None:
    if not sources:
        raise DocumentError("no document given")
