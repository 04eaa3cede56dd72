"""A cheap reward in-process against the same reward in a sidecar: per-call latency and
throughput at batch sizes 1, 8 and 64, side by side in one run (this machine is noisy: read the
ratios).

    python benchmarks/sidecar.py [--calls 300] [--chars 200]

Both sides go through rollout's RewardRunner as a worker does: in-process, the function on a
deadline thread (rollout.harness.deadline); in a sidecar, one framed JSON round trip to a child
(rollout.plugins.sidecar). "bare fn" is the function called directly, for scale. The reward is benchmarks/bench_rewards.py:letter_share, a few
microseconds per completion, so what is measured is the call's overhead, not the reward's work.
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import string
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollout.harness.reward_contract import describe
from rollout.harness.reward_runner import RewardRunner
from rollout.plugins.resolve import resolve_plugin
from rollout.plugins.sidecar.host import SidecarCallable, SidecarHost, server_argv

HERE = Path(__file__).resolve().parent
REF = "./bench_rewards.py:letter_share"
BATCHES = (1, 8, 64)


def runners() -> tuple[RewardRunner, RewardRunner, SidecarCallable, Callable[..., Any]]:
    resolved = resolve_plugin(REF, base_dir=HERE, used_by="rewards[0].fn", builtins={})
    host = SidecarHost(server_argv(None, REF, resolved.identity.model_dump_json()), name="bench")
    sidecar = SidecarCallable(host, timeout_s=30)
    in_process = RewardRunner([describe("letter_share", resolved.fn, 1.0, {}, 30)])
    isolated = RewardRunner([describe("letter_share", sidecar, 1.0, {}, 30)])
    return in_process, isolated, sidecar, resolved.fn


def batch(size: int, chars: int, rng: random.Random) -> tuple[list[str], list[str], list[dict]]:
    text = string.ascii_letters + string.digits + " .,"
    completions = ["".join(rng.choices(text, k=chars)) for _ in range(size)]
    prompts = [f"What is {i} + 1?" for i in range(size)]
    rows = [{"prompt": p, "answer": str(i + 1)} for i, p in enumerate(prompts)]
    return prompts, completions, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=300, help="calls per side and batch size")
    parser.add_argument("--chars", type=int, default=200, help="characters per completion")
    args = parser.parse_args()
    in_process, isolated, sidecar, bare = runners()
    rng = random.Random(0)
    print(
        f"{args.calls} calls per cell (medians; compl/s from the mean), completions of {args.chars} characters"
    )
    print(
        f"{'batch':>5}  {'bare fn ms':>10}  {'in-process ms/call':>18}  {'sidecar ms/call':>15}  {'ratio':>6}  "
        f"{'in-process compl/s':>18}  {'sidecar compl/s':>15}  {'ratio':>6}"
    )
    try:
        for size in BATCHES:
            prompts, completions, rows = batch(size, args.chars, rng)
            assert (
                in_process.score(prompts, completions, rows).total
                == isolated.score(prompts, completions, rows).total
            )
            times: dict[str, list[float]] = {"bare": [], "in": [], "side": []}
            sides = {
                "bare": functools.partial(bare, prompts, completions),
                "in": functools.partial(in_process.score, prompts, completions, rows),
                "side": functools.partial(isolated.score, prompts, completions, rows),
            }
            for _ in range(args.calls):  # interleaved, so every side sees the same noise
                for key, call in sides.items():
                    start = time.perf_counter()
                    call()
                    times[key].append(time.perf_counter() - start)
            median = {key: statistics.median(values) for key, values in times.items()}
            rate = {key: size * len(values) / sum(values) for key, values in times.items()}
            print(
                f"{size:>5}  {median['bare'] * 1e3:>10.3f}  {median['in'] * 1e3:>18.3f}  {median['side'] * 1e3:>15.3f}  "
                f"{median['side'] / median['in']:>5.1f}x  {rate['in']:>18,.0f}  "
                f"{rate['side']:>15,.0f}  {rate['in'] / rate['side']:>5.1f}x"
            )
    finally:
        sidecar.close()


if __name__ == "__main__":
    main()
