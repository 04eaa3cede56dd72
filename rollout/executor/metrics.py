"""The run host's Prometheus /metrics ([logging] metrics_port): how the run goes, for a scraper.

The workers never see it. They write their metrics to the run store through their background
writers, as always; this server reads the run's latest values from the store when it is
scraped (the same read the host's progress bar makes twice a second), at most once a second
however often it is scraped. So a scrape adds no work, lock or I/O to a worker's step.

One thread, started before the workers and stopped on every way the host ends (`with`): an
http.server on metrics_host, loopback by default; anywhere else it needs metrics_key (a
secret reference, read at start), sent as 'Authorization: Bearer <key>' and compared in
constant time. The store connection is opened in that thread, which alone uses it.

Exposed: rollout_run_step, rollout_run_step_seconds, rollout_run_tokens_per_second,
rollout_run_reward_mean, rollout_run_loss, rollout_run_restarts, rollout_run_queue{name} (the
work queue's queue/* metrics), rollout_run_status{status}, rollout_run_errors_total{kind} (error
lines the workers logged, by role; failed reads of the store), and every latest metric as
rollout_run_metric{name} (docs/observability.md).
"""

from __future__ import annotations

import hmac
import logging
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from rollout.config.cluster import is_loopback
from rollout.errors import Issue, RolloutError
from rollout.files import read_secret
from rollout.redact import redact_text
from rollout.storage.base import RUN_STATUSES, MetricRecord, RunStore

log = logging.getLogger("rollout.executor.metrics")

REFRESH_S = 1.0
"""Scrapes closer together than this are answered from the last read of the store."""
LOG_PAGE = 1000
LOG_PAGES_PER_SCRAPE = 20
"""Error lines are counted incrementally, at most this many pages of new lines per read (a
resumed run with millions of lines catches up over a few scrapes, never in one)."""
NAMED = {
    "rollout_run_step_seconds": ("perf/step_s", "Seconds the last recorded step took."),
    "rollout_run_tokens_per_second": ("perf/tokens_per_s", "Tokens generated per second."),
    "rollout_run_reward_mean": ("reward/mean", "Mean reward of the last recorded step."),
    "rollout_run_loss": ("train/loss", "Training loss of the last recorded step."),
    "rollout_run_restarts": ("run/restarts", "Times the workers were started again."),
}
"""Gauge -> (the run-store metric it shows, help)."""


class _Snapshot:
    """What one read of the store found."""

    def __init__(self) -> None:
        self.status: str | None = None
        self.step: int | None = None
        self.latest: Mapping[str, MetricRecord] = {}


class _RunCollector(Collector):
    def __init__(self, run_id: str, open_store: Callable[[], RunStore]) -> None:
        self.run_id = run_id
        self._open_store = open_store
        self.store: RunStore | None = None
        self._snapshot = _Snapshot()
        self._read_at = -REFRESH_S
        self._last_log_id = 0
        self._error_lines: Counter[str] = Counter()
        self._read_errors = 0

    def collect(self) -> Iterator[Any]:
        if time.monotonic() - self._read_at >= REFRESH_S:
            self._refresh()
        snapshot = self._snapshot
        status = GaugeMetricFamily(
            "rollout_run_status", "1 for the run's status in the run store.", labels=["status"]
        )
        for each in RUN_STATUSES:
            status.add_metric([each], float(snapshot.status == each))
        yield status
        if snapshot.step is not None:
            yield GaugeMetricFamily(
                "rollout_run_step", "The last step with recorded metrics.", value=snapshot.step
            )
        latest = snapshot.latest
        for gauge, (name, text) in NAMED.items():
            if name in latest:
                yield GaugeMetricFamily(gauge, text, value=latest[name].value)
        queue = GaugeMetricFamily(
            "rollout_run_queue", "The work queue's queue/* metrics.", labels=["name"]
        )
        every = GaugeMetricFamily(
            "rollout_run_metric", "Every metric's value at its latest step.", labels=["name"]
        )
        for name, record in latest.items():
            every.add_metric([name], record.value)
            if name.startswith("queue/"):
                queue.add_metric([name.removeprefix("queue/")], record.value)
        yield queue
        yield every
        errors = CounterMetricFamily(
            "rollout_run_errors",
            "Errors: error lines the workers logged (kind worker_log, by role) and failed reads "
            "of the run store by this server (kind store_read).",
            labels=["kind", "role"],
        )
        for role, count in sorted(self._error_lines.items()):
            errors.add_metric(["worker_log", role], count)
        errors.add_metric(["store_read", ""], self._read_errors)
        yield errors

    def _refresh(self) -> None:
        self._read_at = time.monotonic()
        try:
            if self.store is None:
                self.store = self._open_store()
            record = self.store.get_run(self.run_id)
            snapshot = _Snapshot()
            if record is not None:
                snapshot.status, snapshot.step = record.status, record.last_step
                snapshot.latest = self.store.latest_metrics(self.run_id)
            self._count_error_lines(self.store)
            self._snapshot = snapshot
        except Exception as error:  # a scrape answers with what it last read, and says so
            self._read_errors += 1
            log.warning("reading the run store for /metrics failed: %s", redact_text(repr(error)))

    def _count_error_lines(self, store: RunStore) -> None:
        for _ in range(LOG_PAGES_PER_SCRAPE):
            page = store.logs(self.run_id, after_id=self._last_log_id, limit=LOG_PAGE)
            self._error_lines.update(line.role for line in page if line.level == "error")
            if page:
                self._last_log_id = page[-1].id
            if len(page) < LOG_PAGE:
                return

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None


