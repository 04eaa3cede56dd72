"""rollout's GRPO against TRL's GRPOTrainer: the same job, side by side, in one invocation.

The job is examples/grpo-arith.toml cut to a timing run. On the CPU (the default there):
SmolLM2-135M-Instruct in fp32 with 2 threads, 2 addition prompts x 4 completions per step, at most
32 new tokens, the numeric_match reward, no KL, one optimizer update per step. On a GPU (the default
there): 8 prompts x 8 completions, 128 new tokens, bfloat16, a random-weight model of SmolLM2-135M's
shape unless --model names another (see bench_models.py); a random model never ends a completion
early on either side and is scored by letter_share (bench_rewards.py). Both sides run on the same
device in the same dtype. Each side runs in its own subprocess, so both pay their own start-up and
their peak RSS is measured the same way:

  rollout  the real CLI path: `rollout run --config COPY --set ...`; per-step times come from
           the run store (perf/step_s, perf/generate_s, perf/generated_tokens).
  TRL      GRPOTrainer in this script's hidden --trl-worker mode (trl is imported only there); a
           callback times each step, completions/mean_length gives the generated tokens.

The first --warmup steps of each side are run but not timed. The machines are noisy: compare the
two columns of one invocation, and quote the ratios.

    python benchmarks/grpo_vs_trl.py --steps 10
    python benchmarks/grpo_vs_trl.py --device cuda --model llama-700m --steps 10
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# This directory on the path: the benchmarks are not a package.
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

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "grpo-arith.toml"
RANDOM_REWARD = f"{Path(__file__).resolve().parent / 'bench_rewards.py'}:letter_share"
GPU_JOB = {"prompts": 8, "generations": 8, "new_tokens": 128}
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "grpo_vs_trl.json"
THREADS = 2
POLL_S = 0.5  # process-tree RSS sampling; coarse, so the sampler itself costs little CPU
GIB = 1 << 30
# Set before python starts: torch.set_num_threads at run time alone leaves small ops ~20x slower.
CHILD_ENV = {
    "OMP_NUM_THREADS": str(THREADS),
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "TOKENIZERS_PARALLELISM": "false",
}
ROLLOUT_PHASES = ("perf/score_s", "perf/learn_s", "perf/sync_s", "perf/cuda_alloc_retries")
"""rollout's other phases of a step and the CUDA allocator's retries (rollout.runtime.online.
trainer), recorded per step in the results, so that a slow step names its phase."""
ROLLOUT_METRICS = ("perf/step_s", "perf/generate_s", "perf/generated_tokens", *ROLLOUT_PHASES)


@dataclass(frozen=True)
class Job:
    """What both sides run, read from examples/grpo-arith.toml (plus the step counts)."""

    model_dir: str
    rollout_model: dict[str, Any]
    """rollout's [model] table (dtype included)."""
    device: str
    dtype: str
    reward: str
    """'numeric_match', or RANDOM_REWARD for a random-weight model."""
    train_path: str
    system_prompt: str
    lr: float
    temperature: float
    top_p: float
    max_new_tokens: int
    completions_per_step: int
    num_generations: int
    seed: int
    total_steps: int
    warmup: int


@dataclass(frozen=True)
class ProcessStats:
    wall_s: float
    peak_rss_gib: float
    """The largest single process of the tree (the worker): wait4's ru_maxrss, which covers
    every descendant its parent waited for."""
    tree_peak_rss_gib: float
    """The largest sum of RSS over the live process tree, sampled every POLL_S."""
    gpu_peak_gib: float | None = None
    """On cuda: the most GPU memory in use on device 0 (nvidia-smi's memory.used, sampled every
    POLL_S) above what was in use at launch. The whole device's: the parent never opens a CUDA
    context and the sides run one at a time, so it is the side's, if no other job uses the GPU
    (whose processes cannot be told apart from inside a container). None on cpu."""


