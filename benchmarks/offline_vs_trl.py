"""rollout's DPO and SFT against TRL's DPOTrainer and SFTTrainer, side by side in one invocation.

Two jobs, by default on SmolLM2-135M-Instruct in fp32 on the CPU with 2 threads (on a GPU: a
random-weight model of SmolLM2-135M's shape in bfloat16; --model, --device and --dtype choose, see
bench_models.py; every side runs on the same device in the same dtype), each side in its own
subprocess (OMP_NUM_THREADS=2 set before Python starts), peak RSS from wait4's ru_maxrss:

  DPO  8 preference pairs per step, about 69 tokens each (prompt + completion, chat template),
       beta 0.1, sigmoid loss, against the frozen initial model.
         rollout   `rollout run` with reference = "cached": the reference log-probs are computed
                   once before step 1 (timed apart) and the policy alone runs each step.
         TRL       DPOTrainer, whose reference model runs every step (its default).
  SFT  8 sequences x 128 tokens per step, loss on every token, no packing.
         rollout   `rollout run` (kind = "sft").
         TRL       SFTTrainer on the same texts.
         torch     the floor: a plain loop of forward, cross-entropy, backward and AdamW (fused,
                   as rollout's) on the same batches.

Everything else is matched: AdamW at the same constant learning rate, gradient norm clipped at 1
(not in the plain loop), no gradient checkpointing (TRL turns it on by default; neither rollout nor
the job does), no evaluation, no checkpoint until after the last step. The first --warmup steps are
run but not timed; throughput is read from the median timed step. Machines are noisy: compare the
columns of one invocation, quote ratios.

    python benchmarks/offline_vs_trl.py --steps 6 --warmup 2
    python benchmarks/offline_vs_trl.py --device cuda --model llama-700m
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# The GRPO benchmark's measuring helpers (subprocess + wait4 RSS, the CLI) and the models.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_models import (
    add_model_options,
    describe,
    model_label,
    resolve_device,
    resolve_dtype,
    resolve_model,
    rollout_precision,
)
from grpo_vs_trl import (
    THREADS,
    machine,
    rollout_cli,
    run_measured,
)

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "offline_vs_trl.json"
BATCH = 8
SFT_TOKENS = 128
LR = 5e-7
BETA = 0.1
SEED = 0


@dataclass(frozen=True)
class Job:
    kind: str  # "dpo" or "sft"
    model_dir: str
    rollout_model: dict[str, Any]
    """rollout's [model] table (dtype included)."""
    device: str
    dtype: str
    data_path: str
    max_length: int
    total_steps: int
    warmup: int


@dataclass(frozen=True)
class Side:
    name: str
    step_s: list[float]
    process: dict[str, float]
    setup_s: float | None = None
    """rollout's DPO: computing the cached reference log-probs, before step 1."""


# --- data ----------------------------------------------------------------------------------------


def dpo_records(count: int) -> list[dict[str, str]]:
    """Addition questions with a worked answer preferred over a wrong one: with SmolLM2's chat
    template (and the default system prompt it inserts) about 69 tokens each."""
    import random

    rng = random.Random(SEED)
    records = []
    for _ in range(count):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        wrong = a + b + rng.choice([-10, -1, 1, 10])
        records.append(
            {
                "prompt": f"What is {a} + {b}? Show the sum, then the answer.",
                "chosen": f"{a} + {b} = {a + b}. The answer is {a + b}.",
                "rejected": f"{a} + {b} = {wrong}. The answer is {wrong}.",
            }
        )
    return records


def sft_records(tokenizer: Any, count: int) -> list[dict[str, str]]:
    """Texts of exactly SFT_TOKENS - 1 tokens (the end-of-text token makes SFT_TOKENS)."""
    import random

    rng = random.Random(SEED)
    records = []
    while len(records) < count:
        sentences = []
        while len(tokenizer.encode(" ".join(sentences))) < SFT_TOKENS:
            a, b = rng.randint(1, 999), rng.randint(1, 999)
            sentences.append(f"The sum of {a} and {b} is {a + b}.")
        ids = tokenizer.encode(" ".join(sentences))[: SFT_TOKENS - 1]
        text = tokenizer.decode(ids)
        if len(tokenizer.encode(text)) == SFT_TOKENS - 1:  # the cut re-encodes the same
            records.append({"prompt": "", "completion": text})
    return records


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


