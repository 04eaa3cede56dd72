"""The tools environment: answers with tool calls get the tools' results (in the chat template's
tool role when it has one), malformed calls get an error observation, a final answer is scored by
the run's rewards and ends the episode; tool-call counts reach the episode metrics."""

from __future__ import annotations

import time
from functools import partial

import pytest

from rollout.algorithms.advantages import group_advantages, turn_advantages
from rollout.engines.base import SamplingParams
from rollout.engines.hf.engine import HfEngine
from rollout.harness.environments.base import StepResult
from rollout.harness.environments.runner import EnvironmentRunner
from rollout.harness.environments.tools import ToolEnvironment
from rollout.harness.reward_runner import RewardRunner
from rollout.harness.rewards import BUILTIN_REWARDS
from rollout.harness.sandbox import probe_sandbox
from rollout.harness.tools import BUILTIN_TOOLS, Toolbox
from rollout.models.loading import apply_chat_template
from rollout.runtime.online.actor import PromptFormat
from rollout.runtime.online.episodes import EpisodeActor, EpisodeSettings, TurnFormat

ROWS = [{"prompt": "What is 123 * 45?", "answer": "5535"}]


def numeric_match(prompts, completions, rows):
    score = BUILTIN_REWARDS["numeric_match"]
    return score(prompts, completions, answer=[row["answer"] for row in rows])


def environment(format="hermes") -> ToolEnvironment:
    return ToolEnvironment(
        numeric_match, "prompt", Toolbox([BUILTIN_TOOLS["calculator"]()]), format=format
    )


def call(expression: str) -> str:
    return (
        f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}'
        "</tool_call>"
    )


def test_a_tool_call_then_a_final_answer_is_scored_by_the_rewards():
    env = environment()
    [first] = env.reset(ROWS, seed=0)
    assert "<tools>" in first and first.endswith("What is 123 * 45?")
    [result] = env.step([0], [call("123 * 45")])
    assert result.observation == "5535" and result.role == "tool" and not result.done
    assert result.reward == 0.0 and result.info == {"tool_calls": 1, "invalid_tool_calls": 0}
    [final] = env.step([0], ["It is 5535."])
    assert final.done and final.reward == 1.0 and final.info["tool_calls"] == 0
    [wrong] = env.step([0], ["It is 5000."])
    assert wrong.done and wrong.reward == 0.0


def test_malformed_calls_are_error_observations_and_the_episode_goes_on():
    env = environment()
    env.reset(ROWS * 3, seed=0)
    results = env.step(
        [0, 1, 2],
        [
            "<tool_call>{not json</tool_call>",
            '<tool_call>{"name": "calc", "arguments": {}}</tool_call>',
            '<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>',
        ],
    )
    texts = [r.observation for r in results]
    assert "not valid JSON" in texts[0]
    assert "no tool 'calc'" in texts[1]
    assert "bad arguments for 'calculator'" in texts[2]
    assert all(not r.done and r.info["invalid_tool_calls"] == 1 for r in results)


def test_several_calls_in_one_answer_are_answered_together():
    env = environment()
    env.reset(ROWS, seed=0)
    [result] = env.step([0], [call("1+1") + call("2*3")])
    assert result.observation == "[1] calculator: 2\n\n[2] calculator: 6"
    assert result.info == {"tool_calls": 2, "invalid_tool_calls": 0}


def test_the_json_format_reads_the_whole_answer():
    env = environment("json")
    env.reset(ROWS, seed=0)
    [result] = env.step([0], ['{"name": "calculator", "arguments": {"expression": "2**8"}}'])
    assert result.observation == "256"
    [final] = env.step([0], ["5535"])
    assert final.done and final.reward == 1.0


def test_every_episode_has_its_own_directory_removed_at_the_next_reset_and_close():
    env = ToolEnvironment(
        numeric_match,
        "prompt",
        Toolbox([BUILTIN_TOOLS["write_file"](), BUILTIN_TOOLS["list_files"]()]),
    )
    env.reset(ROWS * 2, seed=0)
    write = (
        '<tool_call>{"name": "write_file", "arguments": {"path": "a", "content": "x"}}</tool_call>'
    )
    listing = '<tool_call>{"name": "list_files", "arguments": {}}</tool_call>'
    env.step([0], [write])
    assert [r.observation for r in env.step([0, 1], [listing, listing])] == ["a", "(empty)"]
    root = env._root
    env.reset(ROWS, seed=1)
    assert root is not None and not root.exists()
    second = env._root
    env.close()
    assert second is not None and not second.exists()


# --- through the episode actor -------------------------------------------------------------------


class Scripted:
    """The tools environment, with the model's answers replaced by a script per turn (the tiny
    model never writes a tool call): the real actor, engine, chat template and metrics."""

    def __init__(self, inner, script):
        self.inner, self.script, self.turn = inner, script, 0

    def reset(self, rows, *, seed):
        self.turn = 0
        return self.inner.reset(rows, seed=seed)

    def step(self, episodes, actions):
        answers = [self.script[self.turn][i] for i in episodes]
        self.turn += 1
        return self.inner.step(episodes, answers)


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


