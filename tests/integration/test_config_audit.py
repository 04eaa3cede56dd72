"""Nothing accepted and then ignored: every config field, changed, changes what rollout does.

`config_fields()` walks RunConfig: every section, nested models (data.train, data.fields, ...),
list items (rewards[].x), and every branch of the `algorithm` union, whose fields are keyed per
kind ("algorithm[grpo].lr"). CASES holds, for each of them, at least one case: a base config of
one algorithm kind, a change (the field first, then whatever the change needs to be valid), and
the evidence that the field is read:

- Refused: `rollout plan` refuses the changed config with an issue naming the field: where a
  field means nothing (gpu_memory_utilization without vLLM, a system prompt without the chat
  template, ...) or what it asks for cannot run here (several nodes);
- PlanShows: the plans of the base and the changed config differ beyond the echoed config:
  derived values, graph, memory, model or data facts, seeds (or one of them is refused);
- RunShows: runs of both differ: the weights of the last checkpoint, recorded metrics, log lines,
  files written, or how the run failed.

A field whose effect no case can show here would need a reason in UNOBSERVABLE, one line each,
reviewed; there is none: what needs a GPU, vLLM or several nodes is refused here, and its case
compares that refusal with the plan it gets where it can run. A new field without a case fails
`test_every_field_has_a_case`.

Runs are the real worker (rollout.runtime.worker.main) in this process, on the tiny model: one
baseline per kind (and per base change), cached for the module, one field changed at a time;
`test_runs_repeat_exactly` checks that a run differs only when its config does.
"""

from __future__ import annotations

import copy
import faulthandler
import hashlib
import json
import logging
import shutil
import signal
import sys
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from rollout.config.algorithm import ONLINE_KINDS
from rollout.config.root import RunConfig
from rollout.errors import RolloutError
from rollout.models.builtin_build import builtin_model_dir
from rollout.planner.builder import build_plan
from rollout.planner.definition import Plan
from rollout.planner.hardware import probe_hardware
from rollout.planner.lockfile import write_plan
from rollout.storage import open_store
from tests.conftest import COMMITS, HUB_ID, HubCache, write_toml

pytestmark = pytest.mark.slow

# --- the fields ----------------------------------------------------------------------------------


def _models_in(annotation: Any) -> list[tuple[str, type[BaseModel]]]:
    """The config models a field holds, with "[]" for list items: (suffix, model)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _models_in(typing.get_args(annotation)[0])
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [("", annotation)]
    if origin in (typing.Union, types.UnionType):
        return [found for arg in typing.get_args(annotation) for found in _models_in(arg)]
    if origin is list:
        return [("[]", model) for _, model in _models_in(typing.get_args(annotation)[0])]
    return []


def config_fields(model: type[BaseModel] = RunConfig, prefix: str = "") -> set[str]:
    """Every leaf field of the config, by dotted path; the algorithm's per kind."""
    found = set()
    for name, info in model.model_fields.items():
        models = _models_in(info.annotation)
        if not models:
            found.add(f"{prefix}{name}")
        for suffix, inner in models:
            kind = inner.model_fields.get("kind")
            if name == "algorithm" and kind is not None:
                (literal,) = typing.get_args(kind.annotation)
                found |= config_fields(inner, f"{prefix}{name}[{literal}].")
            else:
                found |= config_fields(inner, f"{prefix}{name}{suffix}.")
    return found


# --- base configs --------------------------------------------------------------------------------

WORKDIR = "{workdir}"
"""Stands for the audit's working directory in config values."""

DELETE = object()
"""As a changed value: remove the key."""

ONLINE_RECORDS = [
    {
        "prompt": f"What is {i} + 1?",
        "question": f"Add one to {i}, please.",
        "answer": str(i + 1),
        "solution": f"{i} and one make {i + 1}",
    }
    for i in range(18)
]


def _offline_record(i: int) -> dict[str, Any]:
    a, b = 3 + 7 * i, 11 + 5 * i
    prompt = f"What is {a} + {b}?"
    return {
        "prompt": prompt,
        "chosen": str(a + b),
        "rejected": f"{a}{b}",
        "other": f"{a + b + 1}",
        "completion": f"It is {a + b}.",
        "label": i % 2 == 0,
        "flipped": i % 2 == 1,
        "messages": [
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": f"The sum is {a + b}."},
        ],
    }


OFFLINE_RECORDS = [_offline_record(i) for i in range(12)]

