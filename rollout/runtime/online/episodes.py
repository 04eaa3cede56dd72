"""The actor for multi-turn episodes: prompts in, each prompt played G times against the run's
environment, a scored rollout batch out.

An episode is one growing token sequence. Its prompt is the environment's first observation in
the chat template. Then, turn by turn: the model answers (sampled tokens, trained on), and unless
the episode is over the environment's message follows as the chat template writes a user turn
and opens the next assistant turn (context only: `loss_mask` 0, never trained on). The sampled
tokens are kept exactly as sampled, never re-tokenized from text, so the learner scores the very
tokens the engine produced.

The episode's return is the sum of its turns' rewards; its advantage is the group's estimator
over returns (advantage = "episode"), or per answer from its return-to-go ("turn",
rollout.algorithms.advantages.turn_advantages). The kinds that score per token (PPO,
REINFORCE++) get the return on the episode's last policy token ("episode"), or each turn's reward
on its answer's last token ("turn"): their per-token returns run over the policy's tokens only.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch

from rollout.engines.base import Completion, Engine, SamplingParams
from rollout.harness.environments.runner import EnvironmentFault, EnvironmentRunner, Failed
from rollout.harness.memory import EpisodicMemory
from rollout.harness.reward_runner import RewardRunner
from rollout.runtime.online.actor import PromptFormat, Rollout, Row, Sample
from rollout.runtime.online.batches import RolloutBatch
from rollout.seeds import derive_seed
from rollout.tracing import span

log = logging.getLogger("rollout.episodes")

_ANSWER = "\x00rollout-answer\x00"
_MESSAGE = "\x00rollout-message\x00"


@dataclass(frozen=True)
class TurnFormat:
    """Where an environment's message goes in the token stream, from the model's chat template."""

    tokenizer: Any
    chat_template: str | None
    """None for a model without one: then no episode may have a second turn (the plan makes
    multi-turn environments use the chat template)."""
    system_prompt: str | None
    eos_token_ids: frozenset[int]

    roles: dict[str, str] = field(default_factory=dict, compare=False, repr=False)
    """Cache: the role a message asked for -> the role the chat template writes it in."""

    def between(
        self, observation: str, *, answer_ended: bool, budget: int, role: str = "user"
    ) -> list[int]:
        """Tokens after an answer: the end of the assistant's turn (unless the answer's own eos
        token ended it), the environment's message as a `role` turn (a user turn when the chat
        template has no such role), and the next assistant turn opened; at most `budget` of
        them, the message cut, never the turn markers."""
        if self.chat_template is None:
            raise ValueError("a multi-turn episode needs the model's chat template")
        text = self._render(
            [("user", "u"), ("assistant", _ANSWER), (self.role(role), _MESSAGE)],
            generation_prompt=True,
        )
        after = text[text.index(_ANSWER) + len(_ANSWER) :]
        before, closing = after.split(_MESSAGE, 1)
        if answer_ended:
            for eos in self.eos_token_ids:
                marker = self.tokenizer.decode([eos])
                if marker and before.startswith(marker):
                    before = before[len(marker) :]
                    break
        whole = self._encode(before + observation + closing)
        if len(whole) <= budget:
            return whole
        head, tail = self._encode(before), self._encode(closing)
        room = budget - len(head) - len(tail)
        if room < 0:
            raise ValueError(
                f"environment.max_observation_tokens = {budget} cannot hold the chat template's "
                f"turn markers alone ({len(head) + len(tail)} tokens): raise it"
            )
        return head + self._encode(observation)[:room] + tail

    def role(self, wanted: str) -> str:
        """`wanted` if the chat template writes a message in that role, else "user"."""
        if wanted not in self.roles:
            try:
                text = self._render(
                    [("user", "u"), ("assistant", _ANSWER), (wanted, _MESSAGE)],
                    generation_prompt=True,
                )
                works = _MESSAGE in text
            except Exception:  # templates refuse roles they do not know by raising
                works = False
            self.roles[wanted] = wanted if works else "user"
        return self.roles[wanted]

    def _render(self, turns: list[tuple[str, str]], *, generation_prompt: bool) -> str:
        messages = [{"role": role, "content": content} for role, content in turns]
        if self.system_prompt is not None:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return self.tokenizer.apply_chat_template(
            messages,
            chat_template=self.chat_template,
            add_generation_prompt=generation_prompt,
            tokenize=False,
        )

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))


@dataclass(frozen=True)
class EpisodeSettings:
    max_turns: int
    max_prompt_tokens: int
    max_observation_tokens: int
    advantage: Literal["episode", "turn"]
    failure_reward: float


@dataclass
class _Episode:
    prompt: list[int]
    tokens: list[int]
    mask: list[int]
    logprobs: list[float]
    rewards: list[float]
    answer_ends: list[int] = field(default_factory=list)
    """len(tokens) after each answer: answer t is the policy's tokens before answer_ends[t]."""
    failure: str | None = None
    solved: bool = False
    text: str = ""
    tool_calls: int | None = None
    """Tool calls made (None: its environment does not report tool calls)."""
    invalid_tool_calls: int = 0
    observation: str = ""
    """The first observation (the episode's prompt) as text, for recorded samples."""
    turns: list[dict[str, str]] = field(default_factory=list)
    """The messages after it as text (the model's answers, the environment's replies)."""

    @property
    def context(self) -> list[int]:
        return self.prompt + self.tokens

    @property
    def score(self) -> float:
        return sum(self.rewards)


