"""Run model-written Python in a fresh, isolated interpreter (``python -I -S -B``: no site
packages, no environment variables, no user site, no bytecode written)."""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

from rollout.harness.sandbox.process import Limits, RunResult, run_limited


class PythonSandbox:
    """Runs code with cwd = workdir (the episode's directory, which it may write in) under
    limits. require_network_isolation: refuse to run (SandboxUnavailable) on a host without
    network namespaces, rather than run with the network reachable."""

    def __init__(
        self,
        workdir: Path,
        limits: Limits = Limits(),
        *,
        require_network_isolation: bool = True,
        python: str = sys.executable,
    ):
        self.workdir = Path(workdir)
        self.limits = limits
        self.require_network_isolation = require_network_isolation
        self.python = python

    def run(self, code: str) -> RunResult:
        """The code's output and how it ended; never raises for what the code does."""
        if not isinstance(code, str):
            raise TypeError(f"code must be a str, got {type(code).__name__}")
        # The source lives outside the work dir (the model's files stay its own) and is
        # read-only to the code, which runs it as a script: tracebacks name it "main.py".
        holder = Path(tempfile.mkdtemp(prefix="rollout-code-"))
        try:
            source = holder / "main.py"
            source.write_text(code)
            holder.chmod(0o755)
            source.chmod(0o444)
            return run_limited(
                [self.python, "-I", "-S", "-B", str(source)],
                self.workdir,
                self.limits,
                require_network_isolation=self.require_network_isolation,
                python_errors=True,
            )
        finally:
            shutil.rmtree(holder, ignore_errors=True)
