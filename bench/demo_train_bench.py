"""A finished run's train step again under other settings, side by side: seconds, tokens/s, offline acceptance.

    .venv/bin/python bench/demo_train_bench.py --run work/runs/<a make demo run> --rounds 2 \\
        --arms '{"fp32": {"precision": "fp32"}, "bf16": {"precision": "bf16"}}' \\
        --out bench/results/precision-cpu-<date>.json

Takes a finished run's train, export and evaluate configs (`make demo` writes them beside its step folders), and
runs the three steps again as the host runs them (`python -m <step module> --config`, one subprocess each) into a
scratch folder, once per arm (the train config's keys it sets) a round, the arms' order reversed every other
round, the evaluation offline only (its vLLM part measures the engine, not the draft's training). Per arm: the
train step's wall seconds, its steps' tokens/s, the target top-1 pre-pass's seconds (read from its log line) and
the offline acceptance length (and replayed) at the run's k; the first arm is the baseline of the ratios. The JSON
records the CPU's bf16 flags (bf16 autocast is what `precision` auto picks where the CPU does bf16 in hardware).
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = {"train": "remote.train.train", "export": "remote.train.export", "evaluate": "remote.evaluate.evaluate"}


def cpu_flags() -> dict:
    """The CPU's model and its bf16 flags, for the JSON (precision auto reads the same flags)."""
    from remote.train.state import CPU_BF16_FLAGS, cpu_info

    model, flags = cpu_info()
    return {"model": model, **{f: f in flags for f in CPU_BF16_FLAGS}}


def step(name: str, cfg: dict, work: Path) -> tuple[float, str]:
    path = work / f"{name}.json"
    path.write_text(json.dumps(cfg))
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", STEPS[name], "--config", str(path)], cwd=ROOT, capture_output=True,
                       text=True)
    if p.returncode:
        raise SystemExit(f"{name} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return time.perf_counter() - t0, p.stdout + p.stderr


def arm(run: Path, name: str, settings: dict, work: Path) -> dict:
    cfgs = {n: json.loads((run / f"{n}.config.json").read_text()) for n in STEPS}
    folder = work / name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    train = {**cfgs["train"], **settings, "out_dir": str(folder / "train")}
    train.pop("checkpoint_dir", None)
    export = {**cfgs["export"], "train_dir": str(folder / "train"), "out_dir": str(folder / "export")}
    evaluate = {**cfgs["evaluate"], "draft_dir": str(folder / "export"), "out_dir": str(folder / "evaluate"),
                "online": False}
    train_s, log = step("train", train, folder)
    m = json.loads((folder / "train" / "manifest.json").read_text())
    top1 = [float(x) for x in re.findall(r"samples checked in ([0-9.]+) s", log)]
    export_s, _ = step("export", export, folder)
    eval_s, _ = step("evaluate", evaluate, folder)
    f = json.loads((folder / "evaluate" / "manifest.json").read_text())["figures"]
    return {"arm": name, "settings": settings, "precision": m["train"].get("precision"), "train_s": round(train_s, 1), "steps": m["counts"].get("steps"),
            "tokens_per_s": round(m["figures"]["tokens_per_s"], 1), "top1_check_s": top1,
            "export_s": round(export_s, 1), "evaluate_s": round(eval_s, 1),
            "offline_acceptance_length": f.get("offline_acceptance_length"),
            "offline_replayed_acceptance_length": f.get("offline_replayed_acceptance_length")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", required=True, help="a finished run folder (make demo: work/runs/<stamp>)")
    ap.add_argument("--arms", default='{"fp32": {"precision": "fp32"}, "bf16": {"precision": "bf16"}}',
                    help="JSON: arm name -> the train config keys it sets (the first arm is the ratios' baseline)")
    ap.add_argument("--rounds", type=int, default=1, help="rounds of every arm, the order reversed every other round")
    ap.add_argument("--out", required=True, help="the JSON to write")
    a = ap.parse_args(argv)
    run = Path(a.run).resolve()
    work = Path(tempfile.mkdtemp(prefix="demo-train-bench-"))
    arms = []
    arms_given = json.loads(a.arms)
    names = list(arms_given)
    try:
        for r in range(a.rounds):
            for name in (names if r % 2 == 0 else names[::-1]):
                arms.append({"round": r, **arm(run, name, arms_given[name], work)})
                print(json.dumps(arms[-1]), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    mean = lambda name, k: statistics.mean(x[k] for x in arms if x["arm"] == name)  # noqa: E731
    base = names[0]
    out = {"what": "a run's train step under other settings, then export and offline evaluation",
           "command": "python " + " ".join([Path(__file__).relative_to(ROOT).as_posix(), *sys.argv[1:]]),
           "run": str(run), "cpu": cpu_flags(), "arms": arms,
           "ratios": {name: {"train_s_over_" + base: round(mean(name, "train_s") / mean(base, "train_s"), 3),
                             "tokens_per_s_over_" + base: round(mean(name, "tokens_per_s") / mean(base, "tokens_per_s"), 3)}
                      for name in names[1:]}}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out["ratios"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
