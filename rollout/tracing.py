"""Named spans: which phase a line of log belongs to, and OpenTelemetry traces when asked for.

`span(name)` marks a stretch of work (plan, a step's generate/score/train/sync/checkpoint, a
server request). It always records the innermost span's name in a context variable, which the
run store's log handler writes on every log line (`rollout logs tail --span train`): a
ContextVar set and reset, nothing more. Only once `configure(endpoint)` (or, in tests,
`use_provider`) has run in this process does it also open an OpenTelemetry span; until then
opentelemetry is never imported, so runs without `[logging] otlp_endpoint` pay nothing for it.

OpenTelemetry is the optional extra rollout[otel]; `rollout plan` refuses an otlp_endpoint
without it (rollout.planner.trackers), so `configure` failing to import is a bug, not bad input.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

OTEL_MODULE = "opentelemetry.sdk"
OTLP_MODULE = "opentelemetry.exporter.otlp.proto.http"
"""What `configure` needs: both installed by `pip install 'rollout[otel]'`."""
INSTALL_HINT = "pip install 'rollout[otel]'"

_current: contextvars.ContextVar[str | None] = contextvars.ContextVar("rollout_span", default=None)
_tracer: Any = None
_provider: Any = None


def current_span() -> str | None:
    """The innermost span's name in this thread (or task), None outside every span."""
    return _current.get()


Value = str | int | float | bool


class Attributes:
    """What a span's body may add to it once it knows (a response's status): a no-op when
    tracing is off."""

    def set(self, key: str, value: Value) -> None:
        del key, value


class _Traced(Attributes):
    def __init__(self, otel_span: Any) -> None:
        self._span = otel_span

    def set(self, key: str, value: Value) -> None:
        self._span.set_attribute(key, value)


_UNTRACED = Attributes()


@contextlib.contextmanager
def span(name: str, **attributes: Value) -> Iterator[Attributes]:
    """Mark `name` as the current span for log lines; an OpenTelemetry span too when tracing is
    configured (`attributes` go on it, and what the body `set`s on what it yields)."""
    token = _current.set(name)
    try:
        tracer = _tracer
        if tracer is None:
            yield _UNTRACED
        else:
            with tracer.start_as_current_span(name, attributes=attributes) as otel_span:
                yield _Traced(otel_span)
    finally:
        _current.reset(token)


def missing_package() -> str | None:
    """The OpenTelemetry module `configure` needs and this environment lacks, or None. Looks the
    packages up without importing them."""
    import importlib.util

    for module in (OTEL_MODULE, OTLP_MODULE):
        try:
            if importlib.util.find_spec(module) is None:
                return module
        except ModuleNotFoundError:  # a parent package is missing
            return module
    return None


def configure(endpoint: str, service: str) -> None:
    """Export this process's spans with OTLP over HTTP to `endpoint` (a collector's
    .../v1/traces URL), in batches from a background thread (a slow collector never blocks a
    step). `service`: the service.name the spans carry (rollout-worker, rollout-serve...)."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    use_provider(provider)


def use_provider(provider: Any) -> None:
    """Open OpenTelemetry spans from `provider` (an SDK TracerProvider) from now on."""
    global _tracer, _provider
    _provider = provider
    _tracer = provider.get_tracer("rollout")


def shutdown() -> None:
    """Export what is still queued and stop tracing (spans are no-ops again). Safe without
    configure, and twice."""
    global _tracer, _provider
    provider, _provider, _tracer = _provider, None, None
    if provider is not None:
        provider.shutdown()


@contextlib.contextmanager
def exporting(endpoint: str | None, service: str) -> Iterator[None]:
    """Trace to `endpoint` inside the block (nothing when None), flushed and stopped on every
    way out of it. Where tracing is already on (a test's provider, a caller's own), that is
    kept: spans go where it sends them."""
    if endpoint is None or _tracer is not None:
        yield
        return
    configure(endpoint, service)
    try:
        yield
    finally:
        shutdown()
