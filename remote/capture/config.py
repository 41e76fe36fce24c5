"""The configs of the capture stage's steps: patch_worker, capture (standard library only, so the
controller imports them; remote/config.py says how a config is checked)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from remote.config import Checked, ConfigError, bounded
from remote.engine.config import DTYPES, EngineOptions, one_when_unset

# backend name -> "module:Class" (remote.capture.backend.make_backend builds it); Backend lists the names
BACKENDS = {
    "vllm": "remote.capture.backend_vllm:VllmCapture",
    "transformers": "remote.capture.backend_transformers:HfCapture",
}
Backend = Literal[tuple(BACKENDS)]
FP8 = "fp8"
STORAGE_DTYPES = ("auto", FP8)


@dataclass(frozen=True, kw_only=True)
class PatchWorkerOptions(EngineOptions):
    """What the capture worker is checked for before the capture starts: the engine it will run in (EngineOptions)."""

    layer_ids: list[int] | None = None
    """aux hidden-state indices (HF numbering); none: (2, N//2, N-3)"""


@dataclass(frozen=True, kw_only=True)
class CaptureOptions(PatchWorkerOptions):
    """How the target's hidden states are captured (the worker check takes its part of these)."""

    backend: Backend = "vllm"
    """vllm: the serving engine, tensor parallel; transformers: the numerical reference, for targets vLLM cannot load"""
    samples_per_shard: int = bounded(256, ge=1)
    """samples packed in one capture shard (the unit of resume)"""
    max_shard_gib: float = bounded(4.0, gt=0)
    """a shard also closes before it would pass this size (GiB): bounds memory"""
    storage_dtype: Literal[STORAGE_DTYPES] = "auto"
    """of the states on disk; auto: the capture dtype; fp8: float8 e4m3 with a float32 scale per token and
    layer, about half of bf16's bytes (read back in the capture dtype, within e4m3's rounding)"""
    max_disk_gb: float = bounded(0.0, ge=0)
    """disk budget of the capture's shards, GB (10^9 bytes): those the cache holds for these samples plus
    those to write; a capture that would pass it is refused before the engine starts, and the training flow
    (one host) captures and trains in windows that fit it instead (docs/TRAINING.md); 0: no budget"""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """transformers backend: auto (cuda when there is one), cuda or cpu"""


@dataclass(frozen=True, kw_only=True)
class PatchWorkerConfig(PatchWorkerOptions):
    target: str
    """the target model folder on this host (config.json is read, weights are not)"""
    out_dir: str
    """this step's folder (its manifest)"""
    trust_remote_code: bool = False
    """let vLLM run the target's own config code"""

    def __post_init__(self):
        super().__post_init__()
        one_when_unset(self, "tensor_parallel_size")


@dataclass(frozen=True, kw_only=True)
class CaptureConfig(CaptureOptions):
    dataset: str
    """the prepare step's data.parquet (sample_id, input_ids, loss_mask, length, split)"""
    target: str
    """the target model folder on this host (HF layout: config.json, safetensors, tokenizer)"""
    out_dir: str
    """this step's folder; it holds the manifest, the shards live in the cache"""
    cache_root: str
    """the host's cache folder: shards are kept in <cache_root>/captures/<key>/"""
    target_revision: str = ""
    """a label for the weights, part of the cache key; "": hashes of the target's files"""
    trust_remote_code: bool = False
    """let vLLM / transformers run the target's own code (its config classes)"""
    host_part: int = bounded(0, ge=0)
    """this host's part of a run over host_parts hosts: it captures only the samples with
    remote.split.host_of(sample_id, host_parts) == host_part"""
    host_parts: int = bounded(1, ge=1)
    """hosts that share the capture (1: this one captures all of them)"""
    sample_ids: str = ""
    """a JSON file listing the ids of the samples to capture (a window's, from the windows step); "": every sample"""

    def __post_init__(self):
        super().__post_init__()
        one_when_unset(self, "tensor_parallel_size")
        if not self.host_part < self.host_parts:
            raise ConfigError(f"host_part={self.host_part} of host_parts={self.host_parts}: need 0 <= host_part < host_parts")
        if self.backend == "transformers" and self.tensor_parallel_size != 1:
            raise ConfigError("the transformers backend runs on one device: set tensor_parallel_size=1")


@dataclass(frozen=True, kw_only=True)
class FreeCaptureConfig(Checked):
    capture_dir: str
    """a finished capture step folder of one window (its manifest lists its shards in the cache)"""
    out_dir: str
    """this step's folder (its manifest: the shards removed and the bytes freed)"""
