"""How a training record becomes token ids for the offline objectives (DPO, IPO, KTO, SFT, RM),
and how long an online algorithm's prompt is.

One set of rules serves two tokenizers: the planner's (torch-free, for the max_length and
max_prompt_tokens checks) and the worker's (transformers, for training), so a record's length at
plan time is its length in the run. The rules:

- prompt: a string becomes one user turn (after data.system_prompt, if set) rendered with the
  chat template and the assistant turn opened; a list of {role, content} messages is rendered as
  it is. Without the chat template, a string is encoded with the tokenizer's special tokens.
- completion (chosen, rejected, KTO's and SFT's completion): its text, then the end-of-turn token,
  exactly what the policy would have to generate after the prompt. A list holding one assistant
  message stands for its content.
- messages (SFT): the whole conversation rendered with the chat template; the tokens of each
  assistant turn are the ones learned from.

Problems with a record raise SampleError naming the role (prompt, chosen, label, ...) at fault.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from rollout.models.loading import LoadedModel

Message = Mapping[str, Any]


class TextTokenizer(Protocol):
    """The two operations the rules need, with the model's end-of-turn token."""

    eos_token_id: int

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]: ...

    def chat(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool) -> list[int]:
        """Token ids of the conversation rendered by the chat template."""
        ...


class SampleError(ValueError):
    """A record cannot be turned into a training sample; ``role`` is the field map entry at fault."""

    def __init__(self, role: str, message: str, hint: str | None = None):
        super().__init__(message)
        self.role = role
        self.hint = hint


@dataclass(frozen=True)
class Pair:
    prompt: list[int]
    chosen: list[int]
    rejected: list[int]

    @property
    def length(self) -> int:
        return len(self.prompt) + max(len(self.chosen), len(self.rejected))


@dataclass(frozen=True)
class Judged:
    """A KTO sample: one completion and whether it is desirable."""

    prompt: list[int]
    completion: list[int]
    desirable: bool

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.completion)


@dataclass(frozen=True)
class Demonstration:
    """An SFT sample: token ids, and which of them are learned (predicted from the one before)."""

    ids: list[int]
    targets: list[bool]

    @property
    def length(self) -> int:
        return len(self.ids)


SAMPLE_OF = {"dpo": "pair", "ipo": "pair", "rm": "pair", "kto": "judged", "sft": "sequence"}
"""Algorithm kind -> the SampleRules method that reads its records."""


