"""The prompt file of `rollout generate` and the data files of eval suites (read_rows): every
record read and checked before anything loads.

JSONL or Parquet (by extension), a local path or an fsspec URL, read with the planner's own
scanners. Each record must hold the prompt field: text, or a list of chat messages
({"role", "content"}). Problems name the record (1-based, and the line for JSONL) and the option
to change; at most MAX_LISTED are listed, then a count of the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Literal
from urllib.parse import urlsplit

from rollout.errors import Issue, RolloutError, did_you_mean
from rollout.files import is_url, refusal
from rollout.fingerprints import sha256_file
from rollout.models.prompts import prompt_kind
from rollout.planner import locations
from rollout.planner.inspect_data import scan_jsonl, scan_parquet

MAX_LISTED = 10

EXTENSIONS: dict[str, Literal["jsonl", "parquet"]] = {
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".ndjson": "jsonl",
    ".parquet": "parquet",
}

Record = dict[str, Any]


@dataclass(frozen=True)
class PromptFile:
    location: str
    format: Literal["jsonl", "parquet"]
    records: list[Record]
    fingerprint: str
    """sha256 of the file's bytes: a resumed job must read the same prompts."""
    places: list[str] | None = None
    """Where each record is, for messages ("record 3 (line 4)"); read_rows fills it."""


def file_format(location: str, option: str) -> Literal["jsonl", "parquet"]:
    """The format a path's extension names; a RolloutError at `option` otherwise."""
    suffix = PurePosixPath(urlsplit(location).path).suffix.lower()
    if suffix not in EXTENSIONS:
        raise RolloutError(
            Issue(
                option,
                f"cannot tell the format of {location} from its extension "
                f"{suffix or '(none)'!r}: expected {', '.join(EXTENSIONS)}",
                value=location,
                hint="name the file .jsonl or .parquet",
            )
        )
    return EXTENSIONS[suffix]


def read_prompts(location: str, field: str, *, limit: int | None = None) -> PromptFile:
    """Every record (or the first `limit`) of the prompt file, each checked for `field`.

    A relative `location` starts at the current directory, with or without --config: it is typed
    on the command line, not written in the config.
    """
    resolved, fmt = _locate(location, "--prompts", Path.cwd(), what="prompt file")
    checker = _Checker(resolved, field)
    scan = scan_jsonl if fmt == "jsonl" else scan_parquet
    try:
        scan(resolved, limit, checker)
    except (OSError, ValueError) as exc:  # unreadable, or not Parquet at all (ArrowInvalid)
        raise RolloutError(
            Issue("--prompts", f"cannot read {resolved} as {fmt}: {exc}", value=location)
        ) from exc
    issues = checker.issues()
    if not issues and not checker.records:
        issues.append(Issue("--prompts", f"{resolved} holds no records", value=location))
    if issues:
        raise RolloutError(issues)
    return PromptFile(resolved, fmt, checker.records, sha256_file(resolved))


def read_rows(
    location: str, option: str, base_dir: Path, *, limit: int | None = None
) -> PromptFile:
    """Every record (or the first `limit`) of a JSONL or Parquet file of data rows, whatever
    fields they hold (the caller checks those); problems are reported at `option`. A relative
    `location` starts at `base_dir`."""
    resolved, fmt = _locate(location, option, base_dir, what="data file")
    sink = _Rows(option)
    scan = scan_jsonl if fmt == "jsonl" else scan_parquet
    try:
        scan(resolved, limit, sink)
    except (OSError, ValueError) as exc:
        raise RolloutError(
            Issue(option, f"cannot read {resolved} as {fmt}: {exc}", value=location)
        ) from exc
    if not sink.issues and not sink.records:
        sink.issues.append(Issue(option, f"{resolved} holds no records", value=location))
    if sink.issues:
        raise RolloutError(sink.issues[:MAX_LISTED])
    return PromptFile(resolved, fmt, sink.records, sha256_file(resolved), sink.places)


