"""fp8 capture storage and the disk plan (issue 16, items 1 and 2), on the CPU with the tiny Llama.

fp8 states (float8 e4m3, a float32 scale per token and layer) read back within e4m3's rounding,
through both write paths (write_shard, which the transformers backend calls, and the vLLM worker's
Recorder: its writer thread, without an engine); the capture step with the transformers backend in
process stores fp8 beside the capture dtype under another cache key, in about half the bytes; the
train step (a few steps), the export and the offline evaluation run on the fp8 capture; an fp8 shard in
a bf16 cache, or a capture set mixing them, is refused by name; the disk plan's byte estimate is
within 3% of what was written, and it refuses a budget one sample passes, naming need, free and budget.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from remote.capture.backend_vllm import _wire_plan
from remote.capture.capture import DiskPlan, main as capture_main
from remote.capture.store import FP8_MAX, CaptureSet, Sample, read_shard, write_shard
from remote.capture.worker import Recorder, request_id
from remote.draft.data import CaptureIndex
from remote.step import EXIT_BAD_INPUT, BadInput
from tests.fixtures.capture import one_pass, plan, random_samples, rows, write_dataset
from tests.fixtures.train_inputs import run_train, save_vocab

LAYERS = [1, 3, 4]  # of the 6-layer tiny Llama (H 64)
H = 64


def states(t: int, groups: int, seed: int) -> torch.Tensor:
    """[t, groups * H] values whose magnitude spans 1e-4..1e3 between tokens and layers; one token all zero."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, groups, H, generator=g) * 10 ** (torch.rand(t, groups, 1, generator=g) * 7 - 4)
    x[0] = 0
    return x.reshape(t, groups * H)


def assert_within_e4m3(got: torch.Tensor, want: torch.Tensor, groups: int, zero_first: bool = True) -> None:
    """Each value within e4m3's rounding: 2^-4 of itself (3 mantissa bits), 2^-10 of its token-layer's
    scale (absmax / 448) for the subnormals near zero."""
    w = want.float().reshape(len(want), groups, -1)
    scale = w.abs().amax(-1, keepdim=True) / FP8_MAX
    err = (got.float().reshape(w.shape) - w).abs()
    assert (err <= (2**-4 * w.abs() + 2**-10 * scale) * 1.0001).all(), (err / scale.clamp(min=1e-30)).max()
    assert (err <= 2**-3 * scale * FP8_MAX).all()  # the brief's figure: 2^-3 of the token-layer absmax
    assert not zero_first or torch.equal(got[0], torch.zeros_like(got[0]))  # a token of zeros stays zero


def sample(i: int, t: int, dtype=torch.float32) -> Sample:
    return Sample(f"s{i}", "train", torch.arange(t, dtype=torch.int32), torch.ones(t, dtype=torch.uint8),
                  states(t, len(LAYERS), i).to(dtype), states(t, 1, 100 + i).to(dtype))


def test_fp8_shards_read_back_within_e4m3_rounding_in_half_the_bytes(tmp_path):
    samples = [sample(i, t) for i, t in enumerate([40, 7, 23])]
    n_fp8 = write_shard(tmp_path / "f8.safetensors", samples, LAYERS, "fp8")
    n_f32 = write_shard(tmp_path / "f32.safetensors", samples, LAYERS)
    for s, got in zip(samples, read_shard(tmp_path / "f8.safetensors")):
        assert got.hidden_states.dtype == torch.float32 and torch.equal(got.input_ids, s.input_ids)
        assert_within_e4m3(got.hidden_states, s.hidden_states, len(LAYERS))
        assert_within_e4m3(got.last_hidden_state, s.last_hidden_state, 1)
    assert n_fp8 < 0.3 * n_f32  # 1 byte a value + 4 a layer's scale vs 4 bytes a value
    # bf16 states come back in bf16; the training index reads the same rows as read_shard
    bf = [sample(i, t, torch.bfloat16) for i, t in enumerate([12, 30])]
    write_shard(tmp_path / "bf.safetensors", bf, LAYERS, "fp8")
    index = CaptureIndex.build(CaptureSet((str(tmp_path / "bf.safetensors"),), tuple(LAYERS), H, "bfloat16", "t",
                                          storage="fp8"))
    batch = index.load([1, 0], token_budget=100)
    whole = list(read_shard(tmp_path / "bf.safetensors"))
    assert batch.aux.dtype == torch.bfloat16
    assert torch.equal(batch.aux, torch.cat([whole[1].hidden_states, whole[0].hidden_states]))
    assert_within_e4m3(whole[1].hidden_states, bf[1].hidden_states, len(LAYERS))


