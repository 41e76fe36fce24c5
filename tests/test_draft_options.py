"""The draft options vLLM 0.32's eagle3 Llama draft reads (norm_before_fc, fc_norm, norm_before_residual,
norm_output), in plain torch: each against the slow reference of tests/fixtures/draft.py, which
writes every option the way vLLM's llama_eagle3.py applies it (tests/test_draft_model.py tests the
loss and gradients with options on). The engine side (vLLM's own forward of the exported draft) is
tests/test_export_options.py."""
import dataclasses
import itertools

import pytest
import torch

from remote.draft.config import DraftConfig
from remote.draft.model import EagleDraft, TTTAttention
from remote.draft.eagle3 import OPTIONS as FLAGS  # the DraftConfig fields the export writes for vLLM
from tests.fixtures.draft import CFG, K, OPTION_SETS, batch, reference_states, rms, setup

OPTIONS = {
    "norm_before_fc": {"norm_before_fc": True},
    "fc_norm": {"fc_norm": True},
    "norm_before_residual": {"norm_before_residual": True},
    "norm_output": {"norm_output": True},
    "speculators": OPTION_SETS["speculators"],
    "all_with_fc_norm": OPTION_SETS["fc_norm"],
}


def _cfg(options: dict) -> DraftConfig:
    return dataclasses.replace(CFG, **options)


def _run(draft, b, steps=K):
    """(state handed on, normed state) per TTT step, through the draft's own step()."""
    attn = TTTAttention(b.doc_ids, "dense")
    hidden, out = draft.fc(b.aux), []
    t = len(b.input_ids)
    for k in range(steps):
        nxt = (torch.arange(t) + 1 + k).clamp(max=t - 1)
        hidden, normed = draft.step(draft.embed(b.input_ids[nxt]), hidden, b.positions + k, attn)
        out.append((hidden, normed))
    return out


# Every combination the config accepts (norm_before_fc and fc_norm exclude each other): 12.
COMBINATIONS = {"+".join(k for k, v in zip(FLAGS, bits) if v) or "none": dict(zip(FLAGS, bits))
                for bits in itertools.product((False, True), repeat=len(FLAGS)) if not (bits[0] and bits[1])}


@pytest.mark.parametrize("name", list(COMBINATIONS))
def test_every_combination_matches_the_reference(name):
    draft, _, _ = setup(cfg=_cfg(COMBINATIONS[name]))
    b = batch([9, 14, 6])
    ref = reference_states(draft, b)
    with torch.no_grad():
        for k, (state, normed) in enumerate(_run(draft, b)):
            want_normed = rms(ref[k], draft.norm.weight)
            want_state = want_normed if draft.cfg.norm_output else ref[k]
            assert (normed - want_normed).abs().max() < 1e-4, f"{name} step {k}: normed state"
            assert (state - want_state).abs().max() < 1e-4, f"{name} step {k}: the state handed on"


@pytest.mark.parametrize("name", ["norm_before_fc", "fc_norm", "norm_before_residual", "norm_output"])
def test_each_option_changes_what_the_draft_computes(name):
    """Else the comparisons above could not tell an option from its absence."""
    plain, _, _ = setup(seed=5)
    draft, _, _ = setup(seed=5, cfg=_cfg(OPTIONS[name]))
    draft.load_state_dict(plain.state_dict(), strict=False)  # the same shared weights; the new norms stay as set
    b = batch([10, 8], seed=5)
    with torch.no_grad():
        a, o = _run(plain, b, 2), _run(draft, b, 2)
    step = 1 if name == "norm_output" else 0  # norm_output changes only what step 1 reads
    assert (a[step][1] - o[step][1]).abs().max() > 1e-2, name


def test_the_options_weights_carry_vllms_names_and_shapes():
    h = CFG.hidden_size
    plain = set(EagleDraft(CFG).trainable_state_dict())
    w = EagleDraft(_cfg(OPTIONS["speculators"])).trainable_state_dict()
    assert set(w) - plain == {"input_norm.weight"} and w["input_norm.weight"].shape == (3 * h,)
    w = EagleDraft(_cfg(OPTIONS["all_with_fc_norm"])).trainable_state_dict()
    assert set(w) - plain == {"fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"}
    assert all(w[f"fc_norm.{i}.weight"].shape == (h,) for i in range(3))
    assert set(EagleDraft(_cfg(OPTIONS["norm_output"])).trainable_state_dict()) == plain


def test_both_aux_norms_at_once_are_refused():
    with pytest.raises(ValueError, match="norm_before_fc and fc_norm"):
        _cfg({"norm_before_fc": True, "fc_norm": True})
