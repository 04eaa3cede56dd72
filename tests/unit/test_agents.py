"""Agent programs over rollout's own OpenAI endpoint: the program runner contains what a program
does (time, output, children), episodes are assembled from exactly the served tokens, and the
learner's log-probs of them match the ones served."""

from __future__ import annotations

import copy
import json
import sys
import textwrap
import time
from functools import partial
from pathlib import Path

import pytest
import torch

from rollout.algorithms.advantages import group_advantages
from rollout.engines.base import SamplingParams
from rollout.engines.hf.engine import HfEngine
from rollout.harness.agents import AgentProgram, argv_of, missing_program
from rollout.harness.reward_contract import describe
from rollout.harness.reward_runner import RewardRunner
from rollout.models.loading import apply_chat_template
from rollout.runtime.online.actor import PromptFormat
from rollout.runtime.online.agents import (
    SENT_MESSAGES,
    AgentActor,
    AgentFailure,
    AgentSettings,
    assemble,
    episode_turns,
)
from rollout.runtime.online.batches import pad_for_learner
from rollout.runtime.online.learner import Learner
from rollout.serve.recording import RecordedCompletion
from rollout.storage.base import MAX_SAMPLE_TEXT
from tests.unit.conftest import learner_knobs

# --- assembling episodes ------------------------------------------------------------------------


def call(prompt, tokens, version=0) -> RecordedCompletion:
    return RecordedCompletion(
        "e", "chat", list(prompt), list(tokens), [-0.5] * len(tokens), "eos", version
    )


def test_a_growing_conversation_is_one_row_with_what_came_between_as_context():
    first = call([1, 2, 3], [10, 11])
    second = call([1, 2, 3, 10, 11, 7, 8], [12])  # 7, 8: the tool's answer and the markers
    (row,) = assemble([first, second])
    assert row.prompt == [1, 2, 3] and row.tokens == [10, 11, 7, 8, 12]
    assert row.mask == [1, 1, 0, 0, 1] and row.logprobs == [-0.5, -0.5, 0.0, 0.0, -0.5]


def test_a_call_that_rewrote_the_history_starts_a_row_of_its_own():
    first = call([1, 2, 3], [10, 11])
    rewritten = call([1, 2, 3, 10, 99, 7], [12], version=1)  # token 11 re-tokenized as 99
    rows = assemble([first, rewritten])
    assert [r.prompt for r in rows] == [[1, 2, 3], [1, 2, 3, 10, 99, 7]]
    assert rows[1].mask == [1] and rows[0].policy_version == 0


# --- an episode's calls as a sample's turns -----------------------------------------------------


def chat(messages, reply, tokens=(5, 6), version=0) -> RecordedCompletion:
    sent = tuple({"role": role, "content": content} for role, content in messages)
    return RecordedCompletion(
        "e", "chat", [1], list(tokens), [-0.5] * len(tokens), "stop", version, reply, sent
    )


def test_each_call_is_what_it_sent_that_was_new_then_its_reply_with_its_facts():
    first = chat([("system", "be brief"), ("user", "2+2?")], "four", version=3)
    second = chat(
        [("system", "be brief"), ("user", "2+2?"), ("assistant", "four"), ("tool", "ok: 4")],
        "4",
        tokens=(9,),
        version=4,
    )
    turns = episode_turns([first, second], max_calls=2, decode=str)
    assert [(t["role"], t["content"]) for t in turns] == [
        ("system", "be brief"),
        ("user", "2+2?"),
        ("assistant", "four"),
        ("tool", "ok: 4"),  # the history before the last reply is not repeated
        ("assistant", "4"),
    ]
    assert turns[4] == {
        "role": "assistant",
        "content": "4",
        "call": 2,
        "policy_version": 4,
        "tokens": 1,
        "finish_reason": "stop",
    }


def test_a_completions_call_shows_the_prompt_tokens_past_the_previous_call_as_text():
    def completion(prompt, tokens):
        return RecordedCompletion("e", "completion", prompt, tokens, [0.0] * len(tokens), "eos", 0)

    calls = [completion([1, 2], [3]), completion([1, 2, 3, 4, 5], [6]), completion([7], [8])]
    turns = episode_turns(calls, max_calls=3, decode=lambda ids: " ".join(map(str, ids)))
    prompts = [t["content"] for t in turns if t["role"] == "prompt"]
    assert prompts == ["1 2", "4 5", "7"]  # the third rewrote its history: all of it is news


