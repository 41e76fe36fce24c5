"""The EAGLE-3 draft and its TTT objective against a reference written the slow, obvious way:
an explicit loop over TTT steps, one dense mask over every step's keys, complex-number rotary,
per-position Python loops for the alignment, and plain autograd for the loss."""
import math

import pytest
import torch

from remote.draft.config import DraftConfig
from remote.draft.loss import PackedBatch, TargetHead, TTTObjective
from remote.draft.model import EagleDraft

CFG = DraftConfig(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48,
                  target_vocab_size=90, draft_vocab_size=40, aux_layer_ids=(1, 3, 5), rope_theta=500.0)
K = 4


def _batch(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    return PackedBatch(
        input_ids=torch.randint(0, CFG.target_vocab_size, (t,), generator=g),
        loss_mask=torch.rand(t, generator=g) > 0.25,
        aux=torch.randn(t, 3 * CFG.hidden_size, generator=g),
        last=torch.randn(t, CFG.hidden_size, generator=g),
        positions=torch.cat([torch.arange(n) for n in lengths]),
        doc_ids=torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)),
        n_tokens=t,
    )


def _setup(seed=0, cfg=CFG):
    torch.manual_seed(seed)
    draft = EagleDraft(cfg)
    for p in draft.parameters():  # norms away from 1 so a missing norm would show
        if p.ndim == 1:
            p.data = 1 + 0.3 * torch.randn_like(p)
    g = torch.Generator().manual_seed(seed + 1)
    lm_head = torch.randn(CFG.target_vocab_size, CFG.hidden_size, generator=g)
    t2d = torch.zeros(CFG.target_vocab_size, dtype=torch.bool)
    t2d[torch.randperm(CFG.target_vocab_size, generator=g)[:CFG.draft_vocab_size]] = True
    norm_w = 1 + 0.2 * torch.randn(CFG.hidden_size, generator=g)
    head = TargetHead.from_weights(norm_w, lm_head, t2d, CFG.rms_norm_eps)
    return draft, head, (norm_w, lm_head, t2d)


# ----------------------------------------------------------------------------- the reference
def _rms(x, w, eps=CFG.rms_norm_eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _rope_complex(x, pos):
    """x [T, heads, d]: pairs (i, i + d/2) as one complex number, turned by pos * theta_i."""
    d = x.shape[-1]
    theta = CFG.rope_theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    z = torch.complex(x[..., : d // 2].double(), x[..., d // 2:].double())
    z = z * torch.polar(torch.ones_like(theta), pos.double()[:, None] * theta)[:, None, :]
    return torch.cat([z.real, z.imag], -1).to(x.dtype)


def _reference_states(draft, b):
    """Per TTT step: the pre-norm output state, by the dense-mask definition of TTT attention and
    the draft options as vLLM's llama_eagle3.py applies them (see remote/draft/model.py)."""
    sd = dict(draft.named_parameters())  # parameters, not state_dict() copies: the gradients flow
    c, m = draft.cfg, "midlayer."
    t = len(b.input_ids)
    aux = b.aux
    if c.norm_before_fc:
        aux = _rms(aux, sd["input_norm.weight"])
    if c.fc_norm:
        aux = torch.cat([_rms(a, sd[f"fc_norm.{i}.weight"]) for i, a in enumerate(aux.chunk(c.n_aux, -1))], -1)
    hidden = aux @ sd["fc.weight"].T
    keys, values, outs = [], [], []
    for k in range(K):
        ids = torch.tensor([b.input_ids[min(i + 1 + k, t - 1)] for i in range(t)])
        emb = sd["embed_tokens.weight"][ids]
        normed = _rms(hidden, sd[m + "hidden_norm.weight"])
        x = torch.cat([_rms(emb, sd[m + "input_layernorm.weight"]), normed], -1)
        pos = b.positions + k
        q = _rope_complex((x @ sd[m + "self_attn.q_proj.weight"].T).view(t, CFG.num_heads, -1), pos)
        keys.append(_rope_complex((x @ sd[m + "self_attn.k_proj.weight"].T).view(t, CFG.num_kv_heads, -1), pos))
        values.append((x @ sd[m + "self_attn.v_proj.weight"].T).view(t, CFG.num_kv_heads, -1))
        kk, vv = torch.cat(keys), torch.cat(values)  # [(k+1)T, Hkv, d]: step-major
        allowed = torch.zeros(t, (k + 1) * t, dtype=torch.bool)
        for qi in range(t):
            for j in range(k + 1):
                for s in range(t):
                    if j == 0:
                        allowed[qi, s] = b.doc_ids[s] == b.doc_ids[qi] and s <= qi
                    elif s == qi:
                        allowed[qi, j * t + s] = True
        out = torch.empty(t, CFG.num_heads, CFG.head_dim)
        group = CFG.num_heads // CFG.num_kv_heads
        for h in range(CFG.num_heads):
            scores = q[:, h] @ kk[:, h // group].T / math.sqrt(CFG.head_dim)
            scores = scores.masked_fill(~allowed, float("-inf"))
            out[:, h] = torch.softmax(scores, -1) @ vv[:, h // group]
        h1 = out.reshape(t, -1) @ sd[m + "self_attn.o_proj.weight"].T + (normed if c.norm_before_residual else hidden)
        y = _rms(h1, sd[m + "post_attention_layernorm.weight"])
        mlp = (torch.nn.functional.silu(y @ sd[m + "mlp.gate_proj.weight"].T) * (y @ sd[m + "mlp.up_proj.weight"].T))
        hidden = mlp @ sd[m + "mlp.down_proj.weight"].T + h1
        outs.append(hidden)
        if c.norm_output:  # the next step reads the final-normed state
            hidden = _rms(hidden, sd["norm.weight"])
    return outs


def _reference_loss(draft, b, target_parts, decay=0.8):
    norm_w, lm_head, t2d = target_parts
    states = _reference_states(draft, b)
    tl_full = _rms(b.last, norm_w) @ lm_head.T
    draft_rows = t2d.nonzero().squeeze(1)
    t = len(b.input_ids)
    total, agree = 0.0, []
    for k, s in enumerate(states):
        logits = _rms(s, draft.norm.weight) @ draft.lm_head.weight.T
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
    draft, head, _ = _setup()
    b = _batch([9, 14, 6])
    ref = _reference_states(draft, b)
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


# The draft options (tests/test_draft_options.py has each alone): speculators' three, and fc_norm's variant.
OPTION_SETS = {"none": {}, "speculators": {"norm_before_fc": True, "norm_before_residual": True, "norm_output": True},
               "fc_norm": {"fc_norm": True, "norm_before_residual": True, "norm_output": True}}


@pytest.mark.parametrize("options", list(OPTION_SETS))
def test_loss_and_gradients_match_the_reference(options):
    """Through TTTObjective, which calls draft.fc and draft.step: the options need nothing of the loss."""
    draft, head, parts = _setup(seed=3, cfg=DraftConfig(**{**CFG.to_dict(), **OPTION_SETS[options]}))
    b = _batch([12, 7, 10], seed=3)
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
