"""`rollout report` and `rollout runs compare`: the report's data (thinning, samples, plan with
credentials redacted), the CLI's errors, and the page itself in headless Chromium (it renders
without console errors or network, its plots hold the run's points, its viewer filters)."""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rollout.cli.app import app
from rollout.reports.collect import MAX_POINTS, spread
from rollout.reports.render import embeddable_json
from rollout.reports.series import bucket_width, thin
from rollout.storage import open_store
from rollout.storage.base import MetricRecord, SampleRecord

runner = CliRunner()
SECRET = "hunter2-not-for-reports"


def write_plan(path: Path, run_id: str) -> Path:
    """A plan.lock as the planner writes it, as far as the report reads it; a credential inside."""
    plan = {
        "run_id": run_id,
        "config": {
            "algorithm": {"kind": "grpo", "lr": 1e-4},
            "storage": {"postgres_dsn": f"postgresql://trainer:{SECRET}@db.internal/runs"},
        },
        "model": {"location": "builtin:tiny-llama", "num_parameters": 106816},
        "derived": {"total_steps": 30, "prompts_per_step": 2},
        "rewards": [{"name": "numeric_match", "weight": 1.0}],
        "versions": {"rollout": "0.1.0"},
    }
    path.write_text(json.dumps({"format": "rollout.plan", "sha256": "ab" * 32, "plan": plan}))
    return path


def record_run(
    location: str,
    run_id: str,
    tmp_path: Path,
    *,
    steps: int = 30,
    samples_per_step: int = 4,
    status: str = "finished",
    error: str | None = None,
) -> None:
    """A run as training records it, written to the store directly (fast): reward mean/std,
    loss, step phases, eval every 10 steps, and samples (one multi-turn episode at step 2)."""
    with open_store(location) as store:
        store.create_run(
            run_id,
            name="demo",
            plan_sha256="ab" * 32,
            plan_path=str(write_plan(tmp_path / f"{run_id}.lock", run_id)),
            run_dir=str(tmp_path),
        )
        now = time.time()
        rows = []
        for step in range(1, steps + 1):
            values = {
                "reward/mean": step / steps,
                "reward/std": 0.1,
                "train/loss": 1.0 / step,
                "perf/step_s": 1.0,
                "perf/generate_s": 0.5,
                "perf/score_s": 0.1,
                "perf/learn_s": 0.3,
            }
            if step % 10 == 0:
                values["eval/reward"] = step / steps
            rows += [MetricRecord(run_id, step, n, v, now) for n, v in values.items()]
        store.add_metrics(rows)
        samples = [
            SampleRecord(
                run_id,
                step,
                i,
                f"what is {step} + {i}?",
                f"it is {step + i}",
                None,
                float(i),
                {"finish_reason": "eos", "rewards": {"numeric_match": math.nan}},
                now,
            )
            for step in range(1, steps + 1)
            for i in range(samples_per_step)
        ]
        turns = [
            {"role": "assistant", "content": "guess 50"},
            {"role": "user", "content": "higher </script><script>alert(1)</script>"},
            {"role": "assistant", "content": "guess 75"},
        ]
        samples.append(SampleRecord(run_id, 2, 99, "guess a number", None, turns, 1.0, {}, now))
        store.add_samples(samples)
        if status != "planned":
            store.set_status(run_id, status, error=error)


def add_agent_episode(location: str, run_id: str) -> None:
    """An agent episode's sample as the agent actor records it: each call's new messages and
    its reply with the call's facts, and the program's final answer as the completion."""

    def reply(call: int, text: str) -> dict:
        facts = {"call": call, "policy_version": 3, "tokens": 4, "finish_reason": "stop"}
        return {"role": "assistant", "content": text, **facts}

    turns = [
        {"role": "user", "content": "2 + 2?"},
        reply(1, "maybe 5"),
        {"role": "tool", "content": "the abacus says 4"},
        reply(2, "then 4"),
        {"role": "user", "content": "final answer?"},
        reply(3, "4"),
    ]
    extra = {"episode_id": "episode-7", "calls": 3, "failure": None}
    with open_store(location) as store:
        store.add_samples([SampleRecord(run_id, 3, 98, "2 + 2?", "4", turns, 1.0, extra, 0.0)])


@pytest.fixture
def location(tmp_path):
    return f"sqlite:{tmp_path / 'runs' / 'rollout.db'}"


