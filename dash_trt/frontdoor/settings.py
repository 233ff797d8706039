"""The front door's settings: one record that the command line fills and every part reads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .. import triton_protocol as P

__all__ = ["FrontDoorSettings"]


@dataclass
class FrontDoorSettings:
    triton_grpc: str = "127.0.0.1:8001"
    model: str = P.DEFAULT_NAME
    api_key: str | None = None
    tokenizer: str | None = None  #: a checkpoint folder with tokenizer.json (default: the demo's byte tokenizer)
    max_body_bytes: int = 64 * 2**20
    header_timeout: float = 10.0
    body_timeout: float = 30.0  #: seconds a body may stall between two reads
    body_deadline: float = 300.0  #: seconds a body may take in all, from its first read
    request_timeout: float = 3600.0
    allow_file_root: str | None = None
    allow_url_hosts: tuple[str, ...] = ()
    fetch_max_bytes: int = 32 * 2**20  #: one attachment
    fetch_total_bytes: int = 128 * 2**20  #: every attachment of one request, counted as they are fetched
    fetch_timeout: float = 10.0
    default_max_tokens: int = 2048  #: chat completions without max_tokens
    #: with an API key, /metrics answers without it too (a Prometheus scraper without the key)
    public_metrics: bool = False
    #: text (prompts, messages) may spell control tokens (<PAGE>, <image>, the tokenizer's special
    #: tokens), which then become those tokens; off: such text is refused (400)
    allow_control_text: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
