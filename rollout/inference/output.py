"""The output file of `rollout generate`, written so that an interrupted job continues.

Records go out a chunk of prompts at a time, in prompt order. After each chunk the data is
fsynced, and only then is the progress file ``<out>.progress.json`` replaced (atomically) with
how many prompts are done and where their records end: for JSONL the byte length of the file,
for Parquet the number of part files in ``<out>.parts/`` (one per chunk), which are joined into
``<out>`` once every prompt is done. A job stopped at any point (Ctrl-C, SIGKILL, a crash) leaves
a progress file that counts only durable records; a re-run with the same settings cuts off
whatever was written after them and goes on with the next prompt, so no prompt is written twice
and none is lost. A re-run with other settings is refused, since its records would mix with the
old ones; --overwrite starts over.

The progress file stays after the job is done: a re-run then says so instead of generating.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from rollout.errors import Issue, RolloutError

FORMAT_VERSION = 1
PROGRESS_SUFFIX = ".progress.json"
PARTS_SUFFIX = ".parts"


@dataclass
class Progress:
    """The progress file's content."""

    fingerprint: str
    """sha256 of `settings`: a resumed job must be the same job."""
    settings: dict[str, Any]
    total_prompts: int
    prompts_done: int = 0
    records: int = 0
    end: int = 0
    """JSONL: bytes of the output that hold finished prompts; Parquet: part files."""
    complete: bool = False
    format_version: int = FORMAT_VERSION


def progress_path(out: Path) -> Path:
    return out.with_name(out.name + PROGRESS_SUFFIX)


def parts_path(out: Path) -> Path:
    return out.with_name(out.name + PARTS_SUFFIX)


@dataclass
class OutputFile:
    """An output being written: `append` each finished chunk, `finish` at the end."""

    path: Path
    format: Literal["jsonl", "parquet"]
    progress: Progress
    resumed: bool = False
    _handle: Any = field(default=None, repr=False)

    @property
    def prompts_done(self) -> int:
        return self.progress.prompts_done

    @property
    def complete(self) -> bool:
        return self.progress.complete

    def append(self, rows: Sequence[Mapping[str, Any]], prompts_done: int) -> None:
        """Write one chunk's records durably, then record that `prompts_done` prompts are done."""
        if self.format == "jsonl":
            handle = self._jsonl_handle()
            handle.write(b"".join(_json_line(row) for row in rows))
            handle.flush()
            os.fsync(handle.fileno())
            self.progress.end = handle.tell()
        else:
            self._write_part(rows, self.progress.end)
            self.progress.end += 1
        self.progress.prompts_done = prompts_done
        self.progress.records += len(rows)
        _write_progress(self.path, self.progress)

    def finish(self) -> None:
        """Mark the job done (Parquet: join the parts into the output first)."""
        if self._handle is not None:
            self._handle.close()
            self._handle = None
        if self.format == "parquet":
            self._join_parts()
        self.progress.complete = True
        _write_progress(self.path, self.progress)
        shutil.rmtree(parts_path(self.path), ignore_errors=True)

    def close(self) -> None:
        """Release the file; what was appended stays (for a later resume)."""
        if self._handle is not None:
            self._handle.close()
            self._handle = None

    # --- JSONL ------------------------------------------------------------------------------------

    def _jsonl_handle(self) -> Any:
        if self._handle is None:
            self._handle = open(self.path, "r+b")  # noqa: SIM115 - kept open across chunks
            self._handle.seek(self.progress.end)
        return self._handle

    # --- Parquet ----------------------------------------------------------------------------------

    def _write_part(self, rows: Sequence[Mapping[str, Any]], index: int) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        directory = parts_path(self.path)
        directory.mkdir(exist_ok=True)
        final = directory / f"part-{index:06d}.parquet"
        with _staged(final) as staging:
            pq.write_table(pa.Table.from_pylist([dict(row) for row in rows]), staging)

    def _join_parts(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        directory = parts_path(self.path)
        parts = [directory / f"part-{index:06d}.parquet" for index in range(self.progress.end)]
        # A column that is null in one chunk and filled in another is promoted to the filled type.
        table = pa.concat_tables([pq.read_table(part) for part in parts], promote_options="default")
        with _staged(self.path) as staging:
            pq.write_table(table, staging)


def open_output(
    path: Path,
    *,
    settings: Mapping[str, Any],
    fingerprint: str,
    total_prompts: int,
    overwrite: bool,
) -> OutputFile:
    """The output at `path`, fresh or resumed. Raises RolloutError when `path` holds something
    else: another job's output (different settings), or a file this command did not write."""
    fmt: Literal["jsonl", "parquet"] = "parquet" if path.suffix.lower() == ".parquet" else "jsonl"
    if overwrite:
        _remove(path)
    _remove_staging(path)
    saved = _read_progress(path)
    if saved is None:
        if path.exists() or parts_path(path).exists():
            raise RolloutError(
                Issue(
                    "--out",
                    f"{path} already exists and is not the output of an interrupted "
                    f"`rollout generate` (it has no {progress_path(path).name})",
                    hint="pass --overwrite to replace it, or choose another --out",
                )
            )
        path.parent.mkdir(parents=True, exist_ok=True)
        progress = Progress(fingerprint, dict(settings), total_prompts)
        if fmt == "jsonl":
            _create_empty(path)
        _write_progress(path, progress)
        return OutputFile(path, fmt, progress)
    if saved.fingerprint != fingerprint and saved.records == 0:
        # An earlier attempt stopped before its first chunk: nothing of it to keep.
        _remove(path)
        return open_output(
            path,
            settings=settings,
            fingerprint=fingerprint,
            total_prompts=total_prompts,
            overwrite=False,
        )
    if saved.fingerprint != fingerprint:
        raise RolloutError(
            Issue(
                "--out",
                f"{path} holds the output of another job: {_changes(saved.settings, settings)}; "
                f"{saved.prompts_done} of its {saved.total_prompts} prompts are done",
                hint="re-run with the original arguments to continue it, pass --overwrite to "
                "start over, or choose another --out",
            )
        )
    _cut_back(path, fmt, saved)
    return OutputFile(path, fmt, saved, resumed=True)


def finished_output(path: Path, fingerprint: str) -> Progress | None:
    """The progress of a finished job with these settings at `path`, or None (read only)."""
    try:
        saved = _read_progress(path)
    except RolloutError:
        return None  # open_output reports it
    if saved is None or not saved.complete or saved.fingerprint != fingerprint:
        return None
    return saved if path.exists() else None


def _cut_back(path: Path, fmt: str, progress: Progress) -> None:
    """Drop whatever was written after the last durable chunk."""
    if progress.complete:
        if not path.exists():
            raise RolloutError(
                Issue(
                    "--out",
                    f"{path} is gone, but {progress_path(path).name} says the job finished",
                    hint="pass --overwrite to generate it again",
                )
            )
        return
    if fmt == "jsonl":
        if not path.exists():
            if progress.end:
                raise RolloutError(
                    Issue(
                        "--out",
                        f"{path} is gone, but {progress_path(path).name} says "
                        f"{progress.prompts_done} prompts were written to it",
                        hint="pass --overwrite to start over",
                    )
                )
            _create_empty(path)
        with open(path, "r+b") as handle:
            handle.truncate(progress.end)
            os.fsync(handle.fileno())
        return
    directory = parts_path(path)
    if directory.is_dir():
        for part in directory.iterdir():
            number = part.name.removeprefix("part-").removesuffix(".parquet")
            if not number.isdigit() or int(number) >= progress.end:
                part.unlink()  # a later chunk's part, or a staging file, left by the stop
    missing = [i for i in range(progress.end) if not (directory / f"part-{i:06d}.parquet").exists()]
    if missing:
        raise RolloutError(
            Issue(
                "--out",
                f"{directory} lacks parts {missing[:5]} that {progress_path(path).name} counts",
                hint="pass --overwrite to start over",
            )
        )


def _changes(before: Mapping[str, Any], now: Mapping[str, Any]) -> str:
    changed = [
        f"{key} {before.get(key)!r} -> {now.get(key)!r}"
        for key in sorted(set(before) | set(now))
        if before.get(key) != now.get(key)
    ]
    return "changed " + ", ".join(changed) if changed else "its settings differ"


def _read_progress(path: Path) -> Progress | None:
    file = progress_path(path)
    if not file.is_file():
        return None
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
        if raw.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"format_version {raw.get('format_version')!r}")
        return Progress(**raw)
    except (ValueError, TypeError) as exc:
        raise RolloutError(
            Issue(
                "--out",
                f"{file} is not a progress file this version of rollout can read ({exc})",
                hint="pass --overwrite to start over",
            )
        ) from None