def test_the_vllm_workers_writer_stores_fp8_as_write_shard_does(tmp_path):
    p = plan(tmp_path, 0, [5, 3])
    rec = Recorder([1, 2], storage="fp8")
    rec.plan(_wire_plan(p))
    one_pass(rec, [(request_id(0, 0), 0, rows(0, 0, 0, 5)), (request_id(0, 1), 0, rows(0, 1, 0, 3))])
    assert rec.close()["error"] is None
    exact = [sample_of(p, k) for k in range(2)]
    write_shard(tmp_path / "ref.safetensors", exact, [1, 2], "fp8")
    assert (tmp_path / "ref.safetensors").read_bytes() == Path(p.path).read_bytes()
    for want, got in zip(exact, read_shard(p.path)):
        assert_within_e4m3(got.hidden_states, want.hidden_states, 2, zero_first=False)


def sample_of(p, slot: int) -> Sample:
    s = p.samples[slot]
    want = rows(p.index, slot, 0, len(s.input_ids))
    return Sample(s.sample_id, s.split, torch.from_numpy(s.input_ids), torch.from_numpy(s.loss_mask),
                  want[:, :4], want[:, 4:])


# ----------------------------------------------------------------------------- the step
@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("fp8-data")
    samples = random_samples(np.random.default_rng(7).integers(16, 48, 30).tolist(), vocab=500, seed=7)
    return d, samples, write_dataset(d / "data.parquet", samples)


def capture(tiny_llama, data_path: Path, cache: Path, out: Path, capsys=None, **options) -> tuple[int, dict | None]:
    cfg = {"dataset": str(data_path), "target": str(tiny_llama), "out_dir": str(out), "cache_root": str(cache),
           "backend": "transformers", "device": "cpu", "dtype": "float32", "layer_ids": LAYERS,
           "samples_per_shard": 8, **options}
    out.parent.mkdir(parents=True, exist_ok=True)
    path = out.parent / f"{out.name}.config.json"
    path.write_text(json.dumps(cfg))
    rc = capture_main(["--config", str(path)])
    m = out / "manifest.json"
    return rc, json.loads(m.read_text()) if m.is_file() else None


@pytest.fixture(scope="module")
def captures(tiny_llama, data):
    d, _, path = data
    rc_a, auto = capture(tiny_llama, path, d / "cache", d / "auto")
    rc_f, fp8 = capture(tiny_llama, path, d / "cache", d / "fp8", storage_dtype="fp8")
    assert rc_a == rc_f == 0
    return auto, fp8


def test_the_step_stores_fp8_under_its_own_key_in_about_half_the_bytes(data, captures):
    from tasks.capture import figures_table

    auto, fp8 = captures
    assert fp8["capture"]["storage_dtype"] == "fp8" and auto["capture"]["storage_dtype"] == "float32"
    assert fp8["capture"]["dtype"] == "float32" and fp8["capture"]["cache_key"] != auto["capture"]["cache_key"]
    # bytes per token: 4 x 64 values + 4 scales of 4 bytes + 5, against 4 x 64 x 4 + 5
    assert fp8["figures"]["bytes_per_token"] <= fp8["figures"]["bytes_per_token_bound"] == 4 * 64 + 16 + 5 + 16
    assert fp8["figures"]["bytes"] < 0.3 * auto["figures"]["bytes"]
    for m in captures:  # the plan, made before the engine started, within 3% of what was written
        plan = m["disk_plan"]
        assert abs(plan["need_bytes"] - m["figures"]["bytes"]) <= 0.03 * m["figures"]["bytes"]
        assert plan["budget_bytes"] == 0 and plan["free_bytes"] > 0 and plan["held_bytes"] == 0
    rows = {r["figure"]: r["value"] for r in figures_table(fp8)}
    assert rows["disk plan: storage dtype"] == "fp8" and rows["disk plan: bytes to write"] == fp8["disk_plan"]["need_bytes"]
    exact = {s.sample_id: s for s in CaptureSet.from_manifest(data[0] / "auto").samples()}
    for s in CaptureSet.from_manifest(data[0] / "fp8").samples():  # the same forward, stored both ways
        assert_within_e4m3(s.hidden_states, exact[s.sample_id].hidden_states, len(LAYERS), zero_first=False)
        assert_within_e4m3(s.last_hidden_state, exact[s.sample_id].last_hidden_state, 1, zero_first=False)


