"""`rollout plan` with a Postgres run store: it checks the server answers and the tables can be
created there, changes nothing, and the plan keeps only the DSN's reference."""

from __future__ import annotations

import os

import pytest

from rollout.errors import PlanError, RolloutError
from rollout.planner.builder import build_plan
from rollout.planner.definition import HardwareFacts
from rollout.planner.lockfile import write_plan
from rollout.storage import open_store
from tests.conftest import STORE_DSN_ENV

LAPTOP = HardwareFacts(
    platform="test", cpu_count=8, memory_bytes=16 * 1024**3, memory_available_bytes=12 * 1024**3
)
POSTGRES = {"backend": "postgres", "postgres_dsn": f"env:{STORE_DSN_ENV}"}


def plan_with(config_file, base_config, storage=POSTGRES):
    return build_plan(config_file({**base_config, "storage": storage}), hardware=LAPTOP)


def refusal(config_file, base_config, storage=POSTGRES):
    with pytest.raises(PlanError) as caught:
        plan_with(config_file, base_config, storage)
    (issue,) = [i for i in caught.value.issues if i.path == "storage.postgres_dsn"]
    return issue


def test_a_plan_keeps_only_the_reference_and_creates_nothing(
    postgres_location, config_file, base_config, tmp_path
):
    plan = plan_with(config_file, base_config)
    assert plan.derived.store == postgres_location == f"postgres:env:{STORE_DSN_ENV}"
    write_plan(plan, tmp_path / "plan.lock")
    lock = (tmp_path / "plan.lock").read_text()
    schema = os.environ[STORE_DSN_ENV].split("search_path=")[1].split("'")[0]
    assert schema not in lock and "host=" not in lock
    with pytest.raises(RolloutError, match="no run store here"):
        open_store(postgres_location, create=False)  # the probe's CREATE was rolled back


def test_a_server_that_does_not_answer_is_refused_by_name_not_password(
    config_file, base_config, monkeypatch
):
    monkeypatch.setenv(STORE_DSN_ENV, "host=127.0.0.1 port=9 dbname=runs user=bob password=hunter2")
    issue = refusal(config_file, base_config)
    assert "does not answer (database runs on 127.0.0.1:9)" in issue.message
    assert "hunter2" not in f"{issue.message} {issue.hint} {issue.value}"


def test_a_schema_rollout_cannot_create_in_is_refused(
    postgres_server, config_file, base_config, monkeypatch
):
    monkeypatch.setenv(STORE_DSN_ENV, f"{postgres_server} options='-csearch_path=no_such_schema'")
    issue = refusal(config_file, base_config)
    assert "rollout cannot create its tables in database" in issue.message
    assert "no schema has been selected" in issue.message
    assert "search_path" in issue.hint


@pytest.mark.parametrize(
    ("dsn", "message"),
    [
        (None, "environment variable ROLLOUT_PG_DSN is not set or empty"),
        ("host=h password=hunter2 nonsense", "not a libpq connection string"),
    ],
)
def test_a_dsn_that_cannot_be_read_is_refused_without_echoing_it(
    dsn, message, config_file, base_config, monkeypatch
):
    if dsn is None:
        monkeypatch.delenv(STORE_DSN_ENV, raising=False)
    else:
        monkeypatch.setenv(STORE_DSN_ENV, dsn)
    issue = refusal(config_file, base_config)
    assert message in issue.message and issue.value == f"env:{STORE_DSN_ENV}"
    assert "hunter2" not in issue.message
