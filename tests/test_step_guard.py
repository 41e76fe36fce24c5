"""A step ends when its controller goes away (remote.guard): on a real sshd and on the local host, a
step that never ends by itself (tests/remote_steps/hang_step.py: a child ignoring SIGTERM, and a
grandchild) is started through run_remote_step; the connection is closed, or the controller process
is SIGKILLed, or the network to the host is cut (its heartbeats stop); every process of the step must
be gone within the guard's grace plus a few seconds (plus the heartbeat silence for a cut network).
The guard keeps exit codes as they are.

This module is also the controller of those runs: `python -m tests.test_step_guard PARAMS SRC PID_FILE`.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from remote.guard import GRACE_S, HEARTBEAT_ENV, LOST_AFTER_BEATS
from tasks.errors import CommandTimedOut, HostUnreachable
from tasks.host import HostParams, open_host
from tasks.host import ssh as ssh_host
from tasks.remote_step import run_remote_step
from tasks.ship import ship_code
from tests.fixtures.sshd import SSHD, delete_netns, make_netns, start_sshd
from tests.remote_steps import package_with_probes

REPO = Path(__file__).resolve().parent.parent
GONE_WITHIN_S = GRACE_S + 5  # the guard's grace for the SIGTERM-ignoring child, and time to notice


@pytest.fixture(scope="module")
def hang_src(tmp_path_factory) -> Path:
    pkg = package_with_probes(tmp_path_factory.mktemp("hang-src"))
    shutil.copy(REPO / "tests" / "remote_steps" / "hang_step.py", pkg / "hang_step.py")
    return pkg


def start_hang_step(host, src: Path, pid_file: str, timeout: float = 600) -> None:
    """Ship src and run hang_step on host (returns only when the run fails)."""
    code = ship_code(host, src)
    run_dir = host.path("runs", uuid.uuid4().hex[:8])
    run_remote_step(host, code, "hang_step", {"out_dir": f"{run_dir}/hang", "pid_file": pid_file},
                    run_dir=run_dir, timeout=timeout, log=print)


def alive(pid: int) -> bool:
    """Running (a zombie that nobody reaped yet has ended: it holds no memory and runs nothing)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.fixture
def step_pids(tmp_path):
    """(pid file, wait() -> the step's three pids); whatever is left at the end is SIGKILLed."""
    pid_file = tmp_path / "pids"
    tmp_path.chmod(0o755)
    seen: list[int] = []

    def wait(timeout: float = 60) -> list[int]:
        deadline = time.monotonic() + timeout
        while not pid_file.exists():
            assert time.monotonic() < deadline, "the step did not start its processes"
            time.sleep(0.05)
        seen.extend(int(p) for p in pid_file.read_text().split())
        assert len(seen) == 3 and all(alive(p) for p in seen), seen
        return list(seen)

    yield pid_file, wait
    for pid in seen:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def assert_all_end(pids: list[int], within: float = GONE_WITHIN_S) -> float:
    started = time.monotonic()
    while any(alive(p) for p in pids):
        left = [p for p in pids if alive(p)]
        assert time.monotonic() - started < within, f"still running after {within} s: {left}"
        time.sleep(0.1)
    return time.monotonic() - started


@pytest.mark.ssh
def test_closing_the_ssh_connection_ends_the_step(sshd, hang_src, step_pids):
    pid_file, wait = step_pids
    host = open_host(sshd.params(root=str(sshd.dir.parent / "roots" / uuid.uuid4().hex[:8])))
    errors: list[Exception] = []
    runner = threading.Thread(target=lambda: _catch(errors, start_hang_step, host, hang_src, str(pid_file)),
                              daemon=True)
    runner.start()
    pids = wait()
    host.close()
    runner.join(30)
    assert not runner.is_alive() and len(errors) == 1 and isinstance(errors[0], HostUnreachable), errors
    print(f"connection closed: the step's processes were gone after {assert_all_end(pids):.2f} s")