def test_long_texts_many_messages_and_calls_over_the_limit_are_cut():
    flood = [("user", f"message {i}") for i in range(SENT_MESSAGES + 3)]
    calls = [chat(flood, "x" * (MAX_SAMPLE_TEXT + 10))] + [chat([("user", "again")], "y")] * 4
    turns = episode_turns(calls, max_calls=2, decode=str)
    assert turns[0] == {"role": "note", "content": "[3 earlier messages of this request cut]"}
    assert [t["content"] for t in turns[1 : 1 + SENT_MESSAGES]][-1] == f"message {len(flood) - 1}"
    reply = turns[1 + SENT_MESSAGES]["content"]
    assert reply.startswith("x" * MAX_SAMPLE_TEXT) and reply.endswith("[10 more characters]")
    assert sum(t["role"] == "assistant" for t in turns) == 2
    assert turns[-1] == {"role": "note", "content": "[3 more calls cut]"}


# --- the program runner -------------------------------------------------------------------------


def program(tmp_path: Path, source: str, timeout_s: float = 10, **kw) -> AgentProgram:
    (tmp_path / "agent.py").write_text(textwrap.dedent(source))
    return AgentProgram(argv_of(["python", "agent.py"]), tmp_path, timeout_s, **kw)


def run(agent: AgentProgram, **task):
    return agent.run(base_url="http://x/v1", api_key="k", task=task, episode_id="e-1")


def test_the_final_answer_is_the_last_line_and_the_task_is_given(tmp_path):
    agent = program(
        tmp_path,
        """
        import json, os
        task = json.loads(os.environ["ROLLOUT_TASK"])
        print("thinking...")
        print(os.environ["OPENAI_BASE_URL"], task["prompt"])
        print()
        """,
    )
    outcome = run(agent, prompt="2+2")
    assert outcome.failure is None and outcome.answer == "http://x/v1 2+2"


@pytest.mark.parametrize(
    ("source", "failure"),
    [
        ("import time\ntime.sleep(30)\n", "did not finish within 1 s"),
        (
            "import sys\nsys.stdout.write('x' * 5_000_000)\nimport time\ntime.sleep(30)\n",
            "more than",
        ),
        ("import sys\nsys.exit(3)\n", "exited with code 3"),
    ],
)
def test_a_hung_flooding_or_failing_program_is_stopped_and_reported(tmp_path, source, failure):
    began = time.monotonic()
    outcome = run(program(tmp_path, source, timeout_s=1, max_output_bytes=1 << 20))
    assert failure in outcome.failure and time.monotonic() - began < 8


def test_nothing_the_program_started_outlives_the_episode(tmp_path):
    agent = program(
        tmp_path,
        """
        import subprocess, sys
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        open("child.pid", "w").write(str(child.pid))
        print("done")
        """,
    )
    assert run(agent).answer == "done"
    pid = int((tmp_path / "child.pid").read_text())
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_the_plan_can_tell_a_missing_program_or_script(tmp_path):
    assert "no script agent.py" in missing_program(argv_of("python agent.py"), tmp_path)
    assert "no program 'no-such-agent'" in missing_program(("no-such-agent",), tmp_path)
    (tmp_path / "agent.py").write_text("")
    assert missing_program(argv_of("python agent.py"), tmp_path) is None
    assert argv_of("python agent.py")[0] == sys.executable


# --- agents over the server ---------------------------------------------------------------------

CHATTY_AGENT = """
import json, os
from openai import OpenAI

client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY come from the harness
task = json.loads(os.environ["ROLLOUT_TASK"])
messages = [{"role": "user", "content": task["prompt"]}]
first = client.chat.completions.create(model="policy", messages=messages, max_tokens=5, temperature=1.7)
messages += [
    {"role": "assistant", "content": first.choices[0].message.content},
    {"role": "user", "content": "The calculator says 4. Your final answer?"},
]
second = client.chat.completions.create(model="policy", messages=messages, max_tokens=5)
print(second.choices[0].message.content.replace("\\n", " ") or "-")
"""


@pytest.fixture
def actor(tiny_llama, tmp_path):
    (tmp_path / "agent.py").write_text(CHATTY_AGENT)
    engine = HfEngine(
        tiny_llama.model,
        eos_token_ids=tiny_llama.eos_token_ids,
        pad_token_id=tiny_llama.pad_token_id,
        tokenizer=tiny_llama.tokenizer,
        max_batch_size=None,
        device="cpu",
    )
    fmt = PromptFormat(
        encode=lambda t: apply_chat_template(
            tiny_llama.tokenizer, tiny_llama.chat_template, t, None
        ),
        prompt_field="prompt",
        role_fields={},
    )
    length = describe("length", lambda p, c: [len(x) / 10 for x in c], 1.0, {}, 10)
    made = AgentActor(
        RewardRunner([length]),
        engine,
        fmt,
        AgentProgram(argv_of("python agent.py"), tmp_path, 60),
        partial(group_advantages, scale="group"),
        SamplingParams(max_new_tokens=4, temperature=1.0, n=2),
        AgentSettings(concurrency=4, max_calls=2, failure_reward=-1.0, stop_on_failure=False),
        tokenizer=tiny_llama.tokenizer,
        chat_template=tiny_llama.chat_template,
    )
    yield made
    made.close()


