"""What `rollout serve` reports at GET /metrics, in Prometheus' text format.

Each server has its own registry (two servers in one process, a test's and a run's, never mix
their counts). Updating a metric is a few increments under prometheus_client's locks, on the
event loop (about 4 us a request here). A scrape renders the registry in a worker thread, so the
loop goes on meanwhile: 1-9 ms on these machines, from a fresh server's few series to 30
latency series (benchmarks/metrics_scrape.py measures what a scraper costs the requests).

Labels are bounded: a route is one the server serves (or "other": a client's made-up path never
becomes a series), an error kind is the error's OpenAI code or type, which the server chooses.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from rollout.engines.service import EngineService

__all__ = ["CONTENT_TYPE_LATEST", "ServeMetrics"]

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
"""Seconds: from a /v1/models answer to a long streamed completion."""


class ServeMetrics:
    """The server's metrics: request latency by route and status, requests in flight, tokens
    generated, errors by kind, and the engine batch's occupancy (read at scrape time)."""

    def __init__(self, service: EngineService) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.latency = Histogram(
            "rollout_serve_request_seconds",
            "Time from a request's arrival to the end of its answer (a stream's last event).",
            ["route", "status"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "rollout_serve_requests_in_flight",
            "Requests being answered now.",
            registry=self.registry,
        )
        self.tokens = Counter(
            "rollout_serve_generated_tokens",
            "Completion tokens sent to clients.",
            registry=self.registry,
        )
        self.errors = Counter(
            "rollout_serve_errors",
            "Requests answered with an error, by the error's code or type.",
            ["kind"],
            registry=self.registry,
        )
        rows = Gauge(
            "rollout_serve_batch_rows",
            "Sequences the engine sampled together at its last step.",
            registry=self.registry,
        )
        rows.set_function(lambda: service.occupancy[0])
        capacity = Gauge(
            "rollout_serve_batch_capacity",
            "The most sequences the engine samples together.",
            registry=self.registry,
        )
        capacity.set_function(lambda: service.occupancy[1])

    def render(self) -> bytes:
        return generate_latest(self.registry)
