"""Generated artifacts: committed copies are current, every field is documented, the JSON Schema
agrees with the models, the stubs are valid Python, and `rollout schema --check` catches drift."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_args

import jsonschema
import pytest
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from typer.testing import CliRunner

from rollout.cli.app import app
from rollout.config import read_config_file, validate_config
from rollout.config.root import RunConfig
from rollout.schema import (
    PATHS,
    build_schema,
    build_stubs,
    generated_files,
    schema_text,
    stale_files,
)
from rollout.schema.reference import EXAMPLE_TOML
from rollout.schema.stubs import ROOT_NAME
from tests.conftest import run_config_examples

REPO = Path(__file__).resolve().parents[2]
runner = CliRunner()


# --- committed files ---------------------------------------------------------------------------


def test_committed_files_match_the_models():
    stale = stale_files(REPO)
    assert not stale, (
        f"out of date: {', '.join(stale)}. Run `rollout schema` and commit the result."
    )


def test_output_is_identical_across_processes():
    # A different hash seed per process would expose any dependence on set or dict-of-set order.
    script = "import json; from rollout.schema import generated_files; print(json.dumps(generated_files()))"
    outputs = [
        subprocess.run(
            [sys.executable, "-c", script],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            check=True,
            text=True,
        ).stdout
        for seed in ("1", "2")
    ]
    assert json.loads(outputs[0]) == json.loads(outputs[1]) == generated_files()


def test_schema_text_is_indented_json_with_a_trailing_newline():
    text = schema_text()
    assert text.endswith("}\n") and not text.endswith("\n\n")
    assert text.startswith('{\n  "$schema": "https://json-schema.org/draft/2020-12/schema"')
    assert json.loads(text)["$id"] == "https://rollout.dev/schemas/rollout.schema.json"


# --- every field is documented -----------------------------------------------------------------


def config_models(annotation: Any) -> Iterator[type[BaseModel]]:
    """Every model reachable from ``annotation``: nested sections, optional ones, list items and
    each member of a tagged union."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation
        for info in annotation.model_fields.values():
            yield from config_models(info.annotation)
    for arg in get_args(annotation):
        yield from config_models(arg)


MODELS = sorted(set(config_models(RunConfig)), key=lambda m: m.__name__)
FIELDS = [(f"{m.__name__}.{name}", info) for m in MODELS for name, info in m.model_fields.items()]


def test_the_walk_reaches_every_section_and_algorithm_kind():
    names = {m.__name__ for m in MODELS}
    kinds = {"Grpo", "Ppo", "Rloo", "Dpo", "Ipo", "Kto", "Sft", "Rm"}
    assert {f"{kind}Config" for kind in kinds} <= names
    assert {"DataSource", "FieldMap", "RewardSpec", "StorageSection"} <= names


@pytest.mark.parametrize(("name", "info"), FIELDS, ids=[name for name, _ in FIELDS])
def test_every_field_has_a_description(name: str, info: FieldInfo):
    assert info.description and info.description.strip(), f"{name} has no description"


# --- the JSON Schema agrees with the models ----------------------------------------------------


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft202012Validator:
    schema = build_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_schema_accepts_a_valid_config(validator, base_config):
    validator.validate(base_config)


@pytest.mark.parametrize("path", run_config_examples(), ids=lambda p: p.name)
def test_schema_accepts_every_example(validator, path: Path):
    validator.validate(read_config_file(path))


@pytest.mark.parametrize(
    ("section", "key"),
    [(None, "algorithmm"), ("algorithm", "learning_rate"), ("generation", "max_tokens")],
)
def test_schema_rejects_an_unknown_key(validator, base_config, section, key):
    target = base_config if section is None else base_config[section]
    target[key] = 1
    errors = list(validator.iter_errors(base_config))
    assert errors, f"an unknown key {key!r} was accepted"


def test_schema_rejects_an_unknown_algorithm_kind(validator, base_config):
    base_config["algorithm"]["kind"] = "grop"
    assert not validator.is_valid(base_config)


def test_reference_example_is_valid_for_both_validators(validator, tmp_path: Path):
    path = tmp_path / "run.toml"
    path.write_text(EXAMPLE_TOML, encoding="utf-8")
    raw = read_config_file(path)
    validator.validate(raw)
    assert validate_config(raw).algorithm.kind == "grpo"


# --- stubs -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stub_module() -> ast.Module:
    return ast.parse(build_stubs(build_schema()))


def classes(module: ast.Module) -> dict[str, ast.ClassDef]:
    return {node.name: node for node in module.body if isinstance(node, ast.ClassDef)}


def fields(cls: ast.ClassDef) -> dict[str, str]:
    return {
        node.target.id: ast.unparse(node.annotation)
        for node in cls.body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
    }


