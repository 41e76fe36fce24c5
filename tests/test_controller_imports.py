"""The controller loads without the host side's packages, as on a Prefect worker set up with the `controller`
extra alone (docs/DEPLOYING.md): every flows/ and tasks/ module imports and every deployment of prefect.yaml
loads (its entrypoint's flow, its parameters built by the build steps they name and checked by the flow), in
a Python whose import system refuses torch, numpy, safetensors, vllm, transformers, pyarrow and datasets.
The contract modules (remote/*.py, remote/<package>/config.py) load there too. A wheel built from the
checkout holds every module under flows/, tasks/ and remote/, and installed alone (its files, no checkout beside
them) its flows load and `python -m flows.train_draft --help` runs. Each check runs in a fresh interpreter: this
one has the heavy packages loaded, which would hide an import of one.

    .venv/bin/python -m pytest -q tests/test_controller_imports.py
    .venv/bin/python -m tests.test_controller_imports controller       # the same load, by hand: prints what loaded

Which module is controller and which contract is the house's rule (scripts/house.py).
"""
from __future__ import annotations

import importlib
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from scripts.house import HEAVY, HOUSE, ROOT, draw


class RefuseHeavy:
    """A sys.meta_path finder that refuses the host side's packages, as an interpreter without them would."""

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in HEAVY:
            raise ModuleNotFoundError(f"No module named {name!r} (refused: the controller venv has no "
                                      f"{name.partition('.')[0]})", name=name)
        return None


def load_deployments(folder: Path) -> dict[str, list[str]]:
    """Every deployment of folder/prefect.yaml, loaded as `prefect deploy` does: the build steps its parameters'
    templates name run (from folder), the templates are filled with their outputs, the entrypoint's flow is
    loaded, and the flow checks the parameters as it would at the start of a run. {name: its parameters}."""
    import yaml
    from prefect.flows import Flow, load_flow_from_entrypoint
    from prefect.utilities.importtools import import_object
    from prefect.utilities.templating import apply_values

    os.chdir(folder)  # prefect deploy runs in the project's folder: the build steps' paths are relative to it
    config = yaml.safe_load(Path("prefect.yaml").read_text())
    named = set(re.findall(r"\{\{\s*([A-Za-z0-9_-]+)\.", json.dumps([d.get("parameters") for d in config["deployments"]])))
    outputs = {}
    for step in config.get("build") or []:
        ((fqn, inputs),) = step.items()
        if inputs.get("id") in named:  # the others (a shell `pwd`, the failure automation) need a server or a shell
            kwargs = {k: v for k, v in inputs.items() if k not in ("id", "requires")}
            outputs[inputs["id"]] = import_object(fqn)(**kwargs)
    assert named <= set(outputs), f"templates name steps that prefect.yaml's build does not have: {named - set(outputs)}"
    loaded = {}
    for d in config["deployments"]:
        flow = load_flow_from_entrypoint(d["entrypoint"])
        assert isinstance(flow, Flow), f"{d['name']}: {d['entrypoint']} is {type(flow).__name__}, not a flow"
        parameters = apply_values(d.get("parameters") or {}, outputs)
        flow.validate_parameters(parameters)  # the run's own check: a bad key or value fails here
        loaded[f"{flow.name}/{d['name']}"] = sorted(parameters)
    return loaded


def child(what: str, folder: Path = ROOT) -> dict:
    """In this interpreter: refuse the heavy packages, then load `what` (controller: flows, tasks and the
    deployments of folder/prefect.yaml; contract: the contract modules). What was loaded, as JSON."""
    assert not any(m.partition(".")[0] in HEAVY for m in sys.modules), "loaded before the refusal"
    sys.meta_path.insert(0, RefuseHeavy())
    modules = sorted(m for m, layer in draw().layers.items() if layer == what)
    for m in modules:
        importlib.import_module(m)
    deployments = load_deployments(folder) if what == "controller" else {}
    heavy = sorted(m for m in sys.modules if m.partition(".")[0] in HEAVY)
    return {"modules": modules, "deployments": deployments, "heavy": heavy}


