"""The capture cache: shards of hidden states kept per (target, its revision, layer ids, dtype, storage dtype).

    key = cache_key(target_dir, revision, layer_ids, dtype, storage)
    with CaptureCache.open(cache_root, key) as cache:          # one writer at a time (a file lock)
        plans = cache.plan(samples, samples_per_shard, max_shard_bytes, bytes_per_token)
        ...                                                    # a backend writes plan.path for each
        cache.add(plan)                                        # record a written shard in the index
        cache.shards_for(samples)                              # the shards that hold these samples

Layout: `<cache_root>/captures/<key>/shard-00000.safetensors ...`, `index.json` (shard -> sample id ->
content hash), `key.json` (what the key was made of). A shard is written under a temporary name and
renamed when whole (capture_store.write_shard), so a `shard-*.safetensors` file is always whole and
a killed run leaves at most a `.shard-*.tmp-*` file, removed at the next open. The index is written
after each shard, and rebuilt from the shard files' own headers for any shard it does not list
(the run was killed between the rename and the index update), so resuming starts at the first
missing shard and shards are numbered and filled exactly as in a run that was never interrupted.

A sample is reused when its id and its content (tokens, loss mask, split) match what the cache
holds. The same id with other content (the data was prepared with another length policy or
held-out share) is bad input: the fix is another cache_root or removing the old capture.
The storage dtype is part of the key, so fp8 and bf16 shards never share a folder; a shard of
another storage dtype found there (put by hand) is refused by name.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
from safetensors import safe_open

from remote.capture.store import shard_index, shard_storage
from remote.step import BadInput, log, sha256_file, write_json_atomic

INDEX = "index.json"
# The cache's own files beside its shards, for disk budgets: key.json, the lock and index.json, whose
# entries are a sample's id and digest, a shard's name and size; index.json is rewritten whole (a temporary
# copy beside it while it is replaced), so each entry counts twice.
CACHE_FILES_BYTES = 8192  # key.json, the lock, index.json's header (with room to spare)
INDEX_SAMPLE_BYTES = 2 * 56  # + the id's length, twice: quotes, colon, the 32-hex digest, indentation
INDEX_SHARD_BYTES = 2 * 96  # a shard's entry: name, bytes, the samples' braces
FORMAT = 1
SHARD_GLOB = "shard-*.safetensors"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "chat_template.jinja",
                    "special_tokens_map.json", "tiktoken.model")


@dataclass(frozen=True)
class SampleRow:
    """One sample of the prepared dataset, as the capture needs it."""

    sample_id: str
    split: str
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T]

    @property
    def content(self) -> str:
        return content_hash(self.input_ids, self.loss_mask, self.split)


@dataclass(frozen=True)
class ShardPlan:
    """One shard to write: its number, its final path, its samples in order."""

    index: int
    path: str
    samples: tuple[SampleRow, ...]

    @property
    def tokens(self) -> int:
        return sum(int(s.input_ids.size) for s in self.samples)


def content_hash(input_ids: np.ndarray, loss_mask: np.ndarray, split: str) -> str:
    h = hashlib.sha256(np.ascontiguousarray(input_ids, dtype=np.int32).tobytes())
    h.update(np.ascontiguousarray(loss_mask, dtype=np.uint8).tobytes())
    h.update(split.encode())
    return h.hexdigest()[:32]


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def shard_number(name: str) -> int:
    return int(name[len("shard-"):-len(".safetensors")])


# ----------------------------------------------------------------------------- the key
def target_identity(target: str | os.PathLike, revision: str = "") -> dict:
    """What names the target's weights: its path and the revision label, or else hashes of its files.

    Without a revision: config.json, the weights index (or each safetensors file's size and header)
    and the tokenizer files. Weights rewritten in place with the same shapes need a revision label.
    """
    target = Path(target).resolve()
    ident = {"target": str(target), "revision": revision}
    if revision:
        return ident
    if not (target / "config.json").is_file():
        raise BadInput(f"target {target}: no config.json (expected a HF model folder)")
    ident["config.json"] = sha256_file(target / "config.json")
    index = target / "model.safetensors.index.json"
    if index.is_file():
        ident["weights"] = sha256_file(index)
    else:
        files = sorted(target.glob("*.safetensors"))
        if not files:
            raise BadInput(f"target {target}: no *.safetensors weights")
        ident["weights"] = {f.name: [f.stat().st_size, _header_hash(f)] for f in files}
    ident["tokenizer"] = {n: sha256_file(target / n) for n in _TOKENIZER_FILES if (target / n).is_file()}
    return ident


def _header_hash(path: Path) -> str:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return hashlib.sha256(f.read(min(n, 1 << 26))).hexdigest()


def cache_key(target: str | os.PathLike, revision: str, layer_ids: Sequence[int], dtype: str,
              storage: str | None = None) -> tuple[str, dict]:
    """(key, what it was made of): the folder name under <cache_root>/captures/. storage: the states'
    dtype on disk (remote.capture.store.storage_of); None: the capture dtype."""
    material = {"format": FORMAT, "identity": target_identity(target, revision), "layer_ids": list(layer_ids),
                "dtype": dtype}
    if storage not in (None, dtype):  # states stored as captured keep the key they had before fp8 existed
        material["storage"] = storage
    digest = hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:20]
    return f"{Path(target).resolve().name}-{digest}", material


# ----------------------------------------------------------------------------- the cache
class CaptureCache:
    """One cache folder, held under an exclusive lock while a capture plans and writes into it."""

    def __init__(self, folder: Path, lock_fd: int, storage: str):
        self.folder = folder
        self.storage = storage  # the dtype of every shard's states here
        self._lock_fd = lock_fd
        self.index: dict[str, dict] = {}  # shard file name -> {"samples": {sample_id: content}, "bytes": n}

    @classmethod
    def open(cls, cache_root: str | os.PathLike, key: str, material: dict) -> "CaptureCache":
        folder = Path(cache_root).resolve() / "captures" / key
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise BadInput(f"cache_root {cache_root}: cannot create {folder}: {e}") from e
        fd = os.open(folder / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"another capture holds {folder}/.lock: waiting for it")
            fcntl.flock(fd, fcntl.LOCK_EX)
        cache = cls(folder, fd, material.get("storage", material["dtype"]))
        if not (folder / "key.json").is_file():
            write_json_atomic(folder / "key.json", material)
        cache._load()
        return cache

    def __enter__(self) -> "CaptureCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._lock_fd >= 0:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = -1

    def _load(self) -> None:
        """Read the index, drop what a killed run left half-written, adopt shards it did not list."""
        for tmp in self.folder.glob(".shard-*.tmp-*"):
            log(f"removing {tmp.name}: a shard a killed run did not finish")
            tmp.unlink(missing_ok=True)
        p = self.folder / INDEX
        index = json.loads(p.read_text()).get("shards", {}) if p.is_file() else {}
        on_disk = {f.name: f for f in self.folder.glob(SHARD_GLOB)}
        self.index = {n: e for n, e in index.items() if n in on_disk and on_disk[n].stat().st_size == e["bytes"]}
        for name in sorted(set(on_disk) - set(self.index)):
            entry = _read_entry(on_disk[name])
            if entry is not None and entry["storage"] != self.storage:
                self.close()
                raise BadInput(f"{on_disk[name]} holds {entry['storage']} states; this cache holds {self.storage} "
                               f"ones (its key): fp8 and other shards never mix; remove that file")
            if entry is None:
                aside = on_disk[name].with_name(name + ".unreadable")
                log(f"{name} cannot be read as a shard: moved aside to {aside.name}; its samples are captured again")
                os.replace(on_disk[name], aside)
            else:
                self.index[name] = entry
        if self.index != index:
            self._save()

    def _save(self) -> None:
        write_json_atomic(self.folder / INDEX, {"format": FORMAT, "shards": self.index})

    def _holders(self) -> dict[str, tuple[str, str]]:
        """sample_id -> (content, shard name): the first shard (in name order) that holds it."""
        out: dict[str, tuple[str, str]] = {}
        for name in sorted(self.index):
            for sid, content in self.index[name]["samples"].items():
                out.setdefault(sid, (content, name))
        return out

    def plan(self, samples: Sequence[SampleRow], samples_per_shard: int, max_shard_bytes: int,
             bytes_per_token: int) -> tuple[list[ShardPlan], list[SampleRow]]:
        """(shards to write for the samples the cache lacks, the samples it already holds).

        Missing samples keep their dataset order and fill shards numbered after the last one, each up
        to samples_per_shard samples or max_shard_bytes: the same input always gives the same shards.
        """
        holders = self._holders()
        cached, missing = [], []
        for s in samples:
            held = holders.get(s.sample_id)
            if held is None:
                missing.append(s)
            elif held[0] != s.content:
                raise BadInput(f"sample {s.sample_id}: the capture cache {self.folder} holds it with other tokens, "
                               f"loss mask or split ({held[1]}); was the data prepared with another length "
                               f"policy or held-out share? Use another cache_root or remove {self.folder}")
            else:
                cached.append(s)
        plans, current, size = [], [], 0
        next_index = max((shard_number(n) for n in self.index), default=-1) + 1
        for s in missing:
            need = int(s.input_ids.size) * bytes_per_token
            if current and (len(current) >= samples_per_shard or size + need > max_shard_bytes):
                plans.append(ShardPlan(next_index, str(self.folder / shard_name(next_index)), tuple(current)))
                next_index, current, size = next_index + 1, [], 0
            current.append(s)
            size += need
        if current:
            plans.append(ShardPlan(next_index, str(self.folder / shard_name(next_index)), tuple(current)))
        return plans, cached

    def add(self, plan: ShardPlan) -> None:
        """Record a shard the backend wrote (whole, under its final name)."""
        path = Path(plan.path)
        self.index[path.name] = {"samples": {s.sample_id: s.content for s in plan.samples},
                                 "bytes": path.stat().st_size}
        self._save()

    def shards_for(self, samples: Iterable[SampleRow]) -> list[str]:
        """Absolute paths of the shards holding these samples (each sample in exactly one of them)."""
        holders = self._holders()
        names = set()
        for s in samples:
            if s.sample_id not in holders:
                raise RuntimeError(f"sample {s.sample_id} is in no shard of {self.folder} after the capture")
            names.add(holders[s.sample_id][1])
        return [str(self.folder / n) for n in sorted(names)]

    def remove(self, paths: Iterable[str]) -> int:
        """Delete these shards and their index entries (a trained window's); returns the bytes freed."""
        freed = 0
        for p in paths:
            entry = self.index.pop(Path(p).name, None)
            freed += entry["bytes"] if entry else 0
            Path(p).unlink(missing_ok=True)
        self._save()
        return freed

    def shard_bytes(self, paths: Iterable[str]) -> dict[str, int]:
        return {p: self.index[Path(p).name]["bytes"] for p in paths}


def _read_entry(path: Path) -> dict | None:
    """An index entry made from a shard's own contents, or None when it is not a readable shard."""
    try:
        ids, splits = shard_index(path)
        with safe_open(str(path), framework="pt") as f:
            storage = shard_storage(f)
            tokens, mask, cu = (f.get_tensor(k).numpy() for k in ("input_ids", "loss_mask", "cu_seqlens"))
    except Exception:  # noqa: BLE001 - any unreadable file is treated the same way
        return None
    samples = {sid: content_hash(tokens[cu[i]:cu[i + 1]], mask[cu[i]:cu[i + 1]], sp)
               for i, (sid, sp) in enumerate(zip(ids, splits))}
    return {"samples": samples, "bytes": path.stat().st_size, "storage": storage}