def make_report(location, run_id, out) -> Path:
    result = runner.invoke(app, ["report", run_id, "--store", location, "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out / "index.html"


def page_data(path: Path) -> dict:
    text = path.read_text()
    match = re.search(
        r'<script id="report-data" type="application/json">(.*?)</script>', text, re.S
    )
    assert match, "no data element"
    return json.loads(match.group(1))


# --- data


def test_thin_keeps_short_series_and_buckets_long_ones():
    rows = [(step, float(step)) for step in range(1, 11)]
    kept = thin("m", rows, origin=0, width=1, max_points=100)
    assert [p[0] for p in kept.points] == list(range(1, 11)) and kept.bucket_steps == 1
    width = bucket_width(0, 10, 3)
    assert width == 4
    bucketed = thin("m", rows, origin=0, width=width, max_points=3)
    # Buckets of steps 1-3, 4-7, 8-10 (origin 0, width 4): mean, min, max of each.
    assert bucketed.points == [(0, 2.0, 1.0, 3.0), (4, 5.5, 4.0, 7.0), (8, 9.0, 8.0, 10.0)]
    assert bucketed.rows == 10 and bucketed.bucket_steps == 4


def test_thin_turns_nan_and_infinity_into_gaps():
    rows = [(1, 1.0), (2, math.nan), (3, math.inf)]
    assert [p[1] for p in thin("m", rows, origin=0, width=1, max_points=10).points] == [
        1.0,
        None,
        None,
    ]
    assert thin("m", rows[1:], origin=0, width=5, max_points=1).points == [(0, None, None, None)]


def test_spread_keeps_first_and_last():
    assert spread(list(range(10)), 20) == list(range(10))
    picked = spread(list(range(1000)), 5)
    assert picked[0] == 0 and picked[-1] == 999 and len(picked) == 5


def test_embedded_json_cannot_close_its_script_element():
    text = embeddable_json({"s": "</script><!-- \u2028", "x": math.nan})
    assert "</script>" not in text and "<!--" not in text
    assert json.loads(text) == {"s": "</script><!-- \u2028", "x": None}


def test_report_holds_the_run_and_redacts_its_plan(location, tmp_path):
    record_run(location, "r1", tmp_path)
    data = page_data(make_report(location, "r1", tmp_path / "out"))
    assert data["run"]["status"] == "finished"
    reward = data["series"]["reward/mean"]
    assert [p[0] for p in reward["points"]] == list(range(1, 31)) and reward["bucket_steps"] == 1
    assert data["breakdown"] == {
        "total": "perf/step_s",
        "phases": ["perf/generate_s", "perf/score_s", "perf/learn_s"],
    }
    assert data["plan"]["facts"]["algorithm"] == "grpo"
    assert SECRET not in json.dumps(data) and "***" in json.dumps(data["plan"]["config"])
    rows = data["samples"]["rows"]
    assert len(rows) == 30 * 4 + 1
    assert rows[0]["extra"]["rewards"]["numeric_match"] is None  # NaN
    episode = next(r for r in rows if r["turns"])
    assert episode["completion"] is None and len(episode["turns"]) == 3


def test_an_agent_episodes_calls_carry_their_facts_and_its_final_answer(location, tmp_path):
    record_run(location, "r1", tmp_path, steps=3, samples_per_step=0)
    add_agent_episode(location, "r1")
    data = page_data(make_report(location, "r1", tmp_path / "out"))
    (episode,) = [r for r in data["samples"]["rows"] if r["index"] == 98]
    assert episode["completion"] == "4" and len(episode["turns"]) == 6
    assert episode["turns"][3] == {
        "role": "assistant",
        "content": "then 4",
        "meta": {"call": "2", "policy_version": "3", "tokens": "4", "finish_reason": "stop"},
    }
    assert episode["turns"][2] == {"role": "tool", "content": "the abacus says 4", "meta": {}}


def test_report_of_a_run_with_no_metrics_and_a_missing_plan(location, tmp_path):
    with open_store(location) as store:
        store.create_run(
            "empty", name="e", plan_sha256="-", plan_path="/gone/plan.lock", run_dir="/gone"
        )
        store.set_status("empty", "failed", error="Traceback ...\nValueError: bad batch")
    data = page_data(make_report(location, "empty", tmp_path / "out"))
    assert data["series"] == {} and data["samples"]["rows"] == [] and data["breakdown"] is None
    assert "not on this machine" in data["plan"]["missing"]
    assert data["run"]["error"].endswith("ValueError: bad batch")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["report", "nope"], "no run 'nope'"),
        (["report", "../x"], "run id"),
        (["report", "r1", "--out", "s3://bucket/report"], "takes a local file"),
        (["runs", "compare", "r1", "nope"], "no run 'nope'"),
        (["runs", "compare", "r1", "r1", "--metric", "bogus"], "neither run has a metric"),
    ],
)
def test_user_errors_exit_2_without_a_traceback(location, tmp_path, args, message):
    record_run(location, "r1", tmp_path)
    result = runner.invoke(app, [*args, "--store", location])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output


