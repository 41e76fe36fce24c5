"""Step: plan the capture in windows, when the captured states of the train split would pass the disk budget.

    python -m remote.train.windows --config windows.config.json
    # {"dataset": "<run>/prepare/data.parquet", "target": "/models/Kimi-K2.5", "out_dir": "<run>/windows",
    #  "capture": {<the capture options>}, "train": {<the train options>}}

The training's one plan (remote.draft.data.plan_steps: every epoch's sample order and packing into
optimizer steps) is a function of the samples' lengths and the train options, so it is made here from
the prepared data before anything is captured. A window is a run of consecutive optimizer steps; its
samples are those its steps read. Windows are cut greedily so that a window's states (store.bytes_per_token
a token, fp8 aware, plus the shards' overhead: the capture's DiskPlan formula) and the held-out split's
(captured once, kept for the whole run: the trainer's evaluations and the evaluate step read them) fit
`capture.max_disk_gb`. One sample, or one step, whose states pass that is refused, naming the figures.
A window may run across an epoch's end (a sample both epochs read there is captured once): E epochs take
as many windows as their states need, not E times an epoch's, and each window saved is a capture start
(vLLM's engine) and a train start saved.

Writes windows.json (the train sample ids and lengths in the order the plan numbers them, the total
steps, each window's epochs epoch..last_epoch, steps first_step..last_step, samples, tokens and bytes) and,
when more than one window is needed, the sample ids each capture takes: heldout.ids.json and
window-NNN.ids.json (window NNN's train samples and the held-out ones, which the cache then holds).
The train step of window NNN (TrainConfig.windows, .window) trains exactly that window's steps.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from remote.capture.cache import CACHE_FILES_BYTES, INDEX_SAMPLE_BYTES, INDEX_SHARD_BYTES
from remote.capture.config import CaptureOptions
from remote.capture.layers import TargetConfig, check_layer_ids, default_layer_ids, resolve_dtype
from remote.capture.store import SHARD_HEADER_BYTES, bytes_per_token, sample_overhead, size_text, storage_of
from remote.data.dataset import read_dataset
from remote.draft.data import epochs_for, plan_steps
from remote.step import BadInput, begin_step, load_config, log, step_main, write_json_atomic
from remote.train.config import HELDOUT_IDS, TrainOptions, WindowsConfig, window_ids_file
from remote.train.window import PLAN

STEP = "windows"
SHARD_BYTES = SHARD_HEADER_BYTES + INDEX_SHARD_BYTES  # a shard's header and its index entry


# ----------------------------------------------------------------------------- the plan
@dataclass
class Window:
    """Steps first_step..last_step (optimizer steps counted from 0, last exclusive), of epochs epoch..last_epoch."""

    epoch: int
    first_step: int
    last_step: int
    last_epoch: int = 0
    samples: list[int] = field(default_factory=list)  # positions in the plan's train samples, each once
    tokens: int = 0  # of those samples: what the capture takes
    states: int = 0  # bytes of the samples' states and entries
    shards: int = 0
    held: set[int] = field(default_factory=set)  # = samples, for lookups

    @property
    def bytes(self) -> int:
        return self.states + SHARD_BYTES * self.shards

    def new(self, samples: list[int]) -> list[int]:
        """Those of `samples` this window does not hold yet (a step's samples are distinct)."""
        return [i for i in samples if i not in self.held]

    def bytes_with(self, samples: list[int], sizes: "Sizes") -> int:
        """The window's bytes once it takes one more step, of these samples."""
        new = self.new(samples)
        return sizes.bytes(len(self.samples) + len(new), self.states + sum(sizes.sample[i] for i in new))

    def add(self, epoch: int, samples: list[int], lengths: list[int], sizes: "Sizes") -> None:
        """One more optimizer step: its samples not held yet join the window's."""
        new = self.new(samples)
        self.samples += new
        self.held.update(new)
        self.tokens += sum(lengths[i] for i in new)
        self.states += sum(sizes.sample[i] for i in new)
        self.shards = sizes.shards(len(self.samples), self.states)
        self.last_step, self.last_epoch = self.last_step + 1, epoch


class Sizes:
    """Bytes of captured samples on disk: a sample's tokens x bytes per token and its entry; each shard's
    header, shards closing by count (samples_per_shard) or size (max_shard_gib), as the cache plans them."""

    def __init__(self, ids: list[str], splits: list[str], lengths: list[int], bpt: int, capture: CaptureOptions):
        self.bpt, self.per_shard, self.shard_bytes = bpt, capture.samples_per_shard, int(capture.max_shard_gib * 2**30)
        self.sample = [n * bpt + sample_overhead(i, s) + 2 * len(i) + INDEX_SAMPLE_BYTES
                       for i, s, n in zip(ids, splits, lengths)]  # its rows, its shard entry, its index entry

    def shards(self, samples: int, states: int) -> int:
        return math.ceil(samples / self.per_shard) + states // self.shard_bytes

    def bytes(self, samples: int, states: int) -> int:
        """Bytes on disk of `samples` samples whose states and entries take `states` bytes, shards included."""
        return states + SHARD_BYTES * self.shards(samples, states)

    def of(self, samples: list[int]) -> int:
        return self.bytes(len(samples), sum(self.sample[i] for i in samples))


def run_steps(plans: list[list[list[int]]], micro: int, total_steps: int):
    """(epoch, the samples its micro-batches read) of each optimizer step the run trains, in order."""
    step = 0
    for epoch, plan in enumerate(plans):
        for s in range(len(plan) // micro):
            if step >= total_steps:
                return
            yield epoch, [i for batch in plan[s * micro:(s + 1) * micro] for i in batch]
            step += 1


def cut_windows(plans: list[list[list[int]]], micro: int, total_steps: int, lengths: list[int], sizes: Sizes,
                room: int, refuse) -> list[Window]:
    """The run's optimizer steps, in order, cut greedily into windows whose states fit `room` bytes (across
    epochs' ends). `refuse(samples, size)` names what cannot fit alone (one step's samples)."""
    windows: list[Window] = []
    for step, (epoch, samples) in enumerate(run_steps(plans, micro, total_steps)):
        alone = sizes.of(samples)
        if alone > room:
            refuse(samples, alone)
        if not windows or windows[-1].bytes_with(samples, sizes) > room:
            windows.append(Window(epoch, step, step))
        windows[-1].add(epoch, samples, lengths, sizes)
    return windows


# ----------------------------------------------------------------------------- the step
def run(raw: dict) -> dict:
    cfg, out, done = begin_step(WindowsConfig, raw, STEP)
    if done is not None:
        return done
    capture = load_config(CaptureOptions, cfg.capture, where="windows config: capture")
    train = load_config(TrainOptions, cfg.train, where="windows config: train")
    target = TargetConfig.read(cfg.target)
    layer_ids = check_layer_ids(capture.layer_ids if capture.layer_ids is not None
                                else default_layer_ids(target.num_layers), target.num_layers)
    storage = storage_of(resolve_dtype(capture, target), capture.storage_dtype)
    bpt = bytes_per_token(len(layer_ids), target.hidden_size, storage)
    samples = read_dataset(cfg.dataset, target.vocab_size)
    trains = [s for s in samples if s.split == "train"]
    heldout = [s for s in samples if s.split == "heldout"]
    if not trains:
        raise BadInput(f"dataset {cfg.dataset} has no train samples")
    ids, lengths = [s.sample_id for s in trains], [int(s.input_ids.size) for s in trains]
    micro = train.nproc_per_node * train.grad_accum
    plans, total = plan_steps(lengths, train, micro, epochs_for(train, sum(min(n, train.token_budget) for n in lengths)))
    budget = int(capture.max_disk_gb * 1e9)
    held = Sizes([s.sample_id for s in heldout], ["heldout"] * len(heldout), [int(s.input_ids.size) for s in heldout],
                 bpt, capture).of(list(range(len(heldout)))) if heldout else 0
    sizes = Sizes(ids, ["train"] * len(ids), lengths, bpt, capture)
    room = budget - held - CACHE_FILES_BYTES if budget else 2**62
    figures = f"{bpt} bytes a token ({storage}); budget capture.max_disk_gb {size_text(budget)}; the held-out samples' states {size_text(held)}; the cache's own files {size_text(CACHE_FILES_BYTES)}"
    if budget and room <= 0:
        raise BadInput(f"the held-out samples' states need {size_text(held)} ({len(heldout)} samples, {bpt} bytes a token, "
                       f"{storage}): the budget capture.max_disk_gb {size_text(budget)} cannot hold them; raise it, use "
                       "storage_dtype fp8, or hold out fewer samples (data.heldout_permille)")

    def refuse(step_samples: list[int], size: int) -> None:
        big = max(step_samples, key=lambda i: sizes.sample[i])
        if sizes.of([big]) > room:
            raise BadInput(f"sample {ids[big]} alone needs {size_text(sizes.of([big]))} of states ({lengths[big]} tokens x "
                           f"{figures}, {size_text(room)} left for a window): raise capture.max_disk_gb, use "
                           "storage_dtype fp8, or cut samples shorter (data.max_length)")
        raise BadInput(f"one optimizer step's {len(step_samples)} samples need {size_text(size)} of states ({figures}, "
                       f"{size_text(room)} left for a window): raise capture.max_disk_gb, or take fewer tokens a step "
                       "(train.token_budget, grad_accum)")

    windows = cut_windows(plans, micro, total, lengths, sizes, room, refuse)
    needed = len(windows) > 1  # one window: the states of every epoch fit at once, captured once
    if needed and train.max_seconds:  # the train step would refuse it, after a window's capture
        raise BadInput(f"train.max_seconds {train.max_seconds:g}: the states need {len(windows)} windows under "
                       f"capture.max_disk_gb, and a run in windows plans its captures from its steps, which a deadline "
                       "would cut; set a token or epoch budget, or a disk budget the states fit")
    stage = out.open()
    write_json_atomic(stage / PLAN, {"train_ids": ids, "lengths": lengths, "total_steps": total, "epochs": len(plans),
                                     "windows": [_summary(w) for w in windows] if needed else []})
    if needed:
        heldout_ids = [s.sample_id for s in heldout]
        write_json_atomic(stage / HELDOUT_IDS, heldout_ids)
        for n, w in enumerate(windows):
            write_json_atomic(stage / window_ids_file(n), heldout_ids + [ids[i] for i in w.samples])
    largest = max(w.bytes for w in windows)
    log(f"windows: {len(windows) if needed else 'no'} windows over {len(plans)} epoch(s) of {total} steps; the largest "
        f"needs {size_text(largest)}; {figures}")
    return out.publish(
        counts={"windows": len(windows) if needed else 0, "epochs": len(plans), "total_steps": total,
                "train_samples": len(trains), "heldout_samples": len(heldout)},
        figures={"bytes_per_token": bpt, "budget_bytes": budget, "heldout_bytes": held,
                 "train_bytes": sizes.of(list(range(len(ids)))), "largest_window_bytes": largest},
        windows=[_summary(w) for w in windows] if needed else [])


def _summary(w: Window) -> dict:
    return {k: v for k, v in asdict(w).items() if k not in ("samples", "states", "shards", "held")} | {
        "samples": len(w.samples), "bytes": w.bytes}


def main(argv: list[str] | None = None) -> int:
    return step_main(STEP, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
