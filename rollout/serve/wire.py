"""The HTTP/1.1 layer under the OpenAI routes, on uvicorn's h11 protocol: every answer in OpenAI's
JSON error shape, bodies read against a deadline, connections closed the way HTTP asks.

uvicorn answers a request h11 cannot parse with a plain-text 400 itself, before any route sees
it. JsonH11Protocol answers OpenAI's error JSON instead, always after an HTTP/1.1 status line, with
the status the failure calls for: 505 for an HTTP/0.9 request line (`GET /v1/models`, no
version), 414 for a request line over MAX_LINE, 431 for a head over MAX_HEAD, 400 otherwise. The
routes refuse what h11 lets through but the standard library refused (server.py): a version other
than HTTP/1.x (505), a method no standard names (501), a header line over MAX_LINE or more than
MAX_HEADERS headers (431).

A client may half-close its connection after sending a request: it still gets the answer (the
transport stays open for writing). A request whose body is cut short that way gets 400; one
waiting for generation counts as abandoned (server.py cancels it). A connection the server
closes with bytes still coming in (a refused oversized body) is closed lingeringly: write side
first, then what arrives is read and dropped for LINGER_S, so the client's TCP stack does not
reset the answer away.

A body is read against a deadline: a client whose Content-Length promises more bytes than it
sends gets 408 once the body stalls for body_timeout_s, and a trickling one once body_timeout_s
plus MIN_BODY_RATE's allowance for its size has gone.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from http import HTTPStatus
from typing import Any

import h11
from starlette.responses import Response
from uvicorn.protocols.http.h11_impl import H11Protocol

from rollout.serve.protocol import ApiError

MAX_BODY_BYTES = 8 << 20
BODY_TIMEOUT_S = 10.0
"""Longest a request body may stall (no byte arriving) before the request is answered 408."""
MIN_BODY_RATE = 64 << 10
"""Bytes per second a slow client is granted for its body on top of BODY_TIMEOUT_S."""
MAX_LINE = 65536
"""The longest request line or header line (414 or 431 beyond), as the standard library's."""
MAX_HEADERS = 100
"""Most header lines (431 beyond), as the standard library's."""
MAX_HEAD = MAX_LINE
"""The longest request head h11 takes (431 beyond; 414 if its request line alone is that long)."""
MAX_LENGTH_DIGITS = 12
"""A longer Content-Length is over MAX_BODY_BYTES whatever it says."""
TOKEN = re.compile(rb"[-!#$%&'*+.^_`|~0-9A-Za-z]+")
"""A method, as RFC 9110 spells one."""
VERSION = re.compile(rb"HTTP/[0-9]\.[0-9]")
LINGER_S = 2.0
"""How long a closed connection still reads (and drops) what its client sends."""
PEER_EOF = "rollout.peer_eof"
"""Set in a request's scope once its client has half-closed the connection."""
CONNECTION = "rollout.connection"
"""The JsonH11Protocol serving a request, in its scope: server.py abandons a request through it."""


def json_response(
    status: int, body: dict[str, Any], *, headers: dict[str, str] | None = None, close: bool = False
) -> Response:
    """A JSON answer (json.dumps as the old server wrote it: a -inf log-prob stays -Infinity);
    `close` ends the connection after it."""
    extra = dict(headers or {})
    if close:
        extra["Connection"] = "close"
    data = json.dumps(body).encode()
    return Response(data, status_code=status, media_type="application/json", headers=extra)


def error_response(error: ApiError, *, close: bool = False, **headers: str) -> Response:
    return json_response(error.status, error.body(), headers=headers or None, close=close)


def error_type(status: int) -> str:
    # 501 and 505 are the client's doing here (a method or version nobody serves).
    if status in (HTTPStatus.NOT_IMPLEMENTED, HTTPStatus.HTTP_VERSION_NOT_SUPPORTED):
        return "invalid_request_error"
    return "server_error" if status >= 500 else "invalid_request_error"


