"""Shipping the remote package: content-addressed, verified on the host, nothing sent twice.
Real hosts: a LocalHost, root over the loopback sshd, a zsh user, a host in a network namespace."""
from __future__ import annotations

import os
import posixpath
import threading
import time
from pathlib import Path

import pytest

from tasks.errors import BadInputError, HostUnreachable
from tasks.remote_step import run_remote_step
from tasks.ship import (REMOTE_SRC, STALE_MIN, SUMS, code_hash, is_shipped, package_files, ship_code,
                        ship_code_task, sums_text)
from tests.remote_steps import package_with_probes, probe_src  # noqa: F401 (probe_src is a fixture)


def test_code_hash_follows_paths_and_contents_not_caches(tmp_path):
    pkg = package_with_probes(tmp_path / "a")
    h = code_hash(pkg)
    assert len(h) == 64 and code_hash(REMOTE_SRC) != h  # the probes are part of the hash
    (pkg / "__pycache__").mkdir(exist_ok=True)
    (pkg / "__pycache__" / "step.cpython-311.pyc").write_bytes(b"cache")
    (pkg / "stray.pyc").write_bytes(b"cache")
    assert code_hash(pkg) == h
    (pkg / "probe.py").rename(pkg / "probe2.py")
    renamed = code_hash(pkg)
    assert renamed != h
    (pkg / "probe2.py").write_text((pkg / "probe2.py").read_text() + "\n")
    assert code_hash(pkg) not in (h, renamed)
    (pkg / "__init__.py").unlink()
    with pytest.raises(BadInputError, match="no __init__.py"):
        code_hash(pkg)


def test_ship_to_a_missing_folder_then_again_sends_nothing(each_host, probe_src):
    host = each_host
    assert not host.exists(host.path("code"))
    first = ship_code(host, probe_src)
    assert first.sha == code_hash(probe_src) and first.path == host.path("code", first.sha)
    assert first.root == host.root
    assert first.files == len(package_files(probe_src)) and first.bytes_sent > 0
    # The package imports from there: the probe step starts and refuses a missing config (exit 65).
    r = host.run([host.python, "-m", "remote.probe", "--config", "missing.json"], cwd=first.path,
                 env={"PYTHONPATH": first.path})
    assert r.exit_code == 65 and "does not exist" in r.stderr_tail[0]
    assert host.run(["ls", "-A", host.path("code")]).stdout_tail == [first.sha]  # no staging left over

    sent = host.bytes_sent
    second = ship_code(host, probe_src)
    assert (second.path, second.bytes_sent, host.bytes_sent) == (first.path, 0, sent)
    assert second.seconds < 1.0, f"checking unchanged code took {second.seconds:.2f} s"


def test_a_changed_file_ships_again(each_host, tmp_path):
    pkg = package_with_probes(tmp_path / "pkg")
    before = ship_code(each_host, pkg)
    (pkg / "probe.py").write_text((pkg / "probe.py").read_text() + "# changed\n")
    after = ship_code(each_host, pkg)
    assert after.sha != before.sha and after.bytes_sent > 0
    assert each_host.read_text(posixpath.join(after.path, "remote", "probe.py")).endswith("# changed\n")


def test_a_corrupted_copy_is_detected_and_replaced(each_host, probe_src):
    host = each_host
    code = ship_code(host, probe_src)
    sums = sums_text(package_files(probe_src))
    victim = posixpath.join(code.path, "remote", "step.py")
    good = host.read_text(victim)
    host.write_text(victim, good.replace("EXIT_BAD_INPUT = 65", "EXIT_BAD_INPUT = 66"))
    assert not is_shipped(host, code.path, sums)
    repaired = ship_code(host, probe_src)
    assert repaired.bytes_sent > 0 and host.read_text(victim) == good and is_shipped(host, code.path, sums)
    # A SHA256SUMS edited to match a tampered file is caught too: the folder name is its hash.
    host.write_text(posixpath.join(code.path, SUMS), sums.replace(sums[:64], "0" * 64, 1))
    assert not is_shipped(host, code.path, sums)
    assert ship_code(host, probe_src).bytes_sent > 0 and is_shipped(host, code.path, sums)


