"""The interface every kind of host offers, and what a command returns.

`run` never raises on a non-zero exit (the caller decides what the code means); it raises
`HostUnreachable` when the connection fails and `CommandTimedOut` after it has ended the command's
whole process tree.
"""
from __future__ import annotations

import os
import posixpath
import time
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence

from tasks.host.params import HostParams

OnLine = Callable[[str, str], None]  # (stream name "stdout" | "stderr", the line without its newline)
KILL_GRACE_S = 5  # after the timeout's SIGTERM, this long until SIGKILL
TAIL_LINES = 40  # lines of each stream kept in a CommandResult


@dataclass(frozen=True)
class CommandResult:
    exit_code: int  # the program's exit status; negative (or -1 over SSH) when a signal ended it
    stdout_tail: list[str]  # the last TAIL_LINES lines of stdout
    stderr_tail: list[str]  # the last TAIL_LINES lines of stderr
    seconds: float  # wall time of the command, as seen by the controller


class LineSplitter:
    """A text stream cut into lines: each goes to on_line as it arrives; the last few are kept.

    Fabric writes into it from its reader threads, LocalHost from its own. A callback that raises
    is not called again and its error is raised by `run` once the command has ended.
    """

    def __init__(self, stream: str, on_line: OnLine | None):
        self.stream, self.on_line = stream, on_line
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.error: Exception | None = None
        self._partial = ""

    def write(self, text: str) -> None:
        *lines, self._partial = (self._partial + text).split("\n")
        for line in lines:
            self._emit(line.rstrip("\r"))

    def flush(self) -> None:  # a file-like object for Fabric
        pass

    def close(self) -> None:
        if self._partial:
            self._emit(self._partial)
            self._partial = ""

    def _emit(self, line: str) -> None:
        self.tail.append(line)
        if self.on_line is not None and self.error is None:
            try:
                self.on_line(self.stream, line)
            except Exception as e:  # noqa: BLE001 - kept and raised by run() in the caller's thread
                self.error = e


def command_result(out: LineSplitter, err: LineSplitter, exit_code: int, started: float) -> CommandResult:
    out.close()
    err.close()
    for s in (out, err):
        if s.error is not None:
            raise s.error
    return CommandResult(exit_code, list(out.tail), list(err.tail), time.monotonic() - started)


class Host(ABC):
    """A machine that runs commands and holds files under `root`, using `python` for the steps."""

    root: str
    python: str

    def __init__(self, params: HostParams):
        self.params = params
        self.bytes_sent = 0  # payload bytes put on the host (files, text), not protocol overhead
        self.bytes_received = 0  # payload bytes read back from the host

    @property
    def name(self) -> str:
        """The host's name in logs and errors (`HostParams.display_name`)."""
        return self.params.display_name

    @abstractmethod
    def run(self, argv: Sequence[str], *, cwd: str | None = None, env: Mapping[str, str] | None = None,
            timeout: float | None = None, on_line: OnLine | None = None) -> CommandResult:
        """Run argv (no shell on our side; every word quoted on the host's) and wait for its end."""

    @abstractmethod
    def put(self, local_path: str | os.PathLike, remote_path: str) -> int:
        """Copy a local file onto the host (its folder must exist); returns the bytes sent."""

    @abstractmethod
    def get(self, remote_path: str, local_path: str | os.PathLike) -> int:
        """Copy a file from the host; returns the bytes received."""

    @abstractmethod
    def read_text(self, path: str) -> str: ...

    @abstractmethod
    def write_text(self, path: str, text: str) -> None:
        """Write a whole file atomically (temporary name, then rename)."""

    @abstractmethod
    def exists(self, path: str) -> bool: ...

    @abstractmethod
    def makedirs(self, path: str) -> None:
        """`mkdir -p`; a folder that cannot be made (permissions, full disk) is bad input."""

    @abstractmethod
    def _walk(self, path: str) -> Iterator[tuple[str, list[str], list[str]]]:
        """os.walk over a folder on the host: (folder, subfolder names, file names)."""

    def put_dir(self, local_dir: str | os.PathLike, remote_dir: str) -> int:
        """Copy a local folder's tree onto the host (merging into remote_dir); returns bytes sent."""
        local_dir = Path(local_dir)
        dirs = [remote_dir] + [posixpath.join(remote_dir, p.relative_to(local_dir).as_posix())
                               for p in sorted(local_dir.rglob("*")) if p.is_dir()]
        for d in dirs:
            self.makedirs(d)
        return sum(self.put(p, posixpath.join(remote_dir, p.relative_to(local_dir).as_posix()))
                   for p in sorted(local_dir.rglob("*")) if p.is_file())

    def get_dir(self, remote_dir: str, local_dir: str | os.PathLike) -> int:
        """Copy a folder's tree from the host into local_dir; returns bytes received."""
        total = 0
        for folder, _, files in self._walk(remote_dir):
            dest = Path(local_dir) / posixpath.relpath(folder, remote_dir)
            dest.mkdir(parents=True, exist_ok=True)
            total += sum(self.get(posixpath.join(folder, f), dest / f) for f in files)
        return total

    def path(self, *parts: str) -> str:
        """A path under the host's root."""
        return posixpath.join(self.root, *parts)

    def close(self) -> None:
        pass

    def __enter__(self) -> "Host":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} root={self.root!r}>"



def argv_words(argv: Sequence[str]) -> list[str]:
    if isinstance(argv, (str, bytes)) or not argv:
        raise ValueError(f"argv must be a non-empty list of words, not {argv!r}")
    return [os.fspath(a) if isinstance(a, os.PathLike) else str(a) for a in argv]

