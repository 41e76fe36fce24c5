"""The EAGLE-3 draft and its TTT objective against a reference written the slow, obvious way:
an explicit loop over TTT steps, one dense mask over every step's keys, complex-number rotary,
per-position Python loops for the alignment, and plain autograd for the loss (the forward's reference
is tests/fixtures/draft.py's, which tests/test_draft_options.py uses too)."""
import pytest
import torch

from remote.draft.config import DraftConfig
from remote.draft.loss import TTTObjective
from tests.fixtures.draft import CFG, K, OPTION_SETS, batch, reference_states, rms, setup


# ----------------------------------------------------------------------------- the reference loss
def _reference_loss(draft, b, target_parts, decay=0.8):
    norm_w, lm_head, t2d = target_parts
    states = reference_states(draft, b)
    tl_full = rms(b.last, norm_w) @ lm_head.T
    draft_rows = t2d.nonzero().squeeze(1)
    t = len(b.input_ids)
    total, agree = 0.0, []
    for k, s in enumerate(states):
        logits = rms(s, draft.norm.weight) @ draft.lm_head.weight.T
        terms, hits = [], 0
        for i in range(t):
            j = i + 2 + k  # the token this position predicts
            if j >= t or b.doc_ids[j] != b.doc_ids[i] or not b.loss_mask[j]:
                continue
            if not t2d[tl_full[i + 1 + k].argmax()]:
                continue
            p = torch.softmax(tl_full[i + 1 + k][draft_rows], -1)
            terms.append(-(p * torch.log_softmax(logits[i], -1)).sum())
            hits += int(logits[i].argmax() == p.argmax())
        if terms:
            total = total + decay ** k * torch.stack(terms).mean()
        agree.append(hits)
    return total, agree


# ----------------------------------------------------------------------------- tests
def test_states_match_the_dense_reference():
    draft, head, _ = setup()
    b = batch([9, 14, 6])
    ref = reference_states(draft, b)
    from remote.draft.model import TTTAttention

    # flex (the GPU path) runs forward-only on the CPU, slowly: two steps of it are enough
    for backend, steps in (("dense", K), ("flex", 2)):
        attn = TTTAttention(b.doc_ids, backend)
        hidden = draft.fc(b.aux)
        with torch.no_grad():
            for k in range(steps):
                nxt = (torch.arange(len(b.input_ids)) + 1 + k).clamp(max=len(b.input_ids) - 1)
                hidden, _ = draft.step(draft.embed(b.input_ids[nxt]), hidden, b.positions + k, attn)
                err = (hidden - ref[k]).abs().max().item()
                assert err < 1e-4, f"{backend} step {k}: max abs diff {err}"


@pytest.mark.parametrize("options", list(OPTION_SETS))
def test_loss_and_gradients_match_the_reference(options):
    """Through TTTObjective, which calls draft.fc and draft.step: the options need nothing of the loss."""
    draft, head, parts = setup(seed=3, cfg=DraftConfig(**{**CFG.to_dict(), **OPTION_SETS[options]}))
    b = batch([12, 7, 10], seed=3)
    tgt = head.targets(b, K)
    assert 0 < int(tgt.counts.min()) and int(tgt.counts.max()) < len(b.input_ids)  # some dropped, some kept
    loss, stats = TTTObjective(draft, K, 0.8)(b, tgt, tgt.counts)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in draft.named_parameters() if p.requires_grad}
    draft.zero_grad()
    ref, agree = _reference_loss(draft, b, parts)
    ref.backward()
    assert stats[:, 1].tolist() == agree  # per-step top-1 agreement, as the trainer logs it
    assert abs(loss.item() - ref.item()) < 1e-5 * max(1.0, abs(ref.item()))
    for n, p in draft.named_parameters():
        if p.requires_grad:
            rel = (grads[n] - p.grad).norm() / p.grad.norm().clamp(min=1e-12)
            assert rel < 1e-4, f"gradient of {n} differs by {rel:.2e} (relative)"
    assert "embed_tokens.weight" not in grads  # the target's embedding stays frozen
    norms = [n for n in grads if n.startswith(("input_norm.", "fc_norm."))]  # the options' own norms learn
    assert len(norms) == {"none": 0, "speculators": 1, "fc_norm": 3}[options]
    assert all(grads[n].abs().sum() > 0 for n in norms)
    assert stats.shape == (K, 3) and torch.equal(stats[:, 2], tgt.counts)


