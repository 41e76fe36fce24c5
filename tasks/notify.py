"""Make a failed run loud: which step failed, its error and the last log lines of that step, in the UI
and, through a Prefect automation, in the user's channel.

    @flow(on_failure=[notify_failure], on_crashed=[notify_failure])
    def train_draft(...): ...

The hook writes the run's `failure-report` artifact and emits the Prefect event `eaglet.run.failed`
with the report in its payload. The automation `eaglet: a run failed` sends every such event to a
notification block (the webhook URL lives in the block: Slack, Teams, Mattermost, a custom webhook).
prefect.yaml declares it with the deployments: its build step `declare_failure_automation` creates
or updates it at every `prefect deploy` when the block exists (docs/DEPLOYING.md, "When a run fails").
"""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

log = logging.getLogger("eaglet.notify")
LOG_TAIL = 20  # log lines of the failed step in the report (the remote lines carry the host prefix)
EVENT = "eaglet.run.failed"
AUTOMATION = "eaglet: a run failed"
BLOCK = "custom-webhook/eaglet-failures"  # <block type slug>/<block name>: prefect.yaml's default
_said: set[str] = set()  # what declare_failure_automation printed: `prefect deploy --all` runs it once a deployment


@dataclass(frozen=True)
class FailureReport:
    flow_run: str  # the run's name
    flow_run_id: str
    state: str  # Failed, Crashed, ...
    message: str  # the run's state message
    failed_step: str | None  # the first task run that failed (in a subflow too), None when no task failed
    step_message: str | None  # its state message: the error, with the remote stderr tail
    log_tail: list[str]  # the failed step's last log lines
    url: str | None = None  # the run's page in the Prefect UI (PREFECT_UI_URL; None when unknown)

    def markdown(self) -> str:
        lines = [f"## eaglet run `{self.flow_run}` {self.state.lower()}", "", self.message or "", ""]
        if self.url:
            lines += [f"[The run in the Prefect UI]({self.url})", ""]
        if self.failed_step:
            lines += [f"**Failed step:** `{self.failed_step}`", "", "```", self.step_message or "", "```", ""]
        if self.log_tail:
            lines += ["**Last log lines of that step:**", "", "```", *self.log_tail, "```"]
        return "\n".join(lines)


def failure_report(client, flow_run) -> FailureReport:
    """What failed in this run and its subflows, read back from the Prefect API."""
    from prefect.client.schemas.filters import FlowRunFilter, LogFilter, TaskRunFilter
    from prefect.client.schemas.sorting import LogSort, TaskRunSort
    from prefect.utilities.urls import url_for

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
        step_message=(step.state.message if step and step.state else None), log_tail=tail, url=url_for(flow_run))


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


def emit_failure_event(flow_run, report: FailureReport) -> None:
    """The event the automation sends on: the flow run is its resource, the report its payload."""
    from prefect.events import emit_event

    emit_event(event=EVENT, resource={"prefect.resource.id": f"prefect.flow-run.{flow_run.id}",
                                      "prefect.resource.name": flow_run.name},
               payload={"text": report.markdown(), **asdict(report)})


def notify_failure(flow, flow_run, state) -> None:
    """Prefect on_failure / on_crashed hook: a `failure-report` artifact and an `eaglet.run.failed` event.

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
        emit_failure_event(flow_run, report)
    except Exception:  # noqa: BLE001 - see the docstring
        log.exception("eaglet: could not report the failure of flow run %s", getattr(flow_run, "name", "?"))


def declare_failure_automation(block: str = BLOCK) -> dict:
    """A `prefect deploy` build step: the automation `eaglet: a run failed` -> the notification block
    `block` ("<type slug>/<name>"), created or updated. Without the block it says so and makes nothing. Each line
    is printed once a process: `prefect deploy --all` runs the build steps once a deployment."""
    from datetime import timedelta

    from prefect.automations import Automation
    from prefect.blocks.core import Block
    from prefect.events.actions import SendNotification
    from prefect.events.schemas.automations import EventTrigger
    from prefect.exceptions import ObjectNotFound

    try:
        target = Block.load(block)
    except (ValueError, ObjectNotFound):
        _say(f"no notification block {block}: failed runs are reported in the UI only (docs/DEPLOYING.md)")
        return {"automation": ""}
    automation = Automation(
        name=AUTOMATION, description="post the failure report of every failed eaglet run to " + block,
        trigger=EventTrigger(expect={EVENT}, match={"prefect.resource.id": "prefect.flow-run.*"},
                             posture="Reactive", threshold=1, within=timedelta(0)),
        actions=[SendNotification(block_document_id=target._block_document_id,
                                  subject="eaglet run {{ event.resource.name }} failed",
                                  body="{{ event.payload.text }}")])
    try:
        automation.id = Automation.read(name=AUTOMATION).id
        automation.update()
    except ValueError:  # none by that name yet
        automation.create()
    _say(f"automation {AUTOMATION!r} -> {block}")
    return {"automation": str(automation.id)}


def _say(line: str) -> None:
    if line not in _said:
        print(line)
        _said.add(line)
