"""`rollout plugins test`: one plugin, resolved as a plan resolves it, run on sample input here.

No GPU, no training (and no model but for an engine): the plugin is imported (first in a child process, as planning
does: rollout.plugins.probe), then called the way a run calls it, by the same runners (reward:
harness.reward_runner; environment: harness.environments.runner; tool: its Tool, arguments checked
against its schema; scorer: the eval harness's Scorer), each call under a deadline
(harness.deadline). What it returned and how long each call took come back as a Trial; anything
wrong (the plugin raises, hangs, returns the wrong shape; the sample is malformed) is one
RolloutError naming the plugin and the sample.

Sample files are JSON (a list of objects, or one object) or JSON lines (`.jsonl`), one item per
object:

    reward, scorer   {"prompt": "...", "completion": "...", <any other field>: ...}
                     (the other fields are the dataset fields the plugin is given)
    environment      {"row": {<dataset row>}, "actions": ["the model's 1st answer", "2nd", ...]}
    tool             {<the call's arguments>}
    tracker          {"step": 1, "name": "reward/mean", "value": 0.5}  (one metric row)
    engine           {"prompt": "...", "max_new_tokens": 16, "n": 1, "temperature": 0.0}
                     (all but the prompt optional; shown are the defaults)

An engine plugin is the one kind tried with a model: built on --model (default the builtin tiny
model, on the CPU) as build_engine builds it for `rollout generate`, then asked for each item.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rollout.config.plain import deeper_than
from rollout.errors import Issue, PlanError, RolloutError
from rollout.files import FileRefused, read_capped
from rollout.plugins.probe import probe_imports
from rollout.plugins.registry import KINDS, SCORER_GROUP, PluginKind
from rollout.plugins.resolve import ResolvedPlugin, import_probe, resolve_plugin

SAMPLE_LIMIT = 16 * 2**20
DEFAULT_ENGINE_MODEL = "builtin:tiny-llama"
DEFAULT_TIMEOUT_S = 30.0
"""As [[rewards]] timeout_s: each call's limit unless --timeout-s says otherwise."""


@dataclass(frozen=True)
class Call:
    """One call of the plugin: what it was, how many items it covered, what it returned."""

    label: str
    items: int
    seconds: float
    result: Any


@dataclass(frozen=True)
class Trial:
    kind: str
    ref: str
    identity: dict[str, Any] | None
    """Who the reference resolved to, as plan.lock records it (None for a built-in scorer)."""
    calls: list[Call] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Sample:
    """The sample file's items, and how to name one of them in a message."""

    path: Path
    items: list[dict[str, Any]]
    lines: list[int] | None
    """Each item's line (JSON lines); None for a JSON file (items are then named by index)."""

    def where(self, index: int) -> str:
        if self.lines is not None:
            return f"{self.path}:{self.lines[index]}"
        return f"{self.path}[{index}]"


def try_plugin(
    ref: str,
    kind: str,
    sample_path: Path,
    *,
    base_dir: Path,
    options: Mapping[str, Any] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    seed: int = 0,
    model: str | None = None,
) -> Trial:
    """Resolve ``ref`` as a plugin of ``kind`` (relative files from ``base_dir``) and run it on the
    items of ``sample_path``; ``options`` as the config's options for it. ``model``: what an
    engine plugin generates with (engines only; default DEFAULT_ENGINE_MODEL)."""
    plugin_kind = _kind(kind)
    if model is not None and kind != "engine":
        raise RolloutError(
            Issue(
                "--model", f"only an engine plugin is tried on a model, not a {kind}", value=model
            )
        )
    if plugin_kind.untestable is not None:
        raise RolloutError(
            Issue(
                "--kind",
                f"{kind} plugins cannot be tried on a sample",
                value=kind,
                hint=plugin_kind.untestable,
            )
        )
    job = _Job(
        ref,
        plugin_kind,
        read_sample(sample_path),
        base_dir,
        dict(options or {}),
        timeout_s,
        seed,
        model or DEFAULT_ENGINE_MODEL,
    )
    return _TRIALS[kind](job)


@dataclass(frozen=True)
class _Job:
    ref: str
    kind: PluginKind
    sample: Sample
    base_dir: Path
    options: dict[str, Any]
    timeout_s: float
    seed: int
    model: str = ""


