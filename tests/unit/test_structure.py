"""Structure is checked too: import directions, every module imports, validate stays torch-free."""

from __future__ import annotations

import ast
import importlib
import json
import pkgutil
import subprocess
import sys
import textwrap

import pytest

import rollout
from tests.conftest import EVAL_SUFFIX, EXAMPLES, REPO

PACKAGE = REPO / "rollout"

# The layers, lowest first (DESIGN.md, "Import direction"). A package may import the leaves and
# the packages named here, and nothing else of rollout; the rule is the design, never widened to
# fit code that breaks it. Every package and module of rollout has an entry (a test checks).
LEAVES = {"errors", "redact", "files", "fingerprints", "seeds", "version", "tracing"}
"""Standard-library-only modules every layer may use: the error types, redaction of credentials,
reading user-named files, content fingerprints, seeds derived from the run's root seed, the
installed version, named spans (OpenTelemetry imported only once tracing is configured)."""
ALLOWED = {
    "config": set(),  # pydantic models of the config: the bottom of the tree
    # generated from the config models, and the sidecar protocol's messages (plugins.sidecar)
    "schema": {"config", "plugins"},
    "plugins": set(),  # resolving references and their identity: knows nothing of a plan
    "storage": set(),  # the run store: rows in, rows out
    "algorithms": set(),  # pure tensor maths
    "engines": set(),  # generation backends: tensors and token ids, never config objects
    "models": {"config"},  # loading a model the [model] section and its ModelFacts describe
    "harness": {"models"},  # rewards (a reward model scores model batches)
    "planner": {"config", "plugins", "models", "harness"},  # the compiler
    "executor": {"config", "planner", "storage"},  # host side: verify a plan, launch, supervise
    # Inside a torchrun worker: composes the roles from the plan, and keeps the host's contract
    # (executor: where a failing rank leaves its traceback, dying with its parent); serves the
    # policy to agent programs over the OpenAI endpoint (serve: the server and its recorder).
    "runtime": {
        "config",
        "planner",
        "plugins",
        "models",
        "harness",
        "engines",
        "algorithms",
        "storage",
        "executor",
        "serve",
    },
    # `rollout generate`: a model, prompts and an engine, as a worker composes them; reads the
    # checkpoints a run wrote (runtime.checkpoint is their format). `rollout eval` scores what
    # it samples with the harness's scorers, or a scorer plugin resolved as rewards are.
    "inference": {
        "serve",  # the model sources `rollout serve` serves (inference/serve_source.py)
        "config",
        "planner",
        "plugins",
        "models",
        "engines",
        "storage",
        "runtime",
        "harness",
    },
    # The OpenAI-compatible server and its recorder, over an engine (a training run's own too).
    "serve": {"config", "models", "engines"},
    "testing": {"config", "planner", "models"},  # helpers for tests and plugin authors
    "cloud": set(),
    # `rollout snapshot`: a run's plan, checkpoint (runtime's format) and records, moved between
    # stores and artifacts; CRIU dumps of its processes (executor).
    "snapshots": {"config", "planner", "executor", "storage", "runtime"},
    # `rollout report`: a run's records and plan as one static HTML page.
    "reports": {"storage"},
    "cli": {
        "config",
        "schema",
        "planner",
        "executor",
        "storage",
        "inference",
        "serve",
        "snapshots",
        "reports",
    },
    "__init__": {"config", "planner", "executor"},  # the library face: load, plan, run
    "__main__": {"cli"},
}
ALLOWED.update({leaf: set() for leaf in LEAVES})  # leaves import only each other
FORBIDDEN_THIRD_PARTY = {
    "config": {"torch", "transformers", "typer", "rich"},
    "planner": {"torch", "transformers", "gguf", "vllm"},
    "schema": {"torch", "transformers"},
    "plugins": {"torch", "transformers"},
    "storage": {"torch", "transformers"},
}