class EpisodeActor:
    def __init__(
        self,
        rewards: RewardRunner,
        engine: Engine,
        prompt_format: PromptFormat,
        environment: EnvironmentRunner,
        turns: TurnFormat,
        advantage: Callable[[torch.Tensor, int], torch.Tensor],
        turn_advantage: Callable[[torch.Tensor, int], torch.Tensor] | None,
        params: SamplingParams,
        settings: EpisodeSettings,
    ):
        self.rewards = rewards
        """The run's [[rewards]]: what the single_turn environment and evaluation score with."""
        self.engine = engine
        self.format = prompt_format
        self.environment = environment
        self.turns = turns
        self.advantage = advantage
        self.turn_advantage = turn_advantage
        """GRPO's and RLOO's per-answer advantage (advantage = "turn"); None for the kinds that
        score per token (PPO, REINFORCE++): they get each turn's reward on its answer's last
        token instead, and their returns give each answer the rewards from its turn on."""
        self.params = params
        self.settings = settings
        self.memory: EpisodicMemory | None = None
        """The agents' episodic memory, when the environment keeps one (saved in checkpoints)."""

    def rollout(self, rows: Sequence[Row], *, seed: int) -> Rollout:
        """Play ``params.n`` episodes of each row; score them; compute advantages."""
        group = self.params.n
        started = time.perf_counter()
        records = [self.format.reward_row(row) for row in rows for _ in range(group)]
        with span("generate"):  # the episodes: the policy's turns and the environment's
            episodes = self._start(records, seed)
            generate_s, finishes = self._play(episodes, seed, self.params)
        scoring_started = time.perf_counter()
        with span("score"):
            batch = self._batch(episodes, group)
        metrics = _episode_metrics(episodes, batch.rewards, finishes, generate_s)
        metrics["perf/score_s"] = time.perf_counter() - scoring_started
        metrics["perf/episode_s"] = time.perf_counter() - started
        samples = [
            Sample(
                prompt=e.observation,
                completion=None,
                turns=e.turns,
                reward=float(batch.rewards[i]),
                extra={"turn_rewards": e.rewards, "solved": e.solved, "failure": e.failure},
            )
            for i, e in enumerate(episodes)
        ]
        return Rollout(batch=batch, metrics=metrics, samples=samples)

    def _start(self, records: list[dict[str, Any]], seed: int) -> list[_Episode]:
        first = self.environment.reset(records, seed=seed)
        episodes = []
        for i, observation in enumerate(first):
            prompt = self.format.encode(observation)
            if len(prompt) > self.settings.max_prompt_tokens:
                raise EnvironmentFault(
                    f"environment {self.environment.name!r}: episode {i}'s first observation is "
                    f"{len(prompt)} tokens in the chat template, more than "
                    f"generation.max_prompt_tokens = {self.settings.max_prompt_tokens}",
                    environment=self.environment.name,
                    episode=i,
                )
            episodes.append(_Episode(prompt, [], [], [], [], observation=observation))
        return episodes

    def evaluate(
        self, rows: Sequence[Row], *, seed: int, samples: int = 1
    ) -> tuple[dict[str, float], int]:
        """Summed returns, solved episodes and turns of one greedy episode per row (or `samples`
        sampled ones, at the run's temperature), and how many episodes they cover (sums: ranks'
        shards are averaged together, see evaluate.evaluate). `seed` is the same at every
        evaluation, so each plays the same games with the same draws."""
        names = ("eval/reward", "eval/solved_fraction", "eval/turns_mean")
        if not rows:
            return dict.fromkeys(names, 0.0), 0
        records = [self.format.reward_row(row) for row in rows for _ in range(samples)]
        episodes = self._start(records, seed)
        if samples == 1:
            params = replace(self.params, temperature=0.0, n=1)
        else:
            params = replace(self.params, n=samples)
        self._play(episodes, seed, params)
        returns = [self.settings.failure_reward if e.failure else e.score for e in episodes]
        sums = (
            sum(returns),
            sum(e.solved for e in episodes),
            sum(len(e.rewards) for e in episodes),
        )
        return dict(zip(names, map(float, sums), strict=True)), len(episodes)

    def close(self) -> None:
        """The environment's own close (a sidecar's process, a tool's sandbox) as the run ends,
        in whichever process plays the episodes."""
        self.environment.close()

    def _play(
        self, episodes: list[_Episode], seed: int, params: SamplingParams
    ) -> tuple[float, Counter[str]]:
        settings = self.settings
        active = list(range(len(episodes)))
        generate_s, finishes = 0.0, Counter[str]()
        for turn in range(settings.max_turns):
            if not active:
                break
            began = time.perf_counter()
            answers = self._answer([episodes[i].context for i in active], turn, seed, params)
            generate_s += time.perf_counter() - began
            for i, answer in zip(active, answers, strict=True):
                episode = episodes[i]
                episode.tokens += answer.token_ids
                episode.mask += [1] * len(answer.token_ids)
                episode.logprobs += answer.logprobs
                episode.answer_ends.append(len(episode.tokens))
                episode.text = answer.text
                episode.turns.append({"role": "assistant", "content": answer.text})
                finishes[answer.finish_reason] += 1
            results = self.environment.step(active, [a.text for a in answers])
            still = []
            for i, answer, result in zip(active, answers, results, strict=True):
                if self._follow(episodes[i], answer, result, last=turn == settings.max_turns - 1):
                    still.append(i)
            active = still
        return generate_s, finishes

    def _answer(
        self, contexts: list[list[int]], turn: int, seed: int, params: SamplingParams
    ) -> list[Completion]:
        """One answer per context, in order. When each group's G episodes start alike (the
        first turn, mostly) each group's prompt is sampled G times in one go, as the
        single-turn actor does, on the same seed: the engine reads the prompt once."""
        group = params.n
        groups = [contexts[g : g + group] for g in range(0, len(contexts), group)]
        if turn == 0 and all(all(c == members[0] for c in members) for members in groups):
            answers = self.engine.generate(
                [members[0] for members in groups], replace(params, seed=seed)
            )
        else:
            each = replace(params, n=1, seed=derive_seed(seed, f"turn:{turn}"))
            answers = sorted(self.engine.generate(contexts, each), key=lambda c: c.prompt_index)
        if len(answers) != len(contexts):
            raise RuntimeError(f"the engine gave {len(answers)} answers for {len(contexts)}")
        return answers

    def _follow(self, episode: _Episode, answer: Completion, result: Any, *, last: bool) -> bool:
        """Take the environment's answer into the episode; whether the episode goes on."""
        if isinstance(result, Failed):
            episode.failure = result.reason
            log.warning(
                "episode failed, scored %g: %s", self.settings.failure_reward, result.reason
            )
            return False
        episode.rewards.append(float(result.reward))
        info = result.info or {}
        episode.solved = bool(info.get("solved", False))
        if "tool_calls" in info:  # the tools environment's counts (docs/tools.md)
            episode.tool_calls = (episode.tool_calls or 0) + int(info["tool_calls"])
            episode.invalid_tool_calls += int(info.get("invalid_tool_calls", 0))
        if result.done or last:
            return False
        ended = bool(answer.token_ids) and answer.token_ids[-1] in self.turns.eos_token_ids
        message = self.turns.between(
            result.observation,
            answer_ended=ended,
            budget=self.settings.max_observation_tokens,
            role=result.role,
        )
        episode.turns.append({"role": result.role or "user", "content": str(result.observation)})
        episode.tokens += message
        episode.mask += [0] * len(message)
        episode.logprobs += [0.0] * len(message)
        return True

    def _batch(self, episodes: list[_Episode], group: int) -> RolloutBatch:
        settings = self.settings
        returns = torch.tensor(
            [settings.failure_reward if e.failure else e.score for e in episodes],
            dtype=torch.float32,
            device="cpu",
        )
        batch = RolloutBatch(
            prompt_ids=[e.prompt for e in episodes],
            completion_ids=[e.tokens for e in episodes],
            old_logprobs=[e.logprobs for e in episodes],
            rewards=returns,
            advantages=self.advantage(returns, group).float(),
            group_size=group,
            policy_version=self.engine.policy_version,
            texts=[e.text for e in episodes],
            # Single answers only (no environment tokens anywhere): the plain batch, which
            # also crosses processes (split placements).
            loss_mask=[e.mask for e in episodes] if any(0 in e.mask for e in episodes) else None,
        )
        if settings.advantage == "turn":
            if self.turn_advantage is None:
                batch.token_rewards = [_turn_rewards(e, settings.failure_reward) for e in episodes]
            else:
                batch.token_advantages = self._per_token(episodes, returns, group)
        return batch

    def _per_token(
        self, episodes: list[_Episode], returns: torch.Tensor, group: int
    ) -> list[list[float]]:
        """Each answer's tokens get its turn's advantage; the environment's tokens 0 (masked)."""
        turns = max(1, max(len(e.rewards) for e in episodes))
        to_go = torch.zeros((len(episodes), turns), dtype=torch.float32, device="cpu")
        for i, episode in enumerate(episodes):
            rewards = episode.rewards if not episode.failure else []
            for t in range(len(rewards)):
                to_go[i, t] = sum(rewards[t:])
        to_go[:, 0] = returns  # a failed episode's return is failure_reward from its first turn
        assert self.turn_advantage is not None
        advantages = self.turn_advantage(to_go, group).tolist()
        rows = []
        for i, episode in enumerate(episodes):
            row, turn, previous = [], -1, 0
            for flag in episode.mask:
                if flag and not previous:
                    turn += 1  # an answer starts
                row.append(advantages[i][min(turn, turns - 1)] if flag else 0.0)
                previous = flag
            rows.append(row)
        return rows


