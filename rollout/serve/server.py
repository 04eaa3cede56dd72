"""The OpenAI-compatible HTTP server, on the standard library's ThreadingHTTPServer.

One thread per connection parses and checks a request, submits its prompts to the EngineService
(whose single engine thread batches the requests of every connection together) and writes the
answer: one JSON body, or server-sent events (`data: {...}` chunks, then `data: [DONE]`) in a
chunked HTTP/1.1 response, each prompt's chunks sent as its tokens come. A client that goes away has its request cancelled: a failed write
while streaming, a closed socket while waiting. Every bad request gets a 4xx in OpenAI's error
shape and the server carries on; only a bug in the server itself gives a 500.

Every answer is JSON, the standard library's own refusals included (wire.py): a known route
asked with another standard method gets 405, an unknown path 404, an unknown method 501, and a
body read against a deadline (408 when it stalls). Nothing a client sends prints a traceback:
a client that vanished mid-answer is logged at debug level; a traceback on stderr means a bug in
the server (the 500 path).

Security: an API key, when set, is checked on every route (401 otherwise); the CLI binds only a
loopback address without one. With an ssl.SSLContext the listening socket is wrapped and every
connection speaks TLS (its handshake runs in the connection's thread, not the accepting one).
Request bodies are capped at MAX_BODY_BYTES and idle connections time out after IDLE_TIMEOUT_S.
Log lines and error bodies pass through redact_text: a path or header may carry a credential.

stop() is the graceful shutdown: no new connections, idle keep-alive connections closed,
requests in flight answered in full, then the engine thread stopped.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import select
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from typing import Any

from rollout.engines.base import Completion
from rollout.engines.service import (
    EngineService,
    RequestHandle,
    ServiceBusy,
    ServiceClosed,
    merge_events,
)
from rollout.redact import redact_text
from rollout.serve.protocol import ApiError, GenerationRequest, ModelInfo, parse_request, per_prompt
from rollout.serve.recording import EPISODE_ID, CompletionRecorder, RecorderFull
from rollout.serve.responses import (
    OPENAI_FINISH,
    envelope,
    logprobs_body,
    response_id,
    rollout_fields,
    usage,
)
from rollout.serve.wire import BODY_TIMEOUT_S, MAX_BODY_BYTES, JsonHandler

__all__ = ["BODY_TIMEOUT_S", "MAX_BODY_BYTES", "OpenAIServer", "ServedModel"]

log = logging.getLogger("rollout.serve")

IDLE_TIMEOUT_S = 60.0
LINGER_S = 2.0
"""How long a closed connection still reads (and drops) what its client sends: see
OpenAIServer.shutdown_request."""
Record = Callable[[list[int], Completion], None]
"""Records one finished completion of a prompt (a no-op outside an episode)."""
DISCONNECT_POLL_S = 0.1
"""How often a connection waiting for a non-streamed answer checks that its client is there."""


@dataclass
class ServedModel:
    """The model behind the server: its protocol facts and the service that samples it."""

    info: ModelInfo
    service: EngineService
    token_text: Any
    """token id -> its text, for logprobs."""
    created: int = 0


class OpenAIServer(ThreadingHTTPServer):
    """Serves one model; `serve_forever()` in one thread, `stop()` from another."""

    daemon_threads = False  # server_close() joins the connection threads: in-flight requests end
    block_on_close = True
    allow_reuse_address = True
    request_queue_size = 128  # the listen backlog: socketserver's 5 resets a burst of clients

    def __init__(
        self,
        address: tuple[str, int],
        model: ServedModel,
        *,
        api_key: str | None,
        tls: ssl.SSLContext | None = None,
        body_timeout_s: float = BODY_TIMEOUT_S,
        recorder: CompletionRecorder | None = None,
    ):
        """`tls`: serve HTTPS with this server-side context (rollout.serve.loading.tls_context).
        `body_timeout_s`: how long a request body may stall before the request gets 408.
        `recorder`: serve the episode routes (`/episodes/{id}/v1/...`) and record there every
        completion served (recording.py); without one those routes are 404."""
        self.model = model
        self.recorder = recorder
        self.api_key = api_key
        self.body_timeout_s = body_timeout_s
        self.stopping = False
        self._connections: dict[_Handler, bool] = {}  # handler -> busy with a request
        self._connections_lock = threading.Lock()
        super().__init__(address, _Handler)
        self.https = tls is not None
        if tls is not None:
            # Accepted sockets inherit do_handshake_on_connect: False keeps a slow or hostile
            # client's handshake out of the accepting thread (_Handler.handle does it).
            self.socket = tls.wrap_socket(
                self.socket, server_side=True, do_handshake_on_connect=False
            )

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"{'https' if self.https else 'http'}://{host}:{port}/v1"

    def episode_url(self, episode_id: str) -> str:
        """The base URL an agent of this episode is given: the same API, recorded."""
        if EPISODE_ID.fullmatch(episode_id) is None:
            raise ValueError(f"not an episode id: {episode_id!r} (letters, digits, . _ -)")
        return self.url.removesuffix("/v1") + f"/episodes/{episode_id}/v1"

    def stop(self) -> None:
        """Graceful shutdown (from any thread but serve_forever's): stop accepting, close idle
        connections, let requests in flight finish, stop the engine."""
        self.stopping = True
        self.shutdown()
        with self._connections_lock:
            idle = [handler for handler, busy in self._connections.items() if not busy]
        for handler in idle:
            handler.close_socket()
        self.server_close()  # joins the connection threads
        self.model.service.close()

    def shutdown_request(self, request: Any) -> None:
        """Close a connection the way HTTP servers must (a lingering close): stop sending, then
        read and drop whatever the client still sends, until it closes or LINGER_S pass. Closed
        with unread bytes, the socket would send a TCP reset, and a client still sending a body
        the server refused (413, 408) would lose the answer to it."""
        try:
            request.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        else:
            deadline = time.monotonic() + LINGER_S
            with contextlib.suppress(OSError, ValueError):
                while (left := deadline - time.monotonic()) > 0:
                    request.settimeout(left)
                    if not request.recv(1 << 16):
                        break
        self.close_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """What escaped a connection's handler: socketserver prints its traceback to stderr. A
        client that went away (reset, broken pipe, timeout, TLS alert) is routine; anything else
        is a bug, and says so."""
        error = sys.exc_info()[1]
        if isinstance(error, OSError):
            log.debug("connection from %s ended: %r", client_address[0], error)
        else:
            log.exception("connection from %s failed", client_address[0])

    def _track(self, handler: _Handler, busy: bool | None) -> None:
        with self._connections_lock:
            if busy is None:
                self._connections.pop(handler, None)
            else:
                self._connections[handler] = busy


ROUTES = {
    "/v1/models": "GET",
    "/v1/completions": "POST",
    "/v1/chat/completions": "POST",
}
"""path -> the one method it takes."""
EPISODE_PREFIX = "/episodes/"
"""`/episodes/{episode_id}` + a route: the route, its completions recorded for the episode."""


class _Handler(JsonHandler):
    timeout = IDLE_TIMEOUT_S
    server: OpenAIServer

    def setup(self) -> None:
        super().setup()
        self.body_timeout_s = self.server.body_timeout_s
        self.server._track(self, False)

    def finish(self) -> None:
        self.server._track(self, None)
        super().finish()

    def close_socket(self) -> None:
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)

    def handle(self) -> None:
        if isinstance(self.connection, ssl.SSLSocket):
            try:
                self.connection.do_handshake()  # under the connection's idle timeout
            except (OSError, ValueError) as error:  # ssl.SSLError is an OSError
                log.debug("TLS handshake with %s failed: %s", self.address_string(), error)
                self.close_connection = True
                return
        super().handle()

    def parse_request(self) -> bool:
        self.server._track(self, True)  # a request line arrived: no longer idle
        return super().parse_request()

    def handle_one_request(self) -> None:
        super().handle_one_request()
        self.server._track(self, False)
        if self.server.stopping:
            self.close_connection = True

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), redact_text(format % args))

    def _closing(self) -> bool:
        return self.server.stopping

    # --- routing -------------------------------------------------------------------------------

    def _route(self) -> None:
        """Every standard method comes here (an unknown one gets 501 from the standard library):
        a known path asked with the wrong one gets 405, not 501."""
        self._dispatch(self.command)

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _route
    do_HEAD = do_OPTIONS = do_TRACE = do_CONNECT = _route

    def _dispatch(self, method: str) -> None:
        try:
            self._check_key()
            path = self.path.split("?", 1)[0].rstrip("/")
            episode, path = self._episode(path)
            wanted = ROUTES.get(path)
            if wanted is None:
                self.read_body()  # keep the connection usable
                raise ApiError(404, f"no route {path[:200]!r}", code="not_found")
            if method != wanted:
                self.read_body()
                self.send_json(
                    405,
                    ApiError(405, f"{path} takes {wanted}, not {method}").body(),
                    headers={"Allow": wanted},
                )
                return
            if path == "/v1/models":
                self._models()
            else:
                self._generate("chat" if path == "/v1/chat/completions" else "completion", episode)
        except ApiError as error:
            self.send_json(error.status, error.body())
        except Exception:
            log.exception("internal error on %s %s", method, redact_text(self.path[:200]))
            error = ApiError(500, "internal server error", type="server_error")
            self.send_json(500, error.body())

    def _episode(self, path: str) -> tuple[str | None, str]:
        """(episode id, the route under it) for an episode path, (None, path) otherwise."""
        if not path.startswith(EPISODE_PREFIX):
            return None, path
        episode, _, rest = path[len(EPISODE_PREFIX) :].partition("/")
        if self.server.recorder is None:
            self.read_body()
            raise ApiError(
                404, "episode routes are served only with a completion recorder", code="not_found"
            )
        if EPISODE_ID.fullmatch(episode) is None:
            self.read_body()
            raise ApiError(
                404,
                f"not an episode id: {episode[:200]!r} (1-128 letters, digits, '.', '_', '-')",
                code="not_found",
            )
        return episode, "/" + rest

    def _check_key(self) -> None:
        key = self.server.api_key
        if key is None:
            return
        given = self.headers.get("Authorization", "")
        if not given.startswith("Bearer ") or not hmac.compare_digest(
            given[len("Bearer ") :].encode(), key.encode()
        ):
            self.read_body()
            raise ApiError(
                401,
                "missing or wrong API key: send it as 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )

    def _models(self) -> None:
        model = self.server.model
        self.send_json(
            200,
            {
                "object": "list",
                "data": [
                    {
                        "id": model.info.name,
                        "object": "model",
                        "created": model.created,
                        "owned_by": "rollout",
                        "max_model_len": model.info.context_length,
                    }
                ],
            },
        )

    def _generate(self, kind: str, episode: str | None) -> None:
        body = self.read_body()
        try:
            payload = json.loads(body)
        # ValueError: also an integer over 4300 digits; RecursionError: arrays nested too deep.
        except (ValueError, RecursionError) as error:
            raise ApiError(400, f"the body is not valid JSON: {str(error)[:200]}") from None
        model = self.server.model
        request = parse_request(kind, payload, model.info)  # type: ignore[arg-type]
        record = self._recording(request, episode)
        handles = self._submit(request)
        if request.stream:
            self._stream(request, handles, record)
        else:
            self._answer(request, handles, record)

    def _recording(self, request: GenerationRequest, episode: str | None) -> Record:
        """What records a finished completion of prompt i: the recorder's, for an episode."""
        recorder = self.server.recorder
        if episode is None or recorder is None:
            return lambda prompt, completion: None
        try:
            recorder.check_room()
        except RecorderFull as error:
            raise ApiError(503, str(error), type="server_error", code="unavailable") from None
        return lambda prompt, completion: recorder.record(episode, request.kind, prompt, completion)

    def _submit(self, request: GenerationRequest) -> list[RequestHandle]:
        service = self.server.model.service
        params = [per_prompt(request, index) for index in range(len(request.prompts))]
        try:
            return service.submit_many(request.prompts, params)
        except (ServiceBusy, ServiceClosed) as error:
            raise ApiError(503, str(error), type="server_error", code="unavailable") from None

    # --- answers -------------------------------------------------------------------------------

    def _answer(
        self, request: GenerationRequest, handles: list[RequestHandle], record: Record
    ) -> None:
        for handle in handles:
            while not handle.wait(DISCONNECT_POLL_S):
                if self._client_gone():
                    for other in handles:
                        other.cancel()
                    self.close_connection = True
                    return
        results = [handle.result() for handle in handles]
        for prompt, completions in zip(request.prompts, results, strict=True):
            for completion in completions:
                record(prompt, completion)
        kind, model = request.kind, self.server.model
        body = envelope(kind, response_id(kind), model.info.name, chunk=False)
        choices = []
        for prompt, completions in zip(request.prompts, results, strict=True):
            for completion in completions:
                choice: dict[str, Any] = {"index": len(choices)}
                if kind == "chat":
                    choice["message"] = {"role": "assistant", "content": completion.text}
                else:
                    choice["text"] = completion.text
                choice["finish_reason"] = OPENAI_FINISH[completion.finish_reason]
                choice["logprobs"] = (
                    logprobs_body(
                        kind,
                        completion.token_ids,
                        completion.logprobs,
                        model.token_text,
                        completion.top_logprobs,
                    )
                    if request.logprobs
                    else None
                )
                choice["rollout"] = rollout_fields(prompt, completion)
                choices.append(choice)
        body["choices"] = choices
        body["usage"] = usage(request.prompts, [c for cs in results for c in cs])
        self.send_json(200, body)

    def _stream(
        self, request: GenerationRequest, handles: list[RequestHandle], record: Record
    ) -> None:
        kind, model = request.kind, self.server.model
        ident = response_id(kind)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        completions: list[Completion] = []
        n = request.params.n
        try:
            if kind == "chat":  # one prompt
                for index in range(n):
                    delta = {"role": "assistant", "content": ""}
                    self._event(self._chunk(request, ident, index, delta))
            # Every prompt's tokens as they are sampled: a short completion is not held up
            # behind a long one of an earlier prompt.
            for number, event in merge_events(handles):
                index = number * n + event.sample
                delta = {"content": event.text} if kind == "chat" else event.text
                chunk = self._chunk(request, ident, index, delta)
                choice = chunk["choices"][0]
                if request.logprobs and event.token_ids:
                    choice["logprobs"] = logprobs_body(
                        kind, event.token_ids, event.logprobs, model.token_text, event.top_logprobs
                    )
                if event.completion is not None:
                    completion = event.completion
                    completions.append(completion)
                    record(request.prompts[number], completion)
                    choice["finish_reason"] = OPENAI_FINISH[completion.finish_reason]
                    choice["rollout"] = rollout_fields(request.prompts[number], completion)
                self._event(chunk)
            if request.include_usage:
                chunk = envelope(kind, ident, model.info.name, chunk=True)
                chunk["choices"] = []
                chunk["usage"] = usage(request.prompts, completions)
                self._event(chunk)
            self._event("[DONE]")
            self._write_chunk(b"")
        except OSError:
            for handle in handles:  # the client went away
                handle.cancel()
            self.close_connection = True
        except Exception as error:  # an engine step failed: say so in the stream, then end it
            log.exception("generation failed while streaming")
            failure = ApiError(500, f"generation failed: {error}", type="server_error")
            try:
                self._event(failure.body())
                self._event("[DONE]")
                self._write_chunk(b"")
            except OSError:
                pass
            self.close_connection = True

    def _chunk(
        self, request: GenerationRequest, ident: str, index: int, delta: Any
    ) -> dict[str, Any]:
        chunk = envelope(request.kind, ident, self.server.model.info.name, chunk=True)
        choice: dict[str, Any] = {"index": index}
        if request.kind == "chat":
            choice["delta"] = delta
        else:
            choice["text"] = delta
        choice["logprobs"] = None
        choice["finish_reason"] = None
        chunk["choices"] = [choice]
        return chunk

    # --- wire ----------------------------------------------------------------------------------

    def _event(self, data: dict[str, Any] | str) -> None:
        text = data if isinstance(data, str) else json.dumps(data)
        self._write_chunk(f"data: {text}\n\n".encode())

    def _write_chunk(self, payload: bytes) -> None:
        self.wfile.write(b"%X\r\n%s\r\n" % (len(payload), payload))

    def _client_gone(self) -> bool:
        """Whether the client closed its end (readable, with nothing to read)."""
        try:
            # poll, not select: select() refuses a descriptor past FD_SETSIZE (1024), and with
            # that many connections open every waiting request would count as abandoned.
            poller = select.poll()
            poller.register(self.connection, select.POLLIN)
            if not poller.poll(0):
                return False
            if isinstance(self.connection, ssl.SSLSocket):
                return self._tls_client_gone(self.connection)
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def _tls_client_gone(self, connection: ssl.SSLSocket) -> bool:
        """_client_gone over TLS, which cannot peek: TLS 1.3 encrypts a close_notify like data,
        so only reading tells. A byte of a pipelined next request is lost that way: the
        connection then closes after this answer, and the client sends that request again."""
        connection.settimeout(0)  # a record that has not fully arrived must not block the wait
        try:
            data = connection.recv(1)
        except ssl.SSLWantReadError:
            return False
        finally:
            connection.settimeout(self.timeout)
        if data:
            self.close_connection = True
        return data == b""
