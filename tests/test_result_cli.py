"""`python -m flows.result RUN` (flows/result.py): waits for a run to end, then prints its figures and its
persisted result, or why it failed. Against the real Prefect test harness, with runs of the real training
flow (refused at its first check) and of small flows made here.

    .venv/bin/python -m pytest tests/test_result_cli.py -q
"""
from __future__ import annotations

import json
import threading
import time

from prefect import flow, task

from flows.result import main
from flows.train_draft import TrainDraftResult

FIGURES = {"acceptance_length": 1.8, "acceptance_length_source": "offline, replayed", "speedup": None}


@flow(name="result-cli-test", persist_result=True, result_serializer="json")
def finishing(pause_s: float = 0.0) -> TrainDraftResult:
    time.sleep(pause_s)
    return TrainDraftResult(run_dir="/r/runs/x", draft_dir="/r/runs/x/export", data_fingerprint="f" * 64,
                            figures=FIGURES)


@task(name="capture-hidden-states")
def out_of_memory() -> None:
    raise RuntimeError("step capture on gpu-1 failed (exit 1): torch.OutOfMemoryError: CUDA out of memory")


@flow(name="result-cli-test-fails")
def failing() -> None:
    out_of_memory()


def test_a_running_run_is_waited_for_then_its_figures_and_result_printed(prefect_harness, capsys):
    name = f"result-cli-{time.time_ns()}"
    runner = threading.Thread(target=finishing.with_options(flow_run_name=name), kwargs={"pause_s": 3.0})
    runner.start()
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter

    with get_client(sync_client=True) as client:  # the run exists (Running) before we ask for it
        while not client.read_flow_runs(flow_run_filter=FlowRunFilter(name={"any_": [name]})):
            time.sleep(0.1)
    started = time.monotonic()
    assert main([name]) == 0
    assert time.monotonic() - started > 1.0, "it waited for the run to end"
    runner.join()
    out = capsys.readouterr().out
    head, figures, *rest = out.splitlines()
    assert head.startswith(f"{name}: Completed after ") and figures == "acceptance length 1.800 (offline, replayed)"
    assert json.loads("\n".join(rest)) == {"run_dir": "/r/runs/x", "draft_dir": "/r/runs/x/export",
                                           "data_fingerprint": "f" * 64, "figures": FIGURES}


def test_a_refused_run_prints_its_one_line_and_exits_65(prefect_harness, tmp_path, capsys):
    state = train_draft_refused(tmp_path)
    assert state.is_failed()
    assert main([str(state.state_details.flow_run_id)]) == 65
    err = capsys.readouterr().err
    assert f"Failed: bad input: target.model: {tmp_path / 'no-model'} does not exist on local" in err
    assert main(["result-cli-folder"]) == 65, "found by its folder, the name's first part"


def train_draft_refused(tmp_path):
    from flows.params import TargetParams
    from flows.train_draft import train_draft
    from tasks.host import HostParams

    return train_draft(host=HostParams(root=str(tmp_path / "root")), run_name="result-cli-folder",
                       target=TargetParams(model=str(tmp_path / "no-model")), return_state=True)


def test_a_failed_run_prints_the_failed_step_and_its_error(prefect_harness, capsys):
    state = failing(return_state=True)
    assert main([str(state.state_details.flow_run_id)]) == 1
    err = capsys.readouterr().err
    assert "failed step: capture-hidden-states" in err and "CUDA out of memory" in err


def test_an_unknown_run_is_said_so(prefect_harness, capsys):
    assert main(["no-such-run-anywhere"]) == 2
    assert "no flow run with id, name or folder 'no-such-run-anywhere'" in capsys.readouterr().err