@dataclass(frozen=True)
class Side:
    """One side's per-step series (timed steps only) and its process measurements."""

    name: str
    step_s: list[float]
    generate_s: list[float]
    generated_tokens: list[float]
    process: ProcessStats
    phases: dict[str, list[float]] | None = None
    """rollout only: ROLLOUT_PHASES, per timed step."""


# --- the job -------------------------------------------------------------------------------------


def build_job(args: argparse.Namespace) -> tuple[Job, dict[str, Any]]:
    """The job, and what the results record about its model and device."""
    from rollout.config.load import read_config_file

    example = read_config_file(EXAMPLE)
    algorithm, generation = example["algorithm"], example["generation"]
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    model = resolve_model(args.model, device)
    # The CPU job is the example's (2 x 4, 32 tokens), so CPU ratios stay comparable.
    default_generations = (
        GPU_JOB["generations"] if device == "cuda" else algorithm["num_generations"]
    )
    generations = args.generations or default_generations
    prompts = args.prompts or (
        GPU_JOB["prompts"] if device == "cuda" else algorithm["rollout_batch_size"] // generations
    )
    new_tokens = args.new_tokens or (
        GPU_JOB["new_tokens"] if device == "cuda" else generation["max_new_tokens"]
    )
    job = Job(
        model_dir=model.directory,
        rollout_model={**model.rollout_model, **rollout_precision(args.precision, dtype)},
        device=device,
        dtype=dtype,
        reward=RANDOM_REWARD if model.random else "numeric_match",
        train_path=str((EXAMPLE.parent / example["data"]["train"]["path"]).resolve()),
        system_prompt=example["data"]["system_prompt"],
        lr=algorithm["lr"],
        temperature=generation["temperature"],
        top_p=generation["top_p"],
        max_new_tokens=new_tokens,
        completions_per_step=prompts * generations,
        num_generations=generations,
        seed=example["run"]["seed"],
        total_steps=args.warmup + args.steps,
        warmup=args.warmup,
    )
    return job, describe(model, device, dtype)


# --- measuring a subprocess ----------------------------------------------------------------------


def run_measured(command: list[str], log_path: Path, *, gpu: bool = False) -> ProcessStats:
    """Run `command` with CHILD_ENV, its output into `log_path`; fail loudly if it fails.
    `gpu`: also sample the GPU memory in use (ProcessStats.gpu_peak_gib)."""
    import psutil  # a dependency of accelerate, which both sides need

    started = time.perf_counter()
    tree_peak = 0
    gpu_baseline = gpu_used_bytes() if gpu else None
    gpu_peak = gpu_baseline
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command, env={**os.environ, **CHILD_ENV}, stdout=log, stderr=subprocess.STDOUT
        )
        while True:
            # wait4, not Popen.wait: it also returns the finished tree's resource usage.
            pid, status, usage = os.wait4(process.pid, os.WNOHANG)
            if pid:
                break
            tree_peak = max(tree_peak, tree_rss(psutil, process.pid))
            if gpu_peak is not None:
                gpu_peak = max(gpu_peak, gpu_used_bytes() or 0)
            time.sleep(POLL_S)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        tail = log_path.read_text(encoding="utf-8", errors="replace").splitlines()[-30:]
        sys.exit(
            f"{' '.join(command[:4])} ... exited with {process.returncode}; "
            f"last lines of {log_path}:\n" + "\n".join(tail)
        )
    return ProcessStats(
        wall_s=time.perf_counter() - started,
        peak_rss_gib=usage.ru_maxrss * 1024 / GIB,  # kilobytes on Linux
        tree_peak_rss_gib=tree_peak / GIB,
        gpu_peak_gib=None
        if gpu_peak is None or gpu_baseline is None
        else (gpu_peak - gpu_baseline) / GIB,
    )


def gpu_used_bytes() -> int | None:
    """Memory in use on GPU 0, by nvidia-smi (None where it cannot tell)."""
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
        return int(float(done.stdout.strip().splitlines()[0])) << 20  # MiB
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def tree_rss(psutil: Any, pid: int) -> int:
    """Bytes resident in `pid` and all its descendants now (0 once it is gone)."""
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):  # exited between listing and reading
            total += process.memory_info().rss
    return total