@dataclass(frozen=True)
class SampleRules:
    """The record -> token ids rules of one run: its tokenizer, field map and chat settings."""

    tokenizer: TextTokenizer
    fields: Mapping[str, str | None]
    """Role (prompt, chosen, rejected, completion, label, messages) -> record field."""
    use_chat_template: bool = True
    system_prompt: str | None = None
    completion_only_loss: bool = True

    def sample(self, kind: str, record: Mapping[str, Any]) -> Pair | Judged | Demonstration:
        """The sample an algorithm of ``kind`` trains on."""
        return getattr(self, SAMPLE_OF[kind])(record)

    def pair(self, record: Mapping[str, Any]) -> Pair:
        return Pair(
            self.prompt(record),
            self.completion(record, "chosen"),
            self.completion(record, "rejected"),
        )

    def judged(self, record: Mapping[str, Any]) -> Judged:
        label = self._value(record, "label")
        if not isinstance(label, bool):
            raise SampleError(
                "label",
                f"{self._field('label')!r} is {label!r}, not a boolean",
                hint="write true for a desirable completion and false for an undesirable one",
            )
        return Judged(self.prompt(record), self.completion(record, "completion"), label)

    def sequence(self, record: Mapping[str, Any]) -> Demonstration:
        if self.fields.get("messages"):
            ids, targets = self._conversation(self._messages(record, "messages"))
        else:
            prompt, completion = self.prompt(record), self.completion(record, "completion")
            ids = prompt + completion
            targets = [False] * len(prompt) + [True] * len(completion)
        if not self.completion_only_loss:
            targets = [False] + [True] * (len(ids) - 1)
        return Demonstration(ids, targets)

    def generation_prompt(self, record: Mapping[str, Any]) -> list[int]:
        """The prompt an online algorithm (GRPO, RLOO, PPO, REINFORCE++) generates from.

        The worker (rollout.runtime.online.actor.PromptFormat) takes the field's value as text, so a
        non-string value is counted as its str(), and renders it as one user turn.
        """
        value = self._value(record, "prompt")
        return self.prompt({self._field("prompt"): value if isinstance(value, str) else str(value)})

    # --- pieces ---------------------------------------------------------------------------------

    def prompt(self, record: Mapping[str, Any]) -> list[int]:
        value = self._value(record, "prompt")
        if isinstance(value, str):
            if not self.use_chat_template:
                return self.tokenizer.encode(value, add_special_tokens=True)
            messages = [{"role": "user", "content": value}]
        else:
            messages = self._messages(record, "prompt")
        if self.system_prompt is not None and messages[0].get("role") != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return self._chat("prompt", messages, add_generation_prompt=True)

    def completion(self, record: Mapping[str, Any], role: str) -> list[int]:
        value = self._value(record, role)
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], Mapping):
            value = value[0].get("content")
        if not isinstance(value, str):
            raise SampleError(
                role,
                f"{self._field(role)!r} holds {_kind(value)}, not a string (or one assistant "
                "message)",
                hint=f"give every record its {role} as text",
            )
        return [
            *self.tokenizer.encode(value, add_special_tokens=False),
            self.tokenizer.eos_token_id,
        ]

    def _conversation(self, messages: list[dict[str, Any]]) -> tuple[list[int], list[bool]]:
        """The conversation's ids, and True on the tokens of every assistant turn.

        Each assistant turn's tokens are what rendering the conversation up to it adds to the
        rendering up to the turn before with the assistant turn opened. That needs a template
        that renders earlier turns the same whatever follows them, which is checked.
        """
        ids = self._chat("messages", messages, add_generation_prompt=False)
        targets = [False] * len(ids)
        for turn, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            opened = self._chat("messages", messages[:turn], add_generation_prompt=True)
            closed = self._chat("messages", messages[: turn + 1], add_generation_prompt=False)
            if closed[: len(opened)] != opened or ids[: len(closed)] != closed:
                raise SampleError(
                    "messages",
                    "the chat template renders earlier turns differently once later turns "
                    "follow, so the assistant's tokens cannot be told apart",
                    hint="use prompt and completion fields instead of messages",
                )
            targets[len(opened) : len(closed)] = [True] * (len(closed) - len(opened))
        if not any(targets):
            raise SampleError(
                "messages",
                f"{self._field('messages')!r} holds no assistant message, so nothing is learned",
                hint="give every conversation at least one turn with role 'assistant'",
            )
        return ids, targets

    def _chat(self, role: str, messages: list[dict[str, Any]], **kwargs: bool) -> list[int]:
        if not self.use_chat_template:
            raise SampleError(
                role,
                f"{self._field(role)!r} holds chat messages, which need the chat template",
                hint="set data.use_chat_template = true, or give the field as text",
            )
        return self.tokenizer.chat(messages, **kwargs)

    def _messages(self, record: Mapping[str, Any], role: str) -> list[dict[str, Any]]:
        value = self._value(record, role)
        if not (
            isinstance(value, Sequence)
            and not isinstance(value, str)
            and value
            and all(
                isinstance(m, Mapping) and isinstance(m.get("role"), str) and "content" in m
                for m in value
            )
        ):
            raise SampleError(
                role,
                f"{self._field(role)!r} holds {_kind(value)}, not text or a list of "
                "{role, content} messages",
                hint=f"write the {role} as a string or as [{{'role': 'user', 'content': ...}}]",
            )
        return [dict(m) for m in value]

    def _value(self, record: Mapping[str, Any], role: str) -> Any:
        field = self._field(role)
        if field not in record or record[field] is None:
            raise SampleError(role, f"the record has no {field!r}")
        return record[field]

    def _field(self, role: str) -> str:
        field = self.fields.get(role)
        if not field:
            raise SampleError(role, f"data.fields.{role} is not set")
        return field


def _kind(value: Any) -> str:
    if isinstance(value, list):
        return "an array" if value else "an empty array"
    return {
        str: "a string",
        bool: "a boolean",
        int: "a number",
        float: "a number",
        dict: "an object",
        type(None): "null",
    }.get(type(value), type(value).__name__)


class HfTextTokenizer:
    """A transformers tokenizer behind TextTokenizer."""

    def __init__(self, tokenizer: Any, chat_template: str | None, eos_token_id: int):
        self._tokenizer = tokenizer
        self._chat_template = chat_template
        self.eos_token_id = eos_token_id

    @classmethod
    def of(cls, loaded: LoadedModel) -> HfTextTokenizer:
        """The loaded model's tokenizer, ending completions with its first end-of-turn token."""
        return cls(loaded.tokenizer, loaded.chat_template, loaded.eos_token_ids[0])

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def chat(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool) -> list[int]:
        if self._chat_template is None:
            raise SampleError(
                "prompt",
                "the model has no chat template",
                hint="set data.use_chat_template = false, or give model.chat_template",
            )
        return list(
            self._tokenizer.apply_chat_template(
                messages,
                chat_template=self._chat_template,
                add_generation_prompt=add_generation_prompt,
                tokenize=True,
                return_dict=False,
            )
        )
