"""`python -m rollout.executor.torchrun HOST_PID -- TORCHRUN_ARGS`: torchrun, bound to its host.

torchrun itself, run in this process, after asking the kernel to kill it when the host dies
(rollout.executor.processes.die_with_parent): a host killed with SIGKILL leaves no torchrun, and
so (their own parent-death signal) no worker, training on unsupervised.
"""

from __future__ import annotations

import sys

from rollout.executor.processes import die_with_parent


def main(argv: list[str]) -> None:
    host_pid, separator, *torchrun_args = argv
    assert separator == "--", "usage: python -m rollout.executor.torchrun HOST_PID -- ARGS"
    die_with_parent(int(host_pid))
    from torch.distributed.run import main as torchrun

    torchrun(torchrun_args)


if __name__ == "__main__":
    main(sys.argv[1:])
