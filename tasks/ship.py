"""Ship the `remote` package to a host, content-addressed: unchanged code ships nothing.

    code = ship_code(host)                 # -> <root>/code/<sha>/remote/...
    host.run([host.python, "-m", "remote.data.prepare", ...], cwd=code.path, env={"PYTHONPATH": code.path})

The folder's name is the sha256 of its SHA256SUMS file (one `<sha256>  remote/<path>` line a file),
so the name vouches for every file. A folder already there is checked with `sha256sum -c` on the
host and left alone when whole; otherwise the package travels as one tarball into a staging folder,
is verified there and renamed into place, so `<root>/code/<sha>` is never half-written. What a failed
transfer put there (`code/.<sha>.<random>*`) is removed at once when the host can still be reached,
else by the next upload to that root, once nothing has written it for STALE_MIN minutes.
"""
from __future__ import annotations

import hashlib
import io
import logging
import posixpath
import tarfile
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.tasks import exponential_backoff

from tasks.errors import BadInputError, EagletError, RemoteFault, retry_condition
from tasks.host import Host, HostParams, open_host

REMOTE_SRC = Path(__file__).resolve().parents[1] / "remote"
PACKAGE = "remote"  # the shipped folder's name on the host, whatever the source folder is called
SUMS = "SHA256SUMS"
STALE_MIN = 10  # a staging leftover untouched this long is a failed transfer's (a live one writes it)
log = logging.getLogger("eaglet.ship")

# Run as `sh INSTALL TARBALL STAGING FINAL STALE_MIN` (a file, never a command string, so any login
# shell works). The trap removes the staging folder, the tarball and itself however it ends; after the
# last `mv` the staging folder no longer exists, so the finished copy is never touched. First it removes
# what earlier transfers that failed left beside it (dot names untouched for STALE_MIN minutes).
_INSTALL_SH = """\
set -eu
tarball=$1 staging=$2 final=$3 stale_min=$4
trap 'rm -rf -- "$staging" "$staging.old" "$tarball" "$0"' EXIT
find "${final%/*}" -maxdepth 1 -name '.*' -mmin "+$stale_min" -exec rm -rf -- {} + ||
  echo "could not remove every stale leftover in ${final%/*}" >&2  # not this install's failure
mkdir -- "$staging"
tar --no-same-owner -xzf "$tarball" -C "$staging"
cd -- "$staging"
sha256sum --quiet --strict -c SHA256SUMS
if [ -e "$final" ]; then mv -T -- "$final" "$staging.old"; fi
mv -T -- "$staging" "$final"
"""


@dataclass(frozen=True)
class ShippedCode:
    path: str  # <root>/code/<sha>: holds the `remote` package; the cwd and PYTHONPATH of every step
    sha: str  # the code hash (see code_hash)
    bytes_sent: int  # payload this call sent (0 when the code was already there)
    files: int  # files of the package
    seconds: float  # wall time of this call

    @property
    def root(self) -> str:
        """The host's working root (absolute, as resolved on the host): path is <root>/code/<sha>."""
        return posixpath.dirname(posixpath.dirname(self.path))


def package_files(src: Path) -> list[tuple[str, Path]]:
    """(name on the host, local path) of every file of the package, sorted; caches left out."""
    src = Path(src)
    if not (src / "__init__.py").is_file():
        raise BadInputError(f"{src} is not a Python package (no __init__.py): nothing to ship")
    out = []
    for p in sorted(src.rglob("*")):
        rel = p.relative_to(src)
        if p.is_dir() or "__pycache__" in rel.parts or p.suffix == ".pyc":
            continue
        if any(c in str(rel) for c in "\n\\"):
            raise BadInputError(f"{p}: a file name with a newline or backslash cannot be checksummed on the host")
        out.append((f"{PACKAGE}/{rel.as_posix()}", p))
    return out


