"""The draft vocabulary: the N target tokens the assistant writes most often in the train split.

    python -m remote.train.vocab --config c.json
    # {"data": "/runs/r1/prepare", "target": "/models/target", "out_dir": "/runs/r1/vocab"}

`data` is the prepare step's folder (or its data.parquet): columns sample_id, input_ids, loss_mask,
split. Only rows of split "train" and tokens with loss_mask == 1 count (the ones the draft must
predict). Writes out_dir/vocab.safetensors:

    d2t     [n] int64   offsets: target id = draft id + d2t[draft id] (what vLLM reads)
    t2d     [V] bool    which target ids are in the draft vocabulary
    counts  [V] int64   the loss-token count of every target id

The top n are chosen by count, ties broken by the lower token id, then sorted by id (draft id i is
the i-th smallest chosen target id). n = draft_vocab_size, or fewer when fewer distinct tokens
occur: the manifest says so (`draft_vocab_size`, `requested_draft_vocab_size`); the vocabulary is
never padded with tokens that never occurred. Figure `coverage`: share of train loss tokens whose
target id is in the draft vocabulary.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from remote.data.dataset import DATA_FILE
from remote.draft.vocab import VOCAB_FILE, DraftVocab
from remote.step import BadInput, begin_step, log, progress, step_main
from remote.target import read_config, text_settings
from remote.train.config import VocabConfig

STEP = "vocab"


def choose_vocab(counts: np.ndarray | torch.Tensor, draft_vocab_size: int) -> DraftVocab:
    """Top draft_vocab_size ids by count (ties: lower id first), never including a zero count."""
    counts = torch.as_tensor(np.asarray(counts), dtype=torch.int64)
    v = len(counts)
    ids = torch.arange(v)
    # lexsort on (-count, id): stable sort by id is the identity, then a stable sort by -count.
    order = torch.sort(-counts, stable=True).indices
    n = min(draft_vocab_size, int((counts > 0).sum()))
    chosen = torch.sort(ids[order[:n]]).values
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[chosen] = True
    return DraftVocab(chosen - torch.arange(n), t2d, counts)


def count_loss_tokens(parquet: Path, vocab_size: int) -> tuple[np.ndarray, dict]:
    """Loss-token counts over the train split, streamed one row group at a time."""
    import pyarrow.parquet as pq

    try:
        f = pq.ParquetFile(parquet)
    except Exception as e:  # a truncated or foreign file: say which
        raise BadInput(f"{parquet}: not a readable parquet file ({e})") from e
    need = {"sample_id", "input_ids", "loss_mask", "split"}
    missing = sorted(need - set(f.schema_arrow.names))
    if missing:
        raise BadInput(f"{parquet}: missing column(s) {missing}; the prepare step writes {sorted(need)}")
    counts = np.zeros(vocab_size, dtype=np.int64)
    seen = {"train_samples": 0, "heldout_samples": 0, "train_loss_tokens": 0}
    for g in range(f.num_row_groups):
        t = f.read_row_group(g, columns=sorted(need))
        train = np.asarray(t.column("split").to_numpy(zero_copy_only=False)) == "train"
        seen["train_samples"] += int(train.sum())
        seen["heldout_samples"] += int((~train).sum())
        _count_group(t, train, counts, seen, parquet, vocab_size)
        progress(g + 1, f.num_row_groups, what="row groups")
    return counts, seen


def _count_group(t, train, counts, seen, parquet, vocab_size) -> None:
    ids_col, mask_col = t.column("input_ids").combine_chunks(), t.column("loss_mask").combine_chunks()
    offsets = np.asarray(ids_col.offsets)
    if not np.array_equal(offsets, np.asarray(mask_col.offsets)):
        lens_i, lens_m = np.diff(offsets), np.diff(np.asarray(mask_col.offsets))
        row = int(np.nonzero(lens_i != lens_m)[0][0])
        raise BadInput(f"{parquet}: sample {t.column('sample_id')[row].as_py()}: input_ids and loss_mask lengths differ")
    ids = np.asarray(ids_col.values, dtype=np.int64)
    mask = np.asarray(mask_col.values)
    row_of = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
    bad = (ids < 0) | (ids >= vocab_size)
    if bad.any():
        r = int(row_of[np.nonzero(bad)[0][0]])
        raise BadInput(f"{parquet}: sample {t.column('sample_id')[r].as_py()}: token id outside the target vocabulary "
                       f"[0, {vocab_size})")
    if not np.isin(mask, (0, 1)).all():
        r = int(row_of[np.nonzero(~np.isin(mask, (0, 1)))[0][0]])
        raise BadInput(f"{parquet}: sample {t.column('sample_id')[r].as_py()}: loss_mask holds values other than 0/1")
    keep = (mask == 1) & train[row_of]
    counts += np.bincount(ids[keep], minlength=vocab_size)
    seen["train_loss_tokens"] += int(keep.sum())


def _target_vocab_size(cfg: VocabConfig) -> int:
    if cfg.target_vocab_size:
        return cfg.target_vocab_size
    c = text_settings(read_config(cfg.target))
    if not isinstance(c.get("vocab_size"), int):
        raise BadInput(f"target {cfg.target}: config.json has no vocab_size")
    return c["vocab_size"]


def run(raw: dict) -> dict:
    cfg, out, done = begin_step(VocabConfig, raw, STEP)
    if done is not None:
        return done
    data = Path(cfg.data)
    parquet = data / DATA_FILE if data.is_dir() else data
    if not parquet.is_file():
        raise BadInput(f"data {cfg.data}: no data.parquet there (run the prepare step first)")
    vsize = _target_vocab_size(cfg)
    counts, seen = count_loss_tokens(parquet, vsize)
    if seen["train_loss_tokens"] == 0:
        raise BadInput(f"{parquet}: no loss tokens in the train split; nothing to build a vocabulary from")
    vocab = choose_vocab(counts, cfg.draft_vocab_size)
    n = len(vocab.d2t)
    if n < cfg.draft_vocab_size:
        log(f"vocab: only {n} distinct loss tokens, fewer than draft_vocab_size={cfg.draft_vocab_size}: "
            f"the draft vocabulary has {n} entries")
    stage = out.open()
    vocab.save(stage / VOCAB_FILE)
    counts_out = {**seen, "draft_vocab_size": n, "requested_draft_vocab_size": cfg.draft_vocab_size,
                  "target_vocab_size": vsize, "distinct_loss_tokens": int((vocab.counts > 0).sum())}
    return out.publish(counts=counts_out, figures={"coverage": vocab.coverage},
                       vocab={"file": VOCAB_FILE, "draft_vocab_size": n, "target_vocab_size": vsize})


def main(argv: list[str] | None = None) -> int:
    return step_main(STEP, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
