"""File operations confined to one episode's directory.

Every path is relative to the directory and resolved, symlinks included, before use; a path that
resolves outside (``..``, an absolute path, a symlink pointing out) is refused. The sandboxed
code may create symlinks in its directory, but nothing of it runs while a tool operation does
(the process sandboxes end all it started), so a checked path cannot be swapped under us.
"""

from __future__ import annotations

import os
from pathlib import Path

from rollout.harness.sandbox.process import Refused


class Workspace:
    """One episode's directory. max_write_bytes caps one write; max_read_bytes caps one read
    (a larger file is refused rather than truncated, so the model is never misled)."""

    def __init__(
        self, root: Path, *, max_write_bytes: int = 1 << 20, max_read_bytes: int = 1 << 20
    ):
        self.root = Path(root).resolve()
        if not self.root.is_dir():
            raise ValueError(f"the workspace directory {self.root} does not exist")
        self.max_write_bytes = max_write_bytes
        self.max_read_bytes = max_read_bytes

    def resolve(self, path: str) -> Path:
        """The real path of path inside the workspace; Refused when it leaves it."""
        if not isinstance(path, str) or not path or "\0" in path:
            raise Refused(f"{path!r} is not a usable path")
        if os.path.isabs(path):
            raise Refused(f"{path!r} is absolute: give a path relative to the workspace")
        real = Path(os.path.realpath(self.root / path))
        if real != self.root and not real.is_relative_to(self.root):
            raise Refused(f"{path!r} leads outside the workspace")
        return real

    def read(self, path: str) -> str:
        target = self.resolve(path)
        if not target.is_file():
            raise Refused(f"{path!r} is not a file in the workspace")
        size = target.stat().st_size
        if size > self.max_read_bytes:
            raise Refused(
                f"{path!r} holds {size} bytes, more than the {self.max_read_bytes} a read may return"
            )
        return target.read_bytes().decode(errors="replace")

    def write(self, path: str, text: str) -> int:
        """Write text (creating parent directories); the number of bytes written."""
        data = text.encode()
        if len(data) > self.max_write_bytes:
            raise Refused(
                f"{len(data)} bytes is more than the {self.max_write_bytes} a write may hold"
            )
        target = self.resolve(path)
        if target == self.root or target.is_dir():
            raise Refused(f"{path!r} is a directory")
        target.parent.mkdir(parents=True, exist_ok=True)
        # O_NOFOLLOW: the path was resolved, so a link appearing at its end is refused, not followed
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        return len(data)

    def list(self, path: str = ".") -> list[str]:
        """The entries of a directory, sorted, with a trailing "/" on directories."""
        target = self.resolve(path)
        if not target.is_dir():
            raise Refused(f"{path!r} is not a directory in the workspace")
        return sorted(entry.name + ("/" if entry.is_dir() else "") for entry in target.iterdir())

    def delete(self, path: str) -> None:
        """Delete a file or an empty directory (a symlink itself, never what it points to)."""
        if not isinstance(path, str) or os.path.isabs(path):
            raise Refused(f"{path!r} is absolute: give a path relative to the workspace")
        # a link is deleted, not followed: check its parent, then remove the name itself
        lexical = self.root / path
        parent = self.resolve(os.path.dirname(path) or ".")
        target = parent / lexical.name
        if lexical.name in ("", ".", "..") or target == self.root:
            raise Refused(f"{path!r} names the workspace itself")
        if target.is_symlink() or target.is_file():
            target.unlink()
        elif target.is_dir():
            try:
                target.rmdir()
            except OSError:
                raise Refused(f"{path!r} is a directory that is not empty") from None
        else:
            raise Refused(f"{path!r} does not exist in the workspace")
