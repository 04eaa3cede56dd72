"""PPO and REINFORCE++ on multi-turn episodes: their per-token returns and GAE run over the
policy's tokens alone (an episode with the environment's tokens in it scores exactly as the same
episode without them), the environment's tokens get no advantage and are out of every loss term,
and a learner step on a real multi-turn batch of the tiny model trains."""

from __future__ import annotations

import copy
from dataclasses import replace
from functools import partial

import pytest
import torch

from rollout.algorithms.advantages import (
    discounted_returns,
    gae,
    group_advantages,
    kl_shaped_rewards,
    last_policy_token,
    reinforce_pp_advantages,
)
from rollout.engines.base import SamplingParams
from rollout.engines.hf.engine import HfEngine
from rollout.harness.environments.base import StepResult
from rollout.harness.environments.runner import EnvironmentRunner
from rollout.harness.reward_runner import RewardRunner
from rollout.runtime.online.critic import Critic, value_model_for
from rollout.runtime.online.episodes import EpisodeActor, EpisodeSettings
from rollout.runtime.online.learner import Learner
from rollout.runtime.online.shaping import GaeAdvantages, ReinforcePpAdvantages, Scoring
from tests.unit.conftest import learner_knobs
from tests.unit.test_episodes import ROWS, prompt_format, turns

# Rows in the learner's layout: "." padding, "p" the policy's tokens, "E" the environment's.
LAYOUT = ["..ppEEEp", "ppEpppEp", "pppEEppp"]


