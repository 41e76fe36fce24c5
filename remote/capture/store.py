"""Captured hidden states on disk: the hand-off from capture to vocab, training and evaluation.

A capture is a set of packed shards. One shard is one safetensors file holding whole samples
back to back (no padding):

    hidden_states      [T, len(layer_ids) * H]  target dtype, aux layers concatenated in layer_ids order
    last_hidden_state  [T, H]                   target dtype, the final decoder layer's pre-norm output
    input_ids          [T]                      int32
    loss_mask          [T]                      uint8 (1 on tokens the assistant wrote)
    cu_seqlens         [n + 1]                  int64, sample i is rows cu_seqlens[i]:cu_seqlens[i+1]

with metadata `sample_ids` and `splits` (JSON lists, one entry a sample), `layer_ids` (JSON) and
`hidden_size`, keys sorted: the same samples and states give the same bytes in any process.
Bytes per token: (len(layer_ids) + 1) * H * dtype bytes + 5, plus 8 per sample.

Shards are written to a temporary name and renamed when whole, so a reader never sees a partial one.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from remote.step import BadInput

SHARD_KEYS = ("hidden_states", "last_hidden_state", "input_ids", "loss_mask", "cu_seqlens")


@dataclass(frozen=True)
class Sample:
    sample_id: str
    split: str
    input_ids: torch.Tensor  # [T] int32
    loss_mask: torch.Tensor  # [T] uint8
    hidden_states: torch.Tensor  # [T, n_aux * H]
    last_hidden_state: torch.Tensor  # [T, H]


def write_shard(path: str | os.PathLike, samples: Sequence[Sample], layer_ids: Sequence[int]) -> int:
    """Pack samples into one shard at `path` (temporary name, then rename). Returns its bytes."""
    if not samples:
        raise ValueError("a shard needs at least one sample")
    path = Path(path)
    lengths = [int(s.input_ids.numel()) for s in samples]
    cu = torch.zeros(len(samples) + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    tensors = {
        "hidden_states": torch.cat([s.hidden_states for s in samples]).contiguous(),
        "last_hidden_state": torch.cat([s.last_hidden_state for s in samples]).contiguous(),
        "input_ids": torch.cat([s.input_ids.to(torch.int32) for s in samples]),
        "loss_mask": torch.cat([s.loss_mask.to(torch.uint8) for s in samples]),
        "cu_seqlens": cu,
    }
    meta = {
        "sample_ids": json.dumps([s.sample_id for s in samples]),
        "splits": json.dumps([s.split for s in samples]),
        "layer_ids": json.dumps(list(layer_ids)),
        "hidden_size": str(samples[0].last_hidden_state.shape[-1]),
    }
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save_file(tensors, str(tmp), metadata=meta)
    _sort_metadata_and_sync(tmp)
    os.replace(tmp, path)
    return path.stat().st_size


def _sort_metadata_and_sync(path: Path) -> None:
    """Rewrite a safetensors header in place with its metadata keys sorted, then fsync. safetensors
    writes them in hash order, which changes from process to process; sorted, the same capture gives
    the same bytes, so a checksum can say "same"."""
    with open(path, "r+b") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
        header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        if len(text) > size:  # only the order changed, so never; but never write over the tensors
            raise RuntimeError(f"{path}: the sorted safetensors header is longer than the written one")
        f.seek(8)
        f.write(text.ljust(size))  # safetensors pads its header with spaces
        f.flush()
        os.fsync(f.fileno())


def shard_index(path: str | os.PathLike) -> tuple[list[str], list[str]]:
    """(sample_ids, splits) of a shard, read from its header only."""
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if "sample_ids" not in meta:
        raise BadInput(f"{path}: not an eaglet capture shard (no sample_ids in its metadata)")
    return json.loads(meta["sample_ids"]), json.loads(meta["splits"])


def read_shard(path: str | os.PathLike, split: str | None = None, wanted: set[str] | None = None) -> Iterator[Sample]:
    """The samples of one shard, optionally only one split and/or only the wanted sample ids."""
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        missing = [k for k in SHARD_KEYS if k not in f.keys()]
        if missing or "sample_ids" not in meta:
            raise BadInput(f"{path}: not an eaglet capture shard (missing {missing or ['sample_ids']})")
        ids, splits = json.loads(meta["sample_ids"]), json.loads(meta["splits"])
        t = {k: f.get_tensor(k) for k in SHARD_KEYS}
    cu = t["cu_seqlens"].tolist()
    for i, (sid, sp) in enumerate(zip(ids, splits)):
        if (split is not None and sp != split) or (wanted is not None and sid not in wanted):
            continue
        a, b = cu[i], cu[i + 1]
        yield Sample(sid, sp, t["input_ids"][a:b], t["loss_mask"][a:b], t["hidden_states"][a:b], t["last_hidden_state"][a:b])


@dataclass(frozen=True)
class CaptureSet:
    """What a finished capture step hands on: read from its manifest."""

    shards: tuple[str, ...]  # absolute paths
    layer_ids: tuple[int, ...]
    hidden_size: int
    dtype: str
    target: str  # the target model's path on the host
    sample_ids: frozenset[str] | None = None  # None: every sample of the shards

    @classmethod
    def from_manifest(cls, capture_dir: str | os.PathLike) -> "CaptureSet":
        p = Path(capture_dir) / "manifest.json"
        if not p.is_file():
            raise BadInput(f"{capture_dir}: no finished capture here (no manifest.json)")
        m = json.loads(p.read_text())
        c = m["capture"]
        return cls(
            shards=tuple(c["shards"]),
            layer_ids=tuple(c["layer_ids"]),
            hidden_size=int(c["hidden_size"]),
            dtype=c["dtype"],
            target=c["target"],
            sample_ids=frozenset(c["sample_ids"]) if c.get("sample_ids") is not None else None,
        )

    def samples(self, split: str | None = None) -> Iterator[Sample]:
        for shard in self.shards:
            yield from read_shard(shard, split=split, wanted=self.sample_ids)
