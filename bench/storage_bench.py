"""Bytes per token of fp8 capture storage against the capture dtype (bf16), on the same data and
forward: SmolLM2-135M-Instruct on ShareGPT, the capture step itself (transformers backend, CPU, in
this process), with its disk plan checked against what was written; optionally a tiny CPU training
of the same budget on each, compared by held-out acceptance length.

    .venv/bin/python bench/storage_bench.py --out bench/results/storage_bench-cpu-YYYYMMDD.json
    .venv/bin/python bench/storage_bench.py --samples 64 --train-steps 40 --out f.json

The two captures differ only in capture.storage_dtype ("auto": bf16 states; "fp8"), each into a
fresh cache. Bytes per token come from the shards on disk; the fp8 states are compared with the bf16
ones value by value (error relative to the token-layer absmax). Kimi-K2.5's figures (H 7168, 3 aux
layers) are the formula's (remote.capture.store.bytes_per_token). With --train-steps, the vocab and
train steps run on each capture with the same config and seed; held-out acceptance length comes from
the trainer's own held-out evaluation.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from remote.capture import capture  # noqa: E402
from remote.capture.store import CaptureSet, bytes_per_token  # noqa: E402
from remote.data import embedded_default, prepare  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def run_capture(model: Path, data: Path, work: Path, storage: str) -> dict:
    m = capture.run({"dataset": str(data), "target": str(model), "out_dir": str(work / storage),
                     "cache_root": str(work / f"cache-{storage}"), "backend": "transformers", "device": "cpu",
                     "dtype": "bfloat16", "storage_dtype": storage, "max_num_batched_tokens": 2048})
    f, plan = m["figures"], m["disk_plan"]
    return {"tokens": f["tokens"], "bytes": f["bytes"], "bytes_per_token": f["bytes_per_token"],
            "bytes_per_token_bound": f["bytes_per_token_bound"], "plan_need_bytes": plan["need_bytes"],
            "plan_error": round(plan["need_bytes"] / f["bytes"] - 1, 5), "capture_seconds": f["capture_seconds"]}


def state_error(work: Path) -> dict:
    """fp8 read back against the bf16 states of the same forward: |error| / token-layer absmax."""
    exact = {s.sample_id: s for s in CaptureSet.from_manifest(work / "auto").samples()}
    fp8 = CaptureSet.from_manifest(work / "fp8")
    worst, sq, n = 0.0, 0.0, 0
    for s in fp8.samples():
        for got, want in ((s.hidden_states, exact[s.sample_id].hidden_states),
                          (s.last_hidden_state, exact[s.sample_id].last_hidden_state)):
            w = want.float().reshape(len(want), -1, fp8.hidden_size)
            err = (got.float().reshape(w.shape) - w).abs() / w.abs().amax(-1, keepdim=True).clamp(min=1e-30)
            worst, sq, n = max(worst, err.max().item()), sq + (err ** 2).sum().item(), n + err.numel()
    return {"max_error_over_absmax": round(worst, 5), "rms_error_over_absmax": round((sq / n) ** 0.5, 6)}


def train(work: Path, model: Path, data: Path, storage: str, steps: int) -> dict:
    """The vocab and train steps on one capture, as subprocesses (the host's way); held-out figures."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    vocab = work / "vocab"
    if not (vocab / "manifest.json").is_file():
        _step("remote.train.vocab", {"data": str(data), "out_dir": str(vocab), "target": str(model),
                                     "draft_vocab_size": 8192}, work / "vocab.json", env)
    out = work / f"train-{storage}"
    _step("remote.train.train", {"capture_dir": str(work / storage), "vocab_dir": str(vocab), "out_dir": str(out),
                                 "device": "cpu", "max_steps": steps, "token_budget": 2048, "lr": 1e-3,
                                 "warmup_steps": 4, "seed": 0, "eval_every": max(1, steps // 4),
                                 "checkpoint_every": 10**6, "patience": 0}, work / f"train-{storage}.json", env)
    m = json.loads((out / "manifest.json").read_text())
    return {"heldout_acceptance_length": m["figures"]["heldout_acceptance_length"],
            "heldout_points": m["train"]["heldout_points"]}


def _step(module: str, cfg: dict, path: Path, env: dict) -> None:
    path.write_text(json.dumps(cfg))
    r = subprocess.run([sys.executable, "-m", module, "--config", str(path)], cwd=REPO, env=env,
                       capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"{module} exited {r.returncode}: {r.stderr[-2000:]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=64, help="prepared ShareGPT samples")
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--train-steps", type=int, default=0, help="0: no training comparison")
    ap.add_argument("--cache", default=os.environ.get("EAGLET_TEST_CACHE", "/tmp/eaglet-test-cache"))
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    work = Path(tempfile.mkdtemp(prefix="storage-bench-"))
    demo = embedded_default.run({"out_dir": str(Path(args.cache) / "embedded-default")})
    model = Path(demo["model_dir"])
    prepare.run({"inputs": [demo["data_path"]], "tokenizer": str(model), "out_dir": str(work / "prepare"),
                 "max_length": args.max_length, "max_samples": args.samples, "heldout_permille": 125})
    data = work / "prepare" / "data.parquet"
    result = {"command": " ".join([".venv/bin/python", "bench/storage_bench.py", *(argv or sys.argv[1:])]),
              "target": "SmolLM2-135M-Instruct (H 576, aux layers 2, 15, 27), bf16 forward, CPU", "samples": args.samples,
              "bf16": run_capture(model, data, work, "auto"), "fp8": run_capture(model, data, work, "fp8")}
    result["ratio_fp8_over_bf16"] = round(result["fp8"]["bytes_per_token"] / result["bf16"]["bytes_per_token"], 4)
    result["fp8_vs_bf16_states"] = state_error(work)
    result["kimi_k2_5_bytes_per_token"] = {"bf16": bytes_per_token(3, 7168, "bfloat16"),
                                           "fp8": bytes_per_token(3, 7168, "fp8")}
    if args.train_steps:
        result["train"] = {"steps": args.train_steps, **{name: train(work, model, data, storage, args.train_steps)
                                                          for name, storage in (("bf16", "auto"), ("fp8", "fp8"))}}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