class RunMetricsServer:
    """Serves /metrics for one run on (host, port) from `start()` to `stop()` (or `with`)."""

    def __init__(
        self,
        run_id: str,
        open_store: Callable[[], RunStore],
        address: tuple[str, int],
        *,
        key: str | None,
    ) -> None:
        """Binds `address` now (OSError if it cannot); `key`: required of every scrape."""
        self._collector = _RunCollector(run_id, open_store)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self._collector)
        server_class = _IPv6Server if ":" in address[0] else HTTPServer
        self._server = server_class(address, _handler(registry, key))
        self._thread = threading.Thread(target=self._serve, name="rollout-metrics", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        shown = f"[{host}]" if ":" in str(host) else host
        return f"http://{shown}:{port}/metrics"

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop serving and close the socket and the store connection; safe twice, and before
        start."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join()
        self._server.server_close()

    def __enter__(self) -> RunMetricsServer:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def _serve(self) -> None:
        try:
            self._server.serve_forever(poll_interval=0.2)
        finally:
            self._collector.close()  # in the thread that opened it


class _IPv6Server(HTTPServer):
    address_family = socket.AF_INET6


def _handler(registry: CollectorRegistry, key: str | None) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if not _authorized(self.headers.get("Authorization", ""), key):
                self._answer(401, b"missing or wrong key: send 'Authorization: Bearer <key>'\n")
            elif self.path.split("?", 1)[0].rstrip("/") != "/metrics":
                self._answer(404, b"only /metrics is served here\n")
            else:
                self._answer(200, generate_latest(registry), CONTENT_TYPE_LATEST)

        def _answer(self, status: int, body: bytes, content_type: str = "text/plain") -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            """Quiet: a scraper every few seconds is not news (and the terminal is the run's)."""

    return Handler


def _authorized(header: str, key: str | None) -> bool:
    if key is None:
        return True
    given = header.removeprefix("Bearer ") if header.startswith("Bearer ") else ""
    return hmac.compare_digest(given.encode(), key.encode())


def metrics_server(
    run_id: str,
    open_store: Callable[[], RunStore],
    *,
    port: int | None,
    host: str,
    key_ref: str | None,
) -> RunMetricsServer | None:
    """The server [logging] asks for, bound and not started (None without metrics_port); a
    RolloutError when its key cannot be read or its address cannot be bound."""
    if port is None:
        return None
    key = None
    if key_ref is not None:
        try:
            key = read_secret(key_ref)
        except (ValueError, OSError) as error:
            raise RolloutError(
                Issue(
                    "logging.metrics_key",
                    f"cannot read the /metrics key: {error}",
                    hint="set the environment variable (or file) it names before the run starts",
                )
            ) from None
    if key is None and not is_loopback(host):  # validate refuses this too; never serve it open
        raise RolloutError(Issue("logging.metrics_host", f"{host} needs metrics_key"))
    try:
        return RunMetricsServer(run_id, open_store, (host, port), key=key)
    except OSError as error:
        raise RolloutError(
            Issue(
                "logging.metrics_port",
                f"cannot serve /metrics at {host}:{port}: {error.strerror}",
                value=port,
                hint="choose another port, or 0 for a free one",
            )
        ) from None
