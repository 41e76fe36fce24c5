"""The held-out split's two halves (issue 35, item 2): the trainer chooses the checkpoint it publishes on
"validation", the evaluate step reports on "test", so the report's held-out figure is a test figure.

    .venv/bin/python -m pytest tests/test_heldout_parts.py -q
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from remote.capture.store import CaptureSet
from remote.draft.data import CaptureIndex
from remote.split import HELDOUT_PARTS, heldout_part, host_of, in_part, split_of
from tests.fixtures.train_inputs import hf_capture, random_chats, save_vocab

IDS = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(4000)]  # conversation hashes, as prepare's


def test_the_halves_split_the_heldout_samples_evenly_and_cut_across_the_other_choices():
    held = [s for s in IDS if split_of(s, 500) == "heldout"]
    val = {s for s in held if heldout_part(s) == "validation"}
    assert 0.45 < len(val) / len(held) < 0.55
    for host in (0, 1):  # each host of a two-host run holds both halves
        mine = [s for s in held if host_of(s, 2) == host]
        assert 0.4 < sum(s in val for s in mine) / len(mine) < 0.6
    assert {heldout_part(s) for s in ("s7", "s8", "s9", "s10")} <= set(HELDOUT_PARTS)  # any id has one


def test_a_half_with_no_sample_falls_back_to_the_whole_heldout_split():
    val = [s for s in IDS[:50] if heldout_part(s) == "validation"][:3]
    assert in_part(val, "validation") == ([0, 1, 2], "validation")
    assert in_part(val, "test") == ([0, 1, 2], "heldout")
    assert in_part([], "test") == ([], "heldout")
    mixed = IDS[:40]
    v, t = in_part(mixed, "validation")[0], in_part(mixed, "test")[0]
    assert v and t and not set(v) & set(t) and sorted(v + t) == list(range(40))


def test_the_trainer_chooses_on_validation_and_the_evaluate_step_reads_test(tiny_llama, tmp_path):
    """A real capture of 32 samples, 12 held out: the trainer's held-out index and the evaluate step's are the
    two halves, disjoint, together the held-out split; the published draft's manifest names its half."""
    from remote.step import load_config
    from remote.train.state import Distributed
    from remote.train.train import TrainConfig, Trainer
    from remote.train.train import run as train_run

    vocab = json.loads((tiny_llama / "config.json").read_text())["vocab_size"]
    seqs, masks = random_chats(32, vocab, seed=3)
    cap = hf_capture(tiny_llama, seqs, masks, tmp_path / "capture", heldout=12)
    cfg = {"capture_dir": str(cap), "vocab_dir": str(save_vocab(seqs, masks, vocab, 200, tmp_path / "vocab")),
           "ttt_steps": 2, "eval_k": 2, "token_budget": 96, "max_steps": 2, "eval_every": 1, "eval_tokens": 10_000,
           "checkpoint_every": 1, "seed": 1, "device": "cpu", "out_dir": str(tmp_path / "train")}
    (tmp_path / "stage").mkdir()
    trainer = Trainer(load_config(TrainConfig, cfg), Distributed.from_env("cpu"), tmp_path / "stage")
    chosen_on = {r.sample_id for r in trainer.heldout.refs}
    reported = CaptureIndex.build(CaptureSet.from_manifest(cap), split="heldout", part="test")
    held = {f"s{i}" for i in range(20, 32)}
    assert trainer.heldout.part == "validation" and reported.part == "test"
    assert chosen_on and not chosen_on & {r.sample_id for r in reported.refs}
    assert chosen_on | {r.sample_id for r in reported.refs} == held
    m = train_run(cfg)
    assert m["train"]["chosen_on"] == "validation" and m["figures"]["best_step"] in (1, 2)


def test_a_capture_with_one_heldout_sample_reports_on_it_as_the_whole_split(tmp_path):
    from tests.fixtures.train_inputs import write_capture
    from remote.capture.store import Sample

    H, layers = 8, (0, 1, 2)
    lone = next(f"s{i}" for i in range(100) if heldout_part(f"s{i}") == "validation")
    samples = [Sample(sid, split, torch.arange(6, dtype=torch.int32), torch.ones(6, dtype=torch.uint8),
                      torch.randn(6, 3 * H), torch.randn(6, H)) for sid, split in (("a", "train"), (lone, "heldout"))]
    cap = CaptureSet.from_manifest(write_capture(samples, tmp_path / "c", layers, 4, H, Path("t")))
    assert CaptureIndex.build(cap, "heldout", part="validation").part == "validation"
    test = CaptureIndex.build(cap, "heldout", part="test")
    assert test.part == "heldout" and [r.sample_id for r in test.refs] == [lone]
