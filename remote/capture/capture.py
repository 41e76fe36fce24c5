"""Step: capture the target's hidden states on the prepared data, into the capture cache.

    python -m remote.capture.capture --config capture.config.json
    # {"dataset": "<run>/prepare/data.parquet", "target": "/models/Kimi-K2.5", "out_dir": "<run>/capture",
    #  "cache_root": "<root>/cache", "backend": "vllm", "tensor_parallel_size": 8}

For every sample of the dataset: the residual stream at the aux layers (HF hidden-state indices,
default 2, N//2, N-3) and the last layer's pre-norm output, in the target's dtype (on disk: that
dtype, or fp8 with storage_dtype "fp8"), packed into shards (remote.capture.store) under
`<cache_root>/captures/<key>/` (remote.capture.cache). Samples the cache already holds are not
captured again; a killed run resumes at the first missing shard.

Before the engine starts, the disk plan (`DiskPlan`): the bytes the shards still to write need, those
the cache already holds for these samples, the free space of the cache's filesystem and the budget
max_disk_gb. It is logged and kept in the manifest; a capture that cannot fit is refused (exit 65),
naming the three figures.

The manifest (`<out_dir>/manifest.json`) lists the shards that hold this dataset's samples:
`CaptureSet.from_manifest(out_dir)` reads them.

Backends: "vllm" (the serving engine, tensor parallel; remote.capture.worker hooks its layers) and
"transformers" (remote.capture.backend_transformers: plain HF forwards, packed; the numerical reference, and the path
for hosts without vLLM). Both write the same shards. In a run over several hosts each host captures
only its part of the samples (host_part of host_parts, chosen before either backend starts).
"""
from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from remote.capture.backend import Progress, make_backend
from remote.capture.config import CaptureConfig
from remote.capture.cache import CaptureCache, SampleRow, cache_key
from remote.capture.layers import TargetConfig, check_layer_ids, default_layer_ids, resolve_dtype
from remote.capture.store import bytes_per_token, shard_overhead, size_text, storage_of
from remote.data.dataset import read_dataset
from remote.split import host_of
from remote.step import BadInput, begin_step, emit, log, step_main

STEP = "capture"
SPARE_SHARE, SPARE_BYTES = 0.1, 2**30  # free space kept beyond the plan: 10% of it and 1 GiB


def host_share(samples: list[SampleRow], cfg: CaptureConfig) -> list[SampleRow]:
    """The samples this host captures: all of them, or its part of a run over several hosts."""
    if cfg.host_parts == 1:
        return samples
    mine = [s for s in samples if host_of(s.sample_id, cfg.host_parts) == cfg.host_part]
    if not mine:
        raise BadInput(f"dataset {cfg.dataset}: none of its {len(samples)} samples falls to host part "
                       f"{cfg.host_part} of {cfg.host_parts}; use fewer hosts for this little data")
    log(f"host part {cfg.host_part} of {cfg.host_parts}: {len(mine)} of {len(samples)} samples")
    return mine


def subset(samples: list[SampleRow], ids_file: str) -> list[SampleRow]:
    """The samples a JSON list of ids names (a window of a run that captures in windows), in dataset order."""
    path = Path(ids_file)
    if not path.is_file():
        raise BadInput(f"sample_ids {ids_file} does not exist (expected a JSON list of sample ids)")
    wanted = json.loads(path.read_text())
    named = set(wanted)
    chosen = [s for s in samples if s.sample_id in named]
    if len(chosen) != len(named):
        found = {s.sample_id for s in chosen}
        missing = [w for w in wanted if w not in found]
        raise BadInput(f"sample_ids {ids_file}: {len(missing)} id(s) the dataset lacks (this host's part), e.g. {missing[0]}")
    log(f"sample_ids {ids_file}: {len(chosen)} of {len(samples)} samples")
    return chosen


# ----------------------------------------------------------------------------- the step
@dataclass(frozen=True)
class DiskPlan:
    """What the capture will put on the cache's disk, decided before the engine starts."""

    folder: str  # the cache folder
    storage_dtype: str
    bytes_per_token: int
    tokens: int  # of the samples still to capture
    need_bytes: int  # the shards still to write (tokens x bytes per token + each shard's overhead)
    held_bytes: int  # the cache's shards that already hold the other samples
    free_bytes: int  # free on the cache's filesystem
    budget_bytes: int  # max_disk_gb; 0: no budget

    @classmethod
    def make(cls, cache: CaptureCache, plans, cached: list[SampleRow], storage: str, bpt: int,
             max_disk_gb: float) -> "DiskPlan":
        need = sum(p.tokens * bpt + shard_overhead([s.sample_id for s in p.samples], [s.split for s in p.samples])
                   for p in plans)
        held = sum(cache.shard_bytes(cache.shards_for(cached)).values()) if cached else 0
        return cls(str(cache.folder), storage, bpt, sum(p.tokens for p in plans), need, held,
                   shutil.disk_usage(cache.folder).free, int(max_disk_gb * 1e9))

    def problems(self) -> list[str]:
        out = []
        if self.need_bytes and self.need_bytes * (1 + SPARE_SHARE) + SPARE_BYTES > self.free_bytes:
            out.append("the free space cannot hold it (with 10% and 1 GiB to spare)")
        if self.budget_bytes and self.held_bytes + self.need_bytes > self.budget_bytes:
            out.append("it passes the budget (set capture.max_disk_gb higher, or capture fewer samples)")
        return out

    def describe(self) -> str:
        budget = f"budget capture.max_disk_gb {size_text(self.budget_bytes)}" if self.budget_bytes else "no budget"
        return (f"disk plan: the capture needs {size_text(self.need_bytes)} ({self.tokens} tokens x {self.bytes_per_token} "
                f"bytes, {self.storage_dtype}) + {size_text(self.held_bytes)} the cache holds for these samples; "
                f"{size_text(self.free_bytes)} free in {self.folder}; {budget}")

    def check(self) -> None:
        log(self.describe())
        if problems := self.problems():
            raise BadInput(f"{self.describe()}: refused: {'; '.join(problems)}")


