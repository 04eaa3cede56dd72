"""A reward for random-weight models, used by grpo_vs_trl.py on both sides.

numeric_match scores every completion of a random model 0: every group would score alike, its
advantages would all be 0, and rollout's learner skips such rows (TRL does not), so the learner
sides would not do the same work. The share of letters in a completion's text differs between
any two random completions, so every row carries a signal on both sides.
"""

from __future__ import annotations

from typing import Any


def letter_share(prompts: list[str], completions: list[str], **_fields: Any) -> list[float]:
    """Letters / characters of each completion (0 for an empty one)."""
    return [sum(ch.isalpha() for ch in text) / max(len(text), 1) for text in completions]
