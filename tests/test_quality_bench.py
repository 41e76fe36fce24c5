"""bench/quality_bench.py's own pieces that decide its figures: the shift that feeds speculators eaglet's
batches, speculators' DFlash and DSpark converted to eaglet's export weight for weight and its DSpark arm run
end to end at a tiny size (these need speculators 0.9.0 importable: its wheel unpacked on PYTHONPATH; skipped
without, as in CI), the draft that travels back without the target's lm_head rows, the subset of the data, the
arms' settings.
(The whole benchmark runs as a dress rehearsal: `bench/quality_bench.py --smoke`, its docstring.)"""
from __future__ import annotations

import importlib.util
import json
import math
import tarfile

import pytest
import torch

from bench.quality_bench import arms_of, check_arms, keep_draft, select_rows, target_rows, unpack
from bench.speculators_arm import SpeculatorsDFlashConfig, SpeculatorsDSparkConfig, config_class, padded, shifted
from remote.draft.loss import PackedBatch


def _batch(lengths: list[int]) -> PackedBatch:
    t = sum(lengths)
    return PackedBatch(
        input_ids=torch.arange(100, 100 + t), loss_mask=torch.ones(t, dtype=torch.bool),
        aux=torch.arange(t).float()[:, None].repeat(1, 6), last=torch.arange(t).float()[:, None].repeat(1, 2),
        positions=torch.cat([torch.arange(n) for n in lengths]),
        doc_ids=torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)), n_tokens=t)


def test_shifted_pairs_token_t_plus_1_with_the_state_of_t_inside_each_sample_as_speculators_does():
    b = _batch([3, 4])  # rows 0-2 sample 0, rows 3-6 sample 1
    x = shifted(b, length=10)
    assert x["rows"].tolist() == [1, 2, 4, 5, 6]  # every row but a sample's first
    ids, aux = x["input_ids"][0], x["hidden_states"][0][:, 0]
    assert ids[:5].tolist() == [101, 102, 104, 105, 106]
    assert aux[:5].tolist() == [0, 1, 3, 4, 5]  # the state one row earlier, never across samples
    assert x["verifier_last_hidden_states"][0][:5, 0].tolist() == [1, 2, 4, 5, 6]
    assert x["position_ids"][0][:5].tolist() == [1, 2, 1, 2, 3]  # speculators' positions start at 1
    assert x["document_ids"][0][:5].tolist() == [0, 0, 1, 1, 1]
    pad = slice(5, 10)  # padding: a document of its own that no loss reads
    assert not x["loss_mask"][0][pad].any() and (x["document_ids"][0][pad] == 2).all()
    assert all(v.shape[1] == 10 for k, v in x.items() if k != "rows")


def test_padded_keeps_speculators_dflash_rows_unshifted_and_pads_as_its_collate_does():
    b = _batch([3, 4])
    x = padded(b, 10)
    assert x["input_ids"][0][:7].tolist() == b.input_ids.tolist() and x["hidden_states"].shape == (1, 10, 6)
    assert x["document_ids"][0][7:].tolist() == [-1] * 3 and not x["loss_mask"][0][7:].any()


needs_speculators = pytest.mark.skipif(importlib.util.find_spec("speculators") is None,
                                       reason="speculators 0.9.0 is not importable (put its unpacked wheel on "
                                              "PYTHONPATH); CI has none")
TINY_DFLASH = dict(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64, target_vocab_size=50,
                   draft_vocab_size=40, aux_layer_ids=(1, 2), num_layers=2, block_size=4, rope_theta=500.0)


def _converted(tmp_path, kind: str, confidence: bool = False):
    """(speculators' own draft of the kind at TINY_DFLASH's shape with random weights, rounded to bf16, and eaglet's
    evaluator's model of its converted export folder: read_folder, load_model)."""
    from bench.speculators_arm import block_export, round_as_exported, speculators_dflash, speculators_dspark
    from remote.draft.dflash import DFlash, DFlashConfig
    from remote.draft.dspark import DSpark, DSparkConfig
    from remote.draft.folder import load_model, read_folder, write_folder
    from remote.draft.vocab import DraftVocab

    torch.manual_seed(0)
    if kind == "dspark":
        d, k = DSparkConfig(**TINY_DFLASH, markov_rank=6), DSpark()
        m = speculators_dspark(d, "eager", confidence=confidence).eval()
    else:
        d, k = DFlashConfig(**TINY_DFLASH), DFlash()
        m = speculators_dflash(d, "eager").eval()
    with torch.no_grad():  # norms away from 1, so one left out or misplaced would show
        for p in m.parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if p.ndim == 1 else 0.3 * torch.randn_like(p))
    round_as_exported(m, torch.bfloat16)
    vocab = DraftVocab(torch.zeros(40, dtype=torch.int64), torch.arange(50) < 40, torch.ones(50, dtype=torch.int64))
    tensors = block_export(m, k, d, vocab, torch.bfloat16, tmp_path)
    write_folder(tmp_path, k.export_config(d, "bfloat16", ("vllm",)), tensors)
    folder = read_folder(tmp_path)
    draft, _ = load_model(folder, folder.draft_config(), m.embed_tokens.weight.detach(), torch.float32)
    return m, draft.eval(), folder


