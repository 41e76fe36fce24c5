"""Captured hidden states on disk: the hand-off from capture to vocab, training and evaluation.

A capture is a set of packed shards. One shard is one safetensors file holding whole samples
back to back (no padding):

    hidden_states      [T, len(layer_ids) * H]  storage dtype, aux layers concatenated in layer_ids order
    last_hidden_state  [T, H]                   storage dtype, the final decoder layer's pre-norm output
    input_ids          [T]                      int32
    loss_mask          [T]                      uint8 (1 on tokens the assistant wrote)
    cu_seqlens         [n + 1]                  int64, sample i is rows cu_seqlens[i]:cu_seqlens[i+1]

with metadata `sample_ids` and `splits` (JSON lists, one entry a sample), `layer_ids` (JSON),
`hidden_size`, `dtype` (the capture's) and `storage` (the states' on disk), keys sorted: the same
samples and states give the same bytes in any process.

The storage dtype is the capture dtype (storage "auto") or "fp8": float8 e4m3 with one float32 scale
per token and layer (its absmax / 448, e4m3's largest value), in `hidden_states_scale` [T, len(layer_ids)]
and `last_hidden_state_scale` [T, 1]; readers get the states dequantized to the capture dtype
(`read_rows`), each value within e4m3's rounding (2^-4 of itself, 2^-10 of the scale near zero).
Bytes per token: `bytes_per_token` ((len(layer_ids) + 1) * H * value bytes + 5, fp8 adds 4 a layer),
plus 8 per sample and the header (`shard_overhead`).

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

from remote.capture.config import FP8
from remote.step import BadInput

SHARD_KEYS = ("hidden_states", "last_hidden_state", "input_ids", "loss_mask", "cu_seqlens")
STATE_KEYS = ("hidden_states", "last_hidden_state")
SCALE = "_scale"  # suffix of an fp8 state's scales
FP8_MAX = 448.0  # float8 e4m3fn's largest finite value
VALUE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, FP8: 1}


def storage_of(dtype: str, storage: str) -> str:
    """The states' dtype on disk: the capture dtype (storage "auto") or fp8."""
    return FP8 if storage == FP8 else dtype


def bytes_per_token(n_aux: int, hidden: int, storage: str) -> int:
    """Bytes a token takes in a shard: its states, fp8's scales, its input id (4) and loss mask (1)."""
    scales = 4 * (n_aux + 1) if storage == FP8 else 0
    return (n_aux + 1) * hidden * VALUE_BYTES[storage] + scales + 5


SHARD_HEADER_BYTES = 1024  # a shard's header beyond its samples' entries, within a few hundred bytes


def size_text(n: int) -> str:
    """Bytes as the disk plans print them: GB (1e9, two decimals) from 10 MB, else the bytes."""
    return f"{n / 1e9:,.2f} GB" if n >= 10**7 else f"{n:,} bytes"


def sample_overhead(sample_id: str, split: str) -> int:
    """Bytes a sample adds to a shard beyond its tokens: its cu_seqlens entry, its id and split in the header."""
    return 8 + len(sample_id) + len(split) + 12


def shard_overhead(sample_ids: Sequence[str], splits: Sequence[str]) -> int:
    """Bytes of a shard beyond its tokens: cu_seqlens and the header (ids and splits, escaped, and the
    tensor entries), within a few hundred bytes."""
    return SHARD_HEADER_BYTES + sum(sample_overhead(sid, sp) for sid, sp in zip(sample_ids, splits))


def quantize(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, groups * H] -> (float8 e4m3 [T, groups * H], float32 scales [T, groups]): per token and group
    (layer), the absmax maps to 448. A token-layer of zeros keeps scale 0; NaN or Inf stays NaN."""
    t = x.float().reshape(x.shape[0], groups, -1)
    scale = t.abs().amax(-1) / FP8_MAX
    q = t / scale.clamp(min=torch.finfo(torch.float32).tiny)[..., None]
    return q.to(torch.float8_e4m3fn).reshape(x.shape), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    t = q.float().reshape(q.shape[0], scale.shape[1], -1) * scale[..., None]
    return t.reshape(q.shape).to(dtype)


def read_rows(f, keys: Sequence[str], start: int = 0, stop: int | None = None,
              dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Rows start:stop of these tensors of an open shard (safe_open), fp8 states dequantized to dtype
    (None: the shard's capture dtype)."""
    out = {}
    for k in keys:
        x = f.get_slice(k)[start:stop]
        if x.dtype == torch.float8_e4m3fn:
            x = dequantize(x, f.get_slice(k + SCALE)[start:stop], dtype or getattr(torch, f.metadata()["dtype"]))
        out[k] = x
    return out


def shard_storage(f) -> str:
    """The storage dtype of an open shard's states (shards from before fp8 say so by their tensors)."""
    meta = f.metadata() or {}
    return meta.get("storage") or _dtype_name(f.get_slice("hidden_states").get_dtype())


def _dtype_name(dtype) -> str:
    """'bfloat16' for torch.bfloat16 or safetensors' 'BF16'."""
    return {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F8_E4M3": FP8}.get(dtype) or str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Sample:
    sample_id: str
    split: str
    input_ids: torch.Tensor  # [T] int32
    loss_mask: torch.Tensor  # [T] uint8
    hidden_states: torch.Tensor  # [T, n_aux * H]
    last_hidden_state: torch.Tensor  # [T, H]


def write_shard(path: str | os.PathLike, samples: Sequence[Sample], layer_ids: Sequence[int],
                storage: str = "auto") -> int:
    """Pack samples into one shard at `path` (temporary name, then rename), the states in the storage
    dtype ("auto": as they are; "fp8": quantized). Returns its bytes."""
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
    dtype = _dtype_name(samples[0].hidden_states.dtype)
    if storage == FP8:
        for k, groups in zip(STATE_KEYS, (len(layer_ids), 1)):
            tensors[k], tensors[k + SCALE] = quantize(tensors[k], groups)
    meta = {
        "sample_ids": json.dumps([s.sample_id for s in samples]),
        "splits": json.dumps([s.split for s in samples]),
        "layer_ids": json.dumps(list(layer_ids)),
        "hidden_size": str(samples[0].last_hidden_state.shape[-1]),
        "dtype": dtype,
        "storage": storage_of(dtype, storage),
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
        t = read_rows(f, SHARD_KEYS)
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
    dtype: str  # the capture's; fp8 states are read back in it
    target: str  # the target model's path on the host
    sample_ids: frozenset[str] | None = None  # None: every sample of the shards
    storage: str = ""  # the states' dtype on disk: fp8, or "" / the capture dtype

    @property
    def storage_dtype(self) -> str:
        return self.storage or self.dtype

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
            storage=c.get("storage_dtype", ""),
        )

    def check_storage(self, shard: str, f) -> None:
        """Refuse a shard whose states are stored otherwise than the capture says (a set mixing fp8 and
        bf16 shards), by name."""
        held = shard_storage(f)
        if held != self.storage_dtype:
            raise BadInput(f"{shard} holds {held} states; this capture's are {self.storage_dtype}: a capture set "
                           f"mixing storage dtypes is refused (capture again with one capture.storage_dtype)")

    def samples(self, split: str | None = None) -> Iterator[Sample]:
        for shard in self.shards:
            yield from read_shard(shard, split=split, wanted=self.sample_ids)
