"""What the packages may import: remote/ runs on the host without Prefect or Fabric; no test module imports
another. The layers (no circle, the contract on the standard library alone) are tests/test_house.py's, the
controller without the heavy packages tests/test_controller_imports.py's."""
import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _files(package: str) -> dict[str, Path]:
    """module name -> its file, for every module of a package (subpackages too)."""
    return {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
            for p in (ROOT / package).rglob("*.py")}


def _modules(package: str) -> list[str]:
    return sorted(_files(package))


def _loaded_after_importing(modules: list[str], watched: list[str]) -> list[str]:
    """Which of `watched` a fresh interpreter holds after importing `modules` (and nothing else)."""
    code = ("import importlib, json, sys\n"
            f"for m in {modules!r}: importlib.import_module(m)\n"
            f"print(json.dumps(sorted(w for w in {watched!r} if w in sys.modules)))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_remote_imports_neither_prefect_nor_fabric():
    modules = _modules("remote")
    assert "remote.step" in modules and "remote.capture.backend_vllm" in modules
    assert _loaded_after_importing(modules, ["prefect", "fabric", "paramiko", "invoke"]) == []


def _imported_names(path: Path) -> set[str]:
    """Every module a file imports, anywhere in it (functions too); `from a import b` counts as a and a.b."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            found |= {base} | {f"{base}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return found


def test_no_test_module_imports_another():
    """What several test modules share lives in tests/fixtures/, not in one of them."""
    imported = {path.relative_to(ROOT).as_posix(): _imported_names(path) for path in (ROOT / "tests").rglob("*.py")}
    offending = {file: sorted(m for m in names if any(part.startswith("test_") for part in m.split(".")))
                 for file, names in imported.items()}
    assert {file: names for file, names in offending.items() if names} == {}
    assert "tests.fixtures.capture" in imported["tests/test_capture_vllm.py"], "the walk reads the real imports"
