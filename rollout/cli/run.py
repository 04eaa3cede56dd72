"""`rollout run`."""
