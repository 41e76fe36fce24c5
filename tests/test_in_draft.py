"""The target's full-vocabulary top-1 check, computed once a sample (remote.train.train) instead of in
every step: the batches then carry the flags, and the targets must be the same either way."""
import pytest
import torch

from remote.capture.store import CaptureSet, Sample, write_shard
from remote.draft.data import CaptureIndex
from remote.draft.loss import PackedBatch, TargetHead
from remote.step import BadInput

H, V, VD = 32, 200, 40


def _head(seed=0):
    g = torch.Generator().manual_seed(seed)
    lm_head = torch.randn(V, H, generator=g)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[torch.randperm(V, generator=g)[:VD]] = True
    lm_head[t2d] *= 1.3  # about half the rows' top-1 inside, half outside: both cases occur
    return TargetHead.from_weights(torch.ones(H), lm_head, t2d, 1e-6, chunk=7), lm_head, t2d


def _batch(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    return PackedBatch(torch.randint(0, V, (t,), generator=g), torch.ones(t, dtype=torch.bool),
                       torch.randn(t, 3 * H, generator=g), torch.randn(t, H, generator=g),
                       torch.cat([torch.arange(n) for n in lengths]),
                       torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)), n_tokens=t)


def test_in_draft_matches_the_full_vocabulary_argmax():
    (head, lm_head, t2d), b = _head(), _batch([30, 20])
    x = b.last
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    want = t2d[(normed @ lm_head.T).argmax(-1)]
    got = head.in_draft(b.last)
    assert torch.equal(got, want)
    assert 0 < int(want.sum()) < len(want), "the case must hold rows inside and outside the draft vocabulary"


def test_precomputed_flags_give_the_same_targets():
    (head, _, _), b = _head(), _batch([30, 20, 14])
    per_step = head.targets(b, 3)
    b.in_draft = head.in_draft(b.last)
    head.other_rows = None  # what the trainer does after the pre-pass: the step cannot compute them any more
    pre = head.targets(b, 3)
    assert torch.equal(pre.valid, per_step.valid) and torch.equal(pre.logits, per_step.logits)
    assert not bool(pre.valid.all())


def test_targets_without_precomputed_flags_check_only_the_rows_read():
    """The evaluation's offline pass (no pre-pass): TargetHead.targets checks the top-1 at flag_rows of the packed
    batch alone, and its targets and chain counts are those of flags checked at every row."""
    from remote.draft.loss import flag_rows, read_rows
    from remote.evaluate.chains import score_chains

    (head, _, _), b = _head(), _batch([30, 20, 14])
    g = torch.Generator().manual_seed(5)
    b.loss_mask = torch.rand(len(b.loss_mask), generator=g) < 0.6
    b.in_draft = head.in_draft(b.last)
    full = head.targets(b, 3)
    guesses = torch.stack([full.logits[read_rows(len(b.last), j, "cpu")].argmax(-1) for j in range(3)], 1)
    want = score_chains(guesses, head, b, 3)
    b.in_draft, checked, check = None, [], head.in_draft
    head.in_draft = lambda last, *a: checked.append(len(last)) or check(last, *a)
    got = head.targets(b, 3)
    read = flag_rows(b.loss_mask, b.doc_ids)
    assert checked == [int(read.sum())] and 0 < checked[0] < len(read) - 3  # fewer rows than every row
    assert torch.equal(got.valid, full.valid) and torch.equal(got.known, full.known)
    chains = score_chains(guesses, head, b, 3)
    assert chains[1:] == want[1:] and torch.equal(chains[0].accepted, want[0].accepted)
    assert torch.equal(chains[0].attempts, want[0].attempts)
    assert not bool(got.valid.all()) and want[2] > 0


def test_a_flag_no_loss_token_follows_is_never_read():
    """The trainer checks only flag_rows (the rows before a loss token): whatever the other rows' flags hold,
    the loss's targets and the evaluation's chain counts are the same."""
    from remote.draft.loss import flag_rows, read_rows
    from remote.evaluate.chains import score_chains

    (head, _, _), b = _head(), _batch([30, 20, 14])
    g = torch.Generator().manual_seed(4)
    b.loss_mask = torch.rand(len(b.loss_mask), generator=g) < 0.6  # prompts and answers, mixed
    full = head.in_draft(b.last)
    read = torch.cat([flag_rows(b.loss_mask[b.doc_ids == d]) for d in range(3)])
    assert 0 < int(read.sum()) < len(read)
    b.in_draft = full
    logits = head.targets(b, 3).logits
    guesses = torch.stack([logits[read_rows(len(full), j, "cpu")].argmax(-1) for j in range(3)], 1)  # right wherever known
    head.other_rows, outcomes = None, []
    for flags in (full, torch.where(read, full, ~full), torch.where(read, full, False), torch.where(read, full, True),
                  torch.where(read, ~full, full)):  # the last flips the rows that are read: it must differ
        b.in_draft = flags
        tgt = head.targets(b, 3)
        outcomes.append((tgt.valid, score_chains(guesses, head, b, 3)))
    def same(a, b):
        return (torch.equal(a[0], b[0]) and a[1][1:] == b[1][1:] and torch.equal(a[1][0].attempts, b[1][0].attempts)
                and torch.equal(a[1][0].accepted, b[1][0].accepted))

    assert all(same(o, outcomes[0]) for o in outcomes[1:4])
    assert not same(outcomes[4], outcomes[0])
    assert outcomes[0][0].any() and not outcomes[0][0].all() and outcomes[0][1][2] > 0  # some drafts accepted


