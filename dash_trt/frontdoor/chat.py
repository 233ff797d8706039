"""``POST /v1/chat/completions``: the messages through the checkpoint's chat template (sandboxed
jinja2, :func:`dash_trt.chat_template.render_chat`); content parts ``text``, ``image_url`` and
``file`` / ``input_file`` (a PDF): a last user message with images or files is a document,
answered by the repository's document model (one section a page, each under a
``<!-- page N: ... -->`` comment), its text the instruction. A document's budget is the
document model's (every page its own ``max_page_tokens``), not the text chat's 2048, unless
``max_tokens`` / ``max_completion_tokens`` says; its finish reason is ``length`` when a page
ran out of its budget."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from .. import triton_protocol as P
from ..chat_template import PromptError, render_chat
from .attachments import Budget, fetch_attachment
from .endpoint import Endpoint, usage
from .models import APIError, ChatCompletionRequest
from .streaming import event, event_stream, stream_response

__all__ = ["ChatCompletions", "DEFAULT_CHAT_TEMPLATE"]

ROUTE = "/v1/chat/completions"

#: The chat template of a checkpoint that has none (the demo model's).
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

#: A document is transcribed greedily under the document rules: a sampling field set to
#: anything but these values would be silently ignored, so it is refused.
_GREEDY = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None, "stop_token_ids": None, "ignore_eos": False}


@dataclass
class _Reply:
    """The objects of one chat completion's answer: whole, or as stream chunks."""

    rid: str
    created: int
    model: str

    def chunk(self, index: int, text: str, reason: str | None, role: bool = False) -> dict:
        delta: dict[str, Any] = {"content": text} if text or not role else {}
        if role:
            delta = {"role": "assistant", "content": ""}
        return {
            "id": self.rid,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}],
        }

    def answer(self, text: str, reason: str, use: dict) -> dict:
        return {
            "id": self.rid,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": None,
                    "finish_reason": reason,
                }
            ],
            "usage": use,
        }

    async def events(self, text: str, reason: str, use: dict | None) -> AsyncIterator[str]:
        """A whole answer as a stream: the role, the text, the finish reason, the usage (if
        ``use``), ``[DONE]``."""
        yield event(self.chunk(0, "", None, role=True))
        yield event(self.chunk(0, text, None))
        yield event(self.chunk(0, "", reason))
        if use is not None:
            c = self.chunk(0, "", None)
            c["choices"], c["usage"] = [], use
            yield event(c)
        yield "data: [DONE]\n\n"


