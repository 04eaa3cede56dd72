"""Bad input gets one clear error, never a traceback or a hang.

Each class of malformed input is generated whole by hypothesis and fed to every reader that can
meet it: config files and --set, plan.lock, data files and prompt files. Each must end in a
RolloutError (no other exception type) with an Issue naming the field, or the line where the
parser could not get as far as fields, and quickly. A read that could block (a FIFO) runs under
an alarm, so a regression fails the test instead of hanging the suite; character devices, which
a regression would read without end, are read in a subprocess with a time and memory limit.
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import types
import typing
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin
from unittest import mock

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel
from typer.testing import CliRunner

from rollout.cli.app import app
from rollout.config import apply_overrides, load_config, read_config_file, validate_config
from rollout.config.data import DataSource
from rollout.config.load import MAX_CONFIG_BYTES
from rollout.config.plain import MAX_DEPTH, MAX_VALUES, dotted
from rollout.config.root import RunConfig
from rollout.errors import ConfigError, LockfileError, PlanError, RolloutError
from rollout.files import FileRefused
from rollout.fingerprints import sha256_file
from rollout.inference.plugin_trial import read_sample
from rollout.planner import lockfile
from rollout.planner.inspect_data import MAX_RECORD_DEPTH, inspect_data
from rollout.planner.prompt_files import read_prompts
from tests.conftest import BASE_CONFIG, REPO, TRAIN_RECORDS, write_toml

pytestmark = pytest.mark.skipif(
    not hasattr(signal, "setitimer") or not hasattr(os, "mkfifo"),
    reason="needs POSIX signals and FIFOs",
)

# "Does not hang", with room for a loaded machine: every case here takes well under a second.
HANG_LIMIT_S = 10.0
runner = CliRunner()


def examples(n: int) -> settings:
    return settings(
        max_examples=n,
        deadline=None,  # the point of some tests is time: they assert a bound themselves
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


@contextmanager
def no_hang(seconds: float = HANG_LIMIT_S) -> Iterator[None]:
    """Fail, rather than hang the suite, if the block runs past ``seconds``."""

    def expire(signum: int, frame: Any) -> None:
        raise TimeoutError(f"still running after {seconds} s: it hangs")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    start = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert time.monotonic() - start < seconds


@contextmanager
def workdir() -> Iterator[Path]:
    """A fresh directory with train.jsonl (hypothesis runs many examples per test function)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        (path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in TRAIN_RECORDS))
        yield path


def refused(call: Callable[[], Any], kind: type[RolloutError] = RolloutError) -> RolloutError:
    """The RolloutError ``call`` raises within the hang limit; any other outcome fails."""
    with no_hang(), pytest.raises(kind) as caught:
        call()
    assert caught.value.issues
    return caught.value


def paths_of(error: RolloutError) -> list[str]:
    return [issue.path for issue in error.issues]


# --- where values can go in a config -------------------------------------------------------------

FULL_CONFIG: dict[str, Any] = {
    **copy.deepcopy(BASE_CONFIG),
    "storage": {"backend": "sqlite"},
    "checkpoint": {"interval": 10},
    "logging": {"trackers": ["console"]},
}
FULL_CONFIG["data"]["eval"] = {"path": "train.jsonl"}