@pytest.mark.ssh
def test_ship_and_run_a_step_as_a_zsh_user_in_a_root_with_a_space(sshd, zsh_user, probe_src):
    from tasks.host import open_host

    with open_host(sshd.params(user=zsh_user.name, root=zsh_user.root, python="/usr/bin/python3")) as h:
        code = ship_code(h, probe_src)
        assert " " in code.path and code.bytes_sent > 0
        run_dir = h.path("runs", "r 1")
        manifest = run_remote_step(h, code, "probe", {"out_dir": posixpath.join(run_dir, "probe")},
                                   run_dir=run_dir, timeout=60)
        assert manifest["counts"] == {"lines": 3} and manifest["code_hash"] == code.sha
        assert ship_code(h, probe_src).bytes_sent == 0


@pytest.mark.ssh
def test_ship_to_the_second_host(netns_sshd, probe_src):
    from tasks.host import open_host

    with open_host(netns_sshd.params(root=str(netns_sshd.dir / "root"))) as h:
        assert ship_code(h, probe_src).bytes_sent > 0
        assert ship_code(h, probe_src).bytes_sent == 0


@pytest.mark.ssh
def test_ship_code_task_opens_the_host_from_its_settings(prefect_harness, sshd, probe_src):
    from prefect import flow

    params = sshd.params(root=str(sshd.dir.parent / "task-root"))

    @flow
    def ship_twice():
        return ship_code_task(params, probe_src), ship_code_task(params, probe_src)

    first, second = ship_twice()
    assert first.bytes_sent > 0 and second.bytes_sent == 0 and first.path == second.path


def _ship_dropped_mid_upload(server, host, tmp_path: Path, stop: bool) -> Path:
    """Ship a big package and, once its tarball is part-way up, drop the connection (the sshd's
    sessions) or stop the sshd too; the ship must fail as unreachable. Returns the code folder."""
    code_dir = Path(host.path("code"))
    host.makedirs(str(code_dir))
    pkg = package_with_probes(tmp_path / "pkg")
    (pkg / "blob.bin").write_bytes(os.urandom(32 << 20))  # incompressible: the upload takes a while

    def drop():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if any(p.stat().st_size > 1 << 20 for p in code_dir.glob(".*.tar.gz")):
                server.stop() if stop else server.drop_sessions()
                return
            time.sleep(0.005)

    saboteur = threading.Thread(target=drop, daemon=True)
    saboteur.start()
    with pytest.raises(HostUnreachable):
        ship_code(host, pkg)
    saboteur.join(10)
    return code_dir


@pytest.mark.ssh
def test_a_transfer_dropped_half_way_leaves_nothing_on_the_host(own_sshd, tmp_path):
    from tasks.host import open_host

    with open_host(own_sshd.params(root=str(own_sshd.dir / "root"))) as h:
        code_dir = _ship_dropped_mid_upload(own_sshd, h, tmp_path, stop=False)
        assert os.listdir(code_dir) == []  # the part-uploaded tarball went at once


@pytest.mark.ssh
def test_leftovers_the_controller_could_not_remove_go_with_the_next_upload(own_sshd, tmp_path, probe_src):
    from tasks.host import open_host

    with open_host(own_sshd.params(root=str(own_sshd.dir / "root"))) as h:
        code_dir = _ship_dropped_mid_upload(own_sshd, h, tmp_path, stop=True)
        own_sshd.start()
        leftover = list(code_dir.iterdir())
        assert [p.suffix for p in leftover] == [".gz"]  # the host was down: nothing could remove it
        recent = ship_code(h, probe_src)
        assert leftover[0].exists(), "a fresh leftover may be a live upload: kept"
        stale = time.time() - (STALE_MIN + 1) * 60
        os.utime(leftover[0], (stale, stale))
        h.run(["rm", "-rf", "--", recent.path])  # so the next ship uploads (and sweeps)
        ship_code(h, probe_src)
        assert os.listdir(code_dir) == [recent.sha]
