"""The draft vocabulary: choice, offsets, and the step over a prepare-format parquet file."""
import json
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from remote.step import EXIT_BAD_INPUT
from remote.draft.vocab import DraftVocab
from remote.train.vocab import choose_vocab
from remote.train.vocab import main as vocab_main


def test_top_n_with_ties_broken_by_lower_id():
    counts = torch.tensor([5, 0, 7, 5, 5, 1, 7, 0])
    v = choose_vocab(counts, 4)
    # 7,7 (ids 2,6) then the three 5s (ids 0,3,4) compete for two places: ids 0 and 3 win
    assert v.draft_ids.tolist() == [0, 2, 3, 6]
    assert v.d2t.tolist() == [0, 1, 1, 3] and v.d2t.dtype == torch.int64
    assert (torch.arange(4) + v.d2t).tolist() == [0, 2, 3, 6]  # target = draft + d2t
    assert v.t2d.tolist() == [True, False, True, True, False, False, True, False]
    assert v.coverage == pytest.approx((5 + 7 + 5 + 7) / 30)


def test_fewer_distinct_tokens_than_asked_is_not_padded():
    counts = torch.zeros(1000, dtype=torch.int64)
    counts[[3, 500, 999]] = torch.tensor([2, 9, 1])
    v = choose_vocab(counts, 32000)
    assert v.draft_ids.tolist() == [3, 500, 999] and int(v.t2d.sum()) == 3
    assert v.coverage == 1.0


def test_choice_is_deterministic_under_permuted_equal_counts():
    counts = torch.ones(50, dtype=torch.int64)
    assert choose_vocab(counts, 10).draft_ids.tolist() == list(range(10))


def _write_parquet(path: Path, rows):
    tbl = pa.table({
        "sample_id": [r[0] for r in rows],
        "input_ids": pa.array([r[1] for r in rows], type=pa.list_(pa.int32())),
        "loss_mask": pa.array([r[2] for r in rows], type=pa.list_(pa.int8())),
        "length": pa.array([len(r[1]) for r in rows], type=pa.int32()),
        "split": [r[3] for r in rows],
    })
    pq.write_table(tbl, path, row_group_size=2)


def _run(cfg: dict, tmp_path: Path, capsys):
    """The step's own main(argv), in this process (a subprocess only adds torch's import time)."""
    p = tmp_path / "vocab.config.json"
    p.write_text(json.dumps(cfg))
    rc = vocab_main(["--config", str(p)])
    out = capsys.readouterr()
    return SimpleNamespace(returncode=rc, stdout=out.out, stderr=out.err)


def test_step_counts_only_train_loss_tokens(tmp_path, capsys):
    prep = tmp_path / "prepare"
    prep.mkdir()
    _write_parquet(prep / "data.parquet", [
        ("a", [1, 2, 3, 4], [0, 1, 1, 1], "train"),
        ("b", [4, 4, 5, 6], [0, 0, 1, 1], "train"),
        ("c", [7, 7, 7, 7], [1, 1, 1, 1], "heldout"),  # held out: must not count
        ("d", [8, 9, 9, 2], [1, 0, 1, 1], "train"),
    ])
    out = tmp_path / "vocab"
    r = _run({"data": str(prep), "target_vocab_size": 16, "draft_vocab_size": 4, "out_dir": str(out)}, tmp_path, capsys)
    assert r.returncode == 0, r.stderr
    m = json.loads((out / "manifest.json").read_text())
    v = DraftVocab.load(out)
    # train loss tokens: 2,3,4,5,6,8,9,2 -> 2:2, then ties among 3,4,5,6,8,9 -> 3,4,5
    assert v.draft_ids.tolist() == [2, 3, 4, 5]
    assert v.counts[7] == 0 and int(v.counts.sum()) == 8
    assert m["counts"]["train_loss_tokens"] == 8 and m["counts"]["heldout_samples"] == 1
    assert m["figures"]["coverage"] == pytest.approx(5 / 8)
    assert m["vocab"]["draft_vocab_size"] == 4


def test_step_states_a_smaller_vocab(tmp_path, capsys):
    _write_parquet(tmp_path / "data.parquet", [("a", [1, 2, 1, 2], [1, 1, 1, 1], "train")])
    out = tmp_path / "v"
    r = _run({"data": str(tmp_path / "data.parquet"), "target_vocab_size": 10, "out_dir": str(out)}, tmp_path, capsys)
    assert r.returncode == 0, r.stderr
    m = json.loads((out / "manifest.json").read_text())
    assert m["counts"]["draft_vocab_size"] == 2 and m["counts"]["requested_draft_vocab_size"] == 32000
    assert "fewer than draft_vocab_size" in r.stdout


def test_bad_token_id_names_the_sample_and_leaves_nothing(tmp_path, capsys):
    _write_parquet(tmp_path / "data.parquet", [("good", [1, 2], [1, 1], "train"), ("bad-row", [1, 99], [1, 1], "train")])
    out = tmp_path / "v"
    r = _run({"data": str(tmp_path / "data.parquet"), "target_vocab_size": 10, "out_dir": str(out)}, tmp_path, capsys)
    assert r.returncode == EXIT_BAD_INPUT
    assert "bad-row" in r.stderr and "outside the target vocabulary" in r.stderr
    assert not out.exists()


def test_missing_data_is_bad_input(tmp_path, capsys):
    r = _run({"data": str(tmp_path / "nope"), "target_vocab_size": 10, "out_dir": str(tmp_path / "v")}, tmp_path, capsys)
    assert r.returncode == EXIT_BAD_INPUT and "no data.parquet" in r.stderr