def test_index_carries_the_flags_into_packed_batches(tmp_path):
    g = torch.Generator().manual_seed(2)
    lengths = [9, 5, 12]
    samples = [Sample(f"s{i}", "train", torch.randint(0, V, (n,), generator=g, dtype=torch.int32),
                      torch.ones(n, dtype=torch.uint8), torch.randn(n, 3 * H, generator=g), torch.randn(n, H, generator=g))
               for i, n in enumerate(lengths)]
    shard = tmp_path / "shard-00000.safetensors"
    write_shard(shard, samples, (1, 2, 3))
    index = CaptureIndex.build(CaptureSet([str(shard)], (1, 2, 3), H, "float32", "t"))
    head = _head()[0]
    lasts, read = zip(*index.last_states([0, 1, 2]))
    assert [len(x) for x in lasts] == lengths and torch.equal(lasts[1], samples[1].last_hidden_state)
    assert [r.tolist() for r in read] == [[True] * (n - 1) + [False] for n in lengths]  # every token a loss token
    flags = [head.in_draft(x) for x in lasts]
    index.set_in_draft(flags)
    b = index.load([2, 0], token_budget=64, pad_multiple=8)
    assert torch.equal(b.in_draft[:21], torch.cat([flags[2], flags[0]]))
    assert len(b.in_draft) == 24 and not bool(b.in_draft[21:].any())  # padding rows never count


def _index(tmp_path, states: dict[int, torch.Tensor], lengths=(9, 5, 12)) -> CaptureIndex:
    """A one-shard capture of float32 samples; `states` replaces a sample's aux states."""
    g = torch.Generator().manual_seed(3)
    samples = [Sample(f"s{i}", "train", torch.randint(0, V, (n,), generator=g, dtype=torch.int32),
                      torch.ones(n, dtype=torch.uint8), states.get(i, torch.randn(n, 3 * H, generator=g)),
                      torch.randn(n, H, generator=g)) for i, n in enumerate(lengths)]
    shard = tmp_path / "shard-00000.safetensors"
    write_shard(shard, samples, (1, 2, 3))
    return CaptureIndex.build(CaptureSet([str(shard)], (1, 2, 3), H, "float32", "t"))


def test_a_packed_batch_is_its_samples_back_to_back_then_zero_padding(tmp_path):
    index = _index(tmp_path, {})
    rows = index._read([2, 0], ("input_ids", "hidden_states", "last_hidden_state"))
    b = index.load([2, 0], token_budget=64, pad_multiple=8)
    assert b.n_tokens == 21 and len(b.input_ids) == 24
    assert torch.equal(b.aux[:21], torch.cat([rows[0]["hidden_states"], rows[1]["hidden_states"]]))
    assert torch.equal(b.last[12:21], rows[1]["last_hidden_state"])
    assert torch.equal(b.input_ids[:21], torch.cat([rows[0]["input_ids"], rows[1]["input_ids"]]).long())
    assert b.doc_ids.tolist() == [0] * 12 + [1] * 9 + [2] * 3 and b.positions.tolist() == [*range(12), *range(9), 0, 1, 2]
    assert not bool(b.aux[21:].any()) and not bool(b.loss_mask[21:].any()) and not bool(b.input_ids[21:].any())


def test_states_with_nan_or_inf_are_refused_naming_the_sample_and_large_finite_ones_pass(tmp_path):
    big = torch.full((5, 3 * H), 3e38)  # finite, but their sum is not: the exact check must decide
    assert torch.equal(_index(tmp_path, {1: big}).load([0, 1], token_budget=64).aux[9:], big)
    for bad in (float("nan"), float("inf")):
        x = torch.randn(5, 3 * H)
        x[3, 7] = bad
        with pytest.raises(BadInput, match=r"sample 's1' of .*shard-00000.safetensors: hidden_states holds NaN or Inf"):
            _index(tmp_path, {1: x}).load([0, 1, 2], token_budget=64)
