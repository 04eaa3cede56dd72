"""Traces over the wire: a plan and a real worker (rollout.runtime.worker.main, in this process,
on the tiny model) export their spans with OTLP/HTTP to a collector this test starts on
127.0.0.1, which decodes them with the OTLP protobuf messages."""

from __future__ import annotations

import faulthandler
import logging
import signal
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from rollout.planner.builder import build_plan
from rollout.planner.lockfile import write_plan
from rollout.storage import open_store


class Collector:
    """An OTLP/HTTP trace receiver: every span it got, as (service, name, span id, parent id)."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, str, bytes, bytes]] = []
        received = self.spans

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest.FromString(body)
                for resource in request.resource_spans:
                    service = next(
                        a.value.string_value
                        for a in resource.resource.attributes
                        if a.key == "service.name"
                    )
                    for scope in resource.scope_spans:
                        for span in scope.spans:
                            received.append((service, span.name, span.span_id, span.parent_span_id))
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def names(self, service: str) -> list[str]:
        return [name for got, name, _, _ in self.spans if got == service]


@pytest.fixture
def collector() -> Iterator[Collector]:
    running = Collector()
    running.thread.start()
    yield running
    running.server.shutdown()
    running.server.server_close()


@pytest.fixture
def process_state_kept():
    """What the worker sets for its process, put back afterwards."""
    import torch

    signals = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    logger = logging.getLogger("rollout")
    handlers, level, propagate = list(logger.handlers), logger.level, logger.propagate
    threads = torch.get_num_threads()
    faults = faulthandler.is_enabled()
    yield
    for number, handler in signals.items():
        signal.signal(number, handler)
    logger.handlers[:], logger.level, logger.propagate = handlers, level, propagate
    torch.set_num_threads(threads)
    if faults:
        faulthandler.enable(file=sys.__stderr__, all_threads=True)


def test_plan_and_worker_phases_reach_an_otlp_collector(
    collector, process_state_kept, config_file, base_config, tmp_path, rollout_cache
):
    from rollout.runtime import worker

    base_config["run"]["output_dir"] = str(tmp_path / "runs")
    base_config["algorithm"]["max_steps"] = 1
    base_config["generation"]["max_new_tokens"] = 4
    base_config["logging"] = {"otlp_endpoint": collector.url}
    plan = build_plan(config_file(base_config))
    assert "plan" in collector.names("rollout-plan")  # exported when planning ended

    run_dir = Path(plan.derived.run_dir)
    run_dir.mkdir(parents=True)
    lock = run_dir / "plan.lock"
    write_plan(plan, lock)
    with open_store(plan.derived.store) as store:
        store.create_run(
            plan.run_id, name="t", plan_sha256="-", plan_path=str(lock), run_dir=str(run_dir)
        )
    assert worker.main(["--plan", str(lock)]) == 0

    names = collector.names("rollout-worker")
    assert {"rollout", "generate", "score", "learn", "sync", "checkpoint"} <= set(names)
    by_id = {span_id: name for _, name, span_id, _ in collector.spans}
    parents = {name: by_id.get(parent) for _, name, _, parent in collector.spans}
    assert parents["generate"] == parents["score"] == "rollout"


def test_an_offline_run_exports_its_learn_and_checkpoint_spans(
    collector, process_state_kept, config_file, base_config, tmp_path, rollout_cache
):
    from rollout.runtime import worker

    base_config["run"]["output_dir"] = str(tmp_path / "runs")
    base_config["data"]["fields"] = {"prompt": "prompt", "completion": "answer"}
    base_config["algorithm"] = {"kind": "sft", "max_steps": 1, "batch_size": 4}
    del base_config["rewards"], base_config["generation"]
    base_config["logging"] = {"otlp_endpoint": collector.url}
    plan = build_plan(config_file(base_config))
    run_dir = Path(plan.derived.run_dir)
    run_dir.mkdir(parents=True)
    lock = run_dir / "plan.lock"
    write_plan(plan, lock)
    with open_store(plan.derived.store) as store:
        store.create_run(
            plan.run_id, name="t", plan_sha256="-", plan_path=str(lock), run_dir=str(run_dir)
        )
    assert worker.main(["--plan", str(lock)]) == 0
    assert {"learn", "checkpoint"} <= set(collector.names("rollout-worker"))
