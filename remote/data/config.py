"""The configs of the data stage's steps: prepare, embedded_default, data_delta (standard library only,
so the controller imports them; remote/config.py says how a config is checked)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from remote.config import Checked, ConfigError, bounded, require_paths
from remote.engine.config import HOST_GPUS, EngineOptions, one_when_unset


@dataclass(frozen=True, kw_only=True)
class PrepareOptions(Checked):
    """How the chat data becomes training samples."""

    inputs: list[str] = field(default_factory=list)
    """chat data on the host (JSONL, JSON, Parquet files, folders, a saved datasets folder, hub:NAME[:SPLIT]); empty: the embedded ShareGPT sample"""
    max_length: int = bounded(2048, ge=16)
    """tokens a sample may have"""
    long_policy: Literal["truncate", "drop"] = "truncate"
    """what happens to a longer sample: truncate keeps its first max_length tokens, drop skips it"""
    heldout_permille: int = bounded(50, ge=0, le=1000)
    """share of samples held out for evaluation, per mille, decided by each sample's hash"""
    max_bad_fraction: float = bounded(0.5, ge=0, le=1)
    """fail when more than this share of rows is malformed"""
    max_samples: int | None = bounded(None, ge=1)
    """use at most this many samples, the first in input order (none: all)"""
    batch_size: int = bounded(256, ge=1)
    """conversations rendered and tokenized together"""


@dataclass(frozen=True, kw_only=True)
class RegenerateOptions(EngineOptions):
    """The flow's `data.regenerate`: the target answers the prompts itself before prepare (off by default); its
    vLLM engine takes EngineOptions (max_model_len 0: the target's max_position_embeddings)."""

    enabled: bool = False
    """regenerate the answers with the target before prepare (off: train on the data's own answers)"""
    backend: Literal["vllm", "transformers"] = "vllm"
    """vllm: tensor parallel; transformers: one device, no vLLM"""
    temperature: float = bounded(0.0, ge=0)
    """sampling temperature of the train split (0: greedy); the held-out split is always greedy"""
    top_p: float = bounded(1.0, gt=0, le=1)
    """nucleus sampling mass"""
    max_tokens: int = bounded(1024, ge=1)
    """tokens an answer may have (its end-of-turn token included)"""
    seed: int = bounded(0, ge=0)
    """base of every request's own seed"""
    n: int = bounded(1, ge=1)
    """answers per train prompt (each a conversation of its own); held-out prompts get one"""
    turns: Literal["all", "last"] = "all"
    """all: every assistant turn, turn by turn; last: only the last one"""
    thinking: Literal["keep", "drop", "disable"] = "keep"
    """a reasoning target's <think> block: kept as written, dropped, or disabled in the template"""
    keep_cut: bool = False
    """keep answers cut at max_tokens (their end-of-turn token is then not the target's)"""
    samples_per_shard: int = bounded(512, ge=1)
    """prompts in one cache shard, the unit of resume"""
    batch_size: int = bounded(16, ge=1)
    """prompts generated together (transformers)"""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """transformers backend: auto (cuda when there is one), cuda or cpu"""

    def __post_init__(self):
        super().__post_init__()
        if self.backend == "transformers" and self.tensor_parallel_size not in (HOST_GPUS, 1):
            raise ConfigError("tensor_parallel_size: the transformers backend runs on one device: set it to 1")


@dataclass(frozen=True, kw_only=True)
class RegenerateConfig(RegenerateOptions):
    inputs: list[str]
    """the conversations prepare would read (files, folders, saved datasets)"""
    target: str
    """the target model folder on this host: its weights, tokenizer and chat template"""
    out_dir: str
    """where conversations.jsonl and manifest.json go (through out_dir.partial)"""
    cache_root: str
    """the host's cache folder: answers are kept in <cache_root>/regenerate/<key>/"""
    target_revision: str = ""
    """a label for the weights, part of the cache key; "": the target's path"""
    heldout_permille: int = bounded(PrepareOptions.heldout_permille, ge=0, le=1000)
    """prepare's: which prompts are held out (answered greedily)"""
    max_samples: int | None = bounded(None, ge=1)
    """answer only the first this many conversations (prepare's max_samples)"""
    trust_remote_code: bool = False
    """load a target / tokenizer that ships its own code"""

    def __post_init__(self):
        super().__post_init__()
        one_when_unset(self, "tensor_parallel_size")
        require_paths(self, "inputs")


@dataclass(frozen=True, kw_only=True)
class DataOptions(PrepareOptions):
    """The data stage as the flow shows it: prepare's options and the size of the embedded demo data."""

    demo_conversations: int = bounded(300, ge=1)
    """conversations taken from the ShareGPT package when inputs is empty"""
    regenerate: RegenerateOptions = field(default_factory=RegenerateOptions)
    """have the target answer the prompts itself before prepare (remote/data/regenerate.py): off, or the sampling settings"""


@dataclass(frozen=True, kw_only=True)
class PrepareConfig(PrepareOptions):
    tokenizer: str
    """the target model's folder: its tokenizer and chat template are used"""
    out_dir: str
    """where data.parquet and manifest.json go (through out_dir.partial)"""
    trust_remote_code: bool = False
    """load a tokenizer that ships its own code (Kimi-K2.5's tiktoken one)"""

    def __post_init__(self):
        super().__post_init__()
        require_paths(self, "inputs")


@dataclass(frozen=True, kw_only=True)
class EmbeddedDefaultConfig(Checked):
    out_dir: str
    """the cache folder: the converted model and the conversations are kept here"""
    conversations: int = DataOptions.demo_conversations
    """how many ShareGPT conversations to write (the first clean ones); 0: all of them"""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """weights of the converted model; float32 suits CPUs without bf16 units"""

    def __post_init__(self):
        super().__post_init__()
        if self.conversations < 0:
            raise ConfigError(f"conversations={self.conversations}: give a count, or 0 for all of them")


@dataclass(frozen=True, kw_only=True)
class DataDeltaConfig(Checked):
    inputs: list[str]
    """the data source: files or folders (remote.data.chat_data reads them)"""
    state_dir: str
    """the nightly's folder on the host; its state.json says what earlier nights took"""
    out_dir: str
    """this night's folder (usually <state_dir>/nights/<run>)"""
    heldout_permille: int = bounded(PrepareOptions.heldout_permille, ge=0, le=1000)
    """the training flow's data.heldout_permille (the same each night)"""

    def __post_init__(self):
        super().__post_init__()
        require_paths(self, "inputs")


# The nightly's commit point in state_dir: the data_delta step reads it, the controller writes it after a good night.
STATE = "state.json"
EMPTY_STATE = {"nights": [], "seen": None}  # a nightly before its first good night


def next_state(state: dict, manifest: dict, run_name: str, **record) -> dict:
    """The state after a good night whose data_delta manifest is `manifest` (the controller writes it)."""
    nights = [n for n in state["nights"] if n["run"] != run_name]
    bench = {k: v for k, v in (record.get("figures") or {}).items() if k.startswith("bench_")}
    nights.append({"run": run_name, "data": manifest["new_data"], "new": manifest["counts"]["new"],
                   **({"benchmarks": bench} if bench else {})})  # the trend's benchmark columns
    return {**state, "nights": nights, "seen": manifest["seen"], "last_success": {"run": run_name, **record}}