def _imports(path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def _modules(package):
    single = PACKAGE / f"{package}.py"
    return [single] if single.exists() else sorted((PACKAGE / package).rglob("*.py"))


def _package_of(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_package_and_module_has_an_import_rule():
    names = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()}
    names = {n for n in names if not n.startswith(".") and n not in ("py", "__pycache__")}
    present = {n for n in names if (PACKAGE / n).is_dir() or (PACKAGE / f"{n}.py").exists()}
    assert present == set(ALLOWED), (
        f"without a rule: {present - set(ALLOWED)}; stale: {set(ALLOWED) - present}"
    )


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_import_direction(package):
    allowed = ALLOWED[package] | LEAVES | {package}
    wrong = []
    for path in _modules(package):
        for name in _imports(path):
            top = name.split(".")[0]
            if (
                top == "rollout" and _package_of(name) not in allowed
            ) or top in FORBIDDEN_THIRD_PARTY.get(package, ()):
                wrong.append(f"{path.relative_to(REPO)} imports {name}")
    assert not wrong, "\n".join(wrong)


def test_the_layers_have_no_loop():
    """The rules themselves allow no cycle between packages, so no change can add one quietly."""
    done: set[str] = set()

    def visit(package: str, path: tuple[str, ...]) -> None:
        assert package not in path, " -> ".join((*path, package))
        if package not in done:
            for target in ALLOWED[package]:
                visit(target, (*path, package))
            done.add(package)

    for package in ALLOWED:
        visit(package, ())


def test_algorithms_engines_harness_never_see_config_objects():
    for package in ("algorithms", "engines", "harness"):
        for path in _modules(package):
            assert not any(n.startswith("rollout.config") for n in _imports(path)), path


def test_only_the_transport_talks_to_other_ranks():
    """Every collective goes through rollout/runtime/transport.py (among ranks of one role) or
    weight_sync.py beside it (between actors and learners), the seams between ranks
    (torch.distributed.run, which launches the ranks, talks to none of them). The hosts' one
    seam, rollout/executor/control.py, talks to no rank: node 0's host to the other hosts, through
    a key of the rendezvous store, on SQLite runs whose joining hosts cannot read the run store."""
    seams = {
        PACKAGE / "runtime" / "transport.py",
        PACKAGE / "runtime" / "weight_sync.py",
        PACKAGE / "executor" / "control.py",
    }
    talking = [
        str(path.relative_to(REPO))
        for path in PACKAGE.rglob("*.py")
        if path not in seams
        and any(
            n.split(".")[:2] == ["torch", "distributed"] and n != "torch.distributed.run"
            for n in _imports(path)
        )
    ]
    assert not talking, talking


def test_the_online_and_offline_loops_do_not_import_each_other():
    for loop, other in (("online", "offline"), ("offline", "online")):
        for path in _modules(f"runtime/{loop}"):
            wrong = [n for n in _imports(path) if n.startswith(f"rollout.runtime.{other}")]
            assert not wrong, f"{path.relative_to(REPO)} imports {wrong}"


def test_every_module_imports():
    for info in pkgutil.walk_packages(rollout.__path__, "rollout."):
        if not info.name.endswith("__main__"):  # running it is its job; importing it would too
            importlib.import_module(info.name)


def test_validate_and_plan_never_import_torch(tmp_path):
    """In a fresh interpreter: validate every example, plan the tiny ones, torch stays out."""
    script = textwrap.dedent(f"""
        import json, sys
        from pathlib import Path
        from rollout import load_config, plan
        examples = sorted(p for p in Path({str(EXAMPLES)!r}).rglob("*.toml")
                          if not p.name.endswith({EVAL_SUFFIX!r}))
        for path in examples:
            load_config(path)
        planned = []
        for path in examples:
            if path.stem.endswith("-tiny"):
                plan(path, overrides=["run.output_dir={tmp_path}"])
                planned.append(path.name)
        print(json.dumps({{"torch": "torch" in sys.modules, "planned": planned,
                          "validated": len(examples)}}))
    """)
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=300
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["validated"] >= 5
    assert len(report["planned"]) >= 4
    assert report["torch"] is False
