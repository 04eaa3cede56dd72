"""The actor for agent programs: each episode is an external program talking to the policy
through rollout's own OpenAI-compatible server, trained on exactly the tokens it was served.

The server runs in this process on 127.0.0.1 with a fresh key, over the run's own engine, and
records every completion served under an episode's base URL (rollout.serve.recording) with the
prompt token ids the model was conditioned on, the sampled token ids and their log-probs. Episode
requests sample with the run's settings (temperature, top_p, top_k; max_tokens capped at
generation.max_new_tokens) whatever the agent asked for, so the log-probs recorded are the ones
the learner recomputes.

An episode's completions become rows of the batch. A call whose prompt extends the previous
call's prompt and completion token for token (a conversation growing turn by turn) joins that
row: what came in between (tool results, the next user message, the chat template's markers) is
context, out of the loss. A call that does not (the agent rewrote its history) starts a row of
its own. Every token trained on is one the engine sampled, conditioned on exactly the tokens it
was conditioned on when serving the agent. The rows of an episode share its advantage (its
return, scored by [[rewards]] on the program's final answer, against its group's).

An episode's sample (logging.samples_per_step) shows every call as turns: what the agent sent
that was new (the messages after the last assistant message of a chat request; the prompt tokens
past the previous call's, as text, of a completions request), then the reply it received with
the call's number, policy version, token count and finish reason; the final answer is the
sample's completion. Texts are cut to storage.base.MAX_SAMPLE_TEXT characters, a request's new
messages to its last SENT_MESSAGES, the calls to environment.max_turns.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import torch

from rollout.engines.base import Engine, SamplingParams
from rollout.harness.agents import AgentOutcome, AgentProgram
from rollout.harness.reward_runner import RewardRunner
from rollout.runtime.online.actor import PromptFormat, Rollout, Row, Sample
from rollout.runtime.online.batches import RolloutBatch
from rollout.serve.loading import served_engine
from rollout.serve.recording import CompletionRecorder, RecordedCompletion
from rollout.serve.server import OpenAIServer
from rollout.storage.base import clip_text
from rollout.tracing import span

log = logging.getLogger("rollout.agents")

SENT_MESSAGES = 4
"""The new messages of one request an episode's sample keeps (its last ones)."""


@dataclass
class Stretch:
    """One row: a prompt, then sampled tokens and the context between them."""

    prompt: list[int]
    tokens: list[int]
    mask: list[int]
    logprobs: list[float]
    policy_version: int

    @property
    def context(self) -> list[int]:
        return self.prompt + self.tokens


def assemble(calls: Sequence[RecordedCompletion]) -> list[Stretch]:
    """An episode's served completions (in the order they finished) as rows: each call joins
    the row whose whole context its prompt begins with, or starts a new one."""
    stretches: list[Stretch] = []
    for call in calls:
        prompt = list(call.prompt_token_ids)
        joined = next(
            (s for s in reversed(stretches) if prompt[: len(s.context)] == s.context), None
        )
        if joined is None:
            stretches.append(
                Stretch(
                    prompt,
                    list(call.token_ids),
                    [1] * len(call.token_ids),
                    list(call.logprobs),
                    call.policy_version,
                )
            )
            continue
        between = prompt[len(joined.context) :]
        joined.tokens += between + list(call.token_ids)
        joined.mask += [0] * len(between) + [1] * len(call.token_ids)
        joined.logprobs += [0.0] * len(between) + list(call.logprobs)
        joined.policy_version = min(joined.policy_version, call.policy_version)
    return stretches


def episode_turns(
    calls: Sequence[RecordedCompletion], *, max_calls: int, decode: Callable[[list[int]], str]
) -> list[dict[str, Any]]:
    """An episode's served completions as a sample's turns: per call, what was new in the
    request, then the reply (see the module's docstring); `decode` turns token ids into text."""
    turns: list[dict[str, Any]] = []
    previous: RecordedCompletion | None = None
    for number, call in enumerate(calls[:max_calls], start=1):
        turns += _sent_turns(call, previous, decode)
        turns.append(
            {
                "role": "assistant",
                "content": clip_text(call.text),
                "call": number,
                "policy_version": call.policy_version,
                "tokens": len(call.token_ids),
                "finish_reason": call.finish_reason,
            }
        )
        previous = call
    if len(calls) > max_calls:
        turns.append({"role": "note", "content": f"[{len(calls) - max_calls} more calls cut]"})
    return turns


