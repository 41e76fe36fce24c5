"""The trainer's pace on a real capture beside the same trainer on synthetic states of its shape, on one host.

    python3 bench/pace_bench.py --target M --capture-dir C --vocab-dir V --steps 300 --out pace.json

On an H200 the 10-minute recipe's step ran 53-68 ms on a real capture on one host and 34.4 ms on synthetic states
on another (bench/results/quality-h200-ten-minutes-20261204d.json, docs/TRAINING.md): the host or the data? Both
arms run `python -m remote.train.train` as the host does, one after the other, with the same settings (--train, a
JSON of TrainConfig keys; default the 10-minute arm's recipe) for --steps steps and no held-out evaluation but
the last one: the capture as it is, then bench.warm's synthetic states of its shape (the target's hidden
size, the capture's layers, the vocabulary's size; samples of 64-1024 tokens, enough for --synthetic-steps steps,
trained over again as epochs). Reports each arm's median step (loss.jsonl's seconds, from step 10: the first
compiles) overall and by 50-step windows, and the real arm's over the synthetic one's. The synthetic states are
bf16, as an H200 capture's are; a CPU capture's are float32, so on a CPU the arms differ in precision as well (the
CPU smoke: a 96-sample SmolLM2 capture, token_budget 1024, 30 steps, ran 1.27x slower than its synthetic twin).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.eval_bench import run_step  # noqa: E402
from remote.draft.vocab import DraftVocab  # noqa: E402
from bench.warm import WarmConfig, synthetic_inputs  # noqa: E402

RECIPE = {"ttt_steps": 3, "token_budget": 8192, "optimizer": "muon", "train_lm_head": False,
          "draft_overrides": {"norm_before_fc": True, "norm_before_residual": True, "norm_output": True}}


def pace(name: str, capture: str, vocab: str, a, work: Path) -> dict:
    """One arm: the trainer's steps on this capture; its figures and step medians (ms)."""
    folder = work / name
    folder.mkdir(parents=True)
    cfg = {**a.train, "capture_dir": capture, "vocab_dir": vocab, "target": a.target, "out_dir": str(folder / "train"),
           "max_steps": a.steps, "epochs": 0.0, "train_tokens": 0, "eval_every": 10 ** 9, "checkpoint_every": 10 ** 9}
    seconds, m = run_step("train", cfg, folder)
    s = [json.loads(line)["seconds"] for line in (folder / "train" / "loss.jsonl").read_text().splitlines()]
    return {"arm": name, "steps": len(s), "step_ms_median": round(statistics.median(s[10:]) * 1000, 2),
            "step_ms_by_50": [round(statistics.median(s[i:i + 50]) * 1000, 1) for i in range(10, len(s), 50)],
            "tokens_per_s": m["figures"].get("tokens_per_s"), "wall_s": round(seconds, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True, help="the target's HF folder")
    ap.add_argument("--capture-dir", required=True, help="a finished capture of that target")
    ap.add_argument("--vocab-dir", required=True, help="its vocab step's folder")
    ap.add_argument("--steps", type=int, default=300, help="train steps of each arm")
    ap.add_argument("--synthetic-steps", type=int, default=40, help="the synthetic set's size, in steps")
    ap.add_argument("--train", type=json.loads, default=RECIPE, help="TrainConfig keys (JSON) both arms train with")
    ap.add_argument("--work", default="", help="where the arms' folders go (default: a fresh temporary folder)")
    ap.add_argument("--out", required=True, help="the results JSON")
    a = ap.parse_args(argv)
    work = Path(a.work or tempfile.mkdtemp(prefix="pace-"))
    layers = json.loads((Path(a.capture_dir) / "manifest.json").read_text())["capture"]["layer_ids"]
    size = len(DraftVocab.load(a.vocab_dir).d2t)
    budget = int(a.train.get("token_budget", RECIPE["token_budget"]))
    capture, vocab = synthetic_inputs(WarmConfig(target=a.target, out_dir=str(work / "unused"), draft_vocab_size=size,
                                                 layer_ids=layers), work / "synthetic-inputs", budget * a.synthetic_steps // 3)
    rows = [pace("real", a.capture_dir, a.vocab_dir, a, work), pace("synthetic", str(capture), str(vocab), a, work)]
    ratio = round(rows[0]["step_ms_median"] / rows[1]["step_ms_median"], 3)
    for r in rows:
        print(json.dumps(r), flush=True)
    print(json.dumps({"real_over_synthetic": ratio}))
    Path(a.out).write_text(json.dumps({"args": vars(a), "arms": rows,
                                       "real_over_synthetic": ratio}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
