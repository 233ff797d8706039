"""Generation metrics on Triton's metrics endpoint (Prometheus text on ``--metrics-port``).

The Python backend's custom metrics (``pb_utils.MetricFamily``) carry, per generation model
(label ``model``):

=====================================  =======  ==============================================
name                                   kind     meaning
=====================================  =======  ==============================================
``dash_requests_total``                counter  finished requests, label ``outcome``: done / failed
``dash_prompt_tokens_total``           counter  prompt tokens of the finished requests
``dash_prompt_tokens_cached_total``    counter  those found in the prefix cache (not computed)
``dash_prompt_tokens_computed_total``  counter  those computed (prefilled)
``dash_generated_tokens_total``        counter  tokens generated for them
``dash_time_to_first_token_seconds``   counter  sum of their times to first token (submit -> first
                                                token); divide by ``dash_first_tokens_total``
``dash_first_tokens_total``            counter  requests that got a first token
``dash_request_seconds``               counter  sum of their times from submit to the end
``dash_requests_running``              gauge    sequences in the engine's batch now
``dash_requests_waiting``              gauge    requests queued or waiting for KV blocks now
``dash_kv_blocks_in_use``              gauge    KV blocks held by sequences now
``dash_kv_blocks_total``               gauge    KV blocks in the pool
``dash_kv_blocks_cached``              gauge    KV blocks in the prefix cache (held or not)
``dash_pages_in_flight``               gauge    document pages (``<PAGE>`` markers) of the requests
                                                running or waiting now
``dash_pages_total``                   counter  document pages of the requests that finished done
=====================================  =======  ==============================================

Rates (tokens/s) and means (time to first token) come from the counters, as Prometheus'
``rate()`` and ratios do; no histogram, which the Python backend of Triton 2.51 lacks.
"""

from __future__ import annotations

from typing import Any

PREFIX = "dash_"

#: (name without the prefix, kind, description)
FAMILIES = (
    ("requests_total", "COUNTER", "finished generation requests, by outcome"),
    ("prompt_tokens_total", "COUNTER", "prompt tokens of finished requests"),
    ("prompt_tokens_cached_total", "COUNTER", "prompt tokens of finished requests found in the prefix cache"),
    ("prompt_tokens_computed_total", "COUNTER", "prompt tokens of finished requests computed (prefilled)"),
    ("generated_tokens_total", "COUNTER", "tokens generated for finished requests"),
    ("time_to_first_token_seconds", "COUNTER", "sum of the times from submit to the first token"),
    ("first_tokens_total", "COUNTER", "requests that got a first token"),
    ("request_seconds", "COUNTER", "sum of the times from submit to the end of a request"),
    ("requests_running", "GAUGE", "sequences in the engine's batch"),
    ("requests_waiting", "GAUGE", "requests queued or waiting for KV blocks"),
    ("kv_blocks_in_use", "GAUGE", "KV blocks held by sequences"),
    ("kv_blocks_total", "GAUGE", "KV blocks in the pool"),
    ("kv_blocks_cached", "GAUGE", "KV blocks in the prefix cache"),
    ("pages_in_flight", "GAUGE", "document pages of the requests running or waiting"),
    ("pages_total", "COUNTER", "document pages of the requests that finished done"),
)


class GenerationMetrics:
    """The metric families of one generation model, updated from the engine's events."""

    def __init__(self, pb_utils: Any, model: str):
        kinds = {"COUNTER": pb_utils.MetricFamily.COUNTER, "GAUGE": pb_utils.MetricFamily.GAUGE}
        self._families = {
            name: pb_utils.MetricFamily(name=PREFIX + name, description=desc, kind=kinds[kind])
            for name, kind, desc in FAMILIES
        }
        labels = {"model": model}
        self._m = {name: fam.Metric(labels=labels) for name, fam in self._families.items() if name != "requests_total"}
        total = self._families["requests_total"]
        self._outcome = {o: total.Metric(labels={**labels, "outcome": o}) for o in ("done", "failed")}

    def finished(self, request: Any, ok: bool) -> None:
        """A request ended (done or failed): its tokens and times into the counters."""
        m = self._m
        self._outcome["done" if ok else "failed"].increment(1)
        if ok:
            m["pages_total"].increment(request.pages)
        m["prompt_tokens_total"].increment(len(request.prompt))
        m["prompt_tokens_cached_total"].increment(request.prompt_cached)
        m["prompt_tokens_computed_total"].increment(len(request.prompt) - request.prompt_cached)
        m["generated_tokens_total"].increment(len(request.tokens))
        if request.t_first_token is not None:
            m["first_tokens_total"].increment(1)
            m["time_to_first_token_seconds"].increment(max(0.0, request.t_first_token - request.t_submit))
        if request.t_end is not None:
            m["request_seconds"].increment(max(0.0, request.t_end - request.t_submit))

    def state(self, stats: dict) -> None:
        """The engine's current queue and pool (GenerationEngine.stats()) into the gauges."""
        m = self._m
        m["requests_running"].set(stats["running"])
        m["requests_waiting"].set(stats["waiting"])
        m["kv_blocks_in_use"].set(stats["kv_blocks_total"] - stats["kv_blocks_free"])
        m["kv_blocks_total"].set(stats["kv_blocks_total"])
        m["kv_blocks_cached"].set(stats["kv_blocks_cached"])
        m["pages_in_flight"].set(stats["pages_running"] + stats["pages_waiting"])
