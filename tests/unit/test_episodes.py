"""The episode actor on the tiny model: environment tokens in the sequence but out of the loss,
the sampled tokens kept as sampled (the learner's log-probs match the engine's), a single-turn
episode identical to the single-turn actor, failures contained, per-turn advantages laid out."""

from __future__ import annotations

import copy
from functools import partial

import pytest
import torch

from rollout.algorithms.advantages import group_advantages, turn_advantages
from rollout.engines.base import SamplingParams
from rollout.engines.hf.engine import HfEngine
from rollout.harness.environments.base import StepResult
from rollout.harness.environments.guess_number import GuessNumber
from rollout.harness.environments.runner import EnvironmentFault, EnvironmentRunner
from rollout.harness.environments.single_turn import SingleTurn
from rollout.harness.reward_runner import RewardRunner
from rollout.models.loading import apply_chat_template
from rollout.runtime.online.actor import Actor, PromptFormat
from rollout.runtime.online.batches import pad_for_learner
from rollout.runtime.online.episodes import EpisodeActor, EpisodeSettings, TurnFormat
from rollout.runtime.online.learner import Learner
from tests.unit.conftest import learner_knobs

ROWS = [{"prompt": "Guess the number."}, {"prompt": "Another game."}]


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


def prompt_format(tiny_llama) -> PromptFormat:
    return PromptFormat(
        encode=lambda text: apply_chat_template(
            tiny_llama.tokenizer, tiny_llama.chat_template, text, None
        ),
        prompt_field="prompt",
        role_fields={},
    )


def turns(tiny_llama) -> TurnFormat:
    return TurnFormat(
        tiny_llama.tokenizer, tiny_llama.chat_template, None, frozenset(tiny_llama.eos_token_ids)
    )


def episode_actor(tiny_llama, engine, environment, *, max_turns=3, advantage="episode", **kw):
    return EpisodeActor(
        RewardRunner([]),
        engine,
        prompt_format(tiny_llama),
        EnvironmentRunner(environment, name="env", timeout_s=10, **kw),
        turns(tiny_llama),
        partial(group_advantages, scale="group"),
        partial(turn_advantages, scale="group"),
        SamplingParams(max_new_tokens=6, n=4),
        EpisodeSettings(
            max_turns=max_turns,
            max_prompt_tokens=64,
            max_observation_tokens=32,
            advantage=advantage,
            failure_reward=-1.0,
        ),
    )


class Tally:
    """Never done; says "again" and gives 0.25 per turn: every episode runs every turn."""

    def reset(self, rows, *, seed):
        return ["Say something."] * len(rows)

    def step(self, episodes, actions):
        return [StepResult("again", reward=0.25) for _ in episodes]


def test_the_batch_holds_answers_and_environment_messages_with_only_answers_trained(
    tiny_llama, engine
):
    rollout = episode_actor(tiny_llama, engine, Tally()).rollout(ROWS, seed=1)
    batch = rollout.batch
    assert len(batch) == 8 and batch.loss_mask is not None
    tokenizer = tiny_llama.tokenizer
    for ids, mask, logprobs in zip(
        batch.completion_ids, batch.loss_mask, batch.old_logprobs, strict=True
    ):
        assert len(ids) == len(mask) == len(logprobs)
        environment = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if not m])
        assert environment.count("<|im_start|>user\nagain<|im_end|>") == 2  # 3 turns, 2 between
        assert all(lp == 0.0 for lp, m in zip(logprobs, mask, strict=True) if not m)
        assert all(lp < 0.0 for lp, m in zip(logprobs, mask, strict=True) if m)
    torch.testing.assert_close(batch.rewards, torch.full((8,), 0.75))
    assert rollout.metrics["episode/turns_mean"] == 3.0
    assert batch.num_completion_tokens == sum(sum(m) for m in batch.loss_mask)


