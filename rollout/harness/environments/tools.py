"""The `tools` environment: the model may call tools before it answers.

Each turn, an answer that calls tools (in the configured format) gets the tools' results as the
next message (in the chat template's tool role where it has one); a malformed call gets an error
message saying what is wrong, and costs its turn. An answer without a tool call is the final
answer: the run's [[rewards]] score it, as the single_turn environment does, and the episode
ends. An episode that runs out of turns while still calling tools ends with return 0.

Every episode has its own directory, which the file tools, python and shell share; the
directories are removed at the next reset and when the run ends.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rollout.harness.environments.base import Row, StepResult
from rollout.harness.environments.single_turn import Score
from rollout.harness.tools import Outcome, Toolbox, ToolContext, ToolFormat, parse_calls

TOOLS = "tools"
MAX_PARALLEL_CALLS = 32
"""Episodes whose tool calls run at once; more wait for a free worker."""
STEP_MARGIN_S = 2.0
"""Time kept free at the end of a step (a sandboxed process's teardown, the step's bookkeeping):
a tool call starts only when its limit ends this long before environment.timeout_s."""


class ToolEnvironment:
    def __init__(
        self,
        score: Score,
        prompt_field: str,
        toolbox: Toolbox,
        *,
        format: ToolFormat = "hermes",
        require_network_isolation: bool = True,
        step_timeout_s: float | None = None,
    ):
        self._score = score
        self.step_timeout_s = step_timeout_s
        """The step's time limit (environment.timeout_s): a call whose tool could run past it,
        less STEP_MARGIN_S, is not started, so slow tools cannot make the step overrun."""
        self._prompt_field = prompt_field
        self.toolbox = toolbox
        self.format = format
        self.require_network_isolation = require_network_isolation
        self._rows: list[Row] = []
        self._root: Path | None = None
        self._contexts: list[ToolContext] = []

    def reset(self, rows: Sequence[Row], *, seed: int) -> list[str]:
        self.close()
        self._root = Path(tempfile.mkdtemp(prefix="rollout-tools-"))
        self._rows = list(rows)
        self._contexts = []
        for i in range(len(rows)):
            workdir = self._root / f"episode-{i}"
            workdir.mkdir()
            self._contexts.append(ToolContext(workdir, self.require_network_isolation))
        intro = self.toolbox.instructions(self.format)
        return [first_message(intro, row[self._prompt_field]) for row in rows]

    def step(self, episodes: Sequence[int], actions: Sequence[str]) -> list[StepResult]:
        limit = self.step_timeout_s
        deadline = None if limit is None else time.monotonic() + limit - STEP_MARGIN_S
        parsed = [parse_calls(action, self.format) for action in actions]
        finals = [position for position, calls in enumerate(parsed) if not calls]
        calling = [position for position, calls in enumerate(parsed) if calls]
        results = self._score_finals(episodes, actions, finals)

        def answer(position: int) -> list[Outcome]:
            # one answer's calls in order (a later call may read what an earlier one wrote)
            context = self._contexts[episodes[position]]
            return [self.toolbox.run(call, context, deadline) for call in parsed[position]]

        # Episodes' calls run side by side: a tool waiting on its sandboxed process holds no
        # lock, so a step takes about its slowest answer, not the sum of all.
        with ThreadPoolExecutor(max(1, min(len(calling), MAX_PARALLEL_CALLS))) as pool:
            answered = list(pool.map(answer, calling))
        for position, outcomes in zip(calling, answered, strict=True):
            results[position] = StepResult(
                _observation(outcomes),
                role="tool",
                info={
                    "tool_calls": len(outcomes),
                    "invalid_tool_calls": sum(not outcome.valid for outcome in outcomes),
                },
            )
        return [results[position] for position in range(len(episodes))]

    def _score_finals(
        self, episodes: Sequence[int], actions: Sequence[str], finals: list[int]
    ) -> dict[int, StepResult]:
        """The final answers scored by the run's rewards (first: what is left of the step's
        time then goes to the tools)."""
        if not finals:
            return {}
        rows = [self._rows[episodes[p]] for p in finals]
        prompts = [str(row[self._prompt_field]) for row in rows]
        rewards = self._score(prompts, [actions[p] for p in finals], rows)
        done = {"tool_calls": 0, "invalid_tool_calls": 0}
        return {
            position: StepResult(reward=reward, done=True, info=done)
            for position, reward in zip(finals, rewards, strict=True)
        }

    def close(self) -> None:
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None


def first_message(instructions: str, prompt: object) -> str:
    """An episode's first message: the tools and how to call them, then the task (the planner
    counts its tokens against generation.max_prompt_tokens the same way)."""
    return f"{instructions}\n\n{prompt}"


def _observation(outcomes: list[Outcome]) -> str:
    if len(outcomes) == 1:
        return outcomes[0].text
    return "\n\n".join(
        f"[{i}] {outcome.name or 'call'}: {outcome.text}" for i, outcome in enumerate(outcomes, 1)
    )