def mean_tokens(job: Job) -> float:
    """Tokens of a sequence as rollout forms it (prompt + completion + end of turn)."""
    from transformers import AutoTokenizer

    from rollout.models.samples import HfTextTokenizer, SampleRules

    tokenizer = AutoTokenizer.from_pretrained(job.model_dir)
    eos = json.loads((Path(job.model_dir) / "generation_config.json").read_text())["eos_token_id"]
    rules = SampleRules(
        tokenizer=HfTextTokenizer(tokenizer, tokenizer.chat_template, eos),
        fields={
            "prompt": "prompt",
            "chosen": "chosen",
            "rejected": "rejected",
            "completion": "completion",
        },
        use_chat_template=job.kind == "dpo",
        completion_only_loss=False,
    )
    records = [json.loads(line) for line in Path(job.data_path).read_text().splitlines()]
    if job.kind == "sft":
        return statistics.mean(rules.sequence(r).length for r in records)
    pairs = [rules.pair(r) for r in records]
    return statistics.mean((2 * len(p.prompt) + len(p.chosen) + len(p.rejected)) / 2 for p in pairs)


# --- rollout -------------------------------------------------------------------------------------


def run_rollout(job: Job, workdir: Path, log: Path) -> Side:
    import tomli_w

    algorithm: dict[str, Any] = {
        "kind": job.kind,
        "lr": LR,
        "batch_size": BATCH,
        "max_steps": job.total_steps,
        "max_length": job.max_length,
        "max_grad_norm": 1.0,
    }
    if job.kind == "dpo":
        algorithm.update(beta=BETA, reference="cached")
        fields = {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected"}
    else:
        algorithm.update(completion_only_loss=False, packing=False)
        fields = {"prompt": "prompt", "completion": "completion"}
    config = {
        "run": {"name": f"bench-{job.kind}", "seed": SEED, "output_dir": str(workdir / "runs")},
        "model": job.rollout_model,
        "data": {
            "train": {"path": job.data_path},
            "fields": fields,
            "use_chat_template": job.kind == "dpo",
            "shuffle": False,
        },
        "algorithm": algorithm,
        "cluster": {"device": job.device, "threads_per_process": THREADS},
        "checkpoint": {"interval": job.total_steps + 1, "save_optimizer": False},
    }
    path = workdir / f"rollout-{job.kind}.toml"
    path.write_text(tomli_w.dumps(config), encoding="utf-8")
    command = [rollout_cli(), "run", "--config", str(path)]
    print("rollout:", " ".join(command), flush=True)
    process = run_measured(command, log, gpu=job.device == "cuda")

    from rollout.planner.lockfile import read_plan
    from rollout.storage import open_store

    (plan_path,) = (workdir / "runs").glob(f"bench-{job.kind}-*/plan.lock")
    plan = read_plan(plan_path, check_fresh=False)
    store = open_store(plan.derived.store, create=False)
    try:
        rows = sorted(store.metrics(plan.run_id, ["perf/step_s"]), key=lambda m: m.step)
        logs = store.logs(plan.run_id, limit=10_000)
    finally:
        store.close()
    return Side(
        name="rollout",
        step_s=[m.value for m in rows][job.warmup :],
        process=asdict(process),
        setup_s=_between(logs, "reference log-probs: computing", "training dpo")
        if job.kind == "dpo"
        else None,
    )


def _between(logs: list[Any], first: str, then: str) -> float | None:
    start = next((line.time for line in logs if line.message.startswith(first)), None)
    end = next((line.time for line in logs if line.message.startswith(then)), None)
    return None if start is None or end is None else end - start


# --- TRL and the plain loop (each in its own subprocess: this script's hidden --worker mode) -----


def run_worker(side: str, job: Job, workdir: Path, log: Path) -> Side:
    spec, result = workdir / f"{side}-{job.kind}.json", workdir / f"{side}-{job.kind}-result.json"
    spec.write_text(json.dumps({"side": side, "job": asdict(job), "result": str(result)}))
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", str(spec)]
    print(f"{side}:", " ".join(command), flush=True)
    process = run_measured(command, log, gpu=job.device == "cuda")
    step_s = json.loads(result.read_text())["step_s"]
    return Side(name=side, step_s=step_s[job.warmup :], process=asdict(process))


def worker(spec_path: Path) -> None:
    spec = json.loads(spec_path.read_text())
    job = Job(**spec["job"])
    output = spec_path.parent / f"{spec['side']}-{job.kind}-output"
    step_s = plain_torch_loop(job) if spec["side"] == "torch" else trl_train(job, output)
    Path(spec["result"]).write_text(json.dumps({"step_s": step_s}))


def trl_train(job: Job, output_dir: Path) -> list[float]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.step_s: list[float] = []
            self._started = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            synchronize(job.device)
            self._started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            synchronize(job.device)
            self.step_s.append(time.perf_counter() - self._started)

    common = {
        "output_dir": str(output_dir),
        "max_steps": job.total_steps,
        "learning_rate": LR,
        "lr_scheduler_type": "constant",
        "per_device_train_batch_size": BATCH,
        "gradient_accumulation_steps": 1,
        "max_grad_norm": 1.0,
        "optim": "adamw_torch_fused",  # rollout's optimizer: torch.optim.AdamW(fused=True)
        "gradient_checkpointing": False,  # TRL's default is on; rollout's (and the job's) is off
        "max_length": job.max_length,
        "use_cpu": job.device == "cpu",
        "bf16": job.dtype == "bfloat16",  # on weights loaded in that dtype, as rollout's
        "seed": SEED,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "dataloader_pin_memory": False,
    }
    model = AutoModelForCausalLM.from_pretrained(
        job.model_dir, dtype=getattr(torch, job.dtype), use_safetensors=True
    )
    tokenizer = AutoTokenizer.from_pretrained(job.model_dir)
    records = [json.loads(line) for line in Path(job.data_path).read_text().splitlines()]
    timer = StepTimer()
    if job.kind == "dpo":
        from trl import DPOConfig, DPOTrainer

        dataset = Dataset.from_list(
            [
                {
                    "prompt": [{"role": "user", "content": r["prompt"]}],
                    "chosen": [{"role": "assistant", "content": r["chosen"]}],
                    "rejected": [{"role": "assistant", "content": r["rejected"]}],
                }
                for r in records
            ]
        )
        trainer = DPOTrainer(
            model=model,
            args=DPOConfig(beta=BETA, loss_type=["sigmoid"], **common),
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[timer],
        )
    else:
        from trl import SFTConfig, SFTTrainer

        dataset = Dataset.from_list([{"text": r["completion"]} for r in records])
        trainer = SFTTrainer(
            model=model,
            args=SFTConfig(packing=False, dataset_text_field="text", **common),
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[timer],
        )
    trainer.train()
    return timer.step_s


def plain_torch_loop(job: Job) -> list[float]:
    """forward, cross-entropy over every next token, backward, AdamW: nothing else."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_pretrained(
        job.model_dir, dtype=getattr(torch, job.dtype), use_safetensors=True
    ).to(job.device)
    model.train()
    tokenizer = AutoTokenizer.from_pretrained(job.model_dir)
    eos = json.loads((Path(job.model_dir) / "generation_config.json").read_text())["eos_token_id"]
    records = [json.loads(line) for line in Path(job.data_path).read_text().splitlines()]
    rows = [[*tokenizer.encode(r["completion"]), eos] for r in records]
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    step_s = []
    for step in range(job.total_steps):
        synchronize(job.device)
        started = time.perf_counter()
        input_ids = torch.tensor(rows[step * BATCH : (step + 1) * BATCH], device=job.device)
        logits = model(input_ids=input_ids, use_cache=False).logits
        loss = F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), input_ids[:, 1:].reshape(-1)
        )
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(job.device)
        step_s.append(time.perf_counter() - started)
    return step_s


def synchronize(device: str) -> None:
    """Wait for the GPU's queued work, so that a step's time is the step's."""
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


# --- report --------------------------------------------------------------------------------------


def summarize(side: Side, tokens: float, unit: str) -> dict[str, Any]:
    """Throughput from the median step: other jobs on a shared machine slow single steps down
    many times over (a 2-thread OpenMP job waits for a core taken away), and the median shrugs
    off those steps where the mean does not."""
    median = statistics.median(side.step_s)
    summary = {
        "timed_steps": len(side.step_s),
        "step_s_mean": statistics.mean(side.step_s),
        "step_s_median": median,
        f"{unit}_per_s": BATCH / median,
        "tokens_per_s": BATCH * tokens / median,
        **side.process,
        "step_s": side.step_s,
    }
    if side.setup_s is not None:
        summary["reference_pass_s"] = side.setup_s
    return summary


ROWS = (
    # (label, key, digits, higher is better)
    ("seconds/step, mean", "step_s_mean", 2, False),
    ("seconds/step, median", "step_s_median", 2, False),
    ("{unit}/s (median step)", "{unit}_per_s", 3, True),
    ("tokens/s (median step)", "tokens_per_s", 0, True),
    ("peak RSS, largest process (GiB)", "peak_rss_gib", 2, False),
    ("peak RSS, process tree (GiB)", "tree_peak_rss_gib", 2, False),
    ("peak GPU memory in use (GiB)", "gpu_peak_gib", 2, False),
    ("wall time with start-up (s)", "wall_s", 0, False),
    ("reference pass before step 1 (s)", "reference_pass_s", 1, False),
)


def render(title: str, results: dict[str, dict[str, Any]], unit: str) -> None:
    from rich.console import Console
    from rich.table import Table

    names = list(results)
    others = [n for n in names if n != "rollout"]
    table = Table(title=title)
    table.add_column("")
    for name in names:
        table.add_column(name, justify="right")
    for other in others if "rollout" in results else []:
        table.add_column(f"rollout / {other}", justify="right")
    for label, key, digits, _ in ROWS:
        key = key.format(unit=unit)
        if not any(results[n].get(key) is not None for n in names):
            continue
        cells = [
            f"{results[n][key]:.{digits}f}" if results[n].get(key) is not None else ""
            for n in names
        ]
        for other in others if "rollout" in results else []:
            both = results["rollout"].get(key) is not None and results[other].get(key) is not None
            ratio = results["rollout"][key] / results[other][key] if both else None
            cells.append(f"{ratio:.2f}x" if ratio and key != "wall_s" else "")
        table.add_row(label.format(unit=unit), *cells)
    Console().print(table)


def ratios(results: dict[str, dict[str, Any]], unit: str) -> dict[str, float]:
    if "rollout" not in results:
        return {}
    rollout = results["rollout"]
    return (
        {
            f"{unit}_per_s_over_{name}": rollout[f"{unit}_per_s"] / side[f"{unit}_per_s"]
            for name, side in results.items()
            if name != "rollout"
        }
        | {
            f"peak_rss_over_{name}": rollout["peak_rss_gib"] / side["peak_rss_gib"]
            for name, side in results.items()
            if name != "rollout"
        }
        | {
            f"gpu_peak_over_{name}": rollout["gpu_peak_gib"] / side["gpu_peak_gib"]
            for name, side in results.items()
            if name != "rollout" and rollout["gpu_peak_gib"] and side["gpu_peak_gib"]
        }
    )


# --- main ----------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="timed steps per side")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    parser.add_argument("--jobs", nargs="+", choices=["dpo", "sft"], default=["dpo", "sft"])
    parser.add_argument(
        "--sides",
        nargs="+",
        choices=["rollout", "TRL", "torch"],
        default=["rollout", "TRL", "torch"],
        help="torch (the plain loop) runs for SFT only",
    )
    add_model_options(parser)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results JSON")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be at least 1 and --warmup at least 0")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker is not None:
        worker(args.worker)
        return
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    # SFT and DPO append eos to every sequence: a random model keeps a real one (never_ends off).
    model = resolve_model(args.model, device, never_ends=False)
    info = describe(model, device, dtype)
    model_dir = model.directory
    args.out.parent.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    report: dict[str, Any] = {"model": info, "jobs": {}}
    with tempfile.TemporaryDirectory(prefix="offline-vs-trl-") as tmp:
        workdir = Path(tmp)
        for kind in args.jobs:
            total = args.warmup + args.steps
            data = workdir / f"{kind}.jsonl"
            if kind == "dpo":
                write_jsonl(data, dpo_records(BATCH * total))
            else:
                from transformers import AutoTokenizer

                write_jsonl(
                    data, sft_records(AutoTokenizer.from_pretrained(model_dir), BATCH * total)
                )
            job = Job(
                kind,
                model_dir,
                {**model.rollout_model, **rollout_precision(args.precision, dtype)},
                device,
                dtype,
                str(data),
                256,
                total,
                args.warmup,
            )
            tokens = mean_tokens(job)
            unit = "pairs" if kind == "dpo" else "sequences"
            results = {}
            for side in args.sides:
                if side == "torch" and kind != "sft":
                    continue
                log = args.out.with_name(f"{args.out.stem}.{kind}.{side.lower()}.log")
                ran = (
                    run_rollout(job, workdir, log)
                    if side == "rollout"
                    else run_worker(side, job, workdir, log)
                )
                results[side] = summarize(ran, tokens, unit)
            threads = f", {THREADS} CPU threads" if device == "cpu" else ""
            title = (
                f"DPO step: {model_label(info)}, {BATCH} pairs of {tokens:.0f} tokens{threads}"
                if kind == "dpo"
                else f"SFT step: {model_label(info)}, {BATCH} x {tokens:.0f} tokens{threads}"
            )
            render(title, results, unit)
            report["jobs"][kind] = {
                "job": asdict(job),
                "tokens_per_sequence": tokens,
                "results": results,
                "ratios": ratios(results, unit),
            }
    report["machine"] = machine(load_before)
    args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
