"""An example reward plugin, referenced from grpo-tiny.toml as "./rewards.py:brevity".

A reward is any function fn(prompts, completions, **kwargs) -> list[float]: one score per
completion. kwargs carry the dataset fields (one list entry per completion) and the reward's
`options` from the config. It needs nothing from rollout, so it tests like any function:

    >>> brevity(["q"], ["42"], max_chars=8)
    [1.0]
"""

from __future__ import annotations


def brevity(
    prompts: list[str], completions: list[str], max_chars: int = 16, **_: object
) -> list[float]:
    """1.0 for an answer of at most ``max_chars`` characters, falling linearly to 0 at twice that."""
    scores = []
    for completion in completions:
        extra = max(0, len(completion.strip()) - max_chars)
        scores.append(max(0.0, 1.0 - extra / max_chars))
    return scores
