"""The parent side: start a sidecar, call it in batches under a deadline, restart it, stop it.

A call waits for its answer on a queue fed by a reader thread, never on the child: when the
deadline passes, the child's whole process group is SIGKILLed (a regex backtracking in C with the
GIL held, or a native hang, ignores anything gentler), a fresh child is started, and the same
call (same id) is sent once more. A crash (segfault, os._exit, a kill from outside) is handled
the same way. A second failure of the same call is one SidecarError naming the plugin and the
batch. What the plugin raises is not retried: it answered, and would answer the same again.
Which *sample* of the batch is to blame is the caller's question (it knows which arguments are
per sample): the reward runner bisects the batch with SidecarCallable.once (rollout.harness.
isolate), each half under an id of its own.

No child outlives its host: the child asks the kernel for SIGKILL when the host dies
(PR_SET_PDEATHSIG, set between fork and exec, so a sidecar in any language gets it), the host
kills the group on close() and at interpreter exit, and a healthy child exits at EOF on stdin.
PR_SET_PDEATHSIG fires when the *thread* that forked the child ends, so every child is forked
from one thread that lives as long as the process (_spawner).
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import contextlib
import ctypes
import inspect
import itertools
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError
from pydantic_core import PydanticSerializationError

from rollout.plugins.sidecar.protocol import (
    FROM_CHILD,
    PROTOCOL,
    PROTOCOL_VERSION,
    Call,
    Error,
    FramingError,
    Hello,
    Ping,
    Pong,
    Result,
    Shutdown,
    encode,
    read_frame,
)

DEFAULT_START_TIMEOUT_S = 60.0
_STDERR_LINES = 20
_PR_SET_PDEATHSIG = 1


class SidecarError(Exception):
    """A sidecar failed in a way the host could not recover from; the message names the plugin."""


class SidecarPluginError(SidecarError):
    """The plugin raised inside the sidecar (which stays up). kind: the exception's type name."""

    def __init__(self, message: str, *, kind: str):
        super().__init__(message)
        self.kind = kind


class _Lost(Exception):
    """The child stopped answering this call: it died, hung, or broke the framing."""


