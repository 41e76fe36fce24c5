"""The configs of the evaluate stage's steps: evaluate, online_eval, promote (standard library only,
so the controller imports them)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from remote.step import BadInput, load_config

CURRENT = "current"  # drafts/current: the link to the promoted draft


@dataclass(frozen=True, kw_only=True)
class OnlineConfig:
    target: str  # the target model's folder on this host
    draft_dir: str  # the exported eagle3 draft folder (remote.train.export)
    data: str  # the prepare step's data.parquet (or its folder): held-out prompts come from it
    out_dir: str = ""  # where online.json and the manifest go (only when run as its own step)
    num_speculative_tokens: int = 3  # k: tokens the draft proposes per target forward
    prompts: int = 32  # held-out prompts at most
    max_tokens: int = 64  # tokens generated per prompt (end of sequence ignored, so every arm decodes as much)
    temperature: float = 0.0  # a second pass at this temperature when > 0 (greedy always runs)
    baseline: bool = True  # measure the target alone (the speed-up's denominator)
    ngram: bool = True  # measure vLLM's n-gram (prompt lookup) speculation too
    ngram_min: int = 2  # shortest n-gram prompt lookup matches
    ngram_max: int = 4  # longest n-gram prompt lookup matches
    previous_draft_dir: str = ""  # a previously published draft measured on the same prompts ("": none)
    max_seconds: float = 300.0  # generation time budget of the baseline arm; the prompt count it reaches is used by all
    max_num_seqs: int = 8  # requests decoded together (speculation pays most at small batches)
    tensor_parallel_size: int = 1  # GPUs the target is split over
    dtype: str = "auto"  # vLLM dtype of the target ("auto": its config's, bf16 on the CPU)
    gpu_memory_utilization: float = 0.85  # share of each GPU vLLM may take
    enforce_eager: bool = False  # skip CUDA graphs / torch.compile (always on the CPU, where they cost start time)
    cpu_kvcache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE on a CPU host (startup fails on memory without it)
    cpu_threads: int = 0  # torch threads of the in-process CPU engine (0: all cores but one, at least 1)
    seed: int = 0  # sampling seed of the temperature pass

    def __post_init__(self):
        for name in ("num_speculative_tokens", "prompts", "max_tokens", "max_num_seqs", "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be at least 1")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature}: must be >= 0")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"ngram_min={self.ngram_min}, ngram_max={self.ngram_max}: need 1 <= min <= max")
        if self.max_seconds <= 0:
            raise ValueError(f"max_seconds={self.max_seconds}: must be positive")


@dataclass(frozen=True, kw_only=True)
class EvaluateConfig:
    target: str  # the target model's folder on this host
    draft_dir: str  # the exported draft (remote.train.export)
    data: str  # the prepare step's data.parquet (or folder): held-out prompts for the online run
    out_dir: str  # where evaluation.json and the manifest go (through out_dir.partial)
    capture_dir: str = ""  # a finished capture: the offline run reads its held-out samples ("": no offline run)
    num_speculative_tokens: int = 3  # k: the acceptance length reported is for k speculative tokens
    offline_steps: int = 0  # chain steps measured offline (0: k); the per-position table shows them all
    offline_max_tokens: int = 262144  # held-out captured tokens the offline run reads at most
    token_budget: int = 2048  # tokens per offline batch (dense attention: memory grows with its square)
    device: str = "auto"  # offline device: "auto" (cuda when there is one), "cuda" or "cpu"
    run_online: bool = True  # measure in vLLM too
    online: dict = field(default_factory=dict)  # remote.evaluate.online.OnlineConfig fields (prompts, max_tokens, ...)
    train_dir: str = ""  # the train step folder (loss curve); "": the one the draft's export manifest names
    vocab_dir: str = ""  # the vocab step folder (coverage); "": the one the export manifest names

    def __post_init__(self):
        if self.num_speculative_tokens < 1 or self.offline_steps < 0:
            raise ValueError("num_speculative_tokens must be >= 1 and offline_steps >= 0")
        if self.device not in ("auto", "cuda", "cpu"):
            raise ValueError(f"device={self.device!r}: choose auto, cuda or cpu")
        if not self.capture_dir and not self.run_online:
            raise ValueError("nothing to measure: give capture_dir (offline) or run_online=true")

    def online_config(self) -> OnlineConfig:
        fixed = {"target": self.target, "draft_dir": self.draft_dir, "data": self.data,
                 "num_speculative_tokens": self.num_speculative_tokens}
        clash = sorted(set(fixed) & set(self.online))
        if clash:
            raise BadInput(f"online: {clash} are set at the top level of the evaluate config, not under online")
        return load_config(OnlineConfig, {**self.online, **fixed}, where="online")


@dataclass(frozen=True, kw_only=True)
class PromoteConfig:
    out_dir: str  # this run's promote folder: the decision's manifest
    drafts_root: str  # <root>/drafts: the promoted drafts and the `current` link
    candidate_dir: str  # the run's exported draft (a folder vLLM loads)
    name: str  # the candidate's folder name under drafts_root (the run name)
    figures: dict  # the candidate's evaluation figures
    metric: str = "acceptance_length"  # the figure compared; higher is better
    margin: float = 0.0  # promote only when candidate - current is more than this (same unit as metric)
    context: dict = field(default_factory=dict)  # kept in the record: run, data fingerprint, warm start...

    def __post_init__(self):
        if not self.name or "/" in self.name or self.name.startswith(".") or self.name == CURRENT:
            raise ValueError(f"name={self.name!r}: a plain folder name, not '{CURRENT}', no '/', no leading '.'")
        if not math.isfinite(self.margin):
            raise ValueError(f"margin={self.margin}: must be a finite number")
