"""Promotion: read the current draft's record, and switch `drafts/current` to a better draft.

    current = current_draft(ctx)               # CurrentDraft | None: its folder and recorded figures
    decision = promote_if_better(ctx, draft_dir, figures, metric="acceptance_length", margin=0.05, floor_margin=0.1)

The decision and the switch run on the host (remote/evaluate/promote.py) under a lock on drafts/, so the
comparison and the rename are one step there; this side only reads and reports.
"""
from __future__ import annotations

import json
import posixpath
from dataclasses import asdict

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact
from pydantic import BaseModel

from remote.evaluate.config import CURRENT, RECORD, PromoteConfig
from tasks.context import RunContext, step_task
from tasks.host import Host, open_host

STEP_TIMEOUT_S = 3600  # copying a large draft (a Kimi-K2.5 one is a few GB) onto the drafts disk


class CurrentDraft(BaseModel):
    """The promoted draft as its record tells it."""

    name: str  # its folder under drafts/ (the run that made it)
    path: str  # drafts/<name>, resolved: a warm start reads this, not the link that may move
    figures: dict  # what its evaluation measured when it was promoted
    record: dict  # the whole promotion.json


class PromotionDecision(BaseModel):
    promoted: bool
    reason: str
    metric: str
    value: float
    current_value: float | None
    current_before: str | None  # the draft that was current when the decision was taken
    current: str  # the drafts/current link on the host
    held_back_by: str | None = None  # not promoted: "no-draft floor", "random-draft floor" or "current draft"


def drafts_root(root: str) -> str:
    return posixpath.join(root, "drafts")


def read_current_draft(host: Host, root: str) -> CurrentDraft | None:
    """The current draft on the host, or None when nothing was promoted yet."""
    link = posixpath.join(drafts_root(root), CURRENT)
    record_path = posixpath.join(link, RECORD)
    if not host.exists(record_path):
        return None
    record = json.loads(host.read_text(record_path))
    return CurrentDraft(name=record["name"], path=posixpath.join(drafts_root(root), record["name"]),
                        figures=record.get("figures", {}), record=record)


@step_task(name="current-draft")
def current_draft(ctx: RunContext) -> CurrentDraft | None:
    with open_host(ctx.host) as host:
        current = read_current_draft(host, ctx.root)
    get_run_logger().info("current draft on %s: %s", ctx.host.display_name,
                          f"{current.name} {current.figures}" if current else "none yet")
    return current


@step_task(name="promote-if-better")
def promote_if_better(ctx: RunContext, draft_dir: str, figures: dict, *, metric: str, margin: float,
                      floor_margin: float, max_benchmark_drop: float = -1.0,
                      context: dict | None = None) -> PromotionDecision:
    """Promote the run's draft when it is above the floors (no draft, a random draft: by floor_margin) and its
    metric beats the current draft's by more than margin."""
    config = asdict(PromoteConfig(out_dir=ctx.step_dir("promote"), drafts_root=drafts_root(ctx.root),
                                  candidate_dir=draft_dir, name=ctx.run_name, figures=figures, metric=metric,
                                  margin=margin, floor_margin=floor_margin, max_benchmark_drop=max_benchmark_drop,
                                  context=context or {}))
    m = ctx.run_step("promote", config, timeout=STEP_TIMEOUT_S, title="promote")
    d = m["decision"]
    decision = PromotionDecision(promoted=d["promote"], reason=d["reason"], metric=metric, value=d["value"],
                                 current_value=d["current_value"], current_before=m["current_before"],
                                 current=m["current"], held_back_by=d.get("held_back_by"))
    create_markdown_artifact(key="promotion", markdown=promotion_markdown(ctx.run_name, decision),
                             description="the nightly's promotion decision")
    get_run_logger().info("%s: %s", "promoted" if decision.promoted else "kept the current draft", decision.reason)
    return decision


def promotion_markdown(run_name: str, d: PromotionDecision) -> str:
    verdict = f"**promoted** `{run_name}`: `drafts/current` now points at it" if d.promoted else \
        f"**not promoted** (held back by the {d.held_back_by}): `drafts/current` still points at `{d.current_before}`"
    cur = "none" if d.current_value is None else f"{d.current_value:.4f}"
    return "\n".join([
        "## Promotion", "", verdict, "", f"Reason: {d.reason}", "",
        f"| | {d.metric} |", "|---|---|",
        f"| this run's draft | {d.value:.4f} |", f"| current draft (`{d.current_before}`) | {cur} |",
    ])