def test_the_loss_is_the_same_in_one_chunk_or_many():
    """The fused head and loss over one chunk of rows (its default at these sizes) and over chunks of 5 rows:
    the same loss, top-1 counts and gradients; the default chunk bounds its [rows, vocab] logits."""
    from remote.draft.loss import loss_chunk_rows

    draft, head, _ = setup(seed=5)
    b = batch([12, 7, 10], seed=5)
    tgt = head.targets(b, K)
    runs = []
    for chunk in (0, 5):
        obj = TTTObjective(draft, K, 0.8, chunk=chunk)
        loss, stats = obj(b, tgt, tgt.counts)
        loss.backward()
        runs.append((obj.chunk, loss.detach(), stats, {n: p.grad.clone() for n, p in draft.named_parameters()
                                                       if p.requires_grad}))
        draft.zero_grad()
    (whole, l1, s1, g1), (_, l5, s5, g5) = runs
    assert whole >= len(b.input_ids) > 5  # one chunk, then several
    assert torch.allclose(l1, l5, rtol=1e-6) and torch.allclose(s1, s5, rtol=1e-6) and torch.equal(s1[:, 1:], s5[:, 1:])
    for n in g1:
        assert torch.allclose(g1[n], g5[n], rtol=1e-5, atol=1e-7), n
    assert loss_chunk_rows(32000, compiled=True) == 8388 and loss_chunk_rows(32000, compiled=False) == 2097
    assert loss_chunk_rows(163840, compiled=True) * 163840 * 4 <= 1 << 30  # 1 GiB of float32 logits at most
    assert loss_chunk_rows(10 ** 7, compiled=False) == 256  # a floor: never a row at a time


@pytest.mark.parametrize("rope", [{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64}])
def test_llama3_rope_scaling_slows_only_long_wavelengths(rope):
    from remote.draft.model import rope_frequencies

    base, _ = rope_frequencies(CFG)
    cfg = DraftConfig(**{**CFG.to_dict(), "rope_scaling": rope})
    scaled, scale = rope_frequencies(cfg)
    assert scale == 1.0
    assert torch.allclose(scaled[0], base[0])  # the fastest frequency is kept
    assert torch.allclose(scaled[-1], base[-1] / 8.0)  # the slowest is divided by the factor


def test_config_from_a_target_config_and_its_errors():
    target = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
              "vocab_size": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 2048,
              "bos_token_id": 1, "eos_token_id": 2}
    c = DraftConfig.from_target_config({"text_config": target}, draft_vocab_size=100, aux_layer_ids=[2, 3, 3])
    assert (c.head_dim, c.num_kv_heads, c.target_vocab_size, c.aux_layer_ids) == (16, 2, 512, (2, 3, 3))
    assert c.extra == {"bos_token_id": 1, "eos_token_id": 2}
    with pytest.raises(ValueError, match="draft_vocab_size"):
        DraftConfig.from_target_config(target, draft_vocab_size=600, aux_layer_ids=[1])
    with pytest.raises(ValueError, match="'longrope' is not supported"):  # tests/test_rope.py has the rest
        DraftConfig.from_target_config({**target, "rope_scaling": {"rope_type": "longrope", "factor": 4}},
                                       draft_vocab_size=100, aux_layer_ids=[1])


def test_training_benchmark_runs_on_the_cpu(tmp_path):
    """bench/train_bench.py at a tiny shape: the same step code the GPU figures come from."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "train_bench.py"
    spec = importlib.util.spec_from_file_location("train_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "r.jsonl"
    assert bench.main(["--shape", "tiny", "--ttt", "2", "--tokens", "128", "--doc-len", "50", "--steps", "1",
                       "--warmup", "0", "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["finite"] and rec["tokens_per_s"] > 0 and rec["tflops_per_step"] >= 0
    # the stated FLOP count grows with the TTT steps: 6N per step plus attention
    c = bench.draft_config("llama8b")
    assert bench.step_flops(c, 8192, 2048, 7) > 2 * bench.step_flops(c, 8192, 2048, 3)
