"""The whole run config: one model per area, assembled here."""

from __future__ import annotations

from pydantic import Field

from rollout.config.algorithm import AlgorithmConfig
from rollout.config.base import ConfigModel
from rollout.config.checkpoint import CheckpointSection
from rollout.config.cluster import ClusterSection
from rollout.config.data import DataSection
from rollout.config.environment import EnvironmentSection
from rollout.config.evaluation import EvalSection
from rollout.config.generation import GenerationSection
from rollout.config.logging import LoggingSection
from rollout.config.model import ModelSection
from rollout.config.rewards import RewardSpec
from rollout.config.run import RunSection
from rollout.config.snapshot import SnapshotSection
from rollout.config.storage import StorageSection


class RunConfig(ConfigModel):
    """A rollout run: model, data, objective, generation, rewards, hardware, storage."""

    run: RunSection = Field(default_factory=RunSection, description="Name, seed, output directory.")
    model: ModelSection = Field(description="The model to train.")
    data: DataSection = Field(description="Training (and evaluation) data.")
    algorithm: AlgorithmConfig = Field(
        description="The training objective; `kind` selects grpo, ppo, rloo, dpo, ipo, kto, sft "
        "or rm."
    )
    generation: GenerationSection = Field(
        default_factory=GenerationSection,
        description="Sampling settings (online algorithms only).",
    )
    rewards: list[RewardSpec] = Field(
        default_factory=list,
        description="Reward functions, combined by weight (online algorithms only).",
    )
    environment: EnvironmentSection | None = Field(
        default=None,
        description="What the model talks to in multi-turn episodes (online algorithms). Without "
        "it, each prompt gets one answer, scored by [[rewards]].",
    )
    eval: EvalSection | None = Field(
        default=None,
        description="Eval suites scored during training (online algorithms), at step 0, every "
        "run.eval_interval steps and at the last step. None: none.",
    )
    cluster: ClusterSection = Field(
        default_factory=ClusterSection, description="Nodes, processes, devices and role placement."
    )
    storage: StorageSection = Field(
        default_factory=StorageSection, description="Run store and artifact location."
    )
    checkpoint: CheckpointSection = Field(
        default_factory=CheckpointSection, description="Checkpoint interval and retention."
    )
    snapshot: SnapshotSection = Field(
        default_factory=SnapshotSection,
        description="What `rollout snapshot save` captures besides the newest checkpoint.",
    )
    logging: LoggingSection = Field(
        default_factory=LoggingSection, description="Metric trackers and log level."
    )
