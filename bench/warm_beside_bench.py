"""What compiling ahead (bench.warm) costs the capture it runs beside, by the warm step's niceness.

    .venv/bin/python bench/warm_beside_bench.py --model-dir CACHE/embedded-default/smollm2-135m-instruct-float32 \
        --prepared PACK/a/data.parquet --rows 96 --out bench/results/warm_beside-cpu-DATE.json

Arms, one after another, each with fresh compile caches (TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR) and a fresh
capture folder: the capture alone; the capture with the warm step started beside it at niceness 0; the same at
the warm step's default niceness. Per arm: the capture's seconds (and its ratio to the capture alone), the warm
step's seconds and compile seconds, and when the later of the two ended (what an own-capture run waits for before
it trains). The capture is the transformers backend, as on the lent GPU; on a CPU the warm step compiles the
trainer for the CPU (`compile: yes`), so both compete for the same cores, where on a GPU host the capture's one
launching thread competes with the compile's workers.

Seen on a GPU host without niceness (bench/results/quality-h200-ten-minutes-20261204d.json): the capture took 175 s
beside a cold compile, 96 s beside a cached one.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.eval_bench import run_step  # noqa: E402
from bench.quality_bench import select_rows  # noqa: E402
from bench.warm import WarmConfig  # noqa: E402


def arm(name: str, nice: int | None, a, data: Path, work: Path) -> dict:
    """The capture, with the warm step beside it at `nice` (None: alone); seconds and figures."""
    folder = work / name
    folder.mkdir(parents=True)
    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):  # cold compiles, every arm alike
        os.environ[var] = str(folder / var.lower())
    t0 = time.perf_counter()
    ahead = None
    if nice is not None:
        warm = {"target": a.model_dir, "out_dir": str(folder / "warm"), "draft_vocab_size": a.draft_vocab_size,
                "nice": nice, "train": {"ttt_steps": 3, "token_budget": a.token_budget, "optimizer": "muon",
                                        "train_lm_head": False, **({} if a.gpu else {"compile": "yes", "device": "cpu"})}}
        pool = ThreadPoolExecutor(1)
        ahead = pool.submit(lambda: (run_step("warm", warm, folder, None, "bench.warm"),
                                     time.perf_counter() - t0))
        pool.shutdown(wait=False)
    cap_s, cap_m = run_step("capture", {"dataset": str(data), "target": a.model_dir, "out_dir": str(folder / "capture"),
                                        "cache_root": str(folder / "cache"), "backend": "transformers",
                                        "samples_per_shard": 256}, folder)
    rec = {"arm": name, "warm_nice": nice, "capture_s": round(cap_s, 1),
           "capture_tokens": cap_m["counts"]["tokens"], "capture_tokens_per_s": cap_m["figures"]["tokens_per_s"]}
    if ahead is not None:
        (warm_s, wm), ended = ahead.result()
        rec.update(warm_s=round(warm_s, 1), warm_compile_s=wm["figures"].get("compile_seconds"),
                   warm_ran_at_nice=wm["figures"].get("nice"))
        rec["both_done_s"] = round(max(cap_s, ended), 1)
    else:
        rec["both_done_s"] = rec["capture_s"]
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", required=True, help="the target's HF folder")
    ap.add_argument("--prepared", required=True, help="a prepared data.parquet")
    ap.add_argument("--rows", type=int, default=96, help="its first rows to capture")
    ap.add_argument("--token-budget", type=int, default=1024, help="the warm step's train token_budget")
    ap.add_argument("--draft-vocab-size", type=int, default=8192)
    ap.add_argument("--gpu", action="store_true", help="the warm step as on a GPU host (compile: auto)")
    ap.add_argument("--out", required=True, help="the results JSON")
    a = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="warm-beside-"))
    data = select_rows(a.prepared, work / "data.parquet", a.rows)
    default_nice = WarmConfig.__dataclass_fields__["nice"].default
    rows = [arm("alone", None, a, data, work), arm("beside-nice-0", 0, a, data, work),
            arm(f"beside-nice-{default_nice}", default_nice, a, data, work)]
    for r in rows:
        r["capture_vs_alone"] = round(r["capture_s"] / rows[0]["capture_s"], 3)
        print(json.dumps(r), flush=True)
    Path(a.out).write_text(json.dumps({"args": vars(a), "cpus": os.cpu_count(), "arms": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
