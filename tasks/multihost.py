"""Several GPU hosts in one run: which samples each host captures, and how training joins them.

    part = host_of(sample_id, n_hosts)                   # remote.split: a sample never moves as data grows
    plan = rendezvous(hosts, port=29400)                 # one NodeLaunch per host, node 0 first
    with host_slot(*hosts): ...                          # all the hosts, or none (tasks/host_slot.py)
    same_data(datasets, hosts)                           # every host prepared the same samples
    copies = copy_vocab.map(ctxs[1:], unmapped(ctxs[0]), unmapped(vocab))   # node 0's vocab to the others

Capture fans out by sample: host i captures the samples with host_of(id, n) == i into its own cache,
so a re-run (or the next night) on the same hosts finds each sample where it was captured. The draft
vocabulary is built on node 0 and copied to the others through the controller (checksummed at both
ends). Training then runs torchrun on every host at once (nnodes = n, node_rank = i, rendezvous at
node 0) and each node reads the shards on its own disk: no capture is copied between hosts.
"""
from __future__ import annotations

import json
import posixpath
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import get_run_logger

from remote.step import MANIFEST, sha256_file
from tasks.context import RunContext, step_task
from tasks.errors import BadInputError, RemoteFault
from tasks.host import Host, HostParams, open_host

DEFAULT_RDZV_PORT = 29400  # torchrun's c10d rendezvous port on node 0
COPY_TIMEOUT_S = 600  # sha256sum / mv of a step folder on a host


@dataclass(frozen=True)
class NodeLaunch:
    host: HostParams
    node_rank: int  # torchrun --node-rank
    nnodes: int  # torchrun --nnodes
    rdzv_endpoint: str  # torchrun --rdzv-endpoint: node 0 as the other hosts reach it
    local_addr: str = ""  # torchrun --local-addr: this host as the other hosts reach it


def rendezvous(hosts: list[HostParams], port: int = DEFAULT_RDZV_PORT, address: str = "") -> list[NodeLaunch]:
    """One launch per host, the first host is node 0 and runs the rendezvous.

    `address` is node 0 as the *other hosts* reach it (a cluster-internal name or IP); empty: the
    first host's `hostname`, which is right when the controller and the hosts share a network.
    Every other host is reached by the others at its own `hostname`.
    """
    if not hosts:
        raise BadInputError("no hosts to train on")
    names = [h.display_name for h in hosts]
    if len(set(names)) != len(names):
        raise BadInputError(f"hosts must be distinct; got {names}")
    if len(hosts) > 1 and any(h.kind == "local" for h in hosts):
        raise BadInputError("a multi-host run needs SSH hosts: 'local' cannot be reached by the others")
    if not 1 <= port <= 65535:
        raise BadInputError(f"rendezvous port {port}: must be 1..65535")
    if len(hosts) == 1:
        return [NodeLaunch(hosts[0], 0, 1, "")]
    addrs = [address or hosts[0].hostname] + [h.hostname for h in hosts[1:]]
    return [NodeLaunch(h, i, len(hosts), f"{addrs[0]}:{port}", addrs[i]) for i, h in enumerate(hosts)]


def same_data(datasets: list[Any], hosts: list[HostParams]) -> Any:
    """Node 0's prepared dataset, once every host's is the same (same inputs, same tokenizer)."""
    prints = {h.display_name: d.fingerprint for h, d in zip(hosts, datasets)}
    if len(set(prints.values())) > 1:
        raise BadInputError(f"the hosts prepared different data (fingerprints {prints}): data.inputs and "
                            "target.model must hold the same files on every host")
    return datasets[0]


# ----------------------------------------------------------------------------- the vocab, node 0 -> the others
def _sums(host: Host, folder: str, names: list[str]) -> dict[str, str]:
    """sha256 of these files of a folder on the host, computed there (a missing file is left out)."""
    lines: list[str] = []
    host.run(["sha256sum", "--", *names], cwd=folder, timeout=COPY_TIMEOUT_S,
             on_line=lambda stream, line: lines.append(line) if stream == "stdout" else None)
    return {name.lstrip("*"): digest for digest, name in (line.split(None, 1) for line in lines)}


def _run_checked(host: Host, argv: list[str]) -> None:
    r = host.run(argv, timeout=COPY_TIMEOUT_S)
    if r.exit_code != 0:
        raise RemoteFault(f"{argv[0]} on {host.name} exited {r.exit_code}: {' '.join(r.stderr_tail[-5:])}")


def copy_step_dir(src: Host, src_dir: str, dst: Host, dst_dir: str) -> int:
    """Copy a finished step folder between hosts through the controller; returns bytes moved (0: it
    was already there). Checked against the source manifest's sha256s here and on the destination,
    which sees the folder only once it is whole (staged under `<dst_dir>.incoming`, then renamed)."""
    want = {rel: meta["sha256"] for rel, meta in json.loads(src.read_text(posixpath.join(src_dir, MANIFEST)))["files"].items()}
    names = sorted(want)
    if dst.exists(posixpath.join(dst_dir, MANIFEST)) and _sums(dst, dst_dir, names) == want:
        return 0
    staging = dst_dir + ".incoming"
    with tempfile.TemporaryDirectory(prefix="eaglet-copy-") as tmp:
        moved = src.get_dir(src_dir, tmp)
        got = {rel: sha256_file(Path(tmp) / rel) for rel in names}
        if got != want:
            raise RemoteFault(f"{src_dir} on {src.name}: files differ from its manifest after the copy "
                              f"({sorted(k for k in want if got[k] != want[k])})")
        _run_checked(dst, ["rm", "-rf", "--", staging])
        dst.put_dir(tmp, staging)
    if _sums(dst, staging, names) != want:
        raise RemoteFault(f"{staging} on {dst.name}: checksums differ from {src_dir} on {src.name} after the copy")
    _run_checked(dst, ["rm", "-rf", "--", dst_dir])
    _run_checked(dst, ["mv", "-T", "--", staging, dst_dir])
    return moved


@step_task(name="copy-vocab")
def copy_vocab(ctx: RunContext, node0: RunContext, vocab: Any) -> Any:
    """The draft vocabulary built on node 0, copied into this host's run folder (same step name)."""
    dst_dir = ctx.step_dir("vocab")
    with open_host(node0.host) as src, open_host(ctx.host) as dst:
        moved = copy_step_dir(src, vocab.path, dst, dst_dir)
    get_run_logger().info("draft vocabulary %s -> %s:%s (%d bytes through the controller)",
                          vocab.path, ctx.host.display_name, dst_dir, moved)
    return vocab.model_copy(update={"path": dst_dir})
