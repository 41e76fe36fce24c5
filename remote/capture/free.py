"""Step: free a trained window's capture: remove from the cache the shards that hold only its train samples.

    python -m remote.capture.free --config free_capture.config.json
    # {"capture_dir": "<run>/capture-w003", "out_dir": "<run>/free-w003"}

A run that captures in windows (remote.train.windows) frees each window once it is trained, so the
next one fits the disk budget. The cache is shared (other runs' samples; the held-out samples, kept
for the whole run): a shard is removed only when every sample it holds is a train sample of this
capture, under the cache's lock. The manifest counts the shards removed and the bytes freed.
"""
from __future__ import annotations

import json
from pathlib import Path

from remote.capture.cache import CaptureCache
from remote.capture.config import FreeCaptureConfig
from remote.capture.store import shard_index
from remote.step import BadInput, begin_step, log, read_manifest, step_main

STEP = "free_capture"


def run(raw: dict) -> dict:
    cfg, out, done = begin_step(FreeCaptureConfig, raw, STEP)
    if done is not None:
        return done
    m = read_manifest(cfg.capture_dir)
    if m is None or m.get("step") != "capture":
        raise BadInput(f"capture_dir {cfg.capture_dir}: no finished capture here (no capture manifest.json)")
    c = m["capture"]
    folder = Path(c["cache_dir"])
    mine = set(c["sample_ids"])
    material = json.loads((folder / "key.json").read_text())
    with CaptureCache.open(folder.parent.parent, c["cache_key"], material) as cache:
        gone = [p for p in c["shards"] if Path(p).is_file() and _only_train_of(p, mine)]
        freed = cache.remove(gone)
    log(f"free_capture: removed {len(gone)} shard(s) of {cfg.capture_dir} from {folder}, {freed:,} bytes")
    out.open()
    return out.publish(counts={"shards": len(gone), "kept": len(c["shards"]) - len(gone)}, figures={"bytes": freed},
                       removed=gone)


def _only_train_of(shard: str, mine: set[str]) -> bool:
    ids, splits = shard_index(shard)
    return all(sid in mine and split == "train" for sid, split in zip(ids, splits))


def main(argv: list[str] | None = None) -> int:
    return step_main(STEP, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
