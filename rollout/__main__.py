"""`python -m rollout` is the `rollout` command."""

from rollout.cli.app import main

main()
