"""The front door's own Prometheus metrics (``GET /metrics``; Triton's are ``dash-triton serve
--metrics-port``'s)."""

from __future__ import annotations

__all__ = ["ENDPOINTS", "Metrics"]

#: The endpoints ``/metrics`` counts by name (others as "other").
ENDPOINTS = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/ocr", "/health", "/metrics")


class Metrics:
    """The front door's own Prometheus metrics (a registry of its own)."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self.requests = Counter(
            "dash_frontdoor_requests", "HTTP requests answered", ["endpoint", "status"], registry=self.registry
        )
        self.tokens = Counter("dash_frontdoor_tokens", "tokens", ["kind"], registry=self.registry)
        self.pages = Counter("dash_frontdoor_pages", "document pages transcribed", registry=self.registry)
        self.in_flight = Gauge("dash_frontdoor_in_flight", "requests being answered", registry=self.registry)
        self.seconds = Histogram(
            "dash_frontdoor_request_seconds", "time to the whole answer", ["endpoint"], registry=self.registry
        )

    @staticmethod
    def endpoint(path: str) -> str:
        """The ``endpoint`` label of a request for ``path``."""
        return path if path in ENDPOINTS else ("/v1/models" if path.startswith("/v1/models/") else "other")

    def count_tokens(self, prompt: int, completion: int) -> None:
        self.tokens.labels("prompt").inc(prompt)
        self.tokens.labels("completion").inc(completion)

    def exposition(self) -> tuple[bytes, str]:
        """The registry in Prometheus' text format, and its content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
