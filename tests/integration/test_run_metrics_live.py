"""A real `rollout run` with [logging] metrics_port = 0: the host prints where /metrics is,
serves the run's progress there while the workers train (read from the run store), and the
port is closed once the run has ended."""

from __future__ import annotations

import queue
import signal
import socket
import threading
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.driver import start

pytestmark = pytest.mark.slow

SETTINGS = (
    "data.eval=null",
    "cluster.threads_per_process=1",
    "algorithm.max_steps=6",
    "generation.max_new_tokens=4",
    "rewards=[{ fn = './slow.py:slow' }]",  # 0.3 s a step: scrapes land mid-run
    "logging.metrics_port=0",
)
WAIT_S = 240.0


def samples(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {
        sample.name + str(sorted(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def start_run(workdir, *extra: str):
    """`rollout run` in the background; (the process, the /metrics URL it printed)."""
    args = ["run", "--config", "examples/grpo-tiny.toml"]
    for setting in (*SETTINGS, *extra):
        args += ["--set", setting]
    process = start(workdir, *args)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(
        target=lambda: [lines.put(line) for line in process.stdout], daemon=True
    ).start()
    deadline = time.monotonic() + WAIT_S
    url = None
    while url is None and time.monotonic() < deadline:
        line = lines.get(timeout=WAIT_S)
        if line.startswith("metrics: "):
            url = line.removeprefix("metrics: ").strip()
    assert url is not None and url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
    return process, url


def closed(url: str) -> bool:
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except OSError:
        return True
    return False


def test_the_host_serves_metrics_while_the_run_goes(workdir):
    process, url = start_run(workdir)
    deadline = time.monotonic() + WAIT_S

    seen: dict[str, float] = {}
    while process.poll() is None and time.monotonic() < deadline:
        try:
            seen = samples(url)
        except OSError:  # the run ended between poll() and the scrape
            break
        if seen.get("rollout_run_step[]", 0) >= 1 and "rollout_run_reward_mean[]" in seen:
            break
        time.sleep(0.2)
    assert seen.get("rollout_run_status[('status', 'running')]") == 1.0, seen
    assert seen.get("rollout_run_step[]", 0) >= 1, seen
    assert "rollout_run_step_seconds[]" in seen and "rollout_run_tokens_per_second[]" in seen

    assert process.wait(WAIT_S) == 0, process.stderr.read()
    assert closed(url)


def test_a_signalled_host_closes_its_metrics_port(workdir):
    process, url = start_run(workdir, "algorithm.max_steps=200")
    deadline = time.monotonic() + WAIT_S
    while samples(url).get("rollout_run_step[]", 0) < 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    process.wait(WAIT_S)
    assert closed(url)
