"""Facts about a data file, from reading the records a run will use (never from trusting the config).

Every JSONL line is parsed; for Parquet the schema and row count come from the file's metadata and
only the columns the run needs are read. Each record must hold every required field, not null, and
a preference pair must not compare a completion with itself. A caller may add its own check of
each complete record (the offline objectives tokenize it: rollout.planner.inspect_samples). Problems
become Issues naming the file, the record (and line) and the field; at most MAX_ISSUES_PER_FILE
record-level problems are listed, then a count of the rest. Records longer than a limit make one
Issue per file and limit, at the longest of them, with how many there are.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Literal, Protocol
from urllib.parse import urlsplit

from rollout.config.data import DataSource
from rollout.config.plain import deeper_than
from rollout.errors import Issue, PlanError, did_you_mean
from rollout.files import is_url, open_binary, refusal
from rollout.fingerprints import sha256_file
from rollout.planner import locations
from rollout.planner.definition import DataFacts
from rollout.planner.inspect_samples import RecordProblem

MAX_ISSUES_PER_FILE = 10
# A record nests a chat or a tool call a few levels deep; past this it is not data we can use,
# and comparing or tokenizing it would exhaust the recursion limit.
MAX_RECORD_DEPTH = 100

_EXTENSIONS = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet"}
_JSON_KINDS = {
    list: "an array",
    str: "a string",
    int: "a number",
    float: "a number",
    bool: "a boolean",
    type(None): "null",
}


def inspect_data(
    source: DataSource,
    *,
    split: Literal["train", "eval"],
    base_dir: Path,
    required: dict[str, str],
    paired: tuple[str, str] | None = None,
    check: Callable[[dict[str, Any]], list[RecordProblem]] | None = None,
) -> DataFacts:
    """Read a data file and check it. `required` maps a role (prompt, answer, ...) to the record
    field that holds it; `paired` names the (chosen, rejected) fields that must differ; `check`
    returns the problems (with path, message, hint) of a record that has every required field."""
    key = f"data.{split}.path"
    location = locations.resolve(source.path, base_dir)
    if not locations.exists(location, key):
        raise PlanError(
            locations.not_found(key, location, what=f"{split} data file", value=source.path)
        )
    reason = None if is_url(location) else refusal(location)
    if reason is not None:  # a FIFO would block the scan, /dev/zero feed it forever
        raise PlanError(
            Issue(
                key,
                f"{location} {reason}",
                value=source.path,
                hint="point it at a .jsonl or .parquet file",
            )
        )
    data_format = _data_format(source, location, split)
    checker = _Checker(location, key, required, paired, check)
    scan = scan_jsonl if data_format == "jsonl" else scan_parquet
    try:
        num_records = scan(location, source.limit, checker)
    except (OSError, ValueError) as exc:  # unreadable, or not Parquet at all (ArrowInvalid)
        raise PlanError(
            Issue(
                key,
                f"cannot read {location} as {data_format}: {exc}",
                value=source.path,
                hint=f"check the file, or set data.{split}.format if it is not {data_format}",
            )
        ) from exc
    issues = checker.issues()
    if num_records == 0:
        issues.insert(
            0,
            Issue(
                key,
                f"{location} holds no records",
                value=source.path,
                hint=f"the {split} split needs at least one record",
            ),
        )
    if issues:
        raise PlanError(issues)
    return DataFacts(
        split=split,
        location=location,
        format=data_format,
        num_records=num_records,
        fields=sorted(checker.fields),
        size_bytes=locations.size(location, key),
        fingerprint=sha256_file(location),
    )


def _data_format(source: DataSource, location: str, split: str) -> Literal["jsonl", "parquet"]:
    if source.format != "auto":
        return source.format
    suffix = PurePosixPath(urlsplit(location).path).suffix.lower()
    if suffix in _EXTENSIONS:
        return _EXTENSIONS[suffix]  # type: ignore[return-value]
    raise PlanError(
        Issue(
            f"data.{split}.format",
            f"cannot tell the format of {location} from its extension {suffix or '(none)'!r}: "
            f"expected {', '.join(_EXTENSIONS)}",
            value=source.path,
            hint=f"set data.{split}.format = 'jsonl' or 'parquet'",
        )
    )


class RecordSink(Protocol):
    """What the scanners feed: the planner's checker, or the runtime's record collector."""

    def use_columns(self, columns: list[str]) -> list[str]: ...

    def record(self, where: str, record: dict[str, Any]) -> None: ...

    def problem(self, message: str, hint: str | None = None) -> None: ...


def scan_jsonl(location: str, limit: int | None, checker: RecordSink) -> int:
    """Check every non-blank line up to `limit`; return how many there were."""
    number = 0
    with open_binary(location) as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            if limit is not None and number >= limit:
                break
            number += 1
            try:
                record = json.loads(line)
                if _too_deep(line, record):
                    raise RecursionError
            except json.JSONDecodeError as exc:
                checker.problem(
                    f"line {line_number} of {location} is not valid JSON: {exc.msg} "
                    f"(column {exc.colno})"
                )
                continue
            except UnicodeDecodeError:
                checker.problem(f"line {line_number} of {location} is not UTF-8 text")
                continue
            except RecursionError:
                checker.problem(
                    f"line {line_number} of {location} nests arrays or objects more than "
                    f"{MAX_RECORD_DEPTH} levels deep"
                )
                continue
            except ValueError:  # CPython's limit on integer digits (about 4300)
                checker.problem(f"line {line_number} of {location} holds a number too long")
                continue
            if not isinstance(record, dict):
                checker.problem(
                    f"line {line_number} of {location} holds {_JSON_KINDS[type(record)]}, "
                    "not a JSON object",
                    hint="write one JSON object per line (a file holding one JSON array is not "
                    "JSONL)",
                )
                continue
            checker.record(f"record {number} (line {line_number})", record)
    return number


def _too_deep(line: bytes, record: Any) -> bool:
    # Counting brackets (in C) first keeps the walk off every ordinary line.
    nesting = line.count(b"[") + line.count(b"{")
    return nesting > MAX_RECORD_DEPTH and deeper_than(record, MAX_RECORD_DEPTH)


def scan_parquet(location: str, limit: int | None, checker: RecordSink) -> int:
    """Check the needed columns of the first `limit` rows; return how many rows that is."""
    import pyarrow.parquet as pq  # only Parquet data pays for pyarrow

    with open_binary(location) as handle:
        parquet = pq.ParquetFile(handle)
        columns = parquet.schema_arrow.names
        total = parquet.metadata.num_rows
        num_records = total if limit is None else min(total, limit)
        needed = checker.use_columns(columns)
        if not needed:
            return num_records
        number = 0
        for batch in parquet.iter_batches(columns=needed):
            for row in batch.to_pylist():
                number += 1
                if number > num_records:
                    return num_records
                checker.record(f"record {number}", row)
    return num_records


@dataclass
class _Gap:
    """Records that lack a required field (or hold null in it): the first one, and how many."""

    first: str
    count: int = 1


@dataclass
class _TooLong:
    """Records longer than one limit: the first, the longest and its problem, and how many."""

    first: str
    longest: str
    problem: RecordProblem
    count: int = 1


class _Checker:
    """Collects the problems of one file's records, grouped so that one wrong field name gives one
    Issue rather than one per record."""

    def __init__(
        self,
        location: str,
        key: str,
        required: dict[str, str],
        paired: tuple[str, str] | None,
        check: Callable[[dict[str, Any]], list[RecordProblem]] | None = None,
    ):
        self.location = location
        self.key = key
        self.required = dict(required)
        self.paired = paired
        self.check = check
        self.fields: set[str] = set()
        self._missing: dict[str, _Gap] = {}
        self._null: dict[str, _Gap] = {}
        self._too_long: dict[str, _TooLong] = {}
        self._column_issues: list[Issue] = []
        self._problems: list[Issue] = []
        self._unlisted = 0

    def use_columns(self, columns: list[str]) -> list[str]:
        """Note a table's columns; report required ones it lacks; return those worth reading."""
        self.fields.update(columns)
        for role, field in list(self.required.items()):
            if field not in columns:
                self._column_issues.append(
                    Issue(
                        f"data.fields.{role}",
                        f"{self.location} has no column {field!r}; its columns: "
                        f"{_listing(columns)}",
                        value=field,
                        hint=self._field_hint(role, field),
                    )
                )
                del self.required[role]
        wanted = {*self.required.values(), *(self.paired or ())}
        return [name for name in columns if name in wanted]

    def record(self, where: str, record: dict[str, Any]) -> None:
        self.fields.update(record)
        complete = True
        for role, field in self.required.items():
            if field not in record:
                _note(self._missing, role, where)
                complete = False
            elif record[field] is None:
                _note(self._null, role, where)
                complete = False
        if self.paired is not None:
            chosen, rejected = (record.get(field) for field in self.paired)
            if chosen is not None and chosen == rejected:
                self.problem(
                    f"{where} of {self.location}: {self.paired[0]!r} and {self.paired[1]!r} are "
                    "identical, so the pair prefers nothing",
                    hint="drop the record, or give it a different rejected completion",
                )
                complete = False
        if complete and self.check is not None:
            for found in self.check(record):
                if found.length is None:
                    self.problem(
                        f"{where} of {self.location}: {found.message}", found.hint, found.path
                    )
                else:
                    self._note_too_long(where, found)

    def _note_too_long(self, where: str, found: RecordProblem) -> None:
        seen = self._too_long.get(found.path)
        if seen is None:
            self._too_long[found.path] = _TooLong(first=where, longest=where, problem=found)
            return
        seen.count += 1
        if found.length is not None and found.length > (seen.problem.length or 0):
            seen.longest, seen.problem = where, found

    def problem(self, message: str, hint: str | None = None, path: str | None = None) -> None:
        if len(self._problems) < MAX_ISSUES_PER_FILE:
            self._problems.append(Issue(path or self.key, message, hint=hint))
        else:
            self._unlisted += 1

    def issues(self) -> list[Issue]:
        issues = list(self._column_issues)
        for role, gap in self._missing.items():
            field = self.required[role]
            issues.append(
                Issue(
                    f"data.fields.{role}",
                    f"{gap.first} of {self.location} has no field {field!r}"
                    f"{_others(gap, 'nor do')}; records have: {_listing(sorted(self.fields))}",
                    value=field,
                    hint=self._field_hint(role, field),
                )
            )
        for role, gap in self._null.items():
            field = self.required[role]
            issues.append(
                Issue(
                    f"data.fields.{role}",
                    f"{gap.first} of {self.location} has {field!r} = null{_others(gap, 'and')}",
                    value=field,
                    hint=f"give every record a {role}, or remove the records without one",
                )
            )
        for path, too_long in self._too_long.items():
            others = ""
            if too_long.count > 1:
                first = (
                    "" if too_long.first == too_long.longest else f"; the first is {too_long.first}"
                )
                others = f" (the longest of {too_long.count} records over the limit{first})"
            message = f"{too_long.longest} of {self.location}: {too_long.problem.message}{others}"
            issues.append(Issue(path, message, hint=too_long.problem.hint))
        issues += self._problems
        if self._unlisted:
            issues.append(
                Issue(self.key, f"... and {self._unlisted} more problems in {self.location}")
            )
        return issues

    def _field_hint(self, role: str, field: str) -> str:
        # Other records may hold `field` itself; the suggestion is for the ones that misspell it.
        guess = did_you_mean(field, sorted(self.fields - {field}), most=3)
        change = f"set data.fields.{role} to the field that holds the {role}"
        return f"{guess} {change}" if guess else change


def _note(gaps: dict[str, _Gap], role: str, where: str) -> None:
    if role in gaps:
        gaps[role].count += 1
    else:
        gaps[role] = _Gap(where)


def _others(gap: _Gap, word: str) -> str:
    return f" ({word} {gap.count - 1} other records)" if gap.count > 1 else ""


def _listing(names: list[str], limit: int = 20) -> str:
    shown = ", ".join(names[:limit]) or "(none)"
    return shown if len(names) <= limit else f"{shown}, ... ({len(names)} in all)"
