"""The `code_tests` reward: run the completion's Python with the row's tests in the sandbox.

A reward that runs model-written code says so with ``runs_model_code = True`` (see
reward_contract.runs_model_code): the planner then tries this host's sandbox and refuses the plan
when it lacks a capability, unless ``rewards[i].allow_unsandboxed`` opts out, and the worker
passes the decision as ``require_network_isolation``, never the user's options.
"""

from __future__ import annotations

import math
import re
import secrets
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rollout.harness.sandbox import Limits, PythonSandbox

# The last fenced block tagged python (or py); without one the whole completion is the code.
_FENCED = re.compile(r"```[ \t]*(?:python|py)[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)

_PARALLEL = 8
"""Programs run side by side: each thread mostly waits on its sandboxed process, so a batch of
8 takes about one time limit, not 8."""


def code_tests(
    prompts: list[str],
    completions: list[str],
    *,
    tests: list[Any],
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    require_network_isolation: bool = True,
) -> list[float]:
    """1.0 where the completion's code followed by the row's ``tests`` (Python asserts, a string
    or a list of lines) exits 0 in the sandbox; 0.0 where it fails, crashes or runs out of time.

    The code is the last ```python fenced block of the completion, else the whole completion.
    The tests pass only when the program reaches its end: an early ``sys.exit(0)`` scores 0.0.
    (A program can still read its own source; the sandbox, not this check, bounds what it may
    do.)
    Each program gets ``timeout_s`` seconds of wall-clock and CPU time and ``memory_mb`` MiB of
    address space. ``require_network_isolation`` comes from the plan's sandbox decision.
    """
    if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"code_tests: timeout_s must be a number > 0, got {timeout_s!r}")
    if not isinstance(memory_mb, int) or isinstance(memory_mb, bool) or memory_mb < 1:
        raise ValueError(f"code_tests: memory_mb must be an integer >= 1, got {memory_mb!r}")
    # Passing means reaching the end: the program prints a token it could not have known,
    # after the tests, so code that exits 0 before them (sys.exit(0), os._exit(0)) fails.
    token = f"rollout-tests-passed-{secrets.token_hex(16)}"
    tail = f"\n\nimport sys as _rollout_sys\n_rollout_sys.stdout.write({token!r})\n"
    programs = [
        f"{extract_code(completion)}\n\n{_test_text(test, i)}{tail}"
        for i, (completion, test) in enumerate(zip(completions, tests, strict=True))
    ]
    limits = Limits(
        cpu_s=max(1, math.ceil(timeout_s)),
        memory_bytes=memory_mb * 2**20,
        wall_s=float(timeout_s),
    )

    def score(program: str) -> float:
        with tempfile.TemporaryDirectory(prefix="rollout-code-tests-") as workdir:
            sandbox = PythonSandbox(
                Path(workdir), limits, require_network_isolation=require_network_isolation
            )
            result = sandbox.run(program)
            return 1.0 if result.ok and result.stdout.endswith(token) else 0.0

    if not programs:
        return []
    with ThreadPoolExecutor(min(_PARALLEL, len(programs)), "code-tests") as pool:
        return list(pool.map(score, programs))


code_tests.runs_model_code = True  # type: ignore[attr-defined]


def extract_code(completion: str) -> str:
    """The last ```python fenced block's body, else the whole completion."""
    blocks = _FENCED.findall(completion)
    return blocks[-1] if blocks else completion


def _test_text(test: Any, row: int) -> str:
    if isinstance(test, str):
        return test
    if isinstance(test, list) and all(isinstance(line, str) for line in test):
        return "\n".join(test)
    raise TypeError(
        f"code_tests: the tests field of sample {row} is {type(test).__name__}; it must be "
        "Python source (a string, or a list of lines such as 'assert f(1) == 2')"
    )
