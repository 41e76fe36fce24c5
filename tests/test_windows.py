"""Capture in windows (issue 16, item 3) on the CPU with the tiny Llama and the transformers capture backend.

The flow itself runs in windows over SSH in tests/test_flow.py. Here the steps run as the flow's
window loop runs them (tasks/windows.py): the windows step plans, the held-out samples are captured
once, then for each window: capture its samples, train its steps, free its shards. A budget that
forces three windows, the second across the epoch's end; the bytes in the capture cache, polled while
the steps run, never pass it; every train sample is read exactly once an epoch, in the same order,
with the same losses and weights as one capture of everything and one training, and its target top-1
checked once in the run; a window's train step SIGKILLed after a checkpoint mid-window resumes on the
same steps to the same end; a sample larger than the budget is refused with the figures. The flow's own loop
(tasks/windows.py, steps as subprocesses of a local host), killed with its step at each point of a window
(mid-capture, mid-training, trained but not freed, between windows) and run again after each, ends with the
draft of an uninterrupted run, byte for byte.

    .venv/bin/python -m pytest tests/test_windows.py -x -q
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from remote.capture.cache import CACHE_FILES_BYTES
from remote.draft.data import CaptureIndex, plan_steps
from remote.split import in_part
from remote.step import EXIT_BAD_INPUT, load_config
from remote.train.config import TrainOptions
from remote.train.train import main as train_main
from tests.fixtures.capture import random_samples, write_dataset
from tests.fixtures.polling import DiskWatch
from tests.fixtures.train_inputs import save_vocab
from tests.fixtures.windows import (ControllerKilled, KillPoint, capture, in_windows, kill_at, plan, step,
                                    train_config, windows_flow)

LAYERS = [1, 3, 4]  # of the 6-layer tiny Llama
CAPTURE = {"backend": "transformers", "device": "cpu", "dtype": "float32", "layer_ids": LAYERS, "samples_per_shard": 4}
# AdamW: Muon orthogonalises each update, so states captured in other packs (1e-7 apart) end further apart than
# the 1e-5 the weights are compared at; what is tested here is the windows, not the optimiser.
TRAIN = {"ttt_steps": 2, "token_budget": 96, "optimizer": "adamw", "lr": 3e-3, "warmup_steps": 1, "epochs": 1.5, "checkpoint_every": 1000,
         "eval_every": 3, "eval_k": 2, "eval_tokens": 256, "seed": 1, "device": "cpu"}


@pytest.fixture(scope="module")
def world(tiny_llama, tmp_path_factory):
    d = tmp_path_factory.mktemp("windows")
    samples = random_samples(np.random.default_rng(3).integers(16, 48, 30).tolist(), vocab=500, seed=3)
    vocab = save_vocab([s.input_ids.tolist() for s in samples], [s.loss_mask.tolist() for s in samples], 512, 200,
                       d / "vocab")
    return {"dir": d, "target": str(tiny_llama), "dataset": str(write_dataset(d / "data.parquet", samples)),
            "vocab": str(vocab), "train_ids": {s.sample_id for s in samples if s.split == "train"},
            "heldout_ids": {s.sample_id for s in samples if s.split == "heldout"},
            "capture": CAPTURE, "train": TRAIN}


def recorder(monkeypatch, train_ids: set[str]) -> list[list[str]]:
    """The sample ids of every train batch the trainer loads, in order (held-out batches left out)."""
    seen: list[list[str]] = []
    load = CaptureIndex.load

    def recording(self, sample_idxs, *a, **k):
        ids = [self.refs[i].sample_id for i in sample_idxs]
        if set(ids) <= train_ids:
            seen.append(ids)
        return load(self, sample_idxs, *a, **k)

    monkeypatch.setattr(CaptureIndex, "load", recording)
    return seen


def losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "loss.jsonl").read_text().splitlines()]


def three_windows_budget(world, tmp: Path) -> float:
    """The held-out states and 65% of the train ones, in GB: the 1.5 epochs in three windows, the second holding
    the first epoch's end and the next one's start."""
    rc, sizes = plan(world, tmp, 0.0)  # no budget: the plan's figures, no windows
    assert rc == 0 and sizes["counts"]["windows"] == 0
    return (sizes["figures"]["heldout_bytes"] + 0.65 * sizes["figures"]["train_bytes"]) / 1e9


def first_epoch_steps(run: Path) -> int:
    lengths = json.loads((run / "windows" / "windows.json").read_text())["lengths"]
    plans, _ = plan_steps(lengths, load_config(TrainOptions, TRAIN), 1, TRAIN["epochs"])
    return len(plans[0])


def top1_checked(checkpoints: Path) -> list[str]:
    """The samples whose target top-1 each window checked (the flags it kept for the later windows)."""
    ids = []
    for p in sorted(checkpoints.glob("top1-*.safetensors")):
        with safe_open(str(p), framework="pt") as f:
            ids += json.loads(f.metadata()["sample_ids"])
    return ids


# ----------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def all_at_once(world, tmp_path_factory):
    """Capture everything, then train: what a run without a budget does (the reference of the others)."""
    run = tmp_path_factory.mktemp("all")
    with pytest.MonkeyPatch.context() as mp:
        reads = recorder(mp, world["train_ids"])
        with DiskWatch(run / "cache") as disk:
            capture(world, run, "capture")
            rc, _ = step(train_main, run, "train", train_config(world, run, str(run / "capture"), "train"))
    assert rc == 0
    return {"out": run / "train", "reads": reads, "bytes": disk.peak,
            "budget": three_windows_budget(world, tmp_path_factory.mktemp("sizes"))}


def test_a_budget_forcing_three_windows_keeps_the_disk_under_it_and_trains_as_capturing_everything(
        world, all_at_once, tmp_path, monkeypatch):
    budget = all_at_once["budget"]
    reads = recorder(monkeypatch, world["train_ids"])
    with DiskWatch(tmp_path / "cache") as disk:
        planned, trained = in_windows(world, tmp_path, budget)
    windows, epoch_end = planned["windows"], first_epoch_steps(tmp_path)
    assert [(w["epoch"], w["last_epoch"]) for w in windows] == [(0, 0), (0, 1), (1, 1)]  # the second epoch captures again
    assert windows[1]["first_step"] < epoch_end < windows[1]["last_step"]
    ids = json.loads((tmp_path / "windows" / "window-001.ids.json").read_text())
    assert len(ids) == len(set(ids))  # a sample both epochs read in the window is captured once
    assert disk.peak <= budget * 1e9 < all_at_once["bytes"], (disk.peak, budget * 1e9, all_at_once["bytes"])
    assert [m["train"]["final"] for m in trained] == [False, False, True]
    # the batches, in order, of the run that captured everything: each train sample once in the epoch
    assert reads == all_at_once["reads"]
    epoch0 = [sid for batch in reads[:epoch_end] for sid in batch]
    assert sorted(epoch0) == sorted(world["train_ids"])
    # the top-1 check once a sample in the run, as capturing everything: later windows read the flags back (of the
    # held-out samples, the validation half the trainer evaluates on)
    held = sorted(world["heldout_ids"])
    validation = {held[i] for i in in_part(held, "validation")[0]}
    assert validation < world["heldout_ids"]
    assert sorted(top1_checked(tmp_path / "checkpoints")) == sorted(world["train_ids"] | validation)
    out, ref = tmp_path / "train-w002", all_at_once["out"]
    assert losses(out) == pytest.approx(losses(ref), rel=1e-6, abs=1e-7)
    a, b = load_file(str(out / "model.safetensors")), load_file(str(ref / "model.safetensors"))
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)  # captured in other packs: 1e-7 apart
    kept = json.loads((tmp_path / "capture-heldout" / "manifest.json").read_text())["capture"]["shards"]
    assert sorted(map(str, (tmp_path / "cache").rglob("shard-*.safetensors"))) == sorted(kept)  # for the evaluation


def test_a_window_killed_mid_way_resumes_on_the_same_steps_to_the_same_checkpoint(world, all_at_once, tmp_path):
    planned, _ = in_windows(world, tmp_path, all_at_once["budget"], kill_window=1, checkpoint_every=1)
    out, ref = tmp_path / "train-w002", all_at_once["out"]
    assert losses(out) == pytest.approx(losses(ref), rel=1e-6, abs=1e-7)
    last = planned["counts"]["total_steps"]
    assert [p.name for p in (tmp_path / "checkpoints").glob("step-*")] == [f"step-{last:08d}"]
    a, b = load_file(str(out / "model.safetensors")), load_file(str(ref / "model.safetensors"))
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)  # captured in other packs: 1e-7 apart


def test_the_plan_refuses_a_sample_larger_than_the_budget_naming_the_figures(world, tmp_path, capsys):
    (tmp_path / "sizes").mkdir()
    rc, sizes = plan(world, tmp_path / "sizes", 0.0)
    held = sizes["figures"]["heldout_bytes"]
    rc, m = plan(world, tmp_path, (held + 30_000) / 1e9)  # 30 kB left: no sample of 16+ tokens x 1,029 bytes fits
    err = capsys.readouterr().err
    assert rc == EXIT_BAD_INPUT and m is None and not (tmp_path / "windows").exists()
    assert re.search(r"sample \S+ alone needs [\d,]+ bytes of states \(\d+ tokens x 1029 bytes a token \(float32\); "
                     rf"budget capture.max_disk_gb {held + 30_000:,} bytes; the held-out samples' states {held:,} bytes; the "
                     rf"cache's own files {CACHE_FILES_BYTES:,} bytes, {30_000 - CACHE_FILES_BYTES:,} bytes left for a window\)", err), err


def test_the_plan_refuses_a_deadline_when_windows_are_needed_before_any_capture(world, all_at_once, tmp_path, capsys):
    """A train deadline (max_seconds) cuts the steps that windows are planned from: refused by the plan, naming both
    settings, before a window is captured; without windows the same deadline plans as ever."""
    world = {**world, "train": {**world["train"], "max_seconds": 600}}
    rc, m = plan(world, tmp_path, all_at_once["budget"])
    err = capsys.readouterr().err
    assert rc == EXIT_BAD_INPUT and m is None and not (tmp_path / "windows").exists()
    assert re.search(r"train\.max_seconds 600: the states need 3 windows under capture\.max_disk_gb", err), err
    rc, m = plan(world, tmp_path, 0.0)
    assert rc == 0 and m["windows"] == [] and m["counts"]["windows"] == 0


# The points where the flow can die in a run in windows, in the order the run meets them: mid-capture (a shard of
# the window in the cache), mid-training (after a checkpoint), after a window's training and before its free,
# between windows (freed, the next capture not started).
KILLS = [KillPoint("capture-w000", "shard"), KillPoint("train-w000", "checkpoint"), KillPoint("free-w000", "before"),
         KillPoint("capture-w001", "before")]


@pytest.mark.slow
def test_the_flow_killed_at_each_point_of_a_run_in_windows_resumes_to_the_uninterrupted_draft(
        prefect_harness, world, tmp_path):
    """The flow's own loop (tasks/windows.py) on a local host, each step a subprocess; the controller and its step
    SIGKILLed at each point of KILLS in turn, the same run started again after each: it ends with the draft of an
    uninterrupted run, byte for byte (a window trained but not freed is freed first, not counted by the next
    window's disk plan)."""
    world = {**world, "train": {**world["train"], "checkpoint_every": 2}}  # a checkpoint mid-window
    (tmp_path / "sizes").mkdir()
    budget = three_windows_budget(world, tmp_path / "sizes")
    ref = windows_flow(world, tmp_path / "ref", budget)
    assert ref.name == "train-w002"
    run = tmp_path / "killed" / "runs" / "r"
    for point in KILLS:
        with kill_at(point), pytest.raises(ControllerKilled):
            windows_flow(world, tmp_path / "killed", budget)
        assert not (run / point.folder / "manifest.json").exists(), point
    resumed = windows_flow(world, tmp_path / "killed", budget)
    assert (resumed / "model.safetensors").read_bytes() == (ref / "model.safetensors").read_bytes()
    assert losses(resumed) == losses(ref)
