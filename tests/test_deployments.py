"""prefect.yaml, deployed for real: a Prefect server, the process pool, `prefect deploy --all`, a worker,
and the demo deployment run through it with the tiny preset's parameters.

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
from tests.fixtures.prefect_server import MANUAL, NIGHTLY, POOL, REPO

pytest_plugins = ["tests.fixtures.prefect_server"]
pytestmark = [pytest.mark.prefect_server, pytest.mark.slow]


def read_deployment(server, name: str):
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_deployment_by_name(name)


def test_presets_are_valid_parameters():
    for path in sorted((REPO / "deployments").glob("*.json")):
        params = TrainDraftParams.from_preset(path)
        assert params.model_dump(exclude_defaults=True), f"{path.name} sets nothing"
    kimi = TrainDraftParams.from_preset(REPO / "deployments" / "kimi-k25-8gpu.json")
    assert (kimi.host.kind, kimi.capture.tensor_parallel_size, kimi.capture.backend) == ("ssh", 8, "vllm")
    assert kimi.train.nproc_per_node == 8 and kimi.host.key_secret, "8 GPUs; the key from a Secret block"


def test_multi_host_preset_plans_a_rendezvous():
    from tasks.host import HostParams
    from tasks.multihost import host_of, rendezvous

    preset = json.loads((REPO / "deployments" / "multi-host.json").read_text())
    hosts = [HostParams.model_validate(h) for h in [preset["host"], *preset["extra_hosts"]]]
    plan = rendezvous(hosts, **preset["rendezvous"])
    assert [(n.host.name, n.node_rank, n.nnodes) for n in plan] == [("gpu-a", 0, 2), ("gpu-b", 1, 2)]
    assert {n.rdzv_endpoint for n in plan} == {"10.10.0.11:29400"}
    ids = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(200)]  # sample ids are sha256s
    shares = [sum(host_of(s, 2) == h for s in ids) for h in (0, 1)]
    assert min(shares) > 70, f"capture work split {shares}"
    from remote.data.prepare import split_of

    heldout = [s for s in ids if split_of(s, 200) == "heldout"]
    assert {host_of(s, 2) for s in heldout} == {0, 1}, "both hosts capture held-out samples too"


def test_both_deployments_are_made_from_prefect_yaml(deployed, prefect_api):
    manual, nightly = read_deployment(prefect_api, MANUAL), read_deployment(prefect_api, NIGHTLY)
    assert manual.work_pool_name == nightly.work_pool_name == POOL
    assert manual.entrypoint == "flows/train_draft.py:train_draft"
    assert nightly.entrypoint == "flows/nightly.py:nightly_retrain"
    assert not manual.schedules
    (schedule,) = nightly.schedules
    assert (schedule.schedule.cron, schedule.schedule.timezone, schedule.active) == ("0 2 * * *", "UTC", True)
    # the pull step puts the flow-run process in the checkout the deployment was made from
    for d in (manual, nightly):
        (step,) = d.pull_steps
        assert Path(step["prefect.deployments.steps.set_working_directory"]["directory"]) == REPO
    assert nightly.parameters["nightly"]["margin"] == 0.05
    # the UI's form: the flow's pydantic parameters, sections and fields with their descriptions
    props = manual.parameter_openapi_schema["properties"]
    assert {"host", "target", "data", "capture", "train", "eval"} <= set(props)


def test_manual_run_through_the_worker_completes_with_its_report(manual_run, prefect_api):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, FlowRunFilter

    with get_client(sync_client=True) as client:
        run = client.read_flow_run(manual_run.flow_run_id)
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id={"any_": [run.id]}))
        subflows = client.read_flow_runs(flow_run_filter=FlowRunFilter(parent_flow_run_id={"any_": [run.id]}))
    assert run.state.is_completed(), f"{run.state.name}: {run.state.message}\n{manual_run.output[-3000:]}"
    assert run.deployment_id is not None and run.work_pool_name == POOL
    # the overrides reached the flow: the tiny preset's settings, not the flow's defaults
    tiny = json.loads((REPO / "deployments" / "tiny-local.json").read_text())
    assert run.parameters["train"]["ttt_steps"] == tiny["train"]["ttt_steps"] != 7
    assert Path(run.parameters["host"]["root"]).name == "root"
    from tasks.evaluate import REPORT_KEY

    reports = [a for a in artifacts if a.key == REPORT_KEY]
    assert len(reports) == 1 and reports[0].type == "markdown", f"artifacts: {sorted(a.key or '-' for a in artifacts)}"
    assert "acceptance length" in reports[0].data
    assert not subflows
