"""The training flow's parameters: pydantic models, so the Prefect UI shows them as a form.

Every field has a default that runs the embedded demo (the local host, SmolLM2-135M-Instruct and a
ShareGPT sample from PyPI); a preset in deployments/ overrides a few of them.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

from remote.data.regenerate import RegenerateOptions
from tasks.hosts import HostParams
from tasks.multihost import DEFAULT_RDZV_PORT


class _Params(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt key is an error, not a silent default


class TargetParams(_Params):
    model: str = Field("", description="HF model folder of the target on the host; empty: the embedded SmolLM2-135M-Instruct")
    revision: str = Field("", description="a label for the target's weights (part of the capture cache key); empty: hash of its config and index")
    trust_remote_code: bool = Field(False, description="let transformers run the target's own code (Kimi-K2.5's tokenizer needs it)")


class DataParams(_Params):
    inputs: list[str] = Field(default_factory=list, description="chat data on the host (JSONL, JSON, Parquet files, folders, a saved datasets folder); empty: the embedded ShareGPT sample")
    demo_conversations: int = Field(300, ge=1, description="conversations taken from the ShareGPT package when inputs is empty")
    max_length: int = Field(2048, ge=16, description="tokens a sample may have")
    long_policy: Literal["truncate", "drop"] = Field("truncate", description="what happens to a longer sample")
    heldout_permille: int = Field(50, ge=0, le=1000, description="share of samples held out for evaluation, per mille, decided by each sample's hash")
    max_bad_fraction: float = Field(0.5, ge=0, le=1, description="fail when more than this share of rows is malformed")
    max_samples: Optional[int] = Field(None, ge=1, description="use at most this many samples (none: all)")
    regenerate: RegenerateOptions = Field(default_factory=RegenerateOptions, description="have the target answer the prompts itself before prepare (remote/data/regenerate.py): off by default, or the sampling settings")


class CaptureParams(_Params):
    backend: Literal["vllm", "transformers"] = Field("vllm", description="vllm: the serving engine, tensor parallel; transformers: the numerical reference, for targets vLLM cannot load")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs the target is split over (8 on a Kimi-K2.5 host)")
    layer_ids: Optional[list[int]] = Field(None, description="aux hidden-state indices (HF numbering); none: (2, N//2, N-3)")
    samples_per_shard: int = Field(256, ge=1, description="samples packed in one capture shard (the unit of resume)")
    max_num_seqs: int = Field(64, ge=1, description="requests in flight in the engine")
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1, description="share of each GPU's memory vLLM may take")


class TrainParams(_Params):
    draft_vocab_size: int = Field(32000, ge=1, description="tokens of the draft's vocabulary (fewer when the data has fewer)")
    ttt_steps: int = Field(7, ge=1, description="training-time-test steps unrolled")
    epochs: float = Field(2.0, gt=0, description="passes over the train split")
    lr: float = Field(3e-4, gt=0, description="peak learning rate (AdamW)")
    batch_tokens: int = Field(8192, ge=16, description="tokens packed in one step on one process")
    nproc_per_node: int = Field(1, ge=1, description="training processes on each host (one a GPU)")
    checkpoint_every: int = Field(200, ge=1, description="steps between checkpoints")
    warm_start: str = Field("", description="a draft folder to start from (the nightly run's current draft); empty: from scratch")


class EvalParams(_Params):
    num_speculative_tokens: int = Field(3, ge=1, description="tokens the draft proposes per step in vLLM")
    prompts: int = Field(32, ge=1, description="held-out prompts generated for")
    max_tokens: int = Field(64, ge=1, description="tokens generated per prompt")
    temperature: float = Field(0.0, ge=0, description="sampling temperature of the second online run (0: greedy only)")
    online: bool = Field(True, description="measure acceptance in vLLM on the host (not only offline)")
    baseline: bool = Field(True, description="also decode with the target alone: the speed-up's denominator")
    ngram: bool = Field(True, description="also measure vLLM's n-gram (prompt lookup) speculation, a draft-free baseline")
    max_seconds: float = Field(300.0, gt=0, description="generation time budget of the baseline arm; the prompts it reaches are used by every arm")
    max_num_seqs: int = Field(8, ge=1, description="requests decoded together online (speculation pays most at small batches)")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs the target is split over in the online run")
    dtype: str = Field("auto", description="vLLM dtype of the target online ('auto': its config's)")
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1, description="share of each GPU vLLM may take online")


class RendezvousParams(_Params):
    """torchrun's rendezvous of a run over several hosts, held by the first host (docs/HOSTS.md)."""

    address: str = Field("", description="the first host as the other hosts reach it; empty: its hostname")
    port: int = Field(DEFAULT_RDZV_PORT, ge=1, le=65535, description="TCP port of the rendezvous on the first host")


class TrainDraftParams(_Params):
    """Everything one run of the training flow takes."""

    host: HostParams = Field(default_factory=HostParams, description="where the steps run (node 0 of several hosts: export and evaluation run here)")
    extra_hosts: list[HostParams] = Field(default_factory=list, description="more GPU hosts: each captures its share of the samples, training spans them all")
    rendezvous: RendezvousParams = Field(default_factory=RendezvousParams, description="where the hosts meet for training (with extra_hosts)")
    run_name: str = Field("", description="folder name under <root>/runs; empty: made from the date")
    target: TargetParams = Field(default_factory=TargetParams)
    data: DataParams = Field(default_factory=DataParams)
    capture: CaptureParams = Field(default_factory=CaptureParams)
    train: TrainParams = Field(default_factory=TrainParams)
    eval: EvalParams = Field(default_factory=EvalParams)

    @classmethod
    def from_preset(cls, path: str | Path | None, overrides: dict | None = None) -> "TrainDraftParams":
        """A preset file (JSON; none: the defaults) with dotted-key overrides, e.g. {"train.epochs": 1}."""
        data = json.loads(Path(path).read_text()) if path else {}
        for key, value in (overrides or {}).items():
            node = data
            *parents, leaf = key.split(".")
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = value
        return cls.model_validate(data)
