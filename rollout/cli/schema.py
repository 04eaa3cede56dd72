"""`rollout schema`."""
