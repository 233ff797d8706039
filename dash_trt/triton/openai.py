"""Moved: the OpenAI front door is the package :mod:`dash_trt.frontdoor` (``create_app`` in
``frontdoor/app.py``, the handlers in ``completions.py``, ``chat.py``, ``ocr.py``, the URL guard
in ``attachments.py``, the middleware in ``http_guard.py``, ``TritonBackend`` in ``backend.py``,
``FrontDoor`` in ``server.py``, the ``dash-triton openai`` command line in ``cli.py``).

This module re-exports the names it had, for one release; import them from
:mod:`dash_trt.frontdoor`'s modules instead.
"""

from __future__ import annotations

from ..frontdoor.app import create_app
from ..frontdoor.attachments import fetch_attachment
from ..frontdoor.backend import TritonBackend, triton_error
from ..frontdoor.chat import DEFAULT_CHAT_TEMPLATE
from ..frontdoor.cli import API_KEY_ENV, add_parser, openai_main
from ..frontdoor.http_guard import GuardMiddleware, guarded_protocol
from ..frontdoor.metrics import ENDPOINTS, Metrics
from ..frontdoor.models import APIError, ChatCompletionRequest, CompletionRequest, validation_error
from ..frontdoor.server import FrontDoor, OpenAIServer
from ..frontdoor.settings import FrontDoorSettings

__all__ = [
    "FrontDoor",
    "FrontDoorSettings",
    "OpenAIServer",
    "create_app",
    "openai_main",
    "add_parser",
    # public names the module had besides its __all__
    "API_KEY_ENV",
    "APIError",
    "ChatCompletionRequest",
    "CompletionRequest",
    "DEFAULT_CHAT_TEMPLATE",
    "ENDPOINTS",
    "GuardMiddleware",
    "Metrics",
    "TritonBackend",
    "fetch_attachment",
    "guarded_protocol",
    "triton_error",
    "validation_error",
]
