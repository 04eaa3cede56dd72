"""plan.lock.example: the plan of examples/grpo-tiny.toml, made comparable across machines.

A real plan records this machine's hardware, absolute paths, a fresh run id and the time. The
example fixes all four (a reference 2-core, 24 GiB machine; paths relative to the repository; a
fixed run id and time), so the committed file changes only when planning itself changes. A test
regenerates it and compares everything but the installed versions.

    python -m rollout.testing.lockfile_example plan.lock.example
"""

from __future__ import annotations

import json
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from rollout.planner.definition import HardwareFacts, Plan

REPO = Path(__file__).resolve().parents[2]
EXAMPLE_CONFIG = REPO / "examples" / "grpo-tiny.toml"
REFERENCE_HARDWARE = HardwareFacts(
    platform="Linux-x86_64",
    cpu_count=2,
    memory_bytes=24 * 1024**3,
    memory_available_bytes=22 * 1024**3,
    gpus=[],
)


def example_plan() -> Plan:
    from rollout.planner.builder import build_plan

    plan = build_plan(
        EXAMPLE_CONFIG,
        overrides=["run.output_dir=runs"],
        hardware=REFERENCE_HARDWARE,
        run_id="grpo-tiny-20260101-000000-000000",
        created_at=datetime(2026, 1, 1, tzinfo=timezone.utc),
    )
    return Plan.model_validate(_relative(plan.model_dump(mode="json")))


def _relative(value: Any) -> Any:
    """Rewrite absolute paths under the repository (or the working directory) as relative."""
    if isinstance(value, dict):
        return {k: _relative(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_relative(v) for v in value]
    if isinstance(value, str):
        for root in (str(REPO), str(Path.cwd())):
            if value == root:
                return "."
            if value.startswith(root + "/"):
                return value[len(root) + 1 :]
            value = value.replace(f":{root}/", ":")
    return value


def comparable(lockfile_text: str) -> dict[str, Any]:
    """The parts of a plan.lock that must match across machines: all but versions and hash."""
    document = json.loads(lockfile_text)
    document.pop("sha256", None)
    document["plan"].pop("versions", None)
    return document


if __name__ == "__main__":
    from rollout.planner.lockfile import write_plan

    write_plan(example_plan(), sys.argv[1] if len(sys.argv) > 1 else "plan.lock.example")
