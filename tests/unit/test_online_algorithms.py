"""The online kinds' records (rollout.runtime.online.algorithms): one per kind, each reading its
knobs from the kind's own config, whose defaults are the only ones."""

from __future__ import annotations

import pytest
import torch

from rollout.algorithms.advantages import group_advantages, rloo_advantages
from rollout.config.algorithm import (
    ONLINE_KINDS,
    GrpoConfig,
    PpoConfig,
    ReinforcePpConfig,
    RlooConfig,
)
from rollout.runtime.online.algorithms import ALGORITHMS
from rollout.runtime.online.shaping import GaeAdvantages, ReinforcePpAdvantages, Scoring

REWARDS = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, 0.0])


def scoring() -> Scoring:
    return Scoring(
        logprobs=lambda *_: torch.zeros(()),
        pad_token_id=0,
        device="cpu",
        reference=None,
        kl_coef=0.0,
        kl_in_reward=False,
    )


def test_every_online_kind_has_one_record():
    assert sorted(ALGORITHMS) == sorted(ONLINE_KINDS)


def test_only_ppo_trains_a_critic():
    assert {kind for kind, record in ALGORITHMS.items() if record.critic} == {"ppo"}


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_grpo_advantages_are_relative_to_the_group_at_the_configured_scale(scale):
    algo = GrpoConfig(kind="grpo", scale_rewards=scale)
    advantages = ALGORITHMS["grpo"].sequence_advantages(algo)(REWARDS, 3)
    assert torch.equal(advantages, group_advantages(REWARDS, 3, scale=scale))


def test_rloo_advantages_leave_one_out():
    algo = RlooConfig(kind="rloo")
    advantages = ALGORITHMS["rloo"].sequence_advantages(algo)(REWARDS, 3)
    assert torch.equal(advantages, rloo_advantages(REWARDS, 3))


@pytest.mark.parametrize(
    "kind, algo",
    [("ppo", PpoConfig(kind="ppo")), ("reinforce_pp", ReinforcePpConfig(kind="reinforce_pp"))],
)
def test_kinds_scored_per_token_leave_zeros_for_the_actor(kind, algo):
    assert torch.equal(ALGORITHMS[kind].sequence_advantages(algo)(REWARDS, 1), torch.zeros(6))


def test_grpo_and_rloo_advantages_are_final():
    assert ALGORITHMS["grpo"].token_advantages is None
    assert ALGORITHMS["rloo"].token_advantages is None


def test_ppo_takes_gae_lambda_and_whitening_from_its_config():
    default = ALGORITHMS["ppo"].token_advantages(PpoConfig(kind="ppo"), scoring())
    assert isinstance(default, GaeAdvantages)
    assert (default.gamma, default.lam, default.whiten) == (1.0, 0.95, True)
    algo = PpoConfig(kind="ppo", gamma=0.9, lam=0.5, whiten_advantages=False)
    chosen = ALGORITHMS["ppo"].token_advantages(algo, scoring())
    assert (chosen.gamma, chosen.lam, chosen.whiten) == (0.9, 0.5, False)


def test_reinforce_pp_takes_its_baseline_from_its_config():
    algo = ReinforcePpConfig(kind="reinforce_pp", gamma=0.99, baseline="group", num_generations=2)
    scorer = ALGORITHMS["reinforce_pp"].token_advantages(algo, scoring())
    assert isinstance(scorer, ReinforcePpAdvantages)
    assert (scorer.gamma, scorer.baseline) == (0.99, "group")