def _kind(kind: str) -> PluginKind:
    if kind not in KINDS:
        raise RolloutError(
            Issue(
                "--kind", f"no plugin kind {kind!r}", value=kind, hint=f"one of: {', '.join(KINDS)}"
            )
        )
    return KINDS[kind]


# ---------------------------------------------------------------------------------------------
# the sample file


def read_sample(path: Path) -> Sample:
    try:
        text = read_capped(path, limit=SAMPLE_LIMIT, what="a sample file").decode("utf-8")
    except FileNotFoundError:
        raise _sample_error(path, "not found") from None
    except FileRefused as refused:
        raise _sample_error(path, str(refused)) from None
    except UnicodeDecodeError as error:
        raise _sample_error(path, f"is not UTF-8 text: {error.reason}") from None
    except OSError as error:
        raise _sample_error(path, f"cannot be read: {error.strerror or error}") from None
    if path.suffix == ".jsonl":
        items, lines = [], []
        for number, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                items.append(_parse(line, f"{path}:{number}"))
                lines.append(number)
        sample = Sample(path, items, lines)
    else:
        found = _parse(text, str(path))
        sample = Sample(path, found if isinstance(found, list) else [found], None)
    if not sample.items:
        raise _sample_error(path, "has no items", hint="write at least one JSON object")
    for index, item in enumerate(sample.items):
        if not isinstance(item, dict):
            raise _sample_error(sample.where(index), f"is {type(item).__name__}, not a JSON object")
    return sample


def _parse(text: str, where: str) -> Any:
    # The data reader's limit (its module costs a command's start-up: imported here).
    from rollout.planner.inspect_data import MAX_RECORD_DEPTH

    try:
        value = json.loads(text)
        # Counting brackets (in C) first keeps the walk off every ordinary item.
        if text.count("[") + text.count("{") > MAX_RECORD_DEPTH and deeper_than(
            value, MAX_RECORD_DEPTH
        ):
            raise RecursionError
    except json.JSONDecodeError as error:
        raise _sample_error(
            where,
            f"is not valid JSON: {error.msg} at line {error.lineno}, column {error.colno}",
            hint="a .json file holds a list of objects (or one); a .jsonl file one object a line",
        ) from None
    except RecursionError:
        raise _sample_error(
            where, f"nests arrays or objects more than {MAX_RECORD_DEPTH} levels deep"
        ) from None
    except ValueError:  # CPython's limit on integer digits (about 4300)
        raise _sample_error(where, "holds a number too long") from None
    return value


def _sample_error(where: Path | str, message: str, hint: str | None = None) -> RolloutError:
    return RolloutError(Issue(str(where), message, hint=hint))


def _texts(sample: Sample, keys: tuple[str, ...], format_hint: str) -> None:
    for index, item in enumerate(sample.items):
        for key in keys:
            if not isinstance(item.get(key), str):
                problem = "missing" if key not in item else f"{type(item[key]).__name__}, not text"
                raise _sample_error(sample.where(index), f"{key!r} is {problem}", format_hint)


# ---------------------------------------------------------------------------------------------
# resolving, as the plan does


def _resolve(ref: str, plugin_kind: PluginKind, base_dir: Path) -> ResolvedPlugin:
    where: dict[str, Any] = {
        "base_dir": base_dir,
        "used_by": _used_by(plugin_kind),
        "group": plugin_kind.group,
        "builtins": plugin_kind.load_builtins(),
    }
    _probe(import_probe(ref, **where))
    return resolve_plugin(ref, **where)


def _probe(probe: Any) -> None:
    failed = probe_imports([probe] if probe is not None else [])
    if failed:
        raise PlanError(list(failed.values()))


def _used_by(plugin_kind: PluginKind) -> str:
    return f"{plugin_kind.name} plugin"


def _timed(fn: Callable[[], Any], timeout_s: float, name: str) -> tuple[Any, float]:
    from rollout.harness.deadline import call_with_deadline

    start = time.perf_counter()
    result = call_with_deadline(fn, timeout_s, name=name)
    return result, time.perf_counter() - start


