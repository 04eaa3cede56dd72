"""`rollout serve` with hundreds of connections: idle keep-alive connections plus concurrent requests.

An agent harness holds hundreds of episodes in flight against the server, each a client with a
keep-alive connection that is idle most of the time (the agent thinks, runs a tool) and now and
then asks for a short completion. For each level (N idle connections, M concurrent clients) this
opens N connections (each asks GET /v1/models once, then stays open and idle), then runs M clients
at once, each sending --rounds short chat completions (max_tokens --max-tokens) one after another
over its own keep-alive connection, and reports:

  threads      the server process's threads with the N idle connections open / peak under load
  rss MiB      its resident memory, the same two moments
  req/s        completed requests / wall time of the M clients
  p50/p99 s    request sent -> whole answer read
  errors       requests without a 200 (refused, reset, timed out), idle connections the server
               dropped, and connections it refused to open

The server is the real CLI in a subprocess on the tiny builtin model (`rollout serve --model
builtin:tiny-llama`, OMP_NUM_THREADS=1); the clients are asyncio streams in this process, so the
client side needs no thread per connection. `--server DIR` (repeatable) runs the server from the
checkout DIR (its code first on PYTHONPATH), so two versions of the server are measured in one run:

    python benchmarks/serve_concurrency.py                                  # this checkout
    python benchmarks/serve_concurrency.py --server /work/main --server .   # old vs this one
    python benchmarks/serve_concurrency.py --levels 100:50 400:200 --max-tokens 8

The machines are noisy (2 shared cores): compare servers and levels of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "serve_concurrency.json"
MODEL = "tiny-llama"
TIMEOUT_S = 120.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--levels", nargs="+", default=["100:50", "400:200"], help="IDLE:CONCURRENT pairs"
    )
    parser.add_argument("--rounds", type=int, default=3, help="requests per concurrent client")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument(
        "--server", type=Path, action="append", help="checkout whose server to run (repeatable)"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    levels = [tuple(int(x) for x in level.split(":")) for level in args.levels]
    checkouts = [path.resolve() for path in args.server or [ROOT]]

    rows = []
    for checkout in checkouts:
        process, port = start_server(checkout, args.max_batch_size)
        try:
            asyncio.run(request(port, args.max_tokens))  # the first request packs the weights
            for idle, concurrent in levels:
                row = asyncio.run(run_level(process.pid, port, idle, concurrent, args))
                rows.append({"server": str(checkout), **row})
                print(json.dumps(rows[-1]), flush=True)
        finally:
            process.terminate()
            process.wait(60)

    report = {
        "model": MODEL,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "load_average": os.getloadavg(),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    head = (
        f"{'server':<24} {'idle':>5} {'conc':>5} {'threads':>11} {'rss MiB':>11} {'req/s':>7} "
        f"{'p50 s':>6} {'p99 s':>6} {'errors':>6}"
    )
    print("\n" + head)
    for row in rows:
        print(
            f"{row['server'][-24:]:<24} {row['idle']:>5} {row['concurrent']:>5} "
            f"{row['threads_idle']:>5}/{row['threads_peak']:<5} "
            f"{row['rss_idle_mib']:>5.0f}/{row['rss_peak_mib']:<5.0f} {row['requests_per_s']:>7.1f} "
            f"{row['latency_p50_s']:>6.2f} {row['latency_p99_s']:>6.2f} {row['errors']:>6}"
        )
    print(f"written to {args.out}")


def start_server(checkout: Path, max_batch: int) -> tuple[subprocess.Popen, int]:
    env = {
        **os.environ,
        "PYTHONPATH": str(checkout),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    command = [sys.executable, "-m", "rollout", "serve", "--model", f"builtin:{MODEL}"]
    command += ["--port", "0", "--max-batch-size", str(max_batch), "--device", "cpu"]
    process = subprocess.Popen(
        command, cwd=checkout, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    assert process.stdout is not None
    for line in process.stdout:
        if "serving" in line:
            url = line.split(" at ")[1].split()[0]
            port = url.removeprefix("http://").removesuffix("/v1").rsplit(":", 1)[1]
            threading.Thread(target=process.stdout.read, daemon=True).start()  # drain
            return process, int(port)
    raise SystemExit(f"the server exited with {process.wait()} before serving")


# --- a minimal HTTP/1.1 client on asyncio streams ------------------------------------------------


async def exchange(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, method: str, path: str, body: bytes
) -> tuple[int, bytes]:
    head = f"{method} {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
    writer.write(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
    await writer.drain()
    status_line = await reader.readuntil(b"\r\n")
    status = int(status_line.split()[1])
    length = 0
    while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
        name, _, value = line.decode("latin-1").partition(":")
        if name.strip().lower() == "content-length":
            length = int(value)
    return status, await reader.readexactly(length)


def chat_body(max_tokens: int) -> bytes:
    messages = [{"role": "user", "content": "Say something short."}]
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 1.0}
    return json.dumps(body).encode()


async def request(port: int, max_tokens: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    status, answer = await exchange(
        reader, writer, "POST", "/v1/chat/completions", chat_body(max_tokens)
    )
    writer.close()
    assert status == 200, answer


# --- one level -------------------------------------------------------------------------------------


async def run_level(pid: int, port: int, idle: int, concurrent: int, args) -> dict:
    server = psutil.Process(pid)
    errors = {"refused": 0, "idle_dropped": 0}

    async def open_idle() -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection("127.0.0.1", port), TIMEOUT_S
            )
            status, _ = await asyncio.wait_for(
                exchange(reader, writer, "GET", "/v1/models", b""), TIMEOUT_S
            )
            if status != 200:
                raise ConnectionError(status)
            return reader, writer
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            errors["refused"] += 1
            return None

    opened = [c for c in await asyncio.gather(*(open_idle() for _ in range(idle))) if c]
    await asyncio.sleep(1.0)  # the server settles (threads started, buffers allocated)
    threads_idle, rss_idle = server.num_threads(), server.memory_info().rss

    peak = {"threads": threads_idle, "rss": rss_idle}
    sampling = True

    async def sample() -> None:
        while sampling:
            peak["threads"] = max(peak["threads"], server.num_threads())
            peak["rss"] = max(peak["rss"], server.memory_info().rss)
            await asyncio.sleep(0.05)

    latencies: list[float] = []
    body = chat_body(args.max_tokens)

    async def client() -> None:
        connection = None
        for _ in range(args.rounds):
            started = time.perf_counter()
            try:
                if connection is None:
                    connection = await asyncio.open_connection("127.0.0.1", port)
                status, _ = await asyncio.wait_for(
                    exchange(*connection, "POST", "/v1/chat/completions", body), TIMEOUT_S
                )
            except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError) as e:
                kind = type(e).__name__
                errors[kind] = errors.get(kind, 0) + 1
                if connection is not None:
                    connection[1].close()
                connection = None
                continue
            if status == 200:
                latencies.append(time.perf_counter() - started)
            else:
                errors[f"status {status}"] = errors.get(f"status {status}", 0) + 1
        if connection is not None:
            connection[1].close()

    sampler = asyncio.create_task(sample())
    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrent)))
    wall = time.perf_counter() - started
    sampling = False
    await sampler

    # The idle connections are still usable: each asks once more.
    async def still_open(connection) -> None:
        try:
            status, _ = await asyncio.wait_for(
                exchange(*connection, "GET", "/v1/models", b""), TIMEOUT_S
            )
            if status != 200:
                raise ConnectionError(status)
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            errors["idle_dropped"] += 1
        connection[1].close()

    await asyncio.gather(*(still_open(c) for c in opened))
    await asyncio.sleep(0.5)
    latencies.sort()
    return {
        "idle": idle,
        "concurrent": concurrent,
        "requests": len(latencies),
        "threads_idle": threads_idle,
        "threads_peak": peak["threads"],
        "rss_idle_mib": rss_idle / 2**20,
        "rss_peak_mib": peak["rss"] / 2**20,
        "requests_per_s": len(latencies) / wall,
        "latency_p50_s": statistics.median(latencies) if latencies else float("nan"),
        "latency_p99_s": latencies[int(0.99 * (len(latencies) - 1))] if latencies else float("nan"),
        "errors": sum(errors.values()),
        "error_kinds": errors,
    }


if __name__ == "__main__":
    main()
