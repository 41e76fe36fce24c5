"""The machine the remote steps run on: the local one, or a GPU host over SSH (Fabric).

One interface, two kinds, so a flow never asks which it has:

    with open_host(HostParams(kind="ssh", hostname="gpu1", user="me", root="/data/eaglet")) as host:
        host.makedirs(host.root)
        result = host.run([host.python, "-m", "remote.data.prepare", "--config", cfg], timeout=600,
                          on_line=lambda stream, line: print(stream, line))

params.py holds the settings and the host's display name, base.py the interface (`Host`,
`CommandResult`), local.py the local kind, ssh.py the SSH kind (host keys, secrets, quoting).
Each module imports only the ones before it; this one picks the kind.
"""
from __future__ import annotations

from tasks.host.base import CommandResult, Host, OnLine
from tasks.host.local import LocalHost
from tasks.host.params import HostParams

__all__ = ["CommandResult", "Host", "HostParams", "LocalHost", "OnLine", "open_host"]


def open_host(params: HostParams) -> Host:
    """The host these settings describe (an SSH one connects on first use)."""
    if params.kind == "ssh":
        from tasks.host.ssh import SSHHost  # Fabric and paramiko load only when a host needs them

        return SSHHost(params)
    return LocalHost(params)

