"""The configs of the data stage's steps: prepare, embedded_default, data_delta (standard library only,
so the controller imports them; remote/config.py says how a config is checked)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from remote.config import Checked, ConfigError, bounded


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
class DataOptions(PrepareOptions):
    """The data stage as the flow shows it: prepare's options and the size of the embedded demo data."""

    demo_conversations: int = bounded(300, ge=1)
    """conversations taken from the ShareGPT package when inputs is empty"""


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
        if not self.inputs:
            raise ConfigError("inputs: expected a non-empty list of paths, got []")


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
        if not self.inputs or not all(self.inputs):
            raise ConfigError(f"inputs={self.inputs!r}: name at least one file or folder of conversations")
