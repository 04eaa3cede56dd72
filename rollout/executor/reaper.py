"""`python -m rollout.executor.reaper TOKEN`: see rollout.executor.processes.Reaper."""

from __future__ import annotations

import sys

from rollout.executor.processes import run_reaper

if __name__ == "__main__":
    run_reaper(sys.argv[1])