def sums_text(files: list[tuple[str, Path]]) -> str:
    """The SHA256SUMS file `sha256sum -c` checks on the host."""
    return "".join(f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {name}\n" for name, p in files)


def code_hash(src: Path = REMOTE_SRC) -> str:
    """sha256 over the package's relative paths and contents (the hash of its SHA256SUMS)."""
    return hashlib.sha256(sums_text(package_files(src)).encode()).hexdigest()


def ship_code(host: Host, src: Path = REMOTE_SRC) -> ShippedCode:
    """Make <root>/code/<sha> on the host hold exactly this package; send nothing when it does."""
    started, sent_before = time.monotonic(), host.bytes_sent
    files = package_files(src)
    sums = sums_text(files)
    sha = hashlib.sha256(sums.encode()).hexdigest()
    final = host.path("code", sha)
    if not is_shipped(host, final, sums):
        _upload(host, files, sums, final)
    return ShippedCode(final, sha, host.bytes_sent - sent_before, len(files), time.monotonic() - started)


def is_shipped(host: Host, folder: str, sums: str) -> bool:
    """True when folder holds this SHA256SUMS and every file it lists checks out on the host."""
    try:
        if host.read_text(posixpath.join(folder, SUMS)) != sums:
            return False
    except (FileNotFoundError, NotADirectoryError):
        return False
    return host.run(["sha256sum", "--quiet", "--strict", "-c", SUMS], cwd=folder).exit_code == 0


def _upload(host: Host, files: list[tuple[str, Path]], sums: str, final: str) -> None:
    staging = posixpath.join(posixpath.dirname(final), f".{posixpath.basename(final)}.{uuid.uuid4().hex[:8]}")
    host.makedirs(posixpath.dirname(final))
    try:
        with tempfile.TemporaryDirectory(prefix="eaglet-ship-") as tmp:
            tarball = Path(tmp) / "code.tar.gz"
            _write_tarball(tarball, files, sums)
            host.put(tarball, staging + ".tar.gz")
        host.write_text(staging + ".sh", _INSTALL_SH)
        r = host.run(["sh", staging + ".sh", staging + ".tar.gz", staging, final, str(STALE_MIN)])
    except Exception:
        _remove_leftovers(host, staging)
        raise
    if r.exit_code != 0:  # a transfer gone wrong is worth another try: RemoteFault is transient
        raise RemoteFault(f"{host.name}: installing code {posixpath.basename(final)[:12]} failed "
                          f"(exit {r.exit_code}): " + "\n".join(r.stderr_tail[-10:] + r.stdout_tail[-10:]))


def _remove_leftovers(host: Host, staging: str) -> None:
    """Remove what this failed transfer put on the host (`<staging>*`: the part of the tarball, the
    script and its temporary); when the host cannot be reached now, the next upload does (STALE_MIN)."""
    folder, name = posixpath.split(staging)
    try:
        host.run(["find", folder, "-maxdepth", "1", "-name", name + "*", "-exec", "rm", "-rf", "--", "{}", "+"],
                 timeout=60)
    except EagletError as e:  # the transfer's own error is the one to raise
        log.warning("%s: could not remove %s* after a failed transfer (%s); the next upload will", host.name,
                    staging, e)


def _write_tarball(path: Path, files: list[tuple[str, Path]], sums: str) -> None:
    with tarfile.open(path, "w:gz") as tar:
        for name, p in files:
            tar.add(p, arcname=name, recursive=False)
        info = tarfile.TarInfo(SUMS)
        info.size, info.mtime, info.mode = len(sums.encode()), int(time.time()), 0o644
        tar.addfile(info, io.BytesIO(sums.encode()))


@task(name="ship-code", retries=3, retry_delay_seconds=exponential_backoff(backoff_factor=2),
      retry_jitter_factor=0.5, retry_condition_fn=retry_condition, cache_policy=NO_CACHE)
def ship_code_task(host: Host | HostParams, src: Path | None = None) -> ShippedCode:
    """ship_code as a Prefect task: a host (or settings to open one), retried on transient faults."""
    logger = get_run_logger()
    if isinstance(host, HostParams):
        with open_host(host) as h:
            code = ship_code(h, src or REMOTE_SRC)
            name = h.name
    else:
        code, name = ship_code(host, src or REMOTE_SRC), host.name
    if code.bytes_sent:
        logger.info("shipped %s (%d files, %d bytes) to %s:%s in %.2f s",
                    PACKAGE, code.files, code.bytes_sent, name, code.path, code.seconds)
    else:
        logger.info("code %s already on %s at %s: nothing sent (checked in %.2f s)",
                    code.sha[:12], name, code.path, code.seconds)
    return code