def test_the_learner_scores_the_sampled_tokens_as_the_engine_did(tiny_llama, engine):
    batch = episode_actor(tiny_llama, engine, Tally()).rollout(ROWS, seed=2).batch
    model = copy.deepcopy(tiny_llama.model)
    learner = Learner(
        model,
        torch.optim.SGD(model.parameters(), lr=0.0),
        None,
        learner_knobs(),
        pad_token_id=tiny_llama.pad_token_id,
        device="cpu",
    )
    padded = pad_for_learner(batch, tiny_llama.pad_token_id, "cpu")
    recomputed = learner.completion_logprobs(model, batch, padded)
    mask = padded.completion_mask
    assert mask.sum().item() == batch.num_completion_tokens  # the loss sees answers only
    torch.testing.assert_close(recomputed[mask], padded.old_logprobs[mask], atol=2e-4, rtol=0)


def test_a_single_turn_episode_is_the_single_turn_actor(tiny_llama, engine):
    def sevens(prompts, completions):
        return [float(c.count("7")) + len(c) / 100 for c in completions]

    from rollout.harness.reward_contract import describe

    rewards = RewardRunner([describe("sevens", sevens, weight=1.0, options={}, timeout_s=10)])
    fmt = prompt_format(tiny_llama)
    params = SamplingParams(max_new_tokens=6, n=4)
    advantage = partial(group_advantages, scale="group")
    plain = Actor(engine, fmt, rewards, advantage, params).rollout(ROWS, seed=5).batch
    environment = SingleTurn(lambda p, c, r: rewards.score(p, c, r).total, "prompt")
    episodes = (
        EpisodeActor(
            rewards,
            engine,
            fmt,
            EnvironmentRunner(environment, name="single_turn", timeout_s=10),
            turns(tiny_llama),
            advantage,
            partial(turn_advantages, scale="group"),
            params,
            EpisodeSettings(1, 64, 32, "episode", 0.0),
        )
        .rollout(ROWS, seed=5)
        .batch
    )
    assert episodes.loss_mask is None  # nothing but answers: the plain batch
    assert episodes.prompt_ids == plain.prompt_ids
    assert episodes.completion_ids == plain.completion_ids
    assert episodes.old_logprobs == plain.old_logprobs
    torch.testing.assert_close(episodes.rewards, plain.rewards)
    torch.testing.assert_close(episodes.advantages, plain.advantages)


def test_an_environment_that_fails_mid_episode_scores_the_episodes_as_failed(tiny_llama, engine):
    class Breaks(Tally):
        calls = 0

        def step(self, episodes, actions):
            self.calls += 1
            if self.calls == 2:
                raise RuntimeError("lost its state")
            return super().step(episodes, actions)

    actor = episode_actor(tiny_llama, engine, Breaks(), on_error="fail_episode")
    rollout = actor.rollout(ROWS, seed=3)
    torch.testing.assert_close(rollout.batch.rewards, torch.full((8,), -1.0))  # failure_reward
    assert rollout.metrics["episode/failed_fraction"] == 1.0
    with pytest.raises(EnvironmentFault, match="lost its state"):
        episode_actor(tiny_llama, engine, Breaks()).rollout(ROWS, seed=3)


def test_per_turn_advantages_follow_each_answers_return_to_go(tiny_llama, engine):
    class LastTurnPays(Tally):
        """Episode 0 of each group earns 1 on its last turn; the rest earn nothing."""

        def step(self, episodes, actions):
            self.turn = getattr(self, "turn", 0) + 1
            return [
                StepResult("again", reward=float(e % 4 == 0 and self.turn == 2)) for e in episodes
            ]

    batch = (
        episode_actor(tiny_llama, engine, LastTurnPays(), max_turns=2, advantage="turn")
        .rollout(ROWS, seed=4)
        .batch
    )
    assert batch.token_advantages is not None
    expected = group_advantages(torch.tensor([1.0, 0, 0, 0]), 4)
    for i, (row, mask) in enumerate(zip(batch.token_advantages, batch.loss_mask, strict=True)):
        answer_values = sorted({round(v, 5) for v, m in zip(row, mask, strict=True) if m})
        assert all(v == 0.0 for v, m in zip(row, mask, strict=True) if not m)
        # Both turns of every episode have the same return to go (the reward comes last).
        assert answer_values == [round(expected[i % 4].item(), 5)]


