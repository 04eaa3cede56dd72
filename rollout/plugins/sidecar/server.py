"""The child side: ``python -m rollout.plugins.sidecar.server REF --identity JSON [--build JSON]``.

Loads the plugin the planner resolved (rollout.plugins.resolve.load_plugin, by its recorded
identity), says Hello, then answers Calls one at a time until Shutdown or EOF on stdin (the host
closed the pipe or died). The protocol owns fds 0 and 1: before the plugin is imported they are
moved aside, and fd 1 and sys.stdout point at stderr, so a plugin's print (or a C library's
write to fd 1) lands in the log instead of corrupting the channel.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any, BinaryIO

from pydantic import ValidationError

from rollout.plugins.identity import PluginIdentity
from rollout.plugins.sidecar.protocol import (
    PROTOCOL,
    PROTOCOL_VERSION,
    TO_CHILD,
    Call,
    Error,
    Hello,
    Parameter,
    Ping,
    Pong,
    Result,
    read_frame,
    write_message,
)

_ATTRIBUTES = ("runs_model_code",)


def take_channel() -> tuple[BinaryIO, BinaryIO]:
    """The protocol's (input, output), with fds 0 and 1 given to /dev/null and stderr."""
    channel_in = os.fdopen(os.dup(0), "rb")
    channel_out = os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    sys.stdin = open(os.devnull)  # noqa: SIM115 - lives as long as the process
    return channel_in, channel_out


def serve(plugin: Any, ref: str, channel_in: BinaryIO, channel_out: BinaryIO) -> None:
    """Hello, then answer until Shutdown or EOF."""
    hello = Hello(
        protocol=PROTOCOL,
        version=PROTOCOL_VERSION,
        plugin=ref,
        pid=os.getpid(),
        parameters=_parameters(plugin),
        attributes={name: getattr(plugin, name, False) is True for name in _ATTRIBUTES},
    )
    write_message(channel_out, hello)
    while True:
        raw = read_frame(channel_in)
        if raw is None:
            return
        try:
            message = TO_CHILD.validate_python(raw)
        except ValidationError as error:
            print(f"sidecar {ref}: ignoring a message that is not the protocol's: {error}")
            continue
        if isinstance(message, Call):
            write_message(channel_out, _answer(plugin, message))
        elif isinstance(message, Ping):
            write_message(channel_out, Pong(id=message.id))
        else:  # Shutdown
            return


def _answer(plugin: Any, call: Call) -> Result | Error:
    try:
        target: Callable[..., Any] = (
            plugin if call.method == "__call__" else getattr(plugin, call.method)
        )
        value = _plain(target(*call.args, **call.kwargs))
        json.dumps(value, allow_nan=False)  # refuse here what the channel cannot carry
        return Result(id=call.id, value=value)
    except Exception as error:  # the plugin's failure is an answer; the child stays up
        return Error(id=call.id, kind=type(error).__name__, message=_describe(error))


def _plain(value: Any) -> Any:
    """Dataclass instances (an environment's StepResults) as dicts, inside lists too."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def _describe(error: Exception) -> str:
    """The message and the innermost frame outside this module (the plugin's, usually)."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename != __file__]
    where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    if isinstance(error, ValueError) and "Out of range float" in str(error):
        return f"the result holds nan or inf, which JSON cannot carry: {error}"
    return f"{error}{where}"


def _parameters(plugin: Any) -> list[Parameter] | None:
    try:
        signature = inspect.signature(plugin)
    except (TypeError, ValueError):
        return None
    return [
        Parameter(name=p.name, kind=p.kind.name, has_default=p.default is not p.empty)
        for p in signature.parameters.values()
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rollout.plugins.sidecar.server")
    parser.add_argument("ref", help="the plugin reference, as in the config")
    parser.add_argument(
        "--identity", required=True, help="the PluginIdentity the plan recorded, as JSON"
    )
    parser.add_argument(
        "--build",
        help="keyword arguments (JSON) to call the loaded callable with once: the object it "
        "returns is served (an environment built from its options)",
    )
    args = parser.parse_args(argv)
    channel_in, channel_out = take_channel()
    from rollout.errors import RolloutError
    from rollout.plugins.resolve import load_plugin

    try:
        plugin = load_plugin(PluginIdentity.model_validate_json(args.identity))
    except RolloutError as error:  # the host shows our stderr's last lines: no traceback
        print(f"cannot load the plugin: {error}", file=sys.stderr)
        sys.exit(2)
    if args.build is not None:
        plugin = plugin(**json.loads(args.build))
    serve(plugin, args.ref, channel_in, channel_out)


if __name__ == "__main__":
    main()
