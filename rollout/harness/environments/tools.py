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
from collections.abc import Sequence
from pathlib import Path

from rollout.harness.environments.base import Row, StepResult
from rollout.harness.environments.single_turn import Score
from rollout.harness.tools import Outcome, Toolbox, ToolContext, ToolFormat, parse_calls

TOOLS = "tools"


class ToolEnvironment:
    def __init__(
        self,
        score: Score,
        prompt_field: str,
        toolbox: Toolbox,
        *,
        format: ToolFormat = "hermes",
        require_network_isolation: bool = True,
    ):
        self._score = score
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
        results: dict[int, StepResult] = {}
        finals: list[int] = []
        for position, (episode, action) in enumerate(zip(episodes, actions, strict=True)):
            calls = parse_calls(action, self.format)
            if not calls:
                finals.append(position)
                continue
            outcomes = [self.toolbox.run(call, self._contexts[episode]) for call in calls]
            results[position] = StepResult(
                _observation(outcomes),
                role="tool",
                info={
                    "tool_calls": len(outcomes),
                    "invalid_tool_calls": sum(not outcome.valid for outcome in outcomes),
                },
            )
        if finals:
            rows = [self._rows[episodes[p]] for p in finals]
            prompts = [str(row[self._prompt_field]) for row in rows]
            rewards = self._score(prompts, [actions[p] for p in finals], rows)
            for position, reward in zip(finals, rewards, strict=True):
                results[position] = StepResult(
                    reward=reward, done=True, info={"tool_calls": 0, "invalid_tool_calls": 0}
                )
        return [results[position] for position in range(len(episodes))]

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
