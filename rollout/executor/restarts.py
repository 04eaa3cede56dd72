"""Start a run's processes again after an actor rank dies; fail it when a learner does.

torchrun's own `--max-restarts` restarts every worker whatever rank failed: it cannot tell an
actor (whose work is sampling, redone from the checkpoint's data cursor) from a learner (whose
optimizer steps since the last checkpoint die with it). So the host runs torchrun with
`--max_restarts=0` and restarts it itself, deciding on the rank that ended the attempt
(rollout.executor.failure.first_death):

- a rank that holds no learner state (rollout.planner.placement.restartable_ranks) while
  `cluster.max_restarts` allows: the world starts again, every worker resumes from the newest
  committed checkpoint and the steps since are done again (their metrics overwrite the
  earlier attempt's: the store keeps one value per run, name and step);
- a learner rank, or any rank of a colocated run: the run fails at once, naming the rank, its
  role and step, and how to resume;
- the restarts spent: the run fails, saying how many there were and the last cause.

Each restart is recorded where a user looks: a warning in the run's logs (by the dead rank and
its role) and the metric `run/restarts` (the count, over every start of the run, at the run's
last recorded step), which `rollout runs show` lists with the other latest metrics.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from rollout.executor.failure import Death, rank_name
from rollout.planner.definition import Plan
from rollout.planner.placement import restartable_ranks
from rollout.storage.base import MetricRecord, RunStore

RESTARTS_METRIC = "run/restarts"


@dataclass
class Restarts:
    """One host start's restart budget and what it has spent."""

    plan: Plan
    budget: int
    roles: dict[int, str]
    restartable: frozenset[int]
    done: int = 0
    earlier: int = 0
    """Restarts recorded by earlier starts of the run (the metric counts them all)."""
    causes: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, plan: Plan, node_rank: int, store: RunStore | None) -> Restarts:
        """Node 0's budget is cluster.max_restarts; a joining node never restarts (its agent
        ends with its workers, and the plan refuses restarts on several nodes)."""
        latest = None
        if node_rank == 0 and store is not None:
            latest = store.latest_metrics(plan.run_id).get(RESTARTS_METRIC)
        return cls(
            plan=plan,
            budget=plan.derived.max_restarts if node_rank == 0 else 0,
            roles={p.rank: "+".join(p.roles) for p in plan.graph.processes},
            restartable=frozenset(restartable_ranks(plan.graph)),
            earlier=int(latest.value) if latest is not None else 0,
        )

    def allows(self, death: Death | None) -> bool:
        return death is not None and death.rank in self.restartable and self.done < self.budget

    def record(self, store: RunStore, death: Death, cause: str) -> str:
        """Count a restart after `death`; write it to the run's logs and metrics; return the
        line to show the user."""
        self.done += 1
        self.causes.append(cause)
        line = (
            f"{rank_name(death.rank, self.roles)} died {death.how()}{death.where()}; "
            f"restarting every process from the newest checkpoint (restart {self.done} of "
            f"cluster.max_restarts = {self.budget})"
        )
        now = time.time()
        run_id = self.plan.run_id
        record = store.get_run(run_id)
        step = record.last_step if record is not None and record.last_step is not None else 0
        with store.transaction():
            store.add_logs(
                [(run_id, now, "warning", death.rank, self.roles.get(death.rank, ""), line)]
            )
            store.add_metrics(
                [MetricRecord(run_id, step, RESTARTS_METRIC, float(self.earlier + self.done), now)]
            )
        return line

    def failure(
        self, death: Death | None, cause: str, plan_arg: str, store: RunStore | None
    ) -> str:
        """The run's error once it is not restarted: the cause, with why it was not restarted
        and how to go on."""
        if death is None:
            return cause
        resume = f"`rollout run --plan {plan_arg}` again resumes it from {_newest(store, self)}"
        if death.rank not in self.restartable:
            why = (
                "it holds learner state (its optimizer steps since the last checkpoint are gone "
                "with it), so the run is not restarted"
            )
        elif self.budget == 0:
            why = "cluster.max_restarts = 0 allows no restart"
        else:
            why = (
                f"the run was restarted {self.done} time(s) already, all that "
                f"cluster.max_restarts = {self.budget} allows (each restart's cause is a warning "
                "in the run's logs)"
            )
        who = f"{rank_name(death.rank, self.roles)} died {death.how()}{death.where()}"
        if cause.startswith(who):  # died without a traceback: the cause already says who, how
            first, _, rest = cause.partition("\n")
            return f"{first}: {why}; {resume}" + (f"\n{rest}" if rest else "")
        return f"{who}: {why}; {resume}\n{cause}"


def _newest(store: RunStore | None, restarts: Restarts) -> str:
    """The checkpoint a re-run resumes from, as the run store knows it (a joining node on a
    SQLite run cannot read it: node 0 keeps it)."""
    if store is None:
        return "its newest checkpoint"
    checkpoints = store.checkpoints(restarts.plan.run_id)
    return f"its checkpoint of step {checkpoints[-1].step}" if checkpoints else "its first step"
