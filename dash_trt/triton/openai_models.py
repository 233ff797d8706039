"""Moved: the front door's request models are :mod:`dash_trt.frontdoor.models`.

This module re-exports the names it had, for one release; import them from
:mod:`dash_trt.frontdoor.models` instead.
"""

from __future__ import annotations

from ..frontdoor.models import (
    MAX_PROMPTS,
    MAX_SEED,
    MAX_TOKEN_ID,
    MAX_TOKENS_LIMIT,
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ContentPart,
    FileData,
    FilePart,
    ImagePart,
    ImageURL,
    InputFilePart,
    StreamOptions,
    TextPart,
    TokenId,
    validation_error,
)

__all__ = [
    "APIError",
    "CompletionRequest",
    "ChatCompletionRequest",
    "ChatMessage",
    "validation_error",
    "MAX_TOKENS_LIMIT",
    # public names the module had besides its __all__
    "ContentPart",
    "FileData",
    "FilePart",
    "ImagePart",
    "ImageURL",
    "InputFilePart",
    "MAX_PROMPTS",
    "MAX_SEED",
    "MAX_TOKEN_ID",
    "StreamOptions",
    "TextPart",
    "TokenId",
]
