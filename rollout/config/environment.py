"""[environment]: what the model talks to in a multi-turn episode (online algorithms)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field

from rollout.config.base import ConfigModel
from rollout.config.rewards import PluginRef, check_options_are_finite

SINGLE_TURN = "single_turn"
TOOLS = "tools"
AGENT = "agent"


class ToolSpec(ConfigModel):
    name: PluginRef = Field(
        description="The tool: a built-in ('calculator', 'python', 'shell', 'read_file', "
        "'write_file', 'list_files', 'http_get'), or a function 'package.module:function' / "
        "'./file.py:function' called with the call's arguments as keyword arguments (see "
        "docs/tools.md).",
    )
    options: Annotated[dict[str, Any], AfterValidator(check_options_are_finite)] = Field(
        default_factory=dict,
        description="A built-in tool's options (e.g. shell: allowed = ['ls', 'cat']; http_get: "
        "allowed_hosts = ['example.com']; python: wall_s, cpu_s, memory_mb, processes); a "
        "function tool takes none.",
    )
    function: Annotated[dict[str, Any], AfterValidator(check_options_are_finite)] | None = Field(
        default=None,
        description="A function tool's OpenAI declaration: {name, description, parameters} "
        "with parameters a JSON Schema object; without it the function's `schema` attribute "
        "is used. Built-in tools declare themselves.",
    )


class EnvironmentSection(ConfigModel):
    name: PluginRef = Field(
        default=SINGLE_TURN,
        description="The environment: a built-in ('single_turn': one answer scored by "
        "[[rewards]], what runs without this section; 'tools': the model may call "
        "environment.tools before its final answer, which [[rewards]] score; 'guess_number': "
        "a multi-turn guessing game; 'gymnasium': a Gymnasium environment with text "
        "observations; 'agent': an agent program per episode, talking to the policy over "
        "rollout's OpenAI endpoint, its final answer scored by [[rewards]]), "
        "'package.module:Class', './file.py:Class' (relative to the config file), or an entry "
        "point in the 'rollout.environments' group. It is called once as name(**options) and "
        "returns an object with reset(rows, seed=) and step(episodes, actions) (see "
        "docs/environments.md).",
    )
    options: Annotated[dict[str, Any], AfterValidator(check_options_are_finite)] = Field(
        default_factory=dict,
        description="Keyword arguments the environment is built with ('single_turn' takes none).",
    )
    max_turns: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Most answers the model gives in one episode; the episode ends there if the "
        "environment has not ended it.",
    )
    max_observation_tokens: int = Field(
        default=64,
        ge=1,
        description="Most tokens one environment message may take in the context (the chat "
        "template's turn markers included); a longer one is cut. With max_turns, "
        "generation.max_prompt_tokens and generation.max_new_tokens it sets the episode's "
        "context budget, which the plan checks against the model's context length.",
    )
    advantage: Literal["episode", "turn"] = Field(
        default="episode",
        description="'episode': every answer of an episode gets the episode's advantage (its "
        "return against its group's); 'turn': each answer gets the return from its turn on, "
        "against the group's mean return. For ppo and reinforce_pp, where the rewards go: "
        "the episode's return on its last token ('episode'), or each turn's reward on the "
        "last token of its answer ('turn').",
    )
    timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="Longest one reset or step call may take for the whole batch.",
    )
    on_error: Literal["stop", "fail_episode"] = Field(
        default="stop",
        description="When the environment raises, hangs past timeout_s or returns something "
        "malformed: 'stop' ends the step with an error naming the environment and episode; "
        "'fail_episode' ends the episodes concerned with failure_reward and logs why (a failing "
        "reset always stops).",
    )
    failure_reward: float = Field(
        default=0.0,
        allow_inf_nan=False,
        description="The return of an episode its environment failed (on_error = 'fail_episode').",
    )
    isolation: Literal["in_process", "sidecar"] = Field(
        default="in_process",
        description="Where a plugin environment runs: in the worker ('in_process'), or in a "
        "process of its own ('sidecar', docs/sidecar.md), killed when a reset or step passes "
        "timeout_s and restarted at the next reset (a hung or crashed step fails as on_error "
        "says; a reset is retried once). Only for a plugin environment (not single_turn, "
        "tools or agent) that keeps no episodic memory.",
    )
    python: str | None = Field(
        default=None,
        min_length=1,
        description="With isolation = 'sidecar': the Python interpreter the sidecar runs; "
        "rollout and the plugin must import there. Default: the Python running rollout.",
    )

    tools: list[ToolSpec] = Field(
        default_factory=list,
        description="The tools of the 'tools' environment ([[environment.tools]] tables), at "
        "least one; other environments take none.",
    )
    tool_format: Literal["hermes", "json"] = Field(
        default="hermes",
        description="How the model writes a tool call ('tools' environment): 'hermes' "
        '(<tool_call>{"name": ..., "arguments": {...}}</tool_call>, the Hermes/Qwen '
        "templates' format) or 'json' (the whole answer is that JSON object).",
    )
    allow_unsandboxed: bool = Field(
        default=False,
        description="Let tools that run model-written code (python, shell) run although this "
        "host's sandbox lacks a capability (network isolation, ...): the plan then warns "
        "instead of refusing, and plan.lock records it. Only with such a tool.",
    )

    @property
    def is_single_turn(self) -> bool:
        return self.name == SINGLE_TURN

    @property
    def is_tools(self) -> bool:
        return self.name == TOOLS

    @property
    def is_agent(self) -> bool:
        return self.name == AGENT


def episode_tokens(
    max_prompt_tokens: int, max_new_tokens: int, environment: EnvironmentSection | None
) -> int:
    """The longest an episode's context can grow: its prompt, every answer, and every environment
    message between two answers."""
    turns = 1 if environment is None else environment.max_turns
    observations = 0 if environment is None else (turns - 1) * environment.max_observation_tokens
    return max_prompt_tokens + turns * max_new_tokens + observations
