"""The front door's ASGI application: FastAPI with the routes, the error handlers and the
backend's lifespan, behind the HTTP guard."""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from .backend import TritonBackend
from .http_guard import GuardMiddleware, error_handlers
from .metrics import Metrics
from .routes import add_routes
from .settings import FrontDoorSettings

__all__ = ["create_app"]


def create_app(settings: FrontDoorSettings, backend: TritonBackend | None = None) -> GuardMiddleware:
    """The application (``backend`` replaces the Triton one, for embedding): a
    :class:`~dash_trt.frontdoor.http_guard.GuardMiddleware` around the FastAPI app, which keeps
    its metrics in ``app.state.metrics`` and the started backend in
    ``app.state.backend_state["backend"]``."""
    metrics = Metrics()
    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(app):
        b = backend or TritonBackend(settings)
        await b.start()
        state["backend"] = b
        try:
            yield
        finally:
            await b.close()

    app = FastAPI(
        title="dash-trt OpenAI front door",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        exception_handlers=error_handlers(settings),
    )
    add_routes(app, settings, metrics, state)
    app.state.metrics = metrics
    app.state.backend_state = state
    return GuardMiddleware(app, settings, metrics)