def _write_progress(path: Path, progress: Progress) -> None:
    with _staged(progress_path(path)) as staging:
        staging.write_text(json.dumps(asdict(progress), indent=1), encoding="utf-8")


class _staged:
    """A temporary file beside `final` to write; on success it is fsynced and renamed over
    `final`, and the directory is fsynced (so the rename survives a crash)."""

    def __init__(self, final: Path):
        self.final = final

    def __enter__(self) -> Path:
        # Not mkstemp: its files are private (0600), and the output is for sharing.
        self.staging = self.final.with_name(f".{self.final.name}.{secrets.token_hex(4)}.tmp")
        return self.staging

    def __exit__(self, kind: Any, *_: Any) -> None:
        if kind is not None:
            self.staging.unlink(missing_ok=True)
            return
        _fsync(self.staging)
        os.replace(self.staging, self.final)
        _fsync(self.final.parent)


def _create_empty(path: Path) -> None:
    path.write_bytes(b"")
    _fsync(path)
    _fsync(path.parent)


def _remove(path: Path) -> None:
    path.unlink(missing_ok=True)
    progress_path(path).unlink(missing_ok=True)
    shutil.rmtree(parts_path(path), ignore_errors=True)


def _remove_staging(path: Path) -> None:
    """Staging files of writes that a stop interrupted (see _staged)."""
    if not path.parent.is_dir():
        return
    prefixes = (f".{path.name}.", f".{progress_path(path).name}.")
    for entry in path.parent.iterdir():
        if entry.name.startswith(prefixes) and entry.name.endswith(".tmp"):
            entry.unlink(missing_ok=True)


def _fsync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _json_line(row: Mapping[str, Any]) -> bytes:
    # default=str: a Parquet prompt file can carry dates and the like over, which JSON lacks.
    return (json.dumps(row, ensure_ascii=False, default=str) + "\n").encode("utf-8")
