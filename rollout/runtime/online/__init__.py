"""The online loop (GRPO, RLOO, REINFORCE++, PPO) and its roles: actor, learner, critic."""
