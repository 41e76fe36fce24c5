"""prefect.yaml, deployed for real: a Prefect server, the process pool, `prefect deploy --all` (a
deployment per preset and the nightly), a worker, and the tiny deployment run through it.

    .venv/bin/python -m pytest tests/test_deployments.py -x -q

Every process (server, worker, the worker's flow-run processes) is started in its own process group
and ended by its PID in the fixtures' teardown (tests/fixtures/prefect_server.py).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from flows.params import TrainDraftParams
from flows.train_draft import TrainDraftResult
from tests.fixtures.prefect_server import NIGHTLY, POOL, PRESET_DEPLOYMENTS, REPO, TINY

pytest_plugins = ["tests.fixtures.prefect_server"]
pytestmark = [pytest.mark.prefect_server, pytest.mark.slow]


def read_deployment(server, name: str):
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_deployment_by_name(name)


def test_presets_are_valid_parameters():
    from flows.nightly import NightlyRunParams
    from flows.presets import preset_params

    for path in sorted((REPO / "deployments").glob("*.json")):
        params = preset_params(path)
        assert params.model_dump(exclude_defaults=True), f"{path.name} sets nothing"
    # the nightly's own preset: the demo's training with the nightly's settings (a test night on this controller)
    nightly = preset_params(REPO / "deployments" / "nightly-local.json")
    demo = TrainDraftParams.from_preset(REPO / "deployments" / "smollm2-local.json")
    assert isinstance(nightly, NightlyRunParams) and nightly.nightly.name == "default"
    assert all(getattr(nightly, s) == getattr(demo, s) for s in ("host", "target", "data", "capture", "train", "eval"))
    kimi = TrainDraftParams.from_preset(REPO / "deployments" / "kimi-k25-8gpu.json")
    assert (kimi.host.kind, kimi.capture.tensor_parallel_size, kimi.capture.backend) == ("ssh", 8, "vllm")
    assert kimi.train.nproc_per_node == 8 and kimi.host.key_secret, "8 GPUs; the key from a Secret block"


def test_multi_host_preset_plans_a_rendezvous():
    from remote.split import host_of, split_of
    from tasks.host import HostParams
    from tasks.multihost import rendezvous

    preset = json.loads((REPO / "deployments" / "multi-host.json").read_text())
    hosts = [HostParams.model_validate(h) for h in [preset["host"], *preset["extra_hosts"]]]
    plan = rendezvous(hosts, **preset["rendezvous"])
    assert [(n.host.name, n.node_rank, n.nnodes) for n in plan] == [("gpu-a", 0, 2), ("gpu-b", 1, 2)]
    assert {n.rdzv_endpoint for n in plan} == {"10.10.0.11:29400"}
    ids = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(200)]  # sample ids are sha256s
    shares = [sum(host_of(s, 2) == h for s in ids) for h in (0, 1)]
    assert min(shares) > 70, f"capture work split {shares}"
    heldout = [s for s in ids if split_of(s, 200) == "heldout"]
    assert {host_of(s, 2) for s in heldout} == {0, 1}, "both hosts capture held-out samples too"


def test_deployments_are_made_from_prefect_yaml_one_per_preset(deployed, prefect_api):
    from flows.presets import read_presets

    presets = read_presets(str(REPO / "deployments"))
    nightly = read_deployment(prefect_api, NIGHTLY)
    for name, preset in PRESET_DEPLOYMENTS.items():
        d = read_deployment(prefect_api, name)
        assert d.entrypoint == "flows.train_draft:train_draft" and d.work_pool_name == POOL
        assert d.parameters == presets[preset], f"{name}: the parameters are {preset}.json's"
        assert not d.schedules
        assert preset in d.description
    # `prefect deployment run train-draft/demo` is `make demo`: the same preset file
    assert "deployments/smollm2-local.json" in (REPO / "Makefile").read_text()
    assert read_deployment(prefect_api, "train-draft/demo").parameters == presets["smollm2-local"]
    assert nightly.entrypoint == "flows.nightly:nightly_retrain"
    (schedule,) = nightly.schedules
    # shipped off: on, it would train on the controller with default parameters at 02:00
    assert (schedule.schedule.cron, schedule.schedule.timezone, schedule.active) == ("0 2 * * *", "UTC", False)
    # the pull step puts the flow-run process in the checkout the deployment was made from
    (step,) = nightly.pull_steps
    assert Path(step["prefect.deployments.steps.set_working_directory"]["directory"]) == REPO
    assert nightly.parameters == presets["nightly-local"] and nightly.parameters["nightly"]["margin"] == 0.05
    # the UI's form: the flow's pydantic parameters, sections and fields with their descriptions
    props = read_deployment(prefect_api, TINY).parameter_openapi_schema["properties"]
    assert {"host", "target", "data", "capture", "train", "eval"} <= set(props)


def test_a_run_of_the_tiny_deployment_completes_named_tagged_with_its_result_and_report(tiny_run, prefect_api,
                                                                                       tiny_llama):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, FlowRunFilter

    with get_client(sync_client=True) as client:
        run = client.read_flow_run(tiny_run.flow_run_id)
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id={"any_": [run.id]},
                                                                          type={"not_any_": ["result"]}))
        subflows = client.read_flow_runs(flow_run_filter=FlowRunFilter(parent_flow_run_id={"any_": [run.id]}))
        result = run.state.result()  # persisted (JSON): read back through the API, in another process
    assert run.state.is_completed(), f"{run.state.name}: {run.state.message}\n{tiny_run.output[-3000:]}"
    assert run.deployment_id is not None and run.work_pool_name == POOL
    # named as its folder on the host, the host and the target; tagged with both
    folder = run.parameters["run_name"]
    assert run.name == f"{folder} · local · {tiny_llama.name}"
    assert {"eaglet", "host:local", f"target:{tiny_llama.name}"} <= set(run.tags)
    assert isinstance(result, TrainDraftResult), result
    assert result.run_dir.endswith(f"/runs/{folder}") and result.draft_dir.startswith(result.run_dir)
    assert 1.0 <= result.figures["acceptance_length"] <= 3.0
    # the overrides reached the flow, and the sections left out are the preset's, not the flow's defaults
    tiny = json.loads((REPO / "deployments" / "tiny-local.json").read_text())
    train = run.parameters["train"]  # the whole group (its other fields at their one default)
    assert {k: train[k] for k in tiny["train"]} == tiny["train"] and tiny["train"]["ttt_steps"] != 7
    assert Path(run.parameters["host"]["root"]).name == "root"
    from tasks.evaluate import REPORT_KEY, SUMMARY_KEY

    undescribed = {a.key for a in artifacts if not (a.key and a.description)}
    assert not undescribed, [(a.type, a.key, a.description) for a in artifacts]
    summaries = [a for a in artifacts if a.key == SUMMARY_KEY]
    assert len(summaries) == 1 and "acceptance length" in summaries[0].data
    assert "speed-up not measured" in summaries[0].description  # the tiny preset evaluates offline only
    # the flow's own artifact (no task run): the run page lists it above the steps' artifacts
    assert [a.key for a in artifacts if a.task_run_id is None] == [SUMMARY_KEY]
    reports = [a for a in artifacts if a.key == REPORT_KEY]
    assert len(reports) == 1 and "data:image/png;base64," in reports[0].data and "n/ax" not in reports[0].data
    assert not subflows


def test_a_misspelt_host_fails_at_once_as_bad_input_and_leaves_no_limit(deployed, prefect_api, tmp_path):
    from prefect.client.orchestration import get_client

    from tests.fixtures.prefect_server import run_deployment

    host = {"kind": "ssh", "name": "gpu-typo", "hostname": "gpu-typo.invalid", "root": str(tmp_path)}
    run = run_deployment(deployed.server, TINY, ["-p", f"host={json.dumps(host)}"], run_name="typo", timeout=180)
    from prefect.client.schemas.filters import LogFilter

    with get_client(sync_client=True) as client:
        state = client.read_flow_run(run.flow_run_id).state
        limits = [limit.name for limit in client.read_global_concurrency_limits(limit=200)]
        logs = [entry.message for entry in client.read_logs(LogFilter(flow_run_id={"any_": [run.flow_run_id]}))]
    assert state.is_failed()
    assert state.message == ("bad input: host.hostname: 'gpu-typo.invalid' does not resolve on the controller; "
                             "correct the name (or add it to DNS or /etc/hosts)")
    assert "gpu-host:gpu-typo" not in limits
    assert not [m for m in logs if "Traceback" in m], "bad input: one message, no traceback"
    assert sum(state.message in m for m in logs) == 1, "said once, as the final state"


def test_the_shipped_kimi_deployment_without_its_secret_block_fails_in_one_line(deployed, prefect_api):
    """Run as docs/DEPLOYING.md runs it, on a server without the Secret block its host names."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter

    from tests.fixtures.prefect_server import run_deployment

    run = run_deployment(deployed.server, "train-draft/kimi-k25-8gpu", [], run_name="no-secret", timeout=180)
    with get_client(sync_client=True) as client:
        state = client.read_flow_run(run.flow_run_id).state
        logs = [entry.message for entry in client.read_logs(LogFilter(flow_run_id={"any_": [run.flow_run_id]}))]
    assert state.is_failed()
    assert state.message.startswith("bad input: host.key_secret: the Prefect server has no Secret block named "
                                    "'kimi-node-1-ssh-key'; save the private key that logs in to the host in one")
    assert not [m for m in logs if "Traceback" in m] and "Traceback" not in run.output, logs
    assert sum("has no Secret block named" in m for m in logs) == 1, "said once, as the final state"