# ---------------------------------------------------------------------------------------------
# reward: one batch call, as the reward runner makes it

_REWARD_FORMAT = 'each item is {"prompt": "...", "completion": "...", <dataset fields>...}'


def _reward(job: _Job) -> Trial:
    from rollout.harness.reward_contract import (
        SANDBOX_KEYWORD,
        RewardError,
        check_reward_signature,
        describe,
        runs_model_code,
    )
    from rollout.harness.reward_runner import RewardRunner

    ref, sample, options, timeout_s = job.ref, job.sample, job.options, job.timeout_s
    plugin_kind = job.kind
    _texts(sample, ("prompt", "completion"), _REWARD_FORMAT)
    records = [{k: v for k, v in item.items() if k != "completion"} for item in sample.items]
    fields = set(records[0])
    for index, record in enumerate(records):
        if set(record) != fields:
            raise _sample_error(
                sample.where(index),
                f"has the fields {sorted(record)}, the first item {sorted(fields)}",
                hint="every item needs the same fields, as every row of a dataset has",
            )
    resolved = _resolve(ref, plugin_kind, job.base_dir)
    # A reward that runs model-written code is told to require the sandbox, as the plan would
    # (a host without one makes it refuse, which is reported below).
    passed = {**options, SANDBOX_KEYWORD: True} if runs_model_code(resolved.fn) else options
    issues = check_reward_signature(
        resolved.fn, options=passed, fields=fields, used_by=_used_by(plugin_kind), ref=ref
    )
    if issues:
        raise PlanError(issues)
    runner = RewardRunner([describe(ref, resolved.fn, 1.0, passed, timeout_s)])
    prompts = [item["prompt"] for item in sample.items]
    completions = [item["completion"] for item in sample.items]
    start = time.perf_counter()
    try:
        scores = runner.score(prompts, completions, records)
    except RewardError as error:
        where = sample.where(error.sample) if error.sample is not None else str(sample.path)
        raise RolloutError(Issue(where, str(error))) from None
    seconds = time.perf_counter() - start
    call = Call(f"score {len(completions)} completions", len(completions), seconds, scores.total)
    return Trial("reward", ref, _identity(resolved), [call])


# ---------------------------------------------------------------------------------------------
# environment: reset on the rows, then step with each episode's actions in turn

_ENVIRONMENT_FORMAT = 'each item is {"row": {...}, "actions": ["answer 1", "answer 2", ...]}'


