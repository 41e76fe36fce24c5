"""The capture cache (remote.capture.cache) and the dataset checks of remote.data.dataset, with real
shard files written by capture_store.write_shard from made-up states (no model needed here)."""
from __future__ import annotations

import hashlib
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from remote.data.dataset import read_dataset
from remote.capture.cache import CaptureCache, SampleRow, cache_key, shard_name
from remote.capture.store import Sample, read_shard, write_shard
from remote.step import BadInput

H, LAYERS = 8, (1, 2)
BPT = (len(LAYERS) + 1) * H * 4 + 5


def rows(n: int, seed: int = 0, start: int = 0) -> list[SampleRow]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(start, start + n):
        length = int(rng.integers(3, 12))
        sid = hashlib.sha256(f"s{i}".encode()).hexdigest()
        out.append(SampleRow(sid, "train" if i % 4 else "heldout", rng.integers(0, 100, length).astype(np.int32),
                             (rng.random(length) > 0.5).astype(np.uint8)))
    return out


def write(plan) -> None:
    """What a backend does with a plan: states for each sample, one shard under its final name."""
    samples = [Sample(s.sample_id, s.split, torch.from_numpy(s.input_ids), torch.from_numpy(s.loss_mask),
                      torch.full((s.input_ids.size, len(LAYERS) * H), float(s.input_ids[0])),
                      torch.zeros(s.input_ids.size, H)) for s in plan.samples]
    write_shard(plan.path, samples, LAYERS)


@pytest.fixture
def key(tiny_llama):
    return cache_key(tiny_llama, "", LAYERS, "float32")


def test_plan_groups_missing_samples_in_order_and_by_size(tmp_path, key):
    data = rows(10)
    with CaptureCache.open(tmp_path, *key) as cache:
        plans, cached = cache.plan(data, 4, 10**9, BPT)
        assert cached == [] and [p.index for p in plans] == [0, 1, 2]
        assert [s.sample_id for p in plans for s in p.samples] == [s.sample_id for s in data]
        assert [len(p.samples) for p in plans] == [4, 4, 2]
        assert plans[0].path == str(cache.folder / shard_name(0))
        small = cache.plan(data, 100, 12 * BPT, BPT)[0]  # by bytes: no shard over 12 tokens unless one sample is
        assert all(p.tokens <= 12 or len(p.samples) == 1 for p in small) and len(small) > 3


def test_a_second_run_captures_only_new_samples(tmp_path, key):
    old, new = rows(6), rows(3, seed=1, start=6)
    with CaptureCache.open(tmp_path, *key) as cache:
        for p in cache.plan(old, 4, 10**9, BPT)[0]:
            write(p)
            cache.add(p)
    with CaptureCache.open(tmp_path, *key) as cache:
        plans, cached = cache.plan(old + new, 4, 10**9, BPT)
        assert [s.sample_id for s in cached] == [s.sample_id for s in old]
        assert [p.index for p in plans] == [2] and [s.sample_id for s in plans[0].samples] == [s.sample_id for s in new]
        assert cache.plan(old, 4, 10**9, BPT)[0] == []
        assert cache.shards_for(old[:2]) == [str(cache.folder / shard_name(0))]


def test_a_killed_run_resumes_at_the_first_missing_shard(tmp_path, key):
    """Killed after shard 1 was renamed but before the index knew it, with shard 2 half-written."""
    data = rows(12)
    with CaptureCache.open(tmp_path, *key) as cache:
        first = cache.plan(data, 4, 10**9, BPT)[0]
        write(first[0])
        cache.add(first[0])
        write(first[1])  # renamed into place, never added to the index
        partial = cache.folder / f".{shard_name(2)}.tmp-12345"
        partial.write_bytes(b"half a shard")
    with CaptureCache.open(tmp_path, *key) as cache:
        assert not partial.exists()
        plans, cached = cache.plan(data, 4, 10**9, BPT)
        assert plans == first[2:]  # the same numbers and samples as the uninterrupted plan
        assert len(cached) == 8 and shard_name(1) in cache.index
    with pytest.raises(FileNotFoundError):
        next(read_shard(partial))


def test_an_unreadable_shard_is_set_aside_and_captured_again(tmp_path, key):
    data = rows(4)
    with CaptureCache.open(tmp_path, *key) as cache:
        plan = cache.plan(data, 4, 10**9, BPT)[0][0]
    (cache.folder / shard_name(0)).write_bytes(b"\0" * 64)  # not what write_shard writes
    with CaptureCache.open(tmp_path, *key) as cache:
        plans, cached = cache.plan(data, 4, 10**9, BPT)
        assert plans == [plan] and cached == []
        assert (cache.folder / (shard_name(0) + ".unreadable")).exists()


def test_the_same_id_with_other_tokens_is_bad_input(tmp_path, key):
    data = rows(3)
    with CaptureCache.open(tmp_path, *key) as cache:
        for p in cache.plan(data, 4, 10**9, BPT)[0]:
            write(p)
            cache.add(p)
        changed = SampleRow(data[1].sample_id, data[1].split, data[1].input_ids[:-1], data[1].loss_mask[:-1])
        with pytest.raises(BadInput, match=f"sample {data[1].sample_id}: the capture cache"):
            cache.plan([changed], 4, 10**9, BPT)


def test_the_key_changes_with_what_changes_the_states(tiny_llama, tmp_path):
    k0 = cache_key(tiny_llama, "", LAYERS, "float32")[0]
    assert k0 == cache_key(tiny_llama, "", LAYERS, "float32")[0]
    assert k0 != cache_key(tiny_llama, "", (1, 3), "float32")[0]
    assert k0 != cache_key(tiny_llama, "", LAYERS, "bfloat16")[0]
    assert k0 != cache_key(tiny_llama, "rev-2", LAYERS, "float32")[0]


def _parquet(path, table: dict) -> str:
    pq.write_table(pa.table(table), path)
    return str(path)


def test_read_dataset_checks_every_row(tmp_path):
    good = {"sample_id": ["a", "b"], "input_ids": [[1, 2, 3], [4, 5]], "loss_mask": [[0, 1, 1], [1, 1]],
            "length": [3, 2], "split": ["train", "heldout"]}
    got = read_dataset(_parquet(tmp_path / "ok.parquet", good), vocab_size=10)
    assert [s.sample_id for s in got] == ["a", "b"] and got[0].input_ids.dtype == np.int32
    cases = [
        ({"input_ids": [[1, 2, 30], [4, 5]]}, "row 0 .*token id 30 outside the target's vocabulary of 10"),
        ({"length": [3, 3]}, "row 1 .*2 input_ids, 2 loss_mask values, length 3"),
        ({"sample_id": ["a", "a"]}, "row 1 .*repeated"),
        ({"split": ["train", "test"]}, "row 1 .*split 'test'"),
        ({"loss_mask": [[0, 2, 1], [1, 1]]}, "row 0 .*loss_mask"),
    ]
    for change, message in cases:
        with pytest.raises(BadInput, match=message):
            read_dataset(_parquet(tmp_path / "bad.parquet", {**good, **change}), vocab_size=10)
    with pytest.raises(BadInput, match="missing column"):
        read_dataset(_parquet(tmp_path / "cols.parquet", {k: v for k, v in good.items() if k != "split"}), 10)
    with pytest.raises(BadInput, match="does not exist"):
        read_dataset(tmp_path / "none.parquet", 10)
    (tmp_path / "junk.parquet").write_bytes(os.urandom(100))
    with pytest.raises(BadInput, match="not a readable parquet"):
        read_dataset(tmp_path / "junk.parquet", 10)
