"""The SSH kind of host: Fabric for commands and SFTP for files, host keys checked by default.

    host = open_host(HostParams(kind="ssh", hostname="gpu1", user="me", root="/data/eaglet",
                                key_secret="gpu1-key"))      # see tasks/host/base.py for the interface

Every command crosses as one line of single-quoted words (`remote_command`), so bash, zsh and dash
login shells run it word for word. A key not in known_hosts is refused unless
`trust_unknown_host_key`; a changed key is always refused. Keys and passphrases come from Prefect
Secret blocks at connect time (or a key file, or the SSH agent) and are never logged.
"""
from __future__ import annotations

import base64
import errno
import hashlib
import io
import logging
import os
import posixpath
import re
import socket
import stat
import threading
import time
import uuid
from contextlib import contextmanager
from typing import Mapping, Sequence

import fabric
import invoke
import paramiko

from remote.guard import HEARTBEAT_ENV, LOST_AFTER_BEATS
from tasks.errors import BadInputError, CommandTimedOut, EagletError, HostKeyRefused, HostUnreachable, LoginRefused
from tasks.host.base import KILL_GRACE_S, CommandResult, Host, LineSplitter, argv_words, command_result
from tasks.host.params import HostParams, check_env_names

log = logging.getLogger("eaglet.hosts")
# Words left bare: no shell expands these characters anywhere in a word. shlex.quote also leaves
# `=`, `:`, `@`, `%`, `+` and `,` bare, but zsh expands `=cmd` (and `k==cmd` under magic_equal_subst).
BARE_WORD = re.compile(r"[A-Za-z0-9_./-]+\Z")
HEARTBEAT_S = 10.0  # a byte down every command's stdin this often: the controller is alive (remote.guard)
LOST_AFTER_S = LOST_AFTER_BEATS * HEARTBEAT_S  # silence that ends a step on the host, and our connection


def remote_command(argv: Sequence[str], cwd: str | None = None, env: Mapping[str, str] | None = None,
                   timeout: float | None = None) -> str:
    """One line any POSIX-ish login shell (bash, zsh, dash) runs as `argv`, word for word.

    `cd -- DIR && env K=V ... timeout -k 5 N prog args...`: every word quoted (`shell_word`), so nothing
    in an argument is ever expanded; coreutils `timeout` ends the command's process group on the host.
    """
    words: list[str] = []
    if env:
        words += ["env", *(f"{k}={v}" for k, v in check_env_names(env).items())]
    if timeout is not None:
        words += ["timeout", "-k", str(KILL_GRACE_S), f"{max(timeout, 0.001):.3f}"]
    words += argv_words(argv)
    line = " ".join(map(shell_word, words))
    return f"cd -- {shell_word(cwd)} && {line}" if cwd else line


def shell_word(word: str) -> str:
    """word as bash, zsh (whatever its options) and dash read it back, byte for byte: bare when it holds
    only characters no shell expands, else single-quoted (a quote inside becomes '\\'')."""
    if "\0" in word:  # the shell would cut the word there (LocalHost's Popen refuses it the same way)
        raise ValueError(f"a NUL byte cannot cross a command line: {word!r}")
    return word if BARE_WORD.match(word) else "'" + word.replace("'", "'\\''") + "'"


def fingerprint(key) -> str:
    """OpenSSH's form: 'ssh-ed25519 SHA256:...'."""
    digest = base64.b64encode(hashlib.sha256(key.asbytes()).digest()).decode().rstrip("=")
    return f"{key.get_name()} SHA256:{digest}"


