"""How big and how fast a run report is for a long run: a store with ROWS metric rows (10 metrics
over ROWS/10 steps) and 4 samples a step, then `rollout report`'s time and file size, and the time
headless Chromium takes to load and draw the page (navigation start to the page's script done).

    python benchmarks/report_scale.py [--rows 1000000] [--chromium /usr/bin/chromium]
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

from rollout.reports.render import write_report
from rollout.storage import open_store
from rollout.storage.base import MetricRecord, SampleRecord
from rollout.testing.browser import CHROMIUM, CHROMIUM_ARGS

NAMES = ["reward/mean", "reward/std", "train/loss", "perf/step_s", "perf/generate_s"] + [
    f"train/extra_{i}" for i in range(5)
]


def fill(location: str, rows: int) -> None:
    steps = rows // len(NAMES)
    with open_store(location) as store:
        store.create_run("big", name="big", plan_sha256="-", plan_path="/none", run_dir="/none")
        for start in range(1, steps + 1, 10_000):
            store.add_metrics(
                MetricRecord("big", step, name, math.sin(step / 1000) + i, 0.0)
                for step in range(start, min(steps + 1, start + 10_000))
                for i, name in enumerate(NAMES)
            )
        store.add_samples(
            SampleRecord("big", step, i, "p" * 200, "c" * 400, None, 1.0, {}, 0.0)
            for step in range(1, steps + 1)
            for i in range(4)
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--chromium", default=CHROMIUM)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        location = f"sqlite:{Path(tmp) / 'rollout.db'}"
        fill(location, args.rows)
        with open_store(location, create=False) as store:
            started = time.perf_counter()
            path = write_report(store, store.get_run("big"), Path(tmp) / "report")
            made_s = time.perf_counter() - started
        print(f"{args.rows:,} metric rows: report written in {made_s:.2f} s, "
              f"{path.stat().st_size / 1e6:.2f} MB")  # fmt: skip
        from playwright.sync_api import sync_playwright

        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=args.chromium, args=CHROMIUM_ARGS)
            for attempt in range(3):
                page = browser.new_page()
                page.goto(path.as_uri())
                page.wait_for_selector("body[data-ready]", state="attached")
                load_ms = page.evaluate("performance.now()")
                print(f"load {attempt + 1}: page drawn {load_ms:.0f} ms after navigation start")
                page.close()
            browser.close()


if __name__ == "__main__":
    main()
