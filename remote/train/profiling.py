"""What the trainer measures about itself: torch.profiler tables over a few steps, torch.compile's seconds and
graphs, and the time the garbage collector takes.

    profiled = Profiled(steps=4, start=10, dist=dist, folder=stage)   # before(step, ready) / after(step)
    compile_figures()                                                  # {"compile_seconds": ..., "compiled_graphs": ...}
"""
from __future__ import annotations

import gc
import time
from pathlib import Path

import torch

from remote.step import log
from remote.train.state import Distributed


class Profiled:
    """torch.profiler over `steps` steps, from the first step at or after `start` (numbered from 1) that is `ready`
    (a run with a deadline profiles once its pace is taken: profiled steps are slower); the ops by device time, then
    by host time, written to profile.txt in `folder` (profile.rank<N>.txt for other ranks) when the last one ends."""

    def __init__(self, steps: int, start: int, dist: Distributed, folder: Path):
        self.steps, self.start, self.dist, self.folder = steps, start, dist, folder
        self.prof, self.first, self.t0 = None, 0, 0.0

    def before(self, step: int, ready: bool) -> None:
        if not self.first and step >= self.start and ready:
            from torch.profiler import ProfilerActivity, profile

            cuda = self.dist.device.type == "cuda"
            self.prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
            self.prof.__enter__()
            self.first, self.t0 = step, time.perf_counter()

    def after(self, step: int, last: bool = False) -> None:
        """After step `step`; `last`: the run ends here (a shorter run writes what it profiled)."""
        if self.prof is None or (step < self.first + self.steps - 1 and not last):
            return
        if self.dist.device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - self.t0
        self.prof.__exit__(None, None, None)
        name = "profile.txt" if self.dist.rank == 0 else f"profile.rank{self.dist.rank}.txt"
        (self.folder / name).write_text(profile_tables(self.prof, self.dist.device.type == "cuda",
                                                       f"steps {self.first}-{step} ({wall:.3f} s)"))
        log(f"train: steps {self.first}-{step} profiled ({wall:.3f} s): {self.folder / name}")
        self.prof = None


def profile_tables(prof, cuda: bool, title: str) -> str:
    """A torch.profiler run's ops by device time (on a GPU), then by host time, 40 rows each, under `title`."""
    ka = prof.key_averages()
    keys = (["self_cuda_time_total"] if cuda else []) + ["self_cpu_time_total"]
    return "".join(f"== {title}, by {k}\n{ka.table(sort_by=k, row_limit=40)}\n" for k in keys)


def compile_figures(since: dict | None = None) -> dict:
    """This process's torch.compile so far, or since the figures `since`: seconds compiling (dynamo's own count,
    inductor's code generation and the kernels' builds included) and graphs compiled."""
    from torch._dynamo.utils import compile_times, counters

    names, seconds = compile_times(repr="csv", aggregate=True)
    now = {"compile_seconds": float(dict(zip(names, seconds)).get("_compile.compile_inner", 0)),
           "compiled_graphs": int(counters["stats"]["unique_graphs"])}
    since = since or {}
    return {"compile_seconds": round(now["compile_seconds"] - since.get("compile_seconds", 0.0), 2),
            "compiled_graphs": now["compiled_graphs"] - since.get("compiled_graphs", 0)}


class GcClock:
    """The seconds the interpreter spends collecting garbage while it lives, and how many collections, by
    generation (gc.callbacks)."""

    def __init__(self):
        self.seconds, self.count, self._t = [0.0] * 3, [0] * 3, 0.0
        gc.callbacks.append(self._tick)

    def _tick(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.seconds[info["generation"]] += time.perf_counter() - self._t
            self.count[info["generation"]] += 1

    def close(self) -> None:
        gc.callbacks.remove(self._tick)
