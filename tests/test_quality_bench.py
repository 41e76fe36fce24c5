"""bench/quality_bench.py's own pieces that decide its figures: the shift that feeds speculators eaglet's
batches, the draft that travels back without the target's lm_head rows, the subset of the data.
(The whole benchmark runs as a dress rehearsal: `bench/quality_bench.py --smoke`, its docstring.)"""
from __future__ import annotations

import json
import tarfile

import pytest
import torch

from bench.quality_bench import keep_draft, select_rows, target_rows, unpack
from bench.speculators_arm import shifted
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


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("target")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)).save_pretrained(d)
    return str(d)


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
