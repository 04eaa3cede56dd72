"""Local input files are read only when they are regular files, and never past a size cap.

A user can name anything as a config, plan.lock, data or prompt file: a named pipe (FIFO) blocks
the reader until a writer comes, a character device (/dev/zero, /dev/urandom) feeds it forever, a
directory fails in a different way on every platform, and a NUL in the path makes every os
function raise ValueError. Every reader of a user-named local file comes here, so each refuses
these the same way, in words, before reading a byte. The kind of file is checked with stat before
it is opened (opening some devices has effects of its own) and again on the opened descriptor, in
case the path was swapped in between.

Standard library only (fsspec is imported only when a remote location is opened): config,
planner, runtime and inference all import it. Callers turn `FileRefused` into an Issue naming their
own option or config key.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import BinaryIO

_KINDS = (
    (stat.S_ISDIR, "is a directory, not a file"),
    (stat.S_ISFIFO, "is a named pipe (FIFO), not a regular file"),
    (stat.S_ISCHR, "is a character device, not a regular file"),
    (stat.S_ISBLK, "is a block device, not a regular file"),
    (stat.S_ISSOCK, "is a socket, not a regular file"),
)

# Opening a FIFO for reading waits for a writer unless the open does not block.
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


class FileRefused(OSError):
    """A local path that is not read: what it is, in words ("is a named pipe (FIFO), not a regular
    file"). An OSError, so code that already reports unreadable files reports these too."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason

    def __str__(self) -> str:
        return self.reason


class FileTooLarge(FileRefused):
    """A regular file larger than its reader's cap."""


def refusal(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` cannot be read as a regular file, or None when it can (or does not exist:
    callers word "not found" themselves)."""
    text = os.fspath(path)
    if "\0" in text:
        return "the path holds a NUL character (\\x00), which no file name can"
    try:
        mode = os.stat(text).st_mode
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot be read: {exc.strerror or exc}"
    return _kind_refusal(mode)


def open_regular(path: str | os.PathLike[str]) -> BinaryIO:
    """Open a local regular file for reading bytes; FileRefused for anything else.

    FileNotFoundError (and other OSErrors) pass through unchanged.
    """
    text = os.fspath(path)
    reason = refusal(text)
    if reason is not None:
        raise FileRefused(reason)
    fd = os.open(text, os.O_RDONLY | _NONBLOCK | getattr(os, "O_BINARY", 0))
    try:
        reason = _kind_refusal(os.fstat(fd).st_mode)
        if reason is not None:  # swapped for something else since the stat above
            raise FileRefused(reason)
        if _NONBLOCK:
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def is_url(location: str | os.PathLike[str]) -> bool:
    """A remote location (``s3://...``, ``hf://...``); ``file://`` paths are local."""
    return "://" in str(location) and not str(location).startswith("file://")


def open_binary(location: str | os.PathLike[str]) -> BinaryIO:
    """Open a local path or an fsspec URL for reading bytes.

    A local path must be a regular file: a FIFO or a device (/dev/zero) raises FileRefused (an
    OSError) instead of blocking or reading forever. Remote objects cannot be either.
    """
    if is_url(location):
        import fsspec  # only remote locations pay for fsspec

        return fsspec.open(str(location), "rb").open()
    return open_regular(str(location).removeprefix("file://"))


def read_capped(path: str | os.PathLike[str], *, limit: int, what: str) -> bytes:
    """The bytes of a local regular file of at most ``limit`` bytes; FileRefused when it is not a
    regular file, FileTooLarge when it is larger. ``what`` names the file in the message ("a config file")."""
    with open_regular(path) as handle:
        size = os.fstat(handle.fileno()).st_size
        data = handle.read(limit + 1) if size <= limit else b""
        if size > limit or len(data) > limit:  # the second: it grew while being read
            raise FileTooLarge(
                f"is {_human(max(size, len(data)))}, larger than {what} may be ({_human(limit)})"
            )
    return data


_SECRET_FILE_LIMIT = 64 * 1024

SECRET_REF = re.compile(r"^(env:[A-Za-z_][A-Za-z0-9_]*|file:.+)$")
"""A reference to a secret: ``env:NAME`` (an environment variable) or ``file:/path``. Configs,
plans and command lines hold these, never the secret itself."""


def read_secret(reference: str) -> str:
    """The secret an `env:NAME` or `file:/path` reference names, stripped. ValueError (or an
    OSError for an unreadable file) when there is none; messages name the place, never the
    content."""
    if reference.startswith("env:"):
        name = reference.removeprefix("env:")
        value, where = os.environ.get(name, ""), f"environment variable {name}"
    else:
        path = Path(reference.removeprefix("file:")).expanduser()
        data = read_capped(path, limit=_SECRET_FILE_LIMIT, what="a secret file")
        value, where = data.decode("utf-8"), str(path)
    if not value.strip():
        raise ValueError(f"the secret in {where} is not set or empty")
    return value.strip()


def _kind_refusal(mode: int) -> str | None:
    if stat.S_ISREG(mode):
        return None
    for test, reason in _KINDS:
        if test(mode):
            return reason
    return "is not a regular file"


def _human(size: int) -> str:
    if size < 1024:
        return f"{size} bytes"
    if size < 1 << 20:
        return f"{size / 1024:.1f} KiB"
    return f"{size / (1 << 20):.1f} MiB"
