"""Make a failed run loud: which step failed, its error and the last remote log lines, in the UI and
posted to the user's channel.

    @flow(on_failure=[notify_failure], on_crashed=[notify_failure])
    def nightly_retrain(..., notify: str = ""): ...

Where it posts, first found wins: the flow's `notify` parameter, else the Prefect Variable
`eaglet_notify` (`prefect variable set eaglet_notify https://hooks.example/...`, once for every
flow). Either holds a URL, or `secret:<block>` naming a Prefect Secret block that holds the URL
(Slack and Teams webhook URLs are secrets: keep them out of logged parameters). The post is JSON
with a `text` field (what Slack, Mattermost and Teams incoming webhooks show) beside the fields.
Without a destination the report is still written as the run's `failure-report` artifact.
"""
from __future__ import annotations

import json
import logging
import urllib.request
from dataclasses import asdict, dataclass
from typing import Any

log = logging.getLogger("eaglet.notify")
VARIABLE = "eaglet_notify"
LOG_TAIL = 20  # log lines of the failed step in the report (the remote lines carry the host prefix)
POST_TIMEOUT_S = 10


@dataclass(frozen=True)
class FailureReport:
    flow_run: str  # the run's name
    flow_run_id: str
    state: str  # Failed, Crashed, ...
    message: str  # the run's state message
    failed_step: str | None  # the first task run that failed (in a subflow too), None when no task failed
    step_message: str | None  # its state message: the error, with the remote stderr tail
    log_tail: list[str]  # the failed step's last log lines

    def markdown(self) -> str:
        lines = [f"## eaglet run `{self.flow_run}` {self.state.lower()}", "", self.message or "", ""]
        if self.failed_step:
            lines += [f"**Failed step:** `{self.failed_step}`", "", "```", self.step_message or "", "```", ""]
        if self.log_tail:
            lines += ["**Last log lines of that step:**", "", "```", *self.log_tail, "```"]
        return "\n".join(lines)


def failure_report(client, flow_run) -> FailureReport:
    """What failed in this run and its subflows, read back from the Prefect API."""
    from prefect.client.schemas.filters import FlowRunFilter, LogFilter, TaskRunFilter
    from prefect.client.schemas.sorting import LogSort, TaskRunSort

    failed = client.read_task_runs(  # latest first: the last one is where the run first went wrong
        flow_run_filter=FlowRunFilter(id={"any_": _with_subflows(client, flow_run.id)}),
        task_run_filter=TaskRunFilter(state={"type": {"any_": ["FAILED", "CRASHED"]}}),
        sort=TaskRunSort.END_TIME_DESC)
    step = failed[-1] if failed else None
    tail: list[str] = []
    if step is not None:
        # INFO and below: the step's own lines (the remote ones); the engine's error is step_message
        logs = client.read_logs(LogFilter(task_run_id={"any_": [step.id]}, level={"le_": logging.INFO}),
                                limit=LOG_TAIL, sort=LogSort.TIMESTAMP_DESC)
        tail = [entry.message for entry in reversed(logs)]
    state = flow_run.state
    return FailureReport(
        flow_run=flow_run.name, flow_run_id=str(flow_run.id),
        state=state.name if state else "Failed", message=(state.message or "") if state else "",
        failed_step=step.name if step else None,
        step_message=(step.state.message if step and step.state else None), log_tail=tail)


def _with_subflows(client, run_id, depth: int = 3) -> list:
    """This run's id and its subflows' (the nightly runs the training flow as a subflow)."""
    from prefect.client.schemas.filters import FlowRunFilter

    ids, frontier = [run_id], [run_id]
    for _ in range(depth):
        children = client.read_flow_runs(flow_run_filter=FlowRunFilter(parent_flow_run_id={"any_": frontier}))
        frontier = [c.id for c in children if c.id not in ids]
        if not frontier:
            break
        ids += frontier
    return ids


def destination(client, parameters: dict[str, Any]) -> str:
    """The URL to post to ('' for none): the notify parameter, else the eaglet_notify Variable."""
    target = str(parameters.get("notify") or "")
    if not target:
        variable = client.read_variable_by_name(VARIABLE)
        target = str(variable.value) if variable is not None and variable.value else ""
    if target.startswith("secret:"):
        from prefect.blocks.system import Secret

        target = str(Secret.load(target[len("secret:"):]).get())
    return target


def post(url: str, report: FailureReport) -> None:
    body = json.dumps({"text": report.markdown(), **asdict(report)}).encode()
    req = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=POST_TIMEOUT_S) as resp:  # noqa: S310 - the user's own URL
        resp.read()


def notify_failure(flow, flow_run, state) -> None:
    """Prefect on_failure / on_crashed hook: a `failure-report` artifact, then a post when one is set.

    A hook must not fail the run a second time: every error here is logged and swallowed on purpose.
    """
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import ArtifactCreate
    from prefect.logging.handlers import APILogHandler

    try:
        APILogHandler().flush()  # the failed step's last lines are still queued in this process
        with get_client(sync_client=True) as client:
            flow_run = client.read_flow_run(flow_run.id)  # the final state, with its message
            report = failure_report(client, flow_run)
            client.create_artifact(ArtifactCreate(key="failure-report", type="markdown", data=report.markdown(),
                                                  description=f"why {flow_run.name} failed",
                                                  flow_run_id=flow_run.id))
            url = destination(client, flow_run.parameters or {})
        if url:
            post(url, report)
            log.info("failure of %s posted", flow_run.name)
    except Exception:  # noqa: BLE001 - see the docstring
        log.exception("eaglet: could not report the failure of flow run %s", getattr(flow_run, "name", "?"))
