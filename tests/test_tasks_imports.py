"""tasks/ has no import cycle: no module imports (at its top or inside a function) one that imports it
back, directly or through others. Read from the source with ast, so nothing is imported to check."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _module(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, package: str, modules: set[str]) -> set[str]:
    """The modules of `modules` that the file names in an import, wherever the import stands."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found |= {n for n in names if n in modules}
    return found - {package}


def import_graph(root: str) -> dict[str, set[str]]:
    files = {_module(p): p for p in (REPO / root).rglob("*.py")}
    return {m: _imports(p, m, set(files)) for m, p in files.items()}


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    done: set[str] = set()

    def visit(m: str, path: list[str]) -> list[str] | None:
        if m in path:
            return path[path.index(m):] + [m]
        if m in done:
            return None
        for n in sorted(graph[m]):
            if found := visit(n, path + [m]):
                return found
        done.add(m)
        return None

    return next((c for m in sorted(graph) if (c := visit(m, []))), None)


def test_tasks_has_no_import_cycle():
    graph = import_graph("tasks")
    assert "tasks.host.ssh" in graph["tasks.host"] and graph["tasks.ship"]  # the graph sees lazy imports too
    assert cycle(graph) is None, f"import cycle: {' -> '.join(cycle(graph))}"


def test_a_cycle_is_found():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None
