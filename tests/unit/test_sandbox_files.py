"""File operations confined to the episode's directory, on a real directory tree."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rollout.harness.sandbox import Refused, Workspace


@pytest.fixture
def space(tmp_path: Path) -> Workspace:
    root = tmp_path / "episode"
    root.mkdir()
    (tmp_path / "secret.txt").write_text("outside")
    return Workspace(root, max_write_bytes=1000, max_read_bytes=2000)


def test_write_read_list_delete_inside(space):
    assert space.write("notes/a.txt", "hello") == 5
    assert space.read("notes/a.txt") == "hello"
    assert space.list() == ["notes/"]
    assert space.list("notes") == ["a.txt"]
    space.delete("notes/a.txt")
    space.delete("notes")
    assert space.list() == []


@pytest.mark.parametrize("path", ["../secret.txt", "notes/../../secret.txt", "/etc/passwd", ""])
def test_paths_that_leave_the_directory_are_refused(space, path):
    with pytest.raises(Refused):
        space.read(path)
    with pytest.raises(Refused):
        space.write(path, "x")
    assert (space.root.parent / "secret.txt").read_text() == "outside"


def test_a_symlink_that_escapes_is_refused_and_deleting_it_removes_only_the_link(space):
    os.symlink(space.root.parent / "secret.txt", space.root / "link.txt")
    os.symlink(space.root.parent, space.root / "up")
    with pytest.raises(Refused, match="outside"):
        space.read("link.txt")
    with pytest.raises(Refused, match="outside"):
        space.write("link.txt", "overwritten")
    with pytest.raises(Refused, match="outside"):
        space.write("up/new.txt", "x")
    with pytest.raises(Refused, match="outside"):
        space.list("up")
    space.delete("link.txt")
    assert (space.root.parent / "secret.txt").read_text() == "outside"
    assert not (space.root.parent / "new.txt").exists()


def test_a_symlink_inside_the_directory_is_followed(space):
    space.write("real.txt", "inside")
    os.symlink("real.txt", space.root / "alias.txt")
    assert space.read("alias.txt") == "inside"


def test_size_caps(space):
    with pytest.raises(Refused, match="1000"):
        space.write("big.txt", "x" * 1001)
    (space.root / "huge.txt").write_text("y" * 3000)
    with pytest.raises(Refused, match="3000 bytes"):
        space.read("huge.txt")


def test_the_workspace_itself_cannot_be_deleted_or_overwritten(space):
    for path in (".", "notes/.."):
        with pytest.raises(Refused):
            space.delete(path)
    with pytest.raises(Refused, match="directory"):
        space.write(".", "x")