def _environment(job: _Job) -> Trial:
    from rollout.harness.agents import AGENT
    from rollout.harness.deadline import Overran, Raised
    from rollout.harness.environments import SINGLE_TURN
    from rollout.harness.environments.runner import EnvironmentFault, EnvironmentRunner
    from rollout.harness.environments.tools import TOOLS
    from rollout.harness.memory import takes_memory

    ref, sample, options, timeout_s = job.ref, job.sample, job.options, job.timeout_s
    plugin_kind = job.kind
    if ref in (SINGLE_TURN, TOOLS, AGENT):
        raise RolloutError(
            Issue(
                _used_by(plugin_kind),
                f"the run builds the {ref!r} environment from the rest of its config, not "
                "from options",
                value=ref,
                hint="try what it is built from: the rewards (--kind reward), the tools "
                "(--kind tool), or the agent program itself",
            )
        )
    for index, item in enumerate(sample.items):
        actions = item.get("actions")
        if not isinstance(item.get("row"), dict) or not (
            isinstance(actions, list) and all(isinstance(a, str) for a in actions)
        ):
            raise _sample_error(
                sample.where(index),
                "needs a 'row' object and a list of 'actions' (text)",
                _ENVIRONMENT_FORMAT,
            )
    resolved = _resolve(ref, plugin_kind, job.base_dir)
    if takes_memory(resolved.fn):
        raise RolloutError(
            Issue(
                _used_by(plugin_kind),
                "it takes the run's episodic memory, which only a run has",
                value=ref,
                hint="try it in a short run (examples/guess-number.toml)",
            )
        )
    try:
        environment, _ = _timed(lambda: resolved.fn(**options), timeout_s, f"build-{ref}")
    except Overran:
        raise RolloutError(
            Issue(
                _used_by(plugin_kind),
                f"building {ref!r} did not return within {timeout_s:g} s",
                value=options,
            )
        ) from None
    except Raised as raised:
        raise _failed(ref, "building it with its options", raised.error, options) from None
    protocol = plugin_kind.load_protocol()
    if not isinstance(environment, protocol):  # Environment is runtime_checkable
        raise RolloutError(
            Issue(
                _used_by(plugin_kind),
                f"calling it with its options returned {type(environment).__name__}, which has "
                f"no reset and step methods (the {protocol.__module__}.{protocol.__name__} "
                "Protocol)",
                value=ref,
                hint="reference a class (or factory) whose instances have reset(rows, *, seed) "
                "and step(episodes, actions)",
            )
        )
    runner = EnvironmentRunner(environment, name=ref, timeout_s=timeout_s, on_error="stop")
    rows = [item["row"] for item in sample.items]
    scripts = [list(item["actions"]) for item in sample.items]
    calls: list[Call] = []
    try:
        start = time.perf_counter()
        first = runner.reset(rows, seed=job.seed)
        calls.append(Call(f"reset {len(rows)} rows", len(rows), time.perf_counter() - start, first))
        done = [False] * len(rows)
        for turn in range(max(len(script) for script in scripts)):
            episodes = [i for i in range(len(rows)) if not done[i] and turn < len(scripts[i])]
            if not episodes:
                break
            start = time.perf_counter()
            results = runner.step(episodes, [scripts[i][turn] for i in episodes])
            seconds = time.perf_counter() - start
            shown = {}
            for episode, result in zip(episodes, results, strict=True):
                done[episode] = result.done
                shown[episode] = asdict(result)
            calls.append(
                Call(f"step {turn + 1} ({len(episodes)} episodes)", len(episodes), seconds, shown)
            )
    except EnvironmentFault as fault:
        where = sample.where(fault.episode) if fault.episode is not None else str(sample.path)
        raise RolloutError(Issue(where, str(fault))) from None
    finally:
        _close(runner)
    return Trial("environment", ref, _identity(resolved), calls)


def _close(runner: Any) -> None:
    # A failing close must not hide what the trial found.
    with contextlib.suppress(Exception):
        runner.close()


# ---------------------------------------------------------------------------------------------
# tool: one call per item, its arguments checked against the tool's schema first


def _tool(job: _Job) -> Trial:
    import jsonschema

    from rollout.harness.deadline import Overran, Raised, call_with_deadline
    from rollout.harness.sandbox import Refused
    from rollout.harness.tools import ToolContext, ToolError, plugin_tool

    ref, sample, options, timeout_s = job.ref, job.sample, job.options, job.timeout_s
    plugin_kind = job.kind

    resolved = _resolve(ref, plugin_kind, job.base_dir)
    builtin = resolved.identity.kind == "builtin"
    if not builtin and options:
        raise RolloutError(
            Issue(
                "--options",
                "a function tool takes no options: each call's arguments come from the sample",
                value=options,
            )
        )
    try:
        tool = resolved.fn(**options) if builtin else plugin_tool(resolved.fn, None, ref)
    except (TypeError, ValueError) as error:
        raise RolloutError(
            Issue(
                _used_by(plugin_kind),
                str(error),
                value=ref,
                hint="a function tool declares itself with a `schema` attribute (its OpenAI "
                "function declaration); a built-in takes the options docs/tools.md lists",
            )
        ) from None
    validator = jsonschema.Draft202012Validator(tool.parameters)
    calls: list[Call] = []
    with tempfile.TemporaryDirectory(prefix="rollout-tool-") as workdir:
        context = ToolContext(Path(workdir), require_network_isolation=True)
        for index, arguments in enumerate(sample.items):
            errors = sorted(validator.iter_errors(arguments), key=str)
            if errors:
                raise _sample_error(
                    sample.where(index),
                    f"the arguments do not fit the tool {tool.name!r}: {errors[0].message}",
                    hint=f"its parameters: {json.dumps(dict(tool.parameters))}",
                )
            start = time.perf_counter()
            try:
                answer = call_with_deadline(
                    lambda a=arguments: tool.run(a, context), timeout_s, name=f"tool-{tool.name}"
                )
            except Overran:
                raise RolloutError(
                    Issue(
                        sample.where(index), f"tool {ref!r} did not return within {timeout_s:g} s"
                    )
                ) from None
            except Raised as raised:
                if not isinstance(raised.error, ToolError | Refused):
                    raise _failed(
                        ref, "the call", raised.error, arguments, sample.where(index)
                    ) from None
                # What the model would be told: a refusal is the tool working as meant.
                answer = f"error: {raised.error}"
            seconds = time.perf_counter() - start
            if not isinstance(answer, str):
                raise RolloutError(
                    Issue(
                        sample.where(index),
                        f"tool {ref!r} answered with {type(answer).__name__}, not text",
                    )
                )
            calls.append(Call(f"call {index + 1}", 1, seconds, answer))
    return Trial("tool", ref, _identity(resolved), calls)


