"""`rollout serve` against malformed and hostile requests, over real sockets on the tiny model.

Every answer is OpenAI's error JSON (correct Content-Type and Content-Length) with a 4xx, or one
of the standard library's protocol refusals (501 unknown method, 505 HTTP version); it comes
promptly; nothing hangs, nothing prints a traceback, and the server stays up. Each class of bad
request is tried over many cases: hypothesis fuzzes every documented request field with random
JSON and the request line with random bytes; tables cover HTTP/0.9, garbage request lines,
methods, Content-Length lies and trickles, and oversized lines and headers. Raw sockets carry a
timeout, so a test can fail but never hang."""

from __future__ import annotations

import http.client
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout.serve.loading import load_served, resolve_source
from rollout.serve.protocol import Defaults
from rollout.serve.server import MAX_BODY_BYTES, OpenAIServer

MODEL = "tiny-llama"
WAIT_S = 30.0
BODY_TIMEOUT_S = 0.5
IDLE_TIMEOUT_S = 2.0
CONTEXT = 64
"""The context the fuzzed server announces: no request it takes costs more than 4 prompts x
16 samples x 64 tokens."""
ROUTES = {"/v1/models": "GET", "/v1/completions": "POST", "/v1/chat/completions": "POST"}


@pytest.fixture(scope="module")
def server(rollout_cache):
    import torch

    # `rollout serve` sets OMP_WAIT_POLICY=PASSIVE before torch loads, which a test cannot: one
    # thread keeps OpenMP's spinning workers from starving the connection threads (8x slower).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    source = resolve_source(config=None, model=f"builtin:{MODEL}", checkpoint=None, name=None)
    source = replace(source, defaults=Defaults(max_tokens=4))
    served = load_served(source, device="cpu", dtype="auto", seed=0, max_batch_size=8)
    served.info = replace(served.info, context_length=CONTEXT)
    running = OpenAIServer(
        ("127.0.0.1", 0),
        served,
        api_key=None,
        body_timeout_s=BODY_TIMEOUT_S,
        idle_timeout_s=IDLE_TIMEOUT_S,
    )
    thread = threading.Thread(target=running.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    yield running
    running.stop()
    thread.join(WAIT_S)
    torch.set_num_threads(threads)


@pytest.fixture
def no_traceback(capfd):
    """Whatever the server's threads write to stderr during the test holds no traceback."""
    yield
    assert "Traceback" not in capfd.readouterr().err


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes
    seconds: float

    def error(self) -> dict:
        """The OpenAI error object, checked for its shape and its framing."""
        assert self.headers["content-type"] == "application/json"
        assert int(self.headers["content-length"]) == len(self.body)
        error = json.loads(self.body)["error"]
        assert isinstance(error["message"], str) and error["message"]
        assert isinstance(error["type"], str)
        assert set(error) == {"message", "type", "param", "code"}
        return error


def exchange(
    address, data: bytes, *, shut: bool = False, head: bool = False, trickle: float = 0.0
) -> Answer:
    """Send raw bytes on a fresh connection and read one answer (status line, headers, then
    Content-Length bytes). `shut`: close our side after sending; `trickle`: send the bytes one
    at a time, this many seconds apart, until the answer comes."""
    started = time.monotonic()
    with socket.create_connection(address[:2], timeout=WAIT_S) as connection:
        if trickle:
            feeder = threading.Thread(target=_trickle, args=(connection, data, trickle))
            feeder.start()
        else:
            try:
                connection.sendall(data)
                if shut:
                    connection.shutdown(socket.SHUT_WR)
            except OSError:
                pass  # the server answered and closed before taking it all: read that answer
        response = http.client.HTTPResponse(connection, method="HEAD" if head else "GET")
        response.begin()  # raises on anything but an HTTP/1.x status line
        body = response.read()
        headers = {name.lower(): value for name, value in response.getheaders()}
        answer = Answer(response.status, headers, body, time.monotonic() - started)
    if trickle:
        feeder.join(WAIT_S)
    return answer


def _trickle(connection: socket.socket, data: bytes, gap: float) -> None:
    for at in range(len(data)):
        try:
            connection.send(data[at : at + 1])
        except OSError:
            return  # answered and closed
        time.sleep(gap)


def post(path: str, body: bytes, *, length: int | None = None, extra: str = "") -> bytes:
    size = len(body) if length is None else length
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {size}\r\n{extra}\r\n"
    return head.encode() + body


def with_length(value: bytes) -> bytes:
    """A POST of `{}` whose Content-Length header says `value`."""
    return b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: " + value + b"\r\n\r\n{}"


def completion(**fields) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "hi", **fields}).encode()


