"""The front door's routes: each URL and the handler that answers it.

- ``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /health``, ``GET /metrics``: :class:`Info`;
- ``POST /v1/completions``: :class:`~dash_trt.frontdoor.completions.Completions`;
- ``POST /v1/chat/completions``: :class:`~dash_trt.frontdoor.chat.ChatCompletions`;
- ``POST /v1/ocr``: :class:`~dash_trt.frontdoor.ocr.OCR`.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from .chat import ChatCompletions
from .completions import Completions
from .endpoint import Endpoint
from .metrics import Metrics
from .ocr import OCR
from .settings import FrontDoorSettings

__all__ = ["Info", "add_routes"]


class Info(Endpoint):
    """The model list, the model card, readiness and the front door's Prometheus metrics."""

    def model_card(self) -> dict:
        return {"id": self.settings.model, "object": "model", "created": 0, "owned_by": "dash-trt"}

    async def models(self):
        return {"object": "list", "data": [self.model_card()]}

    async def model(self, model_id: str):
        self.check_model(model_id)
        return self.model_card()

    async def health(self):
        ok = await self.backend.ready()
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    async def prometheus(self):
        content, media_type = self.metrics.exposition()
        return Response(content, media_type=media_type)


def add_routes(app: FastAPI, settings: FrontDoorSettings, metrics: Metrics, state: dict[str, Any]) -> None:
    """Every route of the front door on ``app``; the handlers share ``metrics`` and ``state``
    (``state["backend"]``, set by the app's lifespan)."""
    info = Info(settings, metrics, state)
    app.add_api_route("/v1/models", info.models, methods=["GET"], name="models")
    app.add_api_route("/v1/models/{model_id:path}", info.model, methods=["GET"], name="model")
    app.add_api_route("/health", info.health, methods=["GET"], name="health")
    app.add_api_route("/metrics", info.prometheus, methods=["GET"], name="prometheus")
    for path, handler, name in (
        ("/v1/completions", Completions, "completions"),
        ("/v1/chat/completions", ChatCompletions, "chat"),
        ("/v1/ocr", OCR, "ocr"),
    ):
        app.add_api_route(path, handler(settings, metrics, state).handle, methods=["POST"], name=name)
