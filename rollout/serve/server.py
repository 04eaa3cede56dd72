"""The OpenAI-compatible HTTP server: an ASGI application on uvicorn (h11), one event loop.

Connections cost no thread: an idle keep-alive connection is a socket the event loop watches,
and a request in flight is a coroutine waiting for the EngineService, whose single engine thread
batches the requests of every connection together and wakes the loop as tokens come (its
`notify` hook). The answer is one JSON body, or server-sent events (`data: {...}` chunks, then
`data: [DONE]`) in a chunked HTTP/1.1 response, each prompt's chunks sent as its tokens come. A
client that goes away has its request cancelled: uvicorn sees the connection close (or the client
half-closes it while it waits). Every bad request gets a 4xx in OpenAI's error shape and the
server carries on; only a bug in the server itself gives a 500.

Every answer is JSON, h11's refusals included (wire.py): a known route asked with another
standard method gets 405, an unknown path 404, an unknown method 501, an HTTP version other than
1.x 505, and a body is read against a deadline (408 when it stalls). Nothing a client sends
prints a traceback; a traceback on stderr means a bug in the server (the 500 path).

Security: an API key, when set, is checked on every route (401 otherwise, compared in constant
time); the CLI binds only a loopback address without one. With an ssl.SSLContext every
connection speaks TLS (its handshake runs on the event loop, never blocking it). Request bodies
are capped at MAX_BODY_BYTES and idle connections time out after IDLE_TIMEOUT_S. Log lines and
error bodies pass through redact_text: a path or header may carry a credential.

Episodes: with a CompletionRecorder (recording.py), `/episodes/{episode_id}` + a route serves
that route and records every completion it serves for the episode.

stop() is the graceful shutdown: no new connections, idle keep-alive connections closed,
requests in flight answered in full, then the engine stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import queue
import socket
import ssl
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import uvicorn
from starlette.responses import Response, StreamingResponse

from rollout.engines.base import Completion, SamplingParams
from rollout.engines.service import (
    EngineService,
    EventMerger,
    RequestHandle,
    ServiceBusy,
    ServiceClosed,
)
from rollout.redact import redact_text
from rollout.serve.metrics import CONTENT_TYPE_LATEST, ServeMetrics
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
from rollout.serve.wire import (
    BODY_TIMEOUT_S,
    CONNECTION,
    MAX_BODY_BYTES,
    MAX_HEAD,
    MAX_HEADERS,
    MAX_LINE,
    PEER_EOF,
    JsonH11Protocol,
    error_response,
    error_type,
    json_response,
    read_body,
)
from rollout.tracing import span

__all__ = ["BODY_TIMEOUT_S", "MAX_BODY_BYTES", "OpenAIServer", "ServedModel"]

log = logging.getLogger("rollout.serve")

IDLE_TIMEOUT_S = 60.0
BACKLOG = 2048
"""The listen backlog: a burst of hundreds of agents connecting at once is queued, not reset."""
Record = Callable[[int, Completion], None]
"""Records one finished completion of the request's prompt number i (a no-op outside an episode)."""
STANDARD_METHODS = frozenset(
    {"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "CONNECT"}
)


@dataclass
class ServedModel:
    """The model behind the server: its protocol facts and the service that samples it."""

    info: ModelInfo
    service: EngineService
    token_text: Any
    """token id -> its text, for logprobs."""
    created: int = 0
    reload: Callable[[], dict[str, Any]] | None = None
    """`rollout serve --dev`: re-import the engine plugin's code and swap the engine (blocking;
    a RolloutError when the new code does not load): the /admin/reload route's answer. None:
    the route refuses."""


ROUTES = {
    "/v1/models": "GET",
    "/v1/completions": "POST",
    "/v1/chat/completions": "POST",
    "/metrics": "GET",
    "/admin/reload": "POST",
}
"""path -> the one method it takes. /metrics: Prometheus' text format (metrics.py), under the
same key as every route. /admin/reload: `rollout plugins reload` (a --dev server only)."""
EPISODE_PREFIX = "/episodes/"
"""`/episodes/{episode_id}` + a route: the route, its completions recorded for the episode."""


class OpenAIServer:
    """Serves one model; `serve_forever()` in one thread, `stop()` from another."""

    def __init__(
        self,
        address: tuple[str, int],
        model: ServedModel,
        *,
        api_key: str | None,
        tls: ssl.SSLContext | None = None,
        body_timeout_s: float = BODY_TIMEOUT_S,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        recorder: CompletionRecorder | None = None,
        episode_sampling: Callable[[SamplingParams], SamplingParams] | None = None,
        episodes_any_model: bool = False,
    ):
        """Binds `address` (OSError if it cannot). `tls`: serve HTTPS with this server-side
        context (rollout.serve.loading.tls_context). `body_timeout_s`: how long a request body
        may stall before the request gets 408. `idle_timeout_s`: how long a connection may wait
        for its next request (or the rest of its request head) before it is closed. `recorder`: serve the episode routes
        (`/episodes/{id}/v1/...`) and record there every completion served (recording.py);
        without one those routes are 404. `episode_sampling`: what an episode request samples
        with, given what it asked for (a training run overrides an agent's temperature with its
        own, so the recorded log-probs are the ones its learner recomputes).
        `episodes_any_model`: an episode request may name any model (an unmodified agent names
        the one it was written for); the served model answers it."""
        self.model = model
        self.api_key = api_key
        self.body_timeout_s = body_timeout_s
        self.recorder = recorder
        self.episode_sampling = episode_sampling
        self.episodes_any_model = episodes_any_model
        self.https = tls is not None
        host, port = address
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.create_server((host, port), family=family, backlog=BACKLOG)
        self.server_address = self.socket.getsockname()
        config = uvicorn.Config(
            self._app,
            http=JsonH11Protocol,
            ws="none",
            interface="asgi3",
            lifespan="off",
            proxy_headers=False,  # no X-Forwarded-For trusted: the client is the socket's peer
            log_config=None,
            log_level=logging.CRITICAL,  # its lines say nothing ours do not (and name no path)
            access_log=False,
            server_header=False,
            date_header=False,
            backlog=BACKLOG,
            timeout_keep_alive=idle_timeout_s,  # type: ignore[arg-type]  # a float works
            h11_max_incomplete_event_size=MAX_HEAD,
            ssl_context_factory=None if tls is None else (lambda config, default: tls),
        )
        self._uvicorn = uvicorn.Server(config)
        self.metrics = ServeMetrics(model.service)
        self._serving = threading.Event()
        self._stopped = threading.Event()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"{'https' if self.https else 'http'}://{host}:{port}/v1"

    def episode_url(self, episode_id: str) -> str:
        """The base URL an agent of this episode is given: the same API, recorded."""
        if EPISODE_ID.fullmatch(episode_id) is None:
            raise ValueError(f"not an episode id: {episode_id!r} (letters, digits, . _ -)")
        return self.url.removesuffix("/v1") + f"/episodes/{episode_id}/v1"

    @property
    def stopping(self) -> bool:
        return self._uvicorn.should_exit

    def serve_forever(self, poll_interval: float = 0.1) -> None:
        """Serve until stop(). `poll_interval` is accepted for the callers of the threaded server
        it replaced; uvicorn checks for stop() every 0.1 s."""
        del poll_interval
        self._serving.set()
        try:
            asyncio.run(self._uvicorn.serve(sockets=[self.socket]))
        finally:
            self._stopped.set()

    def stop(self) -> None:
        """Graceful shutdown (from another thread than serve_forever's): stop accepting, close
        idle connections, let requests in flight finish, stop the engine."""
        self._uvicorn.should_exit = True
        if self._serving.is_set():
            self._stopped.wait()
        else:
            self.socket.close()
        self.model.service.close()

    # --- the ASGI application ------------------------------------------------------------------

    async def _app(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        headers = {
            name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]
        }
        metrics = self.metrics
        route = _route_label(scope["raw_path"])
        started = time.perf_counter()
        metrics.in_flight.inc()
        status = 500
        try:
            # Each request is its own asyncio task: the span is this request's alone.
            with span(f"{scope['method'][:20]} {route}", **{"http.route": route}) as traced:
                response = await self._respond(scope, receive, headers)
                status = response.status_code
                traced.set("http.response.status_code", status)
                await response(scope, receive, send)
        finally:
            metrics.in_flight.dec()
            metrics.latency.labels(route, str(status)).observe(time.perf_counter() - started)

    async def _respond(
        self, scope: dict[str, Any], receive: Any, headers: dict[str, str]
    ) -> Response:
        method = scope["method"]
        raw_path = scope["raw_path"].decode("latin-1")
        try:
            if scope["http_version"] not in ("1.0", "1.1"):
                raise _Closing(ApiError(505, "only HTTP/1.x is served", type=error_type(505)))
            if method not in STANDARD_METHODS:
                raise _Closing(
                    ApiError(501, f"Unsupported method ({method[:20]!r})", type=error_type(501))
                )
            if len(raw_path) > MAX_LINE:
                raise _Closing(ApiError(414, "the request line is too long"))
            if len(scope["headers"]) > MAX_HEADERS or any(
                len(name) + len(value) > MAX_LINE for name, value in scope["headers"]
            ):
                raise _Closing(ApiError(431, "the request headers are too large"))
            # Read first, whatever the answer: the connection stays usable (and a stalled body
            # gets 408 on every path, as it did).
            body = await read_body(scope, receive, headers, self.body_timeout_s)
            self._check_key(headers)
            path = raw_path.split("?", 1)[0].rstrip("/")
            episode, path = self._episode(path)
            wanted = ROUTES.get(path)
            if wanted is None:
                raise ApiError(404, f"no route {path[:200]!r}", code="not_found")
            if method != wanted:
                error = ApiError(405, f"{path} takes {wanted}, not {method}")
                self._count_error(error)
                return error_response(error, Allow=wanted)
            if path == "/v1/models":
                return self._models()
            if path == "/metrics":
                if episode is not None:  # the server's metrics, not an episode's route
                    raise ApiError(404, f"no route {path!r} under an episode", code="not_found")
                # Rendered in a worker thread: the event loop keeps streaming tokens meanwhile
                # (a few milliseconds for a busy server's series; benchmarks/metrics_scrape.py).
                text = await asyncio.to_thread(self.metrics.render)
                return Response(text, media_type=CONTENT_TYPE_LATEST)
            if path == "/admin/reload":
                if episode is not None:
                    raise ApiError(404, f"no route {path!r} under an episode", code="not_found")
                return await self._reload()
            kind = "chat" if path == "/v1/chat/completions" else "completion"
            return await self._generate(kind, episode, body, scope, receive)
        except _Closing as closing:
            self._count_error(closing.error)
            return error_response(closing.error, close=True)
        except ApiError as error:
            self._count_error(error)
            return error_response(error, close=getattr(error, "close", False))
        except Exception:
            log.exception("internal error on %s %s", method, redact_text(raw_path[:200]))
            error = ApiError(500, "internal server error", type="server_error")
            self._count_error(error)
            return error_response(error)

    def _count_error(self, error: ApiError) -> None:
        self.metrics.errors.labels(error.code or error.type).inc()

    def _episode(self, path: str) -> tuple[str | None, str]:
        """(episode id, the route under it) for an episode path, (None, path) otherwise."""
        if not path.startswith(EPISODE_PREFIX):
            return None, path
        episode, _, rest = path[len(EPISODE_PREFIX) :].partition("/")
        if self.recorder is None:
            raise ApiError(
                404, "episode routes are served only with a completion recorder", code="not_found"
            )
        if EPISODE_ID.fullmatch(episode) is None:
            raise ApiError(
                404,
                f"not an episode id: {episode[:200]!r} (1-128 letters, digits, '.', '_', '-')",
                code="not_found",
            )
        return episode, "/" + rest

    def _check_key(self, headers: dict[str, str]) -> None:
        key = self.api_key
        if key is None:
            return
        given = headers.get("authorization", "")
        if not given.startswith("Bearer ") or not hmac.compare_digest(
            given[len("Bearer ") :].encode(), key.encode()
        ):
            raise ApiError(
                401,
                "missing or wrong API key: send it as 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )

    async def _reload(self) -> Response:
        """Swap the engine for one built from the plugin's code as it is now; in a worker thread,
        so that the requests in flight stream on while the old engine finishes them."""
        if self.model.reload is None:
            raise ApiError(
                403,
                "this server does not reload its engine: start rollout serve with --dev",
                code="reload_disabled",
            )
        from rollout.errors import RolloutError

        try:
            answer = await asyncio.to_thread(self.model.reload)
        except RolloutError as error:
            raise ApiError(
                400,
                "the engine plugin did not reload (the old engine still serves): "
                + "; ".join(
                    f"{issue.message}" + (f" ({issue.hint})" if issue.hint else "")
                    for issue in error.issues
                ),
                code="reload_failed",
            ) from None
        return json_response(200, answer)

    def _models(self) -> Response:
        model = self.model
        return json_response(
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

    async def _generate(
        self,
        kind: str,
        episode: str | None,
        body: bytes,
        scope: dict[str, Any],
        receive: Any,
    ) -> Response:
        try:
            payload = json.loads(body)
        # ValueError: also an integer over 4300 digits; RecursionError: arrays nested too deep.
        except (ValueError, RecursionError) as error:
            raise ApiError(400, f"the body is not valid JSON: {str(error)[:200]}") from None
        if episode is not None and self.episodes_any_model and isinstance(payload, dict):
            payload["model"] = self.model.info.name
        request = parse_request(kind, payload, self.model.info)  # type: ignore[arg-type]
        record = self._recording(request, episode)
        woken = asyncio.Event()
        wake = _waker(asyncio.get_running_loop(), woken)
        handles: list[RequestHandle] = []

        def notify() -> None:  # an answer waits for the end only: one wake-up, not one a token
            if request.stream or all(handle.done for handle in handles):
                wake()

        handles[:] = self._submit(request, notify, episode)
        if request.stream:
            return _SseResponse(self._stream(request, handles, woken, record), handles)
        return await self._answer(request, handles, woken, record, scope, receive)

    def _recording(self, request: GenerationRequest, episode: str | None) -> Record:
        """What records a finished completion of prompt i: the recorder's, for an episode."""
        recorder = self.recorder
        if episode is None or recorder is None:
            return lambda number, completion: None
        try:
            recorder.check_room()
        except RecorderFull as error:
            raise ApiError(503, str(error), type="server_error", code="unavailable") from None
        return lambda number, completion: recorder.record(
            episode, request.kind, request.prompts[number], completion, request.sent[number]
        )

    def _submit(
        self, request: GenerationRequest, notify: Callable[[], None], episode: str | None = None
    ) -> list[RequestHandle]:
        params = [per_prompt(request, index) for index in range(len(request.prompts))]
        if episode is not None and self.episode_sampling is not None:
            params = [self.episode_sampling(each) for each in params]
        try:
            return self.model.service.submit_many(request.prompts, params, notify=notify)
        except (ServiceBusy, ServiceClosed) as error:
            raise ApiError(503, str(error), type="server_error", code="unavailable") from None

    # --- answers -------------------------------------------------------------------------------

    async def _answer(
        self,
        request: GenerationRequest,
        handles: list[RequestHandle],
        woken: asyncio.Event,
        record: Record,
        scope: dict[str, Any],
        receive: Any,
    ) -> Response:
        gone = asyncio.ensure_future(_client_gone(scope, receive))
        try:
            while not all(handle.done for handle in handles):
                wake = asyncio.ensure_future(woken.wait())
                await asyncio.wait({wake, gone}, return_when=asyncio.FIRST_COMPLETED)
                wake.cancel()
                woken.clear()
                if gone.done():
                    for handle in handles:
                        handle.cancel()
                    connection = scope.get(CONNECTION)
                    if connection is not None:
                        connection.abandon()
                    return Response(status_code=499)  # never sent: the connection is closed
        finally:
            gone.cancel()
        results = [handle.result() for handle in handles]
        for number, completions in enumerate(results):
            for completion in completions:
                record(number, completion)
                self.metrics.tokens.inc(len(completion.token_ids))
        kind, model = request.kind, self.model
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
        return json_response(200, body, close=self.stopping)

    async def _stream(
        self,
        request: GenerationRequest,
        handles: list[RequestHandle],
        woken: asyncio.Event,
        record: Record,
    ) -> AsyncIterator[bytes]:
        kind, model = request.kind, self.model
        ident = response_id(kind)
        completions: list[Completion] = []
        n = request.params.n
        try:
            if kind == "chat":  # one prompt
                for index in range(n):
                    delta = {"role": "assistant", "content": ""}
                    yield _event(self._chunk(request, ident, index, delta))
            # Every prompt's tokens as they are sampled: a short completion is not held up
            # behind a long one of an earlier prompt.
            merger = EventMerger(handles)
            while not merger.finished:
                try:
                    item = merger.queue.get_nowait()
                except queue.Empty:
                    await woken.wait()
                    woken.clear()
                    continue
                merged = merger.take(item)
                if merged is None:
                    continue
                number, event = merged
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
                    record(number, completion)
                    self.metrics.tokens.inc(len(completion.token_ids))
                    choice["finish_reason"] = OPENAI_FINISH[completion.finish_reason]
                    choice["rollout"] = rollout_fields(request.prompts[number], completion)
                yield _event(chunk)
            if request.include_usage:
                chunk = envelope(kind, ident, model.info.name, chunk=True)
                chunk["choices"] = []
                chunk["usage"] = usage(request.prompts, completions)
                yield _event(chunk)
            yield _event("[DONE]")
        except Exception as error:  # an engine step failed: say so in the stream, then end it
            log.exception("generation failed while streaming")
            failure = ApiError(500, f"generation failed: {error}", type="server_error")
            self._count_error(failure)
            yield _event(failure.body())
            yield _event("[DONE]")
        finally:  # the client went away (the stream was cancelled), or it ended: no-op then
            for handle in handles:
                handle.cancel()

    def _chunk(
        self, request: GenerationRequest, ident: str, index: int, delta: Any
    ) -> dict[str, Any]:
        chunk = envelope(request.kind, ident, self.model.info.name, chunk=True)
        choice: dict[str, Any] = {"index": index}
        if request.kind == "chat":
            choice["delta"] = delta
        else:
            choice["text"] = delta
        choice["logprobs"] = None
        choice["finish_reason"] = None
        chunk["choices"] = [choice]
        return chunk


class _Closing(Exception):
    """An error after which the connection closes."""

    def __init__(self, error: ApiError) -> None:
        super().__init__(error.message)
        self.error = error


class _SseResponse(StreamingResponse):
    """Server-sent events; its handles are cancelled however the response ends."""

    def __init__(self, events: AsyncIterator[bytes], handles: list[RequestHandle]) -> None:
        # Not media_type: starlette would add "; charset=utf-8", which SSE does not take.
        headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        super().__init__(events, headers=headers)
        self._handles = handles

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for handle in self._handles:
                handle.cancel()


def _route_label(raw_path: bytes) -> str:
    """The route a request asked for, as a metric label: a served route (an episode's as
    /episodes/{id}/...), or "other" for any other path, so a client never makes a series."""
    path = raw_path.decode("latin-1").split("?", 1)[0].rstrip("/")
    prefix = ""
    if path.startswith(EPISODE_PREFIX):
        prefix = "/episodes/{id}"
        path = "/" + path[len(EPISODE_PREFIX) :].partition("/")[2]
    return prefix + path if path in ROUTES else "other"


def _event(data: dict[str, Any] | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data)
    return f"data: {text}\n\n".encode()


def _waker(loop: asyncio.AbstractEventLoop, woken: asyncio.Event) -> Callable[[], None]:
    """The engine thread's `notify`: wake the request's coroutine (a loop that has closed, with
    a cancelled request's last tokens still coming, is no error)."""

    def wake() -> None:
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(woken.set)

    return wake


async def _client_gone(scope: dict[str, Any], receive: Any) -> None:
    """Returns once the client has gone: closed the connection, or half-closed it."""
    while not scope.get(PEER_EOF):
        message = await receive()
        if message["type"] == "http.disconnect":
            return