class SidecarHost:
    """One sidecar process for the plugin `name`, started by `argv`.

    start_timeout_s: how long the child may take to load its plugin and say Hello.
    echo_stderr: pass the child's stderr on to ours (its last lines are quoted in errors either
    way).
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        name: str,
        start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        echo_stderr: bool = True,
    ):
        self.argv = list(argv)
        self.name = name
        self.start_timeout_s = start_timeout_s
        self.env = env
        self.cwd = cwd
        self.echo_stderr = echo_stderr
        self.hello: Hello | None = None
        self.restarts = 0
        self._ids = itertools.count(1)
        self._lock = threading.RLock()
        self._process: subprocess.Popen[bytes] | None = None
        self._frames: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._stderr: collections.deque[str] = collections.deque(maxlen=_STDERR_LINES)
        _LIVE.add(self)

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> Hello:
        """Start the child and wait for its Hello; SidecarError if it never comes or is wrong."""
        self._kill()
        self._frames = queue.Queue()
        self._stderr = collections.deque(maxlen=_STDERR_LINES)
        spawn = _spawner().submit(
            subprocess.Popen,
            self.argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=self.env,
            cwd=self.cwd,
            start_new_session=True,  # its own group: killed with whatever it started
            preexec_fn=_die_with(os.getpid()),
        )
        try:
            self._process = spawn.result()
        except OSError as error:
            raise SidecarError(
                f"sidecar for {self.name!r}: cannot start {self.argv[0]}: {error}"
            ) from None
        process = self._process
        threading.Thread(target=self._read, args=(process,), daemon=True).start()
        threading.Thread(target=self._drain_stderr, args=(process,), daemon=True).start()
        kind, value = self._next(time.monotonic() + self.start_timeout_s)
        problem = None
        if kind == "timeout":
            problem = f"did not say hello within {self.start_timeout_s:g} s of starting"
        elif kind != "frame":
            problem = self._lost_text(kind, value, waiting="for its hello")
        if problem is None:
            self.hello, problem = _check_hello(value)
        if problem is not None:
            self._kill()
            raise SidecarError(
                f"sidecar for {self.name!r} ({self._command()}) {problem}{self._log()}"
            )
        assert self.hello is not None
        return self.hello

    def close(self, timeout_s: float = 2.0) -> None:
        """Ask the child to shut down, then kill its group whatever it did."""
        process = self._process
        if process is not None and process.poll() is None and process.stdin is not None:
            try:
                process.stdin.write(encode(Shutdown()))
                process.stdin.close()
                process.wait(timeout=timeout_s)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self._kill()
        _LIVE.discard(self)

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    # -- calls -------------------------------------------------------------------------------

    def call(
        self,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        *,
        method: str = "__call__",
        timeout_s: float,
        what: str = "a call",
        retry: bool = True,
    ) -> Any:
        """The plugin's answer to one batch. `what` describes the batch in errors. retry: send
        the batch once more to a restarted child after a hang or crash (False for a call that
        needs state the dead child took with it, such as an environment's step)."""
        with self._lock:  # one call at a time: answers come back in order
            return self._call(method, list(args), kwargs or {}, timeout_s, what, retry)

    def _call(
        self,
        method: str,
        args: list[Any],
        kwargs: dict[str, Any],
        timeout_s: float,
        what: str,
        retry: bool,
    ) -> Any:
        message = Call(id=next(self._ids), method=method, args=args, kwargs=kwargs)
        try:
            frame = encode(message)
        except (PydanticSerializationError, ValueError) as error:
            raise SidecarError(
                f"sidecar for {self.name!r}: {what} cannot be sent as JSON: {error}"
            ) from None
        failures: list[str] = []
        for _attempt in range(2 if retry else 1):
            if self._process is None or self._process.poll() is not None:
                if self.hello is not None:  # it ran before: this start is a restart
                    self.restarts += 1
                self.start()
            try:
                return self._exchange(message, frame, timeout_s, what)
            except _Lost as lost:
                failures.append(str(lost))
                self._kill()
        if not retry:
            raise SidecarError(
                f"sidecar for {self.name!r} failed on {what} (call {message.id}): "
                f"{failures[0]}{self._log()}"
            )
        raise SidecarError(
            f"sidecar for {self.name!r} failed on {what} (call {message.id}) twice, restarted "
            f"in between: {failures[0]}; then {failures[1]}{self._log()}"
        )

    def ping(self, timeout_s: float = 10.0) -> None:
        """A round trip; SidecarError if the child does not answer in time."""
        with self._lock:
            if self._process is None:
                self.start()
            try:
                ping = Ping(id=next(self._ids))
                self._exchange(ping, encode(ping), timeout_s)
            except _Lost as lost:
                self._kill()
                raise SidecarError(
                    f"sidecar for {self.name!r} failed a health check: {lost}"
                ) from None

    def _exchange(
        self, message: Call | Ping, frame: bytes, timeout_s: float, what: str = "a ping"
    ) -> Any:
        process = self._process
        assert process is not None and process.stdin is not None
        try:
            process.stdin.write(frame)
            process.stdin.flush()
        except OSError:
            pass  # it died; reading says how
        deadline = time.monotonic() + timeout_s
        kind, value = self._next(deadline)
        if kind == "timeout":
            raise _Lost(f"no answer within {timeout_s:g} s (killed)")
        if kind != "frame":
            raise _Lost(self._lost_text(kind, value, waiting="for an answer"))
        try:
            answer = FROM_CHILD.validate_python(value)
        except ValidationError:
            raise _Lost(f"answered with something not in the protocol: {_short(value)}") from None
        if isinstance(answer, Hello) or answer.id != message.id:
            raise _Lost(f"answered call {message.id} with {_short(value)}")
        if isinstance(answer, Error):
            raise SidecarPluginError(
                f"sidecar plugin {self.name!r} raised {answer.kind}: {answer.message} (on {what})",
                kind=answer.kind,
            )
        if isinstance(message, Ping) != isinstance(answer, Pong):
            raise _Lost(f"answered a {message.type} with a {answer.type}")
        return answer.value if isinstance(answer, Result) else None

    # -- the child's output --------------------------------------------------------------------

    def _read(self, process: subprocess.Popen[bytes]) -> None:
        frames = self._frames
        assert process.stdout is not None
        try:
            while True:
                value = read_frame(process.stdout)  # type: ignore[arg-type]
                if value is None:
                    break
                frames.put(("frame", value))
        except FramingError as error:
            frames.put(("garbage", str(error)))
            return
        except (OSError, ValueError):
            pass  # closed under us by _kill
        frames.put(("eof", None))

    def _drain_stderr(self, process: subprocess.Popen[bytes]) -> None:
        """Pass the child's stderr on to ours, keeping its last lines for error messages."""
        assert process.stderr is not None
        lines = self._stderr
        with contextlib.suppress(OSError, ValueError):  # closed under us by _kill
            # At most 64 KiB at a time: a child writing without newlines cannot fill our memory.
            for raw in iter(lambda: process.stderr.readline(65536), b""):  # type: ignore[union-attr]
                line = raw.decode("utf-8", "replace").rstrip()
                lines.append(line)
                if self.echo_stderr:
                    print(f"[sidecar {self.name}] {line}", file=sys.stderr)

    def _next(self, deadline: float) -> tuple[str, Any]:
        try:
            return self._frames.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return "timeout", None

    def _lost_text(self, kind: str, value: Any, *, waiting: str) -> str:
        if kind == "garbage":
            return (
                f"wrote bytes to stdout that are not the protocol's framing ({value}); "
                "something wrote to the channel directly"
            )
        process = self._process
        code = process.wait(timeout=5) if process is not None else None
        return f"exited {_exit_text(code)} while the host waited {waiting}"

    def _log(self) -> str:
        time.sleep(0.05)  # let the stderr thread catch the child's last words
        lines = [_short_text(line) for line in self._stderr if line.strip()]
        return "; its stderr ended with:\n  " + "\n  ".join(lines[-8:]) if lines else ""

    def _command(self) -> str:
        return " ".join(self.argv[:4]) + (" ..." if len(self.argv) > 4 else "")

    def _kill(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        for stream in (process.stdin, process.stdout, process.stderr):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass


def _check_hello(value: Any) -> tuple[Hello | None, str | None]:
    """The Hello in `value`, or what is wrong with it (the version first: a newer child's hello
    may have fields this host does not know)."""
    if not isinstance(value, dict) or value.get("type") != "hello":
        return None, f"sent {_short(value)} before its hello"
    if value.get("protocol") != PROTOCOL or value.get("version") != PROTOCOL_VERSION:
        return None, (
            f"speaks protocol {value.get('protocol')!r} version {value.get('version')!r}; this "
            f"host speaks {PROTOCOL!r} version {PROTOCOL_VERSION}: use the same rollout "
            "version on both sides"
        )
    try:
        return Hello.model_validate(value), None
    except ValidationError as error:
        return None, f"sent a malformed hello: {error}"


def signature_of(hello: Hello) -> inspect.Signature | None:
    """The plugin's signature as the child reported it (None: unknown)."""
    if hello.parameters is None:
        return None
    return inspect.Signature(
        [
            inspect.Parameter(
                p.name,
                getattr(inspect.Parameter, p.kind),
                default=None if p.has_default else inspect.Parameter.empty,
            )
            for p in hello.parameters
        ]
    )


class SidecarCallable:
    """A plugin function served by a sidecar, callable as the function itself would be.

    It carries the function's signature (from the Hello), so the code that reads which keywords a
    plugin accepts treats it like the in-process function. ``enforces_deadline``: each call
    has ``timeout_s`` on the host's own clock, so a caller need not add a thread deadline.
    """

    enforces_deadline = True

    def __init__(self, host: SidecarHost, *, timeout_s: float):
        self.host = host
        self.timeout_s = timeout_s
        hello = host.hello or host.start()
        self.__name__ = hello.plugin.rsplit(":", 1)[-1]
        signature = signature_of(hello)
        self.__signature__ = signature or inspect.Signature(
            [
                inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL),
                inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD),
            ]
        )
        for name, flag in hello.attributes.items():
            setattr(self, name, flag)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        batch = len(args[1]) if len(args) > 1 and isinstance(args[1], list) else None
        what = f"a batch of {batch} samples" if batch is not None else "a call"
        return self.host.call(args, kwargs, timeout_s=self.timeout_s, what=what)

    def once(self, args: Sequence[Any], kwargs: dict[str, Any], *, what: str) -> Any:
        """One attempt, not resubmitted after a hang or crash: a sub-batch of a bisection
        (rollout.harness.isolate), sent after the whole batch already failed twice. A dead
        child is restarted first."""
        return self.host.call(args, kwargs, timeout_s=self.timeout_s, what=what, retry=False)

    def close(self) -> None:
        self.host.close()