def test_report_into_a_file_path_or_from_a_missing_store(location, tmp_path):
    record_run(location, "r1", tmp_path)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    result = runner.invoke(app, ["report", "r1", "--store", location, "--out", str(blocker)])
    assert result.exit_code == 2 and "not a directory" in result.output
    missing = f"sqlite:{tmp_path / 'nowhere.db'}"
    result = runner.invoke(app, ["report", "r1", "--store", missing])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert not (tmp_path / "nowhere.db").exists()


def test_runs_compare_side_by_side(location, tmp_path):
    record_run(location, "a", tmp_path, steps=20)
    record_run(location, "b", tmp_path, steps=10)
    result = runner.invoke(
        app,
        ["runs", "compare", "a", "b", "--store", location, "-m", "reward/mean", "-m", "train/",
         "--last", "5", "--format", "json"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    rows = {row["metric"]: row for row in report["metrics"]}
    assert list(rows) == ["reward/mean", "train/loss"]
    reward, loss = rows["reward/mean"], rows["train/loss"]
    # a: step/20 over 20 steps; b: step/10 over 10 steps: both end at 1.0.
    assert reward["a"]["last"] == reward["b"]["last"] == 1.0
    assert reward["a"]["mean_last"] == pytest.approx(sum(s / 20 for s in range(16, 21)) / 5)
    assert reward["b"]["mean_last"] == pytest.approx(sum(s / 10 for s in range(6, 11)) / 5)
    assert reward["delta"] == pytest.approx(reward["b"]["mean_last"] - reward["a"]["mean_last"])
    assert loss["better"] == "lower" and loss["a"]["best"] == pytest.approx(1 / 20)
    text = runner.invoke(app, ["runs", "compare", "a", "b", "--store", location])
    assert text.exit_code == 0 and "eval/reward" in text.output and "↓ train/loss" in text.output


# --- the page in headless Chromium


class Opened:
    def __init__(self, browser, path: Path):
        self.page = browser.new_page(viewport={"width": 1280, "height": 900})
        self.errors: list[str] = []
        self.requests: list[str] = []
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.page.goto(path.as_uri())
        # Set by the page's script once every section is drawn: absent if the script failed.
        self.page.wait_for_selector("body[data-ready]", state="attached", timeout=10_000)

    def points(self, name: str) -> list[int]:
        """Each plotted line of `name`: how many points it draws (from the path itself)."""
        paths = self.page.locator(f'path.line[data-name="{name}"]')
        return [
            len(re.findall(r"[ML]", paths.nth(i).get_attribute("d"))) for i in range(paths.count())
        ]

    def visible_samples(self) -> int:
        return self.page.locator("tr.sample:visible").count()


def test_the_page_renders_its_plots_from_disk(browser, location, tmp_path):
    record_run(location, "r1", tmp_path, status="failed", error="Traceback\nRuntimeError: oom")
    opened = Opened(browser, make_report(location, "r1", tmp_path / "out"))
    assert opened.errors == []
    assert all(url.startswith("file://") for url in opened.requests), opened.requests
    assert opened.points("reward/mean") == [30]
    assert opened.points("train/loss") == [30]
    assert opened.points("eval/reward") == [3]
    band = opened.page.locator('path.band[data-name="± reward/std"]').get_attribute("d")
    assert band.count("L") >= 2 * 30 - 2  # the upper edge out, the lower edge back
    layers = opened.page.locator('[data-chart="step-time"] path.layer')
    assert layers.count() == 4  # generate, score, learn, and the rest of the step
    assert opened.page.locator("#phase-table tr").count() == 5
    assert "RuntimeError: oom" in opened.page.locator("#run-error").text_content()
    assert "grpo" in opened.page.locator("#plan-facts").text_content()
    assert SECRET not in opened.page.content()
    opened.page.close()


def test_the_viewer_filters_by_text_and_step(browser, location, tmp_path):
    record_run(location, "r1", tmp_path)
    opened = Opened(browser, make_report(location, "r1", tmp_path / "out"))
    page = opened.page
    assert opened.visible_samples() == 121
    page.fill("#search", "what is 7 +")
    assert opened.visible_samples() == 4
    assert "4 of 121" in page.locator("#sample-count").text_content()
    page.fill("#search", "HIGHER")  # case-insensitive, inside an episode's turns
    assert opened.visible_samples() == 1
    assert page.locator("tr.sample:visible .turn").count() == 3
    page.fill("#search", "")
    page.fill("#step-from", "10")
    page.fill("#step-to", "12")
    assert opened.visible_samples() == 12
    assert opened.errors == []  # the episode's "</script>" stayed text
    page.close()


def test_the_viewer_shows_an_agent_episodes_calls_and_finds_a_middle_one(
    browser, location, tmp_path
):
    record_run(location, "r1", tmp_path)
    add_agent_episode(location, "r1")
    opened = Opened(browser, make_report(location, "r1", tmp_path / "out"))
    page = opened.page
    page.fill("#search", "ABACUS")  # the tool's answer between the first and second calls
    assert opened.visible_samples() == 1
    turns = page.locator("tr.sample:visible .turn")
    assert turns.count() == 7  # six turns, then the final answer
    assert turns.nth(3).text_content() == (
        "assistant (call 2, policy version 3, tokens 4, finish reason stop): then 4"
    )
    assert turns.nth(6).text_content() == "final answer: 4"
    assert opened.errors == []
    page.close()


def test_a_run_with_no_metrics_or_samples_says_so(browser, location, tmp_path):
    with open_store(location) as store:
        store.create_run("e", name="e", plan_sha256="-", plan_path="/gone", run_dir="/gone")
    opened = Opened(browser, make_report(location, "e", tmp_path / "out"))
    assert opened.errors == []
    assert "no metrics" in opened.page.locator("#no-metrics").text_content()
    assert opened.page.locator("#no-samples").count() == 1
    opened.page.close()


@pytest.mark.slow
def test_a_million_metric_rows_make_a_small_page(browser, location, tmp_path):
    """A long run: 1,000,000 metric rows (10 metrics x 100,000 steps) and 4 samples a step."""
    record_run(location, "big", tmp_path, steps=10, samples_per_step=0)
    steps = 100_000
    names = ["reward/mean", "reward/std", "train/loss", "perf/step_s", "perf/generate_s"]
    names += [f"train/extra_{i}" for i in range(5)]
    with open_store(location) as store:
        for start in range(1, steps + 1, 10_000):
            store.add_metrics(
                MetricRecord("big", step, name, math.sin(step / 1000) + i, 0.0)
                for step in range(start, start + 10_000)
                for i, name in enumerate(names)
            )
        store.add_samples(
            SampleRecord("big", step, i, "p" * 200, "c" * 400, None, 1.0, {}, 0.0)
            for step in range(1, steps + 1)
            for i in range(4)
        )
    path = make_report(location, "big", tmp_path / "out")
    size = path.stat().st_size
    assert size < 5_000_000, size
    data = page_data(path)
    assert data["series"]["reward/mean"]["rows"] == steps
    assert len(data["series"]["reward/mean"]["points"]) <= MAX_POINTS
    opened = Opened(browser, path)
    assert opened.errors == []
    (drawn,) = opened.points("reward/mean")
    assert 0.9 * MAX_POINTS <= drawn <= MAX_POINTS
    assert "downsampled" in opened.page.locator('[data-chart="reward"] .note').text_content()
    count = opened.page.locator("#sample-count")
    assert "spread over the run" in count.text_content()
    # 400 steps x 4 samples: drawn 200 at a time.
    assert opened.visible_samples() == 200 and "first 200 shown" in count.text_content()
    opened.page.click("#show-more")
    assert opened.visible_samples() == 400
    opened.page.close()
