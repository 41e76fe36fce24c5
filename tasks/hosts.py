"""The machine the remote steps run on: the local one, or a GPU host over SSH (Fabric).

One interface, two kinds, so a flow never asks which it has:

    with open_host(HostParams(kind="ssh", hostname="gpu1", user="me", root="/data/eaglet")) as host:
        host.makedirs(host.root)
        result = host.run([host.python, "-m", "remote.prepare", "--config", cfg], timeout=600,
                          on_line=lambda stream, line: print(stream, line))

`run` never raises on a non-zero exit (the caller decides what the code means); it raises
`HostUnreachable` when the connection fails and `CommandTimedOut` after it has ended the command's
whole process tree. Host keys are checked against known_hosts; an unknown key is refused unless
`trust_unknown_host_key`, a changed key always.
"""
from __future__ import annotations

import base64
import codecs
import errno
import hashlib
import io
import logging
import os
import posixpath
import re
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Literal, Mapping, Optional, Sequence

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tasks.errors import (BadInputError, CommandTimedOut, EagletError, HostKeyRefused, HostUnreachable,
                          LoginRefused, RemoteFault)

log = logging.getLogger("eaglet.hosts")

OnLine = Callable[[str, str], None]  # (stream name "stdout" | "stderr", the line without its newline)
KILL_GRACE_S = 5  # after the timeout's SIGTERM, this long until SIGKILL
TAIL_LINES = 40  # lines of each stream kept in a CommandResult
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


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
        bad = [k for k in env if not _ENV_NAME.match(k)]
        if bad:
            raise ValueError(f"env names must be shell identifiers; bad: {bad}")
        return env

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


class _Lines:
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


def _finish(out: _Lines, err: _Lines, exit_code: int, started: float) -> CommandResult:
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

    def check(self, argv: Sequence[str], what: str, **kw) -> CommandResult:
        """run() that raises RemoteFault (with the stderr tail) unless the command exits 0."""
        r = self.run(argv, **kw)
        if r.exit_code != 0:
            raise RemoteFault(f"{self.name}: {what} failed (exit {r.exit_code}): " + "\n".join(r.stderr_tail[-10:]))
        return r

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
        argv = _argv(argv)
        out, err = _Lines("stdout", on_line), _Lines("stderr", on_line)
        started = time.monotonic()
        try:
            proc = subprocess.Popen(argv, cwd=cwd, env={**os.environ, **self.params.env, **(env or {})},
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    start_new_session=True)
        except OSError as e:  # no such program or folder: report it as the shell would (127)
            err.write(f"{argv[0]}: {e}\n")
            return _finish(out, err, 127, started)
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
            _finish(out, err, proc.returncode, started)
            raise CommandTimedOut(f"{self.name}: {argv[0]} ran past {timeout} s; its process group was ended")
        for t in readers:
            t.join()
        return _finish(out, err, code, started)

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


def _pump(pipe, sink: _Lines) -> None:
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


def _argv(argv: Sequence[str]) -> list[str]:
    if isinstance(argv, (str, bytes)) or not argv:
        raise ValueError(f"argv must be a non-empty list of words, not {argv!r}")
    return [os.fspath(a) if isinstance(a, os.PathLike) else str(a) for a in argv]


# ----------------------------------------------------------------------------- ssh
def remote_command(argv: Sequence[str], cwd: str | None = None, env: Mapping[str, str] | None = None,
                   timeout: float | None = None) -> str:
    """One line any POSIX-ish login shell (bash, zsh, dash) runs as `argv`, word for word.

    `cd -- DIR && env K=V ... timeout -k 5 N prog args...`: every word shlex-quoted, so nothing in an
    argument is ever expanded; coreutils `timeout` ends the command's process group on the host.
    """
    words: list[str] = []
    if env:
        bad = [k for k in env if not _ENV_NAME.match(k)]
        if bad:
            raise ValueError(f"env names must be shell identifiers; bad: {bad}")
        words += ["env", *(f"{k}={v}" for k, v in env.items())]
    if timeout is not None:
        words += ["timeout", "-k", str(KILL_GRACE_S), f"{max(timeout, 0.001):.3f}"]
    words += _argv(argv)
    line = " ".join(shlex.quote(w) for w in words)
    return f"cd -- {shlex.quote(cwd)} && {line}" if cwd else line


