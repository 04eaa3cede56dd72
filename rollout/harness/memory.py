"""Episodic memory: what an agent keeps from one episode to the next, per agent id.

An environment asks for it by naming a `memory` parameter: the run builds it with the run's
EpisodicMemory (one per process). Entries are text with JSON metadata and the training step that
wrote them; each agent keeps its newest `max_entries`. The memory is saved with every checkpoint
(a `memory/` directory holding memory.json) and restored on resume, so a resumed run's agents
remember what they did before the stop; `rollout memory show RUN_ID AGENT` prints it.
"""

from __future__ import annotations

import inspect
import json
import math
import re
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

MEMORY_DIR = "memory"
"""The checkpoint directory the memory is saved in."""
FILE = "memory.json"
FORMAT_VERSION = 1
_WORD = re.compile(r"\w+")


@dataclass(frozen=True)
class MemoryEntry:
    text: str
    metadata: dict[str, Any] = field(default_factory=dict)
    step: int = 0
    """The training step whose episode wrote it."""


class AgentMemory:
    """One agent's entries, oldest first; the oldest go when there are more than max_entries."""

    def __init__(self, owner: EpisodicMemory, entries: list[MemoryEntry]):
        self._owner = owner
        self._entries: deque[MemoryEntry] = deque(entries, maxlen=owner.max_entries)

    def add(self, text: str, **metadata: Any) -> MemoryEntry:
        if not isinstance(text, str):
            raise TypeError(f"a memory entry is text, not {type(text).__name__}")
        try:  # metadata goes into checkpoints as JSON: refuse what would not survive it
            json.dumps(metadata, allow_nan=False)
        except (TypeError, ValueError) as error:
            raise ValueError(f"memory metadata must be JSON (finite numbers): {error}") from None
        entry = MemoryEntry(text, dict(metadata), self._owner.step)
        self._entries.append(entry)
        return entry

    @property
    def entries(self) -> list[MemoryEntry]:
        return list(self._entries)

    def recall(self, query: str, k: int = 5) -> list[MemoryEntry]:
        """The `k` entries sharing the most words with `query` (newest first among equals);
        none that share no word."""
        wanted = set(_WORD.findall(query.lower()))
        scored = [
            (len(wanted & set(_WORD.findall(entry.text.lower()))), i, entry)
            for i, entry in enumerate(self._entries)
        ]
        ranked = sorted((s for s in scored if s[0] > 0), key=lambda s: (-s[0], -s[1]))
        return [entry for _, _, entry in ranked[:k]]

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[MemoryEntry]:
        return iter(list(self._entries))


class EpisodicMemory:
    """Every agent's memory in this process, keyed by agent id."""

    def __init__(self, max_entries: int = 1000):
        if max_entries < 1 or math.isinf(max_entries):
            raise ValueError(f"max_entries must be a positive integer, got {max_entries}")
        self.max_entries = max_entries
        self.step = 0
        """The step being trained (the runtime moves it); entries added now carry it."""
        self._agents: dict[str, AgentMemory] = {}

    def agent(self, agent_id: str) -> AgentMemory:
        if not isinstance(agent_id, str) or not agent_id:
            raise ValueError(f"an agent id is a non-empty string, got {agent_id!r}")
        if agent_id not in self._agents:
            self._agents[agent_id] = AgentMemory(self, [])
        return self._agents[agent_id]

    def agents(self) -> list[str]:
        return sorted(agent for agent, memory in self._agents.items() if len(memory))

    def to_json(self) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "max_entries": self.max_entries,
            "agents": {
                agent: [asdict(entry) for entry in self._agents[agent]] for agent in self.agents()
            },
        }

    def load_json(self, data: dict[str, Any]) -> None:
        if data.get("format_version") != FORMAT_VERSION:
            raise ValueError(
                f"memory format {data.get('format_version')!r}, this rollout reads {FORMAT_VERSION}"
            )
        self._agents = {
            agent: AgentMemory(self, [MemoryEntry(**entry) for entry in entries])
            for agent, entries in data["agents"].items()
        }

    def write(self, directory: Path) -> None:
        """Into a checkpoint's staged `memory/` directory (rollout.runtime.checkpoint.LoopFiles)."""
        directory.mkdir(parents=True, exist_ok=True)
        text = json.dumps(self.to_json(), sort_keys=True, allow_nan=False)
        (directory / FILE).write_text(text, encoding="utf-8")

    def read(self, directory: Path) -> None:
        """From a restored checkpoint's `memory/` directory; an older checkpoint without one
        leaves the memory empty."""
        path = directory / FILE
        if path.is_file():
            self.load_json(json.loads(path.read_text(encoding="utf-8")))


def takes_memory(factory: Callable[..., Any]) -> bool:
    """Whether an environment plugin asks for the episodic memory (names a `memory` parameter)."""
    try:
        return "memory" in inspect.signature(factory).parameters
    except (TypeError, ValueError):  # no signature to read (a C type): it cannot ask
        return False