def _random_batch(lens: list[int]) -> PackedBatch:
    g = torch.Generator().manual_seed(1)
    b = _batch(lens)
    return PackedBatch(input_ids=torch.randint(0, 50, (b.n_tokens,), generator=g), loss_mask=b.loss_mask,
                       aux=torch.randn(b.n_tokens, 64, generator=g), last=torch.randn(b.n_tokens, 32, generator=g),
                       positions=b.positions, doc_ids=b.doc_ids, n_tokens=b.n_tokens)


@needs_speculators
def test_speculators_dflash_converts_to_eaglets_export_guess_for_guess(tmp_path):
    """speculators' own forward (its _backbone_forward, in chunks of anchors) and eaglet's evaluator on the
    converted folder (read_folder, load_model, block_guesses) guess the same tokens at every row and slot."""
    from bench.speculators_arm import dflash_guesses
    from remote.draft.dflash_loss import block_guesses

    m, draft, _ = _converted(tmp_path, "dflash")
    b = _random_batch([9, 7, 5])
    theirs = dflash_guesses(m, b, chunk=6)  # chunks of 6 anchors: the last one part padding
    ours = block_guesses(draft, b, 3)
    assert torch.equal(theirs, ours) and len(theirs.unique()) > 5


@needs_speculators
@pytest.mark.parametrize("confidence", [False, True])
def test_speculators_dspark_converts_to_eaglets_export_guess_for_guess(tmp_path, confidence):
    """speculators' own DSpark (its _backbone_forward plus its Markov head's block_bias of the real previous token)
    and eaglet's evaluator on the converted folder guess the same tokens at all B slots of every block; its
    confidence head, when trained, is left out and changes no guess."""
    from bench.speculators_arm import dspark_guesses
    from remote.draft.dflash_loss import block_guesses

    m, draft, folder = _converted(tmp_path, "dspark", confidence)
    assert folder.config["architectures"] == ["Qwen3DSparkModel"] and folder.config["markov_rank"] == 6
    shapes = folder.tensors
    assert shapes["markov_head.markov_w1.weight"] == (50, 6) and shapes["markov_head.markov_w2.weight"] == (40, 6)
    assert (m.confidence_head is not None) is confidence and not any("confidence" in n for n in shapes)
    lens = [9, 7, 5]
    b = _random_batch(lens)
    theirs = dspark_guesses(m, b, chunk=6)
    ours = block_guesses(draft, b, 4)
    # a slot whose previous token lies past the batch's end reads speculators' padding there and eaglet's last
    # token (a token no chain reaches); every other slot must agree
    t = b.n_tokens
    known = (torch.arange(t)[:, None] + 1 + torch.arange(4)[None, :] < t) | (torch.arange(t)[:, None] == t - 1)
    assert theirs.shape == ours.shape == (t, 4)
    assert torch.equal(theirs[known], ours[known]) and len(theirs.unique()) > 5


def test_the_kinds_floor_arms_check_and_compare_at_one_block_and_layer_count():
    arms = {a["name"]: a["train"] for a in arms_of("kinds-floor")}
    check_arms(arms_of("kinds-floor"))
    assert list(arms) == ["floor-speculators-dflash-block8", "floor-eaglet-dflash-block8-ttt7",
                          "floor-speculators-dspark-block8", "floor-eaglet-dspark-block8-ttt8",
                          "floor-eaglet-dflash-block8"]
    ours = arms["floor-eaglet-dflash-block8"]
    assert ours == {a["name"]: a for a in arms_of("kinds")}["kind-dflash-block8"]["train"]
    # each eaglet block arm trains every slot its block drafts (DFlash B - 1, DSpark B), the rest as kind-dflash-block8
    assert arms["floor-eaglet-dflash-block8-ttt7"] == {**ours, "ttt_steps": 7}
    assert arms["floor-eaglet-dspark-block8-ttt8"] == {**ours, "ttt_steps": 8, "draft": "dspark"}
    for kind in ("dflash", "dspark"):
        theirs = arms[f"floor-speculators-{kind}-block8"]
        assert config_class(theirs) is {"dflash": SpeculatorsDFlashConfig, "dspark": SpeculatorsDSparkConfig}[kind]
        assert (theirs["block_size"], theirs["epochs"]) == (ours["draft_overrides"]["block_size"], ours["epochs"])
        assert theirs["num_layers"] == 1 and "num_layers" not in ours["draft_overrides"]  # eaglet's default: 1
    with pytest.raises(ValueError, match="kind 'eagle3'"):
        SpeculatorsDFlashConfig(capture_dir="c", vocab_dir="v", out_dir="o", kind="eagle3")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("target")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)).save_pretrained(d)
    return str(d)


