"""The prepared dataset: the one file the prepare step writes and the capture, windows and vocab steps read.

    writer = DatasetWriter(out / DATA_FILE)           # prepare: one row group a batch
    writer.write([(sample_id, input_ids, loss_mask, split), ...]); writer.close()
    rows = read_dataset(path, vocab_size)             # [SampleRow], every row checked (BadInput names it)

The columns (DATASET_COLUMNS), one row a sample: sample_id str, input_ids list<int32>, loss_mask list<int8>
(1 on what the assistant wrote), length int32, split "train" or "heldout" (remote/data/prepare.py tells how
each is made).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from remote.step import BadInput

if TYPE_CHECKING:
    from remote.capture.cache import SampleRow

DATA_FILE = "data.parquet"
DATASET_COLUMNS = ("sample_id", "input_ids", "loss_mask", "length", "split")


class DatasetWriter:
    """Appends samples to data.parquet, one row group a batch, so memory stays one batch big."""

    def __init__(self, path: Path):
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.pa = pa
        self.schema = pa.schema([
            ("sample_id", pa.string()), ("input_ids", pa.list_(pa.int32())),
            ("loss_mask", pa.list_(pa.int8())), ("length", pa.int32()), ("split", pa.string()),
        ])
        self.writer = pq.ParquetWriter(path, self.schema)

    def write(self, rows: list[tuple[str, list[int], list[int], str]]) -> None:
        if not rows:
            return
        pa = self.pa
        offsets, flat_ids, flat_mask = [0], [], []
        for _, ids, mask, _ in rows:
            flat_ids += ids
            flat_mask += mask
            offsets.append(len(flat_ids))
        off = pa.array(offsets, pa.int32())
        table = pa.Table.from_arrays([
            pa.array([r[0] for r in rows], pa.string()),
            pa.ListArray.from_arrays(off, pa.array(flat_ids, pa.int32())),
            pa.ListArray.from_arrays(off, pa.array(flat_mask, pa.int8())),
            pa.array([len(r[1]) for r in rows], pa.int32()),
            pa.array([r[3] for r in rows], pa.string()),
        ], schema=self.schema)
        self.writer.write_table(table)

    def close(self) -> None:
        self.writer.close()


def read_dataset(path: str | os.PathLike, vocab_size: int) -> list[SampleRow]:
    """The prepared samples, checked: the columns, lengths, token ids, unique ids. BadInput names the row."""
    import numpy as np
    import pyarrow.parquet as pq

    from remote.capture.cache import SampleRow  # (torch, through the shard store: not for the prepare step)

    path = Path(path)
    if not path.is_file():
        raise BadInput(f"dataset {path} does not exist (expected the prepare step's data.parquet)")
    try:
        table = pq.read_table(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several kinds for a bad file
        raise BadInput(f"dataset {path} is not a readable parquet file: {e}") from e
    missing = [c for c in DATASET_COLUMNS if c not in table.column_names]
    if missing:
        raise BadInput(f"dataset {path}: missing column(s) {missing}; has {table.column_names}")
    cols = {c: table.column(c).to_pylist() for c in ("sample_id", "length", "split")}
    ids_col, mask_col = table.column("input_ids"), table.column("loss_mask")
    rows, seen = [], set()
    for i, sid in enumerate(cols["sample_id"]):
        where = f"dataset {path} row {i} (sample {sid})"
        ids = np.asarray(ids_col[i].values, dtype=np.int64)
        mask = np.asarray(mask_col[i].values, dtype=np.int64)
        if not sid or sid in seen:
            raise BadInput(f"{where}: sample_id is empty or repeated")
        if ids.size == 0 or ids.size != mask.size or ids.size != cols["length"][i]:
            raise BadInput(f"{where}: {ids.size} input_ids, {mask.size} loss_mask values, length {cols['length'][i]}")
        if ids.min() < 0 or ids.max() >= vocab_size:
            raise BadInput(f"{where}: token id {int(ids.max()) if ids.max() >= vocab_size else int(ids.min())} "
                           f"outside the target's vocabulary of {vocab_size}")
        if not np.isin(mask, (0, 1)).all():
            raise BadInput(f"{where}: loss_mask holds values other than 0 and 1")
        if cols["split"][i] not in ("train", "heldout"):
            raise BadInput(f"{where}: split {cols['split'][i]!r} is neither 'train' nor 'heldout'")
        seen.add(sid)
        rows.append(SampleRow(sid, cols["split"][i], ids.astype(np.int32), mask.astype(np.uint8)))
    if not rows:
        raise BadInput(f"dataset {path} has no samples")
    return rows
