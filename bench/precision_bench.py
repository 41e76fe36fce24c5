"""The train step on a CPU at precision fp32 against bf16: seconds, tokens/s and the draft's offline acceptance.

    .venv/bin/python bench/precision_bench.py --run work/runs/<a make demo run> --rounds 2 \\
        --out bench/results/precision-cpu-<date>.json

Takes a finished run's train, export and evaluate configs (`make demo` writes them beside its step folders), and
runs the three steps again as the host runs them (`python -m <step module> --config`, one subprocess each) into a
scratch folder, once per precision a round, alternating which goes first, the evaluation offline only (its vLLM
part measures the engine, not the draft's training). Per arm: the train step's wall seconds, its steps' tokens/s,
the target top-1 pre-pass's seconds (read from its log line) and the offline acceptance length (and replayed) at
the run's k. bf16 is autocast over float32 weights, as on a GPU; what it buys depends on the CPU's bf16 matrix
units (AMX: `lscpu | grep amx_bf16`), which the JSON records.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = {"train": "remote.train.train", "export": "remote.train.export", "evaluate": "remote.evaluate.evaluate"}


def cpu_flags() -> dict:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = re.search(r"^model name\s*:\s*(.*)$", text, re.M)
    flags = set(re.search(r"^flags\s*:\s*(.*)$", text, re.M).group(1).split()) if "flags" in text else set()
    return {"model": name.group(1) if name else "", **{f: f in flags for f in ("avx512_bf16", "amx_bf16")}}


def step(name: str, cfg: dict, work: Path) -> tuple[float, str]:
    path = work / f"{name}.json"
    path.write_text(json.dumps(cfg))
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", STEPS[name], "--config", str(path)], cwd=ROOT, capture_output=True,
                       text=True)
    if p.returncode:
        raise SystemExit(f"{name} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return time.perf_counter() - t0, p.stdout + p.stderr


def arm(run: Path, precision: str, work: Path) -> dict:
    cfgs = {n: json.loads((run / f"{n}.config.json").read_text()) for n in STEPS}
    folder = work / precision
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    train = {**cfgs["train"], "precision": precision, "out_dir": str(folder / "train")}
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
    return {"precision": precision, "train_s": round(train_s, 1), "steps": m["counts"].get("steps"),
            "tokens_per_s": round(m["figures"]["tokens_per_s"], 1), "top1_check_s": top1,
            "export_s": round(export_s, 1), "evaluate_s": round(eval_s, 1),
            "offline_acceptance_length": f.get("offline_acceptance_length"),
            "offline_replayed_acceptance_length": f.get("offline_replayed_acceptance_length")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", required=True, help="a finished run folder (make demo: work/runs/<stamp>)")
    ap.add_argument("--rounds", type=int, default=1, help="rounds of both arms, alternating which goes first")
    ap.add_argument("--out", required=True, help="the JSON to write")
    a = ap.parse_args(argv)
    run = Path(a.run).resolve()
    work = Path(tempfile.mkdtemp(prefix="precision-bench-"))
    arms = []
    try:
        for r in range(a.rounds):
            for precision in (("fp32", "bf16") if r % 2 == 0 else ("bf16", "fp32")):
                arms.append({"round": r, **arm(run, precision, work)})
                print(json.dumps(arms[-1]), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    by = {p: [x for x in arms if x["precision"] == p] for p in ("fp32", "bf16")}
    mean = lambda xs, k: sum(x[k] for x in xs) / len(xs)  # noqa: E731
    out = {"what": "the train step at precision fp32 and bf16 on this CPU, then export and offline evaluation",
           "command": "python " + " ".join([Path(__file__).relative_to(ROOT).as_posix(), *sys.argv[1:]]),
           "run": str(run), "cpu": cpu_flags(), "arms": arms,
           "ratios": {"train_s_fp32_over_bf16": round(mean(by["fp32"], "train_s") / mean(by["bf16"], "train_s"), 3),
                      "tokens_per_s_bf16_over_fp32": round(mean(by["bf16"], "tokens_per_s")
                                                           / mean(by["fp32"], "tokens_per_s"), 3)}}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out["ratios"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
