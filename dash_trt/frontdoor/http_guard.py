"""The front door's HTTP guard, in front of every route.

- :class:`GuardMiddleware` (pure ASGI): the API key (every path but ``/health``, and
  ``/metrics`` with ``--public-metrics``; compared in constant time), ``Content-Length`` against
  ``--max-body-mb`` (413 before the body is read), ``application/json`` on JSON posts, the body
  counted as it arrives (over the cap: 413; stalled past ``--body-timeout``, or not complete
  within ``--body-deadline`` of its first read however it trickles: 408), every answer
  counted by endpoint and status for ``/metrics``;
- :func:`guarded_protocol`: uvicorn's h11 protocol with ``--header-timeout`` (a slow client
  holds no socket);
- :func:`error_handlers`: every refusal as OpenAI's error object (JSON), the unknown route and
  method included; a client gone while its body was read is answered 499 (nginx's code for
  it, what ``/metrics`` counts), without a traceback.
"""

from __future__ import annotations

import asyncio
import hmac

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect

from .metrics import Metrics
from .models import APIError
from .settings import FrontDoorSettings

__all__ = ["BodyTimeout", "BodyTooLarge", "GuardMiddleware", "error_handlers", "guarded_protocol", "json_error"]


class BodyTooLarge(Exception):
    """The body grew past ``--max-body-mb`` while it was read (answered 413)."""


