"""The nightly retrain: train on what is new, promote the draft only when it measures better.

    python -m flows.nightly --preset deployments/smollm2-local.json --set nightly.margin=0.05
    prefect deployment run 'train-draft-nightly/nightly'            # what the 02:00 UTC schedule runs

Holding the host's slot for the whole night (a manual run on the same host waits, and waits for it):
find the conversations of the data source not trained on by an earlier good night (by sample hash)
-> none: end here, saying so -> read the current draft -> the training flow on every good night's
data plus tonight's (capture reuses the cached samples, so only tonight's are captured), warm
started from the current draft or from scratch -> promote when its acceptance length is above no
draft's and a random draft's (by nightly.floor_margin; first night too) and beats the current draft's
by more than nightly.margin (and, with nightly.max_benchmark_drop >= 0, loses no benchmark set by more
than that) -> commit the night. A night that fails before the commit
leaves `drafts/current` and the nightly's memory as they were.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from pydantic import BaseModel, Field

from flows.params import (CaptureParams, DataParams, EvalParams, RendezvousParams, TargetParams, TrainDraftParams,
                          TrainParams)
from flows.run_names import flow_run_label, run_folder, tag_run
from flows.train_draft import TrainDraftResult, train_draft
from remote.config import bounded
from remote.evaluate.config import PromoteOptions
from tasks.context import RunContext
from tasks.host_slot import host_slot
from tasks.host import HostParams
from tasks.inputs import bad_input, check_inputs, exit_status, refuse_preset, refusals_fail_the_run
from tasks.nightly_data import DataDelta, commit_night, find_new_data
from tasks.notify import notify_failure
from tasks.promote import PromotionDecision, current_draft, promote_if_better
from tasks.ship import ship_code_task

HOST_WAIT_S = 600.0  # a host that does not answer at 02:00 is tried for 10 minutes (host.wait_s): a blip loses no night


@dataclasses.dataclass(frozen=True, kw_only=True)
class NightlyParams(PromoteOptions):
    """The nightly's own settings: its name, the promotion rule (PromoteOptions), the warm start."""

    name: str = bounded("default", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    """the nightly's name: its memory lives in <root>/nightly/<name>"""
    warm_start: bool = False
    """start training from the current draft (false: from scratch); lm_head rows of tokens new to the night's
    draft vocabulary start from the target's"""


class NightlyRunParams(TrainDraftParams):
    """A preset of the training flow plus the nightly's own settings (what `--preset` files hold)."""

    nightly: NightlyParams = Field(default_factory=NightlyParams)


class NightlyResult(BaseModel):
    status: str  # "no-new-data", "promoted" or "kept-current"
    run_name: str
    delta: DataDelta
    waited_for_host_s: float
    trained: TrainDraftResult | None = None
    decision: PromotionDecision | None = None


def nightly_run_label() -> str:
    """The run's name: nightly-<name>-<scheduled start>, host and target (its folder on the host is the first part)."""
    from prefect.runtime import flow_run

    nightly = flow_run.parameters.get("nightly") or {}  # the parameters as given: an object or its dict
    name = nightly.name if isinstance(nightly, NightlyParams) else nightly.get("name", NightlyParams.name)
    return flow_run_label(prefix=f"nightly-{name}-")


@flow(name="train-draft-nightly", flow_run_name=nightly_run_label, log_prints=True, persist_result=True,
      result_serializer="json", on_failure=[notify_failure], on_crashed=[notify_failure])
@refusals_fail_the_run  # bad input, a host key, a login, a host that did not answer: one line, no traceback
def nightly_retrain(
    host: HostParams = HostParams(),
    extra_hosts: list[HostParams] = [],  # noqa: B006 - Prefect parameters: never mutated
    rendezvous: RendezvousParams = RendezvousParams(),
    target: TargetParams = TargetParams(),
    data: DataParams = DataParams(),
    capture: CaptureParams = CaptureParams(),
    train: TrainParams = TrainParams(),
    eval: EvalParams = EvalParams(),
    nightly: NightlyParams = NightlyParams(),
    run_name: str = "",
) -> NightlyResult:
    """Retrain on new data; promote only a better draft."""
    if extra_hosts:  # the new-data files are written on the first host only
        return bad_input([f"extra_hosts: the nightly retrain runs on one host (got {len(extra_hosts)} extra); "
                          "leave extra_hosts empty, or run the training flow for several hosts"])
    run_name = run_folder(run_name, prefix=f"nightly-{nightly.name}-")
    tag_run(host, target)
    if problems := check_inputs([host], target, data, wait_s=HOST_WAIT_S):  # before the slot: no limit for a typo
        return bad_input(problems)
    with host_slot(host) as waited:
        code = ship_code_task(host)
        ctx = RunContext(host=host, code=code, run_name=run_name)
        delta = find_new_data(ctx, data.inputs or [_demo_data(ctx, data)], nightly=nightly.name,
                              heldout_permille=data.heldout_permille)
        if delta.new == 0:
            _report(run_name, f"No new data since the last good night: {delta.source} conversations in the "
                              "source, all trained on before. Nothing captured, trained or promoted.", delta)
            return NightlyResult(status="no-new-data", run_name=run_name, delta=delta, waited_for_host_s=waited)

        current = current_draft(ctx)
        warm = current.path if nightly.warm_start and current is not None else ""
        trained = train_draft(host=host, run_name=run_name, target=target,
                              data=dataclasses.replace(data, inputs=delta.train_inputs), capture=capture,
                              train=dataclasses.replace(train, warm_start=warm), eval=eval)
        decision = promote_if_better(ctx, trained.draft_dir, trained.figures, metric=nightly.metric,
                                     margin=nightly.margin, floor_margin=nightly.floor_margin,
                                     max_benchmark_drop=nightly.max_benchmark_drop,
                                     context={"run": run_name, "data_fingerprint": trained.data_fingerprint,
                                              "new_samples": delta.new, "warm_start": warm or None})
        commit_night(ctx, delta, promoted=decision.promoted, draft=trained.draft_dir, figures=trained.figures)
    status = "promoted" if decision.promoted else "kept-current"
    _report(run_name, f"{delta.new} new conversations trained on ({'warm start from ' + current.name if warm else 'from scratch'}). "
                      + (f"Promoted: {decision.reason}." if decision.promoted else
                         f"Not promoted, held back by the {decision.held_back_by}: {decision.reason}."), delta)
    return NightlyResult(status=status, run_name=run_name, delta=delta, waited_for_host_s=waited,
                         trained=trained, decision=decision)


def _demo_data(ctx: RunContext, data: DataParams) -> str:
    """The embedded ShareGPT sample, the training flow's own default data source."""
    from tasks.prepare import embedded_default

    return embedded_default(ctx, conversations=data.demo_conversations).data_path


def _report(run_name: str, summary: str, delta: DataDelta) -> None:
    get_run_logger().info(summary)
    rows = "\n".join(f"| {k} | {v} |" for k, v in delta.counts.items())
    create_markdown_artifact(key="nightly-report", description=f"nightly {delta.nightly}",
                             markdown=f"## Nightly `{run_name}`\n\n{summary}\n\n| data | count |\n|---|---|\n{rows}\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flows.nightly", description=nightly_retrain.__doc__)
    ap.add_argument("--preset", help="a JSON file of parameters (deployments/*.json); it may hold a 'nightly' section")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override one parameter, dotted, value as JSON or text (e.g. nightly.margin=0.1)")
    ap.add_argument("--result", help="also write the result (JSON) to this file, for scripts")
    args = ap.parse_args(argv)
    overrides = dict(_key_value(ap, item) for item in args.set)
    try:
        params = NightlyRunParams.from_preset(args.preset, overrides)
    except (OSError, ValueError) as e:  # a missing or malformed preset, a bad value (pydantic's errors are ValueErrors)
        return refuse_preset(args.preset, e)
    state = nightly_retrain(**{name: getattr(params, name) for name in NightlyRunParams.model_fields},
                            return_state=True)
    if status := exit_status(state):
        return status
    text = json.dumps(state.result().model_dump(mode="json"), indent=2)
    print(text)
    if args.result:
        Path(args.result).write_text(text + "\n")
    return 0


def _key_value(ap: argparse.ArgumentParser, item: str) -> tuple[str, object]:
    key, sep, raw = item.partition("=")
    if not sep:
        ap.error(f"--set {item!r}: expected KEY=VALUE")
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw


if __name__ == "__main__":
    sys.exit(main())