def server_argv(
    python: str | None, ref: str, identity_json: str, build: dict[str, Any] | None = None
) -> list[str]:
    """How to start rollout's own server for a plugin the plan resolved; `build`: keyword
    arguments to build the served object with (an environment's options)."""
    argv = [
        python or sys.executable,
        "-m",
        "rollout.plugins.sidecar.server",
        ref,
        "--identity",
        identity_json,
    ]
    return argv if build is None else [*argv, "--build", json.dumps(build)]


_SPAWNER: concurrent.futures.ThreadPoolExecutor | None = None
_SPAWNER_LOCK = threading.Lock()


def _spawner() -> concurrent.futures.ThreadPoolExecutor:
    """The one thread every sidecar is started from. PR_SET_PDEATHSIG fires when the *thread*
    that forked the child ends, so a child started from a short-lived thread (a deadline
    thread, a pool's worker) would be killed with it; this thread lives as long as the
    process."""
    global _SPAWNER
    with _SPAWNER_LOCK:
        if _SPAWNER is None:
            _SPAWNER = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="rollout-sidecar-spawn"
            )
        return _SPAWNER


def _die_with(parent: int):  # type: ignore[no-untyped-def]
    """A preexec_fn asking the kernel to SIGKILL the child when `parent` dies (Linux)."""
    if sys.platform != "linux":
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before fork, not in the child

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the host died before we asked
            os._exit(1)

    return preexec


def _exit_text(code: int | None) -> str:
    if code is None:
        return "(still running)"
    if code < 0:
        try:
            return f"on signal {signal.Signals(-code).name}"
        except ValueError:
            return f"on signal {-code}"
    return f"with code {code}"


def _short_text(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


_LIVE: weakref.WeakSet[SidecarHost] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for host in list(_LIVE):
        host._kill()