def still_serving(server) -> None:
    # Not half-closed: a client that closes its side while it waits has gone, for the server.
    answer = exchange(server.server_address, post("/v1/completions", completion(max_tokens=2)))
    assert answer.status == 200, answer.body


# --- the request line and the headers ------------------------------------------------------------

PROTOCOL_CASES = {
    "http-0.9-get": (b"GET /v1/models\r\n", {505}),
    "http-0.9-post": (b"POST /v1/completions\r\n", {505}),
    "http-0.9-unknown-path": (b"GET /\r\n", {505}),
    "one-word": (b"garbage\r\n\r\n", {400}),
    "binary": (b"\x00\x01\xff\xfe\x80\r\n\r\n", {400}),
    "four-words": (b"GET /v1/models HTTP/1.1 extra\r\n\r\n", {400}),
    "bad-version": (b"GET /v1/models HTTP/x.y\r\n\r\n", {400}),
    "version-without-slash": (b"GET /v1/models HTTP1.1\r\n\r\n", {400}),
    "three-part-version": (b"GET /v1/models HTTP/1.1.1\r\n\r\n", {400}),
    "long-version": (b"GET /v1/models HTTP/1." + b"1" * 40 + b"\r\n\r\n", {400}),
    "http-2": (b"GET /v1/models HTTP/2.0\r\n\r\n", {505}),
    "http-3": (b"GET /v1/models HTTP/3.0\r\n\r\n", {505}),
    "request-line-over-64k": (b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n", {414}),
    "header-over-64k": (b"GET /v1/models HTTP/1.1\r\nX: " + b"a" * 70_000 + b"\r\n\r\n", {431}),
    "101-headers": (b"GET /v1/models HTTP/1.1\r\n" + b"X-A: b\r\n" * 101 + b"\r\n", {431}),
    "unknown-method": (b"BREW /v1/models HTTP/1.1\r\nHost: x\r\n\r\n", {501}),
    "lowercase-method": (b"get /v1/models HTTP/1.1\r\nHost: x\r\n\r\n", {501}),
    "symbol-method": (b"G@T /v1/models HTTP/1.1\r\nHost: x\r\n\r\n", {501}),
    "unknown-method-with-body": (b"FOO" + post("/v1/completions", completion())[4:], {501}),
    "length-not-a-number": (with_length(b"abc"), {400}),
    "length-negative": (with_length(b"-1"), {400}),
    "length-float": (with_length(b"2.0"), {400}),
    "length-plus": (with_length(b"+2"), {400}),
    "length-hex": (with_length(b"0x2"), {400}),
    "length-unicode-digits": (with_length(b"\xb2"), {400}),
    "length-list": (with_length(b"2, 2"), {400}),
    "length-twice-differing": (post("/v1/completions", b"{}", extra="Content-Length: 3\r\n"), {400}),
    "length-5000-digits": (with_length(b"9" * 5000), {413}),
    "length-over-the-cap": (with_length(str(MAX_BODY_BYTES + 1).encode()), {413}),
    "chunked": (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", {411}),
    "not-json": (post("/v1/completions", b"{not json"), {400}),
    "nested-100k-deep": (post("/v1/completions", b"[" * 100_000), {400}),
    "integer-of-5000-digits": (post("/v1/completions", b'{"seed": ' + b"9" * 5000 + b"}"), {400}),
    "not-utf-8": (post("/v1/completions", b'{"model": "\xff\xfe"}'), {400}),
    "nan-body": (post("/v1/completions", b"NaN"), {400}),
    "empty-body": (post("/v1/completions", b""), {400}),
    "unknown-path": (b"GET /v2/anything HTTP/1.1\r\nHost: x\r\n\r\n", {404}),
    "absolute-url": (b"GET http://x/v1/models HTTP/1.1\r\nHost: x\r\n\r\n", {404}),
}  # fmt: skip


@pytest.mark.parametrize(("data", "expected"), PROTOCOL_CASES.values(), ids=list(PROTOCOL_CASES))
def test_protocol_errors_get_json_promptly(server, no_traceback, data, expected):
    answer = exchange(server.server_address, data, shut=True)
    assert answer.status in expected, answer.body
    answer.error()
    assert answer.seconds < 5


METHOD_CASES = [
    (method, path)
    for method in ("GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "TRACE", "CONNECT")
    for path in [*ROUTES, "/v1/nothing", "/"]
    if ROUTES.get(path) != method
]


@pytest.mark.parametrize(("method", "path"), METHOD_CASES)
def test_a_known_path_with_another_method_is_405_and_an_unknown_path_404(
    server, no_traceback, method, path
):
    data = f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{{}}".encode()
    answer = exchange(server.server_address, data, shut=True, head=method == "HEAD")
    if path in ROUTES:
        assert answer.status == 405 and answer.headers["allow"] == ROUTES[path]
    else:
        assert answer.status == 404
    if method == "HEAD":  # the headers of the error, no body
        assert answer.body == b"" and answer.headers["content-type"] == "application/json"
        assert int(answer.headers["content-length"]) > 0
    else:
        answer.error()


FUZZ = settings(
    deadline=None,
    database=None,
    derandomize=True,  # the same cases on every run: a failure here is a regression, not luck
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
RANDOM_LINES = 200


def test_random_request_lines_get_an_answer_never_a_hang(server, no_traceback):
    tried = []

    @settings(FUZZ, max_examples=RANDOM_LINES)
    @given(line=st.binary(min_size=1, max_size=120).filter(lambda line: line.split()))
    def one(line: bytes) -> None:
        tried.append(line)
        answer = exchange(server.server_address, line + b"\r\n\r\n", shut=True)
        if answer.status != 200:  # the bytes can spell a real request
            assert 400 <= answer.status < 600
            answer.error()

    one()
    assert len(tried) >= RANDOM_LINES
    still_serving(server)


# --- bodies that lie about their length ----------------------------------------------------------

SHORT_BODIES = [(10, 2), (1000, 999), (MAX_BODY_BYTES, 100), (100, 0), (3, 1)]


@pytest.mark.parametrize(("announced", "sent"), SHORT_BODIES)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/nothing"])
def test_a_body_shorter_than_its_content_length_gets_408_then_400_at_eof(
    server, no_traceback, announced, sent, path
):
    data = post(path, b"{" * sent, length=announced)
    stalled = exchange(server.server_address, data)
    assert stalled.status == 408 and stalled.error()["code"] == "request_timeout"
    assert stalled.seconds < BODY_TIMEOUT_S + 5
    ended = exchange(server.server_address, data, shut=True)
    assert ended.status == 400 and "ended after" in ended.error()["message"]


def test_a_trickling_body_gets_408_at_its_deadline(server, no_traceback):
    body = completion(prompt="x" * 200)
    answer = exchange(server.server_address, post("/v1/completions", body), trickle=0.02)
    assert answer.status == 408 and answer.seconds < BODY_TIMEOUT_S + 5
    still_serving(server)


@pytest.mark.parametrize("sent", [b"", b"GET /v1/mo", b"GET /v1/models HTTP/1.1\r\nHost: x\r\n"])
def test_a_connection_without_a_whole_request_is_closed_after_the_idle_timeout(server, sent):
    started = time.monotonic()
    with socket.create_connection(server.server_address[:2], timeout=WAIT_S) as connection:
        connection.sendall(sent)
        assert connection.recv(1) == b""  # closed, without an answer
    assert IDLE_TIMEOUT_S - 0.5 < time.monotonic() - started < IDLE_TIMEOUT_S + 5


# --- every documented field, fuzzed ---------------------------------------------------------------

JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=8,
)
EDGE_NUMBERS = st.sampled_from(
    [0, -1, 1, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63), -(2**63) - 1, 10**30,
     -(10**30), 10**300, 0.5, 1.0, 2.0, -0.0, 1e-300, 1e308, -1e308, math.inf, -math.inf, math.nan]
)  # fmt: skip
NEAR_ZERO = st.sampled_from([5e-324, 1e-300, 1e-40, 1e-8])
"""Valid numbers that are hard on the engine's arithmetic (logits / temperature)."""
TEXT = st.text(max_size=12)
ROLES = ["system", "user", "assistant", "tool", "developer"]


def messages(role: st.SearchStrategy, text: st.SearchStrategy) -> st.SearchStrategy:
    parts = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}), max_size=3)
    message = st.fixed_dictionaries({"role": role, "content": text | parts})
    return st.lists(message, min_size=1, max_size=4)


