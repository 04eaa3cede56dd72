"""What a checkpoint costs the training loop: a local root against S3 (a moto server this script
starts on 127.0.0.1, in a process of its own), on SmolLM2-135M's shape with AdamW's state.

Each side trains the same random llama-135m model (SFT-shaped steps: --batch x --tokens tokens,
forward, backward, AdamW) for --steps steps and checkpoints every --interval steps the way a run
does (rollout.runtime.run_state: stage, then commit; under S3 the commit runs on the upload
thread while the next steps train). It reports, per side:

  blocking   the seconds a save held the loop up (perf/checkpoint_blocking_s in a run: staging,
             and under a local root the commit too; under S3 also waiting for the previous
             upload, if it had not finished)
  commit     the seconds the commit took (hashing, and the upload under S3)
  step       the median step time without a save, the saving steps (step + blocking) and the
             steps trained while an upload was in flight (the upload competes for the cores)

    python benchmarks/checkpoint_save.py --steps 8 --interval 3

`--staging-only` measures the part of an object-store save the step waits for, alone: staging
with fresh copy buffers against staging into the previous save's buffers (as a run does,
rollout.runtime.checkpoint.CopyBuffers), alternated --repeats times in one process, no upload.

    python benchmarks/checkpoint_save.py --staging-only --repeats 5
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

THREADS = 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-135m", help="a bench_models shape")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--interval", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--staging-only", action="store_true")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if args.staging_only:
        staging_only(args)
        return

    import torch
    from transformers.utils import logging as transformers_logging

    torch.set_num_threads(THREADS)
    transformers_logging.disable_progress_bar()
    with moto_server() as endpoint:
        import fsspec

        fsspec.filesystem("s3").mkdir("bench")
        with tempfile.TemporaryDirectory(prefix="rollout-ckpt-bench-") as local:
            results = {
                "local": run(args, Path(local) / "checkpoints"),
                "s3": run(args, "s3://bench/checkpoints"),
            }
    print(f"{args.model}, AdamW, {args.batch} x {args.tokens} tokens/step, {THREADS} threads")
    print(f"endpoint {endpoint}; checkpoint every {args.interval} steps of {args.steps}")
    for side, result in results.items():
        print(
            f"{side:>6}: checkpoint {result['bytes'] / 2**20:,.0f} MiB; "
            f"blocking {fmt(result['blocking'])} s; commit {fmt(result['commit'])} s"
        )
        plain = statistics.median(result["plain"])
        saving = statistics.median(result["saving"])
        during = result["during_upload"]
        print(
            f"        step {plain:.2f} s without a save; {saving:.2f} s saving "
            f"(+{100 * (saving / plain - 1):.1f}%)"
            + (
                f"; {statistics.median(during):.2f} s while uploading "
                f"(+{100 * (statistics.median(during) / plain - 1):.1f}%)"
                if during
                else ""
            )
        )


def run(args: argparse.Namespace, root: str | Path) -> dict:
    import torch
    from bench_models import random_model_dir
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollout.runtime.checkpoint import (
        CopyBuffers,
        commit_checkpoint,
        prune,
        stage_checkpoint,
    )
    from rollout.runtime.manifest import read_manifest
    from rollout.runtime.uploads import Uploads

    directory = random_model_dir(args.model, never_ends=False)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    generator = torch.Generator().manual_seed(0)
    batch = torch.randint(
        0, model.config.vocab_size, (args.batch, args.tokens), generator=generator
    )
    uploads = Uploads()
    buffers = CopyBuffers()  # one per run, as rollout.runtime.run_state.RunState holds it
    remote = isinstance(root, str)
    plain, saving, during, blocking, commit = [], [], [], [], []
    location = None

    def committed(staged) -> None:
        started = time.perf_counter()
        nonlocal location
        location = commit_checkpoint(staged)
        prune(root, 2)
        commit.append(time.perf_counter() - started)

    for step in range(1, args.steps + 1):
        uploading = uploads.in_flight
        started = time.perf_counter()
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - started
        if step % args.interval:
            (during if uploading and uploads.in_flight else plain).append(elapsed)
            continue
        started = time.perf_counter()
        uploads.wait()
        staged = stage_checkpoint(
            root,
            step,
            model=model,
            tokenizer=tokenizer,
            optimizer=optimizer,
            scheduler=scheduler,
            trainer_state={"step": step},
            run_id="bench",
            plan="bench",
            buffers=buffers,
        )
        if remote:
            uploads.start(f"upload of step {step}", lambda staged=staged: committed(staged))
        else:
            committed(staged)
        blocking.append(time.perf_counter() - started)
        saving.append(elapsed + blocking[-1])
    uploads.wait()
    size = sum(entry["size"] for entry in read_manifest(location)["files"].values())
    return {
        "plain": plain,
        "saving": saving,
        "during_upload": during,
        "blocking": blocking,
        "commit": commit,
        "bytes": size,
    }


def staging_only(args: argparse.Namespace) -> None:
    """Stage a remote checkpoint (nothing is uploaded: the staged files are removed) with fresh
    buffers and with reused ones, alternately; print the seconds of each and the ratio."""
    import shutil

    import torch
    from bench_models import random_model_dir
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollout.runtime.checkpoint import CopyBuffers, stage_checkpoint

    torch.set_num_threads(THREADS)
    directory = random_model_dir(args.model, never_ends=False)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    batch = torch.randint(0, model.config.vocab_size, (1, 16))
    model(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()  # AdamW's state exists: the checkpoint is weights + optimizer
    kept = CopyBuffers()
    times: dict[str, list[float]] = {"fresh": [], "reused": []}

    def stage(buffers: CopyBuffers) -> float:
        started = time.perf_counter()
        staged = stage_checkpoint(
            "s3://never-uploaded/checkpoints", 1, model=model, tokenizer=tokenizer,
            optimizer=optimizer, scheduler=None, trainer_state={}, buffers=buffers,
        )  # fmt: skip
        seconds = time.perf_counter() - started
        shutil.rmtree(staged.directory)
        staged.deferred.clear()
        return seconds

    stage(kept)  # the run's first save allocates the buffers it keeps
    for _ in range(args.repeats):
        times["fresh"].append(stage(CopyBuffers()))
        times["reused"].append(stage(kept))
    fresh, reused = (statistics.median(times[side]) for side in ("fresh", "reused"))
    print(f"{args.model} + AdamW state, staging for an object store, {THREADS} threads")
    print(f" fresh buffers: {fmt(times['fresh'])} s (median {fresh:.2f})")
    print(f"reused buffers: {fmt(times['reused'])} s (median {reused:.2f})")
    print(f"reused / fresh: {reused / fresh:.2f}")


def fmt(values: list[float]) -> str:
    return "/".join(f"{v:.2f}" for v in values)


class moto_server:
    """`python -m moto.server` on a free port of 127.0.0.1, its address in the environment
    (where s3fs's credential chain finds it), stopped on exit."""

    def __enter__(self) -> str:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        endpoint = f"http://127.0.0.1:{port}"
        os.environ.update(
            AWS_ACCESS_KEY_ID="bench",
            AWS_SECRET_ACCESS_KEY="bench",
            AWS_DEFAULT_REGION="us-east-1",
            AWS_ENDPOINT_URL_S3=endpoint,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    return endpoint
            time.sleep(0.1)
        self.__exit__()
        raise SystemExit("the moto server did not start")

    def __exit__(self, *_: object) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


if __name__ == "__main__":
    main()
