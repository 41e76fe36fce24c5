"""scripts/worker.sh, the worker as docs/DEPLOYING.md §3 starts and stops it, against a real Prefect server: started
detached from a non-interactive shell (where a plain `setsid prefect worker start &` inherits SIGINT ignored and
survives a SIGTERM), it registers with its pool, and one SIGTERM (`worker.sh stop`) stops it."""
from __future__ import annotations

import subprocess
import time

import pytest

from tests.fixtures.prefect_server import REPO

pytest_plugins = ["tests.fixtures.prefect_server"]
pytestmark = [pytest.mark.prefect_server, pytest.mark.slow]

SCRIPT = str(REPO / "scripts" / "worker.sh")


def _script(server, tmp_path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = server.env(EAGLET_WORKER_DIR=str(tmp_path / "w"), PREFECT_WORKER_QUERY_SECONDS="1")
    return subprocess.run(["bash", SCRIPT, *args], env=env, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def _workers(server, pool: str) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: server.api_url}), get_client(sync_client=True) as client:
        return [w.name for w in client.read_workers_for_work_pool(pool)]


def test_one_sigterm_stops_the_worker_the_script_started(prefect_server, tmp_path):
    pool = "script-pool"
    prefect_server.cli("work-pool", "create", pool, "--type", "process")
    started = _script(prefect_server, tmp_path, "start", "--pool", pool, "--name", "by-the-script")
    assert started.returncode == 0, started.stderr
    pid = int((tmp_path / "w" / "worker.pid").read_text())
    try:
        deadline = time.monotonic() + 60
        while "by-the-script" not in _workers(prefect_server, pool):
            assert time.monotonic() < deadline, (tmp_path / "w" / "worker.log").read_text()[-2000:]
            time.sleep(0.5)
        assert _script(prefect_server, tmp_path, "start", "--pool", pool).returncode == 1  # one at a time
        assert "running (pid" in _script(prefect_server, tmp_path, "status").stdout
        t0 = time.monotonic()
        stopped = _script(prefect_server, tmp_path, "stop")
        seconds = time.monotonic() - t0
    finally:
        subprocess.run(["kill", "-KILL", str(pid)], capture_output=True)  # a failed test leaves no worker behind
    assert stopped.returncode == 0 and "after one SIGTERM" in stopped.stdout, stopped.stdout + stopped.stderr
    assert seconds < 30, seconds
    log = (tmp_path / "w" / "worker.log").read_text()
    assert "Received SIGTERM" in log and "stopped!" in log, log[-2000:]
    assert _script(prefect_server, tmp_path, "status").returncode == 3