def all_paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every table, list and value of a config, by raw path (keys and indices)."""
    found = [prefix] if prefix else []
    if isinstance(value, dict):
        for key, item in value.items():
            found += all_paths(item, (*prefix, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found += all_paths(item, (*prefix, i))
    return found


CONFIG_PATHS = all_paths(FULL_CONFIG)
# A path that does not exist yet, under the one table the schema leaves open.
OPTIONS_PATH = ("rewards", 0, "options", "x")


def set_at(config: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    config = copy.deepcopy(config)
    target: Any = config
    for part, after in itertools.pairwise(path):
        if isinstance(target, dict):
            target = target.setdefault(part, [] if isinstance(after, int) else {})
        else:
            if part == len(target):  # a list of tables, e.g. [[environment.tools]], with none yet
                target.append([] if isinstance(after, int) else {})
            target = target[part]
    if isinstance(target, list) and path[-1] == len(target):
        target.append(value)
    else:
        target[path[-1]] = value
    return config


config_paths = st.sampled_from([*CONFIG_PATHS, OPTIONS_PATH])
TOKEN = "__rollout_test_token__"


def config_text(config: dict[str, Any], fmt: str, path: tuple[Any, ...], text: str) -> str:
    """The config as ``fmt`` text with ``text`` written verbatim as the value at ``path``."""
    marked = set_at(config, path, TOKEN)
    if fmt == "toml":
        import tomli_w

        document = tomli_w.dumps(marked)
    elif fmt == "json":
        document = json.dumps(marked, indent=1)
    else:
        document = yaml.safe_dump(marked)
    quoted = f'"{TOKEN}"' if fmt in ("toml", "json") else TOKEN
    assert document.count(quoted) == 1
    return document.replace(quoted, text)


def line_of(document: str, text: str) -> int:
    return document[: document.index(text)].count("\n") + 1


def write_config(directory: Path, fmt: str, document: str) -> Path:
    path = directory / f"run.{fmt}"
    path.write_text(document, encoding="utf-8")
    return path


# --- 1. special files, for every reader ----------------------------------------------------------


def _plan_reader(path: Path) -> Any:
    return lockfile.read_plan(path, check_fresh=False)


def _data_reader(path: Path) -> Any:
    source = DataSource(path=path.name)
    return inspect_data(source, split="train", base_dir=path.parent, required={"p": "prompt"})


def _prompt_reader(path: Path) -> Any:
    return read_prompts(str(path), "prompt")


# reader: (the file names it takes, how it is called, the error, the issue path it must name)
READERS: dict[str, tuple[list[str], Callable[[Path], Any], type[RolloutError], str | None]] = {
    "config": (["run.toml", "run.yaml", "run.yml", "run.json"], load_config, ConfigError, None),
    "plan.lock": (["plan.lock"], _plan_reader, LockfileError, "plan.lock"),
    "data": (["train.jsonl", "d.parquet", "d.json", "d.ndjson"], _data_reader, PlanError, None),
    "prompts": (["p.jsonl", "p.parquet"], _prompt_reader, RolloutError, "--prompts"),
    "plugin sample": (["s.jsonl", "s.json"], read_sample, RolloutError, None),
}
SPECIAL_KINDS = ["fifo", "directory", "fifo behind a symlink", "directory behind a symlink"]


def make_special(directory: Path, name: str, kind: str) -> Path:
    target = directory / (f".target-{name}" if "symlink" in kind else name)
    if kind.startswith("fifo"):
        os.mkfifo(target)
    else:
        target.mkdir()
    if "symlink" in kind:
        (directory / name).symlink_to(target)
    return directory / name


@examples(40)
@given(reader=st.sampled_from(sorted(READERS)), kind=st.sampled_from(SPECIAL_KINDS), data=st.data())
def test_fifos_and_directories_are_refused_by_every_reader(reader, kind, data):
    names, read, error_type, where = READERS[reader]
    with tempfile.TemporaryDirectory() as tmp:
        path = make_special(Path(tmp), data.draw(st.sampled_from(names)), kind)
        error = refused(lambda: read(path), error_type)
    issue = error.issues[0]
    expected_key = where or ("data.train.path" if reader == "data" else str(path))
    assert issue.path == expected_key or issue.path.endswith(path.name), issue
    words = "named pipe" if kind.startswith("fifo") else "directory"
    assert words in issue.message, issue


@examples(20)
@given(kind=st.sampled_from(SPECIAL_KINDS), name=st.sampled_from(["f.bin", "model.gguf", "x"]))
def test_fingerprints_refuse_special_files_at_once(kind, name):
    with tempfile.TemporaryDirectory() as tmp:
        path = make_special(Path(tmp), name, kind)
        for location in (path, f"file://{path}"):
            with no_hang(), pytest.raises(FileRefused, match=r"named pipe|directory"):
                sha256_file(location)


def test_remote_locations_are_still_read():
    fsspec = pytest.importorskip("fsspec")
    url = "memory://bad-input-test/data.jsonl"
    with fsspec.open(url, "w") as handle:
        handle.write('{"prompt": "hi"}\n')
    assert len(sha256_file(url)) == 64
    assert read_prompts(url, "prompt").records == [{"prompt": "hi"}]


DEVICE_SCRIPT = textwrap.dedent(
    """
    import json, os, resource, sys, tempfile
    from pathlib import Path
    # A regression would read a device without end: let it fail on memory instead of the machine.
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
    from tests.unit.test_bad_input import READERS
    from rollout.errors import RolloutError
    from rollout.files import FileRefused
    from rollout.fingerprints import sha256_file
    devices = [d for d in ("/dev/zero", "/dev/urandom", "/dev/null", "/dev/full", "/dev/tty")
               if os.path.exists(d)]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for device in devices:
            for reader, (names, read, _, _) in READERS.items():
                for name in names:
                    link = Path(tmp, name)
                    link.unlink(missing_ok=True)
                    link.symlink_to(device)
                    try:
                        read(link)
                        outcome = "accepted"
                    except RolloutError as error:
                        outcome = " | ".join(issue.message for issue in error.issues)
                    results.append([device, reader, name, outcome])
            try:
                sha256_file(device)
                outcome = "accepted"
            except FileRefused as error:
                outcome = str(error)
            results.append([device, "sha256_file", device, outcome])
    print(json.dumps(results))
    """
)


def test_character_devices_are_refused_by_every_reader():
    """/dev/zero and its kind, behind every name every reader takes: refused without reading."""
    result = subprocess.run(
        [sys.executable, "-c", DEVICE_SCRIPT],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads(result.stdout.strip().splitlines()[-1])
    assert results
    for device, reader, name, outcome in results:
        assert "character device" in outcome, (device, reader, name, outcome)


# --- 2. nesting past any config ------------------------------------------------------------------


def nested(depth: int, bracket: str, fmt: str) -> str:
    if bracket == "[":
        return "[" * depth + "]" * depth
    key = {"toml": "a = ", "json": '"a": ', "yaml": "a: ", "set": "a = "}[fmt]
    return ("{" + key) * depth + "{}" + "}" * depth


@examples(40)
@given(
    fmt=st.sampled_from(["toml", "json", "yaml"]),
    depth=st.integers(MAX_DEPTH + 1, 20_000) | st.integers(MAX_DEPTH + 1, 2_000),
    bracket=st.sampled_from(["[", "{"]),
    path=config_paths,
)
def test_deep_nesting_in_a_config_file_is_one_issue(fmt, depth, bracket, path):
    if fmt == "yaml":  # PyYAML is pure Python; past the recursion limit depth adds only time
        depth = min(depth, 5_000)
    with workdir() as tmp:
        value = nested(depth, bracket, fmt)
        document = config_text(FULL_CONFIG, fmt, path, value)
        config = write_config(tmp, fmt, document)
        error = refused(lambda: load_config(config), ConfigError)
    # Parsed (then refused at the path), or too deep for the parser (then refused at the line).
    line = f"{config}:{line_of(document, value)}:"
    assert any(p.startswith(dotted(path)) or p.startswith(line) for p in paths_of(error)), (
        paths_of(error),
        dotted(path),
        line,
    )


@examples(25)
@given(depth=st.integers(MAX_DEPTH + 1, 50_000), bracket=st.sampled_from(["[", "{"]))
def test_deep_nesting_in_an_override_is_one_issue(depth, bracket):
    override = f"rewards[0].options.x={nested(depth, bracket, 'set')}"

    def apply() -> Any:
        return validate_config(apply_overrides(FULL_CONFIG, [override]))

    error = refused(apply, ConfigError)
    assert any(
        p.startswith("--set rewards[0].options.x") or p.startswith("rewards[0].options.x")
        for p in paths_of(error)
    ), paths_of(error)


@examples(25)
@given(depth=st.integers(MAX_DEPTH + 1, 500), path=config_paths)
def test_deep_nesting_given_as_data_is_refused_at_its_path(depth, path):
    value: Any = []
    for _ in range(depth):
        value = [value]
    error = refused(lambda: validate_config(set_at(FULL_CONFIG, path, value)), ConfigError)
    assert any(p.startswith(dotted(path)) for p in paths_of(error)), paths_of(error)


# --- 3. values that are not plain data ---------------------------------------------------------

NOT_PLAIN = {
    "date": st.dates(),
    "datetime": st.datetimes(),
    "time": st.times(),
    "binary": st.binary(max_size=20),
    "set": st.sets(st.integers(), max_size=4),
}


@examples(60)
@given(kind=st.sampled_from(sorted(NOT_PLAIN)), path=config_paths, data=st.data())
def test_non_plain_values_are_refused_at_their_path(kind, path, data):
    value = data.draw(NOT_PLAIN[kind])
    error = refused(lambda: validate_config(set_at(FULL_CONFIG, path, value)), ConfigError)
    assert dotted(path) in paths_of(error), (paths_of(error), dotted(path))
    (issue,) = [i for i in error.issues if i.path == dotted(path)]
    assert "a config value is a string, number, boolean, list or table" in issue.message


# What each file format can hold that is not plain data.
FILE_KINDS = {"toml": ["date", "datetime", "time"], "yaml": ["date", "datetime", "binary", "set"]}


@examples(50)
@given(fmt=st.sampled_from(sorted(FILE_KINDS)), path=config_paths, data=st.data())
def test_dates_binary_and_sets_in_files_are_refused_at_their_path(fmt, path, data):
    kind = data.draw(st.sampled_from(FILE_KINDS[fmt]))
    value = data.draw(NOT_PLAIN[kind])
    marked = set_at(FULL_CONFIG, path, value)
    with workdir() as tmp:
        config = tmp / f"run.{fmt}"
        if fmt == "toml":
            write_toml(config, marked)
        else:
            config.write_text(yaml.safe_dump(marked))
        error = refused(lambda: load_config(config), ConfigError)
        # Read without validation (generate reads a config so), the values are refused too.
        alone = refused(lambda: read_config_file(config), ConfigError)
    assert dotted(path) in paths_of(error), (paths_of(error), dotted(path))
    assert dotted(path) in paths_of(alone)


def test_a_date_typed_in_an_override_is_text():
    raw = apply_overrides(FULL_CONFIG, ["run.name=2024-01-01"])
    assert validate_config(raw).run.name == "2024-01-01"


def test_impossible_yaml_dates_are_reported_at_their_line(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(FULL_CONFIG) + "when: 2024-13-45\n")
    error = refused(lambda: load_config(config), ConfigError)
    assert error.issues[0].path.startswith(f"{config}:")
    assert "2024-13-45" in error.issues[0].message


# --- 4. integers past 64 bits, and past Python's digit limit -----------------------------------

huge_ints = st.integers(min_value=2**63, max_value=10**4000) | st.integers(
    max_value=-(2**63) - 1, min_value=-(10**4000)
)


@examples(50)
@given(value=huge_ints, path=config_paths)
def test_integers_past_64_bits_are_refused_at_their_path(value, path):
    error = refused(lambda: validate_config(set_at(FULL_CONFIG, path, value)), ConfigError)
    assert dotted(path) in paths_of(error), (paths_of(error), dotted(path))


@examples(40)
@given(
    fmt=st.sampled_from(["toml", "json", "yaml"]),
    digits=st.integers(sys.get_int_max_str_digits() + 1, 50_000),
    path=config_paths,
    sign=st.sampled_from(["", "-"]),
)
def test_numbers_past_the_digit_limit_are_one_issue_at_their_line(fmt, digits, path, sign):
    number = sign + "7" * digits
    with workdir() as tmp:
        document = config_text(FULL_CONFIG, fmt, path, number)
        config = write_config(tmp, fmt, document)
        error = refused(lambda: load_config(config), ConfigError)
    (issue,) = error.issues
    assert issue.path.startswith(f"{config}:{line_of(document, number)}:"), issue
    assert "digits" in issue.message


@examples(20)
@given(digits=st.integers(sys.get_int_max_str_digits() + 1, 50_000))
def test_numbers_past_the_digit_limit_in_an_override_name_it(digits):
    override = f"run.seed={'9' * digits}"
    error = refused(lambda: apply_overrides(FULL_CONFIG, [override]), ConfigError)
    assert paths_of(error)[0].startswith("--set run.seed=")
    assert len(paths_of(error)[0]) < 120  # the 50,000 digits are not echoed back


# --- every scalar field of the schema, found by walking RunConfig.model_fields ------------------


def _scalar_fields(annotation: Any, prefix: tuple[Any, ...]) -> Iterator[tuple[tuple, Any, Any]]:
    """(raw path, scalar type, algorithm kind or None) of every scalar a config can hold."""
    annotation = _strip(annotation)
    origin = get_origin(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        for name, info in annotation.model_fields.items():
            yield from _scalar_fields(info.annotation, (*prefix, name))
    elif origin in (Union, types.UnionType) and all(_is_kind(m) for m in get_args(annotation)):
        for member in get_args(annotation):  # the algorithm union, one branch per kind
            kind = get_args(member.model_fields["kind"].annotation)[0]
            for path, scalar, _ in _scalar_fields(member, prefix):
                yield path, scalar, kind
    elif origin in (Union, types.UnionType):  # of scalars (and lists), e.g. 'auto' | bool
        yield prefix, annotation, None
    elif origin is list and get_args(annotation):
        yield from _scalar_fields(get_args(annotation)[0], (*prefix, 0))
    elif origin is tuple:
        for i, item in enumerate(get_args(annotation)):
            yield from _scalar_fields(item, (*prefix, i))
    elif origin is Literal or annotation in (str, int, float, bool):
        yield prefix, annotation, None


def _is_kind(member: Any) -> bool:
    return (
        isinstance(member, type) and issubclass(member, BaseModel) and "kind" in member.model_fields
    )


def _strip(annotation: Any) -> Any:
    """Without Optional and Annotated."""
    if get_origin(annotation) is typing.Annotated:
        return _strip(get_args(annotation)[0])
    if get_origin(annotation) in (Union, types.UnionType):
        members = [a for a in get_args(annotation) if a is not type(None)]
        if len(members) == 1:
            return _strip(members[0])
    return annotation


SCALARS = sorted(
    {
        (path, scalar, kind)
        for name, info in RunConfig.model_fields.items()
        for path, scalar, kind in _scalar_fields(info.annotation, (name,))
    },
    key=repr,
)
STRING_FIELDS = [(path, kind) for path, scalar, kind in SCALARS if scalar is str]


def with_value(path: tuple[Any, ...], kind: str | None, value: Any) -> dict[str, Any]:
    config = copy.deepcopy(FULL_CONFIG)
    if kind is not None and kind != config["algorithm"]["kind"]:
        config["algorithm"] = {"kind": kind}
    if isinstance(path[-1], int):  # an item of a list or tuple: the others keep their defaults
        config = set_at(config, path[:-1], list(_default_of(path[:-1], kind)))
    return set_at(config, path, value)


def _default_of(path: tuple[Any, ...], kind: str | None) -> Any:
    model: Any = RunConfig
    for part in path[:-1]:
        if isinstance(part, int):
            continue  # an item of a list of models: `model` is that model already
        model = _strip(model.model_fields[part].annotation)
        if get_origin(model) in (Union, types.UnionType):  # the algorithm, by kind
            model = next(
                m for m in get_args(model) if m.model_fields["kind"].annotation == Literal[kind]
            )
        elif get_origin(model) is list:
            model = get_args(model)[0]
    return model.model_fields[path[-1]].get_default(call_default_factory=True)


# --- 5. NUL characters ---------------------------------------------------------------------------


def test_the_field_walk_finds_every_area():
    areas = {path[0] for path, _, _ in SCALARS}
    assert areas == set(RunConfig.model_fields)
    assert (("algorithm", "lr"), float, "grpo") in SCALARS
    assert (("algorithm", "adam_betas", 1), float, "sft") in SCALARS


@pytest.mark.parametrize("field", STRING_FIELDS, ids=lambda f: f"{f[1] or ''}:{dotted(f[0])}")
@examples(4)
@given(text=st.text(max_size=30), data=st.data())
def test_nul_in_any_string_field_is_refused_at_the_field(field, text, data):
    path, kind = field
    at = data.draw(st.integers(0, len(text)))
    value = text[:at] + "\0" + text[at:]
    error = refused(lambda: validate_config(with_value(path, kind, value)), ConfigError)
    assert dotted(path) in paths_of(error), (paths_of(error), dotted(path))
    (issue,) = [i for i in error.issues if i.path == dotted(path)]
    assert "NUL" in issue.message


printable = st.characters(blacklist_categories=("Cs",), blacklist_characters="\0")


@examples(30)
@given(name=st.text(printable, min_size=1, max_size=20), data=st.data())
def test_nul_in_a_file_path_is_refused_by_every_reader(name, data):
    at = data.draw(st.integers(0, len(name)))
    suffix = data.draw(st.sampled_from([".toml", ".yaml", ".json", ".lock", ".jsonl"]))
    path = name[:at] + "\0" + name[at:] + suffix
    refused(lambda: read_config_file(path), ConfigError)
    refused(lambda: lockfile.read_plan(Path(path), check_fresh=False), LockfileError)
    refused(lambda: read_prompts(path, "prompt"), RolloutError)
    result = runner.invoke(app, ["validate", "--config", path])
    assert result.exit_code == 2 and "Traceback" not in result.output


# --- 6. values of the wrong type: refused, not coerced -------------------------------------------


def wrong_values(scalar: Any) -> st.SearchStrategy[Any]:
    """Values a lax validator would convert, or that are plainly of another type."""
    # Integers within 64 bits and finite floats: larger ones are another class (plain data).
    ints = st.integers(-(10**12), 10**12)
    floats = st.floats(allow_nan=False, allow_infinity=False)
    numbers_as_text = ints.map(str) | floats.map(repr)
    containers = st.lists(ints, max_size=3) | st.dictionaries(
        st.sampled_from("abc"), ints, min_size=1, max_size=2
    )
    if scalar is int:
        return numbers_as_text | st.integers(0, 100).map(lambda i: i + 0.5) | containers
    if scalar is float:
        return numbers_as_text | st.booleans() | containers
    if scalar is bool:
        return st.sampled_from(["true", "false", "yes", "1"]) | st.integers(0, 1) | containers
    if get_origin(scalar) in (Union, types.UnionType):  # what no member takes
        return floats | st.dictionaries(st.sampled_from("abc"), ints, min_size=1, max_size=2)
    return ints | floats | st.booleans() | containers  # a string, or a choice among strings


@pytest.mark.parametrize("field", SCALARS, ids=lambda f: f"{f[2] or ''}:{dotted(f[0])}")
@examples(4)
@given(data=st.data())
def test_wrong_types_are_refused_at_the_field_not_coerced(field, data):
    path, scalar, kind = field
    value = data.draw(wrong_values(scalar))
    error = refused(lambda: validate_config(with_value(path, kind, value)), ConfigError)
    shown = dotted(path)
    assert shown in paths_of(error), (paths_of(error), shown, value)
    issue = next(i for i in error.issues if i.path == shown)
    if get_origin(scalar) is not Literal:
        assert issue.message.startswith("must be ") and ", not " in issue.message, issue
    if isinstance(value, str) and scalar in (int, float) and _parses(value, scalar):
        assert issue.hint and "without quotes" in issue.hint, issue


def _parses(text: str, scalar: type) -> bool:
    try:
        scalar(text)
    except ValueError:
        return False
    return True


def test_a_string_number_says_what_was_expected_and_given():
    raw = set_at(FULL_CONFIG, ("algorithm", "lr"), "1e-5")
    (issue,) = refused(lambda: validate_config(raw), ConfigError).issues
    assert str(issue) == (
        "algorithm.lr: must be a number, not a string (got '1e-5'); write it without quotes: 1e-5"
    )


def test_legitimate_conversions_are_kept(tmp_path):
    """An integer is a number, a list fills a tuple, YAML's 1e-5 is a number, and a plan.lock,
    whose JSON has lists where the config has tuples, still loads."""
    raw = set_at(FULL_CONFIG, ("algorithm", "lr"), 1)
    raw = set_at(raw, ("algorithm", "adam_betas"), [0.9, 0.99])
    config = validate_config(raw)
    assert config.algorithm.lr == 1.0 and isinstance(config.algorithm.lr, float)
    assert config.algorithm.adam_betas == (0.9, 0.99)
    text = yaml.safe_dump(FULL_CONFIG).replace("kind: grpo", "kind: grpo\n  lr: 1e-5")
    (tmp_path / "train.jsonl").write_text("{}\n")
    assert load_config(write_config(tmp_path, "yaml", text)).algorithm.lr == 1e-5
    content = json.loads(json.dumps(config.model_dump(mode="json")))
    assert RunConfig.model_validate(content) == config


# --- 7. YAML aliases that expand without end ------------------------------------------------------


def alias_bomb(width: int, levels: int) -> str:
    lines = ["  - fn: numeric_match", "    options:", f"      l0: &l0 [{', '.join(['1'] * width)}]"]
    for level in range(1, levels):
        refs = ", ".join([f"*l{level - 1}"] * width)
        lines.append(f"      l{level}: &l{level} [{refs}]")
    config = {k: v for k, v in FULL_CONFIG.items() if k != "rewards"}
    return yaml.safe_dump(config) + "rewards:\n" + "\n".join(lines) + "\n"


@examples(30)
@given(width=st.integers(2, 12), levels=st.integers(2, 14))
def test_yaml_alias_bombs_are_refused_quickly(width, levels):
    expanded = sum(width**level for level in range(1, levels + 1))
    with workdir() as tmp:
        config = write_config(tmp, "yaml", alias_bomb(width, levels))
        with no_hang():
            try:
                load_config(config)
                outcome = None
            except ConfigError as error:
                outcome = error
    if expanded > 2 * MAX_VALUES:
        assert outcome is not None
    if outcome is not None:
        assert all(p.startswith("rewards") for p in paths_of(outcome)), paths_of(outcome)


@examples(20)
@given(path=st.sampled_from([p for p in CONFIG_PATHS if len(p) == 1] + [OPTIONS_PATH]))
def test_a_yaml_alias_inside_its_own_anchor_is_refused(path):
    with workdir() as tmp:
        document = config_text(FULL_CONFIG, "yaml", path, "&loop [1, *loop]")
        config = write_config(tmp, "yaml", document)
        error = refused(lambda: load_config(config), ConfigError)
    assert any("contains itself" in issue.message for issue in error.issues)
    assert any(p.startswith(dotted(path)) for p in paths_of(error))


# --- 8. files too large to be what they claim ---------------------------------------------------


@examples(10)
@given(extra=st.integers(1, 64 << 10), fmt=st.sampled_from(["toml", "yaml", "json"]))
def test_config_files_past_the_cap_are_refused_unread(extra, fmt):
    with workdir() as tmp:
        config = tmp / f"run.{fmt}"
        config.write_bytes(b" " * (MAX_CONFIG_BYTES + extra))
        error = refused(lambda: load_config(config), ConfigError)
    assert "larger than a config file may be" in error.issues[0].message


@examples(20)
@given(cap=st.integers(100, 5000), extra=st.integers(1, 5000))
def test_plan_files_past_the_cap_are_refused_unread(cap, extra):
    with tempfile.TemporaryDirectory() as tmp, mock.patch.object(lockfile, "MAX_PLAN_BYTES", cap):
        plan = Path(tmp) / "plan.lock"
        plan.write_bytes(b"{" * (cap + extra))
        error = refused(lambda: lockfile.read_plan(plan, check_fresh=False), LockfileError)
    assert "larger than a plan.lock may be" in error.issues[0].message


# --- 9. plan.lock: nesting and numbers the JSON parser cannot take ------------------------------


@examples(30)
@given(
    depth=st.integers(lockfile.MAX_PLAN_DEPTH + 1, 1_000_000),
    bracket=st.sampled_from(["[", "{"]),
)
def test_deeply_nested_plan_files_are_one_issue(depth, bracket):
    text = nested(depth, bracket, "json")
    with tempfile.TemporaryDirectory() as tmp:
        plan = Path(tmp) / "plan.lock"
        plan.write_text(text)
        error = refused(lambda: lockfile.read_plan(plan, check_fresh=False), LockfileError)
    assert error.issues[0].path == "plan.lock"


@examples(15)
@given(depth=st.integers(lockfile.MAX_PLAN_DEPTH + 1, 300))
def test_deeply_nested_plan_content_with_a_good_hash_is_refused(depth):
    """A hand-made plan.lock that hashes right, nested past any plan rollout writes."""
    value: Any = []
    for _ in range(depth):
        value = [value]
    with tempfile.TemporaryDirectory() as tmp:
        plan = Path(tmp) / "plan.lock"
        plan.write_bytes(lockfile._serialize({"config": value}))
        error = refused(lambda: lockfile.read_plan(plan, check_fresh=False), LockfileError)
    assert "nested too deeply" in error.issues[0].message


@examples(15)
@given(digits=st.integers(sys.get_int_max_str_digits() + 1, 50_000))
def test_plan_files_with_endless_numbers_are_one_issue(digits):
    with tempfile.TemporaryDirectory() as tmp:
        plan = Path(tmp) / "plan.lock"
        plan.write_text('{"plan": ' + "1" * digits + "}")
        error = refused(lambda: lockfile.read_plan(plan, check_fresh=False), LockfileError)
    assert "Exceeds the limit" not in str(error)  # CPython's words, not a user's


# --- 10. data and prompt files with a line no JSON reader should recurse into -----------------


@examples(30)
@given(
    depth=st.integers(MAX_RECORD_DEPTH + 1, 200_000),
    bracket=st.sampled_from(["[", "{"]),
    position=st.integers(0, 5),
    reader=st.sampled_from(["data", "prompts"]),
)
def test_a_deeply_nested_data_line_is_an_issue_naming_the_line(depth, bracket, position, reader):
    records = [json.dumps({"prompt": f"q{i}"}) for i in range(5)]
    records.insert(position, '{"prompt": ' + nested(depth, bracket, "json") + "}")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "train.jsonl"
        path.write_text("\n".join(records) + "\n")
        _, read, error_type, _ = READERS[reader]
        error = refused(lambda: read(path), error_type)
    assert any(f"line {position + 1} of" in issue.message for issue in error.issues), error


@examples(15)
@given(digits=st.integers(sys.get_int_max_str_digits() + 1, 50_000), position=st.integers(0, 3))
def test_a_data_line_with_an_endless_number_is_an_issue_naming_the_line(digits, position):
    records = [json.dumps({"prompt": f"q{i}"}) for i in range(3)]
    records.insert(position, '{"prompt": ' + "3" * digits + "}")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "train.jsonl"
        path.write_text("\n".join(records) + "\n")
        error = refused(lambda: _data_reader(path), PlanError)
    assert any(f"line {position + 1} of" in issue.message for issue in error.issues), error


# --- 11. the command line: exit 2, a message, no traceback ---------------------------------------


def special_inputs(tmp: Path) -> dict[str, Path]:
    fifo = tmp / "fifo.toml"
    os.mkfifo(fifo)
    (tmp / "dir.yaml").mkdir()
    (tmp / "zero.json").symlink_to("/dev/zero")
    (tmp / "deep.toml").write_text("a = " + "[" * 100_000 + "]" * 100_000)
    (tmp / "huge.json").write_text('{"run": {"seed": ' + "9" * 10_000 + "}}")
    (tmp / "big.toml").write_bytes(b"#" * (MAX_CONFIG_BYTES + 1))
    (tmp / "date.toml").write_text("[run]\nname = 2024-01-01\n")
    return {p.name: p for p in tmp.iterdir()}


@pytest.mark.parametrize(
    "name",
    ["fifo.toml", "dir.yaml", "zero.json", "deep.toml", "huge.json", "big.toml", "date.toml"],
)
@pytest.mark.parametrize("command", ["validate", "plan"])
def test_cli_refuses_each_bad_config_with_exit_2(tmp_path, monkeypatch, name, command):
    monkeypatch.chdir(tmp_path)
    path = special_inputs(tmp_path)[name]
    args = [command, "--config", str(path)]
    if command == "plan":
        args += ["-o", str(tmp_path / "plan.lock")]
    with no_hang(HANG_LIMIT_S * 4):  # plan imports more on its first call
        result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert re.search(r"error: .*\d+ problems?", " ".join(result.output.split())), result.output


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_cli_refuses_a_special_plan_or_prompt_file_with_exit_2(tmp_path, monkeypatch, kind):
    monkeypatch.chdir(tmp_path)
    plan = make_special(tmp_path, "plan.lock", kind)
    prompts = make_special(tmp_path, "prompts.jsonl", kind)
    calls = [
        ["run", "--plan", str(plan)],
        ["generate", "--prompts", str(prompts), "--out", "o.jsonl", "--model", "tiny-llama"],
    ]
    for args in calls:
        with no_hang(HANG_LIMIT_S * 4):
            result = runner.invoke(app, args)
        assert result.exit_code == 2, result.output
        assert "Traceback" not in result.output
        assert ("named pipe" if kind == "fifo" else "directory") in result.output