class _LingeringTransport:
    """The connection's transport, whose close() lingers (see the module docstring); everything
    else is the transport's own."""

    def __init__(self, transport: asyncio.Transport, protocol: JsonH11Protocol) -> None:
        self._transport = transport
        self._protocol = protocol

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def close(self) -> None:
        transport = self._transport
        if transport.is_closing() or self._protocol.lingering:
            return
        between_requests = self._protocol.conn.their_state in (h11.IDLE, h11.DONE)
        if between_requests or self._protocol.peer_eof or not transport.can_write_eof():
            # Nothing unread is coming (or TLS, which cannot half-close): close at once.
            transport.close()
            return
        self._protocol.lingering = True
        transport.write_eof()  # sent after what is buffered
        transport.resume_reading()
        asyncio.get_running_loop().call_later(LINGER_S, transport.close)


class JsonH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with JSON protocol errors, half-closes and lingering closes."""

    lingering = False
    peer_eof = False
    _head = b""
    """The start of the request head being received, for send_400_response to diagnose."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._parse_error: h11.RemoteProtocolError | None = None
        next_event = self.conn.next_event

        def remember_errors() -> Any:  # send_400_response is not told what went wrong
            try:
                return next_event()
            except h11.RemoteProtocolError as error:
                self._parse_error = error
                raise

        self.conn.next_event = remember_errors  # type: ignore[method-assign]

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.transport = _LingeringTransport(transport, self)  # type: ignore[assignment]
        self._await_head()

    def data_received(self, data: bytes) -> None:
        if self.lingering:
            return  # closing: what still comes is dropped
        if self.conn.their_state is h11.IDLE and len(self._head) <= MAX_HEAD:
            self._head += data[: MAX_HEAD + 1 - len(self._head)]
        super().data_received(data)
        self._await_head()

    def _await_head(self) -> None:
        """uvicorn times a connection out only between requests: this one waiting for its first
        request, or with half a head, is closed after the same idle timeout."""
        if (
            self.conn.their_state is h11.IDLE
            and self.timeout_keep_alive_task is None
            and not self.transport.is_closing()
            and not self.lingering
        ):
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's head was parsed
            self._head = b""
        if self.cycle is not None:  # a request just parsed has not run yet: tell it who serves it
            self.cycle.scope.setdefault(CONNECTION, self)  # type: ignore[misc]

    def eof_received(self) -> bool:  # type: ignore[override]
        """The client half-closed: answer what it asked, then close."""
        self.peer_eof = True
        if self.lingering:
            self.transport.close()
            return False
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            if self.conn.their_state is h11.IDLE and not self.conn.trailing_data[0]:
                self.transport.close()  # idle: nothing to answer
                return False
            self.conn.receive_data(b"")  # a partial head: h11 refuses it (send_400_response)
            self.handle_events()
            return True
        cycle.scope[PEER_EOF] = True  # type: ignore[typeddict-unknown-key]
        cycle.message_event.set()  # a body reader or a waiter looks at it
        return True

    def on_response_complete(self) -> None:
        if self.peer_eof and not self.transport.is_closing():
            self.server_state.total_requests += 1
            self.transport.close()
            return
        super().on_response_complete()

    def abandon(self) -> None:
        """Close the connection without an answer (its client went away)."""
        if self.cycle is not None:
            self.cycle.disconnected = True
        self._transport_close_now()

    def _transport_close_now(self) -> None:
        transport = self.transport
        inner = transport._transport if isinstance(transport, _LingeringTransport) else transport
        inner.close()

    def send_400_response(self, msg: str) -> None:
        status, message = self._refusal()
        error = ApiError(status, message, type=error_type(status))
        data = json.dumps(error.body()).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(data)).encode()),
            (b"connection", b"close"),
        ]
        # A failed h11 connection sends nothing more: write the answer with a fresh one.
        writer = h11.Connection(h11.SERVER)
        writer.receive_data(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        writer.next_event()
        phrase = HTTPStatus(status).phrase.encode()
        self.transport.write(
            writer.send(h11.Response(status_code=status, headers=headers, reason=phrase))
        )
        self.transport.write(writer.send(h11.Data(data=data)))
        self.transport.close()

    def _refusal(self) -> tuple[int, str]:
        """The status and message for a head h11 could not parse, as the standard library's
        server answered it: the request line first, then the headers."""
        head = self._head.lstrip(b"\r\n")
        self._head = b""
        line, newline, rest = head.partition(b"\n")
        if len(line) > MAX_LINE or (not newline and len(line) >= MAX_HEAD):
            return 414, "the request line is too long"
        words = line.split()
        if len(words) == 2:
            return 505, "HTTP/0.9 requests are not served: send HTTP/1.1"
        if len(words) == 3:
            method, _, version = words
            if TOKEN.fullmatch(method) is None:
                return 501, f"Unsupported method ({method[:20].decode('iso-8859-1')!r})"
            if VERSION.fullmatch(version) is not None and version[5:6] != b"1":
                return 505, "only HTTP/1.x is served"
        headers = rest.split(b"\n")
        too_long = len(head) >= MAX_HEAD  # what was kept of it stops at MAX_HEAD
        if too_long or len(headers) > MAX_HEADERS + 2 or any(len(h) > MAX_LINE for h in headers):
            return 431, "the request headers are too large"
        if getattr(self._parse_error, "error_status_hint", 400) == 431:
            return 431, "the request head is too large"
        for header in headers:
            name, _, value = header.partition(b":")
            digits = value.strip()
            long = digits.isdigit() and len(digits) > MAX_LENGTH_DIGITS
            if name.strip().lower() == b"content-length" and long:
                return 413, f"the body is over {MAX_BODY_BYTES} bytes"
        shown = line.decode("iso-8859-1").rstrip("\r")[:100]
        return 400, f"Bad request syntax ({shown!r}): {self._parse_error or 'malformed'}"


async def read_body(
    scope: dict[str, Any], receive: Any, headers: dict[str, str], body_timeout_s: float
) -> bytes:
    """The request body its Content-Length announces; ApiError (the connection closes after the
    answer: `error.close`) if it is chunked, too big, cut short or too slow."""
    if "transfer-encoding" in headers:
        raise _closing(ApiError(411, "send the body with a Content-Length, not chunked"))
    value = headers.get("content-length", "0")  # h11 has checked it is one integer
    if len(value) > MAX_LENGTH_DIGITS or int(value) > MAX_BODY_BYTES:
        raise _closing(ApiError(413, f"the body is over {MAX_BODY_BYTES} bytes"))
    length = int(value)
    if not length:
        return b""
    deadline = time.monotonic() + body_timeout_s + length / MIN_BODY_RATE
    parts, received = [], 0
    while received < length:
        left = deadline - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError
            message = await asyncio.wait_for(receive(), min(left, body_timeout_s))
        except (TimeoutError, asyncio.TimeoutError):
            raise _closing(
                ApiError(
                    408,
                    f"the body stopped after {received} of the {length} bytes its "
                    "Content-Length announced",
                    code="request_timeout",
                )
            ) from None
        part = message.get("body", b"") if message["type"] == "http.request" else b""
        parts.append(part)
        received += len(part)
        # All the client sent came before its half-close (PEER_EOF): nothing more will.
        if received < length and (scope.get(PEER_EOF) or message["type"] != "http.request"):
            raise _closing(
                ApiError(
                    400,
                    f"the body ended after {received} of the {length} bytes its Content-Length "
                    "announced",
                )
            )
    return b"".join(parts)


def _closing(error: ApiError) -> ApiError:
    error.close = True  # type: ignore[attr-defined]
    return error