# field -> (a valid value, a value that may be anything). Each body breaks a few fields at most,
# so that most of it is valid and the broken ones are what the server has to refuse.
COMMON = {
    "max_tokens": (st.integers(1, 8), EDGE_NUMBERS | JSON_VALUES),
    "temperature": (st.floats(0, 2) | NEAR_ZERO, EDGE_NUMBERS | JSON_VALUES),
    "top_p": (st.floats(0.01, 1) | NEAR_ZERO, EDGE_NUMBERS | JSON_VALUES),
    "top_k": (st.integers(0, 1000), EDGE_NUMBERS | JSON_VALUES),
    "n": (st.integers(1, 4), EDGE_NUMBERS | JSON_VALUES),
    "stop": (TEXT.filter(bool) | st.lists(TEXT.filter(bool), max_size=4), TEXT | JSON_VALUES),
    "stream": (st.booleans(), EDGE_NUMBERS | JSON_VALUES),
    "stream_options": (
        st.fixed_dictionaries({"include_usage": st.booleans()}),
        st.dictionaries(st.just("include_usage"), JSON_VALUES) | JSON_VALUES,
    ),
    "seed": (st.integers(-(2**63), 2**63 - 1), st.integers() | EDGE_NUMBERS | JSON_VALUES),
    "model": (st.just(MODEL), JSON_VALUES),
}
FIELDS = {
    "/v1/completions": {
        **COMMON,
        "prompt": (
            st.sampled_from(["hi", "Once upon"])
            | st.lists(TEXT.filter(str.strip), min_size=1, max_size=4)
            | st.lists(st.integers(0, 500), min_size=1, max_size=8),
            st.lists(st.integers(-1, 10**6), max_size=8)
            | st.lists(st.lists(st.integers(0, 600), max_size=4), max_size=4)
            | st.lists(TEXT, max_size=4)
            | JSON_VALUES,
        ),
        "logprobs": (st.integers(0, 5), EDGE_NUMBERS | JSON_VALUES),
    },
    "/v1/chat/completions": {
        **COMMON,
        "messages": (
            messages(st.sampled_from(ROLES), TEXT),
            messages(TEXT | JSON_VALUES, TEXT | JSON_VALUES) | JSON_VALUES,
        ),
        "max_completion_tokens": (st.integers(1, 8), EDGE_NUMBERS | JSON_VALUES),
        "logprobs": (st.booleans(), EDGE_NUMBERS | JSON_VALUES),
        "top_logprobs": (st.integers(0, 20), EDGE_NUMBERS | JSON_VALUES),
    },
}
REQUIRED = {"model", "prompt", "messages"}


