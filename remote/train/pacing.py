"""The trainer's deadline (max_seconds): the total of steps cut to what fits at the pace the run measures, and set
again every few steps as the pace moves. A part of remote.train.train's Trainer (its base class): it reads the
trainer's step, plan and timings and sets its end.

    class Trainer(DeadlinePacing): ...
    self._meet_deadline(rec)   # once the pace is taken: the first cut
    self._hold_deadline(rec)   # after it, every few steps
"""
from __future__ import annotations

import math
import statistics
import time

import torch

from remote.step import log


class DeadlinePacing:
    """Deadline pacing over the Trainer's state (cfg, dist, step, end_step, total_steps, planned_steps, paced, met,
    held, loop_s, told, apart_s, saves, saves_s, eval_s, eval_every, heldout, evaluated, evaluate(), t0)."""

    def _meet_deadline(self, rec: dict) -> None:
        """With max_seconds: once 8 steps after the first two (compiling) have taken 5% of it (and, when checkpoints
        are due before the end, one has been written among them, or 25% has passed), the total is cut to
        what fits in the time left at their pace, less the held-out evaluations still to come (one is
        timed now, its figures not kept; the process's first one compiles, so it runs first, untimed). Every rank
        takes the smallest total any rank found."""
        cfg, paced = self.cfg, self.paced
        if self.met or len(paced) < 10:
            return
        now = time.perf_counter()
        waited = now - paced[2]
        saves_ahead = cfg.checkpoint_every < self.total_steps - self.step  # then a save's time belongs in the pace
        ok = waited >= 0.05 * cfg.max_seconds and (not saves_ahead or self.saves > 0 or waited >= 0.25 * cfg.max_seconds)
        ready = torch.tensor(int(ok), device=self.dist.device)
        if not int(self.dist.all_reduce(ready, "min")):  # every rank decides at the same step, or none does
            return
        # the steps' own time and what comes with them (logs, saves), not the evaluations among them (the first one
        # compiles: on an H200 it made a 42.7-ms step look like 62.5 ms, and the run ended 27% short of its deadline)
        step_s = (now - paced[2] - self.apart_s) / (len(paced) - 2)
        eval_s = 0.0
        if cfg.eval_tokens and self.heldout is not None:
            if not self.evaluated:
                self.evaluate()
            t = time.perf_counter()
            self.evaluate()
            eval_s = self.eval_s = time.perf_counter() - t
        left = cfg.max_seconds - (time.perf_counter() - self.t0)
        steps = max(0.0, left / step_s)
        every = cfg.eval_every or max(1.0, (self.step + steps) / 20)  # at the cut total's pace
        evals = 1 + steps / every if eval_s else 0  # the last one too
        fit = self._fit(left, evals * eval_s, step_s, least=self.step + 1)
        total = int(self.dist.all_reduce(torch.tensor(min(fit, self.total_steps), device=self.dist.device), "min"))
        rec["deadline"] = {"total_steps": total, "planned_steps": self.total_steps, "step_s": round(step_s, 5),
                           "eval_s": round(eval_s, 3), "seconds_left": round(left, 1)}
        log(f"train: max_seconds {cfg.max_seconds:g}: {step_s * 1000:.1f} ms a step, {eval_s:.2f} s an evaluation, "
            f"{left:.0f} s left at step {self.step}: {total} steps of the {self.total_steps} planned")
        self.told = total
        self._cut_to(total)
        self.held, self.loop_s = self.step, []

    def _hold_deadline(self, rec: dict) -> None:
        """After the cut, every few steps: the total is set again to what fits at the steps' pace since the last
        check, the evaluations and checkpoints still to come counted apart at their own. A host-bound step is as
        fast as the host lets it be, and the host's pace moves: on an H200 a run's steps drifted from 43 to 60 ms
        after its cut and it ran 55 s past its deadline (so slower steps cut again; past the deadline, the run ends
        at this step), and runs whose cut was taken in a slow spell (62-69 ms, then mostly 54-59 ms) ended
        30-60 s before theirs (so faster ones move the end back up, never past the plan, and only by more than a
        re-check's worth of steps: the total does not flap). The pace is the median of the steps since the last
        check (each its seconds in the loop, evaluations, checkpoints and profile writes apart): a slow spell moves
        it, one slow step does not (a run cut at 8,063 steps was cut to 4,439 by one when the pace was the window's
        mean); what such a step cost is gone from the time left. Every rank takes the smallest total any found."""
        cfg, every = self.cfg, max(5, min(50, self.total_steps // 40))
        if self.held is None:  # a resumed run that met its deadline before: its pace is taken from here
            self.held = self.step
            return
        if self.step - self.held < every or self.step >= self.end_step:
            return
        step_s = statistics.median(self.loop_s) if self.loop_s else rec["seconds"]
        self.held, self.loop_s = self.step, []
        left = cfg.max_seconds - (time.perf_counter() - self.t0)

        def others(todo: int) -> float:  # evaluations and checkpoints in `todo` steps; the last step has both
            return ((todo / self.eval_every + 1) * self.eval_s +
                    (todo // cfg.checkpoint_every + 1) * self.saves_s / max(1, self.saves))

        todo = self.end_step - self.step
        ahead = others(todo)
        if todo * step_s + ahead > left:  # past the deadline: this step is the last
            fit = self._fit(left, ahead, step_s, least=self.step + (left > ahead))
        else:  # room for more steps: counted with the evaluations and checkpoints they bring
            fit = self._fit(left, ahead, step_s, least=self.end_step)
            fit = self._fit(left, others(fit - self.step), step_s, least=self.end_step)
        # every rank checks at the same steps and takes part, whatever it found (or the collective would hang)
        total = int(self.dist.all_reduce(torch.tensor(min(fit, self.planned_steps), device=self.dist.device), "min"))
        if self.end_step <= total < self.end_step + max(every, math.ceil(0.01 * self.end_step)):
            return  # fits, and not by enough steps to move the end
        rec["recut"] = {"total_steps": total, "was": self.end_step, "step_s": round(step_s, 5),
                        "seconds_left": round(left, 1)}
        # every re-cut is in the step's record; the log tells the ones that move the end by 10% since it last told
        # one, and the last step (a host's pace flaps: an H100 run re-cut 90 times in 6 minutes at 41-58 ms a step)
        if total == self.step or abs(total - self.told) >= 0.1 * max(1, self.told):
            log(f"train: max_seconds {cfg.max_seconds:g}: {step_s * 1000:.1f} ms a step lately, {left:.0f} s left at "
                f"step {self.step}: {total} steps instead of {self.told or self.end_step}")
            self.told = total
        self._cut_to(total)

    def _fit(self, left: float, others: float, step_s: float, least: int) -> int:
        """The last step that fits in `left` seconds, `others` of them for evaluations and checkpoints still to
        come, at `step_s` a step, 2% kept in hand; at least `least`."""
        return max(least, self.step + int((left - others) * 0.98 / step_s))

    def _cut_to(self, total: int) -> None:
        """The run ends at step `total` (no later than planned); the schedule falls to its floor there."""
        self.met = True
        self.total_steps = self.end_step = min(total, self.planned_steps)
        self.eval_every = self.cfg.eval_every or max(1, math.ceil(self.total_steps / 20))
