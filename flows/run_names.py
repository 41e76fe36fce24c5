"""How a run is named and tagged in Prefect, so the UI, the host's folder and the logs agree.

    @flow(flow_run_name=flow_run_label)      # "20261203-065949 · gpu-1 · Kimi-K2.5"
    def train_draft(...):
        tag_run(host, target)                 # tags host:gpu-1, target:Kimi-K2.5 (filters, the slot's holder)
        name = run_folder(run_name)           # the folder under <root>/runs: the label's first part

The folder name is the run_name parameter, else the run's scheduled start time (UTC): the same value
whenever it is asked for in the run, so the label and the folder match.
"""
from __future__ import annotations

import posixpath
from typing import Any

from tasks.host import HostParams, open_host

EMBEDDED_TARGET = "SmolLM2-135M-Instruct"  # what an empty target.model stands for


def run_folder(run_name: str = "", prefix: str = "") -> str:
    """run_name, else <prefix><scheduled start, UTC, %Y%m%d-%H%M%S> (outside a run: now)."""
    from datetime import timezone

    from prefect.runtime import flow_run

    return run_name or prefix + flow_run.scheduled_start_time.astimezone(timezone.utc).strftime("%Y%m%d-%H%M%S")


def host_label(host: Any) -> str:
    return open_host(HostParams.model_validate(host)).name  # opening is lazy: no connection is made


def target_label(target: Any) -> str:
    model = target.get("model") if isinstance(target, dict) else target.model
    return posixpath.basename(str(model).rstrip("/")) if model else EMBEDDED_TARGET


def flow_run_label(prefix: str = "") -> str:
    """The flow run's name: its folder, host and target (a `flow_run_name` callable)."""
    from prefect.runtime import flow_run

    p = flow_run.parameters
    folder = run_folder(p.get("run_name") or "", prefix)
    return f"{folder} · {host_label(p.get('host') or HostParams())} · {target_label(p.get('target') or {})}"


def tag_run(host: Any, target: Any) -> None:
    """Add host:<name> and target:<name> to this flow run's tags (a nested run gets its own)."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    with get_client(sync_client=True) as client:
        run = client.read_flow_run(flow_run.id)
        tags = sorted({*run.tags, f"host:{host_label(host)}", f"target:{target_label(target)}"})
        client.update_flow_run(run.id, tags=tags)
