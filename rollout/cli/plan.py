"""`rollout plan`."""
