"""The offline acceptance math on hand-made logits whose answer is known (remote/evaluate/acceptance.py)."""
from __future__ import annotations

import random

import pytest
import torch

from remote.evaluate.acceptance import ChainCounts, chain_counts, greedy_walk, leading_right, top1_target_ids, turn_spans

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


def test_turns_are_the_loss_masked_runs_inside_each_sample():
    mask = torch.tensor([0, 0, 1, 1, 0, 1, 1, 1, 0, 1, 1])
    doc = torch.tensor([0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1])
    # sample 0: turns at rows 2-3 and 5-7; sample 1's turn (rows 9-10) has a prompt row before it
    assert turn_spans(mask, doc) == [(2, 3), (5, 7), (9, 10)]
    # a turn at the very start of a sample has nothing to prompt with: left out
    assert turn_spans(torch.tensor([1, 1, 0, 1, 1]), torch.tensor([0, 0, 0, 1, 1])) == []


def test_replaying_greedy_decoding_counts_steps_the_way_vllm_does():
    """One turn, rows 1..9 (the target writes row 1's token; drafting starts at row 0)."""
    lead = [2, 0, 0, 3, 0, 0, 0, 1, 0, 0, 0]
    # row 0: 2 accepted -> tokens 2,3 plus the target's 4th: next chain from row 3
    # row 3: 3 accepted (k=3) -> next from row 7; row 7: 1 accepted -> row 9 = the turn's last: done
    assert greedy_walk(lead, [(1, 9)], k=3) == (3, 6)
    assert greedy_walk(lead, [(1, 9)], k=1) == (6, 3)  # at most k accepted a step
    # never past the turn's end: from row 6 only token 8 is left to guess, so 1 of 3 counts
    assert greedy_walk([0] * 6 + [3, 0, 0, 0], [(1, 8)], k=3) == (7, 1)
    assert greedy_walk([0, 0, 0, 0], [(1, 3)], k=3) == (2, 0)


def test_leading_right_is_the_accepted_prefix_of_each_chain():
    target = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3], [1, 2, 3]])
    draft = torch.tensor([[1, 2, 3], [1, 9, 3], [9, 2, 3], [1, 2, 9]])
    assert leading_right(draft, target).tolist() == [3, 1, 0, 2]
    valid = torch.tensor([[True, False, True]] * 4)
    assert leading_right(draft, target, valid).tolist() == [1, 1, 0, 1]
