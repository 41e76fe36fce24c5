"""Shipping figures: the real remote/ package to a real sshd on loopback, and to the local host.

    cd /work/main && .venv/bin/python -m bench.ship_bench [--repeat 5]

Per host (root over SSH, a non-root zsh user over SSH, local): the first ship (into an empty root), the unchanged re-ship (median of --repeat), and the
ship after one file changed. Exits 1 when an unchanged re-ship sends a byte or takes 1 s or more.
It starts its own sshd (tests/fixtures/sshd.py's start_sshd) as root and stops it at the end.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from tasks.host import HostParams, open_host
from tasks.ship import REMOTE_SRC, ship_code
from tests.fixtures.sshd import ZSH_USER, ensure_user, start_sshd


def measure(host, src: Path, repeat: int) -> list[tuple[str, int, float]]:
    """(case, bytes sent, seconds) for first ship, unchanged re-ship (median) and one changed file."""
    first = ship_code(host, src)
    again = [ship_code(host, src) for _ in range(repeat)]
    (src / "step.py").write_text((src / "step.py").read_text() + "# bench: one changed line\n")
    changed = ship_code(host, src)
    return [("first ship", first.bytes_sent, first.seconds),
            (f"unchanged x{repeat} (median)", max(c.bytes_sent for c in again),
             statistics.median(c.seconds for c in again)),
            ("one file changed", changed.bytes_sent, changed.seconds)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5, help="unchanged re-ships measured")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="eaglet-ship-bench-"))
    src = work / "remote"
    shutil.copytree(REMOTE_SRC, src, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    server = start_sshd(work / "sshd")
    hosts = [("ssh 127.0.0.1 (root)", server.params(root=str(work / "ssh-root"))),
             ("local", HostParams(root=str(work / "local-root")))]
    if os.geteuid() == 0 and shutil.which("useradd") and os.path.exists("/usr/bin/zsh"):
        # A user with a clean zsh: the gap to root's row is what root's shell start-up files cost.
        ensure_user(ZSH_USER)
        work.chmod(0o755)
        (work / "zsh-root").mkdir()
        shutil.chown(work / "zsh-root", ZSH_USER, ZSH_USER)
        hosts.insert(1, (f"ssh 127.0.0.1 ({ZSH_USER})", server.params(user=ZSH_USER, root=str(work / "zsh-root"))))
    rows = []
    try:
        for label, params in hosts:
            shutil.rmtree(src)
            shutil.copytree(REMOTE_SRC, src, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            with open_host(params) as host:
                rows += [(label, *r) for r in measure(host, src, args.repeat)]
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(f"{'host':<26} {'case':<24} {'bytes sent':>10} {'seconds':>8}")
    for host, case, sent, secs in rows:
        print(f"{host:<26} {case:<24} {sent:>10} {secs:>8.3f}")
    bad = [r for r in rows if r[1].startswith("unchanged") and (r[2] != 0 or r[3] >= 1.0)]
    if bad:
        print(f"FAIL: an unchanged re-ship sent bytes or took 1 s or more: {bad}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
