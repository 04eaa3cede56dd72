"""What this version of rollout can execute: the one list of refusals that `plan` and `run` share.

The plan guarantee: a plan that succeeds does not fail at run time on config, schema, plugin
discovery or topology. So everything the executor or a worker cannot do yet is refused here, and
this function is called twice: by the builder while planning, and by the executor's preflight on
the plan.lock it is handed (one written by another rollout, or edited with a recomputed hash).
Each refusal names the key, why, and what works instead; a later version lifts one by deleting
its check.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator

from rollout.config.algorithm import ONLINE_KINDS, OnPolicyKnobs
from rollout.config.root import RunConfig
from rollout.errors import Issue
from rollout.files import is_url
from rollout.planner.criu_check import criu_problem
from rollout.planner.definition import Graph
from rollout.planner.location_check import writable_issue
from rollout.planner.object_stores import OBJECT_STORES, scheme
from rollout.planner.placement import is_disaggregated, restartable_ranks

Check = Callable[[RunConfig, Graph | None], Iterator[Issue]]
CHECKS: list[Check] = []


def check(fn: Check) -> Check:
    CHECKS.append(fn)
    return fn


def run_refusals(config: RunConfig, graph: Graph | None = None) -> list[Issue]:
    """Every reason `rollout run` would refuse this config (and graph, when there is one)."""
    return [issue for fn in CHECKS for issue in fn(config, graph)]


@check
def _store_backend(config: RunConfig, graph: Graph | None) -> Iterator[Issue]:
    if config.storage.backend == "postgres" and importlib.util.find_spec("psycopg") is None:
        yield Issue(
            "storage.backend",
            "the postgres run store needs psycopg 3, which is not installed here",
            value="postgres",
            hint="pip install 'rollout[postgres]' (or: pip install 'psycopg[binary]>=3.1')",
        )


@check
def _placement(config: RunConfig, graph: Graph | None) -> Iterator[Issue]:
    """Colocated (every role on every process) and disaggregated (actors on some processes,
    learners on the others) both run; a placement that overlaps them partly does not."""
    if graph is None or not is_disaggregated(graph):
        return
    ranks = {role.role: role.ranks for role in graph.roles}
    actors, learners = set(ranks["actor"]), set(ranks["learner"])
    if actors & learners:
        yield Issue(
            "cluster.placement",
            f"actor ranks {sorted(actors)} and learner ranks {sorted(learners)} overlap without "
            "being the same: a process runs either every role (colocated) or one side",
            hint="give actors and learners disjoint ranks, e.g. { actor = [0], learner = [1] }, "
            "or remove [cluster.placement] to colocate every role",
        )
    for role, follows in (("reward", "actor"), ("reference", "learner"), ("critic", "learner")):
        if role in ranks and ranks[role] != ranks[follows]:
            yield Issue(
                f"cluster.placement.{role}",
                f"the {role} runs beside the {follows} in this version of rollout (on ranks "
                f"{ranks[follows]}), not on ranks {ranks[role]}",
                hint=f"remove {role} from cluster.placement: it follows the {follows}",
            )
    if config.model.lora is not None:
        yield Issue(
            "model.lora",
            "LoRA runs on colocated placements only in this version of rollout: its adapters "
            "are saved through peft, which writes on global rank 0 alone, and the learner of "
            "a disaggregated run is another rank",
            hint="remove [cluster.placement], or [model.lora] to train every weight",
        )
    if config.eval is not None:
        yield Issue(
            "eval",
            "eval suites run on colocated placements only in this version of rollout; with "
            "actors and learners on separate processes they would be skipped",
            hint="remove [eval] (score the checkpoints with `rollout eval --run`), or remove "
            "[cluster.placement]",
        )


@check
def _restarts(config: RunConfig, graph: Graph | None) -> Iterator[Issue]:
    """A restart is worth it only for ranks that hold no learner state, and only node 0's host
    restarts (a joining node's agent ends with its workers)."""
    wanted = config.cluster.max_restarts
    if graph is None or not wanted:
        return
    if not restartable_ranks(graph):
        yield Issue(
            "cluster.max_restarts",
            "every rank of this run holds learner state (colocated, every process runs every "
            "role): a rank that dies takes the steps since the last checkpoint with it, so the "
            "run fails and resumes from that checkpoint when the plan is run again; there is "
            "nothing to restart",
            value=wanted,
            hint="set max_restarts = 0 (or remove it), or give actors ranks of their own, e.g. "
            "[cluster] nproc_per_node = 2, placement = { actor = [0], learner = [1] }",
        )
    elif graph.nnodes > 1:
        yield Issue(
            "cluster.max_restarts",
            f"restarts work on one node in this version of rollout; this run has {graph.nnodes}",
            value=wanted,
            hint="set max_restarts = 0: a failed run resumes from its newest checkpoint when "
            "`rollout run --plan plan.lock` (and each node's --node-rank K) is run again",
        )


@check
def _queue_needs_several_actors(config: RunConfig, graph: Graph | None) -> Iterator[Issue]:
    """The work queue shares a step's prompts among actor processes; with one (or every role
    in every process) there is nothing to share, so its chunk size would be ignored."""
    chunk = config.cluster.queue_chunk_size
    if graph is None or chunk is None:
        return
    actors = next((len(r.ranks) for r in graph.roles if r.role == "actor"), 0)
    if not isinstance(config.algorithm, OnPolicyKnobs) or not is_disaggregated(graph) or actors < 2:
        has = (
            "one actor process"
            if actors == 1 and is_disaggregated(graph)
            else "no actor processes apart from its learners"
        )
        yield Issue(
            "cluster.queue_chunk_size",
            "the work queue hands a step's prompts to several actor processes; this run has "
            f"{has}, so a chunk size would be ignored",
            value=chunk,
            hint="remove cluster.queue_chunk_size, or give actors two ranks or more, e.g. "
            "[cluster] nproc_per_node = 3, placement = { actor = [0, 1], learner = [2] }",
        )


@check
def _staleness_needs_disaggregation(config: RunConfig, graph: Graph | None) -> Iterator[Issue]:
    algo = config.algorithm
    if not isinstance(algo, OnPolicyKnobs):
        return
    staleness = algo.max_staleness
    if graph is not None and staleness > 0 and not is_disaggregated(graph):
        yield Issue(
            "algorithm.max_staleness",
            "with every role in every process, generation and training take turns: there is "
            "nothing to overlap, so no sample can be stale",
            value=staleness,
            hint="set max_staleness = 0, or place actors and learners on separate processes, "
            "e.g. [cluster] nproc_per_node = 2, placement = { actor = [0], learner = [1] }",
        )


@check
def _local_model_files(config: RunConfig, graph: Graph | None) -> Iterator[Issue]:
    model = config.model
    remote = [
        (key, value)
        for key, value in (("model.path", model.path), ("model.tokenizer", model.tokenizer))
        if value is not None and is_url(value)
    ]
    if (
        model.chat_template
        and model.chat_template.endswith(".jinja")
        and is_url(model.chat_template)
    ):
        remote.append(("model.chat_template", model.chat_template))
    remote += [
        (f"rewards[{i}].model", spec.model)
        for i, spec in enumerate(config.rewards)
        if spec.model is not None and is_url(spec.model)
    ]
    for key, value in remote:
        yield Issue(
            key,
            "workers load models, tokenizers and templates from local files only in this version "
            "of rollout",
            value=value,
            hint="copy it to a local directory and point the key at that",
        )


@check
def _lora_needs_peft(config: RunConfig, graph: Graph | None) -> Iterator[Issue]:
    # find_spec locates peft without importing it (which would import torch).
    if config.model.lora is not None and importlib.util.find_spec("peft") is None:
        yield Issue(
            "model.lora",
            "LoRA adapters are built with the peft package, which is not installed here",
            hint="pip install 'rollout[lora]' (or pip install 'peft>=0.13'), or remove "
            "[model.lora] to train every weight",
        )


@check
def _process_snapshots(config: RunConfig, graph: Graph | None) -> Iterator[Issue]:
    if not config.snapshot.process:
        return
    problem = criu_problem()
    if problem is not None:
        yield Issue(
            "snapshot.process",
            f"process snapshots need a usable CRIU, and {problem}",
            value=True,
            hint="on a host where `criu check` passes (apt-get install criu; run as root or "
            "with CAP_CHECKPOINT_RESTORE), or set snapshot.process = false: `rollout snapshot "
            "save` then snapshots the newest checkpoint only",
        )


@check
def _writable_locations(config: RunConfig, graph: Graph | None) -> Iterator[Issue]:
    """Every URL the run writes to: checked over the wire (a probe object written and removed)."""
    location = config.storage.artifacts
    if location is not None:
        issue = writable_issue(location, "storage.artifacts", "checkpoints")
        if issue is not None:
            yield issue


@check
def _mlflow_uri(config: RunConfig, graph: Graph | None) -> Iterator[Issue]:
    uri = config.logging.mlflow_tracking_uri
    if uri is not None and scheme(uri) in OBJECT_STORES:
        yield Issue(
            "logging.mlflow_tracking_uri",
            f"MLflow keeps its runs at a tracking server or in a local file store, not on an "
            f"object store ({scheme(uri)}://)",
            value=uri,
            hint="point it at a tracking server (http://host:5000, whose artifact store can be "
            "on s3 or gs) or a local directory",
        )


@check
def _sharding(config: RunConfig, graph: Graph | None) -> Iterator[Issue]:
    if config.cluster.sharding != "fsdp":
        return
    if config.algorithm.kind in ONLINE_KINDS:
        yield from _sharded_online(config, graph)
    if config.algorithm.kind == "rm":
        yield Issue(
            "cluster.sharding",
            "a reward model scores with its trunk and score head called one by one, outside the "
            "model's own forward, where FSDP would hand them their shards, not whole weights. "
            "This version shards dpo, ipo, kto and sft learners, and grpo, rloo and reinforce_pp "
            "learners on ranks of their own",
            value="fsdp",
            hint='set cluster.sharding = "none" (every rank holds the whole model)',
        )
    if config.model.lora is not None:
        yield Issue(
            "cluster.sharding",
            "sharding LoRA runs is not supported yet: the adapters are small, and the frozen base "
            "model is what FSDP would shard, which this version does not do",
            value="fsdp",
            hint='set cluster.sharding = "none" with [model.lora], or remove [model.lora]',
        )


def _sharded_online(config: RunConfig, graph: Graph | None) -> Iterator[Issue]:
    """An online kind shards learners that never generate: actors on ranks of their own, and at
    least two learners to shard over. PPO's critic is not sharded in this version."""
    kind = config.algorithm.kind
    colocated = not is_disaggregated(graph) if graph is not None else not config.cluster.placement
    if colocated:
        yield Issue(
            "cluster.sharding",
            f"{kind} colocated generates with the learner's own model, and an FSDP-sharded "
            "model gathers each layer from every rank on each forward: every rank would have to "
            "take the same number of decode steps, which the generation engine does not arrange",
            value="fsdp",
            hint="put the actors on ranks of their own, e.g. [cluster] nproc_per_node = 3, "
            'placement = { actor = [0], learner = [1, 2] }, or set cluster.sharding = "none"',
        )
        return
    learners = next((r.ranks for r in graph.roles if r.role == "learner"), []) if graph else []
    if graph is not None and len(learners) < 2:
        yield Issue(
            "cluster.sharding",
            f"FSDP shards the learner over the learner ranks, and this placement has "
            f"{len(learners)} ({learners}): there is nothing to shard it over",
            value="fsdp",
            hint="give the learners 2 or more ranks, e.g. placement = { actor = [0], "
            'learner = [1, 2] } with nproc_per_node = 3, or set cluster.sharding = "none"',
        )
    if kind == "ppo":
        yield Issue(
            "cluster.sharding",
            "PPO's critic (a value head on the policy's trunk, or a separate value model) is "
            "called outside the policy's own forward, where FSDP would hand it shards, not "
            "whole weights; this version shards grpo, rloo and reinforce_pp learners only",
            value="fsdp",
            hint='set cluster.sharding = "none" for PPO',
        )
