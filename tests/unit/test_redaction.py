"""No secret in any message: a canary password in every place a command takes a URL, a DSN or
a path never reaches its output; the run store's log lines are redacted on the way in."""

from __future__ import annotations

import json
import logging
import time

import pytest
from typer.testing import CliRunner

from rollout.cli.app import app
from rollout.errors import Issue, RolloutError
from rollout.redact import redact_text

CANARY = "Canary5ecret"
runner = CliRunner()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("env:postgresql://u:pw@h/db", "env:postgresql://u:***@h/db"),
        ("https://user:s3cr3t@host/model", "https://user:***@host/model"),
        ("redis://:pw@h:6379/0", "redis://:***@h:6379/0"),
        ("s3://AKIA:sec/ret@bucket/prefix", "s3://AKIA:***@bucket/prefix"),
        ("host=h password=abc dbname=x", "host=h password=*** dbname=x"),
        ("password='a b' host=x", "password=*** host=x"),
        (
            "https://b/k?X-Amz-Signature=abc&X-Amz-Date=1",
            "https://b/k?X-Amz-Signature=***&X-Amz-Date=1",
        ),
        ("Authorization: Bearer sk-abcdefghijkl", "Authorization: Bearer ***"),
        ("serving at http://127.0.0.1:8000/v1", "serving at http://127.0.0.1:8000/v1"),
        ("max_new_tokens=8 tokens=3", "max_new_tokens=8 tokens=3"),
    ],
)
def test_redact_text(text, expected):
    assert redact_text(text) == expected


def test_every_issue_is_redacted_on_construction():
    issue = Issue(
        f"https://u:{CANARY}@h/p",
        f"cannot read postgresql://u:{CANARY}@h/db",
        value={"dsn": [f"password={CANARY}"]},
        hint=f"Bearer {CANARY}xyz",
    )
    error = RolloutError([issue], source=f"s3://k:{CANARY}@b/run.toml")
    everything = json.dumps(error.to_dict()) + str(error) + repr(issue)
    assert CANARY not in everything


def _write_config(tmp_path, base_config, **model):
    import tomli_w

    (tmp_path / "train.jsonl").write_text('{"prompt": "1+1?", "answer": "2"}\n')
    config = {**base_config, "model": model or base_config["model"]}
    path = tmp_path / "run.toml"
    path.write_bytes(tomli_w.dumps(config).encode())
    return path


def commands(tmp_path, base_config):
    """Every command's error paths that take a URL, DSN or path from the user."""
    url = f"https://user:{CANARY}@example.invalid/model"
    dsn = f"postgresql://user:{CANARY}@db.invalid/rollout"
    plain = _write_config(tmp_path, base_config)
    (tmp_path / "remote").mkdir()
    remote = _write_config(tmp_path / "remote", base_config, path=url)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    return {
        "validate --set dsn": [
            "validate",
            "--config",
            str(plain),
            "--set",
            f"storage.postgres_dsn=env:{dsn}",
        ],
        "validate --set path": ["validate", "--config", str(plain), "--set", f"model.path={url}"],
        "validate remote model": ["validate", "--config", str(remote)],
        "plan remote model": ["plan", "--config", str(remote), "-o", str(tmp_path / "p.lock")],
        "plan --set artifacts": [
            "plan",
            "--config",
            str(plain),
            "--set",
            f"storage.artifacts={url}",
        ],
        "plan --set store": ["plan", "--config", str(plain), "--set", f"storage.sqlite_path={dsn}"],
        "run --plan url": ["run", "--plan", url],
        "run --config url": ["run", "--config", url],
        "plan show url": ["plan", "show", url],
        "runs list --store": ["runs", "list", "--store", dsn],
        "runs show --store": ["runs", "show", "some-run", "--store", dsn],
        "runs cancel --store": ["runs", "cancel", "some-run", "--store", dsn],
        "logs tail --store": ["logs", "tail", "some-run", "--store", dsn],
        "runs show url id": ["runs", "show", url],
        "serve --model": ["serve", "--model", url],
        "serve --checkpoint": ["serve", "--checkpoint", url],
        "serve --api-key": [
            "serve",
            "--model",
            "builtin:tiny-llama",
            "--api-key",
            f"postgres://u:{CANARY}@x",
        ],
        "generate --model": [
            "generate",
            "--model",
            url,
            "--prompts",
            str(prompts),
            "--out",
            str(tmp_path / "o.jsonl"),
        ],
        "generate --prompts": [
            "generate",
            "--model",
            "builtin:tiny-llama",
            "--prompts",
            url,
            "--out",
            str(tmp_path / "o.jsonl"),
        ],
        "generate --out": [
            "generate",
            "--model",
            "builtin:tiny-llama",
            "--prompts",
            str(prompts),
            "--out",
            f"s3://k:{CANARY}@bucket/out.jsonl",
        ],
    }


def test_no_command_prints_a_password_it_was_given(tmp_path, base_config, monkeypatch):
    monkeypatch.setenv("ROLLOUT_STORE", f"sqlite:{tmp_path / 'store.db'}")
    monkeypatch.chdir(tmp_path)  # a URL taken for a local path lands here, not in the repo
    leaked = {}
    for name, args in commands(tmp_path, base_config).items():
        result = runner.invoke(app, args)
        output = result.output + (str(result.exception) if result.exception else "")
        assert result.exit_code != 0, f"{name}: {result.output}"
        if CANARY in output:
            leaked[name] = output
    assert not leaked, f"a password reached the output: {leaked}"


def test_log_lines_reach_the_run_store_redacted(tmp_path):
    from rollout.storage import open_store
    from rollout.storage.writer import BackgroundWriter, StoreLogHandler

    location = f"sqlite:{tmp_path / 'rollout.db'}"
    with open_store(location) as store:
        store.create_run("r", name="t", plan_sha256="x", plan_path="p", run_dir="d")
    logger = logging.getLogger("rollout.test_redaction")
    with BackgroundWriter(lambda: open_store(location)) as writer:
        handler = StoreLogHandler(writer, "r", 0, "learner")
        logger.addHandler(handler)
        try:
            logger.warning("retrying s3://AKIA:%s@bucket/ckpt", CANARY)
        finally:
            logger.removeHandler(handler)
    time.sleep(0.01)
    with open_store(location) as store:
        (line,) = store.logs("r")
    assert CANARY not in line.message and "s3://AKIA:***@bucket/ckpt" in line.message
