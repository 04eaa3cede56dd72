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
from tests.conftest import EXAMPLES, REPO

PACKAGE = REPO / "rollout"

# Which rollout sub-packages each package may import (DESIGN.md, "Import direction").
ALLOWED = {
    "config": {"config", "errors"},
    "schema": {"config", "errors", "schema"},
    # models: the builtin models' specs, GGUF headers and the cache path of a GGUF model's
    # dequantized copy (whose tokenizer the planner reads), all torch-free.
    "planner": {
        "config",
        "plugins",
        "errors",
        "planner",
        "models",
        "harness",
        "__init__",
    },
    "plugins": {"plugins", "errors"},
    "storage": {"storage", "config", "errors"},
    "executor": {"executor", "planner", "storage", "config", "errors"},
    "algorithms": {"algorithms"},
    "cli": {
        "cli",
        "config",
        "planner",
        "executor",
        "storage",
        "schema",
        "errors",
        "inference",
        "serve",
        "__init__",
    },
    # Batch inference composes a model, prompts and an engine, as a worker does.
    "inference": {
        "inference",
        "config",
        "planner",
        "engines",
        "runtime",
        "storage",
        "models",
        "errors",
    },
    # Models load from the plan's ModelFacts and the [model] section.
    "models": {"models", "config", "planner"},
}
# The server composes a model, an engine and the run store's checkpoints, as a worker does.
ALLOWED["serve"] = {
    "serve",
    "engines",
    "config",
    "planner",
    "runtime",
    "storage",
    "models",
    "errors",
    "inference",
}
# Standard-library-only modules every layer may use: redaction of credentials in any text,
# reading a user-named local file only when it is a regular file, with a size cap; content
# fingerprints; seeds derived from the run's root seed.
SHARED = {"redact", "files", "fingerprints", "seeds"}
FORBIDDEN_THIRD_PARTY = {
    "config": {"torch", "transformers", "typer", "rich"},
    "planner": {"torch", "transformers", "gguf", "vllm"},
    "schema": {"torch", "transformers"},
}


def _imports(path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def _modules(package):
    return sorted((PACKAGE / package).rglob("*.py"))


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_import_direction(package):
    wrong = []
    for path in _modules(package):
        for name in _imports(path):
            parts = name.split(".")
            if parts[0] == "rollout":
                target = parts[1] if len(parts) > 1 else "__init__"
                if target not in ALLOWED[package] | SHARED:
                    wrong.append(f"{path.relative_to(REPO)} imports {name}")
            elif parts[0] in FORBIDDEN_THIRD_PARTY.get(package, ()):
                wrong.append(f"{path.relative_to(REPO)} imports {name}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("module", sorted(SHARED))
def test_shared_modules_are_leaves(module):
    """Every layer imports them, so they import no other part of rollout but each other."""
    wrong = [
        name
        for name in _imports(PACKAGE / f"{module}.py")
        if name == "rollout" or (name.startswith("rollout.") and name.split(".")[1] not in SHARED)
    ]
    assert not wrong, f"rollout/{module}.py imports {', '.join(wrong)}"


def test_algorithms_engines_harness_never_see_config_objects():
    for package in ("algorithms", "engines", "harness"):
        for path in _modules(package):
            assert not any(n.startswith("rollout.config") for n in _imports(path)), path


def test_only_the_transport_talks_to_other_ranks():
    """Every collective goes through rollout/runtime/transport.py, the seam between ranks
    (torch.distributed.run, which launches the ranks, talks to none of them)."""
    talking = [
        str(path.relative_to(REPO))
        for path in PACKAGE.rglob("*.py")
        if path != PACKAGE / "runtime" / "transport.py"
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
        examples = sorted(Path({str(EXAMPLES)!r}).rglob("*.toml"))
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
