"""Does a Prometheus scraper slow `rollout serve`'s requests? Throughput with and without a scraper.

The server is the real CLI in a subprocess on the tiny builtin model (`rollout serve --model
builtin:tiny-llama`, OMP_NUM_THREADS=1). Each trial runs --clients concurrent clients for
--seconds, each sending short chat completions one after another over its own keep-alive
connection; in the "scraped" trials one more client GETs /metrics every --interval seconds
(Prometheus' default is 15 s: 100 ms is 150 times harsher). Trials alternate (plain, scraped,
plain, scraped...) so drift on these noisy machines hits both alike, and it reports per mode
the median over trials of:

  req/s        completed requests / trial wall time
  p50/p99 s    request sent -> whole answer read
  scrapes      /metrics answers in the trial (and the slowest scrape)

and the ratio scraped / plain of req/s and p50: the median over pairs of adjacent trials.

    python benchmarks/metrics_scrape.py
    python benchmarks/metrics_scrape.py --clients 16 --seconds 15 --trials 4
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

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "metrics_scrape.json"
MODEL = "tiny-llama"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=10.0, help="length of one trial")
    parser.add_argument("--trials", type=int, default=3, help="trials per mode")
    parser.add_argument("--interval", type=float, default=0.1, help="seconds between scrapes")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()

    process, port = start_server()
    try:
        asyncio.run(warm_up(port, args.max_tokens))
        trials: dict[str, list[dict]] = {"plain": [], "scraped": []}
        for trial in range(args.trials):
            for mode in ("plain", "scraped"):
                row = asyncio.run(run_trial(port, mode == "scraped", args))
                trials[mode].append(row)
                print(json.dumps({"trial": trial, "mode": mode, **row}), flush=True)
    finally:
        process.terminate()
        process.wait(60)

    summary = {mode: _median(rows) for mode, rows in trials.items()}
    render = render_cost()
    # Each scraped trial against the plain one just before it, then the median of those: drift
    # between pairs (another job starting on the machine) cancels out.
    ratio = {
        key: statistics.median(
            scraped[key] / plain[key]
            for plain, scraped in zip(trials["plain"], trials["scraped"], strict=True)
        )
        for key in ("requests_per_s", "latency_p50_s")
    }
    report = {
        "model": MODEL,
        "clients": args.clients,
        "seconds": args.seconds,
        "interval_s": args.interval,
        "max_tokens": args.max_tokens,
        "load_average": os.getloadavg(),
        "trials": trials,
        "median": summary,
        "ratio_scraped_over_plain": ratio,
        "render_in_process": render,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(
        f"\n{'mode':<8} {'req/s':>7} {'p50 s':>7} {'p99 s':>7} {'scrapes':>8} {'max scrape s':>13}"
    )
    for mode, row in summary.items():
        print(
            f"{mode:<8} {row['requests_per_s']:>7.1f} {row['latency_p50_s']:>7.3f} "
            f"{row['latency_p99_s']:>7.3f} {row['scrapes']:>8.0f} {row['scrape_max_s']:>13.4f}"
        )
    print(
        f"ratio scraped/plain (median of pairs): req/s {ratio['requests_per_s']:.3f}, "
        f"p50 {ratio['latency_p50_s']:.3f}"
    )
    print(
        f"one render in process: {render['render_ms_few']:.2f} ms (a fresh server's series), "
        f"{render['render_ms_busy']:.2f} ms (30 latency series); a request's updates "
        f"{render['update_us']:.1f} us"
    )
    print(f"written to {args.out}")


def render_cost() -> dict[str, float]:
    """What a scrape and a request cost the server's CPU, timed in this process on the server's
    own ServeMetrics: the render with a few series and with 30 (6 routes x 5 statuses), and the
    metric updates one request makes."""
    sys.path.insert(0, str(ROOT))
    from rollout.serve.metrics import ServeMetrics

    class Service:
        occupancy = (3, 8)

    metrics = ServeMetrics(Service())  # type: ignore[arg-type]
    metrics.latency.labels("/v1/chat/completions", "200").observe(0.1)
    few = _per_call(metrics.render, 500)
    routes = ["/v1/models", "/v1/completions", "/v1/chat/completions", "/metrics", "other", "e"]
    for route in routes:
        for status in ("200", "400", "401", "404", "503"):
            metrics.latency.labels(route, status).observe(0.1)
    busy = _per_call(metrics.render, 500)

    def update() -> None:
        metrics.in_flight.inc()
        metrics.tokens.inc(8)
        metrics.latency.labels("/v1/chat/completions", "200").observe(0.1)
        metrics.in_flight.dec()

    return {
        "render_ms_few": few * 1e3,
        "render_ms_busy": busy * 1e3,
        "update_us": _per_call(update, 50_000) * 1e6,
    }


def _per_call(function, count: int) -> float:
    started = time.perf_counter()
    for _ in range(count):
        function()
    return (time.perf_counter() - started) / count


def _median(rows: list[dict]) -> dict[str, float]:
    return {key: statistics.median(row[key] for row in rows) for key in rows[0]}


def start_server() -> tuple[subprocess.Popen, int]:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    command = [sys.executable, "-m", "rollout", "serve", "--model", f"builtin:{MODEL}"]
    command += ["--port", "0", "--device", "cpu"]
    process = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    assert process.stdout is not None
    for line in process.stdout:
        if "serving" in line:
            url = line.split(" at ")[1].split()[0]
            port = url.removeprefix("http://").removesuffix("/v1").rsplit(":", 1)[1]
            threading.Thread(target=process.stdout.read, daemon=True).start()  # drain
            return process, int(port)
    raise SystemExit(f"the server exited with {process.wait()} before serving")


async def exchange(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, method: str, path: str, body: bytes
) -> tuple[int, bytes]:
    head = f"{method} {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
    writer.write(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
    await writer.drain()
    status = int((await reader.readuntil(b"\r\n")).split()[1])
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


async def warm_up(port: int, max_tokens: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    for _ in range(3):
        status, answer = await exchange(
            reader, writer, "POST", "/v1/chat/completions", chat_body(max_tokens)
        )
        assert status == 200, answer
    writer.close()


async def run_trial(port: int, scraped: bool, args) -> dict[str, float]:
    latencies: list[float] = []
    scrapes: list[float] = []
    body = chat_body(args.max_tokens)
    started = time.perf_counter()
    end = started + args.seconds

    async def client() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        while time.perf_counter() < end:
            sent = time.perf_counter()
            status, answer = await exchange(reader, writer, "POST", "/v1/chat/completions", body)
            assert status == 200, answer
            latencies.append(time.perf_counter() - sent)
        writer.close()

    async def scraper() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        while time.perf_counter() < end:
            sent = time.perf_counter()
            status, text = await exchange(reader, writer, "GET", "/metrics", b"")
            assert status == 200 and b"rollout_serve_request_seconds" in text, text[:200]
            scrapes.append(time.perf_counter() - sent)
            await asyncio.sleep(args.interval)
        writer.close()

    tasks = [client() for _ in range(args.clients)] + ([scraper()] if scraped else [])
    await asyncio.gather(*tasks)
    wall = time.perf_counter() - started
    ordered = sorted(latencies)
    return {
        "requests_per_s": len(latencies) / wall,
        "latency_p50_s": statistics.median(ordered),
        "latency_p99_s": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        "scrapes": float(len(scrapes)),
        "scrape_max_s": max(scrapes, default=0.0),
    }


if __name__ == "__main__":
    main()
