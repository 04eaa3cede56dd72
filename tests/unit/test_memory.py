"""Episodic memory: entries per agent, bounded, recalled by shared words, saved and read back."""

from __future__ import annotations

import pytest

from rollout.harness.memory import EpisodicMemory, takes_memory


def test_entries_carry_the_step_and_metadata_and_stay_per_agent():
    memory = EpisodicMemory()
    memory.step = 3
    memory.agent("a").add("the secret was 7", game=1)
    memory.step = 4
    memory.agent("b").add("the door is locked")
    (entry,) = memory.agent("a").entries
    assert (entry.text, entry.metadata, entry.step) == ("the secret was 7", {"game": 1}, 3)
    assert memory.agents() == ["a", "b"] and len(memory.agent("b")) == 1


def test_an_agent_keeps_its_newest_entries():
    memory = EpisodicMemory(max_entries=2)
    agent = memory.agent("a")
    for i in range(5):
        agent.add(f"entry {i}")
    assert [e.text for e in agent] == ["entry 3", "entry 4"]


def test_recall_ranks_by_shared_words_and_skips_unrelated():
    agent = EpisodicMemory().agent("a")
    agent.add("the secret was 7 in game one")
    agent.add("weather is fine")
    agent.add("game two: the secret was 3")
    found = agent.recall("what was the secret in game one", k=5)
    assert [e.text for e in found] == ["the secret was 7 in game one", "game two: the secret was 3"]
    assert agent.recall("nothing matches here") == []


def test_memory_round_trips_through_a_checkpoint_directory(tmp_path):
    memory = EpisodicMemory(max_entries=5)
    memory.step = 2
    memory.agent("player").add("won in 3 turns", turns=3)
    memory.write(tmp_path / "memory")
    restored = EpisodicMemory(max_entries=5)
    restored.read(tmp_path / "memory")
    assert restored.to_json() == memory.to_json()
    empty = EpisodicMemory()
    empty.read(tmp_path / "nothing-here")  # an older checkpoint without memory
    assert empty.agents() == []


def test_metadata_must_survive_json_and_ids_must_be_text():
    agent = EpisodicMemory().agent("a")
    with pytest.raises(ValueError, match="must be JSON"):
        agent.add("x", score=float("nan"))
    with pytest.raises(ValueError, match="must be JSON"):
        agent.add("x", thing=object())
    with pytest.raises(TypeError):
        agent.add(3)
    with pytest.raises(ValueError, match="agent id"):
        EpisodicMemory().agent("")


def test_an_environment_asks_for_memory_by_naming_the_parameter():
    class Remembers:
        def __init__(self, memory, level=1): ...

    class Forgets:
        def __init__(self, level=1): ...

    assert takes_memory(Remembers) and not takes_memory(Forgets)