class SSHHost(Host):
    """A host over SSH (Fabric). Connects on first use and again after a drop; one SFTP session."""

    def __init__(self, params: HostParams):
        super().__init__(params)
        self.python = params.python or "python3"
        self.known_hosts = os.path.expanduser(params.known_hosts or "~/.ssh/known_hosts")
        # An explicit, empty SSH config: every setting comes from HostParams, none from ~/.ssh/config.
        config = fabric.Config(ssh_config=paramiko.SSHConfig(), overrides={"runners": {"remote": HeartbeatRemote}})
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
            if root.startswith("~") and not (root == "~" or root.startswith("~/")):
                raise BadInputError(f"{root!r}: only ~ and ~/... are understood; give an absolute path", param="root")
            if not root.startswith("/"):
                home = self._sftp_client().normalize(".")  # the login folder, asked of the SFTP server
                root = posixpath.join(home, root.lstrip("~").lstrip("/"))
            self._root = posixpath.normpath(root)
        return self._root

    def connect(self) -> None:
        """Open the connection now (else the first command does); raises the error that says why."""
        with self._faults("connect"):
            self._connected()

    def _connected(self):
        with self._lock:  # one connect at a time, even when tasks share this host from threads
            if not self._conn.is_connected:
                self._open()
            return self._conn

    def _open(self) -> None:
        client = self._conn.client
        client.get_host_keys().clear()
        if os.path.exists(self.known_hosts):
            client.load_host_keys(self.known_hosts)
        client.set_missing_host_key_policy(
            RecordUnknownKey(self) if self.params.trust_unknown_host_key else RefuseUnknownKey(self))
        t = self.params.connect_timeout
        kwargs = {"timeout": t, "banner_timeout": t, "auth_timeout": t}
        if self.params.key_filename:
            kwargs["key_filename"] = os.path.expanduser(self.params.key_filename)
        if self.params.key_secret:
            kwargs["pkey"] = self._secret_key()
        self._conn.connect_kwargs = kwargs
        try:
            self._conn.open()
            _fail_unacknowledged_after(self._conn.transport.sock, LOST_AFTER_S)
        except paramiko.BadHostKeyException as e:
            raise HostKeyRefused(self._changed_key_message(e.key, e.expected_key), param="known_hosts") from None
        except paramiko.SSHException as e:
            transport = self._conn.client.get_transport()
            if transport is None or not transport.initial_kex_done:
                # paramiko stops waiting for the key exchange after `timeout`, then fails with an
                # unhelpful "No existing session": say what really happened.
                raise HostUnreachable(f"{self.name}: the SSH handshake did not finish within {t} s "
                                      f"(connect_timeout) or the host closed it: {e}") from e
            raise

    def _secret_key(self):
        """The private key from the Secret block named in key_secret (read once, never logged)."""
        if self._pkey is None:
            text = _secret(self.params.key_secret, "key_secret", "the private key that logs in to the host")
            passphrase = _secret(self.params.passphrase_secret, "passphrase_secret",
                                 "that key's passphrase") if self.params.passphrase_secret else None
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
        try:
            yield
        except EagletError:
            raise
        except paramiko.AuthenticationException as e:
            raise LoginRefused(f"{self.name} refused the login as {self._conn.user!r} ({e}); check user and the key "
                               "(key_secret, key_filename or the SSH agent's)", param="user") from e
        except (paramiko.SSHException, EOFError, ConnectionError, TimeoutError, socket.gaierror) as e:
            raise HostUnreachable(f"{self.name}: {what}: {type(e).__name__}: {e}") from e
        except OSError as e:
            if e.errno is None or e.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EPIPE):
                raise HostUnreachable(f"{self.name}: {what}: {e}") from e  # "Socket is closed" and kin
            raise

    @property
    def key_entry(self) -> str:
        """How known_hosts names this host: `gpu1`, or `[gpu1]:2222` on a port other than 22."""
        p = self.params
        return p.hostname if p.port == 22 else f"[{p.hostname}]:{p.port}"

    def _refused_unknown_message(self, key) -> str:
        p, known = self.params, shell_word(self.known_hosts)
        return (f"host key of {self.key_entry} is unknown: it offers {fingerprint(key)}, "
                f"which is not in {self.known_hosts}. Check that fingerprint with the host's owner "
                "(`ssh-keygen -lf /etc/ssh/ssh_host_*_key.pub` there), "
                f"then trust it: `ssh-keyscan -p {p.port} {shell_word(p.hostname)} >> {known}`, "
                "or run once with trust_unknown_host_key=true (the key is then recorded).")

    def _changed_key_message(self, got, expected) -> str:
        return (f"host key of {self.key_entry} CHANGED: it offers {fingerprint(got)}, but "
                f"{self.known_hosts} holds {fingerprint(expected)}. The host may have been reinstalled, or "
                "someone is in the middle. If you know why it changed, remove the old key with "
                f"`ssh-keygen -R {shell_word(self.key_entry)} -f {shell_word(self.known_hosts)}` and trust the "
                "new one. Refused.")

    # -- commands ----------------------------------------------------------------------
    def run(self, argv, *, cwd=None, env=None, timeout=None, on_line=None) -> CommandResult:
        command = remote_command(argv, cwd, {**self.params.env, **(env or {}), HEARTBEAT_ENV: f"{HEARTBEAT_S:g}"},
                                 timeout)
        out, err = LineSplitter("stdout", on_line), LineSplitter("stderr", on_line)
        # Fabric's own timeout is only a backstop for a hung connection: `timeout` on the host acts first.
        # The command's stdin gets a heartbeat byte every HEARTBEAT_S (HeartbeatRemote) and is never closed:
        # it reads end of file only when the session ends, silence when the network is lost; either way
        # remote.guard knows that the controller has gone.
        backstop = None if timeout is None else timeout + KILL_GRACE_S + self.params.connect_timeout
        started = time.monotonic()
        with self._faults(f"run {argv[0]}"):
            conn = self._connected()
            try:
                r = conn.run(command, hide=False, warn=True, pty=False, in_stream=True, encoding="utf-8",
                             out_stream=out, err_stream=err, timeout=backstop)
                code = r.exited
            except invoke.CommandTimedOut:
                code = None
        elapsed = time.monotonic() - started
        result = command_result(out, err, -1 if code is None else code, started)
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


