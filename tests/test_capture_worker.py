"""The capture worker's bookkeeping (remote.capture.worker.Recorder) without an engine: passes that
mix requests, a request split over passes, a preempted request computed again from 0, a decode row,
someone else's request. Each row's value names its sample and position, so a misfiled row shows."""
from __future__ import annotations

import numpy as np
import torch

from remote.capture.backend_vllm import _wire_plan
from remote.capture.store import read_shard
from remote.capture.worker import Recorder, parse_request_id, request_id
from tests.fixtures.capture import N_AUX, H, one_pass, plan, rows



def test_request_ids_round_trip_and_foreign_ones_are_ignored():
    assert parse_request_id(request_id(12, 3) + "-a1b2c3d4") == (12, 3)
    assert parse_request_id(request_id(12, 3)) == (12, 3)
    assert parse_request_id("0-a1b2c3d4") is None and parse_request_id("prefill.3-x") is None


def test_rows_are_filed_by_request_and_position(tmp_path):
    p0, p1 = plan(tmp_path, 0, [5, 3]), plan(tmp_path, 1, [4])
    rec = Recorder([1, 2])
    rec.plan(_wire_plan(p0))
    rec.plan(_wire_plan(p1))
    r00, r01, r10 = request_id(0, 0) + "-aaaa", request_id(0, 1) + "-bbbb", request_id(1, 0) + "-cccc"
    one_pass(rec, [(r00, 0, rows(0, 0, 0, 2)), (r01, 0, rows(0, 1, 0, 3)), ("other-dddd", 0, rows(9, 9, 0, 4))])
    one_pass(rec, [(r10, 0, rows(1, 0, 0, 2)), (r00, 2, rows(0, 0, 2, 4))])  # slot order changed
    one_pass(rec, [(r10, 0, rows(1, 0, 0, 4))])  # preempted, computed again from 0: shard 1 whole
    one_pass(rec, [(r00, 4, rows(0, 0, 4, 6))])  # the last prompt row and one decode row (position 5)
    status = rec.close()
    assert status["error"] is None and sorted(status["written"]) == [0, 1] and not any(status["pending"].values())
    assert status["multi_request_passes"] == 2 and status["max_passes_per_sample"] == 3
    for p in (p0, p1):
        for slot, s in enumerate(read_shard(p.path)):
            want = rows(p.index, slot, 0, len(p.samples[slot].input_ids))
            assert torch.equal(s.hidden_states, want[:, :N_AUX * H]) and torch.equal(s.last_hidden_state, want[:, N_AUX * H:])
            assert np.array_equal(s.input_ids.numpy(), p.samples[slot].input_ids)


def test_an_unfinished_shard_is_never_written_and_is_reported(tmp_path):
    p = plan(tmp_path, 0, [6])
    rec = Recorder([1, 2])
    rec.plan(_wire_plan(p))
    one_pass(rec, [(request_id(0, 0), 0, rows(0, 0, 0, 4))])
    status = rec.close()
    assert status["written"] == [] and status["pending"] == {0: ["id0-0"]}
    assert not list(tmp_path.iterdir())


def test_a_failed_write_is_reported_not_raised_in_the_forward(tmp_path):
    p = plan(tmp_path / "gone", 0, [2])  # its folder does not exist
    rec = Recorder([1, 2])
    rec.plan(_wire_plan(p))
    one_pass(rec, [(request_id(0, 0), 0, rows(0, 0, 0, 2))])
    status = rec.close()
    assert status["written"] == [] and status["error"].startswith(f"writing shard {p.path}")
