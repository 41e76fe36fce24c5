"""A remote step for tests that never ends by itself: it starts a Python child that ignores SIGTERM
(as a stubborn engine process would) and that child starts a grandchild; all three sleep.

    python -m remote.hang_step --config hang.config.json     # {"out_dir": ..., "pid_file": ...}

Once all three run it writes "<step pid> <child pid> <grandchild pid>" to pid_file.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from remote.step import load_config, log, step_main


@dataclass(frozen=True)
class HangConfig:
    out_dir: str  # never written: the step does not finish
    pid_file: str  # where the three pids go once they all run


def run(raw: dict) -> None:
    cfg = load_config(HangConfig, raw)
    child = subprocess.Popen([sys.executable, "-m", "remote.hang_step", "--child", cfg.pid_file])
    log(f"hang_step: started child {child.pid}")
    time.sleep(3600)


def child(pid_file: str) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only SIGKILL ends this one
    grandchild = subprocess.Popen(["sleep", "3600"])
    tmp = f"{pid_file}.tmp"
    with open(tmp, "w") as f:
        f.write(f"{os.getppid()} {os.getpid()} {grandchild.pid}\n")
    os.replace(tmp, pid_file)
    time.sleep(3600)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2])
    else:
        sys.exit(step_main("hang_step", run))
