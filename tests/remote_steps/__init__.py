"""Remote code for tests only: shipped inside a copy of the `remote` package, never in the real one.

`probe.py` is a remote step that prints, reports progress, writes a manifest or fails on purpose;
`echo_argv.py` is a plain script that prints its arguments as JSON, or hangs with a child process.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tasks.ship import REMOTE_SRC

HERE = Path(__file__).parent


def package_with_probes(dest: Path) -> Path:
    """dest/remote: the real remote package plus probe.py and echo_argv.py."""
    pkg = dest / "remote"
    shutil.copytree(REMOTE_SRC, pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("probe.py", "echo_argv.py"):
        shutil.copy(HERE / name, pkg / name)
    return pkg


@pytest.fixture(scope="session")
def probe_src(tmp_path_factory) -> Path:
    """A package folder to ship (import this fixture into a test module to use it)."""
    return package_with_probes(tmp_path_factory.mktemp("probe-src"))
