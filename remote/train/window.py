"""One window of the windows step's plan (windows.json), as the train step takes it: the plan's train samples
in the order it numbers them, and the optimizer steps first_step..last_step this window trains.

    window = TrainWindow.load(windows_dir, number)       # BadInput: no plan there, no such window
    local = window.positions(index, capture_dir)         # plan position -> row of this window's capture index
    window.in_capture(batch, local)                      # a micro-batch's rows (BadInput: the capture lacks one)

remote/train/windows.py makes the plan; the train step (TrainConfig.windows, .window) reads it here.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from remote.step import BadInput
from remote.train.config import window_ids_file

if TYPE_CHECKING:
    from remote.draft.data import CaptureIndex

PLAN = "windows.json"  # the windows step's plan, in its out_dir


@dataclass(frozen=True)
class TrainWindow:
    """One window of a plan, as the trainer takes it: the plan's train samples and this window's steps."""

    folder: str
    number: int
    windows: int
    first_step: int
    last_step: int
    total_steps: int
    ids: list[str]
    lengths: list[int]

    @classmethod
    def load(cls, folder: str, number: int) -> "TrainWindow":
        p = Path(folder) / PLAN
        if not p.is_file():
            raise BadInput(f"windows {folder}: no {PLAN} (expected the windows step's folder)")
        plan = json.loads(p.read_text())
        if not 0 <= number < len(plan["windows"]):
            raise BadInput(f"window {number}: the plan {p} has {len(plan['windows'])} windows")
        w = plan["windows"][number]
        return cls(folder, number, len(plan["windows"]), w["first_step"], w["last_step"], plan["total_steps"],
                   plan["train_ids"], plan["lengths"])

    def positions(self, index: CaptureIndex, capture_dir: str) -> dict[int, int]:
        """The plan's sample position -> its position in this window's capture index."""
        at = {sid: i for i, sid in enumerate(self.ids)}
        stray = [r.sample_id for r in index.refs if r.sample_id not in at]
        if stray:
            raise BadInput(f"capture {capture_dir} holds train sample {stray[0]}, which the windows plan {self.folder} "
                           "does not list: plan the windows on the data this capture was made from")
        return {at[r.sample_id]: j for j, r in enumerate(index.refs)}

    def in_capture(self, batch: list[int], local: dict[int, int]) -> list[int]:
        lacking = [self.ids[i] for i in batch if i not in local]
        if lacking:
            raise BadInput(f"window {self.number}: its capture lacks train sample {lacking[0]}, which its steps "
                           f"{self.first_step + 1}..{self.last_step} read: capture it with {window_ids_file(self.number)}")
        return [local[i] for i in batch]

    def check(self, total_steps: int) -> None:
        if total_steps != self.total_steps:
            raise BadInput(f"windows {self.folder} plan {self.total_steps} steps, this train config {total_steps}: "
                           "plan the windows with the train options this run trains with")

    def check_start(self, step: int, checkpoints: Path) -> None:
        if step < self.first_step:
            raise BadInput(f"window {self.number} starts at step {self.first_step}, but the newest checkpoint in "
                           f"{checkpoints} is at step {step}: train the windows in order")
