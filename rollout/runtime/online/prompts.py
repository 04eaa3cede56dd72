"""The prompts an online run trains and evaluates on, as this rank takes them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rollout.runtime.data import PromptStream, load_records

if TYPE_CHECKING:
    from rollout.runtime.context import WorkerContext


def load_data(ctx: WorkerContext) -> tuple[PromptStream, list[dict[str, Any]]]:
    """This rank's training stream and its shard of the evaluation set."""
    plan = ctx.plan
    facts = {f.split: f for f in plan.data}
    sources = {"train": plan.config.data.train, "eval": plan.config.data.eval}
    train = load_records(facts["train"].location, facts["train"].format, sources["train"].limit)
    stream = PromptStream(
        train,
        seed=plan.seeds.data,
        shuffle=plan.config.data.shuffle,
        rank=ctx.rank,
        world_size=ctx.world_size,
    )
    eval_rows: list[dict[str, Any]] = []
    if "eval" in facts and sources["eval"] is not None:
        everything = load_records(
            facts["eval"].location, facts["eval"].format, sources["eval"].limit
        )
        eval_rows = [dict(r) for r in everything[ctx.rank :: ctx.world_size]]
    return stream, eval_rows