def _shards_whole(m: dict) -> bool:
    """Whether every shard a finished capture's manifest lists is still in the cache, whole."""
    sizes = m["capture"].get("shard_bytes", {})
    return all(Path(p).is_file() and Path(p).stat().st_size == sizes.get(p) for p in m["capture"]["shards"])


def run(raw: dict) -> dict:
    started = time.monotonic()
    # the work a killed capture did is in the cache (resumed from there), not in out_dir.partial
    cfg, out, done = begin_step(CaptureConfig, raw, STEP, valid=_shards_whole)
    if done is not None:
        return done
    target = TargetConfig.read(cfg.target)
    layer_ids = check_layer_ids(cfg.layer_ids if cfg.layer_ids is not None else default_layer_ids(target.num_layers),
                                target.num_layers)
    dtype = resolve_dtype(cfg, target)
    storage = storage_of(dtype, cfg.storage_dtype)
    samples = host_share(read_dataset(cfg.dataset, target.vocab_size), cfg)
    if cfg.sample_ids:
        samples = subset(samples, cfg.sample_ids)
    max_len = max(int(s.input_ids.size) for s in samples)
    if cfg.max_model_len and max_len + 1 > cfg.max_model_len:
        longest = max(samples, key=lambda s: s.input_ids.size)
        raise BadInput(f"sample {longest.sample_id} has {max_len} tokens: more than max_model_len={cfg.max_model_len} - 1")
    bpt = bytes_per_token(len(layer_ids), target.hidden_size, storage)
    key, material = cache_key(cfg.target, cfg.target_revision, layer_ids, dtype, storage)
    with CaptureCache.open(cfg.cache_root, key, material) as cache:
        plans, cached = cache.plan(samples, cfg.samples_per_shard, int(cfg.max_shard_gib * 2**30), bpt)
        todo_tokens = sum(p.tokens for p in plans)
        log(f"{len(samples)} samples: {len(cached)} already in {cache.folder}, "
            f"{len(samples) - len(cached)} to capture ({todo_tokens} tokens) into {len(plans)} shard(s)")
        disk = DiskPlan.make(cache, plans, cached, storage, bpt, cfg.max_disk_gb)
        disk.check()
        engine_s, detail, written, layers_path = 0.0, {}, [], ""
        prog = Progress(len(samples) - len(cached), todo_tokens)
        if plans:
            backend = make_backend(cfg, target, dtype, layer_ids, max_len)
            try:
                backend.start()
                engine_s = backend.startup_s
                prog = Progress(len(samples) - len(cached), todo_tokens)  # the clock starts with the engine up
                detail = backend.capture(plans, lambda p: (cache.add(p), written.append(p.path)), prog)
                layers_path = backend.layers_path
            finally:
                backend.close()
        shards = cache.shards_for(samples)
        shard_bytes = cache.shard_bytes(shards)
    new_bytes = sum(Path(p).stat().st_size for p in written)
    figures = {
        "tokens": prog.tokens, "bytes": new_bytes,
        "bytes_per_token": round(new_bytes / prog.tokens, 2) if prog.tokens else None,
        "bytes_per_token_bound": bpt + 16,
        "tokens_per_s": round(prog.tokens_per_s, 1) if prog.tokens else None,
        "capture_seconds": round(prog.seconds, 2) if plans else 0.0,
        "engine_start_seconds": round(engine_s, 2), "seconds": round(time.monotonic() - started, 2), **detail,
    }
    counts = {"samples": len(samples), "reused": len(cached), "captured": len(samples) - len(cached),
              "tokens": int(sum(s.input_ids.size for s in samples)), "shards": len(shards),
              "shards_written": len(written)}
    out.open()
    manifest = out.publish(counts=counts, figures=figures, disk_plan=asdict(disk), capture={
        "shards": shards, "shard_bytes": shard_bytes, "layer_ids": list(layer_ids),
        "hidden_size": target.hidden_size, "dtype": dtype, "storage_dtype": storage,
        "target": str(Path(cfg.target).resolve()),
        "sample_ids": [s.sample_id for s in samples], "cache_dir": str(Path(shards[0]).parent), "cache_key": key,
        "backend": cfg.backend, "num_layers": target.num_layers, "layers_path": layers_path,
    })
    emit("figures", **figures)
    log(f"capture done: {counts['captured']} samples captured, {counts['reused']} reused, {len(shards)} shards")
    return manifest


def main(argv: list[str] | None = None) -> int:
    return step_main(STEP, run, argv)


if __name__ == "__main__":  # the guard vLLM needs: its workers are spawned processes
    sys.exit(main())
