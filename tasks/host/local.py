"""The local kind of host: each command a subprocess here, files copied on this disk."""
from __future__ import annotations

import codecs
import errno
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

from tasks.errors import BadInputError, CommandTimedOut
from tasks.host.base import KILL_GRACE_S, CommandResult, Host, LineSplitter, argv_words, command_result
from tasks.host.params import HostParams


class LocalHost(Host):
    """This machine: each command a subprocess in its own session, so a timeout ends its whole tree."""

    def __init__(self, params: HostParams):
        super().__init__(params)
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

