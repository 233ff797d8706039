"""The prompt of a document: ``[BOS] (<PAGE> <image> x N_p) for each page p, instruction`` or the
checkpoint's chat template around it.

Upstream's layout for several pages is ``"<PAGE><image>" * pages + "Multi page parsing."``
(vLLM 0.34.0, ``models/unlimited_ocr2.py``); one ``<image>`` placeholder a page is expanded to
the page's image-token count (:func:`~dash_trt.documents.views.image_token_count`), as the
model's processor does. A chat template (``tokenizer_config.json``'s ``chat_template`` or
``chat_template.jinja``) is rendered in jinja2's immutable sandbox
(:func:`dash_trt.chat_template.render_chat`, also the front door's renderer) with one user
message holding that content, the generation prompt added; placeholders are expanded after
rendering.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..chat_template import PromptError, render_chat

__all__ = ["PromptError", "DEFAULT_INSTRUCTION", "SINGLE_PAGE_INSTRUCTION", "document_prompt_ids", "render_chat"]

#: The instruction of upstream's multi-page layout.
DEFAULT_INSTRUCTION = "Multi page parsing."
#: The instruction for a single page: the model's README's ("document parsing."; vLLM 0.34.0
#: defines none for one page).
SINGLE_PAGE_INSTRUCTION = "document parsing."

IMAGE_PLACEHOLDER = "<image>"


def document_prompt_ids(
    tokenizer,
    page_tokens: Sequence[int],
    *,
    image_token_id: int,
    page_token_id: int,
    instruction: str | None = None,
    use_chat_template: bool = True,
) -> list[int]:
    """The prompt's token ids for pages of ``page_tokens`` image tokens each (module docstring).
    ``instruction`` defaults to :data:`DEFAULT_INSTRUCTION` for several pages and
    :data:`SINGLE_PAGE_INSTRUCTION` for one."""
    if not page_tokens:
        raise PromptError("a document prompt needs at least one page")
    if instruction is None:
        instruction = DEFAULT_INSTRUCTION if len(page_tokens) > 1 else SINGLE_PAGE_INSTRUCTION
    if IMAGE_PLACEHOLDER in instruction:
        raise PromptError(f"the instruction may not contain {IMAGE_PLACEHOLDER!r} (pages are added for you)")
    page_text = tokenizer.token_text(page_token_id)
    content = (page_text + IMAGE_PLACEHOLDER) * len(page_tokens) + instruction
    template = tokenizer.chat_template if use_chat_template else None
    bos = tokenizer.bos_id
    if template:
        special = {
            "bos_token": getattr(tokenizer, "bos_token", None),
            "eos_token": getattr(tokenizer, "eos_token", None),
        }
        text = render_chat(template, content, special)
        if text.count(IMAGE_PLACEHOLDER) != len(page_tokens):
            raise PromptError(
                f"the chat template gave {text.count(IMAGE_PLACEHOLDER)} {IMAGE_PLACEHOLDER} placeholders for "
                f"{len(page_tokens)} pages"
            )
        ids: list[int] = []
    else:
        text = content
        ids = [bos] if bos is not None else []
    parts = text.split(IMAGE_PLACEHOLDER)
    for part, n in zip(parts, list(page_tokens) + [None]):
        ids += tokenizer.encode(part) if part else []
        if n is not None:
            ids += [image_token_id] * int(n)
    if ids.count(page_token_id) != len(page_tokens):
        raise PromptError(
            f"the prompt holds {ids.count(page_token_id)} page markers for {len(page_tokens)} pages (the instruction "
            f"or template may not contain {page_text!r})"
        )
    return ids
