"""The configs of the data stage's steps: prepare, embedded_default, data_delta (standard library only,
so the controller imports them)."""
from __future__ import annotations

from dataclasses import dataclass, field

LONG_POLICIES = ("truncate", "drop")
DTYPES = ("float32", "bfloat16")  # embedded_default: weights of the converted model


@dataclass(frozen=True, kw_only=True)
class PrepareConfig:
    inputs: tuple[str, ...]  # conversation files, folders, saved datasets folders, or hub:NAME[:SPLIT]
    tokenizer: str  # the target model's folder: its tokenizer and chat template are used
    out_dir: str  # where data.parquet and manifest.json go (through out_dir.partial)
    max_length: int = 2048  # tokens a sample may have at most
    long_policy: str = "truncate"  # longer samples: "truncate" keeps the first max_length tokens, "drop" skips them
    heldout_permille: int = 20  # share of samples (per thousand, by hash) in the held-out split
    max_bad_fraction: float = 0.5  # fail when more than this share of the rows read is malformed
    max_samples: int | None = None  # stop after this many samples (the first ones in input order)
    batch_size: int = 256  # conversations rendered and tokenized together
    trust_remote_code: bool = False  # load a tokenizer that ships its own code (Kimi-K2.5's tiktoken one)

    def __post_init__(self):
        if isinstance(self.inputs, str) or not self.inputs:
            raise ValueError("inputs must be a non-empty list of paths")
        object.__setattr__(self, "inputs", tuple(str(p) for p in self.inputs))
        if self.max_length < 2:
            raise ValueError(f"max_length={self.max_length}: need at least 2 tokens")
        if self.long_policy not in LONG_POLICIES:
            raise ValueError(f"long_policy {self.long_policy!r}: choose one of {LONG_POLICIES}")
        if not 0 <= self.heldout_permille <= 1000:
            raise ValueError(f"heldout_permille={self.heldout_permille}: must lie in 0..1000")
        if not 0.0 <= self.max_bad_fraction <= 1.0:
            raise ValueError(f"max_bad_fraction={self.max_bad_fraction}: must lie in 0..1")
        if self.max_samples is not None and self.max_samples < 1:
            raise ValueError(f"max_samples={self.max_samples}: give a positive number or null")
        if self.batch_size < 1:
            raise ValueError(f"batch_size={self.batch_size}: must be positive")


@dataclass(frozen=True, kw_only=True)
class EmbeddedDefaultConfig:
    out_dir: str  # the cache folder: the converted model and the conversations are kept here
    conversations: int = 300  # how many ShareGPT conversations to write (the first clean ones); 0: all of them
    dtype: str = "float32"  # weights of the converted model; float32 suits CPUs without bf16 units

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r}: choose one of {DTYPES}")
        if self.conversations < 0:
            raise ValueError(f"conversations={self.conversations}: give a count, or 0 for all of them")


@dataclass(frozen=True, kw_only=True)
class DataDeltaConfig:
    inputs: list = field(default_factory=list)  # the data source: files or folders (remote.data.chat_data reads them)
    state_dir: str  # the nightly's folder on the host; its state.json says what earlier nights took
    out_dir: str  # this night's folder (usually <state_dir>/nights/<run>)
    heldout_permille: int = 50  # the training flow's data.heldout_permille (the same each night)

    def __post_init__(self):
        if not self.inputs or not all(isinstance(p, str) and p for p in self.inputs):
            raise ValueError(f"inputs={self.inputs!r}: name at least one file or folder of conversations")
        if not 0 <= self.heldout_permille <= 1000:
            raise ValueError(f"heldout_permille={self.heldout_permille}: must lie in 0..1000")
