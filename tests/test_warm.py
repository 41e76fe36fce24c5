"""bench.warm: the train step's compiled graphs made ahead, on synthetic states of the real run's shape.

Real parts: the trainer compiled on the CPU (inductor's C++ kernels; on a GPU Triton's), in fresh processes whose
compile cache is a folder of the test's own (TORCHINDUCTOR_CACHE_DIR), on a capture of the tiny target's own states."""
import json
from pathlib import Path

import pytest

from tests.fixtures.train_inputs import LAYER_IDS, hf_capture, random_chats, run_train, save_vocab


def _step(module: str, cfg: dict, path, cache) -> dict:
    r = run_train(cfg, path, module=module, env={"TORCHINDUCTOR_CACHE_DIR": str(cache)}, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return json.loads((Path(cfg["out_dir"]) / "manifest.json").read_text())


@pytest.mark.slow
def test_a_run_after_the_warm_step_finds_its_graphs_compiled(tiny_llama, tmp_path):
    """`bench.warm` with a run's own settings (its budget, deadline and folders the warm step's own) in a
    fresh compile cache, then the run itself on a real capture: it compiles the same graphs as the warm step did
    (two steps and a held-out evaluation each) in well under half the time (read back from the cache), and the
    warm step leaves no inputs behind."""
    vocab = json.loads((tiny_llama / "config.json").read_text())["vocab_size"]
    seqs, masks = random_chats(24, vocab)
    cap = hf_capture(tiny_llama, seqs, masks, tmp_path / "capture", heldout=4)
    voc = save_vocab(seqs, masks, vocab, 200, tmp_path / "vocab")
    train = {"ttt_steps": 3, "token_budget": 96, "max_steps": 3, "eval_tokens": 96, "compile": "yes", "device": "cpu",
             "optimizer": "muon", "train_lm_head": False, "draft_overrides": {"norm_before_fc": True}}
    w = _step("bench.warm", {"target": str(tiny_llama), "train": {**train, "max_seconds": 60},
                                     "draft_vocab_size": 200, "layer_ids": list(LAYER_IDS),
                                     "out_dir": str(tmp_path / "w")}, tmp_path / "w.json", tmp_path / "cache")
    run = _step("remote.train.train", {**train, "capture_dir": str(cap), "vocab_dir": str(voc),
                                       "target": str(tiny_llama), "out_dir": str(tmp_path / "run")},
                tmp_path / "run.json", tmp_path / "cache")
    c, h = w["figures"], run["figures"]
    assert w["counts"]["steps"] == 2 and h["compiled_graphs"] == c["compiled_graphs"] >= 3, (c, h)
    assert c["nice"] >= 10  # it yields the CPU to the capture beside it
    assert h["compile_seconds"] < 0.5 * c["compile_seconds"], (c, h)
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == ["manifest.json"]