def request_body(data: st.DataObject, path: str) -> dict:
    """A body for `path`: up to three fields broken (anything at all), the rest valid or left
    out (the required ones are always there, valid or broken)."""
    fields = FIELDS[path]
    broken = data.draw(st.sets(st.sampled_from(sorted(fields)), max_size=3), label="broken")
    body = {}
    for name in sorted(fields):
        valid, anything = fields[name]
        if name in broken:
            body[name] = data.draw(anything, label=name)
        elif name in REQUIRED or data.draw(st.booleans(), label=f"{name} given"):
            body[name] = data.draw(valid, label=name)
    return body


FUZZED_BODIES = 300


def test_any_json_in_any_documented_field_gets_200_or_a_4xx_in_openais_shape(server, no_traceback):
    statuses: list[int] = []

    @settings(FUZZ, max_examples=FUZZED_BODIES)
    @given(data=st.data())
    def one(data: st.DataObject) -> None:
        path = data.draw(st.sampled_from(sorted(FIELDS)), label="path")
        body = json.dumps(request_body(data, path))  # NaN and Infinity as Python writes them
        connection = http.client.HTTPConnection(*server.server_address[:2], timeout=WAIT_S)
        try:
            connection.request("POST", path, body=body)
            response = connection.getresponse()
            raw = response.read()
        finally:
            connection.close()
        status, kind = response.status, response.getheader("Content-Type")
        statuses.append(status)
        assert status == 200 or 400 <= status < 500, raw[:500]
        if status != 200:
            headers = {"content-type": kind, "content-length": response.getheader("Content-Length")}
            Answer(status, headers, raw, 0.0).error()
        elif kind == "text/event-stream":
            events = [line for line in raw.decode().split("\n") if line]
            assert events[-1] == "data: [DONE]" and b"server_error" not in raw
        else:
            assert json.loads(raw)["choices"]

    one()
    assert len(statuses) >= FUZZED_BODIES
    assert statuses.count(200) > FUZZED_BODIES // 20  # the fuzz reaches the engine too
    still_serving(server)