# --- rollout -------------------------------------------------------------------------------------


def run_rollout(job: Job, workdir: Path, log: Path) -> Side:
    config = write_rollout_config(job, workdir)
    overrides = {
        "algorithm.max_steps": job.total_steps,
        "checkpoint.interval": job.total_steps + 1,  # only the final save, after the last step
        "checkpoint.save_optimizer": "false",
        "cluster.threads_per_process": THREADS,
        "run.output_dir": json.dumps(str(workdir / "rollout-runs")),
    }
    command = [rollout_cli(), "run", "--config", str(config)]
    for key, value in overrides.items():
        command += ["--set", f"{key}={value}"]
    print("rollout:", " ".join(command), flush=True)
    process = run_measured(command, log, gpu=job.device == "cuda")

    from rollout.planner.lockfile import read_plan

    (plan_path,) = (workdir / "rollout-runs").glob("*/plan.lock")
    series = read_rollout_metrics(read_plan(plan_path, check_fresh=False))
    timed = {name: values[job.warmup :] for name, values in series.items()}
    return Side(
        name="rollout",
        step_s=timed["perf/step_s"],
        generate_s=timed["perf/generate_s"],
        generated_tokens=timed["perf/generated_tokens"],
        process=process,
        phases={name: timed[name] for name in ROLLOUT_PHASES if timed[name]},
    )


def write_rollout_config(job: Job, workdir: Path) -> Path:
    """A copy of the example without evaluation (--set cannot remove a table), its data path made
    absolute since the copy lives elsewhere. Everything else changes through --set."""
    import tomli_w

    from rollout.config.load import read_config_file

    config = read_config_file(EXAMPLE)
    del config["data"]["eval"]
    del config["run"]["eval_interval"]
    config["data"]["train"]["path"] = job.train_path
    config["model"] = job.rollout_model
    config["cluster"]["device"] = job.device
    config["generation"]["max_new_tokens"] = job.max_new_tokens
    config["algorithm"].update(
        rollout_batch_size=job.completions_per_step,
        num_generations=job.num_generations,
        minibatch_size=job.completions_per_step,  # one optimizer update per step, as TRL's
    )
    config["rewards"] = [{"fn": job.reward}]
    path = workdir / "grpo-arith.toml"
    path.write_text(tomli_w.dumps(config), encoding="utf-8")
    return path


def rollout_cli() -> str:
    """The `rollout` console script of the interpreter running this benchmark."""
    beside = Path(sys.executable).with_name("rollout")
    return str(beside) if beside.exists() else "rollout"


def read_rollout_metrics(plan: Any) -> dict[str, list[float]]:
    """Each ROLLOUT_METRICS series in step order, from the run store the plan names."""
    from rollout.storage import open_store

    store = open_store(plan.derived.store, create=False)
    try:
        rows = store.metrics(plan.run_id, names=list(ROLLOUT_METRICS))
    finally:
        store.close()
    by_step: dict[str, dict[int, float]] = {name: {} for name in ROLLOUT_METRICS}
    for row in rows:
        by_step[row.name][row.step] = row.value
    return {name: [steps[s] for s in sorted(steps)] for name, steps in by_step.items()}


# --- TRL -----------------------------------------------------------------------------------------


TRL_DEFAULTS = "TRL, defaults"
"""The column of TRL as GRPOConfig ships (gradient checkpointing on), the setting the design's
baseline of 9.6 s/step was measured with; "TRL" turns it off, as rollout's job has it."""


