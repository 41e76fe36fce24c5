"""Run a command on the host that ends when the controller goes away.

    python -m remote.guard python -m remote.capture.capture --config capture.config.json

Without it, a step outlives its controller: when the controller process is killed or its Prefect
task cancelled, the SSH channel closes, but a command without a terminal gets no signal for that,
and a step that prints nothing (or one whose engine runs in child processes) keeps the GPUs busy.

The guard runs the command as its child and waits. The controller holds
the guard's stdin open (an SSH channel, or LocalHost's pipe) and never writes to it: end of file
there means the session is gone. On that, or on SIGHUP, SIGTERM or SIGINT, the guard sends SIGTERM
to every other process of its group (the command and whatever it started: vLLM's engine core, its
workers), gives them GRACE_S seconds to end, then SIGKILLs what is left of the group. Processes that
the command leaves behind when it ends by itself (a crashed step's engine) are ended the same way. It
exits with the command's status (a command ended by a signal ends the guard by the same signal),
so exit codes mean what docs/CONVENTIONS.md says, with or without the guard in between.

A lost network or a crashed controller machine closes nothing on the host: TCP may take many minutes
to give up. So a controller that sets EAGLET_HEARTBEAT_S (SSHHost does, and sends a byte down
the channel that often) is taken for lost once stdin stays silent for LOST_AFTER_BEATS heartbeats,
and the step is ended as above: within LOST_AFTER_BEATS x EAGLET_HEARTBEAT_S + GRACE_S + 1 s of the
last heartbeat that arrived (34 s for SSHHost's 10 s).

The guard leads a process group of its own (LocalHost starts it so; elsewhere it makes one), so it
never signals a process it did not start. `timeout -k 5` (SSH) and LocalHost's timeout signal the
guard itself; it passes that on, and its grace (4 s) ends before theirs. Linux only (it reads /proc).
"""
from __future__ import annotations

import os
import select
import signal
import stat
import subprocess
import sys
import threading
import time

GRACE_S = 4.0  # after SIGTERM, seconds until the group's survivors get SIGKILL: under the 5 s the guard gets
ENDING_SIGNALS = (signal.SIGHUP, signal.SIGTERM, signal.SIGINT)
HEARTBEAT_ENV = "EAGLET_HEARTBEAT_S"  # set by a controller that writes a byte to stdin this often (seconds)
LOST_AFTER_BEATS = 3  # heartbeats missed in a row before the controller counts as lost


def group_members(pgid: int) -> list[int]:
    """Pids of the running processes in process group pgid, this one left out."""
    members = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:  # fields after "(comm)": state ppid pgrp ...; comm itself may hold spaces and parentheses
            fields = open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # it ended while we looked
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(d))
    return members


def signal_group(sig: int) -> None:
    for pid in group_members(os.getpgrp()):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _watches_stdin() -> bool:
    """Only a pipe or a socket on stdin is the controller's line; a file or /dev/null is not."""
    try:
        mode = os.fstat(0).st_mode
    except OSError:
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)


def _watch_controller(ending: threading.Event, wake: threading.Event, lost_after_s: float | None) -> None:
    """Set `ending` at end of file on stdin or, when heartbeats are due, after lost_after_s without one."""
    try:
        while select.select([0], [], [], lost_after_s)[0] and os.read(0, 1 << 12):
            pass  # a heartbeat (the controller writes nothing else; anything that comes is ignored)
    except OSError:
        pass
    ending.set()
    wake.set()


def run(argv: list[str], grace_s: float = GRACE_S, lost_after_s: float | None = None) -> int:
    """Run argv until it ends, or end it when the session does (or goes silent for lost_after_s when
    given); returns its exit status."""
    wake = threading.Event()
    ending = threading.Event()

    def on_signal(signum, frame) -> None:
        ending.set()
        wake.set()

    if os.getpgrp() != os.getpid():
        os.setpgid(0, 0)  # a group of our own: whatever else shared the old one is not ours to end
    for sig in ENDING_SIGNALS:  # before the child starts: a signal in between would be lost
        signal.signal(sig, on_signal)
    child = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
    threading.Thread(target=lambda: (child.wait(), wake.set()), daemon=True).start()
    if _watches_stdin():
        threading.Thread(target=_watch_controller, args=(ending, wake, lost_after_s), daemon=True).start()
    while not wake.wait(1.0):  # a timeout, so signal handlers run promptly on every Python
        pass
    # Ending, or the command ended and left processes behind (an engine whose parent crashed): end them all.
    if ending.is_set() or group_members(os.getpgrp()):
        signal_group(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while (child.poll() is None or group_members(os.getpgrp())) and time.monotonic() < deadline:
            time.sleep(0.1)
        signal_group(signal.SIGKILL)
    return child.wait()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: python -m remote.guard PROGRAM [ARG...]", file=sys.stderr)
        return 64  # EX_USAGE
    heartbeat = os.environ.pop(HEARTBEAT_ENV, None)  # the guard's own setting: the command does not inherit it
    code = run(argv, lost_after_s=LOST_AFTER_BEATS * float(heartbeat) if heartbeat else None)
    if code < 0:  # end the way the command ended, so the caller sees the same signal
        sys.stdout.flush()
        if -code != signal.SIGKILL:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


if __name__ == "__main__":
    sys.exit(main())
