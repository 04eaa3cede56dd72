"""`rollout plan --probe N`: sample the starting model on a few of the run's first prompts, score
them as the run will, and say whether the run can learn and how long a step will take.

A group whose N completions all score the same has advantage 0 for every token: GRPO and RLOO
learn nothing from it. When every probed group is like that, the reward is dead for this model
(always 0: the task is too hard or the reward never fires; always the same non-zero score: it is
constant or already solved), which today is found hours into a run, from a flat reward curve.

The step time is measured, not modelled: the probe's generation, scoring and one forward and
backward pass over its completions, scaled to the completions one process handles per step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from rollout.config.environment import episode_tokens
from rollout.engines.build import build_engine
from rollout.models.loading import load_model
from rollout.planner.definition import Plan
from rollout.runtime.data import PromptStream, load_records
from rollout.runtime.online.algorithms import ALGORITHMS
from rollout.runtime.online.batches import pad_for_learner
from rollout.runtime.online.trainer import _prompt_format, build_actor
from rollout.seeds import derive_seed


@dataclass(frozen=True)
class ProbeReport:
    prompts: int
    completions_per_prompt: int
    group_rewards: list[list[float]]
    """Each probed prompt's completions' rewards (episode returns with an environment)."""
    generate_s: float
    score_s: float
    train_s: float
    """One forward and backward pass over every probed completion."""
    step_s: float
    """Estimated seconds per training step of one process."""
    warnings: list[str] = field(default_factory=list)

    @property
    def uniform_groups(self) -> int:
        return sum(1 for group in self.group_rewards if len(set(group)) == 1)


def probe(plan: Plan, completions: int, prompts: int = 4) -> ProbeReport:
    """Sample `completions` per prompt for the first `prompts` prompts of the run's stream."""
    config = plan.config
    torch.manual_seed(plan.seeds.per_rank[0])
    device = "cuda" if plan.graph.device == "cuda" else "cpu"
    loaded = load_model(
        plan.model,
        config.model,
        dtype=plan.derived.dtype,
        device=device,
        base_dir=Path(plan.base_dir),
    )
    model = loaded.model.to(device)
    gen = config.generation
    engine = build_engine(
        "hf",  # the embedded engine: vLLM's start-up would dwarf what is measured
        model=model,
        tokenizer=loaded.tokenizer,
        eos_token_ids=loaded.eos_token_ids,
        pad_token_id=loaded.pad_token_id,
        device=device,
        max_batch_size=gen.max_batch_size,
        dtype=plan.derived.dtype,
        max_context=episode_tokens(gen.max_prompt_tokens, gen.max_new_tokens, config.environment),
    )
    kind = ALGORITHMS[config.algorithm.kind]
    actor = build_actor(plan, engine, _prompt_format(config, loaded), kind, loaded)
    actor.params = replace(actor.params, n=completions)
    rows = _first_rows(plan, prompts)
    rollout = actor.rollout(
        [row.record for row in rows], seed=derive_seed(plan.seeds.sampling, "probe")
    )
    batch = rollout.batch
    train_s = _forward_backward_s(
        model, batch, loaded.pad_token_id, device, plan.derived.micro_batch_size
    )

    probed = len(batch)
    per_step = plan.derived.prompts_per_rank * config.algorithm.num_generations
    scale = per_step / max(1, probed)
    generate_s = rollout.metrics["perf/generate_s"]
    score_s = rollout.metrics["perf/score_s"]
    epochs = getattr(config.algorithm, "update_epochs", 1)
    step_s = (generate_s + score_s + train_s * epochs) * scale
    rewards = batch.rewards.tolist()
    groups = [rewards[i : i + completions] for i in range(0, len(rewards), completions)]
    report = ProbeReport(
        prompts=len(rows),
        completions_per_prompt=completions,
        group_rewards=groups,
        generate_s=generate_s,
        score_s=score_s,
        train_s=train_s,
        step_s=step_s,
    )
    report.warnings.extend(_warnings(groups))
    return report


def _first_rows(plan: Plan, prompts: int):
    """The first prompts the run's first process would take (its data order, its shuffle)."""
    facts = next(f for f in plan.data if f.split == "train")
    records = load_records(facts.location, facts.format, plan.config.data.train.limit)
    stream = PromptStream(
        records, seed=plan.seeds.data, shuffle=plan.config.data.shuffle, rank=0, world_size=1
    )
    return stream.take(min(prompts, len(records)))


def _forward_backward_s(
    model: torch.nn.Module, batch, pad_token_id: int, device: str, micro_batch_size: int
) -> float:
    """Seconds for one forward and backward pass over the batch's sequences, a micro batch at a
    time as the learner goes (its memory bound: a whole batch's vocabulary logits at once can
    take gigabytes), less its optimizer step; the gradients are dropped after."""
    model.train()
    took = 0.0
    for start in range(0, len(batch), micro_batch_size):
        micro = batch.select(list(range(start, min(len(batch), start + micro_batch_size))))
        padded = pad_for_learner(micro, pad_token_id, device)
        began = time.perf_counter()
        logits = model(
            input_ids=padded.input_ids,
            attention_mask=padded.attention_mask,
            position_ids=padded.position_ids,
            logits_to_keep=padded.logits_to_keep,
        ).logits[:, :-1]
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        chosen = logprobs.gather(-1, padded.targets.unsqueeze(-1)).squeeze(-1)
        (chosen * padded.completion_mask).sum().backward()
        if device == "cuda":
            torch.cuda.synchronize()
        took += time.perf_counter() - began
        del logits, logprobs, chosen
    model.zero_grad(set_to_none=True)
    return took


def _warnings(groups: list[list[float]]) -> list[str]:
    if not groups or any(len(set(group)) > 1 for group in groups):
        return []
    values = sorted({group[0] for group in groups})
    if len(values) == 1 and values[0] == 0:
        return [
            "every probed completion scored 0: the advantages are all 0 and the run cannot "
            "learn; the task may be too hard for this model, or the reward never fires (check "
            "its fields and options on a few completions)"
        ]
    if len(values) == 1:
        return [
            f"every probed completion scored {values[0]:g}: the advantages are all 0 and the run "
            "cannot learn; the reward may be constant, or the model already solves these prompts"
        ]
    return [
        "every probed prompt's completions scored alike (each group uniform: "
        + ", ".join(f"{v:g}" for v in values)
        + "): the advantages are all 0; sample more completions per prompt "
        "(algorithm.num_generations), raise generation.temperature, or use prompts of mixed "
        "difficulty"
    ]