def _sent_turns(
    call: RecordedCompletion,
    previous: RecordedCompletion | None,
    decode: Callable[[list[int]], str],
) -> list[dict[str, Any]]:
    if call.kind == "chat":
        # The conversation so far ends at the last reply the agent passed back: what follows it
        # (tool results, the next user message) is this call's news.
        messages = list(call.sent)
        replies = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
        new = messages[replies[-1] + 1 :] if replies else messages
    else:
        prompt = call.prompt_token_ids
        context = previous.prompt_token_ids + previous.token_ids if previous else []
        start = len(context) if context and prompt[: len(context)] == context else 0
        new = [{"role": "prompt", "content": decode(prompt[start:])}] if prompt[start:] else []
    turns = [{"role": m["role"], "content": clip_text(m["content"])} for m in new[-SENT_MESSAGES:]]
    if len(new) > SENT_MESSAGES:
        cut = f"[{len(new) - SENT_MESSAGES} earlier messages of this request cut]"
        turns.insert(0, {"role": "note", "content": cut})
    return turns


@dataclass(frozen=True)
class AgentSettings:
    concurrency: int
    """Episodes (agent programs) running at once."""
    max_calls: int
    """Completions one episode may ask for (environment.max_turns); more fails it."""
    failure_reward: float
    stop_on_failure: bool
    """environment.on_error = "stop": a failed episode stops the step."""


class AgentFailure(Exception):
    """An agent program failed with on_error = "stop"."""


@dataclass
class _Episode:
    episode_id: str
    row: dict[str, Any]
    outcome: AgentOutcome | None = None
    stretches: list[Stretch] | None = None
    failure: str | None = None
    calls: int = 0
    turns: list[dict[str, Any]] | None = None