class BodyTimeout(Exception):
    """The body stalled past ``--body-timeout``, or was not complete within ``--body-deadline``
    (answered 408 with ``reason``)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def json_error(exc: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


def _keyed(path: str, s: FrontDoorSettings) -> bool:
    """Whether ``path`` needs the API key (when one is set): everything but ``/health`` (a load
    balancer's probe), and ``/metrics`` with ``public_metrics``."""
    return path != "/health" and not (path == "/metrics" and s.public_metrics)


class GuardMiddleware:
    """API key on /v1/*, JSON content type on JSON posts, the body's size cap and read timeout
    (pure ASGI: the body is counted as it arrives, never buffered here)."""

    def __init__(self, app, settings: FrontDoorSettings, metrics: Metrics):
        self.app, self.s, self.metrics = app, settings, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, method = scope["path"], scope["method"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            self._check(path, method, headers)
        except APIError as exc:
            return await json_error(exc)(scope, receive, self._counted(send, path))
        body = _BodyGuard(
            receive,
            self.s.max_body_bytes,
            self.s.body_timeout,
            self.s.body_deadline,
            done=method in ("GET", "HEAD"),
        )
        # a body over the cap or stalled raises in the app, whose handlers answer 413 / 408
        await self.app(scope, body, self._counted(send, path))

    def _check(self, path: str, method: str, headers: dict[str, str]) -> None:
        """Raises the refusal of a request from its headers alone."""
        if self.s.api_key and _keyed(path, self.s):
            auth = headers.get("authorization", "")
            # compared in constant time: the time to refuse says nothing of the key
            if not auth.startswith("Bearer ") or not hmac.compare_digest(
                auth[7:].encode("utf-8", "surrogateescape"), self.s.api_key.encode("utf-8")
            ):
                raise APIError(
                    "invalid or missing API key (Authorization: Bearer KEY)",
                    status=401,
                    code="invalid_api_key",
                )
        length = headers.get("content-length")
        if length is not None and not length.isdigit():
            raise APIError("Content-Length is not a number", status=400)
        if length is not None and int(length) > self.s.max_body_bytes:
            raise APIError(
                f"the request body is over {self.s.max_body_bytes // 2**20} MiB", status=413, code="too_large"
            )
        if method == "POST" and path != "/v1/ocr":
            ctype = headers.get("content-type", "").split(";")[0].strip().lower()
            if ctype != "application/json":
                raise APIError(
                    f"Content-Type must be application/json, got {ctype or 'none'}",
                    status=415,
                    code="unsupported_media_type",
                )

    def _counted(self, send, path: str):
        """``send`` that counts every response by endpoint and status (``/metrics``)."""
        endpoint = self.metrics.endpoint(path)

        async def counting(message):
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        return counting


class _BodyGuard:
    """An ASGI ``receive`` that counts the body as it arrives: past ``limit`` bytes it raises
    :class:`BodyTooLarge`; after ``timeout`` seconds without a message, or ``deadline`` seconds
    after its first read with the body still incomplete (a client sending a byte just inside
    every timeout), :class:`BodyTimeout`. Once the body is complete (or for a request without
    one) it waits as long as ``receive``. ``clock``: seconds, monotonic (the event loop's)."""

    def __init__(self, receive, limit: int, timeout: float, deadline: float, *, done: bool, clock=None):
        self.receive, self.limit, self.timeout, self.deadline, self.done = receive, limit, timeout, deadline, done
        self.clock = clock
        self.seen = 0
        self.start = None

    async def __call__(self):
        if self.done:
            return await self.receive()
        clock = self.clock or asyncio.get_running_loop().time
        if self.start is None:
            self.start = clock()
        left = self.deadline - (clock() - self.start)
        if left <= 0:
            raise BodyTimeout(f"the request body was not complete within {self.deadline:g} s")
        try:
            message = await asyncio.wait_for(self.receive(), min(self.timeout, left))
        except asyncio.TimeoutError:
            if self.timeout < left:
                raise BodyTimeout(f"the request body stalled for {self.timeout:g} s") from None
            raise BodyTimeout(f"the request body was not complete within {self.deadline:g} s") from None
        if message["type"] == "http.request":
            self.seen += len(message.get("body", b""))
            if self.seen > self.limit:
                raise BodyTooLarge()
            if not message.get("more_body", False):
                self.done = True
        return message


def error_handlers(settings: FrontDoorSettings) -> dict:
    """The application's exception handlers: each answers OpenAI's error object."""

    async def api_error(request, exc: APIError):
        return json_error(exc)

    async def too_large(request, exc):
        limit = settings.max_body_bytes // 2**20
        return json_error(APIError(f"the request body is over {limit} MiB", status=413, code="too_large"))

    async def stalled(request, exc: BodyTimeout):
        return json_error(APIError(exc.reason, status=408, code="timeout"))

    async def disconnected(request, exc):
        # the client left while its body was read: nobody reads the answer, but /metrics
        # counts it as 499 (not a 500 with a traceback in the log)
        return json_error(APIError("the client disconnected", status=499, code="client_disconnected"))

    async def validation(request, exc):
        return json_error(APIError(f"invalid request: {exc.errors()[0].get('msg')}"))

    async def not_found(request, exc):
        await _drained(request)
        return json_error(APIError(f"no route {request.url.path}", status=404, kind="not_found_error", code=None))

    async def method(request, exc):
        await _drained(request)
        return json_error(APIError(f"{request.method} is not allowed on {request.url.path}", status=405, code=None))

    return {
        APIError: api_error,
        BodyTooLarge: too_large,
        BodyTimeout: stalled,
        ClientDisconnect: disconnected,
        RequestValidationError: validation,
        404: not_found,
        405: method,
    }


async def _drained(request) -> None:
    """Read (and drop) a refused request's body, so the connection stays in step for the next
    request (keep-alive); the middleware bounds it."""
    try:
        await request.body()
    except Exception:  # noqa: BLE001 - a body that cannot be read: the connection closes anyway
        pass


def guarded_protocol(header_timeout: float):
    """uvicorn's h11 protocol, closing a connection whose request headers do not arrive within
    ``header_timeout`` seconds of its first byte (or of the connection): a slow client cannot
    hold a socket open forever (uvicorn's own keep-alive timeout starts only after a response)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        _deadline = None

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm()

        def _arm(self):
            self._disarm()
            self._deadline = self.loop.call_later(header_timeout, self._expired)

        def _disarm(self):
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _waiting(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def data_received(self, data):
            if self._waiting() and self._deadline is None:
                self._arm()
            super().data_received(data)
            if not self._waiting():
                self._disarm()

        def on_response_complete(self):
            super().on_response_complete()

        def _expired(self):
            self._deadline = None
            if self._waiting() and not self.transport.is_closing():
                self.transport.close()

        def connection_lost(self, exc):
            self._disarm()
            super().connection_lost(exc)

    return GuardedH11Protocol
