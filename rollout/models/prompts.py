"""A prompt as data rows and prompt files hold it, text or chat messages, and its token ids."""

from __future__ import annotations

from typing import Any, Literal


def prompt_kind(value: Any) -> Literal["text", "messages"] | None:
    """ "text" for a string, "messages" for a list of {"role": str, "content": str}, else None."""
    if isinstance(value, str):
        return "text"
    if (
        isinstance(value, list)
        and value
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in value
        )
    ):
        return "messages"
    return None


def encode_prompt(
    loaded: Any, value: Any, use_template: bool, system_prompt: str | None
) -> list[int]:
    """A prompt's token ids under `loaded`'s tokenizer: text through the chat template when
    `use_template`, else as it is; messages always through the template."""
    from rollout.models.loading import apply_chat_template

    if prompt_kind(value) == "text":
        if use_template:
            return apply_chat_template(loaded.tokenizer, loaded.chat_template, value, system_prompt)
        return list(loaded.tokenizer.encode(value, add_special_tokens=True))
    messages = list(value)
    if system_prompt is not None and messages[0].get("role") != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return list(
        loaded.tokenizer.apply_chat_template(
            messages,
            chat_template=loaded.chat_template,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
    )