class AgentActor:
    def __init__(
        self,
        rewards: RewardRunner,
        engine: Engine,
        prompt_format: PromptFormat,
        program: AgentProgram,
        advantage: Callable[[torch.Tensor, int], torch.Tensor],
        params: SamplingParams,
        settings: AgentSettings,
        *,
        tokenizer: Any,
        chat_template: str | None,
        model_name: str = "policy",
        model_config: Any = None,
    ):
        self.rewards = rewards
        self.engine = engine
        self.format = prompt_format
        self.program = program
        self.advantage = advantage
        self.params = params
        self.settings = settings
        self.memory = None
        self.tokenizer = tokenizer
        self.recorder = CompletionRecorder()
        self._api_key = secrets.token_hex(16)
        self._greedy = False
        # Every episode of a step may ask at once; the service must queue them all.
        served = served_engine(
            engine,
            tokenizer,
            chat_template,
            name=model_name,
            max_requests=max(256, 4 * settings.concurrency),
            model_config=model_config,  # an engine plugin's context length and vocabulary
        )
        self.server = OpenAIServer(
            ("127.0.0.1", 0),
            served,
            api_key=self._api_key,
            recorder=self.recorder,
            episode_sampling=self._sampling,
            episodes_any_model=True,  # an unmodified agent names the model it was written for
        )
        self._thread = threading.Thread(
            target=self.server.serve_forever, name="agent-server", daemon=True
        )
        self._thread.start()
        self._count = 0

    def rollout(self, rows: Sequence[Row], *, seed: int) -> Rollout:
        """Run ``params.n`` episodes of each row; score them; compute advantages."""
        group = self.params.n
        started = time.perf_counter()
        with span("generate"):  # the agent programs, and what they were served
            episodes = self._play([dict(row) for row in rows for _ in range(group)])
        scoring = time.perf_counter()
        with span("score"):
            returns = self._returns(episodes)
        advantages = self.advantage(returns, group).float()
        batch = self._batch(episodes, returns, advantages, group)
        metrics = self._metrics(episodes, returns, scoring - started)
        metrics["perf/score_s"] = time.perf_counter() - scoring
        samples = [
            Sample(
                prompt=self.format.prompt_text(e.row),
                completion=e.outcome.answer if e.outcome else "",
                turns=e.turns,
                reward=float(returns[i]),
                extra={"episode_id": e.episode_id, "calls": e.calls, "failure": e.failure},
            )
            for i, e in enumerate(episodes)
        ]
        return Rollout(batch=batch, metrics=metrics, samples=samples)

    def evaluate(
        self, rows: Sequence[Row], *, seed: int, samples: int = 1
    ) -> tuple[dict[str, float], int]:
        """Summed returns of one greedy episode per row (or `samples` sampled ones, as training
        samples), and how many episodes (see evaluate.evaluate: sums, for the mean over every
        rank's share). Agents' requests carry no seed of ours: `seed` is unused here."""
        names = ("eval/reward", "eval/failed_fraction", "eval/calls_mean")
        if not rows:
            return dict.fromkeys(names, 0.0), 0
        self._greedy = samples == 1
        try:
            episodes = self._play([dict(row) for row in rows for _ in range(samples)])
        finally:
            self._greedy = False
        returns = self._returns(episodes)
        sums = (
            returns.sum().item(),
            sum(e.failure is not None for e in episodes),
            sum(e.calls for e in episodes),
        )
        return dict(zip(names, map(float, sums), strict=True)), len(episodes)

    def close(self) -> None:
        self.server.stop()
        self._thread.join(timeout=10)

    # --- episodes --------------------------------------------------------------------------

    def _sampling(self, asked: SamplingParams) -> SamplingParams:
        """What an episode request samples with: the run's settings, not the agent's."""
        run = self.params
        return replace(
            asked,
            temperature=0.0 if self._greedy else run.temperature,
            top_p=run.top_p,
            top_k=run.top_k,
            max_new_tokens=min(asked.max_new_tokens, run.max_new_tokens),
        )

    def _play(self, rows: list[dict[str, Any]]) -> list[_Episode]:
        episodes = []
        for row in rows:
            self._count += 1
            episodes.append(_Episode(f"episode-{self._count}", row))
        workers = min(self.settings.concurrency, len(episodes))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="agent") as pool:
            outcomes = list(pool.map(self._run, episodes))
        for episode, outcome in zip(episodes, outcomes, strict=True):
            episode.outcome = outcome
            calls = self.recorder.drain(episode.episode_id)
            episode.calls = len(calls)
            episode.stretches = assemble(calls)
            episode.turns = episode_turns(
                calls, max_calls=self.settings.max_calls, decode=self._decode
            )
            episode.failure = outcome.failure or self._problem(calls)
            if episode.failure is not None:
                message = f"agent episode {episode.episode_id} failed: {episode.failure}"
                if self.settings.stop_on_failure:
                    raise AgentFailure(message)
                log.warning("%s (scored %g)", message, self.settings.failure_reward)
        return episodes

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def _run(self, episode: _Episode) -> AgentOutcome:
        return self.program.run(
            base_url=self.server.episode_url(episode.episode_id),
            api_key=self._api_key,
            task=self.format.reward_row(episode.row),
            episode_id=episode.episode_id,
        )

    def _problem(self, calls: list[RecordedCompletion]) -> str | None:
        if not calls:
            return "the agent asked the model for nothing (no completion was served)"
        if len(calls) > self.settings.max_calls:
            return (
                f"the agent asked for {len(calls)} completions, more than environment.max_turns "
                f"= {self.settings.max_calls}"
            )
        return None

    def _returns(self, episodes: list[_Episode]) -> torch.Tensor:
        scored = [e for e in episodes if e.failure is None]
        totals = []
        if scored:
            prompts = [self.format.prompt_text(e.row) for e in scored]
            answers = [e.outcome.answer if e.outcome else "" for e in scored]
            rows = [self.format.reward_row(e.row) for e in scored]
            totals = self.rewards.score(prompts, answers, rows).total
        by_episode = dict(zip((id(e) for e in scored), totals, strict=True))
        values = [by_episode.get(id(e), self.settings.failure_reward) for e in episodes]
        return torch.tensor(values, dtype=torch.float32, device="cpu")

    def _batch(
        self,
        episodes: list[_Episode],
        returns: torch.Tensor,
        advantages: torch.Tensor,
        group: int,
    ) -> RolloutBatch:
        owners = [i for i, e in enumerate(episodes) for _ in (e.stretches or [])]
        stretches = [s for e in episodes for s in (e.stretches or [])]
        if not stretches:
            raise AgentFailure(
                "no agent episode of this step asked the model for anything: nothing to train on"
            )
        index = torch.tensor(owners, dtype=torch.long, device="cpu")
        return RolloutBatch(
            prompt_ids=[s.prompt for s in stretches],
            completion_ids=[s.tokens for s in stretches],
            old_logprobs=[s.logprobs for s in stretches],
            rewards=returns[index],
            advantages=advantages[index],
            group_size=group,
            policy_version=min(s.policy_version for s in stretches),
            texts=[episodes[i].outcome.answer if episodes[i].outcome else "" for i in owners],
            loss_mask=[s.mask for s in stretches],
        )

    def _metrics(
        self, episodes: list[_Episode], returns: torch.Tensor, seconds: float
    ) -> dict[str, float]:
        count = max(1, len(episodes))
        rows = sum(len(e.stretches or []) for e in episodes)
        generated = sum(sum(s.mask) for e in episodes for s in (e.stretches or []))
        return {
            "reward/mean": returns.mean().item(),
            "reward/std": returns.std().item() if len(returns) > 1 else 0.0,
            "episode/calls_mean": sum(e.calls for e in episodes) / count,
            "episode/rows_mean": rows / count,
            "episode/failed_fraction": sum(e.failure is not None for e in episodes) / count,
            "episode/agent_s_mean": sum(e.outcome.seconds for e in episodes if e.outcome) / count,
            "perf/generated_tokens": float(generated),
            "perf/generate_s": seconds,  # the episodes: the programs and what they were served
        }