def run_trl(job: Job, workdir: Path, log: Path, *, gradient_checkpointing: bool = False) -> Side:
    name = TRL_DEFAULTS if gradient_checkpointing else "TRL"
    stem = "trl-defaults" if gradient_checkpointing else "trl"
    job_path, result_path = workdir / f"{stem}-job.json", workdir / f"{stem}-result.json"
    job_path.write_text(
        json.dumps(
            {
                "job": asdict(job),
                "result": str(result_path),
                "gradient_checkpointing": gradient_checkpointing,
            }
        )
    )
    command = [sys.executable, str(Path(__file__).resolve()), "--trl-worker", str(job_path)]
    print(f"{name}:", " ".join(command), flush=True)
    process = run_measured(command, log, gpu=job.device == "cuda")
    series = json.loads(result_path.read_text())
    timed = {name: values[job.warmup :] for name, values in series.items()}
    return Side(
        name=name,
        step_s=timed["step_s"],
        generate_s=timed["generate_s"],
        generated_tokens=timed["generated_tokens"],
        process=process,
    )


def trl_worker(job_path: Path) -> None:
    """Inside the TRL subprocess: train, then write each step's times and token counts."""
    spec = json.loads(job_path.read_text())
    job = Job(**spec["job"])
    trainer, timer = build_trl_trainer(
        job,
        output_dir=job_path.parent / f"{job_path.stem}-output",
        gradient_checkpointing=spec.get("gradient_checkpointing", False),
    )
    trainer.train()
    steps = sorted(timer.step_s)
    if len(trainer.generate_s) != len(steps):
        raise RuntimeError(
            f"{len(trainer.generate_s)} generations for {len(steps)} steps: the timing hook "
            "no longer matches TRL's loop (one _generate call per step)"
        )
    series = {
        "step_s": [timer.step_s[s] for s in steps],
        "generate_s": trainer.generate_s,
        # TRL logs the mean completion length of the step's completions.
        "generated_tokens": [timer.mean_length[s] * job.completions_per_step for s in steps],
    }
    Path(spec["result"]).write_text(json.dumps(series))


def build_trl_trainer(
    job: Job, output_dir: Path, *, gradient_checkpointing: bool = False
) -> tuple[Any, Any]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    class StepTimer(TrainerCallback):
        """Wall time of each optimizer step (generation included) and its completion length."""

        def __init__(self) -> None:
            self.step_s: dict[int, float] = {}
            self.mean_length: dict[int, float] = {}
            self._started = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            synchronize()
            self._started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            synchronize()
            self.step_s[state.global_step] = time.perf_counter() - self._started

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                self.mean_length[state.global_step] = logs["completions/mean_length"]

    def synchronize() -> None:
        """Wait for the GPU's queued work, so that a step's time is the step's."""
        if job.device == "cuda":
            torch.cuda.synchronize()

    class TimedGRPOTrainer(GRPOTrainer):
        """Times generation (a private method of TRL 1.16: it samples the step's completions)."""

        generate_s: list[float]

        def _generate(self, *args, **kwargs):
            started = time.perf_counter()
            try:
                return super()._generate(*args, **kwargs)
            finally:
                self.generate_s.append(time.perf_counter() - started)

    config = GRPOConfig(
        output_dir=str(output_dir),
        max_steps=job.total_steps,
        learning_rate=job.lr,
        lr_scheduler_type="constant",
        per_device_train_batch_size=job.completions_per_step,
        gradient_accumulation_steps=1,
        generation_batch_size=job.completions_per_step,
        num_generations=job.num_generations,
        num_iterations=1,
        beta=0.0,
        loss_type="dapo",  # normalized by the batch's completion tokens: rollout's token_mean
        scale_rewards="group",
        max_completion_length=job.max_new_tokens,
        temperature=job.temperature,
        top_p=job.top_p,
        max_grad_norm=1.0,
        optim="adamw_torch",  # rollout's optimizer: torch.optim.AdamW
        # TRL's default is on; rollout's (and the job's) is off. On only for "TRL, defaults".
        gradient_checkpointing=gradient_checkpointing,
        use_cpu=job.device == "cpu",
        bf16=job.dtype == "bfloat16",  # on weights loaded in that dtype, as rollout's
        seed=job.seed,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_pin_memory=False,
    )
    model = AutoModelForCausalLM.from_pretrained(
        job.model_dir, dtype=getattr(torch, job.dtype), use_safetensors=True
    )
    tokenizer = AutoTokenizer.from_pretrained(job.model_dir)
    timer = StepTimer()
    trainer = TimedGRPOTrainer(
        model=model,
        reward_funcs=numeric_match_reward if job.reward == "numeric_match" else letter_share_reward,
        args=config,
        train_dataset=Dataset.from_list(trl_records(job)),
        processing_class=tokenizer,
        callbacks=[timer],
    )
    trainer.generate_s = []
    return trainer, timer


