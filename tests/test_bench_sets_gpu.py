"""bench/bench_sets_gpu.py end to end on the CPU: the tiny Llama answers 2 prompts of every benchmark set (a few new
tokens a turn), its states are captured and eaglet's evaluator scores an exported EAGLE-3 draft on the answers.

What the figures are made of is checked through the draft's guesses: a draft that guesses the answer's own next
tokens (the target's greedy choices, so its top-1 on the captured states) scores k + 1 exactly, one that guesses
another token scores 1, and a random draft scores the same twice."""
from __future__ import annotations

import json

import pytest
import torch

from bench import bench_sets_gpu
from remote.draft.config import DraftConfig
from remote.draft.eagle3 import Eagle3
from remote.draft.folder import export_tensors, write_folder
from remote.draft.model import EagleDraft
from remote.draft.registry import kind
from remote.draft.vocab import DraftVocab

KS = [3, 5, 7]
NEW_TOKENS = 10  # an answer longer than k + 1: its chains reach every step
SETS = ["mt-bench", "gsm8k", "humaneval", "aime2025"]


@pytest.fixture(scope="module")
def world(tiny_llama, tmp_path_factory):
    """The prompts file (from the installed packages), and an exported random draft over the whole vocabulary."""
    d = tmp_path_factory.mktemp("bench-sets")
    bench_sets_gpu.main(["--write-prompts", str(d / "prompts.json")])
    cfg = DraftConfig.from_target_dir(tiny_llama, draft_vocab_size=512, aux_layer_ids=(1, 3, 5))
    torch.manual_seed(0)
    v = cfg.target_vocab_size
    vocab = DraftVocab(torch.zeros(v, dtype=torch.int64), torch.ones(v, dtype=torch.bool),
                       torch.ones(v, dtype=torch.int64))
    (d / "draft").mkdir()
    k = kind("eagle3")
    write_folder(d / "draft", k.export_config(cfg, "float32", ("vllm",)),
                 export_tensors(k, EagleDraft(cfg).trainable_state_dict(), cfg, vocab, torch.float32, d / "draft"))
    return d, tiny_llama


def _run(world, name: str) -> dict:
    d, target = world
    out = d / f"{name}.json"
    assert bench_sets_gpu.main(["--prompts", str(d / "prompts.json"), "--model-dir", str(target), "--draft",
                                str(d / "draft"), "--k", *map(str, KS), "--max-new-tokens", str(NEW_TOKENS),
                                "--limit", "2", "--device", "cpu", "--out", str(out)]) == 0
    return json.loads(out.read_text())


def _next_tokens(shift: int):
    """A draft kind's guesses that are the data's own next tokens (+ shift): step j at row t guesses t+2+j."""
    def guesses(self, draft, batch, steps, attention="dense", compiled=False):
        t = len(batch.input_ids)
        rows = (torch.arange(t)[:, None] + 2 + torch.arange(steps)[None]).clamp(max=t - 1)
        return (batch.input_ids[rows] + shift) % 512  # draft ids are target ids: the draft has the whole vocabulary
    return guesses


def test_the_prompts_file_holds_the_capped_sets(world):
    doc = json.loads((world[0] / "prompts.json").read_text())
    assert {n: len(ps) for n, ps in doc["sets"].items()} == {"mt-bench": 80, "gsm8k": 200, "humaneval": 164,
                                                             "aime2025": 30}
    assert all(len(p["turns"]) == 2 for p in doc["sets"]["mt-bench"])


def test_every_set_and_k_is_scored_and_a_random_draft_scores_the_same_twice(world):
    first, again = _run(world, "random"), _run(world, "random-again")
    assert list(first["sets"]) == SETS and first["draft"]["kind"] == "eagle3"
    for s in first["sets"].values():
        assert s["prompts"] == 2 and 0 < s["answer_tokens"] <= NEW_TOKENS * s["turns"]
        for k in KS:
            f = s["by_k"][str(k)]
            assert 1 <= f["acceptance_length"] <= k + 1 and 1 <= f["replayed_acceptance_length"] <= k + 1
            assert len(f["conditional_accuracy"]) == k
        assert s["attempts"][0] >= s["answer_tokens"] - 2 * s["turns"]  # every answer token a chain reaches is scored
    mt = first["sets"]["mt-bench"]
    assert len(mt["categories"]) == 2 and set(mt["by_turn"]) == {"1", "2"} and mt["by_turn"]["2"]["turns"] == 2
    assert again["sets"] == first["sets"]
    assert set(first["seconds"]) == {"generation", "capture", "scoring"}
    assert (world[0] / "random.md").read_text().count("\n") == 2 + len(SETS)


def test_guessing_the_targets_own_next_tokens_scores_k_plus_one_and_another_token_scores_one(world, monkeypatch):
    monkeypatch.setattr(Eagle3, "guesses", _next_tokens(0))
    right = _run(world, "right")
    monkeypatch.setattr(Eagle3, "guesses", _next_tokens(1))
    wrong = _run(world, "wrong")
    for name in SETS:
        for k in KS:
            r, w = right["sets"][name]["by_k"][str(k)], wrong["sets"][name]["by_k"][str(k)]
            assert r["acceptance_length"] == k + 1 and r["conditional_accuracy"] == [1.0] * k
            assert r["replayed_acceptance_length"] > 1 and r["replayed"]["accepted"] > 0
            assert w["acceptance_length"] == 1 and w["replayed_acceptance_length"] == 1
