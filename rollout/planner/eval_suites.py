"""[[eval.suites]] at plan time: each suite's scorer resolved (a plugin once, here) and its rows
read and checked against it, with the checks `rollout eval` makes before loading weights; what
was read is frozen in plan.lock (file sha256, rows, the plugin's identity), so a changed suite
file makes the plan stale."""

from __future__ import annotations

from pathlib import Path

from rollout.config.algorithm import ONLINE_KINDS
from rollout.config.root import RunConfig
from rollout.errors import Issue, RolloutError
from rollout.fingerprints import sha256_file
from rollout.planner.definition import SuiteFacts
from rollout.plugins.identity import PluginIdentity


def inspect_suites(config: RunConfig, base: Path, issues: list[Issue]) -> list[SuiteFacts]:
    """One record per suite; problems are added to `issues`, every suite's together."""
    if config.eval is None or config.algorithm.kind not in ONLINE_KINDS:
        return []  # an offline run with [eval] is refused by the config's rules
    from rollout.inference.eval_suites import checked_suites, run_config_suites

    try:
        suites = checked_suites(run_config_suites(config.eval.suites, base), config.generation)
    except RolloutError as error:
        issues.extend(error.issues)
        return []
    return [
        SuiteFacts(
            name=suite.spec.name,
            location=suite.data,
            num_records=len(suite.rows),
            fingerprint=sha256_file(suite.data),
            scorer_plugin=PluginIdentity.model_validate(suite.plugin) if suite.plugin else None,
        )
        for suite in suites
    ]