FIELDS = {
    "dpo": {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected"},
    "ipo": {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected"},
    "rm": {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected"},
    "kto": {"prompt": "prompt", "completion": "completion", "label": "label"},
    "sft": {"prompt": "prompt", "completion": "completion"},
}

KINDS = (*ONLINE_KINDS, *FIELDS)


def base_config(kind: str) -> dict[str, Any]:
    """Two steps of `kind` on the tiny model, with an eval split. Online: two prompts a step,
    four completions of up to 4 tokens each (a group of 4 rarely scores all alike, so every
    optimizer step has a gradient), in two minibatches; offline: batches of 4 of 8 records."""
    config: dict[str, Any] = {
        "run": {"name": "audit", "seed": 1, "output_dir": f"{WORKDIR}/runs"},
        "model": {"builtin": "tiny-llama"},
        "cluster": {"device": "cpu", "threads_per_process": 1},
    }
    if kind in ONLINE_KINDS:
        config["data"] = {
            "train": {"path": "online-train.jsonl"},
            "eval": {"path": "online-eval.jsonl"},
            "fields": {"prompt": "prompt"},
        }
        config["algorithm"] = {
            "kind": kind,
            "lr": 1e-3,
            "max_steps": 2,
            "rollout_batch_size": 8,
            "num_generations": 4,
            "minibatch_size": 4,
        }
        config["generation"] = {"max_new_tokens": 4, "max_prompt_tokens": 48}
        config["rewards"] = [{"fn": "length_penalty", "options": {"target_chars": 1}}]
    else:
        config["data"] = {
            "train": {"path": "offline-train.jsonl"},
            "eval": {"path": "offline-eval.jsonl"},
            "fields": dict(FIELDS[kind]),
        }
        config["algorithm"] = {"kind": kind, "lr": 1e-3, "batch_size": 4, "max_length": 64}
    return config


REWARD_PLUGINS = '''
import time

from rollout.harness.environments.base import StepResult


def answer_chars(prompts, completions, answer, **_):
    """The length of the answer a reward is given: shows which field data.fields.answer maps."""
    return [float(len(str(a))) for a in answer]


def slow(prompts, completions, **_):
    time.sleep(0.1)
    return [0.0 for _ in completions]


class Chars:
    """Never done; each answer earns its length over 8; says a lot between answers; takes a
    moment (so a tiny timeout_s is passed)."""

    def reset(self, rows, *, seed):
        return [str(row["prompt"]) for row in rows]

    def step(self, episodes, actions):
        time.sleep(0.05)
        return [StepResult("keep going " * 20, reward=len(a) / 8) for a in actions]


class Broken(Chars):
    def step(self, episodes, actions):
        raise RuntimeError("lost its board")


def runs_code(prompts, completions, require_network_isolation=True, **_):
    """Declares it runs model-written code, so the plan decides its sandbox."""
    return [0.0 for _ in completions]


runs_code.runs_model_code = True


def lookup(city):
    return city.upper()


lookup.schema = {
    "name": "lookup",
    "description": "Look a city up.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def digest(row, completion):
    """An eval scorer that tells completions apart (a random model answers no sum right)."""
    return sum(map(ord, completion)) % 97 / 96
'''

TEMPLATE = (
    "{%- for message in messages %}{{ message['role'] + ': ' + message['content'] + '\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ 'assistant: ' }}{%- endif %}"
)


def _write_jsonl(path: Path, records: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


def _prepare(workdir: Path) -> None:
    """Data, a reward plugin file, and the models and tokenizer the model.* cases point at."""
    _write_jsonl(workdir / "online-train.jsonl", ONLINE_RECORDS[:16])
    _write_jsonl(workdir / "online-eval.jsonl", ONLINE_RECORDS[16:])
    _write_jsonl(workdir / "offline-train.jsonl", OFFLINE_RECORDS[:8])
    _write_jsonl(workdir / "offline-eval.jsonl", OFFLINE_RECORDS[8:])
    suite = [{**r, "category": "low" if i < 2 else "high"} for i, r in enumerate(ONLINE_RECORDS)]
    _write_jsonl(workdir / "suite.jsonl", suite[:4])
    _write_jsonl(workdir / "suite-b.jsonl", suite[4:8])
    (workdir / "audit_rewards.py").write_text(REWARD_PLUGINS, encoding="utf-8")
    llama = builtin_model_dir("tiny-llama")
    shutil.copytree(llama, workdir / "models" / "llama")
    # A directory with a Hugging Face model and a (never read) GGUF file: two models in one.
    shutil.copytree(llama, workdir / "models" / "mixed")
    (workdir / "models" / "mixed" / "other.gguf").write_bytes(b"GGUF")
    # An installed package that ships a model (found on sys.path, never imported).
    package = workdir / "site" / "audit_model_pkg"
    shutil.copytree(llama, package)
    (package / "__init__.py").write_text("")
    # The model's own tokenizer with another chat template.
    tokenizer = workdir / "tokenizer"
    tokenizer.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(llama / name, tokenizer / name)
    (tokenizer / "chat_template.jinja").write_text(TEMPLATE, encoding="utf-8")
    # A Hugging Face cache (HF_HUB_CACHE, set by the audit fixture) with two commits of a model.
    hub = HubCache(workdir / "hf-hub", llama)
    hub.add(commit=COMMITS[0])
    hub.add(commit=COMMITS[1], ref="v2")


# --- plans and runs ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Refusal:
    """A config `rollout plan` refused, and the config paths its issues name."""

    issues: tuple[tuple[str, str], ...]
    """(path, the issue as `rollout plan` prints it)."""

    def names(self, path: str) -> bool:
        """Whether an issue is at `path`, or says what is wrong with it in its message."""
        return any(at == path or path in text for at, text in self.issues)


@dataclass(frozen=True)
class RunResult:
    plan: Plan
    error: str | None
    """The worker's traceback (errors/rank-0.txt) when it failed."""
    metrics: dict[str, dict[int, float]]
    logs: list[tuple[str, str]]
    """(level, message) of every log line the run recorded."""
    files: frozenset[str]
    """Files written under the run directory, relative to it."""
    weights: str | None
    """sha256 of the trained weights (policy, and critic or value head) of the last checkpoint."""
    samples: tuple[tuple[int, int], ...] = ()
    """(step, index) of every sample completion the run recorded."""

    def checkpoints(self) -> list[str]:
        return sorted({f.split("/")[1] for f in self.files if f.startswith("checkpoints/step-")})


def _steps(path: str) -> list[str | int]:
    """ "rewards[0].fn" -> ["rewards", 0, "fn"]."""
    steps: list[str | int] = []
    for part in path.split("."):
        name, *indices = part.replace("]", "").split("[")
        steps.append(name)
        steps += [int(i) for i in indices]
    return steps


def _with(config: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = _steps(path)
    node: Any = config
    for step in parents:
        node = node.setdefault(step, {}) if isinstance(step, str) else node[step]
    if value is DELETE:
        node.pop(last, None)
    else:
        node[last] = copy.deepcopy(value)


def _fill(value: Any, audit: Audit) -> Any:
    """`value` with WORKDIR replaced, and callables (what only an earlier run can tell, like
    the directory of a trained reward model) called."""
    if callable(value):
        return value(audit)
    if isinstance(value, str):
        return value.replace(WORKDIR, str(audit.workdir))
    if isinstance(value, dict):
        return {k: _fill(v, audit) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill(v, audit) for v in value]
    return value


class Audit:
    """Plans and runs configs in one working directory, each config once."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.hardware = probe_hardware()
        self._plans: dict[str, Plan | Refusal] = {}
        self._runs: dict[str, RunResult] = {}

    def config(self, kind: str, *changes: Mapping[str, Any]) -> dict[str, Any]:
        config = base_config(kind)
        for change in changes:
            for path, value in change.items():
                _with(config, path, value)
        return _fill(config, self)

    def plan(self, config: dict[str, Any]) -> Plan | Refusal:
        key = _key(config)
        if key not in self._plans:
            path = write_toml(self.workdir / f"config-{key[:16]}.toml", config)
            try:
                self._plans[key] = build_plan(path, hardware=self.hardware)
            except RolloutError as error:
                self._plans[key] = Refusal(tuple((i.path, str(i)) for i in error.issues))
        return self._plans[key]

    def run(self, config: dict[str, Any], *, cached: bool = True) -> RunResult:
        key = _key(config)
        if cached and key in self._runs:
            return self._runs[key]
        plan = (
            self.plan(config)
            if cached
            else build_plan(
                write_toml(self.workdir / f"config-{key[:16]}.toml", config), hardware=self.hardware
            )
        )
        assert isinstance(plan, Plan), f"the config does not plan: {plan}"
        result = run_worker(plan)
        if cached:
            self._runs[key] = result
        return result

    def baseline(self, kind: str) -> RunResult:
        result = self.run(self.config(kind))
        assert result.error is None, result.error
        return result


def _key(config: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()


def run_worker(plan: Plan) -> RunResult:
    """Run `plan` as `rollout run` would with one process, the worker in this process: its store
    row created, then rollout.runtime.worker.main on the plan.lock in the run directory."""
    from rollout.runtime import worker

    run_dir = Path(plan.derived.run_dir)
    run_dir.mkdir(parents=True)
    lock = run_dir / "plan.lock"
    write_plan(plan, lock)
    store = open_store(plan.derived.store)
    store.create_run(
        plan.run_id,
        name=plan.config.run.name,
        plan_sha256="-",
        plan_path=str(lock),
        run_dir=str(run_dir),
    )
    with _process_state_kept():
        code = worker.main(["--plan", str(lock)])
    error_file = run_dir / "errors" / "rank-0.txt"
    error = error_file.read_text() if error_file.exists() else None
    assert (code == 0) == (error is None), (code, error)
    metrics: dict[str, dict[int, float]] = {}
    for row in store.metrics(plan.run_id):
        metrics.setdefault(row.name, {})[row.step] = row.value
    logs = [(row.level, row.message) for row in store.logs(plan.run_id, limit=100_000)]
    samples = tuple((row.step, row.index) for row in store.samples(plan.run_id))
    store.close()
    files = frozenset(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file())
    weights = _weights(Path(plan.derived.artifacts))
    return RunResult(plan, error, metrics, logs, files, weights, samples)


def _weights(artifacts: Path) -> str | None:
    steps = sorted(artifacts.glob("step-*"))
    if not steps:
        return None
    digest = hashlib.sha256()
    for name in (
        "model/model.safetensors",
        "critic/weights.safetensors",
        "value_head/weights.safetensors",
        "adapter/adapter_model.safetensors",
    ):
        path = steps[-1] / name
        if path.exists():
            digest.update(name.encode() + path.read_bytes())
    return digest.hexdigest()


class _process_state_kept:
    """What the worker sets for its process (signal handlers, the rollout logger, torch threads,
    faulthandler), put back afterwards."""

    def __enter__(self) -> None:
        import torch

        self.signals = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
        logger = logging.getLogger("rollout")
        self.logger = (list(logger.handlers), logger.level, logger.propagate)
        self.threads = torch.get_num_threads()
        self.faulthandler = faulthandler.is_enabled()

    def __exit__(self, *_: object) -> None:
        import torch

        for number, handler in self.signals.items():
            signal.signal(number, handler)
        logger = logging.getLogger("rollout")
        logger.handlers[:], logger.level, logger.propagate = self.logger
        torch.set_num_threads(self.threads)
        if self.faulthandler:
            faulthandler.enable(file=sys.__stderr__, all_threads=True)


# --- evidence ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Refused:
    """`rollout plan` refuses the changed config, naming the field; it plans the base."""


@dataclass(frozen=True)
class PlanShows:
    """`what` of the base plan differs from `what` of the changed plan (a refusal is itself)."""

    what: Callable[[Plan], Any]


@dataclass(frozen=True)
class RunShows:
    """`what` of the base run differs from `what` of the changed run; `fails`: the changed run
    is expected to fail (otherwise both must succeed)."""

    what: Callable[[RunResult], Any]
    fails: bool = False


Evidence = Refused | PlanShows | RunShows


@dataclass(frozen=True)
class Case:
    kind: str
    change: Mapping[str, Any]
    """Config path -> value; the audited field first, then what the change needs to be valid."""
    evidence: Evidence
    base: Mapping[str, Any] = field(default_factory=dict)
    """Changes to the kind's base config, applied to both sides."""


def refused(kind: str, change: Mapping[str, Any], base: Mapping[str, Any] | None = None) -> Case:
    return Case(kind, change, Refused(), base or {})


def plan_shows(kind, change, what, base=None) -> Case:
    return Case(kind, change, PlanShows(what), base or {})


def run_shows(kind, change, what=None, base=None, fails=False) -> Case:
    return Case(kind, change, RunShows(what or weights, fails), base or {})


# What a plan or a run shows.


def weights(run: RunResult) -> str | None:
    return run.weights


def metric(name: str) -> Callable[[RunResult], Any]:
    return lambda run: run.metrics.get(name)


def steps_of(prefix: str) -> Callable[[RunResult], Any]:
    """The steps at which metrics named `prefix`... were recorded."""
    return lambda run: sorted(
        {step for name, steps in run.metrics.items() if name.startswith(prefix) for step in steps}
    )


def names_of(prefix: str) -> Callable[[RunResult], Any]:
    return lambda run: sorted(name for name in run.metrics if name.startswith(prefix))


def files(pattern: str) -> Callable[[RunResult], Any]:
    return lambda run: sorted(f for f in run.files if fnmatch(f, pattern))


def timed_out(run: RunResult) -> bool:
    """Whether the run stopped on a reward that did not return within its timeout_s."""
    return "did not return within" in (run.error or "")


def derived(name: str) -> Callable[[Plan], Any]:
    """A derived value, with the run directory (whose name is the run id, new in every plan)
    written as RUN_DIR."""
    return lambda plan: str(getattr(plan.derived, name)).replace(plan.derived.run_dir, "RUN_DIR")


def roles(plan: Plan) -> list[str]:
    return [role.role for role in plan.graph.roles]


def memory(plan: Plan) -> list[dict[str, int]]:
    return [estimate.items for estimate in plan.memory]


def data_facts(split: str, name: str) -> Callable[[Plan], Any]:
    return lambda plan: next(getattr(f, name) for f in plan.data if f.split == split)


def _reward_model_run(audit: Audit) -> str:
    """The run directory of the rm baseline: a trained reward model for rewards[].model."""
    return audit.baseline("rm").plan.derived.run_dir


REWARD_MODEL = {"rewards": [{"model": _reward_model_run}]}
# Multi-turn episodes: the environment gives the rewards, and evaluation is single-turn only.
CHARS = {
    "environment": {"name": "./audit_rewards.py:Chars", "max_turns": 2},
    "rewards": DELETE,
    "data.eval": DELETE,
}
BROKEN_CONTAINED = {
    **CHARS,
    "environment": {
        "name": "./audit_rewards.py:Broken",
        "max_turns": 2,
        "on_error": "fail_episode",
    },
}
# The tools environment: [[rewards]] score the final answers; the tools' declarations come
# before every prompt (about 450 tokens of the tiny tokenizer for the calculator).
TOOLS = {
    "environment": {"name": "tools", "max_turns": 2, "tools": [{"name": "calculator"}]},
    "data.eval": DELETE,
    "generation.max_prompt_tokens": 600,
}
LOOKUP_TOOL = {**TOOLS, "environment.tools": [{"name": "./audit_rewards.py:lookup"}]}
PYTHON_TOOL = {**TOOLS, "environment.tools": [{"name": "python"}]}
FSDP_MIXED = {
    "cluster.nproc_per_node": 2,
    "cluster.sharding": "fsdp",
    "cluster.fsdp_mixed_precision": {},
}
# An eval suite scored during training (data.eval stays: the suites are recorded beside it).
SUITE = {
    "eval.suites": [
        {"name": "sums", "scorer": "./audit_rewards.py:digest", "data": "suite.jsonl"},
    ]
}
SAMPLED_SUITE = {
    "eval.suites": [{**SUITE["eval.suites"][0], "samples": 2, "temperature": 1.0}],
}
STOPS = {"generation.stop": ["e"]}
"""Completions of different lengths, for the loss aggregations to tell apart."""
SLOW_REWARD = {
    "rewards": [
        {"fn": "length_penalty", "options": {"target_chars": 1}},
        {"fn": "./audit_rewards.py:slow", "weight": 0.0},
    ]
}
CODE_REWARD = {"rewards": [{"fn": "./audit_rewards.py:runs_code"}]}
ANSWER_REWARD = {
    "data.fields.answer": "answer",
    "rewards": [
        {"fn": "length_penalty", "options": {"target_chars": 1}},
        {"fn": "./audit_rewards.py:answer_chars", "weight": 0.0},
    ],
}
OTHER_KIND = {
    "grpo": {"algorithm.kind": "rloo"},
    "rloo": {"algorithm.kind": "grpo"},
    "ppo": {"algorithm.kind": "reinforce_pp"},
    "reinforce_pp": {"algorithm.kind": "ppo"},
    "dpo": {"algorithm.kind": "rm"},
    "ipo": {"algorithm.kind": "rm"},
    "rm": {"algorithm.kind": "dpo"},
    "kto": {"algorithm.kind": "sft", "data.fields.label": DELETE},
    "sft": {"algorithm.kind": "kto", "data.fields.label": "label"},
}
"""A sibling kind that reads the same data."""


# --- the cases -----------------------------------------------------------------------------------


LORA_ON: dict[str, Any] = {"model.lora": {}}
LORA = (derived("adapter_parameters"), LORA_ON)
"""What a LoRA setting shows in the plan, and the base config that trains adapters."""


def _optimizer_cases(kind: str) -> dict[str, list[Case]]:
    at = f"algorithm[{kind}]."
    cases = {
        "lr": run_shows(kind, {"algorithm.lr": 3e-3}),
        "lr_schedule": run_shows(kind, {"algorithm.lr_schedule": "linear"}),
        "warmup_steps": run_shows(kind, {"algorithm.warmup_steps": 2}),
        "weight_decay": run_shows(kind, {"algorithm.weight_decay": 0.1}),
        "adam_betas": run_shows(kind, {"algorithm.adam_betas": [0.5, 0.9]}),
        "adam_eps": run_shows(kind, {"algorithm.adam_eps": 1e-3}),
        "max_grad_norm": run_shows(kind, {"algorithm.max_grad_norm": 1e-3}),
        "micro_batch_size": plan_shows(
            kind, {"algorithm.micro_batch_size": 1}, derived("grad_accumulation")
        ),
        "kind": (
            run_shows(kind, OTHER_KIND[kind])
            if kind in ("grpo", "rloo")
            else plan_shows(kind, OTHER_KIND[kind], roles)
        ),
    }
    return {at + name: [case] for name, case in cases.items()}


def _online_cases(kind: str) -> dict[str, list[Case]]:
    at = f"algorithm[{kind}]."
    cases = {
        "max_steps": [plan_shows(kind, {"algorithm.max_steps": 3}, derived("total_steps"))],
        "rollout_batch_size": [
            plan_shows(kind, {"algorithm.rollout_batch_size": 16}, derived("prompts_per_step"))
        ],
        "num_generations": [
            plan_shows(kind, {"algorithm.num_generations": 8}, derived("prompts_per_step"))
        ],
        "minibatch_size": [
            plan_shows(kind, {"algorithm.minibatch_size": 8}, derived("optimizer_steps_per_step"))
        ],
        "update_epochs": [
            plan_shows(kind, {"algorithm.update_epochs": 2}, derived("optimizer_steps_per_step"))
        ],
        "clip_ratio_low": [run_shows(kind, {"algorithm.clip_ratio_low": 0.001})],
        "clip_ratio_high": [run_shows(kind, {"algorithm.clip_ratio_high": 0.001})],
        "kl_coef": [run_shows(kind, {"algorithm.kl_coef": 0.5})],
        # Without a KL term there is no estimator to choose.
        "kl_estimator": [refused(kind, {"algorithm.kl_estimator": "k1"})],
        # The token mean and the sequence mean differ once completions differ in length.
        "loss_aggregation": [
            run_shows(kind, {"algorithm.loss_aggregation": "sequence_mean"}, base=STOPS)
        ],
        # Staleness needs actors and learners apart; colocated (the base) it is refused, and
        # what happens to stale samples is refused while nothing can be stale.
        "max_staleness": [refused(kind, {"algorithm.max_staleness": 1})],
        "stale_samples": [refused(kind, {"algorithm.stale_samples": "drop"})],
        "tis_bound": [refused(kind, {"algorithm.tis_bound": 4.0})],
    }
    if kind in ("grpo", "rloo"):
        cases["kl_estimator"].append(
            run_shows(kind, {"algorithm.kl_estimator": "k1"}, base={"algorithm.kl_coef": 0.5})
        )
    else:  # the KL in the token rewards is the log-ratio, whatever the estimator
        cases["kl_estimator"].append(
            refused(kind, {"algorithm.kl_estimator": "k1"}, base={"algorithm.kl_coef": 0.5})
        )
    return {at + name: found for name, found in cases.items()}


def _offline_cases(kind: str) -> dict[str, list[Case]]:
    at = f"algorithm[{kind}]."
    cases = {
        "batch_size": plan_shows(kind, {"algorithm.batch_size": 8}, derived("minibatch_size")),
        "epochs": plan_shows(kind, {"algorithm.epochs": 2}, derived("total_steps")),
        "max_steps": plan_shows(kind, {"algorithm.max_steps": 1}, derived("total_steps")),
        "max_length": plan_shows(
            kind, {"algorithm.max_length": 128}, derived("max_sequence_length")
        ),
    }
    if kind in ("dpo", "ipo", "kto"):
        cases["beta"] = run_shows(kind, {"algorithm.beta": 0.5})
        # Reference log-probs computed live leave no cache file in the run directory.
        cases["reference"] = run_shows(
            kind, {"algorithm.reference": "live"}, files("reference-logprobs*")
        )
    return {at + name: [case] for name, case in cases.items()}


KIND_CASES: dict[str, list[Case]] = {
    "algorithm[grpo].scale_rewards": [run_shows("grpo", {"algorithm.scale_rewards": "batch"})],
    "algorithm[ppo].gamma": [run_shows("ppo", {"algorithm.gamma": 0.5})],
    "algorithm[ppo].lam": [run_shows("ppo", {"algorithm.lam": 0.5})],
    "algorithm[ppo].critic": [plan_shows("ppo", {"algorithm.critic": "value_head"}, roles)],
    "algorithm[ppo].critic_lr": [
        run_shows("ppo", {"algorithm.critic_lr": 1e-3}),
        run_shows("ppo", {"algorithm.critic_lr": 1e-3}, base={"algorithm.critic": "value_head"}),
    ],
    "algorithm[ppo].vf_coef": [
        run_shows("ppo", {"algorithm.vf_coef": 2.0}, base={"algorithm.critic": "value_head"}),
        # A separate critic has an optimizer of its own: the weight would only rescale its
        # gradients, which AdamW normalizes away.
        refused("ppo", {"algorithm.vf_coef": 2.0}),
    ],
    "algorithm[ppo].value_clip": [run_shows("ppo", {"algorithm.value_clip": 1e-6})],
    "algorithm[ppo].whiten_advantages": [run_shows("ppo", {"algorithm.whiten_advantages": False})],
    "algorithm[ppo].kl_penalty": [
        run_shows("ppo", {"algorithm.kl_penalty": "loss"}, base={"algorithm.kl_coef": 0.5}),
        refused("ppo", {"algorithm.kl_penalty": "loss"}),  # kl_coef = 0: no KL anywhere
    ],
    "algorithm[reinforce_pp].gamma": [run_shows("reinforce_pp", {"algorithm.gamma": 0.5})],
    "algorithm[reinforce_pp].baseline": [
        run_shows("reinforce_pp", {"algorithm.baseline": "group"})
    ],
    "algorithm[dpo].label_smoothing": [run_shows("dpo", {"algorithm.label_smoothing": 0.1})],
    "algorithm[kto].desirable_weight": [run_shows("kto", {"algorithm.desirable_weight": 2.0})],
    "algorithm[kto].undesirable_weight": [run_shows("kto", {"algorithm.undesirable_weight": 2.0})],
    "algorithm[sft].completion_only_loss": [
        run_shows("sft", {"algorithm.completion_only_loss": False})
    ],
    "algorithm[sft].packing": [run_shows("sft", {"algorithm.packing": True})],
    "algorithm[rm].center_rewards_coef": [run_shows("rm", {"algorithm.center_rewards_coef": 0.5})],
}

SECTION_CASES: dict[str, list[Case]] = {
    "run.name": [plan_shows("grpo", {"run.name": "renamed"}, lambda p: p.run_id.split("-")[0])],
    "run.seed": [plan_shows("grpo", {"run.seed": 2}, lambda p: p.seeds)],
    "run.output_dir": [
        plan_shows("grpo", {"run.output_dir": f"{WORKDIR}/elsewhere"}, derived("store"))
    ],
    "run.eval_interval": [
        run_shows("grpo", {"run.eval_interval": 1}, steps_of("eval/")),
        run_shows("dpo", {"run.eval_interval": 1}, steps_of("eval/")),
    ],
    "run.eval_samples": [
        run_shows("grpo", {"run.eval_samples": 3}, metric("eval/reward")),
        refused("grpo", {"run.eval_samples": 3, "generation.temperature": 0}),
        refused("dpo", {"run.eval_samples": 3}),
    ],
    "eval.suites[].name": [
        run_shows("grpo", {"eval.suites[0].name": "other"}, names_of("eval/"), base=SUITE)
    ],
    "eval.suites[].scorer": [
        run_shows(
            "grpo", {"eval.suites[0].scorer": "gsm8k"}, metric("eval/sums/score"), base=SUITE
        ),
        refused("grpo", {"eval.suites[0].scorer": "./audit_rewards.py:absent"}, base=SUITE),
    ],
    "eval.suites[].data": [
        run_shows("grpo", {"eval.suites[0].data": "suite-b.jsonl"}, names_of("eval/"), base=SUITE),
        refused(
            "grpo",
            {"eval.suites[0].data": "online-train.jsonl", "eval.suites[0].scorer": "mmlu"},
            base=SUITE,
        ),
    ],
    "eval.suites[].samples": [
        run_shows(
            "grpo",
            {"eval.suites[0].samples": 2, "eval.suites[0].temperature": 1.0},
            names_of("eval/sums/"),
            base=SUITE,
        )
    ],
    "eval.suites[].k": [
        run_shows("grpo", {"eval.suites[0].k": [2]}, names_of("eval/sums/"), base=SAMPLED_SUITE)
    ],
    "eval.suites[].max_new_tokens": [
        run_shows(
            "grpo", {"eval.suites[0].max_new_tokens": 1}, metric("eval/sums/score"), base=SUITE
        )
    ],
    "eval.suites[].temperature": [
        run_shows(
            "grpo", {"eval.suites[0].temperature": 1.5}, metric("eval/sums/score"), base=SUITE
        )
    ],
    "eval.suites[].top_p": [
        run_shows(
            "grpo", {"eval.suites[0].top_p": 0.05}, metric("eval/sums/score"), base=SAMPLED_SUITE
        )
    ],
    "eval.suites[].limit": [
        run_shows("grpo", {"eval.suites[0].limit": 1}, names_of("eval/sums/"), base=SUITE)
    ],
    "model.path": [
        plan_shows(
            "grpo",
            {"model.path": "models/llama", "model.builtin": DELETE},
            lambda p: (p.model.source, p.model.location),
        )
    ],
    "model.package": [
        plan_shows(
            "grpo",
            {"model.package": "audit_model_pkg", "model.builtin": DELETE},
            lambda p: (p.model.source, p.model.location),
        )
    ],
    "model.builtin": [
        plan_shows("grpo", {"model.builtin": "tiny-qwen2"}, lambda p: p.model.model_type)
    ],
    "model.hub": [
        plan_shows(
            "grpo",
            {"model.hub": HUB_ID, "model.builtin": DELETE},
            lambda p: (p.model.source, p.model.location),
        )
    ],
    # The test's Hugging Face cache holds two commits: refs/main -> COMMITS[0], refs/v2 -> [1].
    "model.revision": [
        plan_shows(
            "grpo",
            {"model.revision": "v2"},
            lambda p: p.model.commit,
            base={"model.hub": HUB_ID, "model.builtin": DELETE},
        )
    ],
    # models/mixed holds a Hugging Face model and a GGUF file: unless told which, plan refuses.
    "model.file": [
        plan_shows(
            "grpo",
            {"model.file": "config.json"},
            lambda p: p.model.format,
            base={"model.path": "models/mixed", "model.builtin": DELETE},
        )
    ],
    "model.format": [
        plan_shows(
            "grpo",
            {"model.format": "hf"},
            lambda p: p.model.format,
            base={"model.path": "models/mixed", "model.builtin": DELETE},
        )
    ],
    "model.dtype": [plan_shows("grpo", {"model.dtype": "bfloat16"}, derived("dtype"))],
    "model.tokenizer": [run_shows("grpo", {"model.tokenizer": "tokenizer"})],
    "model.chat_template": [run_shows("grpo", {"model.chat_template": TEMPLATE})],
    "model.gradient_checkpointing": [
        plan_shows("grpo", {"model.gradient_checkpointing": True}, memory)
    ],
    # The tiny model ships no code of its own: there is nothing to trust.
    "model.trust_remote_code": [refused("grpo", {"model.trust_remote_code": True})],
    "model.precision": [plan_shows("grpo", {"model.precision": "autocast"}, derived("precision"))],
    "model.lora.rank": [plan_shows("grpo", {"model.lora.rank": 4}, *LORA)],
    "model.lora.target_modules": [
        plan_shows("grpo", {"model.lora.target_modules": ["q_proj"]}, *LORA)
    ],
    # B starts at 0, so the scale and the dropout show in the adapters a run trains.
    "model.lora.alpha": [run_shows("grpo", {"model.lora.alpha": 64.0}, base=LORA_ON)],
    "model.lora.dropout": [run_shows("grpo", {"model.lora.dropout": 0.5}, base=LORA_ON)],
    "model.lora.export": [
        run_shows("grpo", {"model.lora.export": "merged"}, files("checkpoints/*/model/*"), LORA_ON)
    ],
    "data.train.path": [
        plan_shows(
            "grpo", {"data.train.path": "online-eval.jsonl"}, data_facts("train", "fingerprint")
        )
    ],
    "data.train.format": [refused("grpo", {"data.train.format": "parquet"})],
    "data.train.limit": [
        plan_shows("grpo", {"data.train.limit": 4}, data_facts("train", "num_records")),
        run_shows("grpo", {"data.train.limit": 2}),
    ],
    "data.eval.path": [
        plan_shows(
            "grpo", {"data.eval.path": "online-train.jsonl"}, data_facts("eval", "fingerprint")
        )
    ],
    "data.eval.format": [refused("grpo", {"data.eval.format": "parquet"})],
    "data.eval.limit": [
        plan_shows("grpo", {"data.eval.limit": 1}, data_facts("eval", "num_records")),
        run_shows("dpo", {"data.eval.limit": 1}, metric("eval/margin")),
    ],
    "data.fields.prompt": [run_shows("grpo", {"data.fields.prompt": "question"})],
    "data.fields.answer": [
        # The mapped field reaches the rewards as `answer`, even where records have an `answer`.
        run_shows(
            "grpo",
            {"data.fields.answer": "solution"},
            metric("reward/answer_chars"),
            base=ANSWER_REWARD,
        ),
        refused("dpo", {"data.fields.answer": "other"}),  # no offline objective reads answers
    ],
    "data.fields.completion": [
        run_shows("sft", {"data.fields.completion": "other"}),
        refused("dpo", {"data.fields.completion": "completion"}),
    ],
    "data.fields.messages": [
        run_shows("sft", {"data.fields.messages": "messages", "data.fields.completion": DELETE}),
        refused("kto", {"data.fields.messages": "messages"}),
    ],
    "data.fields.chosen": [
        run_shows("dpo", {"data.fields.chosen": "other"}),
        refused("sft", {"data.fields.chosen": "chosen"}),
    ],
    "data.fields.rejected": [
        run_shows("rm", {"data.fields.rejected": "other"}),
        refused("kto", {"data.fields.rejected": "rejected"}),
    ],
    "data.fields.label": [
        run_shows("kto", {"data.fields.label": "flipped"}),
        refused("sft", {"data.fields.label": "label"}),
    ],
    "data.shuffle": [
        run_shows("grpo", {"data.shuffle": False}),
        run_shows("sft", {"data.shuffle": False}),
    ],
    "data.use_chat_template": [
        run_shows("grpo", {"data.use_chat_template": False}),
        run_shows("ipo", {"data.use_chat_template": False}),
    ],
    "data.system_prompt": [
        run_shows("grpo", {"data.system_prompt": "Be brief."}),
        run_shows("dpo", {"data.system_prompt": "Be brief."}),
        refused(
            "grpo", {"data.system_prompt": "Be brief."}, base={"data.use_chat_template": False}
        ),
        # SFT conversations are trained on as written.
        refused(
            "sft",
            {"data.system_prompt": "Be brief."},
            base={"data.fields.messages": "messages", "data.fields.completion": DELETE},
        ),
    ],
    # No vLLM here (and no GPU): refused. Where it runs, its memory plan differs from hf's.
    "generation.engine": [plan_shows("grpo", {"generation.engine": "vllm"}, memory)],
    "generation.max_new_tokens": [
        plan_shows("grpo", {"generation.max_new_tokens": 8}, derived("max_sequence_length"))
    ],
    "generation.max_prompt_tokens": [
        plan_shows("grpo", {"generation.max_prompt_tokens": 64}, derived("max_sequence_length"))
    ],
    "generation.temperature": [run_shows("grpo", {"generation.temperature": 0.5})],
    "generation.top_p": [run_shows("grpo", {"generation.top_p": 0.5})],
    "generation.top_k": [run_shows("grpo", {"generation.top_k": 5})],
    "generation.stop": [
        run_shows("grpo", {"generation.stop": ["e"]}, metric("completion/tokens_mean"))
    ],
    "generation.max_batch_size": [plan_shows("grpo", {"generation.max_batch_size": 1}, memory)],
    "generation.gpu_memory_utilization": [
        refused("grpo", {"generation.gpu_memory_utilization": 0.9})  # the hf engine ignores it
    ],
    # No GPU here: refused. Where there is one, the hf engine captures its decode step
    # (tests/gpu/test_static_decode_cuda.py).
    "generation.cuda_graphs": [refused("grpo", {"generation.cuda_graphs": True})],
    "rewards[].fn": [
        run_shows(
            "grpo",
            {"rewards[0].fn": "regex_match", "rewards[0].options": {"pattern": "e"}},
            names_of("reward/"),
        )
    ],
    "rewards[].model": [
        run_shows(
            "grpo",
            {
                "rewards[0].model": _reward_model_run,
                "rewards[0].fn": DELETE,
                "rewards[0].options": DELETE,
            },
            names_of("reward/"),
        )
    ],
    "rewards[].weight": [run_shows("grpo", {"rewards[0].weight": 2.0}, metric("reward/mean"))],
    "rewards[].name": [run_shows("grpo", {"rewards[0].name": "brevity"}, names_of("reward/"))],
    "rewards[].options": [
        run_shows(
            "grpo", {"rewards[0].options": {"target_chars": 3}}, metric("reward/length_penalty")
        ),
        refused("grpo", {"rewards[0].options": {"scale": 2}}, base=REWARD_MODEL),
    ],
    "environment.name": [
        run_shows(
            "grpo",
            {
                "environment.name": "guess_number",
                "environment.max_turns": 2,
                "rewards": DELETE,
                "data.eval": DELETE,
            },
            names_of("episode/"),
        )
    ],
    "environment.options": [
        refused("grpo", {"environment.options": {"high": 3}}, base=CHARS),  # Chars takes none
    ],
    "environment.max_turns": [
        run_shows("grpo", {"environment.max_turns": 3}, metric("episode/turns_mean"), base=CHARS)
    ],
    "environment.max_observation_tokens": [
        run_shows(
            "grpo",
            {"environment.max_observation_tokens": 16},
            metric("episode/tokens_mean"),
            base=CHARS,
        )
    ],
    "environment.advantage": [
        run_shows("grpo", {"environment.advantage": "turn"}, base=CHARS),
        # PPO: each turn's reward on its own answer instead of the return on the last token
        run_shows("ppo", {"environment.advantage": "turn"}, base=CHARS),
    ],
    "environment.timeout_s": [
        run_shows("grpo", {"environment.timeout_s": 0.01}, timed_out, base=CHARS, fails=True)
    ],
    "environment.on_error": [
        run_shows(
            "grpo",
            {"environment.on_error": "stop"},
            lambda run: "lost its board" in (run.error or ""),
            base=BROKEN_CONTAINED,
            fails=True,
        )
    ],
    "environment.failure_reward": [
        run_shows(
            "grpo",
            {"environment.failure_reward": -1.0},
            metric("reward/mean"),
            base=BROKEN_CONTAINED,
        )
    ],
    "environment.tools[].name": [
        run_shows("grpo", {"environment.tools[0].name": "list_files"}, base=TOOLS)
    ],
    "environment.tools[].options": [
        refused("grpo", {"environment.tools[0].options": {"max_digits": 0}}, base=TOOLS)
    ],
    "environment.tools[].function": [
        plan_shows(
            "grpo",
            {
                "environment.tools[0].function": {
                    "name": "population",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                }
            },
            lambda plan: [tool.name for tool in plan.tools],
            base=LOOKUP_TOOL,
        )
    ],
    "environment.tool_format": [run_shows("grpo", {"environment.tool_format": "json"}, base=TOOLS)],
    # Killed at its deadline in a sidecar ("(killed)"), where in-process the step only stops
    # waiting ("did not return within"); the rest is tests/unit/test_sidecar_environment.py's.
    "environment.isolation": [
        run_shows(
            "grpo",
            {"environment.isolation": "sidecar", "environment.timeout_s": 0.01},
            lambda run: "(killed)" in (run.error or ""),
            base=CHARS,
            fails=True,
        ),
        refused("grpo", {"environment.isolation": "sidecar"}, base=TOOLS),
    ],
    "environment.python": [
        refused("grpo", {"environment.python": sys.executable}, base=CHARS),
        plan_shows(
            "grpo",
            {"environment.python": sys.executable, "environment.isolation": "sidecar"},
            lambda plan: plan.environment_python,
            base=CHARS,
        ),
    ],
    "environment.allow_unsandboxed": [
        plan_shows(
            "grpo",
            {"environment.allow_unsandboxed": True},
            lambda plan: plan.tool_sandbox,
            base=PYTHON_TOOL,
        ),
        refused("grpo", {"environment.allow_unsandboxed": True}, base=TOOLS),
    ],
    # This host's sandbox works, so the opt-out changes the record only; the refusal without
    # it on a host that lacks a capability is tests/unit/test_reward_sandbox.py's.
    "rewards[].allow_unsandboxed": [
        plan_shows(
            "grpo",
            {"rewards[0].allow_unsandboxed": True},
            lambda plan: plan.rewards[0].sandbox,
            base=CODE_REWARD,
        ),
        refused("grpo", {"rewards[0].allow_unsandboxed": True}),
    ],
    # The sidecar's behaviour (killed at its deadline, restarted, resubmitted) is
    # tests/unit/test_sidecar_host.py's; tests/integration/test_run_sidecar.py runs one.
    "rewards[].isolation": [
        plan_shows(
            "grpo", {"rewards[0].isolation": "sidecar"}, lambda plan: plan.rewards[0].isolation
        ),
        refused("grpo", {"rewards[0].isolation": "sidecar"}, base=REWARD_MODEL),
    ],
    "rewards[].python": [
        refused("grpo", {"rewards[0].python": sys.executable}),
        refused("grpo", {"rewards[0].python": "./no-python", "rewards[0].isolation": "sidecar"}),
        plan_shows(
            "grpo",
            {"rewards[0].python": sys.executable, "rewards[0].isolation": "sidecar"},
            lambda plan: plan.rewards[0].python,
        ),
    ],
    # Which samples fail and what they score is tests/unit/test_sidecar_isolation.py's.
    "rewards[].on_error": [
        refused("grpo", {"rewards[0].on_error": "fail_sample"}),
        plan_shows(
            "grpo",
            {"rewards[0].on_error": "fail_sample", "rewards[0].isolation": "sidecar"},
            lambda plan: plan.rewards[0].on_error,
        ),
    ],
    "rewards[].failure_score": [
        refused("grpo", {"rewards[0].failure_score": -1.0}),
        plan_shows(
            "grpo",
            {
                "rewards[0].failure_score": -1.0,
                "rewards[0].on_error": "fail_sample",
                "rewards[0].isolation": "sidecar",
            },
            lambda plan: plan.rewards[0].failure_score,
        ),
    ],
    "rewards[].timeout_s": [
        run_shows("grpo", {"rewards[1].timeout_s": 0.02}, timed_out, base=SLOW_REWARD, fails=True),
        run_shows("grpo", {"rewards[0].timeout_s": 1e-6}, timed_out, base=REWARD_MODEL, fails=True),
    ],
    # Several nodes need an endpoint and a store they all reach: where AUDIT_DSN names a server
    # the graph spans two nodes; elsewhere the plan is refused (the DSN cannot be read).
    "cluster.nnodes": [
        plan_shows(
            "grpo",
            {
                "cluster.nnodes": 2,
                "cluster.rdzv_endpoint": "node0.example:29500",
                "storage.backend": "postgres",
                "storage.postgres_dsn": "env:AUDIT_DSN",
            },
            lambda p: (p.graph.nnodes, p.graph.world_size),
        ),
    ],
    # Where nodes meet is read when there are several; a loopback address other machines can
    # never reach is refused without rdzv_loopback (the runs are tests/integration/test_multi_node)
    "cluster.rdzv_endpoint": [
        refused("grpo", {"cluster.rdzv_endpoint": "127.0.0.1:29500", "cluster.nnodes": 2})
    ],
    "cluster.rdzv_loopback": [refused("grpo", {"cluster.rdzv_loopback": True})],
    "cluster.nproc_per_node": [
        plan_shows("grpo", {"cluster.nproc_per_node": 2}, lambda p: p.graph.world_size)
    ],
    # No GPU here: refused. Where there is one, the graph's device differs.
    "cluster.device": [plan_shows("grpo", {"cluster.device": "cuda"}, lambda p: p.graph.device)],
    "cluster.placement": [
        # The reward placed away from the actor it follows.
        refused(
            "grpo",
            {
                "cluster.placement": {"actor": [0], "reward": [1], "learner": [1]},
                "cluster.nproc_per_node": 2,
            },
        ),
        # Actors and learners apart, evaluating on the actor (tests/integration/
        # test_run_disaggregated.py and test_run_split_episodes.py run them).
        plan_shows(
            "grpo",
            {
                "cluster.placement": {"actor": [0], "learner": [1]},
                "cluster.nproc_per_node": 2,
            },
            lambda plan: [process.roles for process in plan.graph.processes],
        ),
    ],
    "cluster.sharding": [
        refused("grpo", {"cluster.sharding": "fsdp"}, base={"cluster.nproc_per_node": 2}),
        plan_shows("sft", {"cluster.sharding": "fsdp"}, memory, base={"cluster.nproc_per_node": 2}),
    ],
    "cluster.fsdp_mixed_precision.param_dtype": [
        plan_shows(
            "sft", {"cluster.fsdp_mixed_precision.param_dtype": "float32"}, memory, FSDP_MIXED
        )
    ],
    "cluster.fsdp_mixed_precision.reduce_dtype": [
        plan_shows(
            "sft", {"cluster.fsdp_mixed_precision.reduce_dtype": "bfloat16"}, memory, FSDP_MIXED
        )
    ],
    "cluster.queue_chunk_size": [
        # One actor (or colocated roles): no queue, so the chunk size is refused.
        refused("grpo", {"cluster.queue_chunk_size": 1}),
        # Two actors share each step's prompts (tests/integration/test_run_shared_prompts.py
        # runs it); the chunk size is the plan's.
        plan_shows(
            "grpo",
            {"cluster.queue_chunk_size": 2},
            derived("queue_chunk_size"),  # 1 in the base: a quarter of 2 prompts per actor
            base={
                "cluster.placement": {"actor": [0, 1], "learner": [2]},
                "cluster.nproc_per_node": 3,
                "algorithm.rollout_batch_size": 16,
                "data.eval": DELETE,
            },
        ),
    ],
    "cluster.threads_per_process": [
        plan_shows("grpo", {"cluster.threads_per_process": 2}, derived("threads_per_process"))
    ],
    # Refused where every rank is a learner; with actors apart, the host's restart budget
    # (tests/integration/test_run_restarts.py kills an actor and sees it restarted, or not).
    "cluster.max_restarts": [
        refused("grpo", {"cluster.max_restarts": 2}),
        plan_shows(
            "grpo",
            {"cluster.max_restarts": 0},
            derived("max_restarts"),
            base={
                "cluster.placement": {"actor": [0], "learner": [1]},
                "cluster.nproc_per_node": 2,
                "data.eval": DELETE,
            },
        ),
    ],
    # Where AUDIT_DSN names a server, the plan records into it; elsewhere the plan is refused
    # (the DSN cannot be read): either way not the base's SQLite file.
    "storage.backend": [
        plan_shows(
            "grpo",
            {"storage.backend": "postgres", "storage.postgres_dsn": "env:AUDIT_DSN"},
            derived("store"),
        )
    ],
    "storage.sqlite_path": [
        plan_shows("grpo", {"storage.sqlite_path": f"{WORKDIR}/other.db"}, derived("store"))
    ],
    "storage.postgres_dsn": [refused("grpo", {"storage.postgres_dsn": "env:AUDIT_DSN"})],
    "storage.artifacts": [
        plan_shows("grpo", {"storage.artifacts": f"{WORKDIR}/artifacts"}, derived("artifacts"))
    ],
    # Refused here (no usable CRIU: `criu check` fails, and the issue says why). Where CRIU
    # works the plan is the base's: the field acts in `rollout snapshot save` of a live run,
    # tests/unit/test_snapshot.py's CRIU test (skipped here).
    "snapshot.process": [refused("grpo", {"snapshot.process": True})],
    "checkpoint.interval": [
        run_shows("sft", {"checkpoint.interval": 1}, lambda r: r.checkpoints())
    ],
    "checkpoint.keep_last": [
        run_shows(
            "sft",
            {"checkpoint.keep_last": 1},
            lambda r: r.checkpoints(),
            base={"checkpoint.interval": 1},
        )
    ],
    "checkpoint.save_optimizer": [
        run_shows("sft", {"checkpoint.save_optimizer": False}, files("checkpoints/*/optimizer*"))
    ],
    "logging.trackers": [run_shows("sft", {"logging.trackers": ["jsonl"]}, files("metrics.jsonl"))],
    "logging.level": [
        run_shows(
            "sft", {"logging.level": "debug"}, lambda r: sorted({level for level, _ in r.logs})
        )
    ],
    "logging.interval": [run_shows("sft", {"logging.interval": 2}, steps_of("train/"))],
    "logging.samples_per_step": [
        run_shows("grpo", {"logging.samples_per_step": 1}, lambda run: run.samples),
        refused("sft", {"logging.samples_per_step": 1}),
    ],
    "logging.wandb_project": [refused("sft", {"logging.wandb_project": "audit"})],
    "logging.wandb_api_key": [refused("sft", {"logging.wandb_api_key": "env:WANDB_API_KEY"})],
    "logging.mlflow_tracking_uri": [
        refused("sft", {"logging.mlflow_tracking_uri": f"{WORKDIR}/mlruns"})
    ],
    "logging.mlflow_experiment": [refused("sft", {"logging.mlflow_experiment": "audit"})],
    # Read by the metrics server alone: without metrics_port, refused.
    "logging.metrics_host": [refused("sft", {"logging.metrics_host": "0.0.0.0"})],
    "logging.metrics_key": [refused("sft", {"logging.metrics_key": "env:METRICS_KEY"})],
}


def _all_cases() -> dict[str, list[Case]]:
    cases: dict[str, list[Case]] = dict(SECTION_CASES)
    for kind in KINDS:
        cases.update(_optimizer_cases(kind))
        cases.update(_online_cases(kind) if kind in ONLINE_KINDS else _offline_cases(kind))
    for key, found in KIND_CASES.items():
        cases.setdefault(key, []).extend(found)
    return cases


CASES = _all_cases()

UNOBSERVABLE: dict[str, str] = {
    "cluster.rdzv_timeout_s": "read by torchrun agents meeting across nodes, and the audit's "
    "runs are one worker in this process: test_multi_node's rendezvous that never forms ends "
    "within it",
    "cluster.collective_timeout_s": "read where several ranks join a process group, and the "
    "audit's runs are one worker in this process: test_multi_node's stalled rank ends the run "
    "after it",
    "logging.metrics_port": "read by the run's host process, and the audit runs the worker "
    "alone: test_run_metrics_live scrapes a real run's host at the port, and finds it closed "
    "after the run",
    "logging.otlp_endpoint": "exported to a collector, which the audit's runs have none of: "
    "test_traces_otlp runs a plan and a worker against an OTLP collector and reads their spans",
}
"""Field -> why no case can show its effect here, reviewed one by one, each naming the test that
shows it where it can be seen."""


# --- the tests -----------------------------------------------------------------------------------


def test_every_field_has_a_case():
    fields = config_fields()
    missing = sorted(fields - set(CASES) - set(UNOBSERVABLE))
    unknown = sorted((set(CASES) | set(UNOBSERVABLE)) - fields)
    assert not missing, f"fields without a case in CASES (or a reason in UNOBSERVABLE): {missing}"
    assert not unknown, f"cases for fields the config does not have: {unknown}"
    assert not set(CASES) & set(UNOBSERVABLE)


def _concrete(key: str) -> str:
    """ "algorithm[grpo].lr" -> "algorithm.lr"; "rewards[].fn" -> "rewards[0].fn"."""
    if key.startswith("algorithm["):
        return "algorithm." + key.split("].", 1)[1]
    return key.replace("[]", "[0]")


@pytest.fixture(scope="module")
def audit(tmp_path_factory) -> Iterator[Audit]:
    workdir = tmp_path_factory.mktemp("audit")
    _prepare(workdir)
    sys.path.insert(0, str(workdir / "site"))
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("HF_HUB_CACHE", str(workdir / "hf-hub"))
            yield Audit(workdir)
    finally:
        sys.path.remove(str(workdir / "site"))


@pytest.mark.parametrize(
    ("key", "case"),
    [(key, case) for key, found in sorted(CASES.items()) for case in found],
    ids=[f"{key}-{i}" for key, found in sorted(CASES.items()) for i, _ in enumerate(found)],
)
def test_changing_the_field_shows(audit, key, case):
    base = audit.config(case.kind, case.base)
    changed = audit.config(case.kind, case.base, case.change)
    path = _concrete(key)
    evidence = case.evidence
    if isinstance(evidence, Refused):
        planned = audit.plan(base)
        assert isinstance(planned, Plan), f"the base config does not plan: {planned}"
        refusal = audit.plan(changed)
        assert isinstance(refusal, Refusal), f"{path}: the changed config plans"
        assert refusal.names(path), f"{path} is not named in {refusal.issues}"
    elif isinstance(evidence, PlanShows):
        before, after = audit.plan(base), audit.plan(changed)
        assert isinstance(before, Plan) or isinstance(after, Plan), (before, after)
        seen = [p if isinstance(p, Refusal) else evidence.what(p) for p in (before, after)]
        assert seen[0] != seen[1], f"{path}: both plans show {seen[0]}"
    else:
        before, after = audit.run(base), audit.run(changed)
        assert before.error is None, before.error
        assert evidence.fails == (after.error is not None), after.error
        seen = [evidence.what(before), evidence.what(after)]
        assert seen[0] != seen[1], f"{path}: both runs show {seen[0]}"


@pytest.mark.parametrize("kind", KINDS)
def test_runs_repeat_exactly(audit, kind):
    """Evidence by difference needs runs that do not differ on their own: the same config twice
    trains the same weights and records the same losses."""
    first = audit.baseline(kind)
    again = audit.run(audit.config(kind), cached=False)
    assert again.error is None, again.error
    assert first.weights is not None and first.weights == again.weights
    losses = [run.metrics["train/loss"] for run in (first, again)]
    assert losses[0] == losses[1]


def test_a_checkpoint_that_ships_code_may_be_trusted(audit):
    """The other side of model.trust_remote_code's refusal: a Hugging Face directory whose
    config.json maps classes to its own code plans with it."""
    directory = audit.workdir / "models" / "with-code"
    shutil.copytree(builtin_model_dir("tiny-llama"), directory)
    config = json.loads((directory / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_audit.AuditForCausalLM"}
    (directory / "config.json").write_text(json.dumps(config))
    change = {"model.builtin": DELETE, "model.path": "models/with-code"}
    assert isinstance(audit.plan(audit.config("grpo", change)), Plan)
    trusted = audit.plan(audit.config("grpo", change, {"model.trust_remote_code": True}))
    assert isinstance(trusted, Plan), trusted