def trl_records(job: Job) -> list[dict[str, Any]]:
    """The training prompts as TRL conversations (system + user turn) with their answers."""
    records = []
    with open(job.train_path, encoding="utf-8") as lines:
        for line in lines:
            row = json.loads(line)
            prompt = [
                {"role": "system", "content": job.system_prompt},
                {"role": "user", "content": row["prompt"]},
            ]
            records.append({"prompt": prompt, "answer": row["answer"]})
    return records


def numeric_match_reward(prompts, completions, answer, **_columns) -> list[float]:
    """rollout's numeric_match in TRL's reward_funcs form: conversational completions are lists
    of messages, and dataset columns (here `answer`) arrive as keyword arguments."""
    from rollout.harness.rewards import numeric_match

    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return numeric_match(prompts, texts, answer=answer)


def letter_share_reward(prompts, completions, **_columns) -> list[float]:
    """bench_rewards.letter_share (rollout's reward for a random model) in TRL's form."""
    from bench_rewards import letter_share

    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return letter_share(prompts, texts)


# --- report --------------------------------------------------------------------------------------


def summarize(side: Side, completions_per_step: int) -> dict[str, Any]:
    total_s = sum(side.step_s)
    return {
        "timed_steps": len(side.step_s),
        "step_s_mean": statistics.mean(side.step_s),
        "step_s_median": statistics.median(side.step_s),
        "completions_per_s": completions_per_step * len(side.step_s) / total_s,
        "generated_tokens_per_s": sum(side.generated_tokens) / total_s,
        "generate_s_mean": statistics.mean(side.generate_s),
        "train_s_mean": statistics.mean(side.step_s) - statistics.mean(side.generate_s),
        **asdict(side.process),
        "step_s": side.step_s,
        "generate_s": side.generate_s,
        **({"phases": side.phases} if side.phases else {}),
    }


ROWS = (
    # (label, key, digits, ratio shown)
    ("seconds/step, mean", "step_s_mean", 2, True),
    ("seconds/step, median", "step_s_median", 2, False),
    ("completions/s", "completions_per_s", 3, True),
    ("generated tokens/s", "generated_tokens_per_s", 1, True),
    ("generation, s/step", "generate_s_mean", 2, True),
    ("training (rest of the step), s/step", "train_s_mean", 2, True),
    ("peak RSS, largest process (GiB)", "peak_rss_gib", 2, True),
    ("peak RSS, process tree (GiB)", "tree_peak_rss_gib", 2, True),
    ("peak GPU memory in use (GiB)", "gpu_peak_gib", 2, True),
    ("wall time with start-up (s)", "wall_s", 0, False),
)


