"""Offline acceptance math: how far the draft's chain of guesses agrees with the target's top-1.

    counts = chain_counts(draft_top1, target_top1, valid)   # [N, K] each: N start positions, K draft steps
    counts = counts + more                                  # accumulate over batches
    counts.conditional_accuracy      # [K]: P(step k right | steps < k right)
    counts.prefix_rate               # [K]: P(steps 0..k all right): what vLLM's per-position counter measures
    counts.acceptance_length(3)      # expected tokens per target forward with 3 speculative tokens
    greedy_walk(leading_right(...), turn_spans(mask, doc), k=3)  # (drafts, accepted) replaying decoding

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


def _chains(draft_top1: torch.Tensor, target_top1: torch.Tensor, valid: torch.Tensor | None):
    """(known, right, alive) [N, K]; alive[n, k]: steps 0..k-1 of chain n were all right."""
    if draft_top1.shape != target_top1.shape or draft_top1.dim() != 2:
        raise ValueError(f"draft_top1 {tuple(draft_top1.shape)} and target_top1 {tuple(target_top1.shape)}: "
                         "expected the same [N, K] shape")
    known = torch.ones_like(draft_top1, dtype=torch.bool) if valid is None else valid.bool()
    if known.shape != draft_top1.shape:
        raise ValueError(f"valid {tuple(known.shape)}: expected {tuple(draft_top1.shape)}")
    right = (draft_top1 == target_top1) & known
    alive = torch.cumprod(torch.cat([torch.ones_like(right[:, :1]), right[:, :-1]], 1).to(torch.int8), 1).bool()
    return known, right, alive


def chain_counts(draft_top1: torch.Tensor, target_top1: torch.Tensor, valid: torch.Tensor | None = None) -> ChainCounts:
    """Count a batch of chains. All [N, K]: the draft's and the target's top-1 token at each step."""
    known, right, alive = _chains(draft_top1, target_top1, valid)
    return ChainCounts((alive & known).sum(0).long(), (alive & right).sum(0).long())


def leading_right(draft_top1: torch.Tensor, target_top1: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """[N] int64: how many guesses of the chain started at each row the target would accept."""
    _, right, alive = _chains(draft_top1, target_top1, valid)
    return (alive & right).sum(1)


def turn_spans(loss_mask: torch.Tensor, doc_ids: torch.Tensor) -> list[tuple[int, int]]:
    """(first, last) row of every run of loss-masked rows inside one sample: the assistant's turns.
    A turn that opens its sample (nothing before it to prompt with) is left out."""
    m = loss_mask.bool()
    same = torch.zeros_like(m)
    same[1:] = doc_ids[1:] == doc_ids[:-1]  # row i continues the sample of row i-1
    prev_in = torch.zeros_like(m)
    prev_in[1:] = m[:-1] & same[1:]
    next_in = torch.zeros_like(m)
    next_in[:-1] = m[1:] & same[1:]
    starts = (m & ~prev_in).nonzero().squeeze(1).tolist()
    ends = (m & ~next_in).nonzero().squeeze(1).tolist()
    return [(a, b) for a, b in zip(starts, ends) if bool(same[a])]


def greedy_walk(lead: list[int], spans: list[tuple[int, int]], k: int) -> tuple[int, int]:
    """(drafts, accepted) of greedy speculative decoding with k tokens replayed along known turns.

    The target writes a turn's first token itself (prefill); then each step the draft guesses from
    row t (it has read token t+1), the target keeps lead[t] of them (at most k, never past the
    turn's end) and adds one of its own. When the text is the target's own greedy output this is
    what vLLM counts (acceptance length = 1 + accepted / drafts); on other text it weights
    positions the way decoding visits them, which the per-position average does not.
    """
    drafts = accepted = 0
    for first, last in spans:
        t = first - 1
        while t + 1 < last:
            a = min(lead[t], k, last - (t + 1))
            drafts += 1
            accepted += a
            t += a + 1
    return drafts, accepted


def top1_target_ids(draft_logits: torch.Tensor, d2t: torch.Tensor) -> torch.Tensor:
    """The draft's top-1 as target token ids: draft id i is target id i + d2t[i] (vLLM's convention)."""
    best = draft_logits.argmax(-1)
    return best + d2t.to(best.device)[best]