def test_stubs_define_a_typeddict_per_definition(stub_module):
    found = classes(stub_module)
    for name in [ROOT_NAME, *build_schema()["$defs"]]:
        assert name in found, f"no class {name} in the stubs"
        assert [ast.unparse(base) for base in found[name].bases] == ["TypedDict"]


def test_stubs_mark_exactly_the_optional_keys_not_required(stub_module):
    schema = build_schema()
    for name, node in [(ROOT_NAME, schema), *schema["$defs"].items()]:
        required = set(node.get("required", ()))
        for key, annotation in fields(classes(stub_module)[name]).items():
            assert annotation.startswith("NotRequired[") == (key not in required), f"{name}.{key}"


def test_stubs_name_the_algorithm_union_and_the_reward_protocol(stub_module):
    aliases = {
        node.target.id: ast.unparse(node.value)
        for node in stub_module.body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
    }
    kinds = ["Grpo", "Ppo", "Rloo", "ReinforcePp", "Dpo", "Ipo", "Kto", "Sft", "Rm"]
    assert aliases["AlgorithmConfig"] == " | ".join(f"{kind}Config" for kind in kinds)
    assert fields(classes(stub_module)[ROOT_NAME])["algorithm"] == "AlgorithmConfig"
    protocol = classes(stub_module)["RewardFn"]
    assert [ast.unparse(base) for base in protocol.bases] == ["Protocol"]


def test_stub_types_cover_each_schema_shape():
    schema = {
        "required": ["tag"],
        "properties": {
            "tag": {"const": "a", "description": "Tag."},
            "mode": {"enum": ["x", "y"], "default": "x"},
            "count": {"anyOf": [{"type": "integer", "minimum": 1}, {"type": "null"}]},
            "pair": {"type": "array", "prefixItems": [{"type": "number"}, {"type": "string"}]},
            "names": {"type": "array", "items": {"type": "string"}},
            "extra": {"type": "object", "additionalProperties": True},
            "ranks": {"type": "object", "additionalProperties": {"$ref": "#/$defs/Child"}},
        },
        "$defs": {"Child": {"properties": {"on": {"type": "boolean"}}}},
    }
    got = fields(classes(ast.parse(build_stubs(schema)))[ROOT_NAME])
    assert got == {
        "tag": "Literal['a']",
        "mode": "NotRequired[Literal['x', 'y']]",
        "count": "NotRequired[int | None]",
        "pair": "NotRequired[tuple[float, str]]",
        "names": "NotRequired[list[str]]",
        "extra": "NotRequired[dict[str, Any]]",
        "ranks": "NotRequired[dict[str, Child]]",
    }


def test_field_docstrings_survive_quotes_and_backslashes():
    tricky = 'Ends with "quotes"; has """ and a \\d+ pattern ' + "and many words " * 12
    schema = {"properties": {"x": {"type": "string", "description": tricky}}, "$defs": {}}
    body = classes(ast.parse(build_stubs(schema)))[ROOT_NAME].body
    docstring = next(node.value.value for node in body if isinstance(node, ast.Expr))
    assert " ".join(docstring.split()) == " ".join(tricky.split())


# --- the command -------------------------------------------------------------------------------


def test_check_passes_on_the_repository():
    result = runner.invoke(app, ["schema", "--check", "--root", str(REPO)])
    assert result.exit_code == 0, result.output


def test_check_names_an_altered_file_and_the_fix(tmp_path: Path):
    assert runner.invoke(app, ["schema", "--root", str(tmp_path)]).exit_code == 0
    assert runner.invoke(app, ["schema", "--check", "--root", str(tmp_path)]).exit_code == 0
    altered = tmp_path / PATHS["markdown"]
    altered.write_text(altered.read_text(encoding="utf-8") + "edited by hand\n", encoding="utf-8")

    result = runner.invoke(app, ["schema", "--check", "--root", str(tmp_path)])

    assert result.exit_code == 1
    assert PATHS["markdown"] in result.output
    assert PATHS["json"] not in result.output
    assert "rollout schema" in result.output


def test_write_reports_only_changed_files(tmp_path: Path):
    first = runner.invoke(app, ["schema", "--root", str(tmp_path)])
    assert all(path in first.output for path in PATHS.values())
    (tmp_path / PATHS["python"]).unlink()

    second = runner.invoke(app, ["schema", "--root", str(tmp_path)])

    assert second.exit_code == 0
    assert PATHS["python"] in second.output
    assert PATHS["json"] not in second.output
    assert not stale_files(tmp_path)


@pytest.mark.parametrize("fmt", sorted(PATHS))
def test_format_prints_one_artifact_and_writes_nothing(tmp_path: Path, fmt: str):
    result = runner.invoke(app, ["schema", "--format", fmt, "--root", str(tmp_path)])
    assert result.exit_code == 0
    assert result.stdout == generated_files()[PATHS[fmt]]
    assert not any(tmp_path.iterdir())