def fingerprint(key) -> str:
    """OpenSSH's form: 'ssh-ed25519 SHA256:...'."""
    digest = base64.b64encode(hashlib.sha256(key.asbytes()).digest()).decode().rstrip("=")
    return f"{key.get_name()} SHA256:{digest}"


class SSHHost(Host):
    """A host over SSH (Fabric). Connects on first use and again after a drop; one SFTP session."""

    def __init__(self, params: HostParams):
        import fabric
        import paramiko

        super().__init__(params)
        self.name = params.name or (params.hostname if params.port == 22 else f"{params.hostname}:{params.port}")
        self.python = params.python or "python3"
        self.known_hosts = os.path.expanduser(params.known_hosts or "~/.ssh/known_hosts")
        # An explicit, empty SSH config: every setting comes from HostParams, none from ~/.ssh/config.
        config = fabric.Config(ssh_config=paramiko.SSHConfig())
        self._conn = fabric.Connection(params.hostname, user=params.user, port=params.port, config=config)
        self._lock = threading.RLock()
        self._sftp = None
        self._sftp_transport = None
        self._root: str | None = None
        self._pkey = None

    # -- connection ------------------------------------------------------------------
    @property
    def root(self) -> str:
        """The absolute working root ('~' and relative roots are resolved against the login folder)."""
        if self._root is None:
            root = self.params.root or "~/eaglet"
            if not root.startswith("/"):
                home = self._sftp_client().normalize(".")
                root = posixpath.join(home, root[2:] if root.startswith("~/") else root.lstrip("~"))
            self._root = posixpath.normpath(root)
        return self._root

    def connect(self) -> None:
        """Open the connection now (else the first command does); raises the errors that says why."""
        with self._faults("connect"):
            self._connected()

    def _connected(self):
        with self._lock:  # one connect at a time, even when tasks share this host from threads
            if not self._conn.is_connected:
                self._open()
            return self._conn

    def _open(self) -> None:
        import paramiko

        client = self._conn.client
        client.get_host_keys().clear()
        if os.path.exists(self.known_hosts):
            client.load_host_keys(self.known_hosts)
        client.set_missing_host_key_policy(
            _RecordUnknownKey(self) if self.params.trust_unknown_host_key else _RefuseUnknownKey(self))
        t = self.params.connect_timeout
        kwargs = {"timeout": t, "banner_timeout": t, "auth_timeout": t}
        if self.params.key_filename:
            kwargs["key_filename"] = os.path.expanduser(self.params.key_filename)
        if self.params.key_secret:
            kwargs["pkey"] = self._secret_key()
        self._conn.connect_kwargs = kwargs
        try:
            self._conn.open()
        except paramiko.BadHostKeyException as e:
            raise HostKeyRefused(self._changed_key_message(e.key, e.expected_key)) from None

    def _secret_key(self):
        """The private key from the Secret block named in key_secret (read once, never logged)."""
        if self._pkey is None:
            text = _secret(self.params.key_secret)
            passphrase = _secret(self.params.passphrase_secret) if self.params.passphrase_secret else None
            self._pkey = _parse_private_key(text, passphrase, self.params.key_secret)
        return self._pkey

    def _sftp_client(self):
        """The SFTP session of the current connection (a new one after a reconnect)."""
        with self._faults("open sftp"), self._lock:
            conn = self._connected()
            if self._sftp is None or self._sftp_transport is not conn.transport:
                self._sftp = conn.client.open_sftp()
                self._sftp_transport = conn.transport
            return self._sftp

    @contextmanager
    def _faults(self, what: str):
        """Turn paramiko's and the socket's failures into HostUnreachable / LoginRefused."""
        import paramiko

        try:
            yield
        except EagletError:
            raise
        except paramiko.AuthenticationException as e:
            raise LoginRefused(f"{self.name}: login as {self._conn.user!r} refused ({e}); check user and key") from e
        except (paramiko.SSHException, EOFError, ConnectionError, TimeoutError, socket.gaierror) as e:
            raise HostUnreachable(f"{self.name}: {what}: {type(e).__name__}: {e}") from e
        except OSError as e:
            if e.errno is None or e.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EPIPE):
                raise HostUnreachable(f"{self.name}: {what}: {e}") from e  # "Socket is closed" and kin
            raise

    def _refused_unknown_message(self, hostname: str, key) -> str:
        p = self.params
        return (f"host key of {hostname} (port {p.port}) is unknown: it offers {fingerprint(key)}, "
                f"which is not in {self.known_hosts}. Check that fingerprint with the host's owner "
                "(`ssh-keygen -lf /etc/ssh/ssh_host_*_key.pub` there), "
                f"then trust it: `ssh-keyscan -p {p.port} {p.hostname} >> {self.known_hosts}`, "
                "or run once with trust_unknown_host_key=true (the key is then recorded).")

    def _changed_key_message(self, got, expected) -> str:
        p = self.params
        entry = p.hostname if p.port == 22 else f"[{p.hostname}]:{p.port}"
        return (f"host key of {p.hostname} (port {p.port}) CHANGED: it offers {fingerprint(got)}, but "
                f"{self.known_hosts} holds {fingerprint(expected)}. The host may have been reinstalled, or "
                "someone is in the middle. If you know why it changed, remove the old key with "
                f"`ssh-keygen -R '{entry}' -f {self.known_hosts}` and trust the new one. Refused.")

    # -- commands ----------------------------------------------------------------------
    def run(self, argv, *, cwd=None, env=None, timeout=None, on_line=None) -> CommandResult:
        import invoke

        command = remote_command(argv, cwd, {**self.params.env, **(env or {})}, timeout)
        out, err = _Lines("stdout", on_line), _Lines("stderr", on_line)
        # Fabric's own timeout is only a backstop for a hung connection: `timeout` on the host acts first.
        backstop = None if timeout is None else timeout + KILL_GRACE_S + self.params.connect_timeout
        started = time.monotonic()
        with self._faults(f"run {argv[0]}"):
            conn = self._connected()
            try:
                r = conn.run(command, hide=False, warn=True, pty=False, in_stream=False, encoding="utf-8",
                             out_stream=out, err_stream=err, timeout=backstop)
                code = r.exited
            except invoke.CommandTimedOut:
                code = None
        elapsed = time.monotonic() - started
        result = _finish(out, err, -1 if code is None else code, started)
        if code == -1 and not conn.is_connected:
            raise HostUnreachable(f"{self.name}: the connection dropped while {argv[0]} ran")
        if timeout is not None and (code is None or (code in (124, 137, -1) and elapsed >= timeout)):
            raise CommandTimedOut(f"{self.name}: {argv[0]} ran past {timeout} s; `timeout` ended its process group")
        return result

    def makedirs(self, path: str) -> None:
        # Over SFTP, not `mkdir -p`: a stat and a mkdir a level cost milliseconds, a shell far more.
        missing = []
        with self._sftp_op(f"mkdir {path}") as sftp:
            p = posixpath.normpath(path)
            while p not in ("/", "", "."):
                try:
                    if not stat.S_ISDIR(sftp.stat(p).st_mode):
                        raise BadInputError(f"{self.name}: cannot create folder {path}: {p} is a file")
                    break
                except FileNotFoundError:
                    missing.append(p)
                    p = posixpath.dirname(p)
            for d in reversed(missing):
                try:
                    sftp.mkdir(d)
                except OSError as e:
                    if e.errno is None:
                        raise
                    if not self._is_dir(sftp, d):  # someone else may have made it meanwhile
                        raise BadInputError(f"{self.name}: cannot create folder {d}: {e}") from e

    @staticmethod
    def _is_dir(sftp, path: str) -> bool:
        try:
            return stat.S_ISDIR(sftp.stat(path).st_mode)
        except FileNotFoundError:
            return False

    # -- files -------------------------------------------------------------------------
    @contextmanager
    def _sftp_op(self, what: str):
        with self._lock, self._faults(what):
            yield self._sftp_client()

    def put(self, local_path, remote_path) -> int:
        with self._sftp_op(f"put {remote_path}") as sftp:
            n = sftp.put(os.fspath(local_path), remote_path).st_size
        self.bytes_sent += n
        return n

    def get(self, remote_path, local_path) -> int:
        with self._sftp_op(f"get {remote_path}") as sftp:
            sftp.get(remote_path, os.fspath(local_path))
        n = os.path.getsize(local_path)
        self.bytes_received += n
        return n

    def read_text(self, path: str) -> str:
        with self._sftp_op(f"read {path}") as sftp, sftp.open(path, "rb") as f:
            data = f.read()
        self.bytes_received += len(data)
        return data.decode()

    def write_text(self, path: str, text: str) -> None:
        data = text.encode()
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        with self._sftp_op(f"write {path}") as sftp:
            with sftp.open(tmp, "wb") as f:
                f.write(data)
            sftp.posix_rename(tmp, path)
        self.bytes_sent += len(data)

    def exists(self, path: str) -> bool:
        with self._sftp_op(f"stat {path}") as sftp:
            try:
                sftp.stat(path)
                return True
            except FileNotFoundError:
                return False

    def _walk(self, path: str):
        with self._sftp_op(f"list {path}") as sftp:
            entries = sftp.listdir_attr(path)
        dirs = sorted(e.filename for e in entries if stat.S_ISDIR(e.st_mode))
        files = sorted(e.filename for e in entries if not stat.S_ISDIR(e.st_mode))
        yield path, dirs, files
        for d in dirs:
            yield from self._walk(posixpath.join(path, d))

    def close(self) -> None:
        with self._lock:
            if self._sftp is not None:
                self._sftp.close()
                self._sftp = None
            self._conn.close()


