"""The generated files, where they live in the repository, and whether the committed ones are current."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from rollout.schema.jsonschema import build_schema, schema_text, sidecar_schema_text
from rollout.schema.reference import build_reference
from rollout.schema.stubs import build_stubs

# Artifact format -> path relative to the repository root. The formats are the CLI's --format.
PATHS = {
    "json": "schemas/rollout.schema.json",
    "python": "stubs/rollout_config.pyi",
    "markdown": "docs/config-reference.md",
    "sidecar": "schemas/sidecar-protocol.schema.json",
}

_BUILDERS: dict[str, Callable[[], str]] = {
    "json": schema_text,
    "python": lambda: build_stubs(build_schema()),
    "markdown": build_reference,
    "sidecar": sidecar_schema_text,
}


def artifact_text(fmt: str) -> str:
    return _BUILDERS[fmt]()


def generated_files() -> dict[str, str]:
    """Every generated file: relative path -> the text it must hold."""
    return {PATHS[fmt]: artifact_text(fmt) for fmt in PATHS}


def stale_files(root: Path, files: dict[str, str] | None = None) -> list[str]:
    """Relative paths under ``root`` that are missing or differ from what the code generates."""
    files = generated_files() if files is None else files
    return [path for path, text in files.items() if _read(root / path) != text]


def write_files(root: Path, files: dict[str, str] | None = None) -> list[str]:
    """Write the stale files under ``root``; return the relative paths that changed."""
    files = generated_files() if files is None else files
    changed = stale_files(root, files)
    for path in changed:
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        # Bytes, not text mode: the committed files stay LF and UTF-8 on every platform.
        target.write_bytes(files[path].encode("utf-8"))
    return changed


def _read(path: Path) -> str | None:
    try:
        return path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        return None
