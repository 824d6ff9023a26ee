"""The house rules of the code, read from its source: no import circles between files, the
rooms' arrows (tui -> ipc <- service, gpu -> ipc; fmserve/ on top), and no file over 400 lines.

Every import counts: at module level, inside functions and under TYPE_CHECKING alike.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fmserve", "gpu", "ipc", "service", "tui")
# What each room may import from the others (ipc is the shared language; fmserve the top).
ALLOWED = {
    "ipc": set(),
    "gpu": {"ipc"},
    "service": {"ipc"},
    "tui": {"ipc"},
    "fmserve": {"ipc", "gpu", "service", "tui"},
}
MAX_LINES = 400


def source_files() -> dict[str, Path]:
    """Module name -> file, for every module of the five packages."""
    found = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def imports_of(path: Path, name: str, modules: set[str]) -> set[str]:
    """The modules of ours that `path` imports (a package import counts as its __init__)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            wanted = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import mod` imports pkg.mod when that is a module of ours
            wanted = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                      for a in node.names]
        else:
            continue
        for w in wanted:
            while w and w not in modules:  # `import a.b.c` names the longest module of ours
                w = w.rpartition(".")[0]
            if w and w != name:
                targets.add(w)
    # Importing a.b.c runs a/__init__.py and a/b/__init__.py first.
    parts = name.split(".")
    targets |= {".".join(parts[:i]) for i in range(1, len(parts))} & modules
    return targets


def import_graph() -> dict[str, set[str]]:
    files = source_files()
    return {name: imports_of(path, name, set(files)) for name, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_circles_between_files():
    graph = import_graph()
    assert len(graph) > 100  # the walk found the code
    assert cycles(graph) == []


def test_the_checker_sees_a_circle_inside_a_function():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    tree = imports_of(ROOT / "fmserve" / "engine.py", "fmserve.engine", set(source_files()))
    assert {"gpu.worker", "service.scheduler", "ipc.worker_config"} <= tree


@pytest.mark.parametrize("room", PACKAGES)
def test_each_room_imports_only_the_rooms_it_may(room):
    wrong = sorted(f"{src} -> {dst}" for src, dsts in import_graph().items()
                   if src.split(".")[0] == room for dst in dsts
                   if dst.split(".")[0] not in ALLOWED[room] | {room})
    assert wrong == []


def test_no_file_outside_tests_is_over_400_lines():
    files = list(source_files().values()) + sorted((ROOT / "scripts").rglob("*.py")) + sorted(
        (ROOT / "examples").rglob("*.py"))
    long = {str(p.relative_to(ROOT)): n for p in files
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}
