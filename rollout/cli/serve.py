"""`rollout serve`: an OpenAI-compatible server for a model, a config's model or a checkpoint."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Annotated
from urllib.parse import urlsplit

import typer
from rich.markup import escape

import rollout.tracing as tracing
from rollout.cli.options import local_path
from rollout.cli.render import stdout, user_errors
from rollout.errors import Issue, RolloutError
from rollout.redact import redact_text

DTYPES = ("auto", "float32", "bfloat16", "float16")


def serve(
    config: Annotated[
        str | None,
        typer.Option(
            "--config",
            "-c",
            metavar="PATH",
            help="Serve this config's model; its \\[generation] section gives the defaults.",
        ),
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            help="A Hugging Face directory, a .gguf file, builtin:NAME or package:NAME.",
        ),
    ] = None,
    checkpoint: Annotated[
        str | None,
        typer.Option(
            "--checkpoint",
            help="A checkpoint step directory, a run directory (its latest step) or a run id.",
        ),
    ] = None,
    host: Annotated[
        str, typer.Option("--host", help="Address to bind; other than loopback needs --api-key.")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="Port to bind; 0 picks a free one.")] = 8000,
    api_key: Annotated[
        str | None,
        typer.Option(
            "--api-key",
            metavar="REF",
            help="Where the API key is: env:NAME or file:/path (never the key itself). Every "
            "route then needs 'Authorization: Bearer <key>'.",
        ),
    ] = None,
    tls_cert: Annotated[
        Path | None,
        typer.Option(
            "--tls-cert",
            help="Serve HTTPS with this PEM certificate (chain); needs --tls-key.",
        ),
    ] = None,
    tls_key: Annotated[
        Path | None,
        typer.Option("--tls-key", help="The PEM private key of --tls-cert (unencrypted)."),
    ] = None,
    name: Annotated[
        str | None,
        typer.Option("--served-model-name", help="The model name clients send. Default: derived."),
    ] = None,
    max_batch_size: Annotated[
        int | None,
        typer.Option("--max-batch-size", min=1, help="Most sequences decoded together."),
    ] = None,
    device: Annotated[
        str,
        typer.Option(
            "--device", help="auto (cuda when torch sees a GPU, else cpu), cpu, cuda or cuda:N."
        ),
    ] = "auto",
    dtype: Annotated[
        str, typer.Option("--dtype", help="auto, float32, bfloat16 or float16.")
    ] = "auto",
    seed: Annotated[
        int | None, typer.Option("--seed", help="Seed of the sampling stream (unseeded requests).")
    ] = None,
    engine: Annotated[
        str | None,
        typer.Option(
            "--engine",
            metavar="REF",
            help="hf, or an engine plugin: './engine.py:make' (relative to the current "
            "directory), 'package.module:make' or a 'rollout.engines' entry point. Default: "
            "the --config's \\[generation] engine, else hf.",
        ),
    ] = None,
    dev: Annotated[
        bool,
        typer.Option(
            "--dev",
            help="Development server: `rollout plugins reload` re-imports the engine plugin's "
            "code and swaps the engine between requests.",
        ),
    ] = False,
    otlp_endpoint: Annotated[
        str | None,
        typer.Option(
            "--otlp-endpoint",
            metavar="URL",
            help="Export a trace span per request over OTLP/HTTP to this collector URL "
            "(http://127.0.0.1:4318/v1/traces); needs rollout\\[otel].",
        ),
    ] = None,
) -> None:
    """Serve a model over HTTP (or HTTPS) with the OpenAI API (completions, chat, streaming).

    Stops gracefully on SIGTERM or Ctrl-C: requests in flight are answered first.
    """
    from rollout.inference.batch import resolve_device
    from rollout.inference.serve_source import choose_engine, load_served, resolve_source
    from rollout.serve.loading import resolve_api_key, tls_context

    # OpenMP's worker threads spin while they wait for work. Here the engine thread shares the
    # cores with the connection threads, and spinning workers starve them (and it): 8 streaming
    # clients ran about 8x slower. Read once, when torch loads, so it is set before that.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    with user_errors():
        if dtype not in DTYPES:
            raise RolloutError(Issue("--dtype", f"must be one of {', '.join(DTYPES)}", value=dtype))
        check_otlp_endpoint(otlp_endpoint)
        source = resolve_source(
            config=local_path(config), model=model, checkpoint=checkpoint, name=name
        )
        key = resolve_api_key(api_key, host)
        tls = tls_context(tls_cert, tls_key)
        served = load_served(
            source,
            device=resolve_device(device),
            dtype=dtype,
            seed=seed,
            max_batch_size=max_batch_size,
            engine=engine,
            dev=dev,
        )
    with user_errors():
        server = _bind(host, port, served, key, tls)
    # The name may come from a --model URL: printed only through redact_text, like every Issue.
    shown = redact_text(repr(source.name))
    chosen = choose_engine(engine, source).ref
    on = "" if chosen == "hf" else f" with engine {escape(repr(chosen))}"
    dev_note = ", --dev: `rollout plugins reload` reloads the engine" if dev else ""
    stdout.print(f"serving {escape(shown)}{on} at {server.url} (Ctrl-C or SIGTERM stops{dev_note})")
    with tracing.exporting(otlp_endpoint, "rollout-serve"):
        _serve_until_signalled(server)
    stdout.print("stopped")


def check_otlp_endpoint(endpoint: str | None) -> None:
    """An endpoint is an http(s) URL without a password, and needs OpenTelemetry installed."""
    if endpoint is None:
        return
    if not endpoint.startswith(("http://", "https://")) or urlsplit(endpoint).password:
        raise RolloutError(
            Issue(
                "--otlp-endpoint",
                "must be an http:// or https:// URL with no password in it (OTLP over HTTP)",
                hint="e.g. http://127.0.0.1:4318/v1/traces for a local OpenTelemetry collector",
            )
        )
    missing = tracing.missing_package()
    if missing is not None:
        raise RolloutError(
            Issue(
                "--otlp-endpoint",
                f"exporting traces needs the Python package {missing!r}, which is not installed",
                hint=f"{tracing.INSTALL_HINT}, or leave out --otlp-endpoint",
            )
        )


def _bind(host: str, port: int, served, key: str | None, tls):
    from rollout.serve.server import OpenAIServer

    try:
        return OpenAIServer((host, port), served, api_key=key, tls=tls)
    except OSError as error:
        served.service.close()
        raise RolloutError(
            Issue("--port", f"cannot bind {host}:{port}: {error.strerror}")
        ) from None


def _serve_until_signalled(server) -> None:
    """serve_forever in a thread; the main thread waits for SIGTERM/SIGINT, then stops it
    gracefully (shutdown() must come from another thread than serve_forever's)."""
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2})
    thread.start()
    while not stop.wait(0.5):
        pass
    server.stop()
    thread.join()
