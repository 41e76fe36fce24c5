"""The configs of the capture stage's steps: patch_worker, capture (standard library only, so the
controller imports them)."""
from __future__ import annotations

from dataclasses import dataclass

# backend name -> "module:Class" (remote.capture.backend.make_backend builds it)
BACKENDS = {
    "vllm": "remote.capture.backend_vllm:VllmCapture",
    "transformers": "remote.capture.backend_transformers:HfCapture",
}
DTYPES = ("auto", "bfloat16", "float16", "float32")


@dataclass(frozen=True, kw_only=True)
class PatchWorkerConfig:
    target: str  # the target model folder on this host (config.json is read, weights are not)
    out_dir: str  # this step's folder (its manifest)
    tensor_parallel_size: int = 1  # GPUs (CPU ranks on a CPU host) the capture will use
    layer_ids: list[int] | None = None  # the aux layers the capture will hook; None: (2, N//2, N-3)
    gpu_memory_utilization: float = 0.85  # share of each GPU vLLM will take
    cpu_kvcache_gib: int = 2  # KV cache per rank on a CPU host, GiB
    trust_remote_code: bool = False  # let vLLM run the target's own config code

    def __post_init__(self):
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size}: must be at least 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization}: must be in (0, 1]")


@dataclass(frozen=True, kw_only=True)
class CaptureConfig:
    dataset: str  # the prepare step's data.parquet (sample_id, input_ids, loss_mask, length, split)
    target: str  # the target model folder on this host (HF layout: config.json, safetensors, tokenizer)
    out_dir: str  # this step's folder; it holds the manifest, the shards live in the cache
    cache_root: str  # the host's cache folder: shards are kept in <cache_root>/captures/<key>/
    target_revision: str = ""  # a label for the weights, part of the cache key; "": hashes of the target's files
    backend: str = "vllm"  # "vllm" or "transformers"
    tensor_parallel_size: int = 1  # GPUs (CPU ranks on a CPU host) the target is split over (vllm)
    layer_ids: list[int] | None = None  # aux hidden-state indices, HF numbering; None: (2, N//2, N-3)
    samples_per_shard: int = 256  # samples in one shard, the unit of resume
    max_shard_gib: float = 4.0  # a shard also closes before it would pass this size (GiB): bounds memory
    max_num_seqs: int = 64  # requests in flight in one engine step (vllm)
    max_num_batched_tokens: int = 8192  # tokens of one forward pass: vLLM's step budget, HF's pack size
    dtype: str = "auto"  # of the forward and the shards; "auto": the target's own (config.json)
    gpu_memory_utilization: float = 0.85  # share of each GPU vLLM may take
    max_model_len: int = 0  # vLLM's context length; 0: the longest sample + 1
    cpu_kvcache_gib: int = 2  # KV cache per rank on a CPU host (VLLM_CPU_KVCACHE_SPACE), GiB
    device: str = "auto"  # transformers backend: "auto" (cuda when there is one), "cuda", "cpu"
    trust_remote_code: bool = False  # let vLLM / transformers run the target's own code (its config classes)
    engine_start_s: float = 1800.0  # seconds vLLM may take to start (load the weights, warm up); then it fails
    host_part: int = 0  # this host's part of a run over host_parts hosts: it captures only the samples
    host_parts: int = 1  # with remote.data.prepare.host_of(sample_id, host_parts) == host_part (1: all of them)

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"backend {self.backend!r}: choose one of {BACKENDS}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r}: choose one of {DTYPES}")
        for name in ("tensor_parallel_size", "samples_per_shard", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be at least 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization}: must be in (0, 1]")
        if self.max_shard_gib <= 0:
            raise ValueError(f"max_shard_gib={self.max_shard_gib}: must be positive")
        if self.engine_start_s <= 0:
            raise ValueError(f"engine_start_s={self.engine_start_s}: must be positive")
        if not 0 <= self.host_part < self.host_parts:
            raise ValueError(f"host_part={self.host_part} of host_parts={self.host_parts}: need 0 <= host_part < host_parts")
        if self.backend == "transformers" and self.tensor_parallel_size != 1:
            raise ValueError("the transformers backend runs on one device: set tensor_parallel_size=1")