@needs_speculators
def test_the_speculators_dspark_arm_trains_exports_and_its_own_forward_is_the_evaluators_figure(target, tmp_path):
    """The arm end to end on a CPU at a tiny size (a capture of the tiny target's states, 3 steps): speculators'
    DSpark trains, is written as eaglet's DSpark export, and its own forward's figure at every k of the block is
    what the evaluate step's offline measure gives on that export."""
    from bench.speculators_arm import run
    from remote.evaluate.config import EvaluateConfig
    from remote.evaluate.evaluate import measure_offline
    from tests.fixtures.train_inputs import hf_capture, random_chats, save_vocab

    seqs, masks = random_chats(28, 300)
    cap = hf_capture(target, seqs, masks, tmp_path / "capture", layer_ids=(1, 2), heldout=6)
    voc = save_vocab(seqs[:22], masks[:22], 300, 64, tmp_path / "vocab")
    m = run({"kind": "dspark", "capture_dir": str(cap), "vocab_dir": str(voc), "out_dir": str(tmp_path / "export"),
             "block_size": 4, "num_layers": 1, "markov_rank": 8, "max_steps": 3, "token_budget": 256, "lr": 1e-2,
             "device": "cpu", "log_every": 1})
    export = tmp_path / "export"
    history = [json.loads(line) for line in (export / "loss.jsonl").read_text().splitlines()]
    assert m["counts"]["steps"] == 3 and len(history) == 3 and all(math.isfinite(r["loss"]) for r in history)
    assert len(history[0]["acc"]) == 4  # all four slots of the block draft
    assert m["export"]["format"] == "vllm-dspark" and not m["export"]["confidence_head_left_out"]
    own = m["own_forward"]
    assert own["k"] == 4 and sorted(own["by_k"]) == ["1", "2", "3", "4"]
    for k in (1, 4):
        cfg = EvaluateConfig(target=target, draft_dir=str(export), data="unused", out_dir=str(tmp_path / "eval"),
                             capture_dir=str(cap), num_speculative_tokens=k, online=False)
        theirs = measure_offline(cfg, k)
        assert own["by_k"][str(k)]["acceptance_length"] == pytest.approx(theirs["acceptance_length"], abs=1e-9)


def _export(folder, target, lm_head=None):
    from safetensors.torch import save_file

    ids = torch.tensor([3, 7, 8, 20, 299])
    w = {"d2t": ids - torch.arange(len(ids)), "fc.weight": torch.randn(32, 96).bfloat16()}
    w["lm_head.weight"] = (target_rows(target, w) if lm_head is None else lm_head).bfloat16().contiguous()
    folder.mkdir(parents=True)
    save_file(w, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"draft_vocab_size": 5}))
    return w


@pytest.mark.parametrize("frozen", [True, False])
def test_a_kept_draft_comes_back_whole_and_travels_without_the_targets_rows(target, tmp_path, frozen):
    from safetensors.torch import load_file

    w = _export(tmp_path / "export", target, None if frozen else torch.randn(5, 32))
    kept = keep_draft(tmp_path / "export", target, tmp_path / "out" / "draft-x.tar")
    assert kept["lm_head_left_out"] is frozen
    with tarfile.open(tmp_path / "out" / "draft-x.tar") as t:
        travelled = t.extractfile("export/model.safetensors").read()
    assert (b"lm_head.weight" in travelled) is not frozen
    back = load_file(str(unpack(str(tmp_path / "out" / "draft-x.tar"), target, tmp_path / "back") / "model.safetensors"))
    assert set(back) == set(w) and all(torch.equal(back[k], w[k]) for k in w)


def test_a_draft_is_not_made_whole_from_another_target(target, tmp_path):
    _export(tmp_path / "export", target)
    keep_draft(tmp_path / "export", target, tmp_path / "draft.tar")
    other = tmp_path / "other"
    from transformers import LlamaForCausalLM

    m = LlamaForCausalLM.from_pretrained(target)
    with torch.no_grad():
        m.lm_head.weight.add_(1.0)
    m.save_pretrained(other)
    with pytest.raises(SystemExit, match="another lm_head"):
        unpack(str(tmp_path / "draft.tar"), str(other), tmp_path / "back")


def test_select_rows_takes_the_first_rows_then_enough_held_out_ones_cut_to_length(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    splits = ["train", "train", "train", "heldout", "train", "heldout", "heldout"]
    src = tmp_path / "data.parquet"
    pq.write_table(pa.table({"sample_id": [f"s{i}" for i in range(7)], "input_ids": [list(range(10))] * 7,
                             "loss_mask": [[1] * 10] * 7, "length": [10] * 7, "split": splits}), src)
    t = pq.read_table(select_rows(str(src), tmp_path / "sub" / "data.parquet", rows=2, max_tokens=4, min_heldout=2))
    assert t.column("sample_id").to_pylist() == ["s0", "s1", "s3", "s5"]
    assert t.column("length").to_pylist() == [4] * 4 and t.column("input_ids").to_pylist()[0] == [0, 1, 2, 3]
    assert pq.read_table(select_rows(str(src), tmp_path / "all.parquet")).num_rows == 7