class HeartbeatRemote(fabric.runners.Remote):
    """Fabric's runner, whose stdin thread sends the command a heartbeat byte every HEARTBEAT_S until it
    ends, instead of copying a stream (run it with in_stream=True, so that the thread starts)."""

    def handle_stdin(self, input_, output, echo=False) -> None:
        while not self.program_finished.wait(HEARTBEAT_S):
            try:
                self.channel.sendall(b"\n")
            except OSError:  # the channel closed: the command ended, or the connection dropped
                return


def _fail_unacknowledged_after(sock, seconds: float) -> None:
    """A connection whose data (a heartbeat, a file) goes unacknowledged this long fails, so a lost host
    is reported as unreachable then instead of after TCP's retries (about 15 minutes). Linux only."""
    if isinstance(sock, socket.socket) and hasattr(socket, "TCP_USER_TIMEOUT"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(seconds * 1000))


class RefuseUnknownKey(paramiko.RejectPolicy):
    """The default: a key not in known_hosts is refused, with the fingerprint and how to trust it."""

    def __init__(self, host: SSHHost):
        self.host = host

    def missing_host_key(self, client, hostname, key):
        raise HostKeyRefused(self.host._refused_unknown_message(key), param="known_hosts")


class RecordUnknownKey(RefuseUnknownKey):
    """trust_unknown_host_key: accept a key never seen before and append it to known_hosts."""

    def missing_host_key(self, client, hostname, key):
        client.get_host_keys().add(hostname, key.get_name(), key)
        path = self.host.known_hosts
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "a") as f:
            f.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")
        log.warning("trusted the unknown host key of %s (%s) and recorded it in %s", hostname, fingerprint(key), path)


def _secret(block_name: str, param: str, what: str) -> str:
    """The text of the Secret block named by the parameter param; a block that is missing says how to make it."""
    from prefect.blocks.system import Secret

    try:
        return str(Secret.load(block_name).get())
    except ValueError:  # no such block, or a block of another type by that name
        value = "open('/path/to/key').read()" if param == "key_secret" else "'the passphrase'"
        raise BadInputError(
            f"the Prefect server has no Secret block named {block_name!r}; save {what} in one: "
            f"`python -c \"from prefect.blocks.system import Secret; Secret(value={value}).save({block_name!r})\"` "
            f"(or in the UI: Blocks -> + -> Secret), or leave {param} empty"
            + (" to log in with key_filename or the SSH agent" if param == "key_secret" else ""), param=param) from None


def _parse_private_key(text: str, passphrase: str | None, where: str):
    for cls in (paramiko.Ed25519Key, paramiko.ECDSAKey, paramiko.RSAKey):
        try:
            return cls.from_private_key(io.StringIO(text), password=passphrase)
        except paramiko.PasswordRequiredException:
            raise LoginRefused(f"the key in Secret block {where!r} is encrypted: name a Secret block holding its "
                               "passphrase", param="passphrase_secret") from None
        # A damaged key fails deep in paramiko (IndexError, AssertionError, ValueError, SSHException...):
        # whatever it raises, the text is not a readable key of this type.
        except Exception:  # noqa: BLE001
            continue
    raise BadInputError(f"Secret block {where!r} holds no private key that can be read (OpenSSH ed25519, ECDSA or RSA"
                        + (", with that passphrase" if passphrase else "")
                        + "): it may be damaged or truncated; save the whole key file there, BEGIN and END lines included",
                        param="key_secret")
