"""Wait for a flow run to end and print its result: the figures, or why it failed.

    prefect deployment run 'train-draft/demo'          # prints the new run's UUID
    python -m flows.result <UUID>                       # or, once it started, its name or folder (20261203-065949)

Prints the run's name, final state and time; then, when it completed, the acceptance length and
speed-up and its persisted result as JSON (TrainDraftResult or NightlyResult: paths on the host and
figures), else its state's message and the step that failed with that step's error (the run's failure
report, tasks/notify.py). Exits 0, 65 (the run was refused: bad input) or 1 (any other failure). The
result is read from the worker's result storage: run it on the worker's machine, or give the results
a shared storage block (docs/DEPLOYING.md, "The result").
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import uuid

from tasks.inputs import exit_status

POLL_S = 2.0  # how often the run's state is read while it runs


def find_run(client, ref: str):
    """The flow run with this id, else the latest one of this name, else of this folder (the name's first part)."""
    from prefect.client.schemas.filters import FlowRunFilter
    from prefect.client.schemas.sorting import FlowRunSort

    try:
        return client.read_flow_run(uuid.UUID(ref))
    except ValueError:
        pass
    for name in ({"any_": [ref]}, {"like_": f"{ref} · %"}):
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=name), sort=FlowRunSort.START_TIME_DESC,
                                     limit=1)
        if runs:
            return runs[0]
    return None


def wait_for(client, run, timeout_s: float | None):
    """The run once its state is final (read again every POLL_S); None when timeout_s passed first."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not (run.state and run.state.is_final()):
        if deadline is not None and time.monotonic() >= deadline:
            return None
        time.sleep(POLL_S)
        run = client.read_flow_run(run.id)
    return run


def figures_line(result) -> str:
    """The acceptance length and speed-up of a training result, or of a nightly result's training."""
    trained = getattr(result, "trained", result)
    f = getattr(trained, "figures", None) or {}
    parts = []
    if f.get("acceptance_length") is not None:
        parts.append(f"acceptance length {f['acceptance_length']:.3f} ({f.get('acceptance_length_source', '?')})")
    if f.get("speedup") is not None:
        parts.append(f"speed-up {f['speedup']:.2f}x")
    if getattr(result, "status", None):
        parts.insert(0, result.status + (f" ({result.decision.reason})" if getattr(result, "decision", None) else ""))
    return ", ".join(parts)


def report(client, run) -> int:
    """Print what the run ended with; its exit status."""
    from tasks.notify import failure_report

    seconds = run.total_run_time.total_seconds() if run.total_run_time else 0.0
    print(f"{run.name}: {run.state.name} after {seconds:.0f} s")
    if run.state.is_completed():
        try:
            result = run.state.result()
        except Exception as e:  # noqa: BLE001 - the result lives in the worker's storage, maybe not here
            print(f"its result cannot be read here ({type(e).__name__}: {e}); read it on the worker's machine",
                  file=sys.stderr)
            return 1
        if line := figures_line(result):
            print(line)
        print(json.dumps(result.model_dump(mode="json") if hasattr(result, "model_dump") else result, indent=2,
                         default=str))
        return 0
    status = exit_status(run.state)  # the state's message, on stderr
    failure = failure_report(client, run)
    if failure.failed_step:
        print(f"failed step: {failure.failed_step}\n{failure.step_message or ''}", file=sys.stderr)
    return status


def main(argv: list[str] | None = None) -> int:
    from prefect.client.orchestration import get_client

    ap = argparse.ArgumentParser(prog="python -m flows.result", description=__doc__.split("\n\n")[0])
    ap.add_argument("run", help="the flow run's id, name, or folder (its name's first part)")
    ap.add_argument("--timeout", type=float, default=None, help="seconds to wait at most (default: until it ends)")
    args = ap.parse_args(argv)
    with get_client(sync_client=True) as client:
        run = find_run(client, args.run)
        if run is None:
            print(f"no flow run with id, name or folder {args.run!r}", file=sys.stderr)
            return 2
        ended = wait_for(client, run, args.timeout)
        if ended is None:
            print(f"{run.name} is still {client.read_flow_run(run.id).state.name} after {args.timeout:g} s",
                  file=sys.stderr)
            return 3
        return report(client, ended)


if __name__ == "__main__":
    sys.exit(main())