def expanded_and_compact(seed: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Random rewards, values and KL on the policy's tokens, laid out with the environment's
    tokens in between (which carry large garbage), and the same rows without them."""
    generator = torch.Generator().manual_seed(seed)
    width = len(LAYOUT[0])
    compact_width = max(row.count("p") for row in LAYOUT)
    full = {name: torch.zeros(len(LAYOUT), width) for name in ("rewards", "values", "kl", "mask")}
    small = {name: torch.zeros(len(LAYOUT), compact_width) for name in full}
    for i, row in enumerate(LAYOUT):
        policy = [k for k, c in enumerate(row) if c == "p"]
        start = compact_width - len(policy)
        for name in ("rewards", "values", "kl"):
            drawn = torch.randn(len(policy), generator=generator)
            full[name][i, policy] = drawn
            small[name][i, start:] = drawn
            for k, c in enumerate(row):
                if c == "E":
                    full[name][i, k] = 100.0 + k  # would show anywhere it leaked
        full["mask"][i, policy] = 1.0
        small["mask"][i, start:] = 1.0
    return full, small


def on_policy_tokens(values: torch.Tensor, mask: torch.Tensor) -> list[list[float]]:
    return [row[m.bool()].tolist() for row, m in zip(values, mask, strict=True)]


def assert_same_on_policy_tokens(full, small, full_mask, small_mask):
    environment = (full_mask == 0) & torch.tensor([[c == "E" for c in r] for r in LAYOUT])
    assert torch.all(full[environment] == 0)
    for got, want in zip(
        on_policy_tokens(full, full_mask), on_policy_tokens(small, small_mask), strict=True
    ):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want))


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 0.95), (0.9, 0.8), (0.5, 1.0)])
def test_gae_over_an_episode_is_gae_over_it_without_the_environment_tokens(gamma, lam):
    full, small = expanded_and_compact(0)
    got = gae(full["rewards"], full["values"], full["mask"], gamma=gamma, lam=lam)
    want = gae(small["rewards"], small["values"], small["mask"], gamma=gamma, lam=lam)
    for a, b in zip(got, want, strict=True):  # advantages, then returns
        assert_same_on_policy_tokens(a, b, full["mask"], small["mask"])


@pytest.mark.parametrize("gamma", [1.0, 0.7])
def test_discounted_returns_skip_the_environment_tokens(gamma):
    full, small = expanded_and_compact(1)
    assert_same_on_policy_tokens(
        discounted_returns(full["rewards"], full["mask"], gamma=gamma),
        discounted_returns(small["rewards"], small["mask"], gamma=gamma),
        full["mask"],
        small["mask"],
    )


def test_gae_steps_from_policy_token_to_policy_token_by_hand():
    # p E p: with gamma 0.5 the first token's return is 0.5 * 2 (one step, not two)
    rewards, values = torch.tensor([[0.0, 9.0, 2.0]]), torch.tensor([[1.0, 9.0, 0.5]])
    mask = torch.tensor([[1, 0, 1]])
    advantages, returns = gae(rewards, values, mask, gamma=0.5, lam=1.0)
    torch.testing.assert_close(returns, torch.tensor([[1.0, 0.0, 2.0]]))
    torch.testing.assert_close(advantages, torch.tensor([[0.0, 0.0, 1.5]]))


def test_the_kl_in_the_reward_and_the_reward_go_on_policy_tokens_only():
    full, small = expanded_and_compact(2)
    episode_rewards = torch.tensor([1.0, -2.0, 0.5])
    assert_same_on_policy_tokens(
        kl_shaped_rewards(episode_rewards, full["kl"], full["mask"], kl_coef=0.1),
        kl_shaped_rewards(episode_rewards, small["kl"], small["mask"], kl_coef=0.1),
        full["mask"],
        small["mask"],
    )
    # The reward lands on the last policy token, wherever it is.
    mask = torch.tensor([[1, 1, 0, 0], [0, 1, 0, 1]])
    assert last_policy_token(mask).tolist() == [1, 3]
    shaped = kl_shaped_rewards(torch.tensor([3.0, 4.0]), None, mask)
    torch.testing.assert_close(shaped, torch.tensor([[0.0, 3.0, 0, 0], [0, 0, 0, 4.0]]))


def test_reinforce_pp_with_per_turn_rewards_and_a_group_baseline_skips_the_environment():
    full, small = expanded_and_compact(3)
    returns = torch.tensor([0.5, 1.5, -1.0, 2.0])
    extra_full = torch.cat([full["mask"], full["mask"][:1]])  # four rows: two groups of two
    extra_small = torch.cat([small["mask"], small["mask"][:1]])
    placed_full = torch.cat([full["rewards"], full["rewards"][:1]]) * extra_full
    placed_small = torch.cat([small["rewards"], small["rewards"][:1]]) * extra_small
    kwargs = dict(kl_coef=0.0, gamma=0.9, group_size=2, baseline="group")
    got = reinforce_pp_advantages(returns, None, extra_full, placed=placed_full, **kwargs)
    want = reinforce_pp_advantages(returns, None, extra_small, placed=placed_small, **kwargs)
    for a, b in zip(
        on_policy_tokens(got, extra_full), on_policy_tokens(want, extra_small), strict=True
    ):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b))
    assert torch.all(got[extra_full == 0] == 0)


# --- the actor and the learner on the tiny model ---------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return HfEngine(
        tiny_llama.model,
        eos_token_ids=tiny_llama.eos_token_ids,
        pad_token_id=tiny_llama.pad_token_id,
        tokenizer=tiny_llama.tokenizer,
        max_batch_size=None,
        device="cpu",
    )


class PaysTheSecondTurn:
    """Never done; the second answer of episode 0 of each group of 4 earns 1, the first 0.25."""

    def reset(self, rows, *, seed):
        self.turn = 0
        return ["Say something."] * len(rows)

    def step(self, episodes, actions):
        self.turn += 1
        paid = [0.25 if self.turn == 1 else float(e % 4 == 0) for e in episodes]
        return [StepResult("again", reward=r) for r in paid]


def per_token_actor(tiny_llama, engine, advantage: str) -> EpisodeActor:
    return EpisodeActor(
        RewardRunner([]),
        engine,
        prompt_format(tiny_llama),
        EnvironmentRunner(PaysTheSecondTurn(), name="env", timeout_s=10),
        turns(tiny_llama),
        partial(group_advantages, scale="group"),
        None,  # a kind that scores per token
        SamplingParams(max_new_tokens=6, n=4),
        EpisodeSettings(
            max_turns=2,
            max_prompt_tokens=64,
            max_observation_tokens=32,
            advantage=advantage,
            failure_reward=-1.0,
        ),
    )


def answers(mask: list[int]) -> list[list[int]]:
    """The positions of each answer (a run of 1s) of one row."""
    runs: list[list[int]] = []
    for k, flag in enumerate(mask):
        if flag and (not k or not mask[k - 1]):
            runs.append([])
        if flag:
            runs[-1].append(k)
    return runs


def test_per_turn_rewards_land_on_each_answers_last_token(tiny_llama, engine):
    batch = per_token_actor(tiny_llama, engine, "turn").rollout(ROWS, seed=5).batch
    assert batch.token_rewards is not None and batch.loss_mask is not None
    for i, (placed, mask) in enumerate(zip(batch.token_rewards, batch.loss_mask, strict=True)):
        first, second = answers(mask)
        expected = [0.0] * len(mask)
        expected[first[-1]] = 0.25
        expected[second[-1]] = float(i % 4 == 0)
        assert placed == expected
    torch.testing.assert_close(batch.rewards, torch.tensor([1.25, 0.25, 0.25, 0.25] * 2))
    # "episode": no per-turn placement; the return goes on the last policy token when scored.
    whole = per_token_actor(tiny_llama, engine, "episode").rollout(ROWS, seed=5).batch
    assert whole.token_rewards is None and whole.token_advantages is None


def ppo_learner(model, pad_id: int) -> tuple[Learner, Critic]:
    critic = Critic(
        model=value_model_for(model, separate=False),
        optimizer=None,
        scheduler=None,
        vf_coef=0.5,
        value_clip=0.2,
        max_grad_norm=None,
    )
    with torch.no_grad():  # values that differ per token, the same for every learner built
        head = critic.model.head.weight
        head.copy_(torch.linspace(-0.2, 0.2, head.numel()).reshape(head.shape))
    parameters = [*model.parameters(), *critic.model.head.parameters()]
    optimizer = torch.optim.SGD(parameters, lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    learner = Learner(
        model,
        optimizer,
        scheduler,
        learner_knobs(max_new_tokens=64),
        pad_token_id=pad_id,
        device="cpu",
        critic=critic,
    )
    return learner, critic


def scored_for_ppo(learner: Learner, critic: Critic, batch, pad_id: int):
    scoring = Scoring(
        logprobs=learner.completion_logprobs,
        pad_token_id=pad_id,
        device="cpu",
        reference=None,
        kl_coef=0.0,
        kl_in_reward=False,
        critic=critic,
    )
    return GaeAdvantages(scoring, gamma=0.9, lam=0.95, whiten=True)(batch)[0]


def test_a_ppo_step_on_multi_turn_episodes_trains_on_the_policys_tokens_only(tiny_llama, engine):
    batch = per_token_actor(tiny_llama, engine, "turn").rollout(ROWS, seed=6).batch
    pad = tiny_llama.pad_token_id
    model = copy.deepcopy(tiny_llama.model)
    learner, critic = ppo_learner(model, pad)
    scored = scored_for_ppo(learner, critic, batch, pad)
    for row, mask, values in zip(
        scored.token_advantages, batch.loss_mask, scored.old_values, strict=True
    ):
        assert all(
            a == 0.0 and v == 0.0 for a, v, m in zip(row, values, mask, strict=True) if not m
        )
        assert any(a != 0.0 for a, m in zip(row, mask, strict=True) if m)

    # The environment's tokens out of every loss term: garbage at their positions (old log-probs
    # for the ratio, advantages, old values and returns for the value loss) changes nothing.
    def garbage(rows, masks):
        return [
            [x if m else 123.0 for x, m in zip(r, ms, strict=True)]
            for r, ms in zip(rows, masks, strict=True)
        ]

    masks = batch.loss_mask
    spoiled = replace(
        scored,
        old_logprobs=garbage(scored.old_logprobs, masks),
        token_advantages=garbage(scored.token_advantages, masks),
        old_values=garbage(scored.old_values, masks),
        returns=garbage(scored.returns, masks),
    )
    before = [p.detach().clone() for p in model.parameters()]
    learner.update(scored)
    trained = [p.detach().clone() for p in model.parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(before, trained, strict=True))

    other = copy.deepcopy(tiny_llama.model)
    other_learner, _ = ppo_learner(other, pad)
    other_learner.update(spoiled)
    for a, b in zip(trained, other.parameters(), strict=True):
        torch.testing.assert_close(a, b.detach(), rtol=0, atol=1e-6)


def test_a_reinforce_pp_batch_gives_the_environment_tokens_no_advantage(tiny_llama, engine):
    batch = per_token_actor(tiny_llama, engine, "turn").rollout(ROWS, seed=7).batch
    pad = tiny_llama.pad_token_id
    learner, _ = ppo_learner(copy.deepcopy(tiny_llama.model), pad)
    scoring = Scoring(learner.completion_logprobs, pad, "cpu", None, 0.0, False)
    scored, _ = ReinforcePpAdvantages(scoring, gamma=1.0, baseline="group")(batch)
    for row, mask in zip(scored.token_advantages, batch.loss_mask, strict=True):
        first, second = answers(mask)
        assert all(a == 0.0 for a, m in zip(row, mask, strict=True) if not m)
        # gamma 1: every token of an answer has its answer's return to go
        assert len({round(row[k], 5) for k in first}) == 1
        assert len({round(row[k], 5) for k in second}) == 1


class SevensOnTheSecondTurn:
    """Two turns: the first answer earns nothing, the second the share of its characters that
    are '7' (deterministic: the answer must be one fixed token, again and again)."""

    def reset(self, rows, *, seed):
        self.turn = 0
        return ["Say something."] * len(rows)

    def step(self, episodes, actions):
        self.turn += 1
        if self.turn == 1:
            return [StepResult("Now sevens.", reward=0.0) for _ in actions]
        return [StepResult("", reward=a.count("7") / max(1, len(a)), done=True) for a in actions]


def test_ppo_learns_what_the_second_turn_asks_for(tiny_llama):
    """A few seconds: 15 PPO steps of 32 two-turn episodes, the value head trained alongside."""
    model = copy.deepcopy(tiny_llama.model)
    pad = tiny_llama.pad_token_id
    engine = HfEngine(
        model,
        eos_token_ids=tiny_llama.eos_token_ids,
        pad_token_id=pad,
        tokenizer=tiny_llama.tokenizer,
        max_batch_size=None,
        device="cpu",
    )
    actor = EpisodeActor(
        RewardRunner([]),
        engine,
        prompt_format(tiny_llama),
        EnvironmentRunner(SevensOnTheSecondTurn(), name="env", timeout_s=10),
        turns(tiny_llama),
        partial(group_advantages, scale="group"),
        None,
        SamplingParams(max_new_tokens=8, n=8),
        EpisodeSettings(
            max_turns=2,
            max_prompt_tokens=64,
            max_observation_tokens=32,
            advantage="turn",
            failure_reward=0.0,
        ),
    )
    critic = Critic(
        model=value_model_for(model, separate=False),
        optimizer=None,
        scheduler=None,
        vf_coef=0.5,
        value_clip=0.2,
        max_grad_norm=None,
    )
    optimizer = torch.optim.AdamW([*model.parameters(), *critic.model.head.parameters()], lr=3e-3)
    learner = Learner(
        model,
        optimizer,
        torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0),
        learner_knobs(minibatch_size=32, micro_batch_size=32, max_new_tokens=16),
        pad_token_id=pad,
        device="cpu",
        critic=critic,
    )
    scoring = Scoring(learner.completion_logprobs, pad, "cpu", None, 0.0, False, critic)
    scorer = GaeAdvantages(scoring, gamma=1.0, lam=0.95, whiten=True)
    rows = [{"prompt": f"game {i}"} for i in range(4)]
    rewards = []
    for step in range(15):
        batch = actor.rollout(rows, seed=step).batch
        learner.update(scorer(batch)[0])
        engine.load_weights(None, step + 1)  # the engine samples with the learner's module
        rewards.append(batch.rewards.mean().item())
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.1, rewards
