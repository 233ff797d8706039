"""What every route handler of the front door shares (:class:`Endpoint`): the settings, the
metrics, the backend the app's lifespan started, and the steps of a request that completions,
chat and OCR have in common (the model check, the JSON body, a Triton call that a client's
disconnect cancels, usage, finish reasons, encoding and decoding)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import Request
from pydantic import ValidationError

from ..documents.tokenizer import TextTokenizer
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
        """``coro``'s result, or its cancellation when the client disconnects."""
        task = asyncio.ensure_future(coro)
        gone = asyncio.ensure_future(_until_disconnected(request))
        try:
            done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
            if task not in done:
                task.cancel()
                raise APIError("the client disconnected", status=499, code="client_disconnected")
            return task.result()
        finally:
            gone.cancel()

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

    async def encode(self, prompt) -> list[int]:
        """Token ids of a prompt (text, length-checked first and tokenized off the event loop so
        a long text stalls no other client; or ids as given)."""
        if isinstance(prompt, str):
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


async def _until_disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
