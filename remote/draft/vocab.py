"""The draft vocabulary: which target tokens the draft's lm_head has rows for (the vocab step makes it).

    vocab = DraftVocab.load(vocab_dir)     # <vocab_dir>/vocab.safetensors; BadInput when there is none
    vocab.d2t                              # [n] int64: target id = draft id + d2t[draft id] (what vLLM reads)
    vocab.t2d                              # [V] bool: which target ids are in the draft vocabulary
    vocab.draft_ids                        # [n] the target id of each draft id, ascending
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from remote.step import BadInput

VOCAB_FILE = "vocab.safetensors"


@dataclass(frozen=True)
class DraftVocab:
    d2t: torch.Tensor  # [n] int64
    t2d: torch.Tensor  # [V] bool
    counts: torch.Tensor  # [V] int64

    @property
    def draft_ids(self) -> torch.Tensor:
        """Target id of each draft id, ascending."""
        return torch.arange(len(self.d2t)) + self.d2t

    @property
    def coverage(self) -> float:
        total = int(self.counts.sum())
        return float(self.counts[self.t2d].sum()) / total if total else 0.0

    def save(self, path: str | Path) -> None:
        save_file({"d2t": self.d2t, "t2d": self.t2d, "counts": self.counts}, str(path))

    @classmethod
    def load(cls, vocab_dir: str | Path) -> "DraftVocab":
        p = Path(vocab_dir) / VOCAB_FILE
        if not p.is_file():
            raise BadInput(f"{vocab_dir}: no {VOCAB_FILE} (run the vocab step first)")
        t = load_file(str(p))
        return cls(t["d2t"], t["t2d"], t["counts"])