def _locate(
    location: str, option: str, base_dir: Path, *, what: str
) -> tuple[str, Literal["jsonl", "parquet"]]:
    """The resolved location of a readable JSONL or Parquet file, and its format."""
    if "\0" in location:  # every os function would raise ValueError on it
        raise RolloutError(Issue(option, "the path holds a NUL character (\\x00)", value=location))
    resolved = locations.resolve(location, base_dir)
    if not locations.exists(resolved, option):
        raise RolloutError(
            locations.not_found(
                option,
                resolved,
                what=what,
                value=location,
                relative_to=f"the current directory ({base_dir})"
                if base_dir == Path.cwd()
                else f"the config's directory ({base_dir})",
            )
        )
    if locations.is_dir(resolved, option):
        raise RolloutError(
            Issue(option, f"{resolved} is a directory, not a {what}", value=location)
        )
    reason = None if is_url(resolved) else refusal(resolved)
    if reason is not None:  # a FIFO would block the read, /dev/zero feed it forever
        raise RolloutError(
            Issue(
                option,
                f"{resolved} {reason}",
                value=location,
                hint="pass a .jsonl or .parquet file",
            )
        )
    return resolved, file_format(resolved, option)


class _Rows:
    """The scanners' sink for read_rows: every record, where it was, and unreadable lines."""

    def __init__(self, option: str):
        self.option = option
        self.records: list[Record] = []
        self.places: list[str] = []
        self.issues: list[Issue] = []

    def use_columns(self, columns: list[str]) -> list[str]:
        return columns

    def record(self, where: str, record: Record) -> None:
        self.records.append(record)
        self.places.append(where)

    def problem(self, message: str, hint: str | None = None) -> None:
        self.issues.append(Issue(self.option, message, hint=hint))


class _Checker:
    """The scanners' sink: keeps every record and collects what is wrong with them."""

    def __init__(self, location: str, field: str):
        self.location = location
        self.field = field
        self.records: list[Record] = []
        self.fields: set[str] = set()
        self._issues: list[Issue] = []
        self._unlisted = 0
        self._column_missing = False
        self._missing: tuple[str, list[str]] | None = None  # (first record, its fields), count
        self._missing_count = 0

    def use_columns(self, columns: list[str]) -> list[str]:
        self.fields.update(columns)
        if self.field not in columns:
            self._column_missing = True
            self._add(
                Issue(
                    "--field",
                    f"{self.location} has no column {self.field!r}; its columns: "
                    f"{', '.join(columns) or '(none)'}",
                    value=self.field,
                    hint=self._hint(),
                )
            )
        return columns  # every column: the output carries the records' fields over

    def record(self, where: str, record: Record) -> None:
        self.records.append(record)
        self.fields.update(record)
        if self.field not in record:
            if not self._column_missing:
                self._missing_count += 1
                self._missing = self._missing or (where, sorted(record))
        elif prompt_kind(record[self.field]) is None:
            self._add(
                Issue(
                    "--field",
                    f"{where} of {self.location}: {self.field!r} holds "
                    f"{_kind_of(record[self.field])}, not text or a list of chat messages",
                    value=self.field,
                    hint="give every record its prompt as text, or as a list of "
                    '{"role": ..., "content": ...} messages',
                )
            )

    def problem(self, message: str, hint: str | None = None) -> None:
        self._add(Issue("--prompts", message, hint=hint))

    def issues(self) -> list[Issue]:
        issues = list(self._issues)
        if self._missing is not None:
            where, fields = self._missing
            others = self._missing_count - 1
            issues.insert(
                0,
                Issue(
                    "--field",
                    f"{where} of {self.location} has no field {self.field!r}"
                    + (f" (nor do {others} other records)" if others else "")
                    + f"; it has: {', '.join(fields) or '(nothing)'}",
                    value=self.field,
                    hint=self._hint(),
                ),
            )
        if self._unlisted:
            issues.append(
                Issue("--prompts", f"... and {self._unlisted} more problems in {self.location}")
            )
        return issues

    def _add(self, issue: Issue) -> None:
        if len(self._issues) < MAX_LISTED:
            self._issues.append(issue)
        else:
            self._unlisted += 1

    def _hint(self) -> str:
        guess = did_you_mean(self.field, sorted(self.fields - {self.field}), most=3)
        change = "pass --field with the name of the field that holds the prompt"
        return f"{guess} {change}" if guess else change


def _kind_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, list):
        return "a list that is not chat messages" if value else "an empty list"
    if isinstance(value, dict):
        return "an object"
    return f"a {type(value).__name__}"
