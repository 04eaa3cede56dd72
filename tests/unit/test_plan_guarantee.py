"""The plan guarantee: a plan that succeeds does not fail at run time on config, schema, plugin
discovery or topology.

Three parts. Every refusal `rollout run` can make before step 1 (its preflight, ownership and
store, and a worker's start-up) is enumerated from the source, and each is either caught by
`rollout plan` first (a case below) or can only arise at run time (with the reason). Each case is
refused by the planner, naming the key. And `run`'s preflight refuses the same config when it
comes in a plan.lock that never went through the planner (edited, hash recomputed), so the
guarantee does not rest on the lock being honest.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

from rollout.errors import ConfigError, LockfileError, PlanError, RolloutError
from rollout.executor.preflight import verify_plan
from rollout.planner.builder import build_plan
from rollout.planner.definition import HardwareFacts
from rollout.planner.lockfile import write_plan
from tests.conftest import REPO

GIB = 1024**3
LAPTOP = HardwareFacts(
    platform="test", cpu_count=8, memory_bytes=16 * GIB, memory_available_bytes=12 * GIB
)

# --- what the planner refuses: (config changes, the key it names) --------------------------------

CASES = {
    # Never set (tests/conftest.py never sets it): the planner reads the reference.
    "postgres DSN not set": (
        {"storage": {"backend": "postgres", "postgres_dsn": "env:ROLLOUT_TEST_UNSET_DSN"}},
        "storage.postgres_dsn",
    ),
    "restarts on several nodes": (
        {
            "cluster": {
                "device": "cpu",
                "nnodes": 2,
                "rdzv_endpoint": "node0.example:29500",
                "placement": {"actor": [0], "learner": [1]},
                "max_restarts": 2,
            }
        },
        "cluster.max_restarts",
    ),
    "several nodes without an endpoint": (
        {"cluster": {"device": "cpu", "nnodes": 2}},
        "cluster.rdzv_endpoint",
    ),
    "several nodes at a loopback endpoint": (
        {"cluster": {"device": "cpu", "nnodes": 2, "rdzv_endpoint": "127.0.0.1:29500"}},
        "cluster.rdzv_endpoint",
    ),
    "split placement": (
        {
            "cluster": {
                "device": "cpu",
                "nproc_per_node": 2,
                "placement": {"actor": [0, 1], "learner": [1]},
            }
        },
        "cluster.placement",
    ),
    "staleness with colocated roles": (
        {"algorithm": {"max_staleness": 1}},
        "algorithm.max_staleness",
    ),
    "threads past any machine": (
        {"cluster": {"device": "cpu", "threads_per_process": 9223372036854775807}},
        "cluster.threads_per_process",
    ),
    "threads past this machine": (
        {"cluster": {"device": "cpu", "threads_per_process": 9}},
        "cluster.threads_per_process",
    ),
    "artifacts in one process's memory": (
        {"storage": {"artifacts": "memory://ckpt"}},
        "storage.artifacts",
    ),
    "remote model": ({"model": {"path": "s3://bucket/model", "builtin": None}}, "model.path"),
    "remote tokenizer": (
        {"model": {"builtin": "tiny-llama", "tokenizer": "gs://bucket/tok"}},
        "model.tokenizer",
    ),
    "remote reward model": ({"rewards": [{"model": "s3://bucket/rm"}]}, "rewards[0].model"),
    "store file named by a URL": (
        {"storage": {"sqlite_path": "s3://bucket/rollout.db"}},
        "storage.sqlite_path",
    ),
    "run directory named by a URL": ({"run": {"output_dir": "s3://bucket/runs"}}, "run.output_dir"),
    "vllm without a GPU": ({"generation": {"engine": "vllm"}}, "generation.engine"),
    "cuda without a GPU": ({"cluster": {"device": "cuda"}}, "cluster.device"),
    "cuda graphs without a GPU": ({"generation": {"cuda_graphs": True}}, "generation.cuda_graphs"),
    "chat template the model lacks": (
        {
            "model": {"builtin": "tiny-llama", "chat_template": None},
            "data": {"use_chat_template": True},
        },
        None,  # filled below: only when the builtin lacks a template
    ),
}
if importlib.util.find_spec("s3fs") is None:
    CASES["artifacts on s3 without s3fs"] = (
        {"storage": {"artifacts": "s3://bucket/ckpt"}},
        "storage.artifacts",
    )
del CASES["chat template the model lacks"]  # the builtins ship one; see test_online_plan_checks


def merged(base: dict, changes: dict) -> dict:
    """`base` with `changes` applied, recursively; a None in `changes` removes the key."""
    out = dict(base)
    for key, value in changes.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merged(base.get(key) or {}, value) if isinstance(value, dict) else value
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_planner_refuses_what_run_cannot_do(case, config_file, base_config):
    changes, key = CASES[case]
    with pytest.raises((PlanError, ConfigError)) as caught:
        build_plan(config_file(merged(base_config, changes)), hardware=LAPTOP)
    paths = [issue.path for issue in caught.value.issues]
    assert key in paths, f"{case}: {caught.value}"
    named = next(issue for issue in caught.value.issues if issue.path == key)
    # A planner's refusal says what works instead; a field's own bound says it in its message.
    assert named.hint or isinstance(caught.value, ConfigError), f"{case}: {named}"


# Cases the executor's preflight asks again of the plan.lock it is handed.
PREFLIGHT = [
    "restarts on several nodes",
    "split placement",
    "staleness with colocated roles",
    "artifacts in one process's memory",
    "remote model",
    "remote tokenizer",
    "remote reward model",
]


@pytest.mark.parametrize("case", PREFLIGHT)
def test_run_refuses_the_same_in_a_lock_that_bypassed_the_planner(
    case, config_file, base_config, tmp_path
):
    plan = build_plan(config_file(base_config), hardware=LAPTOP)
    changes, key = CASES[case]
    # What the planner refuses, written into a good plan's config with a fresh, valid hash.
    raw = merged(plan.config.model_dump(mode="json"), changes)
    if case == "split placement":
        from rollout.config import validate_config
        from rollout.planner.placement import build_graph

        config = validate_config(raw)
        seeds = plan.seeds.model_copy(update={"per_rank": [1, 2]})
        tampered = plan.model_copy(
            update={"config": config, "graph": build_graph(config, "cpu"), "seeds": seeds}
        )
    else:
        tampered = plan.model_copy(update={"config": plan.config.model_validate(raw)})
    lock = tmp_path / "tampered.lock"
    write_plan(tampered, lock)
    with pytest.raises(LockfileError) as caught:
        verify_plan(lock)
    assert key in [issue.path for issue in caught.value.issues], str(caught.value)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("run_id", "../escape", "run_id"),
        ("run_id", "a/b", "run_id"),
        ("derived.total_steps", -5, "total_steps"),
        ("derived.minibatch_size", 0, "minibatch_size"),
        ("derived.run_dir", "/tmp/../etc", "run_dir"),
        ("config.algorithm.rollout_batch_size", 10, "not divisible"),  # a cross-field rule
        ("seeds.per_rank", [], "one seed per rank"),
    ],
)
def test_a_lock_with_a_recomputed_hash_is_still_validated(
    field, value, message, config_file, base_config, tmp_path
):
    import json

    from rollout.planner.lockfile import _serialize

    plan = build_plan(config_file(base_config), hardware=LAPTOP)
    content = plan.model_dump(mode="json")
    *parents, leaf = field.split(".")
    target = content
    for part in parents:
        target = target[part]
    target[leaf] = value
    lock = tmp_path / "edited.lock"
    lock.write_bytes(_serialize(content))  # a valid hash over the edited content
    assert json.loads(lock.read_text())["sha256"]
    with pytest.raises(LockfileError) as caught:
        verify_plan(lock)
    assert message in str(caught.value)


# --- every refusal on run's way to step 1, enumerated from the source ----------------------------

# The modules `rollout run` executes before the first step: the host's preflight, ownership and
# store, and a worker's start-up.
ON_RUNS_PATH = [
    "rollout/executor/preflight.py",
    "rollout/executor/launch.py",
    "rollout/executor/join.py",
    "rollout/executor/rendezvous.py",
    "rollout/executor/ownership.py",
    "rollout/planner/lockfile.py",
    "rollout/storage/__init__.py",
    "rollout/storage/postgres.py",
    "rollout/runtime/worker.py",
    "rollout/models/loading.py",
    "rollout/runtime/components.py",
]

# Each `raise` on that path, by a fragment of its source: caught at plan (the CASES key that
# shows it, or the test that does), or why only run time can know.
REFUSALS = {
    "LockfileError(refusals": "plan: every check in rollout/planner/runnable.py (CASES above)",
    "already belongs to another plan": "run time: the store's state, not the config",
    "already_running(": "run time: another process owns the run at this moment",
    "is not a node of this plan": "run time: --node-rank is a command-line argument, checked "
    "against the plan's cluster.nnodes (test_multi_node_plan)",
    "is named postgres:env:NAME": "unreachable from a plan: the builder writes postgres: and "
    "storage.postgres_dsn, a reference the config validated",
    "needs psycopg 3, which is not installed": "plan: runnable refuses storage.backend "
    "postgres without psycopg (test_postgres_without_psycopg_is_refused_by_plan_and_run)",
    "cannot read the DSN": "plan: CASES['postgres DSN not set'] (store_check reads it)",
    "cannot connect to the postgres run store": "plan: store_check connects (test_store_plan); "
    "a server gone since planning is run time",
    "not a libpq connection string": "plan: store_check parses the DSN (test_store_plan)",
    "cannot create the run store's tables": "plan: store_check creates them, rolled back "
    "(test_store_plan); permissions changed since planning are run time",
    "self._gone(": "run time: the server went away mid-run for longer than reconnect_s",
    'Issue("run store", message': "unreachable from a plan: the builder writes sqlite: or "
    "postgres: store locations only (an unknown scheme is a reader's --store mistake)",
    "no run store here": "readers only (runs, logs); run creates its store",
    "cannot open the run store": "run time: the store file was damaged after planning",
    "a run id has no": "readers only; a plan's run_id is validated (test above)",
    "no run {run_id!r}": "readers only",
    "is NaN or infinite": "plan: plan.lock is written by `rollout plan`, which refuses it then",
    "for r in reasons": "run time: what changed since planning (files, versions); re-plan",
    "_refuse(": "run time: the plan.lock file itself is damaged, edited or of another format",
    "RecursionError": "run time: a plan.lock nested too deeply (refused as edited)",
    "is not a JSON number": "run time: a plan.lock holding NaN (refused as edited)",
    "the model has no chat template": "plan: inspect_samples refuses data.use_chat_template "
    "without a template (test_online_plan_checks)",
    "remote models are not loaded yet": "plan: CASES['remote model']",
    "define no end-of-sequence token": "plan: the planner's tokenizer needs an eos token id "
    "(rollout/planner/tokenizer.py refuses a model without one)",
}


def _raise_sites(path: Path) -> list[str]:
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source)
    return [
        ast.get_source_segment(source, node) or ""
        for node in ast.walk(tree)
        if isinstance(node, ast.Raise) and node.exc is not None
    ]


def _function_sources(path: Path) -> dict[str, str]:
    source = path.read_text(encoding="utf-8")
    return {
        node.name: ast.get_source_segment(source, node) or ""
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef)
    }


@pytest.mark.parametrize("module", ON_RUNS_PATH)
def test_every_refusal_on_runs_path_is_caught_at_plan_or_explained(module):
    path = REPO / module
    functions = _function_sources(path)
    unexplained = []
    for site in _raise_sites(path):
        # A raise of a helper's result (`raise _refuse(...)`) is explained by the helper's call;
        # a raise inside a helper counts with the messages the helper builds.
        context = site + "".join(
            body for name, body in functions.items() if site.startswith(f"raise {name}(")
        )
        if not any(fragment in context for fragment in REFUSALS):
            unexplained.append(site.splitlines()[0])
    assert not unexplained, (
        f"refusals in {module} that plan does not catch first and no reason covers: "
        f"{unexplained}; add a plan-time check (rollout/planner/runnable.py) or a reason here"
    )


def test_every_explained_refusal_still_exists():
    sources = "".join((REPO / module).read_text(encoding="utf-8") for module in ON_RUNS_PATH)
    stale = [fragment for fragment in REFUSALS if fragment not in sources]
    assert not stale, f"reasons for refusals that are gone: {stale}"


def test_postgres_without_psycopg_is_refused_by_plan_and_run(
    config_file, base_config, tmp_path, monkeypatch
):
    import importlib.util

    postgres = {"storage": {"backend": "postgres", "postgres_dsn": "env:ROLLOUT_TEST_UNSET_DSN"}}
    plan = build_plan(config_file(base_config), hardware=LAPTOP)
    raw = merged(plan.config.model_dump(mode="json"), postgres)
    lock = tmp_path / "postgres.lock"
    write_plan(plan.model_copy(update={"config": plan.config.model_validate(raw)}), lock)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *rest: None if name == "psycopg" else find_spec(name, *rest),
    )
    for refuse in (
        lambda: build_plan(config_file(merged(base_config, postgres), "pg.toml"), hardware=LAPTOP),
        lambda: verify_plan(lock),
    ):
        with pytest.raises(RolloutError) as caught:
            refuse()
        (issue,) = [i for i in caught.value.issues if i.path == "storage.backend"]
        assert "needs psycopg 3" in issue.message and "rollout[postgres]" in issue.hint


def test_a_refusal_in_a_lock_is_a_user_error():
    assert issubclass(LockfileError, RolloutError)


# --- the run store: one plan per run id; a finished run is not started again -------------------


def _planned(config_file, base_config, tmp_path):
    base_config["run"]["output_dir"] = str(tmp_path / "runs")
    plan = build_plan(config_file(base_config), hardware=LAPTOP)
    lock = tmp_path / "plan.lock"
    write_plan(plan, lock)
    return plan, lock


def test_a_lock_whose_run_id_belongs_to_another_plan_is_refused(config_file, base_config, tmp_path):
    from rollout.executor.launch import run_plan
    from rollout.storage import open_store

    plan, lock = _planned(config_file, base_config, tmp_path)
    with open_store(plan.derived.store) as store:
        store.create_run(plan.run_id, name="t", plan_sha256="0" * 64, plan_path="p", run_dir="d")
    with pytest.raises(RolloutError) as caught:
        run_plan(lock)
    assert "already belongs to another plan" in str(caught.value)
    assert not (Path(plan.derived.run_dir) / "plan.lock").exists()  # nothing was touched


def test_re_running_a_finished_plan_starts_nothing(config_file, base_config, tmp_path):
    import json

    from rollout.executor.launch import Progress, run_plan
    from rollout.storage import open_store

    plan, lock = _planned(config_file, base_config, tmp_path)
    sha = json.loads(lock.read_text())["sha256"]
    with open_store(plan.derived.store) as store:
        store.create_run(plan.run_id, name="t", plan_sha256=sha, plan_path="p", run_dir="d")
        store.set_status(plan.run_id, "finished")
    told = []
    record = run_plan(lock, progress=Progress(on_already_finished=lambda p, r: told.append(r)))
    assert record.status == "finished" and told == [record]
    assert not (Path(plan.derived.run_dir) / "torchrun.log").exists()


def test_a_config_path_with_a_nul_is_a_user_error_from_python_too():
    import rollout

    with pytest.raises(ConfigError, match="embedded null byte"):
        rollout.plan("a\0b.toml")