def render(results: dict[str, dict[str, Any]], job: Job, model: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    names = list(results)
    baselines = [name for name in names if name != "rollout"] if "rollout" in results else []
    prompts = job.completions_per_step // job.num_generations
    threads = f", {THREADS} CPU threads" if job.device == "cpu" else ""
    table = Table(
        title=f"GRPO step: {model_label(model)}, {prompts} prompts x {job.num_generations} completions, "
        f"at most {job.max_new_tokens} new tokens{threads}"
    )
    table.add_column("")
    for name in names:
        table.add_column(name, justify="right")
    for name in baselines:
        table.add_column(f"rollout / {name}", justify="right")
    for label, key, digits, with_ratio in ROWS:
        if any(results[name][key] is None for name in names):
            continue  # the GPU row, on cpu
        cells = [f"{results[name][key]:.{digits}f}" for name in names]
        for name in baselines:
            ratio = results["rollout"][key] / results[name][key]
            cells.append(f"{ratio:.2f}x" if with_ratio else "")
        table.add_row(label, *cells)
    Console().print(table)


def ratios(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """rollout over each TRL column, keyed by that column's name."""
    if "rollout" not in results:
        return {}
    rollout = results["rollout"]
    return {
        name: {
            "completions_per_s": rollout["completions_per_s"] / trl["completions_per_s"],
            "peak_rss": rollout["peak_rss_gib"] / trl["peak_rss_gib"],
            "tree_peak_rss": rollout["tree_peak_rss_gib"] / trl["tree_peak_rss_gib"],
        }
        | (
            {"gpu_peak": rollout["gpu_peak_gib"] / trl["gpu_peak_gib"]}
            if rollout["gpu_peak_gib"] and trl["gpu_peak_gib"]
            else {}
        )
        for name, trl in results.items()
        if name != "rollout"
    }


def machine(load_before: tuple[float, float, float]) -> dict[str, Any]:
    """The machine and how busy it was: 1, 5 and 15 minute load averages before and after."""
    return {
        "cpu_count": os.cpu_count(),
        "threads": THREADS,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
    }


# --- main ----------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per side")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    parser.add_argument("--skip-trl", action="store_true", help="run rollout only")
    parser.add_argument("--skip-rollout", action="store_true", help="run TRL only")
    parser.add_argument(
        "--trl-defaults",
        action="store_true",
        help="also run TRL as it ships (gradient checkpointing on), as a third column",
    )
    add_model_options(parser)
    parser.add_argument(
        "--prompts", type=int, help="prompts per step (default: 8 on cuda, 2 on cpu)"
    )
    parser.add_argument(
        "--generations", type=int, help="completions per prompt (default: 8 on cuda, 4 on cpu)"
    )
    parser.add_argument(
        "--new-tokens",
        type=int,
        help="most new tokens per completion (default: 128 on cuda, 32 "
        "on cpu); a random-weight model generates exactly this many on both sides",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results JSON")
    parser.add_argument("--trl-worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be at least 1 and --warmup at least 0")
    if any(
        value is not None and value < 1
        for value in (args.prompts, args.generations, args.new_tokens)
    ):
        parser.error("--prompts, --generations and --new-tokens must be at least 1")
    if args.skip_trl and args.skip_rollout:
        parser.error("--skip-trl and --skip-rollout together leave nothing to run")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.trl_worker is not None:
        trl_worker(args.trl_worker)
        return
    job, model = build_job(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    logs = {
        name: args.out.with_name(f"{args.out.stem}.{name}.log")
        for name in ("rollout", "trl", "trl-defaults")
    }
    load_before = os.getloadavg()
    sides = []
    with tempfile.TemporaryDirectory(prefix="grpo-vs-trl-") as workdir:
        if not args.skip_rollout:
            sides.append(run_rollout(job, Path(workdir), logs["rollout"]))
        if not args.skip_trl:
            sides.append(run_trl(job, Path(workdir), logs["trl"]))
            if args.trl_defaults:
                sides.append(
                    run_trl(job, Path(workdir), logs["trl-defaults"], gradient_checkpointing=True)
                )
    results = {side.name: summarize(side, job.completions_per_step) for side in sides}
    render(results, job, model)
    report = {
        "job": asdict(job),
        "model": model,
        "machine": machine(load_before),
        "results": results,
        "ratios_rollout_over_trl": ratios(results),
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    written = [str(path) for path in logs.values() if path.exists()]
    print(f"results: {args.out}; each side's output: {', '.join(written)}")


if __name__ == "__main__":
    main()
