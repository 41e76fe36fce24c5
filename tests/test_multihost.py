"""Several GPU hosts in one run: the real training flow over two "hosts", each a real sshd in its own
network namespace with its own root folder, through the Prefect test harness.

    .venv/bin/python -m pytest tests/test_multihost.py -x -q

The two namespaces reach each other through this one (a default route each, IP forwarding on for the
test and put back after), so torchrun's c10d rendezvous on host A is reached from host B as it would
be across a cluster network. Capture uses the transformers backend (the tiny preset: vLLM's CPU
attention refuses the tiny target's head size) and training gloo on the CPU. The namespaces share
this machine's filesystem, so the target and the chat file have the same path on both hosts, as the
flow requires of real hosts.
"""
from __future__ import annotations

import json
import posixpath
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flows.params import TrainDraftParams
from flows.train_draft import train_draft
from remote.split import host_of
from tasks.host import open_host
from tests.fixtures.sshd import SSHD, delete_netns, make_netns, start_sshd
from tests.fixtures.tiny_run import REPO, tiny_params, write_chats

IP_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")


def test_multi_host_preset_loads():
    p = TrainDraftParams.from_preset(REPO / "deployments" / "multi-host.json")
    assert [h.name for h in (p.host, *p.extra_hosts)] == ["gpu-a", "gpu-b"]
    assert (p.rendezvous.address, p.rendezvous.port) == ("10.10.0.11", 29400)
    assert TrainDraftParams().extra_hosts == [], "one host unless told otherwise"
    with pytest.raises(ValueError, match="rendezvous"):
        TrainDraftParams.model_validate({"rendezvous": {"adress": "10.0.0.1"}})


def _iface(ns: str, addr: str) -> str:
    """The interface inside namespace ns that holds addr (what gloo must bind to)."""
    out = subprocess.run(["ip", "netns", "exec", ns, "ip", "-o", "-4", "addr"], check=True, capture_output=True,
                         text=True).stdout
    return next(line.split()[1] for line in out.splitlines() if f" {addr}/" in line)


@pytest.fixture
def two_hosts(tmp_path):
    """Two sshd hosts in network namespaces that reach each other; everything undone afterwards."""
    if not Path(SSHD).exists():
        pytest.skip(f"{SSHD} missing: apt-get install -y openssh-server")
    made, servers, forward = [], [], IP_FORWARD.read_text().strip()
    try:
        for tag in ("mha", "mhb"):
            try:
                made.append(make_netns(tag))
            except (subprocess.CalledProcessError, FileNotFoundError) as e:
                pytest.skip(f"cannot make a network namespace ({getattr(e, 'stderr', '') or e}); needs root and iproute2")
        IP_FORWARD.write_text("1")
        for ns in made:
            subprocess.run(["ip", "netns", "exec", ns.name, "ip", "route", "add", "default", "via", ns.host_addr],
                           check=True, capture_output=True)
        hosts = []
        for name, ns in zip(("host-a", "host-b"), made):
            servers.append(start_sshd(tmp_path / f"sshd-{name}", listen=ns.addr, port=22, netns=ns.name))
            hosts.append(servers[-1].params(name=name, root=str(tmp_path / f"root {name}"), python=sys.executable,
                                            env={"GLOO_SOCKET_IFNAME": _iface(ns.name, ns.addr)}))
        yield hosts
    finally:
        for s in servers:
            s.stop()
        for ns in made:
            delete_netns(ns)
        IP_FORWARD.write_text(forward)
        shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.mark.ssh
