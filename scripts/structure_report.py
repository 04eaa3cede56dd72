"""Print the package's structure figures: import cycles, longest functions, biggest modules.

    python scripts/structure_report.py [--top N]

Reads the source with `ast` (nothing is imported or run). A cycle is a set of modules that import
each other, directly or through others, counting every import (module-level and inside
functions), so a lazy import that only hides a loop is still a loop.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "rollout"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, name: str, known: set[str]) -> set[str]:
    """Every rollout module `path` imports; `from pkg import mod` counts as importing pkg.mod."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                found.add(target)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield (
                node.end_lineno - node.lineno + 1,
                f"{path.relative_to(PACKAGE.parent)}:{node.name}",
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=10)
    top = parser.parse_args().top
    paths = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
    # Packages import their own __init__ implicitly; only edges between modules count.
    graph = {name: imported_modules(path, name, set(paths)) for name, path in paths.items()}
    loops = cycles(graph)
    print(
        f"modules: {len(paths)}, lines: {sum(len(p.read_text().splitlines()) for p in paths.values())}"
    )
    print(f"import cycles: {len(loops)}")
    for loop in loops:
        print("  " + " <-> ".join(loop))
    print(f"longest functions (top {top}):")
    for length, where in sorted((f for p in paths.values() for f in functions(p)), reverse=True)[
        :top
    ]:
        print(f"  {length:5d}  {where}")
    print(f"biggest modules (top {top}):")
    sizes = sorted(((len(p.read_text().splitlines()), n) for n, p in paths.items()), reverse=True)
    for length, name in sizes[:top]:
        print(f"  {length:5d}  {name}")


if __name__ == "__main__":
    main()
