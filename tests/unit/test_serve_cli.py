"""The command lines of `rollout serve` and `rollout generate`, short of loading a model: one
--device default (auto) resolved in one place, and a credential in a --model, --checkpoint or
--config URL never printed, whichever way the command fails."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rollout.cli.app import app
from rollout.errors import Issue, RolloutError
from rollout.inference.batch import resolve_device

runner = CliRunner()
CANARY = "CANARY7f3a"


@pytest.fixture
def cuda(monkeypatch):
    """Pretend torch sees `count` GPUs: cuda(2)."""
    import torch

    def pretend(count: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)

    return pretend


@pytest.mark.parametrize(
    ("gpus", "wanted", "device"),
    [(0, "auto", "cpu"), (1, "auto", "cuda"), (0, "cpu", "cpu"), (2, "cpu", "cpu"),
     (1, "cuda", "cuda"), (2, "cuda:1", "cuda:1")],
)  # fmt: skip
def test_auto_is_cuda_when_torch_sees_a_gpu_else_cpu(cuda, gpus, wanted, device):
    cuda(gpus)
    assert resolve_device(wanted) == device


@pytest.mark.parametrize(
    ("gpus", "wanted", "message"),
    [(0, "cuda", "sees no CUDA GPU"), (0, "cuda:0", "sees no CUDA GPU"),
     (2, "cuda:2", "cuda:0 to cuda:1"), (1, "tpu", "auto, cpu, cuda or cuda:N"),
     (1, "cuda:x", "auto, cpu, cuda or cuda:N"), (1, "", "auto, cpu, cuda or cuda:N")],
)  # fmt: skip
def test_a_device_torch_cannot_use_is_an_issue_at_the_flag(cuda, gpus, wanted, message):
    cuda(gpus)
    with pytest.raises(RolloutError) as caught:
        resolve_device(wanted)
    (issue,) = caught.value.issues
    assert issue.path == "--device" and message in issue.message


@pytest.mark.parametrize("gpus", [0, 1])
def test_serve_defaults_to_auto_as_generate_does(cuda, monkeypatch, gpus):
    cuda(gpus)
    seen = {}

    def load_served(source, **options):
        seen.update(options)
        raise RolloutError(Issue("--model", "stop here"))

    monkeypatch.setattr("rollout.inference.serve_source.load_served", load_served)
    result = runner.invoke(app, ["serve", "--model", "builtin:tiny-llama"])
    assert result.exit_code == 2 and "stop here" in result.output
    assert seen["device"] == ("cuda" if gpus else "cpu")
    for command in ("serve", "generate"):
        help_text = runner.invoke(app, [command, "--help"], env={"COLUMNS": "200"}).output
        line = next(line for line in help_text.splitlines() if "--device" in line)
        assert "[default: auto]" in line


URLS = [
    f"https://user:{CANARY}@host/x",
    f"s3://key:{CANARY}@bucket/model",
    f"https://host/x?token={CANARY}",
    f"https://host/x?X-Amz-Signature={CANARY}&a=b",
    f"gs://user:{CANARY}@bucket/m.gguf",
]


def commands(url: str) -> dict[str, list[str]]:
    generate = ["generate", "--prompts", "p.jsonl", "--out", "o.jsonl"]
    return {
        "serve --model": ["serve", "--model", url],
        "serve --checkpoint": ["serve", "--checkpoint", url],
        "serve --config": ["serve", "--config", url + ".toml"],
        "generate --model": [*generate, "--model", url],
        "generate --checkpoint": [*generate, "--checkpoint", url],
        "generate --config": [*generate, "--config", url + ".toml"],
    }


CASES = [(url, name, argv) for url in URLS for name, argv in commands(url).items()]


@pytest.mark.parametrize(
    ("url", "name", "argv"),
    CASES,
    ids=[f"{n} {u.split(':')[0]}-{i}" for i, (u, n, _) in enumerate(CASES)],
)
def test_a_credential_in_a_url_is_never_printed(tmp_path, monkeypatch, url, name, argv):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ROLLOUT_CACHE", str(tmp_path / "cache"))
    Path("p.jsonl").write_text(json.dumps({"prompt": "hi"}) + "\n")
    result = runner.invoke(app, argv)
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert CANARY not in result.output
    assert "Traceback" not in result.output and "error" in result.output


def test_a_url_models_served_name_leaves_its_query_out():
    from rollout.inference.serve_source import resolve_source

    url = f"https://host/models/m.gguf?X-Amz-Signature={CANARY}&token={CANARY}"
    assert resolve_source(config=None, model=url, checkpoint=None, name=None).name == "m.gguf"


@pytest.mark.parametrize(
    ("endpoint", "says"),
    [
        ("collector:4318", "must be an http:// or https:// URL"),
        ("http://user:pw@collector:4318/v1/traces", "no password in it"),
    ],
)
def test_a_bad_otlp_endpoint_is_one_clear_error(endpoint, says):
    result = runner.invoke(
        app, ["serve", "--model", "builtin:tiny-llama", "--otlp-endpoint", endpoint]
    )
    assert result.exit_code == 2, result.output
    assert "--otlp-endpoint" in result.output and says in result.output
    assert "Traceback" not in result.output and "pw@" not in result.output


def test_an_otlp_endpoint_without_opentelemetry_names_the_pip_command(monkeypatch):
    from rollout import tracing

    monkeypatch.setattr(tracing, "missing_package", lambda: "opentelemetry.sdk")
    result = runner.invoke(
        app,
        ["serve", "--model", "builtin:tiny-llama", "--otlp-endpoint", "http://127.0.0.1:4318"],
        env={"COLUMNS": "200"},
    )
    assert result.exit_code == 2, result.output
    assert "pip install 'rollout[otel]'" in result.output
