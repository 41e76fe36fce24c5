"""The house, drawn from the code's own imports: each module's layer, and the circles and arrows that break its rules.

    python scripts/house.py            # every module by layer, then the circles and the rule-breaking arrows
    python scripts/house.py --breaks   # only the circles and the rule-breaking arrows

Read with ast (nothing is imported), every import statement counts, at the top of a file or inside a function.
The layers, top to bottom (an import may point down, or sideways inside library and contract, never up):

    controller  flows/, tasks/ (and deployments/, JSON presets that import nothing): controller and contract only,
                never a heavy package (the controller venv has none: HEAVY)
    step        the modules remote.step.STEP_MODULES names: library and contract, never another step
    library     every other module under remote/: library and contract only
    contract    remote/*.py and remote/<package>/config.py: contract and the standard library only

A package's config.py is contract only where importing it runs no code: remote/<package>/__init__.py imports
nothing (remote/draft/__init__.py loads the model, so remote.draft.config is library). A circle is a set of
modules that import each other, directly or through others, in any layer. bench/, tests/ and scripts/ stand
outside the house: they may import anything, and nothing in the house may import them.
Exit status: 0 when nothing breaks the rules, 1 otherwise.
"""
from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HOUSE = ("flows", "tasks", "remote")
OUTSIDE = ("bench", "tests", "scripts")
LAYERS = ("controller", "step", "library", "contract")
HEAVY = ("torch", "numpy", "safetensors", "vllm", "transformers", "pyarrow", "datasets")
# which layers each layer may import (a step may import itself, not another step: checked apart)
MAY_IMPORT = {"controller": {"controller", "contract"}, "step": {"library", "contract"},
              "library": {"library", "contract"}, "contract": {"contract"}}


@dataclass(frozen=True)
class Arrow:
    source: str  # the importing module
    target: str  # what it imports: a module of the repo, or a package's top-level name
    names: tuple[str, ...]  # the names it takes (from a import b, c), empty for `import a`


def module_name(path: Path, root: Path = ROOT) -> str:
    return ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")


def files(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the house -> its file."""
    return {module_name(p, root): p for top in HOUSE for p in sorted((root / top).rglob("*.py"))}


def step_modules(root: Path = ROOT) -> set[str]:
    """remote.step.STEP_MODULES's values, read from the source."""
    for node in ast.parse((root / "remote" / "step.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "STEP_MODULES" for t in node.targets):
            return set(ast.literal_eval(node.value).values())
    raise SystemExit("remote/step.py: no STEP_MODULES")


def layer_of(module: str, steps: set[str], root: Path = ROOT) -> str:
    parts = module.split(".")
    if parts[0] in ("flows", "tasks"):
        return "controller"
    if module in steps:
        return "step"
    if module == "remote" or len(parts) == 2 and (root / "remote" / f"{parts[1]}.py").is_file():
        return "contract"
    if len(parts) == 3 and parts[2] == "config" and not _imports_anything(root / "remote" / parts[1] / "__init__.py"):
        return "contract"
    return "library"


def _imports_anything(init: Path) -> bool:
    return init.is_file() and any(isinstance(n, (ast.Import, ast.ImportFrom)) for n in ast.walk(ast.parse(init.read_text())))


def arrows(module: str, path: Path, known: set[str]) -> list[Arrow]:
    """What one file imports: the most precise module of the repo (`from a import b` where a.b is a module: a.b),
    else the top-level name of the package (prefect, torch, json)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [Arrow(module, _within(a.name, known), ()) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from . import x / from ..a import b
                anchor = package.rsplit(".", node.level - 1)[0]
                base = f"{anchor}.{base}" if base else anchor
            for a in node.names:
                target = f"{base}.{a.name}" if f"{base}.{a.name}" in known else _within(base, known)
                found.append(Arrow(module, target, (a.name,)))
    return found


def _within(name: str, known: set[str]) -> str:
    """The longest prefix of a dotted name that is a module of the repo, else its top-level package."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in known:
            return ".".join(parts[:n])
    return parts[0]


@dataclass(frozen=True)
class House:
    layers: dict[str, str]  # module -> its layer
    graph: dict[tuple[str, str], tuple[str, ...]]  # (source, target) -> the names taken, for every arrow

    def breaks(self) -> dict[str, str]:
        """Every arrow that breaks a rule: 'a -> b' -> why, with the names it takes."""
        out = {}
        for (a, b), names in sorted(self.graph.items()):
            if why := self.why(a, b):
                out[f"{a} -> {b}"] = why + (": " + ", ".join(sorted(set(names))) if names else "")
        return out

    def why(self, a: str, b: str) -> str | None:
        la, lb = self.layers[a], self.layers.get(b)
        top = b.partition(".")[0]
        if lb is None and top in OUTSIDE:
            return f"{la} imports {top}/, which stands outside the house"
        if lb is None:  # a package from outside the repo
            if la == "controller" and top in HEAVY:
                return "controller imports a heavy package"
            if la == "contract" and top not in sys.stdlib_module_names:
                return "contract imports a package beyond the standard library"
            return None
        if la == lb == "step" and a != b:
            return "step -> another step"
        if lb not in MAY_IMPORT[la]:
            return f"{la} -> {lb}"
        return None

    def circles(self) -> list[list[str]]:
        """The import circles: each strongly connected set of two or more modules, sorted (Tarjan's walk)."""
        edges = {m: sorted({b for (a, b) in self.graph if a == m and b in self.layers and b != m}) for m in self.layers}
        index, low, stack, on_stack, found = {}, {}, [], set(), []

        def visit(m: str) -> None:
            index[m] = low[m] = len(index)
            stack.append(m)
            on_stack.add(m)
            for n in edges[m]:
                if n not in index:
                    visit(n)
                    low[m] = min(low[m], low[n])
                elif n in on_stack:
                    low[m] = min(low[m], index[n])
            if low[m] == index[m]:
                members = []
                while True:
                    n = stack.pop()
                    on_stack.discard(n)
                    members.append(n)
                    if n == m:
                        break
                if len(members) > 1:
                    found.append(sorted(members))

        for m in sorted(self.layers):
            if m not in index:
                visit(m)
        return sorted(found)


def draw(root: Path = ROOT) -> House:
    modules = files(root)
    steps = step_modules(root)
    graph: dict[tuple[str, str], tuple[str, ...]] = {}
    for m, path in modules.items():
        for arrow in arrows(m, path, set(modules)):
            graph[arrow.source, arrow.target] = graph.get((arrow.source, arrow.target), ()) + arrow.names
    return House({m: layer_of(m, steps, root) for m in modules}, graph)


def circle_name(members: list[str]) -> str:
    return "circle: " + " <-> ".join(members)


def main(argv: list[str]) -> int:
    house = draw()
    if "--breaks" not in argv:
        for layer in LAYERS:
            members = sorted(m for m, lay in house.layers.items() if lay == layer)
            print(f"{layer} ({len(members)})")
            print("".join(f"    {m}\n" for m in members), end="")
        print("bench/, tests/, scripts/: outside the house (they may import anything)")
    circles, breaks = house.circles(), house.breaks()
    print(f"\n{len(circles)} circles")
    print("".join(f"    {circle_name(c)}\n" for c in circles), end="")
    print(f"{len(breaks)} arrows that break the rules")
    print("".join(f"    {arrow} ({why})\n" for arrow, why in breaks.items()), end="")
    return 1 if circles or breaks else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
