"""The prompts an online run trains and evaluates on, as this rank takes them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rollout.runtime.data import PromptStream, load_records

if TYPE_CHECKING:
    from rollout.runtime.context import WorkerContext


def load_data(
    ctx: WorkerContext, *, rank: int | None = None, world_size: int | None = None
) -> tuple[PromptStream, list[dict[str, Any]]]:
    """This rank's training stream and its shard of the evaluation set: share `rank` of
    `world_size` (by default the process's own rank among all; an actor of a disaggregated run
    passes its index among the actors)."""
    plan = ctx.plan
    rank = ctx.rank if rank is None else rank
    world_size = ctx.world_size if world_size is None else world_size
    facts = {f.split: f for f in plan.data}
    sources = {"train": plan.config.data.train, "eval": plan.config.data.eval}
    train = load_records(facts["train"].location, facts["train"].format, sources["train"].limit)
    stream = PromptStream(
        train,
        seed=plan.seeds.data,
        shuffle=plan.config.data.shuffle,
        rank=rank,
        world_size=world_size,
    )
    eval_rows: list[dict[str, Any]] = []
    if "eval" in facts and sources["eval"] is not None:
        everything = load_records(
            facts["eval"].location, facts["eval"].format, sources["eval"].limit
        )
        eval_rows = [dict(r) for r in everything[rank::world_size]]
    return stream, eval_rows
