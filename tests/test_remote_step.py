"""Remote steps end to end: a test-only step (tests/remote_steps/probe.py) shipped to real hosts and
run through run_remote_step, and through Prefect tasks on the real test harness (logs, progress
artifacts, retries of transient faults only, a dropped SSH connection)."""
from __future__ import annotations

import json
import posixpath
import threading
import time
from pathlib import Path

import pytest
from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from remote.step import EVENT_PREFIX
from tasks.errors import BadInputError, CommandTimedOut, RemoteFault, retry_condition
from tasks.host import HostParams, open_host
from tasks.remote_step import config_path, run_remote_step, run_step_in_task
from tasks.ship import ship_code
from tests.remote_steps import probe_src  # noqa: F401 (a fixture)


def _probe(host, code, run_dir: str, timeout: float = 60, **config):
    events, lines = [], []
    manifest = run_remote_step(host, code, "probe", {"out_dir": posixpath.join(run_dir, "probe"), **config},
                               run_dir=run_dir, timeout=timeout,
                               on_event=events.append, log=lines.append)
    return manifest, events, lines


def test_a_step_runs_and_its_manifest_comes_back(each_host, probe_src):
    code = ship_code(each_host, probe_src)
    run_dir = each_host.path("runs", "one")
    manifest, events, lines = _probe(each_host, code, run_dir, lines=3)
    assert manifest["counts"] == {"lines": 3} and manifest["code_hash"] == code.sha
    assert manifest["files"]["lines.txt"]["bytes"] == 6
    assert [e["done"] for e in events if e["event"] == "progress"] == [1, 2, 3]
    assert {"event": "figures", "lines": 3} in events
    assert [f"[{each_host.name}] probe line {i}" for i in range(3)] == [x for x in lines if "probe line" in x]
    assert not any(EVENT_PREFIX in x for x in lines)  # events never leak into the log
    assert json.loads(each_host.read_text(config_path(run_dir, "probe")))["lines"] == 3


@pytest.mark.parametrize("mode, error, words", [
    ("bad_input", BadInputError, ["step probe on", "row 7 of data.jsonl"]),
    ("crash", RemoteFault, ["exit 3", "crashing on purpose"]),
    ("no_manifest", RemoteFault, ["exited 0 but wrote no", "manifest.json"]),
])
def test_each_failure_has_its_error(each_host, probe_src, mode, error, words):
    code = ship_code(each_host, probe_src)
    with pytest.raises(error) as e:
        _probe(each_host, code, each_host.path("runs", mode), mode=mode)
    assert type(e.value) is error and all(w in str(e.value) for w in words), str(e.value)


def test_bad_calls_fail_before_anything_runs(probe_src, tmp_path):
    host = open_host(HostParams(root=str(tmp_path / "root")))
    code = ship_code(host, probe_src)
    with pytest.raises(BadInputError, match="not a module name"):
        run_remote_step(host, code, "../probe", {"out_dir": "x"}, run_dir=host.path("r"), timeout=5)
    with pytest.raises(BadInputError, match="needs an out_dir"):
        run_remote_step(host, code, "probe", {}, run_dir=host.path("r"), timeout=5)
    assert not host.exists(host.path("r"))


def test_a_step_past_its_timeout_is_ended(probe_src, tmp_path):
    host = open_host(HostParams(root=str(tmp_path / "root")))
    code = ship_code(host, probe_src)
    started = time.monotonic()
    with pytest.raises(CommandTimedOut, match="step probe"):
        _probe(host, code, host.path("runs", "slow"), lines=100, pause_s=0.1, timeout=1.5)
    assert time.monotonic() - started < 5
    assert not host.exists(host.path("runs", "slow", "probe", "manifest.json"))  # nothing looks finished


