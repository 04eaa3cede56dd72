"""The run host's /metrics server ([logging] metrics_port): what it reads from the run store
(SQLite and Postgres), its key, its refusals, and that it is gone once stopped; and the config
rules of the [logging] metrics and tracing keys."""

from __future__ import annotations

import socket
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rollout.config import validate_config
from rollout.errors import ConfigError, RolloutError
from rollout.executor import metrics as run_metrics
from rollout.executor.metrics import metrics_server
from rollout.storage import open_store
from rollout.storage.base import MetricRecord

RUN = "grpo-tiny-20260101-000000-abc123"


@pytest.fixture
def location(store_location):
    with open_store(store_location) as store:
        store.create_run(RUN, name="t", plan_sha256="x", plan_path="/p/plan.lock", run_dir="/p")
        store.set_status(RUN, "running")
    return store_location


def write(location, step, values, logs=()):
    now = time.time()
    with open_store(location) as store:
        store.add_metrics(MetricRecord(RUN, step, name, v, now) for name, v in values.items())
        store.add_logs([(RUN, now, level, 0, role, "x") for level, role in logs])


def scrape(url, key=None):
    request = urllib.request.Request(url)
    if key is not None:
        request.add_header("Authorization", f"Bearer {key}")
    with urllib.request.urlopen(request, timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def serve(location, **kwargs):
    options = {"port": 0, "host": "127.0.0.1", "key_ref": None, **kwargs}
    server = metrics_server(RUN, lambda: open_store(location), **options)
    assert server is not None
    return server


def test_the_host_shows_the_runs_latest_metrics(location, monkeypatch):
    monkeypatch.setattr(run_metrics, "REFRESH_S", 0.0)
    write(location, 1, {"perf/step_s": 2.5, "reward/mean": 0.25, "train/loss": 1.5})
    write(
        location,
        2,
        {
            "perf/step_s": 2.0,
            "perf/tokens_per_s": 321.0,
            "reward/mean": 0.5,
            "queue/chunks_claimed": 7.0,
            "run/restarts": 1.0,
        },
        logs=[("error", "actor"), ("error", "actor"), ("warning", "learner"), ("error", "learner")],
    )
    with serve(location) as server:
        samples = scrape(server.url)
        assert samples[("rollout_run_step", ())] == 2
        assert samples[("rollout_run_step_seconds", ())] == 2.0
        assert samples[("rollout_run_tokens_per_second", ())] == 321.0
        assert samples[("rollout_run_reward_mean", ())] == 0.5
        assert samples[("rollout_run_loss", ())] == 1.5  # its latest step is 1
        assert samples[("rollout_run_restarts", ())] == 1.0
        assert samples[("rollout_run_queue", (("name", "chunks_claimed"),))] == 7.0
        assert samples[("rollout_run_metric", (("name", "reward/mean"),))] == 0.5
        assert samples[("rollout_run_status", (("status", "running"),))] == 1.0
        assert samples[("rollout_run_status", (("status", "finished"),))] == 0.0
        errors = (("kind", "worker_log"), ("role", "actor"))
        assert samples[("rollout_run_errors_total", errors)] == 2
        assert samples[("rollout_run_errors_total", (("kind", "worker_log"), ("role", "learner")))]
        # New rows reach the next scrape; error lines are counted once, not again.
        write(location, 3, {"reward/mean": 0.75}, logs=[("error", "actor")])
        again = scrape(server.url)
        assert again[("rollout_run_step", ())] == 3
        assert again[("rollout_run_reward_mean", ())] == 0.75
        assert again[("rollout_run_errors_total", errors)] == 3


def test_scrapes_within_the_refresh_interval_read_the_store_once(location, monkeypatch):
    monkeypatch.setattr(run_metrics, "REFRESH_S", 3600.0)
    write(location, 1, {"reward/mean": 0.25})
    with serve(location) as server:
        assert scrape(server.url)[("rollout_run_reward_mean", ())] == 0.25
        write(location, 2, {"reward/mean": 0.5})
        assert scrape(server.url)[("rollout_run_reward_mean", ())] == 0.25


def test_a_key_is_required_when_one_is_set(location, monkeypatch):
    monkeypatch.setenv("ROLLOUT_TEST_METRICS_KEY", "s3cret")
    with serve(location, host="0.0.0.0", key_ref="env:ROLLOUT_TEST_METRICS_KEY") as server:
        url = server.url.replace("0.0.0.0", "127.0.0.1")
        for key in (None, "wrong"):
            with pytest.raises(urllib.error.HTTPError) as refused:
                scrape(url, key)
            assert refused.value.code == 401
        assert ("rollout_run_status", (("status", "running"),)) in scrape(url, "s3cret")


def test_only_metrics_is_served(location):
    with serve(location) as server:
        with pytest.raises(urllib.error.HTTPError) as other:
            urllib.request.urlopen(server.url.replace("/metrics", "/admin"), timeout=10)
        assert other.value.code == 404


def test_stopping_closes_the_port_and_ends_the_thread(location):
    server = serve(location)
    server.start()
    port = int(server.url.rsplit(":", 1)[1].split("/")[0])
    scrape(server.url)
    server.stop()
    assert not server._thread.is_alive()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    server.stop()  # twice is fine


def test_no_port_no_server(location):
    assert (
        metrics_server(RUN, lambda: open_store(location), port=None, host="x", key_ref=None) is None
    )


def test_an_unreadable_key_and_a_busy_port_are_user_errors(location, monkeypatch):
    monkeypatch.delenv("ROLLOUT_TEST_MISSING_KEY", raising=False)
    with pytest.raises(RolloutError) as unread:
        serve(location, key_ref="env:ROLLOUT_TEST_MISSING_KEY")
    assert "logging.metrics_key" in str(unread.value)
    assert "ROLLOUT_TEST_MISSING_KEY" in str(unread.value)
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        with pytest.raises(RolloutError) as taken:
            serve(location, port=port)
    assert "logging.metrics_port" in str(taken.value) and "or 0 for a free one" in str(taken.value)


# --- config rules


def _issues(base_config, **logging) -> dict[str, str]:
    with pytest.raises(ConfigError) as caught:
        validate_config({**base_config, "logging": logging})
    return {issue.path: f"{issue.message} {issue.hint or ''}" for issue in caught.value.issues}


def test_metrics_options_without_a_port_are_refused(base_config):
    issues = _issues(base_config, metrics_host="0.0.0.0", metrics_key="env:K")
    assert "metrics_port is not" in issues["logging.metrics_host"]
    assert "metrics_port is not" in issues["logging.metrics_key"]


def test_metrics_off_loopback_need_a_key(base_config):
    issues = _issues(base_config, metrics_port=9100, metrics_host="0.0.0.0")
    assert "needs a key" in issues["logging.metrics_host"]
    validate_config(
        {
            **base_config,
            "logging": {"metrics_port": 9100, "metrics_host": "0.0.0.0", "metrics_key": "env:K"},
        }
    )


def test_a_metrics_key_is_a_reference_never_the_key(base_config):
    issues = _issues(base_config, metrics_port=0, metrics_key="hunter2")
    assert "env:NAME" in issues["logging.metrics_key"]
    assert "hunter2" not in str(issues)


@pytest.mark.parametrize("endpoint", ["collector:4318", "grpc://collector:4317"])
def test_an_otlp_endpoint_is_an_http_url(base_config, endpoint):
    issues = _issues(base_config, otlp_endpoint=endpoint)
    assert "http:// or https://" in issues["logging.otlp_endpoint"]


# --- the host stops it on every way out


GIB = 1024**3


@pytest.fixture
def captured(monkeypatch):
    """The servers run_plan makes, kept for the test to look at afterwards."""
    from rollout.executor import launch

    made = []

    def keep(*args, **kwargs):
        server = metrics_server(*args, **kwargs)
        made.append(server)
        return server

    monkeypatch.setattr(launch, "metrics_server", keep)
    return made


def _planned(config_file, base_config, tmp_path):
    import json

    from rollout.planner.builder import build_plan
    from rollout.planner.definition import HardwareFacts
    from rollout.planner.lockfile import write_plan

    base_config["run"]["output_dir"] = str(tmp_path / "runs")
    base_config["logging"] = {"metrics_port": 0}
    laptop = HardwareFacts(
        platform="test", cpu_count=8, memory_bytes=16 * GIB, memory_available_bytes=12 * GIB
    )
    plan = build_plan(config_file(base_config), hardware=laptop)
    lock = tmp_path / "plan.lock"
    write_plan(plan, lock)
    return plan, lock, json.loads(lock.read_text())["sha256"]


def _closed(server) -> bool:
    return server._server.socket.fileno() == -1 and not server._thread.is_alive()


def test_a_refused_start_closes_the_metrics_port(captured, config_file, base_config, tmp_path):
    from rollout.executor.launch import run_plan

    plan, lock, _ = _planned(config_file, base_config, tmp_path)
    with open_store(plan.derived.store) as store:  # the run id belongs to another plan
        store.create_run(plan.run_id, name="t", plan_sha256="0" * 64, plan_path="p", run_dir="d")
    with pytest.raises(RolloutError):
        run_plan(lock)
    (server,) = captured
    assert _closed(server)


def test_a_finished_run_started_again_closes_the_metrics_port(
    captured, config_file, base_config, tmp_path
):
    from rollout.executor.launch import run_plan

    plan, lock, sha = _planned(config_file, base_config, tmp_path)
    with open_store(plan.derived.store) as store:
        store.create_run(plan.run_id, name="t", plan_sha256=sha, plan_path="p", run_dir="d")
        store.set_status(plan.run_id, "finished")
    assert run_plan(lock).status == "finished"
    (server,) = captured
    assert _closed(server)
