"""`rollout serve`'s GET /metrics and request spans, over real sockets on the tiny model: the
counts follow what clients did, the route label never takes a client's made-up path, /metrics
is under the same key as every route, and each request is an OpenTelemetry span."""

from __future__ import annotations

import http.client
import json
import threading
import time

import openai
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from rollout import tracing
from rollout.inference.serve_source import load_served, resolve_source
from rollout.serve.server import OpenAIServer

MODEL = "tiny-llama"
WAIT_S = 30.0


def start(host: str = "127.0.0.1", api_key: str | None = None):
    source = resolve_source(config=None, model=f"builtin:{MODEL}", checkpoint=None, name=None)
    served = load_served(source, device="cpu", dtype="auto", seed=0, max_batch_size=8)
    server = OpenAIServer((host, 0), served, api_key=api_key)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    return server, thread


@pytest.fixture(scope="module")
def server(rollout_cache):
    running, thread = start()
    yield running
    running.stop()
    thread.join(WAIT_S)


def request(server, method, path, body=None, headers=None, host="127.0.0.1"):
    port = server.server_address[1]
    connection = http.client.HTTPConnection(host, port, timeout=WAIT_S)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, response.getheader("content-type"), response.read().decode()
    finally:
        connection.close()


def scrape(server, **kwargs) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics: (name, sorted labels) -> value."""
    status, content_type, text = request(server, "GET", "/metrics", **kwargs)
    assert status == 200, text
    assert content_type.startswith("text/plain")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples, name, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_follow_what_clients_did(server):
    before = scrape(server)
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=WAIT_S)
    answer = client.completions.create(model=MODEL, prompt="1 + 1 =", max_tokens=4, n=2)
    status, _, _ = request(server, "GET", "/v1/no-such-route-9f3a")
    assert status == 404
    bad, _, _ = request(server, "POST", "/v1/completions", body=b"{not json")
    assert bad == 400
    # A request is counted once its answer is sent: the client may read it a moment before.
    deadline = time.monotonic() + WAIT_S
    after = scrape(server)
    while time.monotonic() < deadline and value(
        after, "rollout_serve_request_seconds_count", route="/v1/completions", status="400"
    ) == value(
        before, "rollout_serve_request_seconds_count", route="/v1/completions", status="400"
    ):
        time.sleep(0.01)
        after = scrape(server)

    tokens = answer.usage.completion_tokens
    assert tokens > 0
    grown = {
        key: after.get(key, 0.0) - before.get(key, 0.0)
        for key in after
        if after.get(key, 0.0) != before.get(key, 0.0)
    }
    assert value(grown, "rollout_serve_generated_tokens_total") == tokens
    route = "/v1/completions"
    assert value(grown, "rollout_serve_request_seconds_count", route=route, status="200") == 1
    assert value(grown, "rollout_serve_request_seconds_count", route=route, status="400") == 1
    # A made-up path is "other": a client never creates a series of its own.
    assert value(grown, "rollout_serve_request_seconds_count", route="other", status="404") == 1
    assert not any("no-such-route" in str(key) for key in after)
    assert value(grown, "rollout_serve_errors_total", kind="not_found") == 1
    assert value(grown, "rollout_serve_errors_total", kind="invalid_request_error") == 1
    # The scrape itself is the one request in flight while it renders.
    assert value(after, "rollout_serve_requests_in_flight") == 1
    assert value(after, "rollout_serve_batch_capacity") == 8
    assert 0 <= value(after, "rollout_serve_batch_rows") <= 8
    assert value(grown, "rollout_serve_request_seconds_sum", route=route, status="200") > 0


def test_metrics_takes_get_only(server):
    status, _, body = request(server, "POST", "/metrics", body=b"")
    assert status == 405 and json.loads(body)["error"]["message"] == "/metrics takes GET, not POST"


def test_metrics_needs_the_key_when_the_server_has_one(rollout_cache):
    server, thread = start(host="0.0.0.0", api_key="s3cret")
    try:
        status, _, body = request(server, "GET", "/metrics")
        assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
        wrong = request(server, "GET", "/metrics", headers={"Authorization": "Bearer nope"})
        assert wrong[0] == 401
        samples = scrape(server, headers={"Authorization": "Bearer s3cret"})
        assert value(samples, "rollout_serve_errors_total", kind="invalid_api_key") == 2
    finally:
        server.stop()
        thread.join(WAIT_S)


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use_provider(provider)
    try:
        yield exporter
    finally:
        tracing.shutdown()


def test_each_request_is_a_span_with_its_route_and_status(server, spans):
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=WAIT_S)
    client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    request(server, "GET", "/v1/elsewhere")
    # A span ends once its answer is sent: the client can read the answer a moment before.
    deadline = time.monotonic() + WAIT_S
    while len(spans.get_finished_spans()) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    finished = {span.name: span for span in spans.get_finished_spans()}
    chat = finished["POST /v1/chat/completions"]
    assert chat.attributes["http.route"] == "/v1/chat/completions"
    assert chat.attributes["http.response.status_code"] == 200
    assert chat.end_time > chat.start_time
    assert finished["GET other"].attributes["http.response.status_code"] == 404