@pytest.mark.parametrize("kind", ["local", pytest.param("ssh", marks=pytest.mark.ssh)])
def test_killing_the_controller_ends_the_step(request, kind, hang_src, step_pids, tmp_path):
    pid_file, wait = step_pids
    if kind == "local":
        params = HostParams(root=str(tmp_path / "root"))
    else:
        server = request.getfixturevalue("sshd")
        params = server.params(root=str(server.dir.parent / "roots" / uuid.uuid4().hex[:8]))
    log = open(tmp_path / "controller.log", "w")
    controller = subprocess.Popen([sys.executable, "-m", "tests.test_step_guard", params.model_dump_json(),
                                   str(hang_src), str(pid_file)], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        pids = wait()
        assert controller.poll() is None
        controller.kill()  # SIGKILL: nothing on the controller side gets to clean up
        controller.wait(10)
        print(f"controller killed ({kind}): the step's processes were gone after {assert_all_end(pids):.2f} s")
    finally:
        if controller.poll() is None:
            controller.kill()
        log.close()


def test_a_step_past_its_timeout_is_ended_whole(each_host, hang_src, step_pids):
    """The host's timeout signals the guard, which ends the child that ignores SIGTERM before the
    timeout's own SIGKILL (5 s later) would end the guard alone."""
    pid_file, wait = step_pids
    errors: list[Exception] = []
    runner = threading.Thread(target=lambda: _catch(errors, start_hang_step, each_host, hang_src, str(pid_file),
                                                    timeout=8), daemon=True)
    runner.start()
    pids = wait()
    runner.join(30)
    assert len(errors) == 1 and isinstance(errors[0], CommandTimedOut), errors
    assert_all_end(pids, within=2)  # the timeout ended the command: nothing of it is left


@pytest.mark.ssh
def test_a_lost_network_ends_the_step_within_the_bound(hang_src, step_pids, tmp_path, monkeypatch):
    """The link to a host in its own network namespace is cut while a step runs: nothing reaches the host
    any more and nothing closes there, as when the controller's machine crashes. The step's process tree
    must end within LOST_AFTER_S + GRACE_S (+1 s to notice; more on a loaded machine) all the same, and the
    controller's run fail as unreachable. The heartbeat runs at 3 s instead of 10 here: the same mechanism,
    a 9 s silence instead of 30 (the bound in production: 3 x 10 s + GRACE_S + 1 s, 33.6 s measured once)."""
    monkeypatch.setattr(ssh_host, "HEARTBEAT_S", 3.0)
    monkeypatch.setattr(ssh_host, "LOST_AFTER_S", LOST_AFTER_BEATS * 3.0)
    LOST_AFTER_S = ssh_host.LOST_AFTER_S
    pid_file, wait = step_pids
    if not Path(SSHD).exists():
        pytest.skip(f"{SSHD} missing: apt-get install -y openssh-server")
    try:
        ns = make_netns(f"lc{os.getpid() % 100000}")
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        pytest.skip(f"cannot make a network namespace ({getattr(e, 'stderr', '') or e}); needs root and iproute2")
    try:
        server = start_sshd(tmp_path / "sshd", listen=ns.addr, port=22, netns=ns.name)
        host = open_host(server.params(root=str(tmp_path / "root")))
        errors: list[Exception] = []
        runner = threading.Thread(target=lambda: _catch(errors, start_hang_step, host, hang_src, str(pid_file)),
                                  daemon=True)
        runner.start()
        pids = wait()
        subprocess.run(["ip", "link", "set", ns.link, "down"], check=True)
        cut = time.monotonic()
        gone = assert_all_end(pids, within=LOST_AFTER_S + GONE_WITHIN_S)
        runner.join(LOST_AFTER_S + 15)
        failed = time.monotonic() - cut
        assert not runner.is_alive() and len(errors) == 1 and isinstance(errors[0], HostUnreachable), errors
        print(f"network cut: the step's processes were gone after {gone:.1f} s (bound "
              f"{LOST_AFTER_S + GRACE_S + 1:g} s); the controller's run failed as unreachable after {failed:.1f} s")
    finally:
        server.stop()
        delete_netns(ns)


def test_heartbeats_keep_a_step_and_their_silence_ends_it():
    """Without the network: a pipe that stays open but goes silent, as a cut link does over SSH."""
    beat = 0.5
    command = ["sh", "-c", f'echo "${{{HEARTBEAT_ENV}-unset}}"; exec sleep 300']
    guard = subprocess.Popen([sys.executable, "-m", "remote.guard", *command], cwd=REPO, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, env={**os.environ, HEARTBEAT_ENV: str(beat)})
    for _ in range(8):  # 4 s of heartbeats: longer than the silence that ends the step
        guard.stdin.write(b"\n")
        guard.stdin.flush()
        time.sleep(beat)
    assert guard.poll() is None, "a step whose controller sends heartbeats was ended"
    silent = time.monotonic()
    assert guard.wait(LOST_AFTER_BEATS * beat + GRACE_S + 2) == -signal.SIGTERM
    assert time.monotonic() - silent >= (LOST_AFTER_BEATS - 1) * beat
    assert guard.stdout.read() == b"unset\n"  # the guard's setting is not the command's
    guard.stdin.close()


def _catch(errors: list, fn, *args, **kwargs) -> None:
    try:
        fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - looked at by the test
        errors.append(e)


def _guard(*command: str, stdin=subprocess.DEVNULL) -> int:
    return subprocess.run([sys.executable, "-m", "remote.guard", *command], cwd=REPO, stdin=stdin,
                          timeout=30).returncode


def test_the_guard_keeps_exit_codes():
    assert _guard("sh", "-c", "exit 3") == 3
    assert _guard("sh", "-c", "exit 65") == 65
    assert _guard("sh", "-c", "kill -9 $$") == -signal.SIGKILL  # ended by the same signal
    # stdin that is no controller's line (here /dev/null) does not end the command
    assert _guard("sh", "-c", "sleep 0.5; exit 0") == 0
    assert _guard() == 64


def test_what_a_command_leaves_behind_is_ended(tmp_path):
    """A step that crashes and leaves a child running (an engine whose parent died): the guard ends it."""
    pid_file = tmp_path / "left"
    assert _guard("sh", "-c", f"sleep 300 & echo $! > {pid_file}; exit 3") == 3
    assert not alive(int(pid_file.read_text()))


if __name__ == "__main__":  # the controller of test_killing_the_controller_ends_the_step
    with open_host(HostParams.model_validate_json(sys.argv[1])) as controller_host:
        controller_host.makedirs(controller_host.root)
        start_hang_step(controller_host, Path(sys.argv[2]), sys.argv[3])
