"""Held-out evaluation (data.eval) of a split run: played by the actors, where the engine and
the environment are; recorded by the learners, which record every metric.

An actor evaluates each policy version it loads that is due (version 0, every
run.eval_interval-th, the last), right as it loads it: its shard of the eval rows (its index among
the actors), as colocated rank i evaluates shard i, on the same seed, so a run with one actor
records the colocated run's eval/* numbers. It sends the sums and their count to the first
learner before anything else it sends after loading that version.

The learners take them in that same order: before receiving batch t (which the actors sampled
after loading version max(start, t - 1 - k)), the evaluations of the due versions up to that one;
after the last step, those of the versions up to the last. So each sender's messages are taken
in the order they were sent (NCCL matches in order, whatever the tag), the learners never wait
for an evaluation the actors could not have started, and a checkpoint's batches received ahead
take theirs along. A resumed run's actors evaluate the checkpoint's version again when it is due
(the stopped run may not have received it); the store keeps the newer, equal, values.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from rollout.runtime import weight_sync
from rollout.runtime.online import trainer as colocated

if TYPE_CHECKING:
    from rollout.planner.definition import Plan
    from rollout.runtime.context import WorkerContext
    from rollout.storage.writer import BackgroundWriter

_TAG = 1 << 30
"""Evaluation messages' tags: above every tag of rollout.runtime.online.shared_prompts."""


def due(plan: Plan, version: int) -> bool:
    """Whether the policy of `version` is evaluated (the colocated loop evaluates after the same
    steps)."""
    if not plan.derived.evaluates:
        return False
    interval = plan.config.run.eval_interval
    last = plan.derived.total_steps
    return version in (0, last) or bool(interval and version % interval == 0)


def _tag(version: int) -> int:
    return _TAG | (version % 16384)


class ActorEvaluation:
    """An actor's side: evaluates each due version it loads, sends the first learner the sums."""

    def __init__(self, ctx: WorkerContext, groups: weight_sync.Groups, actor, engine, prompts):
        self.ctx, self.groups = ctx, groups
        self.actor, self.engine, self.prompt_format = actor, engine, prompts
        self.rows: list[dict[str, Any]] = []
        self.seconds = 0.0
        """Spent evaluating (not waiting for weights: perf/actor_wait_s leaves it out)."""
        if ctx.plan.derived.evaluates:
            index = groups.actors.index(ctx.rank)
            _, self.rows = colocated.load_data(ctx, rank=index, world_size=len(groups.actors))

    def after_loading(self, version: int) -> list[weight_sync.Sent]:
        if not due(self.ctx.plan, version):
            return []
        started = time.perf_counter()
        sums, count = colocated.evaluation_sums(
            self.ctx.plan, self.actor, self.engine, self.prompt_format, self.rows
        )
        self.seconds += time.perf_counter() - started
        message = {"version": version, "sums": sums, "count": count}
        return [weight_sync.send_message(message, [], self.groups.source, _tag(version))]


class LearnerEvaluation:
    """The first learner's side: takes the due evaluations in the actors' order and records
    their means over every actor's samples (other learners take none: nothing is reduced)."""

    def __init__(
        self, ctx: WorkerContext, writer: BackgroundWriter, groups: weight_sync.Groups, start: int
    ):
        self.ctx, self.writer, self.groups = ctx, writer, groups
        self.taken = start - 1
        """The versions up to this one are recorded (or not due)."""

    def take_through(self, version: int) -> None:
        """Record the evaluations of the due versions after those taken, up to `version`."""
        if self.ctx.rank == self.groups.source:
            for due_version in range(self.taken + 1, version + 1):
                if due(self.ctx.plan, due_version):
                    self._record(due_version)
        self.taken = max(self.taken, version)

    def _record(self, version: int) -> None:
        sums: dict[str, float] = {}
        count = 0
        for actor in self.groups.actors:
            message, _ = weight_sync.recv_message(actor, _tag(version))
            if message["version"] != version:
                raise RuntimeError(
                    f"expected the evaluation of version {version} from rank {actor}, got "
                    f"version {message['version']}'s"
                )
            for name, value in message["sums"].items():
                sums[name] = sums.get(name, 0.0) + value
            count += message["count"]
        # Means over every actor's samples, as record_means takes them over colocated ranks'.
        means = {name: total / max(1, count) for name, total in sorted(sums.items())}
        self.writer.write_metrics(self.ctx.plan.run_id, version, means)
