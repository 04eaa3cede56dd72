"""The sidecar protocol from the outside: a sidecar written against the generated JSON Schema
alone (tests/data/sidecar_standalone.py, no rollout) driven through the host, and children that
break the protocol (wrong version, garbage, a stdout flood, never starting), each one clear error
naming the plugin."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import jsonschema
import pytest

from rollout.plugins.sidecar.host import (
    SidecarCallable,
    SidecarError,
    SidecarHost,
    SidecarPluginError,
)
from rollout.plugins.sidecar.protocol import (
    PROTOCOL_VERSION,
    Call,
    Hello,
    Ping,
    Pong,
    Result,
    Shutdown,
)
from rollout.schema import PATHS, artifact_text

ROOT = Path(__file__).resolve().parents[2]
STANDALONE = ROOT / "tests" / "data" / "sidecar_standalone.py"
SCHEMA = ROOT / PATHS["sidecar"]


def standalone(*args: str, name: str = "length") -> SidecarHost:
    return SidecarHost([sys.executable, str(STANDALONE), *args], name=name, start_timeout_s=30)


def test_the_committed_protocol_schema_is_the_generated_one():
    assert SCHEMA.read_text() == artifact_text("sidecar")
    assert json.loads(SCHEMA.read_text())["x-protocol-version"] == PROTOCOL_VERSION


@pytest.mark.parametrize(
    "message",
    [
        Hello(protocol="rollout-sidecar", version=1, plugin="x:y", pid=1, parameters=None),
        Call(id=3, args=[["p"], ["c"]], kwargs={"scale": 2}),
        Result(id=3, value=[1.0]),
        Ping(id=4),
        Pong(id=4),
        Shutdown(),
    ],
)
def test_every_message_validates_against_the_schema(message):
    jsonschema.validate(json.loads(message.model_dump_json()), json.loads(SCHEMA.read_text()))


def test_the_schema_refuses_what_the_protocol_does_not_have():
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"type": "result", "value": [1.0]}, json.loads(SCHEMA.read_text()))


def test_a_sidecar_written_without_rollout_is_called_like_a_function():
    callable_ = SidecarCallable(standalone(), timeout_s=10)
    try:
        assert str(callable_.__signature__) == "(prompts, completions, *, scale=None)"
        assert callable_(["a", "b"], ["xy", "xyz"], scale=2.0) == [4.0, 6.0]
        callable_.host.ping()
        with pytest.raises(SidecarPluginError, match="'length' raised ValueError: scale must"):
            callable_(["a"], ["xy"], scale=-1.0)
    finally:
        callable_.close()


def test_a_crash_resubmits_the_same_call_id(tmp_path):
    log = tmp_path / "ids"
    host = standalone("--log", str(log), "--crash-once", str(tmp_path / "marker"))
    try:
        host.start()
        assert host.call([["a"], ["xyz"]], timeout_s=10) == [3.0]
        assert host.call([["a"], ["xy"]], timeout_s=10) == [2.0]
    finally:
        host.close()
    first, resubmitted, second = log.read_text().split()
    assert first == resubmitted != second
    assert host.restarts == 1


def child(tmp_path: Path, body: str, name: str = "faulty", timeout: float = 10) -> SidecarHost:
    """A host for a child running `body` (after `import os, sys, json, struct, time`)."""
    script = tmp_path / "child.py"
    script.write_text("import os, sys, json, struct, time\n" + textwrap.dedent(body))
    return SidecarHost([sys.executable, str(script)], name=name, start_timeout_s=timeout)


def hello(version: int, **more: int) -> str:
    """Child code saying Hello in `version`, with `more` fields (a future version's)."""
    return textwrap.dedent(f"""
        body = json.dumps({{"type": "hello", "protocol": "rollout-sidecar", "version": {version},
                            "plugin": "x:y", "pid": os.getpid(), **{more!r}}}).encode()
        sys.stdout.buffer.write(struct.pack(">I", len(body)) + body)
        sys.stdout.buffer.flush()
        """)


def start_error(host: SidecarHost) -> str:
    with pytest.raises(SidecarError) as caught:
        host.start()
    host.close()
    return str(caught.value)


def test_a_wrong_protocol_version_is_refused_naming_both_versions(tmp_path):
    message = start_error(child(tmp_path, hello(99, new_field=1) + "time.sleep(60)\n"))
    assert "'faulty'" in message
    assert "version 99" in message and f"version {PROTOCOL_VERSION}" in message


def test_garbage_on_the_channel_is_a_clear_error(tmp_path):
    body = """
        sys.stdout.buffer.write(struct.pack(">I", 5) + b"\\xff\\xfe{{{")
        sys.stdout.buffer.flush()
        time.sleep(60)
        """
    message = start_error(child(tmp_path, body))
    assert "'faulty'" in message and "not UTF-8 JSON" in message


def test_a_stdout_flood_is_a_clear_error(tmp_path):
    body = """
        for _ in range(10000):
            print("loading the judge model, please wait ...", flush=True)
        """
    message = start_error(child(tmp_path, body))
    assert "'faulty'" in message and "not the protocol's framing" in message


def test_garbage_after_the_hello_fails_the_call_after_one_retry(tmp_path):
    body = hello(PROTOCOL_VERSION) + textwrap.dedent("""
            sys.stdin.buffer.read(4)
            print("oops: a stray print on the channel", flush=True)
            time.sleep(60)
            """)
    host = child(tmp_path, body)
    host.start()
    with pytest.raises(SidecarError) as caught:
        host.call([["p"], ["c"]], timeout_s=10, what="a batch of 1 samples")
    host.close()
    message = str(caught.value)
    assert "'faulty' failed on a batch of 1 samples" in message
    assert message.count("not the protocol's framing") == 2


def test_a_child_that_never_says_hello_is_stopped_at_the_start_timeout(tmp_path):
    host = child(tmp_path, "time.sleep(600)\n", timeout=0.5)
    message = start_error(host)
    assert "'faulty'" in message and "did not say hello within 0.5 s" in message


def test_a_child_that_dies_before_its_hello_shows_its_last_words(tmp_path):
    body = """
        print("ModuleNotFoundError: No module named 'judge'", file=sys.stderr)
        sys.exit(3)
        """
    message = start_error(child(tmp_path, body))
    assert "exited with code 3" in message
    assert "No module named 'judge'" in message


def test_a_stderr_flood_is_passed_on_and_quoted_short(tmp_path):
    body = """
        sys.stderr.write("x" * 5_000_000)
        sys.stderr.flush()
        sys.exit(4)
        """
    message = start_error(child(tmp_path, body))
    assert "exited with code 4" in message and "xxx…" in message
    assert len(message) < 3000


def test_an_interpreter_that_does_not_exist_is_a_clear_error(tmp_path):
    host = SidecarHost([str(tmp_path / "no-python")], name="faulty")
    message = start_error(host)
    assert "'faulty'" in message and "cannot start" in message
