"""The vLLM engine's settings, one name and one default each (standard library only: the controller reads them).

Every step that starts an engine (capture, patch_worker's check, regenerate, online evaluation) takes its
settings through EngineOptions, so `tensor_parallel_size`, `gpu_memory_utilization`, ... mean the same in
`capture`, `data.regenerate` and `eval`; a group whose default differs (online evaluation decodes small
batches) redeclares that field with its own docstring.

The host's GPU count is stated once, `host.gpus` (tasks/host/params.py): a count field left at HOST_GPUS (0)
takes it (`gpu_count`), in the flow's parameters (flows/params.py) before any step config is built. A step
config built without the flow (a test, a bench, a step run by hand) has no host to ask: there 0 is one
(`one_when_unset`). On the host the device check (remote.engine.devices) then refuses a count the host's
GPUs cannot hold, naming the parameter.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from remote.config import Checked, ConfigError, bounded

DTYPES = ("auto", "bfloat16", "float16", "float32")
HOST_GPUS = 0  # a count field's default: the host's GPUs (host.gpus), or one when none is stated
FROM_HOST = "0: the host's, host.gpus (1 when it is not stated or 0)"


@dataclass(frozen=True, kw_only=True)
class EngineOptions(Checked):
    """How a vLLM engine is started: the same names in capture, data.regenerate and eval."""

    tensor_parallel_size: int = bounded(HOST_GPUS, ge=0)
    """GPUs the target is split over (CPU ranks on a CPU host); 0: the host's, host.gpus (1 when it is not stated or 0)"""
    gpu_memory_utilization: float = bounded(0.85, gt=0, le=1)
    """share of each GPU's memory vLLM may take"""
    cpu_kvcache_gib: int = bounded(2, ge=1)
    """KV cache per rank on a CPU host (VLLM_CPU_KVCACHE_SPACE), GiB"""
    max_num_seqs: int = bounded(64, ge=1)
    """requests in flight in the engine"""
    max_num_batched_tokens: int = bounded(8192, ge=1)
    """tokens of one engine step (one forward pass); the transformers capture's pack size"""
    max_model_len: int = bounded(0, ge=0)
    """the engine's context (prompt + what is generated); 0: the step's own (capture: the longest sample + 1;
    regenerate: the target's max_position_embeddings; online evaluation: the longest prompt + max_tokens + k + 1)"""
    dtype: Literal[DTYPES] = "auto"
    """of the target's weights in the engine; auto: the target's own (config.json), in online evaluation vLLM's
    choice (bf16 on a CPU)"""
    engine_start_s: float = bounded(1800.0, gt=0)
    """seconds vLLM may take to start (load the weights, warm up); then it fails"""


def gpu_count(name: str, value: int, host_gpus: int | None) -> int:
    """A count field (`name`, e.g. "capture.tensor_parallel_size") with HOST_GPUS replaced by the host's GPU
    count (one on a CPU host or when none is stated); ConfigError when it is more than host.gpus states."""
    if value == HOST_GPUS:
        return host_gpus or 1
    if host_gpus and value > host_gpus:
        raise ConfigError(f"{name}={value} is more than host.gpus={host_gpus}: lower it, or state the host's real "
                          "GPU count in host.gpus")
    return value


def one_when_unset(cfg, *names: str) -> None:
    """In a step config built without the flow, a count field still at HOST_GPUS is one (there is no host.gpus)."""
    for name in names:
        if getattr(cfg, name) == HOST_GPUS:
            object.__setattr__(cfg, name, 1)
