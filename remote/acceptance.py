"""Offline acceptance math: how far the draft's chain of guesses agrees with the target's top-1.

    counts = chain_counts(draft_top1, target_top1, valid)   # [N, K] each: N start positions, K draft steps
    counts = counts + more                                  # accumulate over batches
    counts.conditional_accuracy      # [K]: P(step k right | steps < k right)
    counts.prefix_rate               # [K]: P(steps 0..k all right): what vLLM's per-position counter measures
    counts.acceptance_length(3)      # expected tokens per target forward with 3 speculative tokens

A draft proposes K tokens in a chain; the target keeps the longest prefix that matches its own
greedy choice, plus one token of its own. So step k only matters where steps < k were right, and
its accuracy is measured there ("conditional"). With p_j that conditional accuracy, the expected
tokens per target forward with k speculative tokens is 1 + sum_{j<k} prod_{i<=j} p_i.

A (start, step) pair that is not `valid` (past the end of its sample, a token the assistant did
not write) is unknown, not wrong: it leaves the chain without counting as an attempt.
Pure functions on tensors; no model, no I/O.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ChainCounts:
    """Per draft step k: chains that reached it (attempts) and chains it extended (accepted)."""

    attempts: torch.Tensor  # [K] int64: starts whose steps < k were all right and whose step k is known
    accepted: torch.Tensor  # [K] int64: of those, the ones whose step k was right too

    def __add__(self, other: "ChainCounts") -> "ChainCounts":
        if len(self.attempts) != len(other.attempts):
            raise ValueError(f"cannot add counts of {len(self.attempts)} and {len(other.attempts)} steps")
        return ChainCounts(self.attempts + other.attempts, self.accepted + other.accepted)

    @classmethod
    def zeros(cls, steps: int) -> "ChainCounts":
        z = torch.zeros(steps, dtype=torch.int64)
        return cls(z, z.clone())

    @property
    def steps(self) -> int:
        return len(self.attempts)

    @property
    def conditional_accuracy(self) -> torch.Tensor:
        """[K] float64; a step no chain reached has accuracy 0 (nothing was ever accepted there)."""
        return self.accepted.double() / self.attempts.clamp(min=1).double()

    @property
    def prefix_rate(self) -> torch.Tensor:
        """[K] float64: the share of chains whose first k+1 guesses are all right."""
        return torch.cumprod(self.conditional_accuracy, 0)

    def acceptance_length(self, k: int | None = None) -> float:
        """Expected tokens a target forward yields with k speculative tokens (1 + accepted ones)."""
        k = self.steps if k is None else k
        if not 0 <= k <= self.steps:
            raise ValueError(f"k={k}: these counts measure 0 to {self.steps} speculative tokens")
        return 1.0 + float(self.prefix_rate[:k].sum())

    def to_dict(self) -> dict:
        return {"attempts": self.attempts.tolist(), "accepted": self.accepted.tolist(),
                "conditional_accuracy": [round(float(x), 6) for x in self.conditional_accuracy],
                "prefix_rate": [round(float(x), 6) for x in self.prefix_rate]}


def chain_counts(draft_top1: torch.Tensor, target_top1: torch.Tensor, valid: torch.Tensor | None = None) -> ChainCounts:
    """Count a batch of chains. All [N, K]: the draft's and the target's top-1 token at each step."""
    if draft_top1.shape != target_top1.shape or draft_top1.dim() != 2:
        raise ValueError(f"draft_top1 {tuple(draft_top1.shape)} and target_top1 {tuple(target_top1.shape)}: "
                         "expected the same [N, K] shape")
    known = torch.ones_like(draft_top1, dtype=torch.bool) if valid is None else valid.bool()
    if known.shape != draft_top1.shape:
        raise ValueError(f"valid {tuple(known.shape)}: expected {tuple(draft_top1.shape)}")
    right = (draft_top1 == target_top1) & known
    # alive[n, k]: steps 0..k-1 of chain n were all right (every chain reaches step 0).
    alive = torch.cumprod(torch.cat([torch.ones_like(right[:, :1]), right[:, :-1]], 1).to(torch.int8), 1).bool()
    return ChainCounts((alive & known).sum(0).long(), (alive & right).sum(0).long())


def top1_target_ids(draft_logits: torch.Tensor, d2t: torch.Tensor) -> torch.Tensor:
    """The draft's top-1 as target token ids: draft id i is target id i + d2t[i] (vLLM's convention)."""
    best = draft_logits.argmax(-1)
    return best + d2t.to(best.device)[best]
