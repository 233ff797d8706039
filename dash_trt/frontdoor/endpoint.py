"""What every route handler of the front door shares (:class:`Endpoint`): the settings, the
metrics, the backend the app's lifespan started, and the steps of a request that completions,
chat and OCR have in common (the model check, the JSON body, a Triton call that a client's
disconnect cancels, usage, finish reasons, encoding and decoding, and the refusal of text that
spells a control token)."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from fastapi import Request
from pydantic import ValidationError

from ..documents.tokenizer import ByteTokenizer, TextTokenizer
from .backend import TritonBackend, triton_error
from .metrics import Metrics
from .models import APIError, validation_error
from .settings import FrontDoorSettings

__all__ = ["Endpoint", "usage"]


def usage(prompt: int, completion: int, cached: int = 0, images: int | None = None, pages: int | None = None):
    """OpenAI's ``usage`` object (``prompt_tokens_details`` with the cached, image and page counts)."""
    details: dict[str, int] = {"cached_tokens": cached}
    if images is not None:
        details["image_tokens"] = images
    if pages is not None:
        details["pages"] = pages
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": details,
    }


class Endpoint:
    """The base of the route handlers. ``state["backend"]`` is the backend the app's lifespan
    started (shared by every handler of one app)."""

    def __init__(self, settings: FrontDoorSettings, metrics: Metrics, state: dict[str, Any]):
        self.settings, self.metrics, self.state = settings, metrics, state

    @property
    def backend(self) -> TritonBackend:
        return self.state["backend"]

    # ----------------------------------------------------------------- the request
    def check_model(self, name: str | None) -> None:
        if name not in (None, self.settings.model):
            raise APIError(
                f"model {name!r} is not served here (this endpoint serves {self.settings.model!r})",
                status=404,
                param="model",
                kind="not_found_error",
                code="model_not_found",
            )

    async def read_json(self, request: Request, model_cls):
        """The body as ``model_cls``; anything else (not JSON, not text, not an object, a field
        pydantic refuses) is a 400."""
        raw = await request.body()
        try:
            body = json.loads(raw or b"null")
            # a lone UTF-16 surrogate ("\ud800") parses as JSON but is no text: refused here,
            # not as a 500 wherever it is first encoded
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise APIError("the body holds a lone UTF-16 surrogate (\\ud800-\\udfff): not valid text") from None
        except (ValueError, UnicodeDecodeError) as exc:  # JSON errors; an integer of over 4300 digits
            raise APIError(f"the body is not valid JSON: {exc}") from None
        except RecursionError:
            raise APIError("the body is nested too deeply") from None
        if not isinstance(body, dict):
            raise APIError("the request body must be a JSON object")
        try:
            return model_cls.model_validate(body)
        except ValidationError as exc:
            raise validation_error(exc) from None

    # ----------------------------------------------------------------- Triton calls
    async def guarded(self, request: Request, coro):
        """``coro``'s result, or its cancellation when the client disconnects (or this handler
        is cancelled). A cancelled ``coro`` (an ``asyncio.gather`` too) has its outcome
        retrieved when it ends, so asyncio logs no "exception was never retrieved"."""
        task = asyncio.ensure_future(coro)
        gone = asyncio.ensure_future(_until_disconnected(request))
        try:
            done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
            if task not in done:
                raise APIError("the client disconnected", status=499, code="client_disconnected")
            return task.result()
        finally:
            gone.cancel()
            if not task.done():
                task.cancel()
                task.add_done_callback(_retrieved)

    async def infer(self, request: Request, coro):
        """:meth:`guarded` counted in flight, a Triton failure raised as its OpenAI error."""
        self.metrics.in_flight.inc()
        try:
            return await self.guarded(request, coro)
        except APIError:
            raise
        except Exception as exc:
            raise triton_error(exc, self.settings.triton_grpc) from None
        finally:
            self.metrics.in_flight.dec()

    # ----------------------------------------------------------------- tokens
    def finish(self, tokens: list[int], max_tokens: int, stop_at_eos: bool, stops) -> str:
        """OpenAI's ``finish_reason``: "stop" at EOS or a stop id (even at the last allowed
        position, as vLLM answers), "length" at ``max_tokens``."""
        eos = self.backend.config.eos_token_id
        if tokens and ((stop_at_eos and tokens[-1] == eos) or tokens[-1] in (stops or ())):
            return "stop"
        return "length" if len(tokens) >= max_tokens else "stop"

    def check_length(self, chars: int, param: str) -> None:
        """Refuses text too long for the model before it is tokenized: more characters than
        the model's longest prompt times the most characters one token covers (exact: what is
        refused here could never be admitted; tokenizers without that bound are not checked)."""
        most = getattr(self.backend, "max_prompt_tokens", None)  # optional in a backend
        per = getattr(self.backend, "max_token_chars", None)
        if most and per and chars > most * per:
            raise APIError(
                f"the prompt's {chars} characters are more than this model's {most} tokens can hold "
                f"(one token is at most {per} characters)",
                param=param,
                code="context_length_exceeded",
            )

    def check_text(self, text: str, param: str) -> None:
        """Refuses client text that spells a control token (``<PAGE>``, ``<image>``, the
        tokenizer's special tokens), which the tokenizer would turn into that token: a client
        could then fake pages or a template's turns. ``--allow-control-text`` lets it through
        (the markup of trusted clients); token ids are never checked."""
        if self.settings.allow_control_text or not text:
            return
        tok = self.backend.tokenizer
        made = self.state.get("control_pattern")
        if made is None or made[0] is not tok:  # made once per tokenizer, for every handler
            made = self.state["control_pattern"] = (tok, control_pattern(tok, getattr(self.backend, "config", None)))
        pattern = made[1]
        m = pattern.search(text) if pattern is not None else None
        if m:
            raise APIError(
                f"{param} spells the control token {m.group(0)!r} as text, which is refused: send token ids, "
                "or write it some other way (a server for trusted clients may pass --allow-control-text)",
                param=param,
            )

    async def encode(self, prompt) -> list[int]:
        """Token ids of a prompt (text, checked for control tokens and its length first and
        tokenized off the event loop so a long text stalls no other client; or ids as given)."""
        if isinstance(prompt, str):
            self.check_text(prompt, "prompt")
            self.check_length(len(prompt), "prompt")
            try:
                ids = await asyncio.to_thread(self.backend.tokenizer.encode, prompt)
            except ValueError as exc:
                raise APIError(str(exc), param="prompt") from None
            bos = self.backend.tokenizer.bos_id
            return ([bos] if bos is not None else []) + ids
        return list(prompt)

    def skip_special_tokens(self) -> bool:
        """A checkpoint tokenizer's text leaves its special tokens out (as vLLM answers); the
        demo's byte tokenizer shows every token (``<PAGE>``, ``<id>``), as dash-client does."""
        return isinstance(self.backend.tokenizer, TextTokenizer)

    def decode(self, tokens: list[int]) -> str:
        return self.backend.tokenizer.decode(tokens, skip_special_tokens=self.skip_special_tokens())


