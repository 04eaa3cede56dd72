"""The online kinds behind one record, looked up by algorithm kind (ALGORITHMS).

What sets GRPO, RLOO, REINFORCE++ and PPO apart inside a worker: the advantage the actor gives
each completion, whether a critic is trained, and whether the batch is then scored per token
(and how). The trainer (rollout.runtime.online.trainer) builds every kind's roles from this record
alone. Each knob is read from the kind's own config, whose defaults are the only ones.

Two choices are the plan's, computed once by the planner and read from `plan.derived`: whether a
frozen reference model is kept (`keeps_reference_model`: every online kind with kl_coef > 0), and
where its KL goes (`kl_in_reward`, rollout.config.rules.kl_in_reward: the token rewards for
REINFORCE++ and for PPO with kl_penalty = "reward", the loss otherwise).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from rollout.algorithms.advantages import ADVANTAGE_ESTIMATORS
from rollout.runtime.online.shaping import (
    GaeAdvantages,
    ReinforcePpAdvantages,
    Scoring,
    TokenAdvantages,
)

# [B] rewards, group size -> [B] advantages, one per completion
SequenceAdvantages = Callable[[torch.Tensor, int], torch.Tensor]


@dataclass(frozen=True)
class OnlineAlgorithm:
    sequence_advantages: Callable[[Any], SequenceAdvantages]
    """The kind's config -> the actor's advantage per completion."""
    critic: bool
    """Whether it trains a critic (rollout.runtime.online.critic) beside the policy."""
    token_advantages: Callable[[Any, Scoring], TokenAdvantages] | None = None
    """The kind's config and what scoring takes -> the scorer that gives the actor's batch
    per-token advantages before the learner sees it. None: the sequence advantages are final."""


def no_sequence_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Zeros: the kinds that score per token replace them (rollout.runtime.online.shaping)."""
    return torch.zeros_like(rewards)


ALGORITHMS: dict[str, OnlineAlgorithm] = {
    "grpo": OnlineAlgorithm(
        sequence_advantages=lambda algo: partial(
            ADVANTAGE_ESTIMATORS["grpo"], scale=algo.scale_rewards
        ),
        critic=False,
    ),
    "rloo": OnlineAlgorithm(
        sequence_advantages=lambda algo: partial(ADVANTAGE_ESTIMATORS["rloo"]),
        critic=False,
    ),
    "reinforce_pp": OnlineAlgorithm(
        sequence_advantages=lambda algo: no_sequence_advantages,
        critic=False,
        token_advantages=lambda algo, scoring: ReinforcePpAdvantages(
            scoring, gamma=algo.gamma, baseline=algo.baseline
        ),
    ),
    "ppo": OnlineAlgorithm(
        sequence_advantages=lambda algo: no_sequence_advantages,
        critic=True,
        token_advantages=lambda algo, scoring: GaeAdvantages(
            scoring, gamma=algo.gamma, lam=algo.lam, whiten=algo.whiten_advantages
        ),
    ),
}
