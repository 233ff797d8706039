"""The front door as a server: uvicorn (h11 with the header timeout, a listen backlog of 2048)
serving :func:`~dash_trt.frontdoor.app.create_app`."""

from __future__ import annotations

import threading
import time

from .. import triton_protocol as P
from .app import create_app
from .http_guard import guarded_protocol
from .settings import FrontDoorSettings

__all__ = ["FrontDoor", "OpenAIServer"]


class FrontDoor:
    """The front door as a server object: ``start()`` serves on a background thread (tests,
    embedding), ``serve()`` in the calling thread (the CLI)."""

    def __init__(self, settings: FrontDoorSettings, *, host: str = "127.0.0.1", port: int = 9000, backend=None):
        import uvicorn

        self.settings = settings
        self.app = create_app(settings, backend)
        self.config = uvicorn.Config(
            self.app,
            host=host,
            port=port,
            http=guarded_protocol(settings.header_timeout),
            backlog=2048,
            timeout_keep_alive=5,
            log_level="warning",
            access_log=False,
            lifespan="on",
            h11_max_incomplete_event_size=64 * 1024,
        )
        self.server = uvicorn.Server(self.config)
        self.host = host
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        servers = getattr(self.server, "servers", None) or []
        for s in servers:
            for sock in s.sockets:
                return sock.getsockname()[1]
        return self.config.port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def serve(self) -> None:
        self.server.run()

    def start(self, timeout: float = 60.0) -> FrontDoor:
        self._thread = threading.Thread(target=self.server.run, name="dash-frontdoor", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the front door failed to start (see the log above)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the front door did not start within {timeout:g} s")
            time.sleep(0.05)
        return self

    def close(self) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30)


def OpenAIServer(
    triton_http: str, triton_grpc: str | None = None, *, host="127.0.0.1", port=9000, model=P.DEFAULT_NAME, **kw
):
    """The front door for the Triton at ``triton_grpc`` (``triton_http`` is kept for older callers)."""
    settings = FrontDoorSettings(triton_grpc=triton_grpc or "127.0.0.1:8001", model=model, **kw)
    return FrontDoor(settings, host=host, port=port)
