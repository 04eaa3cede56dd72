"""The one exception type users see, and the issues it carries.

Every user mistake (config, plugin, data, model, a stale plan) becomes a `RolloutError` holding
one or more `Issue`s. Each issue names *where* (a dotted config path or a file), *what* is wrong,
the offending value, and *what to change*. The CLI renders them and exits with code 2; library
callers catch `RolloutError` and read `.issues`.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from rollout.redact import redact_text, redact_value

USER_ERROR_EXIT_CODE = 2


def did_you_mean(word: str, choices: Iterable[str], *, most: int = 1) -> str | None:
    """The hint for a misspelt name: "did you mean 'x'?" (or 'x' or 'y' ...), None when nothing
    is close enough."""
    close = difflib.get_close_matches(word, list(choices), n=most, cutoff=0.6)
    if not close:
        return None
    return "did you mean " + " or ".join(repr(name) for name in close) + "?"


_MISSING = object()


@dataclass(frozen=True)
class Issue:
    """One problem, reported at one place.

    path: dotted config path (``algorithm.num_generations``, ``rewards[0].fn``) or, for problems
        outside the config, a file or resource (``data.train.path``, ``plan.lock``).
    message: what is wrong, and what was expected.
    value: the offending value, when there is one (rendered with ``repr``).
    hint: what to change ("did you mean 'num_generations'?", "use 8 or 12").
    """

    path: str
    message: str
    value: Any = _MISSING
    hint: str | None = None

    def __post_init__(self) -> None:
        # Every user-facing error is built from Issues: redacting here keeps a credential that
        # reached a path, message, value or hint out of every command's output at once.
        for name in ("path", "message", "hint"):
            text = getattr(self, name)
            if isinstance(text, str):
                object.__setattr__(self, name, redact_text(text))
        if self.value is not _MISSING:
            object.__setattr__(self, "value", redact_value(self.value))

    @property
    def has_value(self) -> bool:
        return self.value is not _MISSING

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if not self.has_value:
            out.pop("value")
        else:
            out["value"] = _jsonable(self.value)
        if self.hint is None:
            out.pop("hint")
        return out

    def __str__(self) -> str:
        text = f"{self.path}: {self.message}"
        if self.has_value:
            text += f" (got {_short_repr(self.value)})"
        if self.hint:
            text += f"; {self.hint}"
        return text


class RolloutError(Exception):
    """A user-facing error: bad config, plugin, model, data or plan. Carries one or more issues.

    ``source`` names the file the issues refer to (a config or a plan), when there is one.
    """

    def __init__(self, issues: Iterable[Issue] | Issue | str, *, source: str | None = None):
        if isinstance(issues, str):
            issues = [Issue(path=source or "rollout", message=issues)]
        elif isinstance(issues, Issue):
            issues = [issues]
        self.issues: list[Issue] = list(issues)
        self.source = redact_text(source) if source else source
        super().__init__(self._summary())

    def _summary(self) -> str:
        where = f"{self.source}: " if self.source else ""
        if len(self.issues) == 1:
            return where + str(self.issues[0])
        lines = [f"{where}{len(self.issues)} problems"]
        lines += [f"  - {issue}" for issue in self.issues]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "error_count": len(self.issues),
            "errors": [issue.to_dict() for issue in self.issues],
        }


class ConfigError(RolloutError):
    """The config file (or a ``--set`` override) is wrong."""


class PlanError(RolloutError):
    """Planning failed: a plugin, the model, the data or the hardware does not fit the config."""


class LockfileError(RolloutError):
    """A plan.lock cannot be used: edited, stale, or of an unknown format."""


def _short_repr(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return repr(value)
