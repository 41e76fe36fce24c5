"""The nightly's memory on the host: what data it has already trained on, by sample hash.

    delta = find_new_data(ctx, ["/data/chats/"], nightly="default", heldout_permille=50)
    if delta.new: ... train on delta.train_inputs ...
    commit_night(ctx, delta, promoted=True)    # only after the night went well

remote/data/delta.py finds the new conversations on the host; committing is one atomic write of
<root>/nightly/<name>/state.json, so a night that fails anywhere before it leaves the state as it
was and the next night finds the same new data again.
"""
from __future__ import annotations

import json
import posixpath
from dataclasses import asdict

from prefect import get_run_logger
from pydantic import BaseModel

from remote.data.config import DataDeltaConfig
from remote.data.delta import EMPTY_STATE, STATE, next_state
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
    with open_host(ctx.host) as host:
        state = json.loads(host.read_text(path)) if host.exists(path) else EMPTY_STATE
        host.write_text(path, json.dumps(next_state(state, delta.manifest, ctx.run_name, **record), indent=2) + "\n")
    get_run_logger().info("committed night %s: %d new conversations", ctx.run_name, delta.new)