# ----------------------------------------------------------------------------- inside Prefect
def _read_back(flow_run_id):
    """The run's log messages, progress artifacts and task runs, as the Prefect API has them."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (ArtifactFilter, ArtifactFilterFlowRunId, FlowRunFilter,
                                                FlowRunFilterId, LogFilter, LogFilterFlowRunId)
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()
    with get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
        task_runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return [x.message for x in logs], [a for a in artifacts if a.type == "progress"], task_runs


@task(cache_policy=NO_CACHE)
def probe_task(host, code, run_dir: str, config: dict) -> dict:
    return run_step_in_task(host, code, "probe", {"out_dir": posixpath.join(run_dir, "probe"), **config},
                            run_dir=run_dir, timeout=60, progress_title="probing")


@pytest.mark.slow
def test_in_a_task_lines_reach_the_run_log_and_progress_an_artifact(prefect_harness, probe_src, tmp_path):
    host = open_host(HostParams(root=str(tmp_path / "root")))
    code = ship_code(host, probe_src)

    @flow
    def probe_flow():
        return probe_task(host, code, host.path("runs", "p"), {"lines": 4})

    state = probe_flow(return_state=True)
    manifest = state.result()
    assert manifest["counts"] == {"lines": 4} and manifest["events"] == [{"event": "figures", "lines": 4}]
    logs, progress, _ = _read_back(state.state_details.flow_run_id)
    assert [m for m in logs if "probe line" in m] == [f"[local] probe line {i}" for i in range(4)]
    assert progress == [], "a step that ended well leaves no progress card"


@pytest.mark.slow
def test_a_failed_step_keeps_its_progress_card_and_a_try_that_ends_well_removes_them(prefect_harness, probe_src,
                                                                                    tmp_path):
    host = open_host(HostParams(root=str(tmp_path / "root")))
    code = ship_code(host, probe_src)

    @task(retries=1, retry_delay_seconds=0, cache_policy=NO_CACHE)
    def first_try_fails(run: str):
        tried = tmp_path / f"{run}.tried"
        mode = "ok" if tried.exists() else "no_manifest"  # no_manifest: its progress, then a fault
        tried.write_text(mode)
        run_dir = host.path("runs", run)
        return run_step_in_task(host, code, "probe", {"out_dir": posixpath.join(run_dir, "probe"), "lines": 2,
                                                      "mode": mode}, run_dir=run_dir, timeout=60, progress_title="cards")

    @flow
    def cards_flow(run: str, retries: int):
        return first_try_fails.with_options(retries=retries)(run)

    failed = cards_flow("failed", 0, return_state=True)
    assert failed.is_failed()
    _, progress, _ = _read_back(failed.state_details.flow_run_id)
    assert [p.data for p in progress] == [100.0], "the failed step's card stays where it stopped"
    retried = cards_flow("retried", 1, return_state=True)
    assert retried.is_completed()
    _, progress, task_runs = _read_back(retried.state_details.flow_run_id)
    assert [t.run_count for t in task_runs] == [2] and progress == [], "the failed try's card went with the last"


@pytest.mark.slow
def test_bad_input_is_not_retried_but_a_crash_is(prefect_harness, probe_src, tmp_path):
    host = open_host(HostParams(root=str(tmp_path / "root")))
    code = ship_code(host, probe_src)
    retried = probe_task.with_options(retries=2, retry_delay_seconds=0, retry_condition_fn=retry_condition)

    for mode, attempts in (("bad_input", 1), ("crash", 3)):
        counter = tmp_path / f"{mode}.attempts"

        @flow
        def failing_flow():
            return retried(host, code, host.path("runs", mode), {"mode": mode, "attempts_file": str(counter)})

        state = failing_flow(return_state=True)
        assert state.is_failed()
        assert counter.read_text().splitlines() == [mode] * attempts
        _, _, task_runs = _read_back(state.state_details.flow_run_id)
        assert [t.run_count for t in task_runs] == [attempts]


@pytest.mark.ssh
@pytest.mark.slow
def test_a_dropped_connection_is_retried_and_the_task_completes(prefect_harness, own_sshd, probe_src):
    """The sshd and its sessions are killed while the step runs, then started again on the same port."""
    host = open_host(own_sshd.params(root=str(own_sshd.dir / "root")))
    code = ship_code(host, probe_src)
    counter = Path(own_sshd.dir / "attempts")
    failures = []

    @task(retries=4, retry_delay_seconds=1, retry_condition_fn=retry_condition, cache_policy=NO_CACHE)
    def flaky_link_task():
        try:
            return run_step_in_task(host, code, "probe",
                                    {"out_dir": host.path("runs", "d", "probe"), "lines": 15, "pause_s": 0.2,
                                     "attempts_file": str(counter)},
                                    run_dir=host.path("runs", "d"), timeout=60, progress_title="drop")
        except Exception as e:
            failures.append(e)
            raise

    def drop_then_restart():
        while not counter.exists():
            time.sleep(0.05)
        time.sleep(0.5)
        own_sshd.stop()
        time.sleep(1.0)
        own_sshd.start()

    saboteur = threading.Thread(target=drop_then_restart, daemon=True)
    saboteur.start()

    @flow
    def drop_flow():
        return flaky_link_task()

    manifest = drop_flow()
    saboteur.join(10)
    assert manifest["counts"] == {"lines": 15}
    assert failures and {type(e).__name__ for e in failures} == {"HostUnreachable"}
    assert "dropped while" in str(failures[0])  # cut mid-command; a later attempt may find it refused
    assert len(counter.read_text().splitlines()) >= 2  # the step really ran again
    host.close()