def test_guess_number_episodes_end_when_solved(tiny_llama, engine):
    rows = [{"prompt": "x", "secret": 3}] * 1
    actor = episode_actor(tiny_llama, engine, GuessNumber(low=3, high=4), max_turns=4)
    rollout = actor.rollout(rows, seed=0)
    batch = rollout.batch
    # The random model rarely says a number; each episode ran all 4 turns unless solved.
    for reward, mask in zip(
        batch.rewards.tolist(), batch.loss_mask or [[1]] * len(batch), strict=True
    ):
        answers = sum(1 for a, b in zip([0, *mask[:-1]], mask, strict=True) if b and not a)
        assert answers == 4 or reward == 1.0


def test_an_environment_message_past_its_budget_is_cut_but_keeps_the_turn_markers(tiny_llama):
    fmt = turns(tiny_llama)
    whole = fmt.between("Guess higher.", answer_ended=False, budget=100)
    decoded = tiny_llama.tokenizer.decode(whole)
    assert (
        decoded == "<|im_end|>\n<|im_start|>user\nGuess higher.<|im_end|>\n<|im_start|>assistant\n"
    )
    after_eos = tiny_llama.tokenizer.decode(fmt.between("hi", answer_ended=True, budget=100))
    assert after_eos.startswith("\n<|im_start|>user\nhi")  # the answer's own eos closed its turn
    cut = fmt.between("Guess higher. " * 50, answer_ended=False, budget=20)
    assert len(cut) == 20
    assert tiny_llama.tokenizer.decode(cut).endswith("<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="max_observation_tokens = 3"):
        fmt.between("x", answer_ended=False, budget=3)


def test_evaluation_plays_one_greedy_episode_per_row_and_repeats(tiny_llama, engine):
    class Pays(Tally):
        def step(self, episodes, actions):
            return [
                StepResult("again", reward=0.5, done=True, info={"solved": True}) for _ in episodes
            ]

    actor = episode_actor(tiny_llama, engine, Pays())
    sums, count = actor.evaluate(ROWS, seed=0)
    assert count == 2  # one episode per row, not num_generations
    assert sums == {"eval/reward": 1.0, "eval/solved_fraction": 2.0, "eval/turns_mean": 2.0}
    assert actor.evaluate([], seed=0) == (dict.fromkeys(sums, 0.0), 0)
    tokens = []
    for _ in range(2):  # greedy: the same episodes every time

        class Records(Tally):
            def step(self, episodes, actions):
                tokens.append(list(actions))
                return super().step(episodes, actions)

        episode_actor(tiny_llama, engine, Records(), max_turns=2).evaluate(ROWS, seed=0)
    assert tokens[:2] == tokens[2:]


def test_sampled_evaluation_plays_each_row_eval_samples_times_as_training_samples(
    tiny_llama, engine
):
    actions: list[list[str]] = []

    class Records(Tally):
        def step(self, episodes, actions_now):
            actions.append(list(actions_now))
            return [StepResult("x", reward=0.25, done=True) for _ in episodes]

    actor = episode_actor(tiny_llama, engine, Records(), max_turns=1)
    sums, count = actor.evaluate(ROWS, seed=3, samples=3)
    assert count == 6  # three episodes per row: the mean is over episodes
    assert sums["eval/reward"] == pytest.approx(6 * 0.25)
    first_row = actions[0][:3]
    assert len(set(first_row)) > 1  # sampled at the run's temperature, not greedy
    actor.evaluate(ROWS, seed=3, samples=3)
    assert actions[1] == actions[0]  # the same seed draws the same episodes each evaluation
