"""The logged loss skips (and counts) a step with no loss tokens instead of logging it as 0: the train step
on the CPU with real hidden states of the tiny Llama, most of its samples with every position masked, so
that some optimizer steps hold no loss token at all.

    .venv/bin/python -m pytest tests/test_train_loss_log.py -q
"""
from __future__ import annotations

import json

from tests.fixtures.train_inputs import events, hf_capture, random_chats, run_train, save_vocab


def test_a_step_without_loss_tokens_is_counted_not_logged_as_zero(tiny_llama, tmp_path):
    vocab = json.loads((tiny_llama / "config.json").read_text())["vocab_size"]
    seqs, masks = random_chats(16, vocab, seed=5)
    masks = [m if i % 4 == 0 else [0] * len(m) for i, m in enumerate(masks)]  # 3 samples in 4: nothing to learn
    cap = hf_capture(tiny_llama, seqs, masks, tmp_path / "capture")
    voc = save_vocab(seqs, masks, vocab, 100, tmp_path / "vocab")
    cfg = {"capture_dir": str(cap), "vocab_dir": str(voc), "out_dir": str(tmp_path / "out"), "ttt_steps": 2,
           "eval_k": 2, "token_budget": 64, "max_steps": 12, "warmup_steps": 1, "lr": 3e-3, "seed": 1,
           "device": "cpu", "checkpoint_every": 1000}
    r = run_train(cfg, tmp_path / "c.json")
    assert r.returncode == 0, r.stderr[-3000:]

    out = tmp_path / "out"
    records = [json.loads(line) for line in (out / "loss.jsonl").read_text().splitlines()]
    empty = [rec["step"] for rec in records if rec["loss_tokens"] == 0]
    assert empty, "the plan put no step of masked samples alone: pick another seed"
    assert all(rec["loss"] is None for rec in records if rec["loss_tokens"] == 0)
    assert all(rec["loss"] > 0 for rec in records if rec["loss_tokens"] > 0)

    m = json.loads((out / "manifest.json").read_text())
    assert m["counts"]["steps_without_loss_tokens"] == len(empty) and m["counts"]["steps"] == len(records)
    points = m["train"]["loss_points"]
    assert [s for s, _ in points] == [rec["step"] for rec in records if rec["loss_tokens"] > 0]
    assert all(loss > 0 for _, loss in points) and m["figures"]["final_loss"] > 0

    train = events(r.stdout, "train")
    assert train and all(e["loss"] > 0 for e in train) and not {e["step"] for e in train} & set(empty)
    progress = events(r.stdout, "progress")
    assert {e["done"] for e in progress} >= set(empty), "the steps without loss still count as progress"
    assert f"{len(empty)} of {len(records)} steps had no loss tokens" in r.stdout + r.stderr
