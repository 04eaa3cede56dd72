"""`rollout serve --dev --engine ./eng.py:make` and `rollout plugins reload`, as a plugin author
uses them: a real server process on the tiny model, the plugin file edited, reloaded, and the
next completion made by the new code; a server without --dev refuses to reload."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

WAIT_S = 60

ENGINE = """
import dataclasses

from rollout.engines.plugin import WrappedEngine

MARK = "{mark}"


class Marking(WrappedEngine):
    def generate(self, prompts, params):
        return [
            dataclasses.replace(c, text=MARK + c.text)
            for c in self.inner.generate(prompts, params)
        ]


def make(spec):
    return Marking(spec.hf_engine())
"""


def environment(cwd: Path) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "COLUMNS": "200"}


@contextmanager
def serving(cwd: Path, *args: str) -> Iterator[str]:
    """A `rollout serve` process on the tiny model; its URL (with /v1) while it runs."""
    process = subprocess.Popen(
        [sys.executable, "-m", "rollout", "serve", "--model", "builtin:tiny-llama", "--port", "0",
         *args],
        cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environment(cwd),
    )  # fmt: skip
    try:
        line, seen = "", []
        while "serving" not in line:
            line = process.stdout.readline()
            seen.append(line)
            assert line, "the server exited before serving:\n" + "".join(seen)
        yield line.split(" at ")[1].split()[0]
    finally:
        process.terminate()
        process.wait(WAIT_S)


def complete(url: str) -> str:
    body = {"model": "tiny-llama", "prompt": "1+1=", "max_tokens": 4, "temperature": 0}
    request = urllib.request.Request(
        url + "/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=WAIT_S) as response:
        return json.loads(response.read())["choices"][0]["text"]


def reload(cwd: Path, url: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rollout", "plugins", "reload", "--url", url, "--format", "json"],
        cwd=cwd, env=environment(cwd), capture_output=True, text=True, timeout=WAIT_S,
    )  # fmt: skip


def test_reload_swaps_in_the_edited_engine_plugin(tmp_path, rollout_cache):
    engine = tmp_path / "eng.py"
    engine.write_text(ENGINE.format(mark="[v1]"))
    with serving(tmp_path, "--dev", "--engine", "./eng.py:make") as url:
        assert complete(url).startswith("[v1]")

        engine.write_text(ENGINE.format(mark="[v2]"))
        reloaded = reload(tmp_path, url)
        assert reloaded.returncode == 0, reloaded.stdout + reloaded.stderr
        answer = json.loads(reloaded.stdout)
        assert answer["engine"] == "./eng.py:make"
        assert answer["old"]["sha256"] != answer["new"]["sha256"]
        assert answer["new"]["path"] == str(engine.resolve())
        assert complete(url).startswith("[v2]")

        # new code that does not import leaves the old engine serving: one error, exit 2
        engine.write_text("def make(spec):\n    return (\n")
        broken = reload(tmp_path, url)
        assert broken.returncode == 2
        assert "did not reload" in broken.stdout + broken.stderr
        assert "syntax error" in broken.stdout + broken.stderr
        assert complete(url).startswith("[v2]")


def test_a_server_without_dev_refuses_to_reload(tmp_path, rollout_cache):
    with serving(tmp_path) as url:
        refused = reload(tmp_path, url.removesuffix("/v1"))
        assert refused.returncode == 2
        assert "start rollout serve with --dev" in refused.stdout + refused.stderr
        assert "Traceback" not in refused.stdout + refused.stderr
        assert complete(url)  # and it serves on
