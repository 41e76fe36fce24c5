"""The training recipe's pure parts: the one TTT unroll and packer (the numbers they gave before they
were shared), the optimiser split, the learning-rate schedule, the settings' checks."""
from __future__ import annotations

import pytest
import torch

from remote.draft.config import DraftConfig
from remote.draft.data import epoch_order, pack
from remote.draft.loss import PackedBatch, TargetHead, TTTObjective
from remote.draft.model import EagleDraft
from remote.evaluate.chains import chain_tally, heldout_plan
from remote.train.optimizers import build_optimizer, lr_factor
from remote.train.train import TrainConfig

H, V, VD = 32, 120, 48


def _case():
    """A seeded draft, target head and batch of three packed samples with unmasked prompt rows."""
    g = torch.Generator().manual_seed(5)
    cfg = DraftConfig(hidden_size=H, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64,
                      target_vocab_size=V, draft_vocab_size=VD, aux_layer_ids=(1, 2, 3))
    torch.manual_seed(3)
    draft = EagleDraft(cfg)
    draft.embed_tokens.weight = torch.nn.Parameter(torch.randn(V, H, generator=g), requires_grad=False)
    lm_head = torch.randn(V, H, generator=g)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[torch.randperm(V, generator=g)[:VD]] = True
    lm_head[t2d] *= 1.5
    with torch.no_grad():
        draft.lm_head.weight.copy_(lm_head[t2d])
    head = TargetHead.from_weights(torch.ones(H), lm_head, t2d, 1e-6)
    lengths = [20, 13, 9]
    t = sum(lengths)
    mask = torch.ones(t, dtype=torch.bool)
    mask[:5] = False
    mask[20:24] = False
    b = PackedBatch(torch.randint(0, V, (t,), generator=g), mask, torch.randn(t, 3 * H, generator=g),
                    torch.randn(t, H, generator=g), torch.cat([torch.arange(n) for n in lengths]),
                    torch.repeat_interleave(torch.arange(3), torch.tensor(lengths)), n_tokens=t)
    return draft, head, b


def test_the_shared_unroll_gives_the_numbers_of_the_two_it_replaced():
    """Figures printed by the objective and the offline chain count of commit 04a3fbf (before the
    unroll was shared) on this case; the replayed walk then used k = steps - 1 whatever k was asked
    (a loop variable hid it), so it is compared at k = 2 here."""
    draft, head, b = _case()
    tgt = head.targets(b, 3)
    loss, stats = TTTObjective(draft, 3, 0.8)(b, tgt, tgt.counts)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(47.743736267089844, rel=1e-6)
    assert stats.flatten().tolist() == pytest.approx([526.9996948242188, 1.0, 29.0, 562.2549438476562, 1.0, 28.0,
                                                      569.822509765625, 2.0, 27.0], rel=1e-6)
    assert float(draft.fc.weight.grad.double().pow(2).sum()) == pytest.approx(4535.529402309141, rel=1e-5)
    assert float(draft.lm_head.weight.grad.double().pow(2).sum()) == pytest.approx(6.418053589915346, rel=1e-5)
    tally = chain_tally(draft, head, [b], 3, 2)
    assert (tally.counts.attempts.tolist(), tally.counts.accepted.tolist(), tally.drafts, tally.accepted) == \
        ([31, 1, 0], [1, 0, 0], 21, 1)


def test_step_k_counts_where_its_token_is_known_and_the_target_top1_is_a_draft_token():
    _, head, b = _case()
    tgt = head.targets(b, 3)
    assert torch.equal(tgt.valid, tgt.known & torch.stack([tgt.in_draft[(torch.arange(42) + 1 + k).clamp(max=41)]
                                                           for k in range(3)]))
    # sample 0 is rows 0-19: step k at row t predicts row t+2+k, known up to row 19 and from row 5 (the prompt)
    assert [int(tgt.known[k, :20].nonzero().max()) for k in range(3)] == [17, 16, 15]
    assert [int(tgt.known[k, :20].nonzero().min()) for k in range(3)] == [3, 2, 1]


def test_one_packer_packs_as_training_and_evaluation_did():
    lengths = [5, 30, 12, 7, 19, 3, 25, 8, 40, 11]
    # training's plan of (seed 3, epoch 1) and the evaluation's first 60 tokens by id, as both were before
    assert pack(lengths, 32, epoch_order(len(lengths), 3, 1)) == [[1], [5, 0, 7, 3], [2, 4], [9], [6], [8]]
    by_id = sorted(range(10), key=lambda i: str(lengths[i]))
    assert pack(lengths, 32, by_id, max_tokens=60) == [[9, 2], [4]]

    class Index:
        refs = [type("Ref", (), {"sample_id": str(n)}) for n in lengths]

    Index.lengths = lengths
    assert heldout_plan(Index, 32, 60) == [[9, 2], [4]]


def _cfg(**kw) -> TrainConfig:
    return TrainConfig(capture_dir="c", vocab_dir="v", out_dir="o", **kw)


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    draft, _, _ = _case()
    opt = build_optimizer(_cfg(optimizer="muon", lr=1e-3, muon_lr=2e-3), draft, cuda=False)
    names = {id(p): n for n, p in draft.named_parameters()}
    groups = {k: sorted(names[id(p)] for g in o.param_groups for p in g["params"]) for k, o in opt.parts.items()}
    assert groups["muon"] == ["fc.weight", "midlayer.mlp.down_proj.weight", "midlayer.mlp.gate_proj.weight",
                              "midlayer.mlp.up_proj.weight", "midlayer.self_attn.k_proj.weight",
                              "midlayer.self_attn.o_proj.weight", "midlayer.self_attn.q_proj.weight",
                              "midlayer.self_attn.v_proj.weight"]
    assert groups["adamw"] == ["lm_head.weight", "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
                               "midlayer.post_attention_layernorm.weight", "norm.weight"]
    muon = opt.parts["muon"].param_groups[0]
    assert (muon["lr"], muon["momentum"], muon["weight_decay"], muon["adjust_lr_fn"]) == (2e-3, 0.95, 0.1, "match_rms_adamw")
    assert opt.set_lr(0.5) == 5e-4 and muon["lr"] == 1e-3  # every group at the same share of its own peak
    assert list(build_optimizer(_cfg(optimizer="adamw"), draft, cuda=False).parts) == ["adamw"]


def test_schedules_warm_up_then_fall_to_the_floor():
    lin = [lr_factor(s, 10, 2, "linear", 0.0) for s in range(10)]
    assert lin[:3] == [0.5, 1.0, 1.0] and lin[-1] == pytest.approx(1 / 8)
    assert all(a > b for a, b in zip(lin[2:], lin[3:]))
    assert lr_factor(10, 10, 2, "linear", 0.0) == 0.0 and lr_factor(10, 10, 2, "cosine", 0.1) == pytest.approx(0.1)
    assert lr_factor(6, 10, 2, "cosine", 0.0) == pytest.approx(0.5)  # half way down the half cosine


@pytest.mark.parametrize("bad, message", [({"optimizer": "sgd"}, "optimizer 'sgd': choose one of 'muon', 'adamw'"),
                                          ({"schedule": "step"}, "schedule 'step': choose one of 'linear', 'cosine'"),
                                          ({"warmup": 1.0}, "warmup: expected a number >= 0 and < 1, got 1.0"),
                                          ({"patience": -1}, "patience: expected an integer >= 0, got -1"),
                                          ({"eval_k": -1}, "eval_k: expected an integer >= 0, got -1")])
def test_bad_recipe_settings_are_refused_by_name(bad, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        _cfg(**bad)