# ---------------------------------------------------------------------------------------------
# scorer: one call per item, on its row and completion

_SCORER_FORMAT = 'each item is a data row with its "completion": {"prompt": "...", ...}'


def _scorer(job: _Job) -> Trial:
    from rollout.harness.deadline import Overran, Raised
    from rollout.harness.eval.scorers import SCORERS
    from rollout.planner.eval_suites import resolve_scorer

    ref, sample, options, timeout_s = job.ref, job.sample, job.options, job.timeout_s
    plugin_kind = job.kind
    if options:
        raise RolloutError(Issue("--options", "a scorer takes no options", value=options))
    _texts(sample, ("completion",), _SCORER_FORMAT)
    builtins = {name: scorer.score for name, scorer in SCORERS.items()}
    used_by = _used_by(plugin_kind)
    _probe(
        import_probe(
            ref,
            base_dir=job.base_dir,
            used_by=used_by,
            group=SCORER_GROUP,
            builtins=builtins,
        )
    )
    scorer, identity = resolve_scorer(ref, job.base_dir, used_by)
    if not scorer.generates:
        raise RolloutError(
            Issue(
                used_by,
                f"{ref!r} scores by a model's log-probabilities, not completions",
                value=ref,
                hint="try it with `rollout eval`",
            )
        )
    calls: list[Call] = []
    for index, item in enumerate(sample.items):
        record = {k: v for k, v in item.items() if k != "completion"}
        problems = scorer.problems(record)
        if problems:
            key, problem = problems[0]
            raise _sample_error(sample.where(index), f"{key!r} {problem}", _SCORER_FORMAT)
        try:
            score, seconds = _timed(
                lambda r=record, c=item["completion"]: scorer.score(r, c),
                timeout_s,
                f"scorer-{ref}",
            )
        except Overran:
            raise RolloutError(
                Issue(sample.where(index), f"scorer {ref!r} did not return within {timeout_s:g} s")
            ) from None
        except Raised as raised:
            raise RolloutError(
                Issue(sample.where(index), f"scorer {ref!r} {raised.error}")
            ) from None
        calls.append(Call(f"score {index + 1}", 1, seconds, asdict(score)))
    return Trial("scorer", ref, identity, calls)


# ---------------------------------------------------------------------------------------------
# tracker: built as the recording worker builds it, given the sample's rows in one batch, closed

_TRACKER_FORMAT = 'each item is {"step": 1, "name": "reward/mean", "value": 0.5}'


