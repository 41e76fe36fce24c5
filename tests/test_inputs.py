"""The first check of a run (tasks/inputs.py): parameters that name things on the host, checked before
anything expensive, each problem naming the parameter and the fix; a name that does not resolve is bad
input, never retried. Real files on the local host; a real resolver answer for a `.invalid` name.

    .venv/bin/python -m pytest tests/test_inputs.py -q
"""
from __future__ import annotations

import socket

import pytest

from flows.params import DataParams, TargetParams
from tasks.errors import HostUnreachable, is_transient, name_unresolved
from tasks.host import HostParams
from tasks.inputs import check_inputs


def test_missing_paths_are_named_with_the_parameter_and_the_fix(tmp_path):
    not_a_model = tmp_path / "weights"
    not_a_model.mkdir()
    chats = tmp_path / "chats.jsonl"
    chats.write_text("{}\n")
    host = HostParams(root=str(tmp_path / "root"))
    problems = check_inputs.fn([host], TargetParams(model=str(not_a_model)),
                               DataParams(inputs=[str(chats), str(tmp_path / "typo.jsonl")]))
    assert problems == [
        f"target.model: {not_a_model} has no config.json on local; set it to a Hugging Face model folder on the "
        "host (config.json, weights, tokenizer), or leave it empty for the embedded SmolLM2-135M-Instruct",
        f"data.inputs[1]: {tmp_path / 'typo.jsonl'} does not exist on local; name chat files or folders on the host "
        "(JSONL, JSON, Parquet), or leave data.inputs empty for the embedded ShareGPT sample"]
    assert check_inputs.fn([host], TargetParams(), DataParams()) == [], "empty fields: the embedded default"


def test_a_hostname_that_does_not_resolve_is_bad_input(tmp_path):
    typo = HostParams(kind="ssh", name="gpu-b", hostname="gpu-b.invalid", root="/data", connect_timeout=5)
    problems = check_inputs.fn([HostParams(root=str(tmp_path)), typo], TargetParams(), DataParams())
    assert problems == ["extra_hosts[0].hostname: 'gpu-b.invalid' does not resolve on the controller; correct the "
                        "name (or add it to DNS or /etc/hosts)"]


def test_only_a_name_that_does_not_exist_is_not_retried():
    with pytest.raises(socket.gaierror) as no_name:
        socket.getaddrinfo("gpu-b.invalid", 22)
    unresolved = HostUnreachable("gpu-b: connect: gaierror")
    unresolved.__cause__ = no_name.value
    assert name_unresolved(unresolved) and not is_transient(unresolved)
    later = HostUnreachable("gpu-b: connect: gaierror")
    later.__cause__ = socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
    assert is_transient(later), "a resolver that is down for a moment may answer on the next try"
    assert is_transient(HostUnreachable("gpu-b: connection refused"))
