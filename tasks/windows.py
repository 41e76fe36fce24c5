"""Capture in windows, on the controller: the plan (remote.train.windows) and the loop the flow runs.

    plan = plan_windows(ctx, target, dataset, capture, train)    # -> WindowPlan (windows empty: none needed)
    heldout, trained = train_in_windows(ctx, target, dataset, capture, vocab, train, plan)

When the captured states would pass `capture.max_disk_gb`, the flow captures the held-out samples once
(kept for the trainer's evaluations and the evaluate step), then for each window: captures its samples,
trains its steps (one optimizer and schedule over the run: each window goes on from the last one's
checkpoint in <run>/train-checkpoints), frees its shards. Each is its own task run, so the loop reads in
the Prefect UI as capture / train / free per window; a progress artifact follows the run's steps. A
window whose training and free finished in an earlier run of this flow (same config) is skipped, capture
and all. A run killed in a window resumes it where it stopped: the capture from the cache, the training from
its checkpoint; a window trained but not freed (killed in between) is freed first (its capture and training
found finished), so the next window's disk plan does not count its states. Capture and training alternate.
"""
from __future__ import annotations

import json
import posixpath
from dataclasses import asdict

from prefect import get_run_logger
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from pydantic import BaseModel

from remote.capture.config import CaptureOptions
from remote.config import TargetOptions, pick
from remote.step import MANIFEST, as_recorded, with_defaults
from remote.train.config import HELDOUT_IDS, TrainConfig, TrainOptions, WindowsConfig, window_ids_file
from tasks.capture import CapturedStates, capture_hidden_states, free_capture
from tasks.context import RunContext, step_task
from tasks.host import open_host
from tasks.prepare import PreparedData
from tasks.train import DraftVocabInfo, TrainedDraft, train_config, train_draft

WINDOWS_TIMEOUT_S = 3600  # a pass over data.parquet


class WindowPlan(BaseModel):
    path: str  # the windows step folder on the host
    windows: list[dict]  # epoch, last_epoch, first_step, last_step, samples, tokens, bytes; empty: no windows needed
    total_steps: int
    figures: dict  # bytes_per_token, budget_bytes, heldout_bytes, train_bytes, largest_window_bytes


def windows_config(out_dir: str, target: TargetOptions, dataset: PreparedData, capture: CaptureOptions,
                   train: TrainOptions) -> dict:
    return asdict(WindowsConfig(dataset=dataset.path, target=target.model, out_dir=out_dir,
                                capture=asdict(CaptureOptions(**pick(CaptureOptions, capture))),
                                train=asdict(TrainOptions(**pick(TrainOptions, train)))))


@step_task(name="plan-windows")
def plan_windows(ctx: RunContext, target: TargetOptions, dataset: PreparedData, capture: CaptureOptions,
                 train: TrainOptions) -> WindowPlan:
    """Whether the states fit the disk budget, and if not, the windows that do (a sample that cannot fails here)."""
    out_dir = ctx.step_dir("windows")
    m = ctx.run_step("windows", windows_config(out_dir, target, dataset, capture, train), timeout=WINDOWS_TIMEOUT_S,
                     title="Planning capture windows")
    f = m["figures"]
    get_run_logger().info("disk budget %d bytes: %s (train states %d bytes, held-out %d)", f["budget_bytes"],
                          f"{len(m['windows'])} windows of at most {f['largest_window_bytes']} bytes"
                          if m["windows"] else "no windows needed", f["train_bytes"], f["heldout_bytes"])
    return WindowPlan(path=out_dir, windows=m["windows"], total_steps=m["counts"]["total_steps"], figures=f)


def train_in_windows(ctx: RunContext, target: TargetOptions, dataset: PreparedData, capture: CaptureOptions,
                     vocab: DraftVocabInfo, train: TrainOptions, plan: WindowPlan) -> tuple[CapturedStates, TrainedDraft]:
    """(the held-out capture, the last window's training: the draft) of the loop described above."""
    log = get_run_logger()
    heldout = capture_hidden_states(ctx, target, dataset, capture, "capture-heldout",
                                    posixpath.join(plan.path, HELDOUT_IDS))
    progress = create_progress_artifact(0.0, key="capture-windows", description=f"{len(plan.windows)} windows")
    for w, window in enumerate(plan.windows):
        wiring = dict(windows=plan.path, window=w, checkpoint_dir=ctx.step_dir("train-checkpoints"))
        folder = f"train-w{w:03d}"
        trained = _finished(ctx, w, train_config(ctx.step_dir(folder), target, ctx.step_dir(f"capture-w{w:03d}"),
                                                  vocab, train, **wiring))
        if trained is None:  # the capture and training found finished (killed before the free) are reused
            captured = capture_hidden_states(ctx, target, dataset, capture, f"capture-w{w:03d}",
                                             posixpath.join(plan.path, window_ids_file(w)))
            trained = train_draft(ctx, target, captured, vocab, train, None, folder, **wiring)
            free_capture(ctx, captured)
        done = 100 * window["last_step"] / plan.total_steps
        update_progress_artifact(progress, done, description=f"window {w + 1} of {len(plan.windows)} trained")
        epochs = sorted({window["epoch"], window.get("last_epoch", window["epoch"])})  # it may run across an epoch's end
        log.info("window %d of %d trained (epoch %s, steps %d..%d, %d samples): %.0f%% of the run's steps",
                 w + 1, len(plan.windows), "-".join(map(str, epochs)), window["first_step"] + 1, window["last_step"],
                 window["samples"], done)
        if trained.final:  # the run's last step, or stopped early: the draft is published
            break
    return heldout, trained


def _finished(ctx: RunContext, w: int, config: dict) -> TrainedDraft | None:
    """Window w's training, when an earlier run of this flow finished it with the same config (remote.step's rule)
    and freed its states; None: the window is still to run, or to finish (the free after a kill)."""
    folder, freed = ctx.step_dir(f"train-w{w:03d}"), ctx.step_dir(f"free-w{w:03d}")
    with open_host(ctx.host) as host:
        if not host.exists(posixpath.join(folder, MANIFEST)):
            return None
        m = json.loads(host.read_text(posixpath.join(folder, MANIFEST)))
        if not host.exists(posixpath.join(freed, MANIFEST)):
            get_run_logger().info("%s: trained in an earlier run, its states not freed: freeing them first", folder)
            return None
    if with_defaults(TrainConfig, m.get("config")) != as_recorded(config):
        return None  # the step itself refuses another config, by name
    get_run_logger().info("%s: already trained in an earlier run (its capture is skipped)", folder)
    return TrainedDraft.from_manifest(folder, m)
