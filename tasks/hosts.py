"""The machine the remote steps run on: the local one, or a GPU host over SSH (Fabric).

One interface, two kinds, so a flow never asks which it has:

    with open_host(HostParams(kind="ssh", hostname="gpu1", user="me", root="/data/eaglet")) as host:
        host.makedirs(host.root)
        result = host.run([host.python, "-m", "remote.data.prepare", "--config", cfg], timeout=600,
                          on_line=lambda stream, line: print(stream, line))

`run` never raises on a non-zero exit (the caller decides what the code means); it raises
`HostUnreachable` when the connection fails and `CommandTimedOut` after it has ended the command's
whole process tree. This module holds the settings, the interface and LocalHost; the SSH kind
(host keys, secrets, quoting) is in tasks/ssh_host.py.
"""
from __future__ import annotations

import codecs
import errno
import os
import posixpath
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Literal, Mapping, Optional, Sequence

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tasks.errors import BadInputError, CommandTimedOut

OnLine = Callable[[str, str], None]  # (stream name "stdout" | "stderr", the line without its newline)
KILL_GRACE_S = 5  # after the timeout's SIGTERM, this long until SIGKILL
TAIL_LINES = 40  # lines of each stream kept in a CommandResult
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def check_env_names(env: Mapping[str, str]) -> Mapping[str, str]:
    """Refuse names a shell or `env` would misread (`A=B`, spaces): they must be identifiers."""
    bad = [k for k in env if not ENV_NAME.match(k)]
    if bad:
        raise ValueError(f"env names must be shell identifiers; bad: {bad}")
    return env


