"""The sidecar protocol: the messages a plugin process and its host exchange, and their framing.

Framing: each message is a 4-byte big-endian unsigned length, then that many bytes of UTF-8
JSON (one object). It travels over the child's stdin (host -> child) and stdout (child -> host).
Pipes rather than a Unix socket: no path to create, clean up or protect with permissions, the
child notices its host is gone by EOF on stdin, and any language reads stdin. JSON rather than
pickle, always: a message never executes anything when read, and any language can speak it.

The exchange (version PROTOCOL_VERSION):

    child -> host   Hello      once, when the plugin is loaded and ready
    host  -> child  Call       {id, method, args, kwargs}: one batch
    child -> host   Result     {id, value}   or   Error {id, kind, message}
    host  -> child  Ping       {id}          child -> host Pong {id}
    host  -> child  Shutdown                 the child exits (EOF on stdin means the same)

Calls are answered in order, one at a time. An id is the host's: it resubmits a call under the
same id after restarting a crashed or hung child, so a plugin may treat calls as idempotent by id.
A part of a batch asked again to find the sample it fails on (rollout.harness.isolate) is a new
call with an id of its own.
schemas/sidecar-protocol.schema.json is generated from these models (`rollout schema`), so a
sidecar can be written in any language against it alone.
"""

from __future__ import annotations

import json
import struct
from typing import Annotated, Any, BinaryIO, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

PROTOCOL = "rollout-sidecar"
PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
"""Largest frame either side accepts: a length beyond it means the stream is not our framing."""

_LENGTH = struct.Struct(">I")


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Parameter(_Message):
    """One parameter of the plugin's callable, so the host can call it as it would in-process."""

    name: str
    kind: Literal[
        "POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD", "VAR_POSITIONAL", "KEYWORD_ONLY", "VAR_KEYWORD"
    ]
    has_default: bool = False


class Hello(_Message):
    """The child's first message, once its plugin is loaded: who it is and what it speaks."""

    type: Literal["hello"] = "hello"
    protocol: Literal["rollout-sidecar"] = Field(description="Always 'rollout-sidecar'.")
    version: int = Field(
        description="The protocol version the child speaks; the host refuses others."
    )
    plugin: str = Field(
        description="What the child loaded: its reference, e.g. './rewards.py:score'."
    )
    pid: int = Field(description="The child's process id.")
    parameters: list[Parameter] | None = Field(
        default=None,
        description="The callable's parameters, in order; None: unknown (the host then passes "
        "every keyword, as to a function that takes **kwargs).",
    )
    attributes: dict[str, bool] = Field(
        default_factory=dict,
        description="Boolean attributes the plugin declares (e.g. runs_model_code).",
    )


class Call(_Message):
    """One batched call: the plugin's `method` (``__call__`` for the callable itself)."""

    type: Literal["call"] = "call"
    id: int = Field(description="The host's id for this call; a resubmitted call keeps it.")
    method: str = Field(
        default="__call__", description="'__call__', or a method of the plugin object."
    )
    args: list[Any] = Field(default_factory=list, description="Positional arguments (JSON values).")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments.")


class Result(_Message):
    type: Literal["result"] = "result"
    id: int
    value: Any = Field(
        description="What the call returned, as JSON (a reward: one number per completion)."
    )


class Error(_Message):
    """The call failed inside the child (the child itself stays up)."""

    type: Literal["error"] = "error"
    id: int
    kind: str = Field(description="The exception's type name, e.g. 'ValueError'.")
    message: str = Field(description="What went wrong, with the plugin's file:line when known.")


class Ping(_Message):
    type: Literal["ping"] = "ping"
    id: int


class Pong(_Message):
    type: Literal["pong"] = "pong"
    id: int


class Shutdown(_Message):
    type: Literal["shutdown"] = "shutdown"


ToChild = Annotated[Call | Ping | Shutdown, Field(discriminator="type")]
FromChild = Annotated[Hello | Result | Error | Pong, Field(discriminator="type")]
TO_CHILD: TypeAdapter[Any] = TypeAdapter(ToChild)
FROM_CHILD: TypeAdapter[Any] = TypeAdapter(FromChild)


class FramingError(Exception):
    """The bytes on the channel are not length-prefixed JSON messages of this protocol."""


def encode(message: _Message) -> bytes:
    body = message.model_dump_json().encode("utf-8")
    return _LENGTH.pack(len(body)) + body


def write_message(stream: BinaryIO, message: _Message) -> None:
    stream.write(encode(message))
    stream.flush()


def read_frame(stream: BinaryIO) -> Any | None:
    """The next frame's JSON value; None at a clean end of stream (before a frame starts)."""
    head = _read_exactly(stream, _LENGTH.size)
    if head is None:
        return None
    (length,) = _LENGTH.unpack(head)
    if length > MAX_MESSAGE_BYTES:
        raise FramingError(
            f"a frame announces {length} bytes (the limit is {MAX_MESSAGE_BYTES}); its first "
            f"bytes were {head!r}: something other than the protocol wrote to the channel"
        )
    body = _read_exactly(stream, length)
    if body is None:
        raise FramingError(f"the stream ended inside a {length}-byte frame")
    try:
        return json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise FramingError(f"a frame is not UTF-8 JSON ({error}): {body[:60]!r}") from None


def _read_exactly(stream: BinaryIO, size: int) -> bytes | None:
    chunks, got = [], 0
    while got < size:
        chunk = stream.read(size - got)
        if not chunk:
            if got:
                raise FramingError(f"the stream ended after {got} of {size} bytes")
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def protocol_schema() -> dict[str, Any]:
    """The JSON Schema of both directions, for schemas/sidecar-protocol.schema.json."""
    schema = TypeAdapter(ToChild | FromChild).json_schema()
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": f"{PROTOCOL} protocol, version {PROTOCOL_VERSION}",
        "description": (
            "Messages between a rollout host and a sidecar plugin process. Framing: a 4-byte "
            "big-endian length, then that many bytes of UTF-8 JSON, over the child's stdin "
            "(host to child: call, ping, shutdown) and stdout (child to host: hello first, then "
            "result, error, pong). The child's stderr is free for logs."
        ),
        "x-protocol-version": PROTOCOL_VERSION,
        **schema,
    }
