"""``dash-triton openai``: the OpenAI front door in front of a Triton server serving the DASH
repository, on FastAPI, uvicorn and pydantic.

The command line of :mod:`dash_trt.frontdoor` (its docstring lists the endpoints and limits):
``dash_trt.triton.cli`` registers it as the ``openai`` subcommand of ``dash-triton``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
from typing import TextIO

from ..cliutil import EXIT_CODES_NOTE, VERBOSE_HELP
from .backend import TritonBackend
from .server import FrontDoor
from .settings import FrontDoorSettings

__all__ = ["API_KEY_ENV", "add_parser", "openai_main"]

API_KEY_ENV = "DASH_TRT_API_KEY"


def add_parser(sub) -> argparse.ArgumentParser:
    o = sub.add_parser(
        "openai",
        epilog="Exit codes: 0 stopped (Ctrl-C), 2 the Triton model cannot be reached or the port cannot be bound, "
        + EXIT_CODES_NOTE,
        help="serve the OpenAI API (completions, chat completions with images and PDFs, OCR) in front of Triton",
        description=__doc__.split("\n\n")[0],
    )
    d = FrontDoorSettings()
    o.add_argument("--url", default="127.0.0.1:8000", help="Triton's HTTP endpoint (not used; kept for scripts)")
    o.add_argument("--grpc-url", default=d.triton_grpc, help="Triton's gRPC endpoint (%(default)s)")
    o.add_argument("--model", default=d.model, help="the generation model's name (%(default)s)")
    o.add_argument("--host", default="127.0.0.1", help="address to bind (%(default)s)")
    o.add_argument("--port", type=int, default=9000, help="port to bind (%(default)s)")
    o.add_argument("--api-key", help=f"the key clients send as 'Authorization: Bearer KEY' (or ${API_KEY_ENV})")
    o.add_argument(
        "--public-metrics",
        action="store_true",
        help="with an API key: /metrics answers without it (/health always does)",
    )
    o.add_argument(
        "--tokenizer",
        help="a checkpoint folder with tokenizer.json (default: the demo model's bytes; required in front of a "
        "repository with a document model)",
    )
    o.add_argument("--max-body-mb", type=float, default=d.max_body_bytes / 2**20, help="(%(default)g)")
    o.add_argument("--header-timeout", type=float, default=d.header_timeout, help="seconds (%(default)g)")
    o.add_argument("--body-timeout", type=float, default=d.body_timeout, help="seconds a body may stall (%(default)g)")
    o.add_argument(
        "--body-deadline",
        type=float,
        default=d.body_deadline,
        help="seconds a whole body may take from its first read, however it trickles (%(default)g)",
    )
    o.add_argument("--allow-file-root", help="file:// attachments are read only under this folder (default: none)")
    o.add_argument(
        "--allow-url-host", action="append", default=[], help="a host http(s) attachments may come from (repeatable)"
    )
    o.add_argument(
        "--fetch-max-mb", type=float, default=d.fetch_max_bytes / 2**20, help="MiB of one attachment (%(default)g)"
    )
    o.add_argument(
        "--fetch-total-mb",
        type=float,
        default=d.fetch_total_bytes / 2**20,
        help="MiB of all the attachments of one request together, counted as they are fetched: past it the "
        "request is refused (413) and fetching stops (%(default)g)",
    )
    o.add_argument("--fetch-timeout", type=float, default=d.fetch_timeout, help="seconds (%(default)g)")
    o.add_argument(
        "--allow-control-text",
        action="store_true",
        help="prompt and message text may spell control tokens (<PAGE>, <image>, <image*N>, the tokenizer's special "
        "tokens), which then become those tokens: for trusted clients only (default: such text is refused, 400; "
        "token-id prompts are never affected)",
    )
    o.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    return o


def openai_main(a, out: TextIO, err: TextIO) -> int:
    if not 0 < a.port <= 65535:
        print(f"dash-triton openai: error: --port must be 1..65535, got {a.port}", file=err)
        return 2
    for name in (
        "max_body_mb",
        "header_timeout",
        "body_timeout",
        "body_deadline",
        "fetch_max_mb",
        "fetch_total_mb",
        "fetch_timeout",
    ):
        if getattr(a, name) <= 0:
            print(f"dash-triton openai: error: --{name.replace('_', '-')} must be positive", file=err)
            return 2
    settings = FrontDoorSettings(
        triton_grpc=a.grpc_url,
        model=a.model,
        api_key=a.api_key or os.environ.get(API_KEY_ENV) or None,
        public_metrics=a.public_metrics,
        tokenizer=a.tokenizer,
        max_body_bytes=int(a.max_body_mb * 2**20),
        header_timeout=a.header_timeout,
        body_timeout=a.body_timeout,
        body_deadline=a.body_deadline,
        allow_file_root=a.allow_file_root,
        allow_url_hosts=tuple(a.allow_url_host),
        fetch_max_bytes=int(a.fetch_max_mb * 2**20),
        fetch_total_bytes=int(a.fetch_total_mb * 2**20),
        allow_control_text=a.allow_control_text,
        fetch_timeout=a.fetch_timeout,
    )
    try:
        probe = TritonBackend(settings)
        asyncio.run(_probe(probe))
    except Exception as exc:  # noqa: BLE001 - one line: the model cannot be reached
        print(f"dash-triton openai: error: {exc}", file=err)
        return 2
    door = FrontDoor(settings, host=a.host, port=a.port)
    try:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((a.host, a.port))
        sock.close()
    except OSError as exc:
        print(f"dash-triton openai: error: cannot bind {a.host}:{a.port}: {exc.strerror or exc}", file=err)
        return 2
    print(
        f"OpenAI API for '{a.model}' on http://{a.host}:{a.port}/v1 (Triton gRPC {a.grpc_url}"
        + ("; API key required" if settings.api_key else "")
        + "); Ctrl-C stops",
        file=out,
        flush=True,
    )
    door.serve()
    return 0


async def _probe(backend: TritonBackend) -> None:
    try:
        await backend.start()
    finally:
        await backend.close()