def test_agent_episodes_train_on_exactly_the_tokens_they_were_served(tiny_llama, actor):
    rollout = actor.rollout([{"prompt": "What is 2 + 2?"}, {"prompt": "Hi"}], seed=0)
    batch = rollout.batch
    assert rollout.metrics["episode/failed_fraction"] == 0.0
    assert rollout.metrics["episode/calls_mean"] == 2.0
    # Two calls per episode. The second joins the first's row when the agent's history renders
    # back to the very tokens sampled (the tool turn then masked between them); a random model's
    # often does not (special tokens dropped from the text), and then it is a row of its own.
    assert 4 <= len(batch) <= 8
    decode = tiny_llama.tokenizer.decode
    second_calls = 0
    for prompt, tokens, mask in zip(
        batch.prompt_ids, batch.completion_ids, batch.loss_mask, strict=True
    ):
        answered = [t for t, m in zip(tokens, mask, strict=True) if m]
        assert 0 < len(answered) <= 8  # at most two answers of max_new_tokens = 4 (not 5)
        between = decode([t for t, m in zip(tokens, mask, strict=True) if not m])
        second_calls += "The calculator says 4" in between + decode(prompt)
    assert second_calls == 4  # one per episode, joined or on its own
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
    # The agent asked for temperature 1.7; the run's 1.0 was served, and is what the learner uses.
    torch.testing.assert_close(recomputed[mask], padded.old_logprobs[mask], atol=2e-4, rtol=0)
    # Scored on the final answers: rewards are the answers' lengths / 10.
    assert batch.rewards.tolist() == pytest.approx([len(t) / 10 for t in batch.texts])


RECEIVING_AGENT = """
import json, os
from openai import OpenAI

client = OpenAI()
task = json.loads(os.environ["ROLLOUT_TASK"])
messages, received = [{"role": "user", "content": task["prompt"]}], []
for note in ("check with the abacus", "final answer?"):
    reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    received.append(reply.choices[0].message.content)
    messages += [{"role": "assistant", "content": received[-1]}, {"role": "user", "content": note}]
with open(os.environ["ROLLOUT_EPISODE_ID"] + ".json", "w") as out:
    json.dump(received, out)
print("answer: " + str(len(received)))
"""


def test_an_episodes_sample_holds_every_call_as_the_agent_saw_it(actor, tmp_path):
    (tmp_path / "agent.py").write_text(RECEIVING_AGENT)
    rollout = actor.rollout([{"prompt": "What is 2 + 2?"}], seed=0)
    assert len(rollout.samples) == 2
    for sample in rollout.samples:
        episode = sample.extra["episode_id"]
        received = json.loads((tmp_path / f"{episode}.json").read_text())
        replies = [t for t in sample.turns if t["role"] == "assistant"]
        assert [t["content"] for t in replies] == received
        assert [t["call"] for t in replies] == [1, 2] == list(range(1, sample.extra["calls"] + 1))
        assert all(t["policy_version"] == 0 and 0 < t["tokens"] <= 4 for t in replies)
        sent = [t["content"] for t in sample.turns if t["role"] == "user"]
        assert sent == ["What is 2 + 2?", "check with the abacus"]
        assert sample.completion == "answer: 2" and sample.extra["failure"] is None


def test_a_failing_agent_scores_failed_or_stops(actor, tmp_path):
    (tmp_path / "agent.py").write_text("import sys\nsys.exit(1)\n")
    with pytest.raises(AgentFailure, match="the model for anything"):
        actor.rollout([{"prompt": "x"}], seed=0)  # no episode asked for anything
    actor.settings = AgentSettings(4, 2, -1.0, stop_on_failure=True)
    with pytest.raises(AgentFailure, match="exited with code 1"):
        actor.rollout([{"prompt": "x"}], seed=0)


def test_evaluation_plays_one_greedy_episode_per_row(actor):
    sums, count = actor.evaluate([{"prompt": "What is 2 + 2?"}], seed=0)
    assert count == 1 and sums["eval/calls_mean"] == 2.0 and sums["eval/failed_fraction"] == 0.0
    again, _ = actor.evaluate([{"prompt": "What is 2 + 2?"}], seed=0)
    assert again == sums  # greedy: the same answers
