"""The capture backends' one interface, and the one place that names them.

A backend is one file (`backend_<name>.py`) with a class taking the same constructor arguments:

    engine = Backend(cfg, target, dtype, layer_ids, max_len)   # cfg: remote.capture.config.CaptureConfig
    engine.start()                                             # load the target; sets startup_s
    detail = engine.capture(plans, on_written, progress)       # write each planned shard; on_written(plan)
    engine.layers_path                                         # where it hooked the decoder layers
    engine.close()                                             # end everything start() began

Adding a backend: write its file and add one line to BACKENDS (remote/capture/config.py).
"""
from __future__ import annotations

import importlib
import time
from typing import Callable, Protocol, Sequence

from remote.capture.cache import ShardPlan
from remote.capture.config import BACKENDS
from remote.step import progress

PROGRESS_EVERY_S = 2.0



class Progress:
    """Counts what a backend captured and sends a progress event at most every PROGRESS_EVERY_S."""

    def __init__(self, total_samples: int, total_tokens: int):
        self.total_samples, self.total_tokens = total_samples, total_tokens
        self.samples = self.tokens = 0
        self.started = time.monotonic()
        self._sent = 0.0

    def add(self, samples: int, tokens: int) -> None:
        self.samples += samples
        self.tokens += tokens
        now = time.monotonic()
        if now - self._sent >= PROGRESS_EVERY_S or self.samples >= self.total_samples:
            self._sent = now
            progress(self.samples, self.total_samples, samples=self.samples, tokens=self.tokens,
                     total_tokens=self.total_tokens, tokens_per_s=round(self.tokens_per_s, 1))

    @property
    def seconds(self) -> float:
        return time.monotonic() - self.started

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


OnWritten = Callable[[ShardPlan], None]


class CaptureBackend(Protocol):
    startup_s: float
    layers_path: str

    def start(self) -> None: ...

    def capture(self, plans: Sequence[ShardPlan], on_written: OnWritten, prog: Progress) -> dict: ...

    def close(self) -> None: ...


def make_backend(cfg, target, dtype: str, layer_ids: Sequence[int], max_len: int) -> CaptureBackend:
    """The backend cfg.backend names, built (not started)."""
    module, _, cls = BACKENDS[cfg.backend].partition(":")
    return getattr(importlib.import_module(module), cls)(cfg, target, dtype, layer_ids, max_len)
