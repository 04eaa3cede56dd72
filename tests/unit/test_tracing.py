"""rollout.tracing: spans read back with the SDK's in-memory exporter (PhaseClock's phases,
nested spans, plan), the refusals of an OTLP endpoint without OpenTelemetry, and no import of
OpenTelemetry at all where tracing is off."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from rollout import tracing
from rollout.errors import PlanError
from rollout.planner.builder import build_plan
from rollout.planner.definition import HardwareFacts
from rollout.runtime.phases import PhaseClock
from tests.conftest import REPO

GIB = 1024**3
LAPTOP = HardwareFacts(
    platform="test", cpu_count=8, memory_bytes=16 * GIB, memory_available_bytes=12 * GIB
)


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


def test_phaseclock_phases_are_spans_with_their_children(spans):
    """The step loop's shape: rollout (generate, score inside it), learn, sync, checkpoint."""
    clock = PhaseClock("cpu")
    with tracing.span("step", step=3):
        with clock.phase("rollout"):
            with tracing.span("generate"):
                pass
            with tracing.span("score"):
                pass
        with clock.phase("learn"):
            pass
        with clock.phase("sync"):
            pass
        with tracing.span("checkpoint", step=3):
            pass
    finished = {span.name: span for span in spans.get_finished_spans()}
    assert set(finished) == {"step", "rollout", "generate", "score", "learn", "sync", "checkpoint"}

    def parent(name):
        return next(
            s.name for s in finished.values() if s.context.span_id == finished[name].parent.span_id
        )

    assert parent("generate") == parent("score") == "rollout"
    assert parent("rollout") == parent("learn") == parent("sync") == parent("checkpoint") == "step"
    assert finished["step"].parent is None
    assert finished["checkpoint"].attributes["step"] == 3
    assert len({s.context.trace_id for s in finished.values()}) == 1
    # The clock still times its phases, whatever tracing does.
    assert set(clock.seconds) == {"rollout", "learn", "sync"}


def test_a_failing_phase_ends_its_span_and_resets_the_current_one(spans):
    clock = PhaseClock("cpu")
    with pytest.raises(ValueError), clock.phase("learn"):
        raise ValueError("loss is NaN")
    assert tracing.current_span() is None
    (learn,) = spans.get_finished_spans()
    assert learn.name == "learn" and not learn.status.is_ok


def test_after_shutdown_spans_are_no_ops_again(spans):
    tracing.shutdown()
    with tracing.span("after"):
        assert tracing.current_span() == "after"
    assert spans.get_finished_spans() == ()


def test_plan_is_a_span_with_its_stages(spans, config_file, base_config, tmp_path):
    base_config["run"]["output_dir"] = str(tmp_path / "runs")
    build_plan(config_file(base_config), hardware=LAPTOP)
    finished = {span.name: span for span in spans.get_finished_spans()}
    assert {"plan", "plan.model", "plan.data", "plan.rewards"} <= set(finished)
    assert finished["plan"].attributes["rollout.run_name"] == "t"
    assert finished["plan.model"].parent.span_id == finished["plan"].context.span_id


def test_plan_refuses_an_otlp_endpoint_without_opentelemetry(
    config_file, base_config, tmp_path, monkeypatch
):
    monkeypatch.setattr(tracing, "missing_package", lambda: "opentelemetry.sdk")
    base_config["logging"] = {"otlp_endpoint": "http://127.0.0.1:4318/v1/traces"}
    with pytest.raises(PlanError) as caught:
        build_plan(config_file(base_config), hardware=LAPTOP)
    (issue,) = [i for i in caught.value.issues if i.path == "logging.otlp_endpoint"]
    assert "'opentelemetry.sdk'" in issue.message
    assert "pip install 'rollout[otel]'" in issue.hint


def test_the_installed_extra_is_found():
    assert tracing.missing_package() is None


def test_without_an_endpoint_opentelemetry_is_never_imported(config_file, base_config, tmp_path):
    """In a fresh interpreter: plan a config, import the server and the host, run a PhaseClock
    step with spans: no OpenTelemetry module was loaded."""
    base_config["run"]["output_dir"] = str(tmp_path / "runs")
    path = config_file(base_config)
    script = textwrap.dedent(f"""
        import json, sys
        from rollout import tracing
        from rollout.planner.builder import build_plan
        from rollout.runtime.phases import PhaseClock
        import rollout.serve.server
        import rollout.executor.launch
        build_plan({str(path)!r})
        clock = PhaseClock("cpu")
        with clock.phase("learn"), tracing.span("checkpoint"):
            pass
        print(json.dumps(sorted(m for m in sys.modules if m.startswith("opentelemetry"))))
    """)
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []
