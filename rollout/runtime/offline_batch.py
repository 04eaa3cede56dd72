"""Where rollout/harness/model_reward.py still imports pad_completions from: its home is
rollout.runtime.offline.batches. Remove this module once the harness imports it from there."""

from rollout.runtime.offline.batches import pad_completions

__all__ = ["pad_completions"]
