"""The nightly's memory on the host: what data it has already trained on, by sample hash.

    delta = find_new_data(ctx, ["/data/chats/"], nightly="default", heldout_permille=50)
    if delta.new: ... train on delta.train_inputs ...
    commit_night(ctx, delta, promoted=True)    # only after the night went well

remote/data/delta.py finds the new conversations on the host; committing is one atomic write of
<root>/nightly/<name>/state.json, so a night that fails anywhere before it leaves the state as it
was and the next night finds the same new data again. Each commit publishes the trend table artifact
`nightly-trend-<name>` (per good night: data size, acceptance length, promoted or not), whose versions
the Prefect UI keeps across runs.
"""
from __future__ import annotations

import json
import posixpath
from dataclasses import asdict

import re

from prefect import get_run_logger
from prefect.artifacts import create_table_artifact
from pydantic import BaseModel

from remote.data.config import EMPTY_STATE, STATE, DataDeltaConfig, next_state
from remote.evaluate.config import HISTORY
from tasks.context import RunContext, step_task
from tasks.host import open_host

STEP_TIMEOUT_S = 3600  # hashing a few million conversations


class DataDelta(BaseModel):
    nightly: str  # the nightly's name
    state_dir: str  # <root>/nightly/<name>
    new: int  # conversations not trained on by an earlier good night
    source: int  # distinct conversations in the data source
    counts: dict  # all the step's counts (already_seen, new_heldout_left_out, bad_rows...)
    train_inputs: list[str]  # what this night trains on: every committed night's data plus this one's
    manifest: dict  # the data_delta manifest (what commit_night records)


def state_dir(root: str, nightly: str) -> str:
    return posixpath.join(root, "nightly", nightly)


@step_task(name="find-new-data")
def find_new_data(ctx: RunContext, inputs: list[str], *, nightly: str, heldout_permille: int) -> DataDelta:
    folder = state_dir(ctx.root, nightly)
    config = asdict(DataDeltaConfig(inputs=list(inputs), state_dir=folder, heldout_permille=heldout_permille,
                                    out_dir=posixpath.join(folder, "nights", ctx.run_name)))
    m = ctx.run_step("data_delta", config, timeout=STEP_TIMEOUT_S, title="find new data")
    c = m["counts"]
    get_run_logger().info("%d new conversations of %d in the source (%d seen by earlier nights)",
                          c["new"], c["source"], c["already_seen"])
    return DataDelta(nightly=nightly, state_dir=folder, new=c["new"], source=c["source"], counts=c,
                     train_inputs=m["train_inputs"], manifest={k: m[k] for k in ("new_data", "seen", "counts")})


@step_task(name="commit-night")
def commit_night(ctx: RunContext, delta: DataDelta, **record) -> None:
    """Record the night as done: its new data joins what later nights train on and skip."""
    path = posixpath.join(delta.state_dir, STATE)
    history_path = posixpath.join(ctx.root, "drafts", HISTORY)  # every promotion decision (remote/evaluate/promote.py)
    with open_host(ctx.host) as host:
        state = json.loads(host.read_text(path)) if host.exists(path) else EMPTY_STATE
        state = next_state(state, delta.manifest, ctx.run_name, **record)
        host.write_text(path, json.dumps(state, indent=2) + "\n")
        history = host.read_text(history_path).splitlines() if host.exists(history_path) else []
    get_run_logger().info("committed night %s: %d new conversations", ctx.run_name, delta.new)
    rows = trend_rows(state, [json.loads(line) for line in history if line.strip()])
    create_table_artifact(key=re.sub(r"[^a-z0-9]+", "-", f"nightly-trend-{delta.nightly}".lower()), table=rows,
                          description=f"nightly {delta.nightly}: every good night's data size, acceptance length and "
                                      "promotion, oldest first (versions of this artifact are the earlier nights)")


def trend_rows(state: dict, history: list[dict]) -> list[dict]:
    """One row a committed night: its new and total conversations, its draft's figure, whether it was promoted,
    and its acceptance length on each benchmark set a night measured (eval.benchmarks), so a night that gains on
    the held-out split but loses on a benchmark shows."""
    decisions = {h["name"]: h for h in history}  # the last decision about a run wins (a retried promotion)
    sets = sorted({k for night in state["nights"] for k in night.get("benchmarks", {})
                   if k.endswith("_acceptance_length")})
    rows, total = [], 0
    for night in state["nights"]:
        total += night["new"]
        d = decisions.get(night["run"], {})
        bench = night.get("benchmarks", {})
        rows.append({"night": night["run"], "new conversations": night["new"], "conversations trained on": total,
                     "acceptance length": None if d.get("value") is None else round(d["value"], 3),
                     "current draft before": None if d.get("current_value") is None else round(d["current_value"], 3),
                     **{k.removeprefix("bench_").removesuffix("_acceptance_length"):
                        None if bench.get(k) is None else round(bench[k], 3) for k in sets},
                     "promoted": {True: "yes", False: "no"}.get(d.get("promote"), "n/a")})
    return rows
