"""Several GPU hosts in one run: which samples each host captures, and how training joins them.

    part = host_of(sample_id, n_hosts)                   # stable: a sample never moves as data grows
    plan = rendezvous(hosts, port=29400)                 # one NodeLaunch per host, node 0 first
    with host_slot(*hosts): ...                          # all the hosts, or none (tasks/host_slot.py)

Capture fans out by sample: host i captures the samples with host_of(id, n) == i into its own cache,
so a re-run (or the next night) on the same hosts finds each sample where it was captured. Training
then runs torchrun on every host at once (nnodes = n, node_rank = i, rendezvous at node 0) and each
node reads the shards on its own disk: nothing is copied between hosts.
"""
from __future__ import annotations

from dataclasses import dataclass

from tasks.errors import BadInputError
from tasks.hosts import HostParams

DEFAULT_RDZV_PORT = 29400  # torchrun's c10d rendezvous port on node 0


def host_of(sample_id: str, n_hosts: int) -> int:
    """The host (0..n-1) that captures this sample. Uses other hex digits than the held-out split
    (remote.prepare.split_of reads the first 8), so every host gets its share of both splits."""
    if n_hosts < 1:
        raise ValueError(f"n_hosts={n_hosts}: need at least one host")
    return int(sample_id[8:16], 16) % n_hosts


@dataclass(frozen=True)
class NodeLaunch:
    host: HostParams
    node_rank: int  # torchrun --node-rank
    nnodes: int  # torchrun --nnodes
    rdzv_endpoint: str  # torchrun --rdzv-endpoint: node 0 as the other hosts reach it


def rendezvous(hosts: list[HostParams], port: int = DEFAULT_RDZV_PORT, address: str = "") -> list[NodeLaunch]:
    """One launch per host, the first host is node 0 and runs the rendezvous.

    `address` is node 0 as the *other hosts* reach it (a cluster-internal name or IP); empty: the
    first host's `hostname`, which is right when the controller and the hosts share a network.
    """
    if not hosts:
        raise BadInputError("no hosts to train on")
    names = [h.name or h.hostname for h in hosts]
    if len(set(names)) != len(names):
        raise BadInputError(f"hosts must be distinct; got {names}")
    if len(hosts) > 1 and any(h.kind == "local" for h in hosts):
        raise BadInputError("a multi-host run needs SSH hosts: 'local' cannot be reached by the others")
    if not 1 <= port <= 65535:
        raise BadInputError(f"rendezvous port {port}: must be 1..65535")
    endpoint = f"{address or hosts[0].hostname}:{port}"
    return [NodeLaunch(h, i, len(hosts), endpoint if len(hosts) > 1 else "") for i, h in enumerate(hosts)]
