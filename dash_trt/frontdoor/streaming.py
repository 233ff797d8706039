"""Server-sent events of generated tokens: one or several prompts' Triton streams, interleaved
into one event stream (``stream: true`` of completions and chat completions)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

import anyio
from fastapi.responses import StreamingResponse

from ..documents.tokenizer import IncrementalDecoder
from .backend import triton_error
from .endpoint import Endpoint, usage

__all__ = ["event", "event_stream", "stream_response"]

#: ``chunk(index, text, finish_reason)``: one event's object (the endpoint's chunk shape).
Chunk = Callable[..., dict]


def event(obj) -> str:
    """One server-sent event holding ``obj`` as JSON."""
    return f"data: {json.dumps(obj)}\n\n"


def event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def stream_response(
    ep: Endpoint,
    prompts: list[list[int]],
    args: tuple,
    feats,
    include_usage: bool,
    chunk: Chunk,
    first_chunk: dict | None = None,
) -> StreamingResponse:
    """Server-sent events of several prompts' token streams, interleaved. The first answer of
    each stream is awaited before the response starts: a refusal is a 4xx JSON answer.

    ``args`` are the backend's ``(max_tokens, stop_at_eos, stop_ids, sampling)``; ``first_chunk``
    an event sent before any token (chat's role)."""
    streams = [ep.backend.stream(p, *args, feats).__aiter__() for p in prompts]
    firsts = []
    try:
        for s in streams:
            firsts.append(await anext(s, None))
    except Exception as exc:  # the refusal arrives as the stream's first answer
        for s in streams:
            await s.aclose()
        raise triton_error(exc, ep.settings.triton_grpc) from None
    ep.metrics.in_flight.inc()
    interleaved = _Interleaved(ep, prompts, streams, firsts, args, chunk)
    return event_stream(interleaved.events(include_usage, first_chunk))


class _Interleaved:
    """The token streams of several prompts, each pumped into one queue by its own task, as
    events: text as it decodes, a last chunk with the finish reason per prompt, an error event
    for a stream that fails, the usage, ``[DONE]``."""

    def __init__(self, ep: Endpoint, prompts, streams, firsts, args: tuple, chunk: Chunk):
        self.ep, self.prompts, self.streams, self.firsts, self.chunk = ep, prompts, streams, firsts, chunk
        self.max_tokens, self.stop_at_eos, self.stops, _ = args
        self.tokens: list[list[int]] = [[] for _ in prompts]
        self.cached = [0] * len(prompts)
        self.queue: asyncio.Queue = asyncio.Queue()

    async def _pump(self, i: int, s, first) -> None:
        try:
            item = first
            while item is not None:
                await self.queue.put((i, item))
                item = await anext(s, None)
        except Exception as exc:  # noqa: BLE001 - sent as an error event
            await self.queue.put((i, ("error", exc)))
        finally:
            await self.queue.put((i, None))

    async def events(self, include_usage: bool, first_chunk: dict | None) -> AsyncIterator[str]:
        skip = self.ep.skip_special_tokens()
        decoders = [IncrementalDecoder(self.ep.backend.tokenizer, skip_special_tokens=skip) for _ in self.prompts]
        tasks = [asyncio.ensure_future(self._pump(i, s, f)) for i, (s, f) in enumerate(zip(self.streams, self.firsts))]
        open_streams = len(tasks)
        try:
            if first_chunk is not None:
                yield event(first_chunk)
            while open_streams:
                i, item = await self.queue.get()
                if item is None:  # stream i ended
                    open_streams -= 1
                    reason = self.ep.finish(self.tokens[i], self.max_tokens, self.stop_at_eos, self.stops)
                    yield event(self.chunk(i, decoders[i].flush(), reason))
                    continue
                text = self._take(i, item, decoders[i])
                if text:
                    yield text
            prompt_tokens, completion_tokens = sum(len(p) for p in self.prompts), sum(len(t) for t in self.tokens)
            if include_usage:
                c = self.chunk(0, "", None)
                c["choices"] = []
                c["usage"] = usage(prompt_tokens, completion_tokens, sum(self.cached))
                yield event(c)
            yield "data: [DONE]\n\n"
            self.ep.metrics.count_tokens(prompt_tokens, completion_tokens)
        finally:  # also when the client disconnects: the streams are cancelled in Triton
            self.ep.metrics.in_flight.dec()  # first: nothing below may skip it
            for t in tasks:
                t.cancel()
            # A disconnect cancels the response's task scope, and anyio cancels every await in
            # a cancelled scope again: unshielded, the first await here raised and the streams
            # stayed open (and the gauge counted one more request for ever).
            with anyio.CancelScope(shield=True):
                await asyncio.gather(*tasks, return_exceptions=True)
                for s in self.streams:
                    await s.aclose()

    def _take(self, i: int, item: tuple, decoder: IncrementalDecoder) -> str | None:
        """The event for one item of stream ``i``: an error, nothing (the cached count, a token
        whose text is not complete yet) or the text a token completes."""
        kind, value = item
        if kind == "error":
            return event(triton_error(value, self.ep.settings.triton_grpc).body())
        if kind == "cached":
            self.cached[i] = value
            return None
        self.tokens[i].append(value)
        piece = decoder.push(value)
        return event(self.chunk(i, piece, None)) if piece else None
