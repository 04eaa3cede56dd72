"""The OpenAI-compatible HTTP server, on the standard library's ThreadingHTTPServer.

One thread per connection parses and checks a request, submits its prompts to the EngineService
(whose single engine thread batches the requests of every connection together) and writes the
answer: one JSON body, or server-sent events (`data: {...}` chunks, then `data: [DONE]`) in a
chunked HTTP/1.1 response, each prompt's chunks sent as its tokens come. A client that goes away has its request cancelled: a failed write
while streaming, a closed socket while waiting. Every bad request gets a 4xx in OpenAI's error
shape and the server carries on; only a bug in the server itself gives a 500.

Security: an API key, when set, is checked on every route (401 otherwise); the CLI binds only a
loopback address without one. With an ssl.SSLContext the listening socket is wrapped and every
connection speaks TLS (its handshake runs in the connection's thread, not the accepting one).
Request bodies are capped at MAX_BODY_BYTES and idle connections time out after IDLE_TIMEOUT_S.

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
import threading
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from rollout.engines.base import Completion
from rollout.engines.service import (
    EngineService,
    RequestHandle,
    ServiceBusy,
    ServiceClosed,
    merge_events,
)
from rollout.serve.protocol import (
    OPENAI_FINISH,
    ApiError,
    GenerationRequest,
    ModelInfo,
    envelope,
    logprobs_body,
    parse_request,
    per_prompt,
    response_id,
    rollout_fields,
    usage,
)

log = logging.getLogger("rollout.serve")

MAX_BODY_BYTES = 8 << 20
IDLE_TIMEOUT_S = 60.0
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
    ):
        """`tls`: serve HTTPS with this server-side context (rollout.serve.loading.tls_context)."""
        self.model = model
        self.api_key = api_key
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

    def _track(self, handler: _Handler, busy: bool | None) -> None:
        with self._connections_lock:
            if busy is None:
                self._connections.pop(handler, None)
            else:
                self._connections[handler] = busy


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "rollout"
    timeout = IDLE_TIMEOUT_S
    server: OpenAIServer

    def setup(self) -> None:
        super().setup()
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
        log.debug("%s " + format, self.address_string(), *args)

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    # --- routing -------------------------------------------------------------------------------

    def _dispatch(self, method: str) -> None:
        try:
            self._check_key()
            path = self.path.split("?", 1)[0].rstrip("/")
            routes = {
                "/v1/models": ("GET", self._models),
                "/v1/completions": ("POST", lambda: self._generate("completion")),
                "/v1/chat/completions": ("POST", lambda: self._generate("chat")),
            }
            if path not in routes:
                self._read_body()  # keep the connection usable
                raise ApiError(404, f"no route {path!r}", code="not_found")
            wanted, route = routes[path]
            if method != wanted:
                self._read_body()
                raise ApiError(405, f"{path} takes {wanted}, not {method}")
            route()
        except ApiError as error:
            self._send_json(error.status, error.body())
        except Exception:
            log.exception("internal error on %s %s", method, self.path)
            error = ApiError(500, "internal server error", type="server_error")
            self._send_json(500, error.body())

    def _check_key(self) -> None:
        key = self.server.api_key
        if key is None:
            return
        given = self.headers.get("Authorization", "")
        if not given.startswith("Bearer ") or not hmac.compare_digest(
            given[len("Bearer ") :].encode(), key.encode()
        ):
            self._read_body()
            raise ApiError(
                401,
                "missing or wrong API key: send it as 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )

    def _models(self) -> None:
        model = self.server.model
        self._send_json(
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

    def _generate(self, kind: str) -> None:
        body = self._read_body()
        try:
            payload = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ApiError(400, f"the body is not valid JSON: {error}") from None
        model = self.server.model
        request = parse_request(kind, payload, model.info)  # type: ignore[arg-type]
        handles = self._submit(request)
        if request.stream:
            self._stream(request, handles)
        else:
            self._answer(request, handles)

    def _submit(self, request: GenerationRequest) -> list[RequestHandle]:
        service = self.server.model.service
        params = [per_prompt(request, index) for index in range(len(request.prompts))]
        try:
            return service.submit_many(request.prompts, params)
        except (ServiceBusy, ServiceClosed) as error:
            raise ApiError(503, str(error), type="server_error", code="unavailable") from None

    # --- answers -------------------------------------------------------------------------------

    def _answer(self, request: GenerationRequest, handles: list[RequestHandle]) -> None:
        for handle in handles:
            while not handle.wait(DISCONNECT_POLL_S):
                if self._client_gone():
                    for other in handles:
                        other.cancel()
                    self.close_connection = True
                    return
        results = [handle.result() for handle in handles]
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
        self._send_json(200, body)

    def _stream(self, request: GenerationRequest, handles: list[RequestHandle]) -> None:
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

    def _read_body(self) -> bytes:
        if "Transfer-Encoding" in self.headers:
            self.close_connection = True
            raise ApiError(411, "send the body with a Content-Length, not chunked")
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            self.close_connection = True
            raise ApiError(400, "Content-Length is not a number") from None
        if length < 0 or length > MAX_BODY_BYTES:
            self.close_connection = True
            raise ApiError(413, f"the body is over {MAX_BODY_BYTES} bytes")
        return self.rfile.read(length) if length else b""

    def _send_json(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status, HTTPStatus(status).phrase)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if status == 401:
            self.send_header("WWW-Authenticate", "Bearer")
        if self.close_connection or self.server.stopping:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        try:
            self.wfile.write(data)
        except OSError:
            self.close_connection = True

    def _event(self, data: dict[str, Any] | str) -> None:
        text = data if isinstance(data, str) else json.dumps(data)
        self._write_chunk(f"data: {text}\n\n".encode())

    def _write_chunk(self, payload: bytes) -> None:
        self.wfile.write(b"%X\r\n%s\r\n" % (len(payload), payload))

    def _client_gone(self) -> bool:
        """Whether the client closed its end (readable, with nothing to read)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            if not readable:
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