#: The demo's byte tokenizer's markup (``dash_trt.models.prompts.tokenize``).
_BYTE_MARKUP = re.compile(r"<PAGE>|<image(?:\*\d+)?>")


def control_pattern(tokenizer, config=None) -> re.Pattern | None:
    """A pattern of the text ``tokenizer`` turns into a control token: the demo's markup, or a
    checkpoint tokenizer's special tokens with the model's (``config``'s) ``<PAGE>`` and
    ``<image>`` tokens; None for another tokenizer."""
    if isinstance(tokenizer, ByteTokenizer):
        return _BYTE_MARKUP
    if not isinstance(tokenizer, TextTokenizer):
        return None
    texts = {t.content for t in tokenizer.tokenizer.get_added_tokens_decoder().values() if t.special}
    for tid in (getattr(config, "page_token_id", None), getattr(config, "image_token_id", None)):
        if tid is not None:
            texts.add(tokenizer.tokenizer.id_to_token(tid) or "")
    texts.discard("")
    # the longest first: a token that holds another one is told whole
    return re.compile("|".join(re.escape(t) for t in sorted(texts, key=len, reverse=True))) if texts else None


def _retrieved(fut: asyncio.Future) -> None:
    """Marks a cancelled future's outcome as seen (a cancelled ``gather`` holds a
    CancelledError as its exception)."""
    if not fut.cancelled():
        fut.exception()


async def _until_disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
