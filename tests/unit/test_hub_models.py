"""`model.hub`: a model named by Hub id, read from a Hugging Face cache built in the test.

Nothing is downloaded: the cache is laid out by the hub_cache fixture (tests/conftest.py) as
huggingface_hub lays it out, and HF_HUB_CACHE points at it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from typer.testing import CliRunner

import rollout
from rollout.cli.app import app
from rollout.errors import LockfileError
from rollout.inference.model_choice import choose_model, model_source
from rollout.planner.lockfile import read_plan, write_plan
from tests.conftest import COMMITS, HUB_ID, REPO

runner = CliRunner()


@pytest.fixture
def hub_config(base_config):
    base_config["model"] = {"hub": HUB_ID}
    return base_config


def _errors(result) -> list[dict]:
    assert result.exit_code == 2, result.output
    return json.loads(result.output)["errors"]


def test_validate_accepts_a_hub_id_without_looking_it_up(config_file, hub_config):
    # validate reads no model: an id that is in no cache is still a valid config.
    hub_config["model"]["revision"] = "v1.0"
    result = runner.invoke(app, ["validate", "-c", str(config_file(hub_config))])
    assert result.exit_code == 0, result.output
    assert f"grpo on hub {HUB_ID}@v1.0" in result.output


@pytest.mark.parametrize(
    "bad",
    [
        "https://huggingface.co/rollout-tests/tiny-llama",
        "tiny-llama",
        "./models/tiny-llama",
        "org/name/extra",
        "org--x/name",
    ],
)
def test_validate_refuses_what_is_not_an_org_name_id(config_file, hub_config, bad):
    hub_config["model"]["hub"] = bad
    result = runner.invoke(
        app, ["validate", "-c", str(config_file(hub_config)), "--format", "json"]
    )
    (error,) = _errors(result)
    assert error["path"] == "model.hub" and error["value"] == bad
    assert "'org/name'" in error["message"] and "not a URL or a path" in error["message"]


def test_hub_is_one_of_the_four_sources(config_file, base_config):
    base_config["model"] = {"builtin": "tiny-llama", "hub": HUB_ID}
    result = runner.invoke(
        app, ["validate", "-c", str(config_file(base_config)), "--format", "json"]
    )
    (error,) = _errors(result)
    assert error["path"] == "model"
    assert "exactly one of model.path, model.package, model.builtin, model.hub" in error["message"]
    assert "found: model.builtin, model.hub" in error["message"]


def test_a_revision_needs_a_hub_id(config_file, base_config):
    base_config["model"]["revision"] = "main"
    result = runner.invoke(
        app, ["validate", "-c", str(config_file(base_config)), "--format", "json"]
    )
    (error,) = _errors(result)
    assert error["path"] == "model.revision" and "model.hub is not set" in error["message"]


@pytest.mark.parametrize("bad", ["../../../etc", "/abs", "a//b", "v 1"])
def test_validate_refuses_a_revision_that_is_no_git_name(config_file, hub_config, bad):
    hub_config["model"]["revision"] = bad
    result = runner.invoke(
        app, ["validate", "-c", str(config_file(hub_config)), "--format", "json"]
    )
    (error,) = _errors(result)
    assert error["path"] == "model.revision" and error["value"] == bad


def test_plan_records_the_commit_and_the_snapshot(config_file, hub_config, hub_cache):
    snapshot = hub_cache.add()
    plan = rollout.plan(str(config_file(hub_config)))
    assert plan.model.source == "hub"
    assert plan.model.commit == COMMITS[0]
    assert plan.model.location == str(snapshot)
    assert plan.model.format == "hf" and plan.model.architecture == "LlamaForCausalLM"


def test_a_revision_names_a_tag_or_a_commit(config_file, hub_config, hub_cache):
    hub_cache.add(commit=COMMITS[0])
    hub_cache.add(commit=COMMITS[1], ref="v2")
    hub_config["model"]["revision"] = "v2"
    assert rollout.plan(str(config_file(hub_config))).model.commit == COMMITS[1]
    hub_config["model"]["revision"] = COMMITS[0]
    assert rollout.plan(str(config_file(hub_config))).model.commit == COMMITS[0]


@pytest.mark.parametrize("offline", ["1", None])
def test_a_model_not_in_the_cache_is_refused_with_the_fetch_command(
    config_file, hub_config, hub_cache, monkeypatch, tmp_path, offline
):
    if offline is None:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # still nothing is downloaded
    hub_config["model"]["revision"] = "v1"
    result = runner.invoke(
        app,
        [
            "plan",
            "-c",
            str(config_file(hub_config)),
            "-o",
            str(tmp_path / "plan.lock"),
            "--format",
            "json",
        ],
    )
    (error,) = _errors(result)
    assert error["path"] == "model.hub"
    assert error["message"] == (
        f"{HUB_ID} at revision 'v1' is not in the Hugging Face cache {hub_cache.root}; "
        "rollout never downloads a model"
    )
    assert error["hint"] == f"fetch it first: hf download {HUB_ID} --revision v1"
    assert not (tmp_path / "plan.lock").exists()


def test_a_moved_revision_makes_the_plan_stale(config_file, hub_config, hub_cache, tmp_path):
    hub_cache.add(commit=COMMITS[0])
    lock = tmp_path / "plan.lock"
    write_plan(rollout.plan(str(config_file(hub_config))), lock)
    assert read_plan(lock).model.commit == COMMITS[0]  # fresh while refs/main stays

    hub_cache.add(commit=COMMITS[1])  # a newer download moves refs/main
    with pytest.raises(LockfileError) as caught:
        read_plan(lock)
    (issue,) = caught.value.issues
    assert issue.path == "model.hub"
    assert f"{HUB_ID} revision 'main' moved since planning" in issue.message
    assert "aaaaaaaa… → bbbbbbbb…" in issue.message
    assert "rollout plan" in issue.hint

    hub_cache.point("main", COMMITS[0])
    assert read_plan(lock).model.commit == COMMITS[0]


def test_a_plan_whose_model_left_the_cache_is_stale(config_file, hub_config, hub_cache, tmp_path):
    hub_cache.add()
    lock = tmp_path / "plan.lock"
    write_plan(rollout.plan(str(config_file(hub_config))), lock)
    (hub_cache.root / "models--rollout-tests--tiny-llama" / "refs" / "main").unlink()
    with pytest.raises(LockfileError) as caught:
        read_plan(lock)
    (issue,) = caught.value.issues
    assert issue.path == "model.hub"
    assert f"{HUB_ID} at revision 'main' is not in the Hugging Face cache" in issue.message
    assert "any more (planned: commit aaaaaaaa…)" in issue.message


def test_generate_model_option_takes_a_hub_id(hub_cache):
    assert model_source(HUB_ID) == model_source(f"hub:{HUB_ID}")
    assert model_source(HUB_ID)["hub"] == HUB_ID
    assert model_source(f"{HUB_ID}@v2") == {**model_source(HUB_ID), "revision": "v2"}
    for bad in (f"{HUB_ID}@", f"{HUB_ID}@../x", "hub:a/b/c"):
        with pytest.raises(rollout.RolloutError):
            model_source(bad)
    snapshot = hub_cache.add()
    choice = choose_model(config=None, model=HUB_ID)
    assert choice.facts.source == "hub" and choice.facts.location == str(snapshot)
    assert choice.description == HUB_ID


def test_generate_model_option_names_the_fetch_command(hub_cache):
    with pytest.raises(rollout.RolloutError) as caught:
        choose_model(config=None, model="rollout-tests/absent")
    (issue,) = caught.value.issues
    assert issue.path == "--model"
    assert issue.hint == "fetch it first: hf download rollout-tests/absent --revision main"


def test_planning_and_checking_a_hub_model_stay_torch_free(config_file, hub_config, hub_cache):
    hub_cache.add()
    path = config_file(hub_config)
    script = textwrap.dedent(f"""
        import sys
        from rollout import plan
        from rollout.planner.lockfile import stale_reasons
        assert not stale_reasons(plan({str(path)!r}))
        print("torch" in sys.modules)
    """)
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "False"