def test_training_export_and_offline_evaluation_read_fp8_shards(tiny_llama, data, captures, tmp_path):
    from remote.evaluate.evaluate import EvaluateConfig, measure_offline
    from remote.train.export import main as export_main

    d, samples, _ = data
    fp8_dir = d / "fp8"
    vocab = save_vocab([s.input_ids.tolist() for s in samples], [s.loss_mask.tolist() for s in samples], 512, 200,
                       tmp_path / "vocab")
    out = tmp_path / "train"
    r = run_train({"capture_dir": str(fp8_dir), "vocab_dir": str(vocab), "ttt_steps": 3, "token_budget": 96,
                   "lr": 3e-3, "warmup_steps": 1, "max_steps": 3, "checkpoint_every": 1000, "eval_every": 1,
                   "seed": 1, "device": "cpu", "out_dir": str(out)}, tmp_path / "train.json")
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads((out / "manifest.json").read_text())
    assert m["figures"]["heldout_acceptance_length"] >= 1.0
    (tmp_path / "export.json").write_text(json.dumps({"train_dir": str(out), "vocab_dir": str(vocab),
                                                      "out_dir": str(tmp_path / "draft"), "dtype": "float32"}))
    assert export_main(["--config", str(tmp_path / "export.json")]) == 0
    ev = EvaluateConfig(target=str(tiny_llama), draft_dir=str(tmp_path / "draft"), data="", out_dir=str(tmp_path / "ev"),
                        capture_dir=str(fp8_dir), online=False, device="cpu")
    got = measure_offline(ev, 3)
    assert 1.0 <= got["acceptance_length"] <= 4.0


def test_an_fp8_shard_in_a_float32_cache_or_capture_set_is_refused_by_name(tiny_llama, data, captures, tmp_path, capsys):
    d, _, path = data
    auto, fp8 = captures
    cache = tmp_path / "cache"
    shutil.copytree(Path(auto["capture"]["cache_dir"]).parent, cache / "captures")
    stray = cache / "captures" / auto["capture"]["cache_key"] / "shard-00099.safetensors"
    shutil.copy(fp8["capture"]["shards"][0], stray)
    rc, m = capture(tiny_llama, path, cache, tmp_path / "again")
    assert rc == EXIT_BAD_INPUT and m is None
    assert f"{stray} holds fp8 states; this cache holds float32 ones" in capsys.readouterr().err
    mixed = CaptureSet((auto["capture"]["shards"][0], fp8["capture"]["shards"][1]), tuple(LAYERS), H, "float32", "t")
    with pytest.raises(BadInput, match=f"{fp8['capture']['shards'][1]} holds fp8 states; this capture's are float32"):
        CaptureIndex.build(mixed)


def test_the_plan_refuses_a_budget_one_sample_passes_naming_the_three_figures(tiny_llama, data, tmp_path, capsys):
    d, samples, path = data
    one = (4 * 64 + 16 + 5) * int(samples[0].input_ids.size)  # the first sample's fp8 bytes
    rc, m = capture(tiny_llama, path, tmp_path / "cache", tmp_path / "cap", storage_dtype="fp8", max_disk_gb=one / 2 / 1e9)
    err = capsys.readouterr().err
    assert rc == EXIT_BAD_INPUT and m is None and not (tmp_path / "cap").exists()
    assert "disk plan: the capture needs" in err and "free in" in err
    assert f"budget capture.max_disk_gb {one // 2:,} bytes" in err and "passes the budget" in err
    assert not list((tmp_path / "cache").rglob("shard-*"))  # refused before anything was captured


def test_the_plan_refuses_what_the_free_space_cannot_hold():
    fits = DiskPlan("/c", "fp8", 100, 10, 1000, 0, 2**31, 0)
    assert fits.problems() == []
    full = DiskPlan("/c", "fp8", 100, 10**8, 10**10, 0, 2**31, 0)
    with pytest.raises(BadInput, match=r"needs 10\.00 GB .* 2\.15 GB free in /c; no budget: refused: the free space"):
        full.check()
