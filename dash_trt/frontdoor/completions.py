"""``POST /v1/completions``: ``prompt`` as text, token ids, or a list of either (one completion
each, ``choices[i]``); greedy at ``temperature`` 0 (the same tokens as offline generation),
sampling otherwise; ``stream`` as server-sent events, with ``stream_options.include_usage`` a
final chunk of usage; vLLM's ``top_k``, ``stop_token_ids``, ``ignore_eos``; ``image_features``."""

from __future__ import annotations

import asyncio
import time
import uuid

import numpy as np
from fastapi import Request

from .backend import triton_error
from .endpoint import Endpoint, usage
from .models import APIError, CompletionRequest
from .streaming import stream_response

__all__ = ["Completions"]

ROUTE = "/v1/completions"


class Completions(Endpoint):
    """The handler of ``POST /v1/completions``."""

    async def handle(self, request: Request):
        t0 = time.perf_counter()
        req: CompletionRequest = await self.read_json(request, CompletionRequest)
        self.check_model(req.model)
        prompts = [await self.encode(p) for p in req.prompts()]
        feats = _features(req)
        if feats is not None and len(prompts) > 1:
            raise APIError("image_features go with a single prompt", param="image_features")
        args = (req.max_tokens, not req.ignore_eos, req.stop_token_ids, req.sampling())
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(index: int, text: str, reason: str | None) -> dict:
            return self._answer(
                rid, created, [{"index": index, "text": text, "logprobs": None, "finish_reason": reason}]
            )

        if req.stream:
            return await stream_response(self, prompts, args, feats, req.include_usage, chunk)
        results = await self.infer(
            request, asyncio.gather(*(self.backend.generate(p, *args, feats) for p in prompts), return_exceptions=True)
        )
        choices, total_p, total_c, total_cached = [], 0, 0, 0
        for i, (p, r) in enumerate(zip(prompts, results)):
            if isinstance(r, BaseException):
                raise triton_error(r, self.settings.triton_grpc)
            tokens, cached = r
            choices.append(
                {
                    "index": i,
                    "text": self.decode(tokens),
                    "logprobs": None,
                    "finish_reason": self.finish(tokens, req.max_tokens, not req.ignore_eos, req.stop_token_ids),
                }
            )
            total_p, total_c, total_cached = total_p + len(p), total_c + len(tokens), total_cached + cached
        self.metrics.count_tokens(total_p, total_c)
        self.metrics.seconds.labels(ROUTE).observe(time.perf_counter() - t0)
        return {**self._answer(rid, created, choices), "usage": usage(total_p, total_c, total_cached)}

    def _answer(self, rid: str, created: int, choices: list[dict]) -> dict:
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": self.settings.model,
            "choices": choices,
        }


def _features(req: CompletionRequest) -> np.ndarray | None:
    """``image_features`` as a float32 matrix (one row per ``<image>`` token), or None."""
    if req.image_features is None:
        return None
    try:
        arr = np.asarray(req.image_features, dtype=np.float32)
    except ValueError:  # rows of different lengths
        raise APIError("image_features rows must all have the same length", param="image_features") from None
    if arr.ndim != 2:
        raise APIError("image_features must be a list of rows (one per <image> token)", param="image_features")
    return arr
