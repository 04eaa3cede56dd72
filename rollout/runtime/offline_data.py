"""Where rollout/harness/model_reward.py still imports HfTextTokenizer from: its home is
rollout.runtime.offline.data. Remove this module once the harness imports it from there."""

from rollout.runtime.offline.data import HfTextTokenizer

__all__ = ["HfTextTokenizer"]
