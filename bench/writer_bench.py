"""Peak host memory of the capture writer alone, for N and 4N samples: a bounded writer grows by the
same amount for both (issue 4: "peak host memory of the writer bounded, does not grow with the dataset").

    .venv/bin/python bench/writer_bench.py --out /tmp/writer_bench.json
    .venv/bin/python bench/writer_bench.py --samples 64 --samples-per-shard 4 --out f.json

The writer is remote.capture.worker.Recorder (what rank 0 of the vLLM engine runs): shard plans in
the wire format the driver sends, then forward passes of synthetic hidden states of SmolLM2's shape
(H 576, 3 aux layers + the final one, float32), whole samples of about --tokens tokens packed into
passes of at most --pass-tokens, as vLLM batches them; it packs and writes the shards (fsynced) into
a fresh CaptureCache folder. No engine and no model: only the writer's own memory is measured.
Each size runs in a fresh process, which reports its RSS once everything is set up (the baseline)
and its peak RSS (getrusage ru_maxrss) at the end; the growth is peak minus baseline.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HIDDEN = 576  # SmolLM2-135M
LAYER_IDS = [2, 15, 27]  # its default aux layers (30 decoder layers)


def run_writer(samples: int, tokens: int, per_shard: int, pass_tokens: int, folder: Path) -> dict:
    """Feed `samples` synthetic samples through a Recorder into a cache under folder; the figures."""
    import numpy as np
    import psutil
    import torch

    from remote.capture.backend_vllm import _wire_plan  # the driver's own wire format of a shard plan
    from remote.capture.cache import CaptureCache, SampleRow, cache_key
    from remote.capture.worker import Recorder, request_id

    rng = np.random.default_rng(0)
    lengths = rng.integers(int(tokens * 0.9), int(tokens * 1.1) + 1, samples)
    rows = [SampleRow(f"w{i:08d}" + "0" * 8, "train", rng.integers(3, 49152, n).astype(np.int32),
                      np.ones(n, np.uint8)) for i, n in enumerate(lengths)]
    width = (len(LAYER_IDS) + 1) * HIDDEN
    states = torch.randn(pass_tokens, width)  # one pass's states, reused: their values do not matter
    key, material = cache_key("synthetic-smollm2", "bench", LAYER_IDS, "float32")
    with CaptureCache.open(folder, key, material) as cache:
        plans, _ = cache.plan(rows, per_shard, 2**40, width * 4 + 5)
        recorder = Recorder(LAYER_IDS)
        baseline = psutil.Process().memory_info().rss
        started = time.monotonic()
        batch: list[tuple[str, int]] = []

        def forward() -> None:
            starts = np.cumsum([0] + [n for _, n in batch]).tolist()
            recorder.on_pass([rid for rid, _ in batch], starts, [0] * len(batch), states[: starts[-1]])
            batch.clear()

        for plan in plans:
            recorder.plan(_wire_plan(plan))  # before its first request, as the driver sends it
            for slot, s in enumerate(plan.samples):
                if batch and sum(n for _, n in batch) + s.input_ids.size > pass_tokens:
                    forward()
                batch.append((request_id(plan.index, slot), int(s.input_ids.size)))
        if batch:
            forward()
        final = recorder.close()
        seconds = time.monotonic() - started
        if final["error"] or len(final["written"]) != len(plans):
            raise RuntimeError(f"writer: {final['error'] or 'shards unwritten'}")
        for plan in plans:
            cache.add(plan)
        shard_bytes = sum(Path(p).stat().st_size for p in cache.shards_for(rows))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"samples": samples, "tokens": int(lengths.sum()), "shards": len(plans), "shard_bytes": shard_bytes,
            "seconds": round(seconds, 2), "baseline_rss_mib": round(baseline / 2**20, 1),
            "peak_rss_mib": round(peak / 2**20, 1), "peak_growth_mib": round((peak - baseline) / 2**20, 1)}


def measure(samples: int, args) -> dict:
    """run_writer in a fresh process (its peak RSS is its own), in a scratch folder removed after."""
    folder = Path(tempfile.mkdtemp(prefix="writer-bench-", dir=args.scratch))
    try:
        out = subprocess.run([sys.executable, __file__, "--child", str(samples), "--tokens", str(args.tokens),
                              "--samples-per-shard", str(args.samples_per_shard),
                              "--pass-tokens", str(args.pass_tokens), "--scratch", str(folder), "--out", "-"],
                             check=True, capture_output=True, text=True).stdout
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return json.loads(out.splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="where the figures go (JSON); '-' prints them only")
    ap.add_argument("--samples", type=int, default=256, help="N: the smaller run has N samples, the larger 4N")
    ap.add_argument("--tokens", type=int, default=500, help="tokens of a sample, on average (+-10%%)")
    ap.add_argument("--samples-per-shard", type=int, default=16, help="samples in one shard")
    ap.add_argument("--pass-tokens", type=int, default=8192, help="tokens of one forward pass at most")
    ap.add_argument("--scratch", default=tempfile.gettempdir(), help="folder the shards are written under")
    ap.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)  # one measurement, in this process
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(run_writer(args.child, args.tokens, args.samples_per_shard, args.pass_tokens,
                                    Path(args.scratch))))
        return 0
    small, large = measure(args.samples, args), measure(4 * args.samples, args)
    shard_mib = args.samples_per_shard * args.tokens * (len(LAYER_IDS) + 1) * HIDDEN * 4 / 2**20
    figures = {"n": small, "4n": large,
               "peak_growth_ratio_4n_over_n": round(large["peak_growth_mib"] / small["peak_growth_mib"], 3),
               "shard_mib_about": round(shard_mib, 1), "hidden_size": HIDDEN, "layer_ids": LAYER_IDS,
               "dtype": "float32", "tokens_per_sample": args.tokens, "samples_per_shard": args.samples_per_shard,
               "pass_tokens": args.pass_tokens, "cores": len(os.sched_getaffinity(0)), "load_average": os.getloadavg()}
    text = json.dumps(figures, indent=2) + "\n"
    if args.out != "-":
        Path(args.out).write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