@pytest.mark.slow
def test_training_flow_over_two_hosts(prefect_harness, two_hosts, tiny_llama, tmp_path):
    a, b = two_hosts
    chats = write_chats(tmp_path / "chats" / "chats.jsonl", n=48)
    raw = tiny_params(tmp_path / "unused", tiny_llama, [chats])
    raw.update(host=a.model_dump(), extra_hosts=[b.model_dump()], run_name="two-hosts")
    params = TrainDraftParams.model_validate(raw)
    kwargs = {name: getattr(params, name) for name in TrainDraftParams.model_fields}

    started = time.monotonic()
    state = train_draft(**kwargs, return_state=True)
    seconds = time.monotonic() - started
    assert state.is_completed(), state.message
    result = state.result()

    manifests = []
    for host in (a, b):
        with open_host(host) as h:
            run_dir = posixpath.join(h.root, "runs", "two-hosts")
            manifests.append({step: json.loads(h.read_text(posixpath.join(run_dir, step, "manifest.json")))
                              for step in ("prepare", "capture", "vocab", "train")})
            manifests[-1]["export"] = h.exists(posixpath.join(run_dir, "export", "model.safetensors"))
    (ma, mb) = manifests

    # every host prepared the same samples; each captured exactly its share, into its own cache
    assert ma["prepare"]["fingerprint"] == mb["prepare"]["fingerprint"]
    import pyarrow.parquet as pq

    every = set(pq.read_table(posixpath.join(ma["prepare"]["config"]["out_dir"], "data.parquet"),
                              columns=["sample_id"]).column("sample_id").to_pylist())
    shares = [set(m["capture"]["capture"]["sample_ids"]) for m in manifests]
    assert shares[0] and shares[1] and not shares[0] & shares[1]
    assert shares[0] | shares[1] == every
    assert all(host_of(s, 2) == i for i, share in enumerate(shares) for s in share)
    assert ma["capture"]["capture"]["cache_dir"].startswith(a.root) and mb["capture"]["capture"]["cache_dir"].startswith(b.root)

    # the vocab came from host A, whole
    assert ma["vocab"]["files"] == mb["vocab"]["files"]

    # one torchrun job of two nodes: world size 2, each node trained on its own share
    for i, m in enumerate(manifests):
        assert (m["train"]["counts"]["world_size"], m["train"]["counts"]["nnodes"]) == (2, 2)
        assert m["train"]["config"]["node_rank"] == i and m["train"]["config"]["nnodes"] == 2
    by_node = ma["train"]["figures"]["tokens_by_node"]
    assert set(by_node) == {"0", "1"} and min(by_node.values()) > 0, by_node
    assert sum(by_node.values()) == ma["train"]["counts"]["tokens"]
    assert mb["train"]["train"]["node_rank"] == 1 and "weights" not in mb["train"]["train"]

    # the draft is exported (and evaluated) on host A only
    assert result.draft_dir.startswith(a.root) and ma["export"] and not mb["export"]
    assert result.figures
    print(f"\ntwo-host flow: {seconds:.1f} s; world size {ma['train']['counts']['world_size']}, "
          f"tokens by host {by_node}, train samples A {ma['train']['counts']['train_samples']}, "
          f"B {mb['train']['counts']['train_samples']}")


@pytest.mark.ssh
def test_copy_step_dir_checks_both_ends_and_skips_what_is_there(sshd, tmp_path):
    from remote.step import StepOutput
    from tasks.errors import RemoteFault
    from tasks.host import HostParams
    from tasks.multihost import copy_step_dir

    src_dir, dst_dir = tmp_path / "a" / "vocab", tmp_path / "b" / "vocab"
    out = StepOutput(src_dir, "vocab", {})
    (out.open() / "vocab.safetensors").write_bytes(b"x" * 1000)
    out.publish()
    with open_host(HostParams(root=str(tmp_path / "a"))) as src, open_host(sshd.params(root=str(tmp_path / "b"))) as dst:
        assert copy_step_dir(src, str(src_dir), dst, str(dst_dir)) > 1000
        assert (dst_dir / "vocab.safetensors").read_bytes() == b"x" * 1000 and (dst_dir / "manifest.json").is_file()
        assert copy_step_dir(src, str(src_dir), dst, str(dst_dir)) == 0, "already there: nothing moves"
        (dst_dir / "vocab.safetensors").write_bytes(b"y" * 1000)  # damaged on the destination: copied again
        assert copy_step_dir(src, str(src_dir), dst, str(dst_dir)) > 1000
        assert (dst_dir / "vocab.safetensors").read_bytes() == b"x" * 1000
        (src_dir / "vocab.safetensors").write_bytes(b"z" * 1000)  # the source no longer matches its manifest
        with pytest.raises(RemoteFault, match="differ from its manifest"):
            copy_step_dir(src, str(src_dir), dst, str(tmp_path / "b" / "other"))
        assert not (tmp_path / "b" / "other").exists() and not (tmp_path / "b" / "other.incoming").exists()