class ChatCompletions(Endpoint):
    """The handler of ``POST /v1/chat/completions``."""

    async def handle(self, request: Request):
        t0 = time.perf_counter()
        req: ChatCompletionRequest = await self.read_json(request, ChatCompletionRequest)
        self.check_model(req.model)
        reply = _Reply(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), self.settings.model)
        max_tokens = req.limit(self.settings.default_max_tokens)
        for i, m in enumerate(req.messages):
            self.check_text(m.text(), f"messages[{i}].content")
        if any(m.attachments() for m in req.messages):
            # a document's default budget is the document model's: every page its own
            text, reason, use = await self.document(request, req, req.max_completion_tokens or req.max_tokens)
            self.metrics.seconds.labels(ROUTE).observe(time.perf_counter() - t0)
            if not req.stream:
                return reply.answer(text, reason, use)
            return event_stream(reply.events(text, reason, use if req.include_usage else None))
        if req.max_page_tokens is not None:
            message = "max_page_tokens is for a document: a message with images or files"
            raise APIError(message, param="max_page_tokens")

        ids = await self.prompt(req)
        args = (max_tokens, not req.ignore_eos, req.stop_token_ids, req.sampling())
        if req.stream:
            return await stream_response(
                self, [ids], args, None, req.include_usage, reply.chunk, reply.chunk(0, "", None, True)
            )
        tokens, cached = await self.infer(request, self.backend.generate(ids, *args))
        self.metrics.count_tokens(len(ids), len(tokens))
        self.metrics.seconds.labels(ROUTE).observe(time.perf_counter() - t0)
        text = self.decode(tokens)
        return reply.answer(
            text,
            self.finish(tokens, max_tokens, not req.ignore_eos, req.stop_token_ids),
            usage(len(ids), len(tokens), cached),
        )

    # ----------------------------------------------------------------- text
    async def prompt(self, req: ChatCompletionRequest) -> list[int]:
        """The messages' token ids through the tokenizer's chat template (or the plain one):
        their length checked first, rendered and tokenized off the event loop."""
        tok = self.backend.tokenizer
        template = getattr(tok, "chat_template", None) or DEFAULT_CHAT_TEMPLATE
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        self.check_length(sum(len(m["content"]) for m in messages), "messages")
        special = {k: getattr(tok, k, None) for k in ("bos_token", "eos_token")}
        try:
            text = await asyncio.to_thread(render_chat, template, messages, special)
        except PromptError as exc:
            raise APIError(str(exc), param="messages") from None
        try:
            ids = await asyncio.to_thread(tok.encode, text)
        except ValueError as exc:
            raise APIError(str(exc), param="messages") from None
        if not ids:
            raise APIError("the messages render to an empty prompt", param="messages")
        return ids

    # ----------------------------------------------------------------- documents
    async def document(
        self, request: Request, req: ChatCompletionRequest, max_tokens: int | None
    ) -> tuple[str, str, dict]:
        """A conversation whose last user message holds images or files: a document. Returns
        the text (one section a page), the finish reason and the usage."""
        self._check_document(req)
        files = await self._files(req)
        last = req.messages[-1]
        system = "\n".join(m.text() for m in req.messages[:-1] if m.role in ("system", "developer") and m.text())
        instruction = "\n".join(x for x in (system, last.text()) if x) or None
        crop = {"auto": None, "on": True, "off": False, None: None}[req.crop]
        rules = None if req.max_page_tokens is None else {"max_page_tokens": req.max_page_tokens}
        result = await self.infer(request, self.backend.document(files, instruction, max_tokens, crop, rules))
        pages = result["pages"]
        text = "\n\n".join(
            f"<!-- page {p['page']}: {p['source']} -->\n\n{p['text'].strip()}" if len(pages) > 1 else p["text"]
            for p in pages
        )
        self.metrics.pages.inc(len(pages))
        self.metrics.count_tokens(result["prompt_tokens"], result["generated_tokens"])
        use = usage(
            result["prompt_tokens"],
            result["generated_tokens"],
            images=result.get("image_tokens"),
            pages=len(pages),
        )
        return text, result.get("finish_reason", "stop"), use

    def _check_document(self, req: ChatCompletionRequest) -> None:
        """Refuses a document request this server cannot answer as asked."""
        if not self.backend.has_documents:
            raise APIError(
                f"images and files need the document model ({self.settings.model}{P.DOCUMENT_SUFFIX}), which this "
                "Triton does not serve (write the repository from a checkpoint folder with a vision tower)",
                param="messages",
            )
        last = req.messages[-1]
        if last.role != "user" or not last.attachments():
            raise APIError("images and files must be in the last message, a user message", param="messages")
        for name, neutral in _GREEDY.items():
            value = getattr(req, name)
            if name in req.model_fields_set and value != neutral and not (name == "stop_token_ids" and value == []):
                raise APIError(
                    f"{name} is not supported with images or files: a document is transcribed greedily "
                    f"(with the page-count guard and no-repeat rules); leave {name} out",
                    param=name,
                )
        if any(m.attachments() for m in req.messages[:-1]):
            raise APIError("a document is answered in one turn: only the last message may hold images or files")

    async def _files(self, req: ChatCompletionRequest) -> list[tuple[str, bytes]]:
        """The last message's attachments as ``(name, bytes)``, each through the URL guard, all
        of them within the request's ``--fetch-total-mb`` (counted as they are fetched)."""
        files, budget = [], Budget(self.settings.fetch_total_bytes)
        for i, part in enumerate(req.messages[-1].attachments()):
            param = f"messages[{len(req.messages) - 1}].content[{i}]"
            if part.type == "image_url":
                url, name = part.image_url.url, f"image {i + 1}"
            else:
                spec = part.file if part.type == "file" else part
                if spec.file_id is not None or spec.file_data is None:
                    raise APIError("files are sent inline (file_data); file ids are not supported", param=param)
                url, name = spec.file_data, spec.filename or f"file {i + 1}"
                if not url.startswith("data:"):
                    url = "data:application/octet-stream;base64," + url  # bare base64, as OpenAI accepts
            files.append((name, await fetch_attachment(url, self.settings, param, budget)))
        return files
