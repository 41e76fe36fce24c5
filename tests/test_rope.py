"""The draft's rotary is the one vLLM applies to it at inference, for every rope type the draft takes.

vLLM's side is vLLM's own code on the CPU, without an engine: the exported config.json read by
vllm's get_config, wrapped in EAGLEConfig as SpeculativeConfig does for an eagle3 draft, and the
rotary that vLLM's Llama attention builds from it (get_rope over the config's rope_parameters).
Only the engine is left out; these are the same functions and classes it calls.
"""
import json

import pytest
import torch

from remote.draft.config import DraftConfig
from remote.draft.model import EagleDraft, apply_rope
from remote.draft.eagle3 import draft_config_from_export, vllm_config

TARGET = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 512,
          "vocab_size": 1000, "rms_norm_eps": 1e-5}
# As the targets' own config.json files spell them (Kimi-K2.5's sits under text_config, DeepSeek-V3's alike).
LLAMA31 = {"rope_theta": 500000.0, "max_position_embeddings": 131072,
           "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192}}
KIMI = {"rope_theta": 50000.0, "max_position_embeddings": 262144,
        "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}}
QWEN_YARN = {"rope_parameters": {"rope_theta": 1000000.0, "rope_type": "yarn", "factor": 4.0,
                                 "original_max_position_embeddings": 32768}, "max_position_embeddings": 131072}
MSCALE = {"rope_theta": 10000.0, "max_position_embeddings": 163840,  # mscale != mscale_all_dim: a cos/sin scale != 1
          "rope_scaling": {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
                           "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.707}}
LINEAR = {"rope_theta": 10000.0, "max_position_embeddings": 16384, "rope_scaling": {"type": "linear", "factor": 4.0}}
DYNAMIC = {"rope_theta": 10000.0, "max_position_embeddings": 8192, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}
PLAIN = {"rope_theta": 10000.0, "max_position_embeddings": 4096}
CASES = {"llama3": LLAMA31, "kimi-yarn": KIMI, "qwen-yarn": QWEN_YARN, "yarn-mscale": MSCALE, "linear": LINEAR,
         "dynamic": DYNAMIC, "default": PLAIN}


def _draft_config(rope: dict, wrap: bool = False) -> DraftConfig:
    t = {**TARGET, **rope}
    return DraftConfig.from_target_config({"text_config": t} if wrap else t, draft_vocab_size=100, aux_layer_ids=[1, 2, 3])


def _vllm_rotary(export_dir):
    """The rotary vLLM builds for this exported eagle3 draft (llama.py's LlamaAttention._init_rotary_emb)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.transformers_utils.config import get_config
    from vllm.transformers_utils.configs.eagle import EAGLEConfig

    hf = EAGLEConfig(get_config(str(export_dir), trust_remote_code=False), method="eagle3", model_type="eagle")
    with set_current_vllm_config(VllmConfig()):  # its CustomOp dispatch reads the current config
        rotary = get_rope(hf.head_dim, max_position=hf.max_position_embeddings,
                          rope_parameters=getattr(hf, "rope_parameters", None), is_neox_style=True)
    return hf, rotary


def _export(d: DraftConfig, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(vllm_config(d, "float32")))
    return tmp_path


@pytest.mark.parametrize("name", list(CASES))
def test_draft_rotary_equals_vllms_for_the_exported_config(name, tmp_path):
    d = _draft_config(CASES[name], wrap=name == "kimi-yarn")
    hf, rotary = _vllm_rotary(_export(d, tmp_path))
    assert (hf.rope_parameters.get("rope_type") or "default") == (d.rope_scaling or {}).get("rope_type", "default")
    draft = EagleDraft(d)
    # Positions past the original context too: that is where the scalings differ from plain rope.
    pos = torch.tensor([0, 1, 7, 100, 2047, 4095, 4096, 9000, 30000, 131071])
    pos = pos[pos < rotary.cos_sin_cache.shape[0]]
    cos, sin = draft.rope(pos)
    vcos, vsin = rotary.cos_sin_cache[pos].float().chunk(2, dim=-1)
    assert torch.allclose(cos, vcos, atol=2e-5) and torch.allclose(sin, vsin, atol=2e-5), \
        f"{name}: cos max diff {(cos - vcos).abs().max():.2e}, sin {(sin - vsin).abs().max():.2e}"
    # The rotated q/k themselves, through vLLM's forward (its layout: [T, heads * head_dim]).
    g = torch.Generator().manual_seed(0)
    q = torch.randn(len(pos), d.num_heads, d.head_dim, generator=g)
    k = torch.randn(len(pos), d.num_kv_heads, d.head_dim, generator=g)
    vq, vk = rotary.forward_native(pos, q.flatten(1).clone(), k.flatten(1).clone())
    assert torch.allclose(apply_rope(q, cos, sin).flatten(1), vq, atol=1e-4)
    assert torch.allclose(apply_rope(k, cos, sin).flatten(1), vk, atol=1e-4)


def test_plain_rope_is_transformers_own_to_the_bit():
    """Unscaled rope is computed without transformers (its import costs a step seconds): the same frequencies."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from remote.draft.model import rope_frequencies

    for theta, head_dim in ((10000.0, 64), (500000.0, 128), (100000.0, 16)):
        d = _draft_config({**KIMI, "rope_scaling": None, "rope_theta": theta})
        d = DraftConfig(**{**d.to_dict(), "head_dim": head_dim})
        hf = LlamaRotaryEmbedding(LlamaConfig(hidden_size=d.num_heads * head_dim, num_attention_heads=d.num_heads,
                                              head_dim=head_dim, rope_parameters={"rope_theta": theta,
                                                                                  "rope_type": "default"}))
        inv, scale = rope_frequencies(d)
        assert torch.equal(inv, hf.inv_freq.float()) and scale == hf.attention_scaling == 1.0


def test_scaled_types_really_differ_from_plain_rope():
    """The comparison above could not tell the types apart if they all came out as plain rope."""
    plain = EagleDraft(_draft_config({**KIMI, "rope_scaling": None}))
    pos = torch.tensor([9000])
    base_cos, _ = plain.rope(pos)
    for name in ("llama3", "kimi-yarn", "linear"):
        cos, _ = EagleDraft(_draft_config(CASES[name])).rope(pos)
        assert (cos - base_cos).abs().max() > 0.1, name
    # yarn's attention factor: 1 for Kimi (mscale == mscale_all_dim), 0.1 ln(factor) + 1 without mscale keys.
    assert EagleDraft(_draft_config(KIMI)).rope_scale == pytest.approx(1.0)
    assert EagleDraft(_draft_config(QWEN_YARN)).rope_scale == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)
    ratio = (0.1 * 1.0 * torch.log(torch.tensor(40.0)).item() + 1) / (0.1 * 0.707 * torch.log(torch.tensor(40.0)).item() + 1)
    assert EagleDraft(_draft_config(MSCALE)).rope_scale == pytest.approx(ratio)


@pytest.mark.parametrize("name", list(CASES))
def test_exported_config_round_trips_the_rope_settings(name, tmp_path):
    d = _draft_config(CASES[name])
    back = draft_config_from_export(json.loads((_export(d, tmp_path) / "config.json").read_text()))
    assert (back.rope_theta, back.rope_scaling, back.max_position_embeddings) == \
        (d.rope_theta, d.rope_scaling, d.max_position_embeddings)
    src = CASES[name].get("rope_scaling") or {k: v for k, v in CASES[name].get("rope_parameters", {}).items()
                                              if k != "rope_theta"}
    if src:  # every setting of the target reaches the export, the legacy `type` as `rope_type`
        assert d.rope_scaling == {("rope_type" if k == "type" else k): v for k, v in src.items()}


def test_unsupported_or_incomplete_rope_is_refused_by_name():
    with pytest.raises(ValueError, match="'longrope' is not supported"):
        _draft_config({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}})
    with pytest.raises(ValueError, match=r"'yarn' lacks \['original_max_position_embeddings'\]"):
        _draft_config({"rope_scaling": {"type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="alpha"):
        _draft_config({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0, "alpha": 1.5}})
    assert _draft_config({"rope_scaling": {"rope_type": "default"}}).rope_scaling is None