def run_child(what: str, folder: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tests.test_controller_imports", what, str(folder)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})


def result_of(r: subprocess.CompletedProcess) -> dict:
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_every_flow_task_and_deployment_loads_without_the_host_side_packages():
    got = result_of(run_child("controller"))
    assert {"flows.train_draft", "flows.nightly", "tasks.windows", "tasks.host.ssh"} <= set(got["modules"])
    deployments = re.findall(r"^  - name: (\S+)", (ROOT / "prefect.yaml").read_text(), re.M)
    assert sorted(name.split("/")[1] for name in got["deployments"]) == sorted(deployments) and len(deployments) >= 5
    assert set(got["deployments"]["train-draft/tiny"]) >= {"host", "data", "train"}, "the presets filled the templates"
    assert got["heavy"] == []


def test_the_contract_modules_import_no_heavy_package():
    got = result_of(run_child("contract"))
    assert {"remote.step", "remote.guard", "remote.split", "remote.train.config", "remote.data.config"} <= set(
        got["modules"])
    assert got["heavy"] == []


def test_a_module_that_imports_a_heavy_package_is_refused_by_name():
    """The refusal is real: the step that plans windows needs numpy and torch, and fails to load here."""
    code = ("import sys; from tests.test_controller_imports import RefuseHeavy; sys.meta_path.insert(0, RefuseHeavy()); "
            "import remote.train.windows")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "refused: the controller venv has no" in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("where, bad_key", [("tiny-local", "learning_rat"), ("nightly-local", "margn")])
def test_a_deployment_with_a_bad_key_fails_the_load_naming_it(tmp_path, where, bad_key):
    """A misspelt key in a preset file (read by the build step): a training flow's, or the nightly's own section."""
    yaml_text = (ROOT / "prefect.yaml").read_text()
    shutil.copytree(ROOT / "deployments", tmp_path / "deployments")
    preset = tmp_path / "deployments" / f"{where}.json"
    section = "train" if where == "tiny-local" else "nightly"
    preset.write_text(json.dumps({**json.loads(preset.read_text()), section: {bad_key: 0.001}}))
    (tmp_path / "prefect.yaml").write_text(yaml_text)
    r = run_child("controller", tmp_path)
    assert r.returncode != 0 and bad_key in r.stderr, r.stderr[-2000:]


def build_wheel(out: Path) -> Path:
    """A wheel of a copy of the checkout (so it gains no build/), built offline by setuptools' own backend."""
    src = out / "src"
    src.mkdir()
    shutil.copy(ROOT / "pyproject.toml", src / "pyproject.toml")
    for top in HOUSE:
        shutil.copytree(ROOT / top, src / top, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    code = f"from setuptools import build_meta; print(build_meta.build_wheel({str(out)!r}))"
    r = subprocess.run([sys.executable, "-c", code], cwd=src, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return out / r.stdout.strip().splitlines()[-1]


def test_a_wheel_holds_every_module_and_its_flows_load_from_it_alone(tmp_path):
    wheel = build_wheel(tmp_path)
    held = {n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".py")}
    modules = {p.relative_to(ROOT).as_posix() for top in HOUSE for p in (ROOT / top).rglob("*.py")}
    assert {"remote/data/prepare.py", "tasks/host/ssh.py", "flows/train_draft.py"} <= modules
    assert (sorted(modules - held), sorted(held - modules)) == ([], [])

    site = tmp_path / "site"  # a pure-Python wheel installs by unpacking
    zipfile.ZipFile(wheel).extractall(site)
    code = "\n".join([inspect.getsource(RefuseHeavy).replace("in HEAVY", f"in {HEAVY!r}"),
                      "import runpy, sys", "sys.meta_path.insert(0, RefuseHeavy())",
                      "import flows.train_draft, flows.nightly",
                      "assert flows.train_draft.__file__.startswith(sys.argv[1]), flows.train_draft.__file__",
                      "sys.argv = ['flows.train_draft', '--help']",
                      "runpy.run_module('flows.train_draft', run_name='__main__')"])
    elsewhere = tmp_path / "elsewhere"  # not the checkout: only the wheel's files are on the path
    elsewhere.mkdir()
    r = subprocess.run([sys.executable, "-c", code, str(site)], cwd=elsewhere, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "PYTHONPATH": str(site)})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "--preset" in r.stdout, r.stdout[-2000:]


if __name__ == "__main__":  # python -m tests.test_controller_imports controller|contract [folder]
    print(json.dumps(child(sys.argv[1], Path(sys.argv[2]) if len(sys.argv) > 2 else ROOT)))