class HostParams(BaseModel):
    """Where and how to reach a host; flow parameters or a saved block. Holds no secret itself."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["local", "ssh"] = Field("local", description="local: subprocesses here; ssh: a host reached over SSH")
    name: Optional[str] = Field(None, description="name in logs; none: 'local' or the hostname")
    hostname: str = Field("127.0.0.1", description="address of the SSH host")
    port: int = Field(22, ge=1, le=65535, description="SSH port")
    user: Optional[str] = Field(None, description="login user; none: the controller's user")
    root: Optional[str] = Field(None, description="working root on the host; none: ./work (local) or ~/eaglet (ssh)")
    python: Optional[str] = Field(None, description="the host's interpreter; none: this one (local) or python3 (ssh)")
    known_hosts: Optional[str] = Field(None, description="known_hosts file checked; none: ~/.ssh/known_hosts")
    trust_unknown_host_key: bool = Field(False, description="accept an unknown host key once and record it (a changed key is always refused)")
    key_filename: Optional[str] = Field(None, description="private key file on the controller")
    key_secret: Optional[str] = Field(None, description="name of a Prefect Secret block holding the private key text")
    passphrase_secret: Optional[str] = Field(None, description="name of a Prefect Secret block holding the key's passphrase")
    connect_timeout: float = Field(10.0, gt=0, description="seconds to wait for the TCP connect, banner and login")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment of every remote command")

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        return check_env_names(env)

    @classmethod
    def from_block(cls, name: str) -> "HostParams":
        """The settings saved in an `eaglet-host` block (see `save_block`)."""
        try:
            return HostBlock.load(name).host
        except ValueError as e:
            raise BadInputError(f"no eaglet-host block named {name!r}: {e}") from e

    def save_block(self, name: str, overwrite: bool = True) -> None:
        HostBlock(host=self).save(name, overwrite=overwrite)


def _block_class():
    from prefect.blocks.core import Block

    class HostBlock(Block):
        """Saved host settings for eaglet. Keys and passphrases stay in Secret blocks named here."""

        _block_type_name = "eaglet host"
        host: HostParams

    return HostBlock


HostBlock = _block_class()


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

    name: str
    root: str
    python: str

    def __init__(self, params: HostParams):
        self.params = params
        self.bytes_sent = 0  # payload bytes put on the host (files, text), not protocol overhead
        self.bytes_received = 0  # payload bytes read back from the host

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


# ----------------------------------------------------------------------------- local
class LocalHost(Host):
    """This machine: each command a subprocess in its own session, so a timeout ends its whole tree."""

    def __init__(self, params: HostParams):
        super().__init__(params)
        self.name = params.name or "local"
        self.root = os.path.abspath(os.path.expanduser(params.root or "work"))
        self.python = params.python or sys.executable

    def run(self, argv, *, cwd=None, env=None, timeout=None, on_line=None) -> CommandResult:
        argv = argv_words(argv)
        out, err = LineSplitter("stdout", on_line), LineSplitter("stderr", on_line)
        started = time.monotonic()
        try:
            # stdin: a pipe this process holds open and never writes, as an SSH channel is; when the
            # controller dies (or run unwinds) it reads end of file, and remote.guard ends the step.
            proc = subprocess.Popen(argv, cwd=cwd, env={**os.environ, **self.params.env, **(env or {})},
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    start_new_session=True)
        except OSError as e:  # no such program or folder: report it as the shell would (127)
            err.write(f"{argv[0]}: {e}\n")
            return command_result(out, err, 127, started)
        readers = [threading.Thread(target=_pump, args=(pipe, sink), daemon=True)
                   for pipe, sink in ((proc.stdout, out), (proc.stderr, err))]
        for t in readers:
            t.start()
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            _end_group(proc)
            for t in readers:
                t.join()
            command_result(out, err, proc.returncode, started)  # deliver the last partial line, raise a callback's error
            raise CommandTimedOut(f"{self.name}: {argv[0]} ran past {timeout} s; its process group was ended")
        finally:
            proc.stdin.close()
        for t in readers:
            t.join()
        return command_result(out, err, code, started)

    def put(self, local_path, remote_path) -> int:
        shutil.copyfile(local_path, remote_path)
        n = os.path.getsize(remote_path)
        self.bytes_sent += n
        return n

    def get(self, remote_path, local_path) -> int:
        shutil.copyfile(remote_path, local_path)
        n = os.path.getsize(local_path)
        self.bytes_received += n
        return n

    def read_text(self, path: str) -> str:
        data = Path(path).read_bytes()
        self.bytes_received += len(data)
        return data.decode()

    def write_text(self, path: str, text: str) -> None:
        data = text.encode()
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        Path(tmp).write_bytes(data)
        os.replace(tmp, path)
        self.bytes_sent += len(data)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def makedirs(self, path: str) -> None:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            raise BadInputError(f"{self.name}: cannot create folder {path}: {e}") from e

    def _walk(self, path: str):
        if not os.path.isdir(path):
            raise FileNotFoundError(errno.ENOENT, "no such folder", path)
        return os.walk(path)


def _pump(pipe, sink: LineSplitter) -> None:
    """Copy a pipe into a line sink as bytes arrive (read1 returns what is there, not a full block)."""
    decode = codecs.getincrementaldecoder("utf-8")(errors="replace").decode
    with pipe:
        while chunk := pipe.read1(1 << 16):
            sink.write(decode(chunk))
    sink.write(decode(b"", final=True))


def _end_group(proc: subprocess.Popen) -> None:
    """SIGTERM the command's process group, then SIGKILL what is left of it after KILL_GRACE_S."""
    _killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    _killpg(proc.pid, signal.SIGKILL)  # children that ignored SIGTERM, or outlived their parent
    proc.wait()


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def argv_words(argv: Sequence[str]) -> list[str]:
    if isinstance(argv, (str, bytes)) or not argv:
        raise ValueError(f"argv must be a non-empty list of words, not {argv!r}")
    return [os.fspath(a) if isinstance(a, os.PathLike) else str(a) for a in argv]


def open_host(params: HostParams) -> Host:
    """The host these settings describe (an SSH one connects on first use)."""
    if params.kind == "ssh":
        from tasks.ssh_host import SSHHost  # Fabric and paramiko load only when a host needs them

        return SSHHost(params)
    return LocalHost(params)
