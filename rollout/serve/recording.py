"""What the server served, per episode: the record an agent harness assembles trajectories from.

An agent program written against the OpenAI client gets a base URL with its episode in the path,
`.../episodes/{episode_id}/v1`, and every completion the server serves under that prefix is
recorded here with the exact tokens the model was conditioned on and sampled, their log-probs and
the policy version of the weights (engines.base.Completion has them all), and as text what the
client sent and received (for the run report's view of the episode). The harness drains an
episode when it ends and trains on exactly what the agent saw.

The recorder is bounded: at MAX_COMPLETIONS recorded and not yet drained, the server refuses new
episode requests (503) rather than dropping records a trajectory needs; the harness must drain.
The bound is checked when a request is admitted, so requests already in flight may overshoot it
by at most what they generate. Safe to share between threads and an event loop: every method
holds one lock for a few dictionary operations and never blocks on anything else.
"""

from __future__ import annotations

import re
import threading
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from rollout.engines.base import Completion

__all__ = ["EPISODE_ID", "CompletionRecorder", "RecordedCompletion", "RecorderFull"]

MAX_COMPLETIONS = 100_000
"""Completions held (recorded, not drained) before episode requests are refused."""
EPISODE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
"""An episode id as it may appear in the URL path: no slash, no escaping, bounded."""


class RecorderFull(RuntimeError):
    """More completions are held than the recorder's bound: drain finished episodes."""


@dataclass(frozen=True)
class RecordedCompletion:
    """One served completion of an episode, in the order the server finished them."""

    episode_id: str
    kind: str
    """"chat" or "completion": the route it was served on."""
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    """float32 log_softmax(logits / T) of each sampled token, as the learner recomputes it."""
    finish_reason: str
    policy_version: int
    text: str = ""
    """The reply as the client received it (engines.base.Completion.text)."""
    sent: tuple[dict[str, str], ...] = ()
    """What the client sent for this prompt, as text (protocol.GenerationRequest.sent): the
    whole request, history included; the harness keeps what is new of it."""


class CompletionRecorder:
    """Completions served per episode id, held until the harness drains them."""

    def __init__(self, max_completions: int = MAX_COMPLETIONS) -> None:
        if max_completions < 1:
            raise ValueError(f"max_completions must be at least 1, not {max_completions}")
        self.max_completions = max_completions
        self._episodes: defaultdict[str, list[RecordedCompletion]] = defaultdict(list)
        self._held = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """Completions held, over all episodes."""
        with self._lock:
            return self._held

    def check_room(self) -> None:
        """RecorderFull when the bound is reached (the server asks before it generates)."""
        with self._lock:
            if self._held >= self.max_completions:
                raise RecorderFull(
                    f"the completion recorder holds {self._held} completions, its bound: drain "
                    "finished episodes"
                )

    def record(
        self,
        episode_id: str,
        kind: str,
        prompt: Sequence[int],
        completion: Completion,
        sent: Sequence[dict[str, str]] = (),
    ) -> None:
        recorded = RecordedCompletion(
            episode_id=episode_id,
            kind=kind,
            prompt_token_ids=list(prompt),
            token_ids=list(completion.token_ids),
            logprobs=list(completion.logprobs),
            finish_reason=completion.finish_reason,
            policy_version=completion.policy_version,
            text=completion.text,
            sent=tuple(sent),
        )
        with self._lock:
            self._episodes[episode_id].append(recorded)
            self._held += 1

    def episodes(self) -> list[str]:
        """The episode ids holding completions, in the order their first one was recorded."""
        with self._lock:
            return list(self._episodes)

    def drain(self, episode_id: str) -> list[RecordedCompletion]:
        """The episode's completions in the order they finished, removed from the recorder
        (an episode nothing was recorded for gives [])."""
        with self._lock:
            recorded = self._episodes.pop(episode_id, [])
            self._held -= len(recorded)
            return recorded