def actor(tiny_llama, engine, env, template=None) -> EpisodeActor:
    template = template or tiny_llama.chat_template
    return EpisodeActor(
        RewardRunner([]),
        engine,
        PromptFormat(
            encode=lambda text: apply_chat_template(tiny_llama.tokenizer, template, text, None),
            prompt_field="prompt",
            role_fields={},
        ),
        EnvironmentRunner(env, name="tools", timeout_s=30),
        TurnFormat(tiny_llama.tokenizer, template, None, frozenset(tiny_llama.eos_token_ids)),
        partial(group_advantages, scale="group"),
        partial(turn_advantages, scale="group"),
        SamplingParams(max_new_tokens=4, n=2),
        EpisodeSettings(
            max_turns=3,
            max_prompt_tokens=640,
            max_observation_tokens=48,
            advantage="episode",
            failure_reward=0.0,
        ),
    )


def test_episodes_carry_tool_results_in_the_tool_role_and_report_tool_use(tiny_llama, engine):
    script = [
        [call("123 * 45"), "<tool_call>{oops</tool_call>"],  # turn 1: a good and a bad call
        ["5535", "5000"],  # turn 2: final answers, one right
    ]
    rollout = actor(tiny_llama, engine, Scripted(environment(), script)).rollout(ROWS, seed=3)
    batch, metrics = rollout.batch, rollout.metrics
    assert batch.rewards.tolist() == [1.0, 0.0]
    decoded = [
        tiny_llama.tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if not m])
        for ids, mask in zip(batch.completion_ids, batch.loss_mask, strict=True)
    ]
    assert "<|im_start|>tool\n5535<|im_end|>" in decoded[0]
    assert "<|im_start|>tool\nerror: the tool call is not valid JSON" in decoded[1]
    assert metrics["episode/turns_mean"] == 2.0
    assert metrics["episode/tool_calls_mean"] == 1.0
    assert metrics["episode/invalid_tool_calls_mean"] == 0.5
    assert metrics["episode/valid_tool_call_fraction"] == 0.5


NO_TOOL_ROLE = (
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['user', 'assistant', 'system'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{%- endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_without_a_tool_role_in_the_template_results_are_user_turns(tiny_llama, engine):
    script = [[call("2+2")] * 2, ["4"] * 2]
    env = Scripted(environment(), script)
    batch = actor(tiny_llama, engine, env, NO_TOOL_ROLE).rollout(ROWS, seed=3).batch
    message = tiny_llama.tokenizer.decode(
        [t for t, m in zip(batch.completion_ids[0], batch.loss_mask[0], strict=True) if not m]
    )
    assert "<|im_start|>user\n4<|im_end|>" in message and "tool" not in message


def test_environments_without_tools_report_no_tool_metrics(tiny_llama, engine):
    class Once:
        def reset(self, rows, *, seed):
            return ["hi"] * len(rows)

        def step(self, episodes, actions):
            return [StepResult(done=True) for _ in episodes]

    metrics = actor(tiny_llama, engine, Once()).rollout(ROWS, seed=1).metrics
    assert not any(name.startswith("episode/tool") for name in metrics)


def test_slow_tool_calls_run_side_by_side_and_never_overrun_the_step():
    if not probe_sandbox().works("network isolation"):
        pytest.skip("this host's sandbox cannot isolate the network")
    env = ToolEnvironment(
        numeric_match,
        "prompt",
        Toolbox([BUILTIN_TOOLS["python"](wall_s=1.5, cpu_s=5)]),
        step_timeout_s=4.5,  # 2.5 s for calls after the margin: one 1.5 s call per answer
    )
    env.reset(ROWS * 4, seed=0)
    spin = '<tool_call>{"name": "python", "arguments": {"code": "while True: pass"}}</tool_call>'
    started = time.monotonic()
    results = env.step([0, 1, 2, 3], [spin * 3] * 4)
    took = time.monotonic() - started
    assert took < 4.5, took  # four episodes' 1.5 s calls at once, not 4 x 3 x 1.5 s
    for result in results:
        first, *rest = result.observation.split("\n\n")
        assert "stopped: timeout" in first
        assert all("no time left in this turn for python" in text for text in rest)
    env.close()


def test_the_warm_up_demonstrations_open_as_the_environment_does():
    """examples/make_tool_demos.py must render the first message the run gives the model, or
    the warm-up teaches a prompt the run never shows (docs/tools.md)."""
    import importlib.util
    import json

    from tests.conftest import EXAMPLES

    spec = importlib.util.spec_from_file_location("demos", EXAMPLES / "make_tool_demos.py")
    assert spec is not None and spec.loader is not None
    demos = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demos)
    row = json.loads((EXAMPLES / "data" / "products-train.jsonl").read_text().splitlines()[0])
    messages = demos.demonstration(
        Toolbox([BUILTIN_TOOLS["calculator"]()]).instructions("hermes"), row
    )["messages"]
    env = environment()
    try:
        assert messages[0]["content"] == env.reset([row], seed=0)[0]
        (result,) = env.step([0], [messages[1]["content"]])
        assert result.observation == messages[2]["content"] == row["answer"]  # the call works
        (final,) = env.step([0], [messages[3]["content"]])
        assert final.done and final.reward == 1.0
    finally:
        env.close()