def _turn_rewards(episode: _Episode, failure_reward: float) -> list[float]:
    """The episode's tokens with each turn's reward on its answer's last token (an empty
    answer's on the policy's last token before it), 0 elsewhere; a failed episode's
    failure_reward on its last policy token."""
    placed = [0.0] * len(episode.tokens)
    written = [i for i, flag in enumerate(episode.mask) if flag]
    if not written:
        return placed  # nothing the policy wrote: nothing to credit
    if episode.failure is not None:
        placed[written[-1]] += failure_reward
        return placed
    for reward, end in zip(episode.rewards, episode.answer_ends, strict=True):
        before = [i for i in written if i < end]
        placed[before[-1] if before else written[0]] += reward
    return placed


def _episode_metrics(
    episodes: list[_Episode], returns: torch.Tensor, finishes: Counter[str], generate_s: float
) -> dict[str, float]:
    count = max(1, len(episodes))
    answers = sum(finishes.values())
    generated = sum(sum(e.mask) for e in episodes)
    metrics = {
        "reward/mean": returns.mean().item(),
        "reward/std": returns.std().item() if len(returns) > 1 else 0.0,
        "episode/turns_mean": sum(len(e.rewards) for e in episodes) / count,
        "episode/solved_fraction": sum(e.solved for e in episodes) / count,
        "episode/failed_fraction": sum(e.failure is not None for e in episodes) / count,
        "episode/tokens_mean": sum(len(e.tokens) for e in episodes) / count,
        "completion/tokens_mean": generated / max(1, answers),
        "completion/stopped_fraction": (finishes["eos"] + finishes["stop"]) / max(1, answers),
        "perf/generate_s": generate_s,
        "perf/generated_tokens": float(generated),
    }
    if any(e.tool_calls is not None for e in episodes):
        calls = [e.tool_calls or 0 for e in episodes]
        metrics["episode/tool_calls_mean"] = sum(calls) / count
        metrics["episode/invalid_tool_calls_mean"] = (
            sum(e.invalid_tool_calls for e in episodes) / count
        )
        # "called the tool correctly": at least one call, and every call well-formed
        metrics["episode/valid_tool_call_fraction"] = (
            sum(
                made > 0 and e.invalid_tool_calls == 0
                for made, e in zip(calls, episodes, strict=True)
            )
            / count
        )
    return metrics
