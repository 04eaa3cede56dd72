"""Property tests: every malformed config ends in exit code 2, a dotted path, and no traceback."""

from __future__ import annotations

import copy
import json
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from rollout.cli.app import app
from tests.conftest import BASE_CONFIG, write_toml

runner = CliRunner()
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

TABLES = [
    "",
    "run",
    "model",
    "data",
    "data.train",
    "data.fields",
    "algorithm",
    "generation",
    "cluster",
    "rewards[0]",
]
SCALARS = [
    "run.name",
    "run.seed",
    "model.builtin",
    "data.train.path",
    "algorithm.kind",
    "algorithm.rollout_batch_size",
    "algorithm.num_generations",
    "algorithm.max_steps",
    "generation.max_new_tokens",
    "cluster.device",
    "rewards[0].fn",
    "rewards[0].weight",
]
NEGATIVE_INVALID = [
    "run.seed",
    "algorithm.max_steps",
    "algorithm.rollout_batch_size",
    "algorithm.lr",
    "generation.max_new_tokens",
    "generation.temperature",
    "generation.top_p",
    "cluster.nnodes",
    "cluster.nproc_per_node",
]
REQUIRED = [
    "model",
    "data",
    "algorithm",
    "data.train",
    "data.train.path",
    "algorithm.kind",
    "rewards[0].fn",  # a reward needs fn or model: reported at the reward, rewards[0]
]


def _parts(path: str) -> list[str | int]:
    parts: list[str | int] = []
    for segment in filter(None, path.split(".")):
        if "[" in segment:
            name, index = segment[:-1].split("[")
            parts += [name, int(index)]
        else:
            parts.append(segment)
    return parts


def _container(config: dict[str, Any], path: str) -> tuple[Any, str | int]:
    parts = _parts(path)
    target: Any = config
    for part in parts[:-1]:
        target = target.setdefault(part, {}) if isinstance(part, str) else target[part]
    return target, parts[-1]


def _set(config: dict[str, Any], path: str, value: Any) -> None:
    target, last = _container(config, path)
    target[last] = value


def _validate_json(config: dict[str, Any] | str) -> tuple[int, dict[str, Any], str]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run.toml"
        if isinstance(config, str):
            path.write_text(config, encoding="utf-8")
        else:
            write_toml(path, config)
        result = runner.invoke(app, ["validate", "--config", str(path), "--format", "json"])
    output = result.output
    assert "Traceback" not in output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, json.loads(output) if output.strip().startswith("{") else {}, output


def _assert_reported(config: dict[str, Any], expected_prefix: str) -> None:
    code, report, output = _validate_json(config)
    assert code == 2, output
    paths = [error["path"] for error in report["errors"]]
    assert any(
        p == expected_prefix
        or p.startswith(expected_prefix + ".")
        or p.startswith(expected_prefix + "[")
        for p in paths
    ), (expected_prefix, paths)
    for error in report["errors"]:
        assert error["message"], error


identifiers = st.from_regex(r"[a-z][a-z_]{2,14}", fullmatch=True)


@SETTINGS
@given(table=st.sampled_from(TABLES), key=identifiers)
def test_unknown_keys_are_reported_at_their_path(table, key):
    config = copy.deepcopy(BASE_CONFIG)
    target = config if not table else _container(config, table + ".x")[0]
    if key in target:
        return
    target[key] = 1
    code, report, _ = _validate_json(config)
    if code == 0:  # the random key happened to be a real optional field
        return
    expected = f"{table}.{key}" if table else key
    paths = [error["path"] for error in report["errors"]]
    assert code == 2
    assert expected in paths or any(p.startswith(table or key) for p in paths), (expected, paths)


@SETTINGS
@given(
    path=st.sampled_from(SCALARS),
    value=st.one_of(
        st.dictionaries(identifiers, st.integers(), min_size=1), st.lists(st.integers(), min_size=1)
    ),
)
def test_wrong_types_are_reported(path, value):
    config = copy.deepcopy(BASE_CONFIG)
    _set(config, path, value)
    _assert_reported(config, path.rsplit(".", 1)[0] if path.endswith("kind") else path)


@SETTINGS
@given(path=st.sampled_from(NEGATIVE_INVALID), value=st.integers(max_value=-1))
def test_out_of_range_values_are_reported(path, value):
    config = copy.deepcopy(BASE_CONFIG)
    _set(config, path, value)
    _assert_reported(config, path)


@SETTINGS
@given(path=st.sampled_from(REQUIRED))
def test_missing_required_keys_are_reported(path):
    config = copy.deepcopy(BASE_CONFIG)
    target, last = _container(config, path)
    del target[last]
    _assert_reported(config, path.removesuffix(".fn"))


@SETTINGS
@given(path=st.sampled_from([p for p in SCALARS if "[" not in p]), data=st.data())
def test_misspelled_keys_get_a_suggestion(path, data):
    config = copy.deepcopy(BASE_CONFIG)
    target, last = _container(config, path)
    key = str(last)
    i = data.draw(st.integers(min_value=0, max_value=len(key) - 2))
    typo = key[:i] + key[i + 1] + key[i] + key[i + 2 :]  # swap two neighbouring letters
    if typo == key:
        return
    target[typo] = target.pop(last)
    code, report, output = _validate_json(config)
    assert code == 2, output
    hints = [e.get("hint", "") for e in report["errors"] if e["path"].endswith(typo)]
    assert any(f"did you mean {key!r}" in h for h in hints), report


@SETTINGS
@given(ref=st.text(alphabet=" :/\\!@#$%^&*()", min_size=1, max_size=12))
def test_broken_plugin_references_are_reported(ref):
    config = copy.deepcopy(BASE_CONFIG)
    config["rewards"][0]["fn"] = ref
    _assert_reported(config, "rewards[0].fn")


@SETTINGS
@given(text=st.text(max_size=200))
def test_arbitrary_text_never_crashes(text):
    code, _, output = _validate_json(text)
    assert code == 2, output
