"""The offline acceptance tally: a draft's chains of guesses over packed batches, scored against the target.

    plan = heldout_plan(index, token_budget, max_tokens)        # held-out batches, by sample id
    tally = chain_tally(draft, head, batches, steps, k)          # ChainTally: counts, replayed drafts/accepted
    by_k = chain_tallies(draft, head, batches, steps, [3, 5])    # {k: ChainTally}, the draft run once a batch
    tally.all_reduce(dist).summary(k)                            # the figures (every rank's batches summed)

The evaluate step and the trainer's held-out evaluation both count here, so the two figures are the same
measure; each draft proposes by its kind's rule (remote.draft.registry), the chain math is
remote.evaluate.acceptance.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from remote.draft.registry import kind_of_model
from remote.evaluate.acceptance import ChainCounts, chain_counts, greedy_walk, leading_right, turn_spans


def score_chains(guesses: torch.Tensor, head, b, k: int) -> tuple[ChainCounts, int, int]:
    """Chain counts and the greedy replay (drafts, accepted) of any draft's guesses [T, steps] (draft
    ids; row t, step j guesses token t+2+j) against the target's top-1 on this packed batch."""
    from remote.draft.loss import read_rows

    t, steps = guesses.shape
    tgt = head.targets(b, steps)
    truths = []
    for j in range(steps):
        nxt = read_rows(t, j, b.input_ids.device)  # the target's top-1 there is the one to match
        # outside the draft vocabulary the target's choice cannot be guessed: -1 never matches
        truths.append(torch.where(tgt.in_draft[nxt], tgt.logits[nxt].argmax(-1), torch.full_like(nxt, -1)))
    g, tr, kn = guesses.cpu(), torch.stack(truths, 1).cpu(), tgt.known.T.cpu()
    drafts, accepted = greedy_walk(leading_right(g, tr, kn).tolist(), turn_spans(b.loss_mask.cpu(), b.doc_ids.cpu()), k)
    return chain_counts(g, tr, kn), drafts, accepted


@dataclass
class ChainTally:
    """Chain counts, replayed (drafts, accepted) and tokens, summed over batches (and ranks)."""

    counts: ChainCounts
    drafts: int = 0
    accepted: int = 0
    tokens: int = 0

    def __add__(self, other: "ChainTally") -> "ChainTally":
        return ChainTally(self.counts + other.counts, self.drafts + other.drafts, self.accepted + other.accepted,
                          self.tokens + other.tokens)

    def all_reduce(self, dist) -> "ChainTally":
        """Summed over every rank of a remote.train.state.Distributed."""
        flat = torch.cat([self.counts.attempts, self.counts.accepted,
                          torch.tensor([self.drafts, self.accepted, self.tokens])]).to(dist.device)
        flat = dist.all_reduce(flat).cpu()
        n = self.counts.steps
        return ChainTally(ChainCounts(flat[:n], flat[n:2 * n]), *(int(x) for x in flat[2 * n:]))

    def summary(self, k: int) -> dict:
        """The figures of the offline evaluation (k speculative tokens, every measured step's table)."""
        c = self.counts
        return {"acceptance_length": c.acceptance_length(k), "k": k, "tokens": self.tokens,
                "replayed_acceptance_length": 1 + self.accepted / self.drafts if self.drafts else None,
                "replayed": {"drafts": self.drafts, "accepted": self.accepted},
                "acceptance_length_by_k": [c.acceptance_length(j) for j in range(c.steps + 1)], **c.to_dict()}


def heldout_plan(index, token_budget: int, max_tokens: int) -> list[list[int]]:
    """Batches of held-out samples by sample id (a stable subset when max_tokens cuts)."""
    from remote.draft.data import pack

    order = sorted(range(len(index.refs)), key=lambda i: index.refs[i].sample_id)
    return pack(index.lengths, token_budget, order, max_tokens)


def chain_tally(draft, head, batches, steps: int, k: int, attention: str = "dense", compiled: bool = False) -> ChainTally:
    """Count the draft's chains over packed batches (on the draft's device) that carry their in-draft flags."""
    return chain_tallies(draft, head, batches, steps, [k], attention, compiled)[k]


@torch.no_grad()
def chain_tallies(draft, head, batches, steps: int, ks: list[int], attention: str = "dense",
                  compiled: bool = False) -> dict[int, ChainTally]:
    """{k: chain_tally at k} from one pass of the draft: each batch's guesses (start row t, step j guesses token
    t+2+j: the draft kind's proposal rule, remote.draft.registry.DraftKind.guesses) scored by score_chains at each k
    (the replay of greedy decoding with k speculative tokens along its turns; the guesses do not depend on k)."""
    tallies = {k: ChainTally(ChainCounts.zeros(steps)) for k in ks}
    for b in batches:
        guesses = kind_of_model(draft).guesses(draft, b, steps, attention, compiled)
        for k in ks:
            tallies[k] += ChainTally(*score_chains(guesses, head, b, k), b.n_tokens)
    return tallies
