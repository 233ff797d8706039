"""The guard in front of every image and file a chat message names by URL.

- ``data:`` URLs (base64), at most ``--fetch-max-mb``;
- ``file://`` only under ``--allow-file-root`` (the real path, links resolved; no NUL byte);
- ``http(s)://`` only for the hosts of ``--allow-url-host``, never to a private, loopback,
  link-local, reserved or multicast address, no redirects, at most ``--fetch-max-mb`` and
  ``--fetch-timeout`` seconds.

Every attachment of one request together is at most ``--fetch-total-mb`` (:class:`Budget`),
counted as each is fetched: past it, fetching stops with a 413 naming the part.

Anything else is an :class:`~dash_trt.frontdoor.models.APIError` (400) naming the field.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import ipaddress
import os
import socket
from urllib.parse import SplitResult, unquote, urlsplit

from .models import APIError
from .settings import FrontDoorSettings

__all__ = ["Budget", "fetch_attachment"]


class Budget:
    """The bytes every attachment of one request may take together (``--fetch-total-mb``):
    :meth:`take` counts each attachment's bytes as they arrive and refuses the first byte
    past the total."""

    def __init__(self, total: int):
        self.total, self.used = total, 0

    def take(self, n: int, param: str) -> None:
        if self.used + n > self.total:
            raise APIError(
                f"the request's attachments are over {self.total / 2**20:g} MiB in all (--fetch-total-mb)",
                status=413,
                param=param,
                code="too_large",
            )
        self.used += n


async def fetch_attachment(url: str, settings: FrontDoorSettings, param: str, budget: Budget | None = None) -> bytes:
    """The bytes an ``image_url`` / ``file_data`` names (module docstring for what is allowed),
    counted in ``budget`` (the request's; a budget of its own when None)."""
    budget = budget or Budget(settings.fetch_total_bytes)
    if url.startswith("data:"):
        return _data_url(url, settings, param, budget)
    parts = urlsplit(url)
    if parts.scheme == "file":
        return _file_url(parts, settings, param, budget)
    if parts.scheme in ("http", "https"):
        return await _http_url(url, parts, settings, param, budget)
    raise APIError(f"unsupported URL scheme {parts.scheme!r} (data:, file:// or http(s)://)", param=param)


def _over(settings: FrontDoorSettings) -> str:
    return f"over {settings.fetch_max_bytes // 2**20} MiB"


def _data_url(url: str, settings: FrontDoorSettings, param: str, budget: Budget) -> bytes:
    head, _, data = url.partition(",")
    if ";base64" not in head:
        raise APIError("data URLs must be base64 (data:<type>;base64,...)", param=param)
    if len(data) * 3 // 4 > settings.fetch_max_bytes:
        raise APIError(f"the attachment is {_over(settings)}", param=param)
    budget.take(len(data) * 3 // 4, param)  # before decoding
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise APIError("the data URL is not valid base64", param=param) from None


def _file_url(parts: SplitResult, settings: FrontDoorSettings, param: str, budget: Budget) -> bytes:
    root = settings.allow_file_root
    if root is None:
        raise APIError("file:// URLs are not allowed on this server (see --allow-file-root)", param=param)
    raw_path = unquote(parts.path)
    if "\x00" in raw_path:
        raise APIError("a file:// URL's path holds a NUL byte (%00)", param=param)
    path = os.path.realpath(raw_path)
    if os.path.commonpath([path, os.path.realpath(root)]) != os.path.realpath(root):
        raise APIError(f"{parts.path} is outside the allowed folder", param=param)
    if not os.path.isfile(path):
        raise APIError(f"{parts.path}: no such file", param=param)
    size = os.path.getsize(path)
    if size > settings.fetch_max_bytes:
        raise APIError(f"{parts.path} is {_over(settings)}", param=param)
    budget.take(size, param)  # before reading
    with open(path, "rb") as fh:
        data = fh.read(settings.fetch_max_bytes + 1)  # a file that grew since: still bounded
    if len(data) > settings.fetch_max_bytes:
        raise APIError(f"{parts.path} is {_over(settings)}", param=param)
    budget.take(max(0, len(data) - size), param)
    return data


async def _http_url(url: str, parts: SplitResult, settings: FrontDoorSettings, param: str, budget: Budget) -> bytes:
    host = parts.hostname or ""
    if host not in settings.allow_url_hosts:
        raise APIError(f"fetching from {host or 'that URL'} is not allowed (see --allow-url-host)", param=param)
    if await asyncio.to_thread(_private, host):
        raise APIError(f"{host} resolves to a private address", param=param)
    import httpx

    try:
        async with httpx.AsyncClient(timeout=settings.fetch_timeout, follow_redirects=False) as client:
            async with client.stream("GET", url) as res:
                if res.status_code != 200:
                    raise APIError(f"fetching {url} gave HTTP {res.status_code}", param=param)
                chunks, size = [], 0
                async for chunk in res.aiter_bytes():
                    size += len(chunk)
                    if size > settings.fetch_max_bytes:
                        raise APIError(f"{url} is {_over(settings)}", param=param)
                    budget.take(len(chunk), param)
                    chunks.append(chunk)
                return b"".join(chunks)
    except httpx.HTTPError as exc:
        raise APIError(f"fetching {url} failed: {type(exc).__name__}", param=param) from None


def _private(host: str) -> bool:
    """The host resolves to a private, loopback, link-local or reserved address."""
    try:
        infos = socket.getaddrinfo(host, None)
    except socket.gaierror:
        return True
    for info in infos:
        ip = ipaddress.ip_address(info[4][0])
        if ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_reserved or ip.is_multicast:
            return True
    return False
