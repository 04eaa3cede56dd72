"""The HTTP/1.1 layer under the OpenAI routes: every answer in OpenAI's JSON error shape, bodies
read against a deadline.

BaseHTTPRequestHandler answers some requests itself before any route sees them: a garbage
request line (400), an unknown method (501), a request line over 64 KiB (414), too many or too
long headers (431), HTTP/2 or later (505). It writes an HTML page for those, and for a request
that never said its version (HTTP/0.9) no status line at all. JsonHandler.send_error writes
OpenAI's error JSON instead, always after an HTTP/1.x status line, and closes the connection.
An HTTP/0.9 request line (`GET /v1/models`, no version) is refused at once with 505: the standard
library would otherwise wait for headers the client never sends. Empty lines before a request line
are skipped (RFC 9112), and a line of nothing but characters Python counts as spaces (\x1c,
\x85) gets 400: the standard library closes the connection unanswered on both.

A body is read against a deadline: a client whose Content-Length promises more bytes than it
sends gets 408 once the body stalls for body_timeout_s, not a 500 after the idle timeout, and a
trickling one gets 408 once body_timeout_s plus MIN_BODY_RATE's allowance for its size has gone.
"""

from __future__ import annotations

import json
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Any

from rollout.serve.protocol import ApiError

MAX_BODY_BYTES = 8 << 20
BODY_TIMEOUT_S = 10.0
"""Longest a request body may stall (no byte arriving) before the request is answered 408."""
MIN_BODY_RATE = 64 << 10
"""Bytes per second a slow client is granted for its body on top of BODY_TIMEOUT_S."""
MAX_LINE = 65536
"""The longest request line, as the standard library reads it (414 beyond)."""
MAX_BLANK_LINES = 16
"""Empty lines skipped before a request line (RFC 9112 asks for at least one: some clients send
a CRLF after a body); more than that is a client that sends nothing else."""
MAX_LENGTH_DIGITS = 12
"""A longer Content-Length is over MAX_BODY_BYTES whatever it says (int() of it is not free)."""


class JsonHandler(BaseHTTPRequestHandler):
    """BaseHTTPRequestHandler whose every answer is JSON; routes are the subclass's business."""

    protocol_version = "HTTP/1.1"
    server_version = "rollout"
    body_timeout_s = BODY_TIMEOUT_S

    def parse_request(self) -> bool:
        for _ in range(MAX_BLANK_LINES):  # RFC 9112 2.2: skip empty lines before the request
            if self.raw_requestline not in (b"\r\n", b"\n"):
                break
            self.raw_requestline = self.rfile.readline(MAX_LINE + 1)
        if len(self.raw_requestline) > MAX_LINE:
            self.requestline, self.request_version, self.command = "", "", None
            self.send_error(414)
            return False
        line = str(self.raw_requestline, "iso-8859-1")
        words = line.split()  # as the standard library splits it: \x1c or \xa0 separate words too
        if len(words) == 2 or (not words and line.strip("\r\n")):
            self.requestline = line.rstrip("\r\n")
            self.command, self.request_version = None, "HTTP/0.9"
            if words:  # `GET /path`: HTTP/0.9, whose client sends no headers to wait for
                self.send_error(505, "HTTP/0.9 requests are not served: send HTTP/1.1")
            else:  # only characters Python counts as spaces: not the blank line RFC 9112 skips
                self.send_error(400, f"Bad request syntax ({self.requestline[:100]!r})")
            return False
        return super().parse_request()

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The standard library's own refusals (bad request line, 414, 431, 501, 505) as OpenAI's
        error JSON; the connection closes after it, as the standard library's does."""
        if getattr(self, "request_version", "HTTP/0.9") == "HTTP/0.9":
            self.request_version = "HTTP/1.0"  # else send_response writes no status line
        try:
            status = HTTPStatus(code)
        except ValueError:
            status = HTTPStatus.BAD_REQUEST
        # 501 and 505 are the client's doing here (a method or version nobody serves).
        error = ApiError(status, message or status.phrase, type=_error_type(status))
        self.close_connection = True
        self.send_json(status, error.body())

    def send_json(
        self, status: int, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> None:
        data = json.dumps(body).encode()
        self.send_response(status, HTTPStatus(status).phrase)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if self.close_connection or self._closing():
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        if self.command == "HEAD":
            return  # a HEAD answer has the headers a GET would get, and no body
        try:
            self.wfile.write(data)
        except OSError:
            self.close_connection = True

    def _closing(self) -> bool:
        """Whether the server is shutting down (connections then close after their answer)."""
        return False

    def read_body(self) -> bytes:
        """The request body its Content-Length announces; ApiError (and the connection closes
        after the answer) if it is chunked, malformed, too big, cut short or too slow."""
        if "Transfer-Encoding" in self.headers:
            self.close_connection = True
            raise ApiError(411, "send the body with a Content-Length, not chunked")
        length = self._content_length()
        return self._receive(length) if length else b""

    def _content_length(self) -> int:
        values = {value.strip() for value in self.headers.get_all("Content-Length") or []}
        if not values:
            return 0
        value = values.pop()  # two different ones: the set holds another, refused below
        if values or not (value.isascii() and value.isdigit()):
            self.close_connection = True
            raise ApiError(400, "Content-Length must be one non-negative integer")
        if len(value) > MAX_LENGTH_DIGITS or int(value) > MAX_BODY_BYTES:
            self.close_connection = True
            raise ApiError(413, f"the body is over {MAX_BODY_BYTES} bytes")
        return int(value)

    def _receive(self, length: int) -> bytes:
        deadline = time.monotonic() + self.body_timeout_s + length / MIN_BODY_RATE
        parts, received = [], 0
        try:
            while received < length:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                self.connection.settimeout(min(left, self.body_timeout_s))
                part = self.rfile.read1(length - received)
                if not part:
                    self.close_connection = True
                    raise ApiError(
                        400,
                        f"the body ended after {received} of the {length} bytes its "
                        "Content-Length announced",
                    )
                parts.append(part)
                received += len(part)
        except TimeoutError:
            self.close_connection = True  # the rest may still come: the stream is out of step
            raise ApiError(
                408,
                f"the body stopped after {received} of the {length} bytes its Content-Length "
                "announced",
                code="request_timeout",
            ) from None
        finally:
            self.connection.settimeout(self.timeout)  # the answer is written under the idle one
        return b"".join(parts)


def _error_type(status: HTTPStatus) -> str:
    if status in (HTTPStatus.NOT_IMPLEMENTED, HTTPStatus.HTTP_VERSION_NOT_SUPPORTED):
        return "invalid_request_error"
    return "server_error" if status >= 500 else "invalid_request_error"
