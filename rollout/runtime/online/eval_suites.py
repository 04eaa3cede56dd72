"""[[eval.suites]] during training: the suites `rollout eval` runs, scored on the policy as it
trains, with the trainer's own engine, and recorded as the same metrics `rollout eval --run`
writes (eval/<suite>/<score>, eval/<suite>/<category>/<score>).

Checking, sampling and scoring are `rollout eval`'s (rollout.planner.eval_suites,
rollout.harness.eval.suites.run_suite): the same
prompts (data.use_chat_template, data.system_prompt), greedy with one sample unless a suite says
otherwise, seeded from run.seed. Every rank scores a shard of each suite's rows (row r on rank
r mod world size); rank 0 gathers every row's scores and summarizes them whole, so pass@k, maj@k
and the per-category lines are exactly those of one process scoring every row.
"""

from __future__ import annotations

import dataclasses
import logging
from functools import partial
from pathlib import Path
from typing import Any

import torch

from rollout.engines.base import SamplingParams, default_batch_size
from rollout.harness.eval.results import metric_names, suite_result
from rollout.harness.eval.scorers import SCORERS, FunctionScorer, Score, Scorer
from rollout.harness.eval.suites import CheckedSuite, Sampling, encode_suites, run_suite
from rollout.models.loading import LoadedModel
from rollout.planner.eval_suites import checked_suites, first, run_config_suites
from rollout.plugins.resolve import load_plugin
from rollout.runtime import transport
from rollout.runtime.context import WorkerContext
from rollout.storage.writer import BackgroundWriter

progress = logging.getLogger("rollout.progress")


@dataclasses.dataclass(frozen=True)
class _Shard:
    suite: CheckedSuite
    """The whole suite (every row), as rank 0 summarizes it."""
    mine: CheckedSuite
    """Only the rows this rank scores."""
    indices: list[int]
    """Their places in the whole suite."""
    prompt_ids: list[list[int]]


class SuiteEvaluator:
    """Runs every suite on this rank's shard; rank 0 records the scores."""

    def __init__(self, shards: list[_Shard], sampling: Sampling, loaded: LoadedModel) -> None:
        self.shards, self.sampling, self.loaded = shards, sampling, loaded

    def run(self, ctx: WorkerContext, writer: BackgroundWriter, step: int) -> None:
        """Every rank calls it at the same steps (the scores are gathered: a collective)."""
        model = self.loaded.model
        training = model.training
        model.eval()
        metrics: dict[str, float] = {}
        try:
            with torch.no_grad():
                for shard in self.shards:
                    metrics |= self._suite(ctx, shard)
        finally:
            model.train(training)
        if ctx.is_main:
            writer.write_metrics(ctx.plan.run_id, step, metrics)
            shown = ", ".join(
                f"{shard.suite.name} {metrics[f'eval/{shard.suite.name}/score']:.3g}"
                for shard in self.shards
            )
            progress.info("eval suites at step %d: %s", step, shown)

    def _suite(self, ctx: WorkerContext, shard: _Shard) -> dict[str, float]:
        suite = shard.suite
        _, scored = run_suite(shard.mine, shard.prompt_ids, self.sampling, self.loaded)
        local = [
            [index, [[s.value, s.correct, s.answer] for s in scores]]
            for index, scores in zip(shard.indices, scored, strict=True)
        ]
        parts = transport.gather_state(local) if ctx.world_size > 1 else [local]
        if not ctx.is_main:
            return {}
        by_row = {index: scores for part in parts for index, scores in part}
        whole = [[Score(*score) for score in by_row[i]] for i in range(len(suite.rows))]
        return metric_names(suite_result(suite, None, whole))


def build_suite_evaluator(
    ctx: WorkerContext, engine: Any, loaded: LoadedModel, model: torch.nn.Module
) -> SuiteEvaluator | None:
    """The run's suites, read and encoded once; None without [eval]. `model` is the policy the
    learner trains (log-likelihood suites score with it; the engine samples with it)."""
    plan, config = ctx.plan, ctx.plan.config
    if config.eval is None:
        return None
    planned = {
        f"eval.suites[{index}].scorer": facts.scorer_plugin
        for index, facts in enumerate(plan.eval_suites)
    }

    def load(ref: str, _base: Path, used_by: str) -> tuple[Scorer, dict[str, Any] | None]:
        """What the planner resolved, loaded (never resolved again)."""
        if ref in SCORERS:
            return SCORERS[ref], None
        identity = planned[used_by]
        assert identity is not None  # the planner records every plugin scorer
        return FunctionScorer(ref, load_plugin(identity)), identity.model_dump(mode="json")

    suites = checked_suites(
        run_config_suites(config.eval.suites, Path(plan.base_dir)), config.generation, load
    )
    loaded = dataclasses.replace(loaded, model=model)
    indices = [list(range(ctx.rank, len(suite.rows), ctx.world_size)) for suite in suites]
    mine = [
        dataclasses.replace(
            suite, rows=[suite.rows[i] for i in rows], places=[suite.places[i] for i in rows]
        )
        for suite, rows in zip(suites, indices, strict=True)
    ]
    prompt_ids = encode_suites(
        mine,
        loaded,
        context=plan.model.context_length,
        description="the policy",
        templated=config.data.use_chat_template,
        system_prompt=config.data.system_prompt,
    )
    generation = config.generation
    sampling = Sampling(
        engine,
        partial(SamplingParams, top_k=generation.top_k, stop=tuple(generation.stop)),
        first(generation.max_batch_size, default_batch_size(generation.engine)),
        config.run.seed,
    )
    shards = [
        _Shard(suite, part, rows, ids)
        for suite, part, rows, ids in zip(suites, mine, indices, prompt_ids, strict=True)
    ]
    return SuiteEvaluator(shards, sampling, loaded)