def _host_key_policies():
    import paramiko

    class RefuseUnknownKey(paramiko.MissingHostKeyPolicy):
        """The default: a key not in known_hosts is refused, with the fingerprint and how to trust it."""

        def __init__(self, host: SSHHost):
            self.host = host

        def missing_host_key(self, client, hostname, key):
            raise HostKeyRefused(self.host._refused_unknown_message(hostname, key))

    class RecordUnknownKey(RefuseUnknownKey):
        """trust_unknown_host_key: accept a key never seen before and append it to known_hosts."""

        def missing_host_key(self, client, hostname, key):
            client.get_host_keys().add(hostname, key.get_name(), key)
            path = self.host.known_hosts
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            with open(path, "a") as f:
                f.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")
            log.warning("trusted the unknown host key of %s (%s) and recorded it in %s", hostname, fingerprint(key), path)

    return RefuseUnknownKey, RecordUnknownKey


_RefuseUnknownKey, _RecordUnknownKey = _host_key_policies()


def _secret(block_name: str) -> str:
    from prefect.blocks.system import Secret

    try:
        return str(Secret.load(block_name).get())
    except ValueError as e:
        raise BadInputError(f"no Secret block named {block_name!r}: {e}") from e


def _parse_private_key(text: str, passphrase: str | None, where: str):
    import paramiko

    for cls in (paramiko.Ed25519Key, paramiko.ECDSAKey, paramiko.RSAKey):
        try:
            return cls.from_private_key(io.StringIO(text), password=passphrase)
        except paramiko.PasswordRequiredException:
            raise LoginRefused(f"the key in Secret block {where!r} is encrypted: name its passphrase in passphrase_secret") from None
        except (paramiko.SSHException, ValueError):
            continue
    raise BadInputError(f"Secret block {where!r} holds no private key that can be read (OpenSSH ed25519, ECDSA or RSA)"
                        + (" with that passphrase" if passphrase else ""))


def open_host(params: HostParams) -> Host:
    """The host these settings describe (an SSH one connects on first use)."""
    return SSHHost(params) if params.kind == "ssh" else LocalHost(params)
