"""Compile ahead: the compiled train step's graphs made while the capture still runs.

    python -m bench.warm --config c.json
    # {"target": "/models/smollm2", "train": {"token_budget": 8192, "ttt_steps": 3, ...},
    #  "draft_vocab_size": 32000, "out_dir": "/runs/r1/warm"}

On a GPU host the trainer's first compiled step costs 70-90 s of compiling (a SmolLM2 draft, 8,192 tokens a
step, an H200), paid after the capture, inside the run's budget. Inductor and Triton keep what they compile in
their caches on disk, keyed by the graphs, so a second process that builds the same graphs reads them back (the
same step's first step took 7 s with a warm cache). The graphs depend on the shapes and settings alone: the
target's hidden size and vocabulary, the draft vocabulary's size, three aux layers, the train settings (the
batch is padded to token_budget), none of which waits for the capture. So this step runs the trainer itself,
two steps and two held-out evaluations, on synthetic states of that shape, beside the capture; the real run's
first step then finds its graphs compiled.

It runs niced (`nice`, 10 by default; its compile workers with it), so the capture it shares the host with keeps
the CPU it needs. Writes out_dir/manifest.json (figures: seconds, the trainer's compile seconds and graphs, the
niceness it ran at) through out_dir.partial, like every step; the synthetic inputs and the short run's draft are
removed.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from remote.capture.layers import TargetConfig, check_layer_ids, default_layer_ids
from remote.capture.store import Sample, write_shard
from remote.config import Checked, bounded
from remote.step import StepOutput, begin_step, log, step_main, write_json_atomic
from remote.train.config import TrainConfig
from remote.train.vocab import choose_vocab

STEP = "warm"
# what the short run may not take from the real one: its own budget, inputs, deadline and outputs
OWN = {"max_steps": 2, "train_tokens": 0, "epochs": 0.0, "max_seconds": 0.0, "eval_every": 1, "patience": 0,
       "profile_steps": 0, "checkpoint_every": 10 ** 9, "warm_start": "", "windows": "", "window": 0}


@dataclass(frozen=True, kw_only=True)
class WarmConfig(Checked):
    target: str
    """the target's folder (config.json: hidden size, layers, vocabulary; the head's weights)"""
    out_dir: str
    """where manifest.json goes (through out_dir.partial)"""
    train: dict = field(default_factory=dict)
    """the real train step's settings (what shapes its graphs); budget, deadline and folders are the warm run's own"""
    draft_vocab_size: int = bounded(32000, ge=2)
    """the vocab step's draft_vocab_size"""
    layer_ids: list[int] | None = None
    """the capture's layer_ids; None: its default for the target (EAGLE-3's three)"""
    doc_tokens: tuple[int, int] = (64, 1024)
    """the synthetic samples' shortest and longest length (they are packed and padded as real ones are)"""
    nice: int = bounded(10, ge=0, le=19)
    """the process's niceness, at least (its compile workers inherit it): the capture beside it is bound by its
    own host thread's launches; on an H200 host it took 175 s beside a cold compile at its own priority, 96 s
    beside a cached one"""


def synthetic_inputs(cfg: WarmConfig, folder: Path, budget: int) -> tuple[Path, Path]:
    """A finished capture folder (random states of the target's shape, train and held-out samples enough for two
    steps of `budget` tokens and an evaluation) and a vocab folder of draft_vocab_size ids, in `folder`."""
    t = TargetConfig.read(cfg.target)
    layers = check_layer_ids(cfg.layer_ids, t.num_layers) if cfg.layer_ids else default_layer_ids(t.num_layers)
    g = torch.Generator().manual_seed(0)
    lo, hi = cfg.doc_tokens
    samples, tokens = [], {"train": 0, "heldout": 0}
    for split, want in (("train", 3 * budget), ("heldout", budget)):
        while tokens[split] < want:
            n = int(torch.randint(lo, hi + 1, (1,), generator=g))
            samples.append(Sample(f"w{len(samples)}", split, torch.randint(0, t.vocab_size, (n,), generator=g,
                                                                           dtype=torch.int32),
                                  torch.ones(n, dtype=torch.uint8),
                                  torch.randn(n, len(layers) * t.hidden_size, generator=g).bfloat16(),
                                  torch.randn(n, t.hidden_size, generator=g).bfloat16()))
            tokens[split] += n
    capture = folder / "capture"
    capture.mkdir(parents=True)
    shard = capture / "shard-00000.safetensors"
    write_shard(shard, samples, layers)
    write_json_atomic(capture / "manifest.json", {
        "step": "capture", "fingerprint": "warm", "capture": {
            "shards": [str(shard)], "layer_ids": list(layers), "hidden_size": t.hidden_size, "dtype": "bfloat16",
            "target": cfg.target}})
    vocab = folder / "vocab"
    vocab.mkdir()
    choose_vocab(torch.randint(0, 1000, (t.vocab_size,), generator=g), cfg.draft_vocab_size).save(
        vocab / "vocab.safetensors")
    return capture, vocab


def warm(cfg: WarmConfig, out: StepOutput) -> dict:
    from remote.train import train as trainer  # torch.compile's imports: after the step's own checks

    os.setpriority(os.PRIO_PROCESS, 0, max(cfg.nice, os.getpriority(os.PRIO_PROCESS, 0)))
    stage = out.open()
    work = stage / "inputs"
    shutil.rmtree(work, ignore_errors=True)
    budget = int(cfg.train.get("token_budget", TrainConfig.token_budget))
    capture, vocab = synthetic_inputs(cfg, work, budget)
    run = {**cfg.train, **OWN, "capture_dir": str(capture), "vocab_dir": str(vocab), "target": cfg.target,
           "out_dir": str(work / "train"), "eval_tokens": budget}
    log(f"warm: two train steps on synthetic states of {cfg.target}'s shape, to compile ahead")
    m = trainer.run(run) or {}
    figures = {k: v for k, v in m.get("figures", {}).items() if k in ("compile_seconds", "compiled_graphs",
                                                                        "train_seconds")}
    shutil.rmtree(work, ignore_errors=True)
    return out.publish(counts={"steps": m.get("counts", {}).get("steps", 0)},
                       figures={**figures, "nice": os.getpriority(os.PRIO_PROCESS, 0)})


def run(raw: dict) -> dict | None:
    cfg, out, done = begin_step(WarmConfig, raw, STEP)
    return done if done is not None else warm(cfg, out)


def main(argv: list[str] | None = None) -> int:
    return step_main(STEP, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