@pytest.mark.parametrize("chars", [CONTEXT * 32 + 1, 1 << 20, MAX_BODY_BYTES - 200])
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_a_huge_prompt_is_refused_before_it_is_tokenized(server, no_traceback, chars, route):
    info, tokenized = server.model.info, []

    def counting(encode):
        return lambda value: tokenized.append(value) or encode(value)

    server.model.info = replace(
        info, encode=counting(info.encode), chat_encode=counting(info.chat_encode)
    )
    try:
        text = "x" * chars
        if route == "/v1/completions":
            body = completion(prompt=text)
        else:
            body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": text}]})
        answer = exchange(
            server.server_address,
            post(route, body.encode() if isinstance(body, str) else body),
            shut=True,
        )
        assert answer.status == 400 and answer.error()["code"] == "context_length_exceeded"
        assert tokenized == [] and answer.seconds < 5
    finally:
        server.model.info = info


# --- the real command -----------------------------------------------------------------------------


def test_the_cli_server_answers_every_class_without_a_traceback(rollout_cache, tmp_path):
    """`rollout serve` in its own process, its stderr kept: the protocol table, the numeric
    classes and a body shorter than its Content-Length (408 after the default body timeout,
    running meanwhile), then SIGTERM. Its stderr holds no traceback."""
    from rollout.serve.wire import BODY_TIMEOUT_S as DEFAULT_BODY_TIMEOUT_S

    stderr = tmp_path / "stderr.txt"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with stderr.open("w") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "rollout", "serve", "--model", f"builtin:{MODEL}", "--port", "0"],
            stdout=subprocess.PIPE, stderr=sink, text=True, env=env,
        )  # fmt: skip
    try:
        line = ""
        while "serving" not in line:
            line = process.stdout.readline()
            assert line, stderr.read_text()
        host, port = (
            line.split(" at ")[1].split()[0].removeprefix("http://").split("/")[0].split(":")
        )
        address = (host, int(port))
        stalled: list[Answer] = []
        waiting = threading.Thread(
            target=lambda: stalled.append(
                exchange(address, post("/v1/completions", b"{", length=50))
            )
        )
        waiting.start()
        for data, expected in PROTOCOL_CASES.values():
            assert exchange(address, data, shut=True).status in expected
        for field in ("seed", "n", "max_tokens", "top_k", "temperature", "top_p", "logprobs"):
            for value in (2**64, -(2**63) - 1, 10**30, math.inf, math.nan, 2.5):
                answer = exchange(
                    address, post("/v1/completions", completion(**{field: value})), shut=True
                )
                assert answer.status == 400 and answer.error()["param"] == field
        waiting.join(WAIT_S)
        assert stalled[0].status == 408 and stalled[0].seconds < DEFAULT_BODY_TIMEOUT_S + 10
        assert exchange(address, post("/v1/completions", completion(max_tokens=2))).status == 200
        process.send_signal(signal.SIGTERM)
        assert process.wait(WAIT_S) == 0
    finally:
        if process.poll() is None:
            process.kill()
    assert "Traceback" not in stderr.read_text(), stderr.read_text()