def _tracker(job: _Job) -> Trial:
    from rollout.harness.deadline import Overran, Raised
    from rollout.runtime.trackers import TRACKER_SHAPE, not_a_tracker
    from rollout.storage.base import MetricRecord

    ref, sample, timeout_s = job.ref, job.sample, job.timeout_s
    if job.options:
        raise RolloutError(Issue("--options", "a tracker takes no options", value=job.options))
    if ref in job.kind.load_builtins():
        raise RolloutError(
            Issue(
                "REF",
                f"{ref!r} is a built-in tracker, built from a run's plan",
                value=ref,
                hint="try it with a short `rollout run` (examples/ has CPU-sized configs)",
            )
        )
    rows = []
    for index, item in enumerate(sample.items):
        step, name, value = item.get("step"), item.get("name"), item.get("value")
        numbers = isinstance(step, int) and isinstance(value, int | float)
        if not numbers or isinstance(step, bool) or isinstance(value, bool) or not name:
            raise _sample_error(
                sample.where(index), "is not a metric row", f"{_TRACKER_FORMAT} ({_TRACKER_HINT})"
            )
        rows.append(MetricRecord("plugins-test", step, str(name), float(value), time.time()))
    resolved = _resolve(ref, job.kind, job.base_dir)

    def timed(label: str, fn: Callable[[], Any]) -> tuple[Any, float]:
        try:
            return _timed(fn, timeout_s, f"tracker-{ref}")
        except Overran:
            raise RolloutError(
                Issue(f"tracker {ref!r}", f"{label} did not return within {timeout_s:g} s")
            ) from None
        except Raised as raised:
            error = raised.error
            message = f"{label} raised {type(error).__name__}: {error}"
            raise RolloutError(Issue(f"tracker {ref!r}", message)) from None

    with tempfile.TemporaryDirectory(prefix="rollout-tracker-") as run_dir:
        made = "factory(run_id, run_dir)"
        tracker, make_s = timed(made, lambda: resolved.fn(run_id="plugins-test", run_dir=run_dir))
        problem = not_a_tracker(tracker)
        if problem:
            raise RolloutError(Issue(f"tracker {ref!r}", problem, hint=TRACKER_SHAPE))
        _, log_s = timed(f"log({len(rows)} rows)", lambda: tracker.log(rows))
        _, close_s = timed("close()", tracker.close)
        root = Path(run_dir)
        written = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    calls = [
        Call("build", 0, make_s, type(tracker).__name__),
        Call(f"log {len(rows)} rows", len(rows), log_s, None),
        Call("close", 0, close_s, {"files written in run_dir": written}),
    ]
    return Trial("tracker", ref, _identity(resolved), calls)


_TRACKER_HINT = "an integer step, a metric name and a number"


# ---------------------------------------------------------------------------------------------
# engine: built on a model as `rollout generate` builds it, asked for each item's completions

_ENGINE_FORMAT = (
    'each item is {"prompt": "...", "max_new_tokens": 16, "n": 1, "temperature": 0.0} '
    "(all but the prompt optional)"
)


def _engine(job: _Job) -> Trial:
    from rollout.engines.build import build_engine
    from rollout.engines.plugin import EnginePlugin
    from rollout.inference.batch import choose_dtype, load_chosen_model
    from rollout.inference.model_choice import choose_model
    from rollout.planner.engine import resolve_engine_ref

    ref, sample = job.ref, job.sample
    if job.options:
        raise RolloutError(Issue("--options", "an engine takes no options", value=job.options))
    if ref in job.kind.load_builtins():
        raise RolloutError(
            Issue(
                "REF",
                f"{ref!r} is a built-in engine",
                value=ref,
                hint=f"try it with `rollout generate --engine {ref}`",
            )
        )
    asks = [_engine_ask(sample, index, item) for index, item in enumerate(sample.items)]
    used_by = _used_by(job.kind)
    _probe(
        import_probe(
            ref,
            base_dir=job.base_dir,
            used_by=used_by,
            group=job.kind.group,
            builtins=job.kind.load_builtins(),
        )
    )
    resolved = resolve_engine_ref(ref, base_dir=job.base_dir, used_by=used_by)
    choice = choose_model(config=None, model=job.model)
    dtype = choose_dtype(choice, "cpu")
    start = time.perf_counter()
    loaded = load_chosen_model(choice, dtype, "cpu")
    load_s = time.perf_counter() - start
    start = time.perf_counter()
    engine = build_engine(
        ref,
        model=loaded.model,
        tokenizer=loaded.tokenizer,
        eos_token_ids=loaded.eos_token_ids,
        pad_token_id=loaded.pad_token_id,
        device="cpu",
        max_batch_size=None,
        seed=job.seed,
        keep_packed=True,
        dtype=dtype,
        plugin=EnginePlugin(ref, used_by, resolved.fn),
    )
    calls = [
        Call(f"load {choice.description}", 0, load_s, dtype),
        Call("build", 0, time.perf_counter() - start, type(engine).__name__),
    ]
    try:
        for index, (text, params) in enumerate(asks):
            prompt_ids = list(loaded.tokenizer.encode(text, add_special_tokens=True))
            start = time.perf_counter()
            completions = engine.generate([prompt_ids], params)
            seconds = time.perf_counter() - start
            _check_completions(completions, params, sample.where(index), ref)
            shown = [
                {"text": c.text, "tokens": len(c.token_ids), "finish_reason": c.finish_reason}
                for c in completions
            ]
            tokens = sum(len(c.token_ids) for c in completions)
            calls.append(Call(f"generate {index + 1}", tokens, seconds, shown))
    finally:
        with contextlib.suppress(Exception):
            engine.close()
    return Trial("engine", ref, _identity(resolved), calls)


