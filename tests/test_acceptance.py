"""The offline acceptance math on hand-made logits whose answer is known (remote/acceptance.py)."""
from __future__ import annotations

import random

import pytest
import torch

from remote.acceptance import ChainCounts, chain_counts, top1_target_ids

V = 11  # target vocabulary of the hand-made logits


def one_hot_logits(tokens: torch.Tensor, vocab: int = V) -> torch.Tensor:
    """Logits whose argmax is `tokens` (a clear margin, random elsewhere)."""
    g = torch.Generator().manual_seed(int(tokens.sum()))
    x = torch.rand(*tokens.shape, vocab, generator=g)
    return x.scatter(-1, tokens.unsqueeze(-1), 5.0)


def chains(first_wrong: list[int], steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Target tokens and draft logits for chains that go wrong first at the given step (>= steps: never)."""
    n = len(first_wrong)
    target = torch.randint(0, V, (n, steps), generator=torch.Generator().manual_seed(1))
    draft = target.clone()
    for i, w in enumerate(first_wrong):
        if w < steps:
            draft[i, w] = (target[i, w] + 1) % V  # wrong at w
            draft[i, w + 1:] = torch.randint(0, V, (steps - w - 1,))  # after a miss anything goes
    return one_hot_logits(target), one_hot_logits(draft)


def counts_of(target_logits, draft_logits, valid=None) -> ChainCounts:
    return chain_counts(draft_logits.argmax(-1), target_logits.argmax(-1), valid)


def test_all_right_accepts_every_token():
    t, d = chains([9] * 5, steps=4)
    c = counts_of(t, d)
    assert c.attempts.tolist() == [5, 5, 5, 5] and c.accepted.tolist() == [5, 5, 5, 5]
    assert c.conditional_accuracy.tolist() == [1.0] * 4
    assert c.acceptance_length(3) == pytest.approx(4.0)
    assert c.acceptance_length(4) == pytest.approx(5.0)
    assert c.acceptance_length(0) == pytest.approx(1.0)


def test_first_wrong_accepts_nothing_and_later_steps_are_never_reached():
    t, d = chains([0] * 6, steps=3)
    c = counts_of(t, d)
    assert c.attempts.tolist() == [6, 0, 0] and c.accepted.tolist() == [0, 0, 0]
    assert c.acceptance_length(3) == pytest.approx(1.0)


@pytest.mark.parametrize("k_wrong", [1, 2, 3])
def test_kth_wrong_accepts_exactly_k(k_wrong):
    steps = 4
    t, d = chains([k_wrong] * 3, steps)
    c = counts_of(t, d)
    assert c.conditional_accuracy.tolist() == [1.0] * k_wrong + [0.0] * (steps - k_wrong)
    assert c.attempts.tolist() == [3] * (k_wrong + 1) + [0] * (steps - k_wrong - 1)
    assert c.acceptance_length(steps) == pytest.approx(1 + k_wrong)
    assert c.acceptance_length(1) == pytest.approx(2.0)  # step 0 is always right here


def test_mixed_chains_match_a_per_chain_count():
    """With every step known, the product formula equals the mean accepted prefix, chain by chain."""
    rng = random.Random(3)
    steps = 5
    first_wrong = [rng.choice([0, 0, 1, 2, 2, 3, 4, 9]) for _ in range(200)]
    t, d = chains(first_wrong, steps)
    c = counts_of(t, d)
    for k in range(steps + 1):
        expected = sum(1 + min(w, k) for w in first_wrong) / len(first_wrong)
        assert c.acceptance_length(k) == pytest.approx(expected)
    # step j's conditional accuracy: among chains alive at j, the share not wrong at j
    for j in range(steps):
        alive = [w for w in first_wrong if w >= j]
        assert float(c.conditional_accuracy[j]) == pytest.approx(sum(w > j for w in alive) / len(alive))


def test_unknown_steps_leave_the_chain_without_counting_as_misses():
    t, d = chains([9, 9], steps=3)
    valid = torch.tensor([[True, True, True], [True, False, True]])  # chain 1: step 1 is past its sample
    c = counts_of(t, d, valid)
    assert c.attempts.tolist() == [2, 1, 1] and c.accepted.tolist() == [2, 1, 1]
    assert c.conditional_accuracy.tolist() == [1.0, 1.0, 1.0]


def test_counts_add_up_over_batches():
    t, d = chains([0, 1, 2, 9, 9, 1], steps=3)
    whole = counts_of(t, d)
    parts = counts_of(t[:2], d[:2]) + counts_of(t[2:], d[2:]) + ChainCounts.zeros(3)
    assert torch.equal(whole.attempts, parts.attempts) and torch.equal(whole.accepted, parts.accepted)


def test_draft_vocab_ids_map_to_target_ids_through_d2t():
    draft_to_target = torch.tensor([1, 4, 5, 9])  # the draft vocabulary, as target ids
    d2t = draft_to_target - torch.arange(4)
    logits = torch.zeros(2, 3, 4)
    logits[0, :, 2] = 1.0  # draft id 2 = target id 5
    logits[1, :, 3] = 1.0  # draft id 3 = target id 9
    assert top1_target_ids(logits, d2t).tolist() == [[5, 5, 5], [9, 9, 9]]


def test_bad_shapes_and_k_are_refused():
    with pytest.raises(ValueError, match="same"):
        chain_counts(torch.zeros(2, 3), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="k=4"):
        ChainCounts.zeros(3).acceptance_length(4)
