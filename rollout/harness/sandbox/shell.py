"""An allow-listed shell: run one command (an argv list, or a string split like a POSIX shell
would, but with no shell: no pipes, globs, redirections or variables) when its program is on the
allow list, in the episode's directory, under the same limits and isolation as Python code."""

from __future__ import annotations

import shlex
import shutil
from collections.abc import Iterable
from pathlib import Path

from rollout.harness.sandbox.process import SAFE_PATH, Limits, Refused, RunResult, run_limited


class ShellSandbox:
    """allowed: program names (``ls``, ``grep``), looked up on a fixed PATH; a program given as a
    path is refused, so the list cannot be sidestepped with ``/bin/sh`` or ``./ls``. An allowed
    interpreter (sh, python3, ...) runs anything: allow programs, not interpreters."""

    def __init__(
        self,
        workdir: Path,
        allowed: Iterable[str],
        limits: Limits = Limits(),
        *,
        require_network_isolation: bool = True,
    ):
        self.allowed = frozenset(allowed)
        for name in self.allowed:
            if not name or "/" in name:
                raise ValueError(f"allowed programs are bare names, got {name!r}")
        self.workdir = Path(workdir)
        self.limits = limits
        self.require_network_isolation = require_network_isolation

    def run(self, command: str | list[str]) -> RunResult:
        """The command's output and how it ended; Refused when its program is not allowed (or
        the string does not parse); never raises for what the program does."""
        if isinstance(command, str):
            try:
                argv = shlex.split(command)
            except ValueError as error:
                raise Refused(f"the command does not parse: {error}") from None
        else:
            argv = list(command)
        if not argv or not all(isinstance(arg, str) for arg in argv):
            raise Refused("the command is empty or not a list of strings")
        program = argv[0]
        if program not in self.allowed:
            allowed = ", ".join(sorted(self.allowed)) or "none"
            raise Refused(f"the program {program!r} is not allowed (allowed: {allowed})")
        found = shutil.which(program, path=SAFE_PATH)
        if found is None:
            raise Refused(f"the program {program!r} is not installed on {SAFE_PATH}")
        return run_limited(
            [found, *argv[1:]],
            self.workdir,
            self.limits,
            require_network_isolation=self.require_network_isolation,
        )