def _engine_ask(sample: Sample, index: int, item: dict[str, Any]) -> tuple[str, Any]:
    from rollout.engines.base import SamplingParams

    where = sample.where(index)
    prompt = item.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise _sample_error(where, "needs a non-empty 'prompt' (text)", _ENGINE_FORMAT)
    unknown = sorted(set(item) - {"prompt", "max_new_tokens", "n", "temperature"})
    if unknown:
        raise _sample_error(where, f"has unknown keys {unknown}", _ENGINE_FORMAT)
    try:
        params = SamplingParams(
            max_new_tokens=_count(item, "max_new_tokens", 16, where),
            n=_count(item, "n", 1, where),
            temperature=float(item.get("temperature", 0.0)),
            seed=0,
        )
    except (TypeError, ValueError):
        raise _sample_error(where, "'temperature' is not a number", _ENGINE_FORMAT) from None
    return prompt, params


def _count(item: dict[str, Any], key: str, default: int, where: str) -> int:
    value = item.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise _sample_error(where, f"{key!r} is {value!r}, not a positive integer", _ENGINE_FORMAT)
    return value


def _check_completions(completions: Any, params: Any, where: str, ref: str) -> None:
    """What an engine returns, as the trainer and the server read it: a list of n Completions
    for the one prompt, each with a log-prob per token and a known finish reason."""
    from rollout.engines.base import Completion

    def wrong(problem: str) -> RolloutError:
        return RolloutError(
            Issue(
                f"engine {ref!r}",
                f"generate for {where} returned {problem}",
                hint="generate(prompts, params) returns a list of rollout.engines.base.Completion, "
                "params.n per prompt, grouped by prompt, each with one log-prob per token",
            )
        )

    if not isinstance(completions, list):
        raise wrong(f"a {type(completions).__name__}, not a list")
    if len(completions) != params.n:
        raise wrong(f"{len(completions)} completions, asked for n={params.n}")
    for number, completion in enumerate(completions):
        if not isinstance(completion, Completion):
            raise wrong(f"a {type(completion).__name__} at [{number}], not a Completion")
        if completion.prompt_index != 0:
            raise wrong(f"prompt_index {completion.prompt_index} at [{number}] for prompt 0")
        if len(completion.logprobs) != len(completion.token_ids):
            raise wrong(
                f"{len(completion.token_ids)} tokens but {len(completion.logprobs)} log-probs "
                f"at [{number}]"
            )
        if not all(isinstance(t, int) for t in completion.token_ids):
            raise wrong(f"token_ids that are not all integers at [{number}]")
        if completion.finish_reason not in ("stop", "length", "eos"):
            raise wrong(f"finish_reason {completion.finish_reason!r} at [{number}]")
        if not isinstance(completion.text, str):
            raise wrong(f"text of type {type(completion.text).__name__} at [{number}]")


# ---------------------------------------------------------------------------------------------


def _failed(
    ref: str, what: str, error: BaseException, given: Any, where: str | None = None
) -> RolloutError:
    return RolloutError(
        Issue(
            where or f"{ref}",
            f"{ref!r}: {what} raised {type(error).__name__}: {error}",
            value=given,
        )
    )


def _identity(resolved: ResolvedPlugin) -> dict[str, Any]:
    return resolved.identity.model_dump(mode="json")


_TRIALS = {
    "reward": _reward,
    "environment": _environment,
    "tool": _tool,
    "scorer": _scorer,
    "tracker": _tracker,
    "engine": _engine,
}
