"""Layer lookup and the aux-layer numbering (remote.capture.layers), on real HF modules and small torch
modules shaped like vLLM's multimodal wrappers (vLLM's own classes need an engine to build)."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from remote.capture.layers import (LAYER_PATHS, TargetConfig, check_layer_ids, default_layer_ids, find_decoder_layers,
                           hooked_layer)
from remote.step import BadInput


def _layers(n: int = 3) -> nn.ModuleList:
    return nn.ModuleList(nn.Linear(4, 4) for _ in range(n))


class _Node(nn.Module):
    """A module with the given children, to build a wrapper of any shape."""

    def __init__(self, **children: nn.Module):
        super().__init__()
        for name, child in children.items():
            self.add_module(name, child)


class KimiK25ForConditionalGeneration(_Node):
    """Named like the real wrapper so the error message can be checked for the class name."""


@pytest.mark.parametrize("shape, path", [
    (lambda L: _Node(model=_Node(layers=L), lm_head=nn.Linear(4, 4)), "model.layers"),  # a plain decoder
    # vLLM 0.32 Kimi-K2.5: language_model is a DeepseekV2ForCausalLM; the vision tower has layers too
    (lambda L: _Node(vision_tower=_Node(layers=_layers(5)), mm_projector=nn.Linear(4, 4),
                     language_model=_Node(model=_Node(layers=L))), "language_model.model.layers"),
    # the vLLM 0.16 era: language_model is a bare DeepseekV2Model (.layers, no .model)
    (lambda L: _Node(vision_tower=_Node(layers=_layers(5)), language_model=_Node(layers=L)), "language_model.layers"),
    # HF 5.x multimodal: the wrapper's .model holds language_model
    (lambda L: _Node(model=_Node(vision_tower=_Node(layers=_layers(5)), language_model=_Node(layers=L))),
     "model.language_model.layers"),
])
def test_each_known_shape_resolves_to_the_text_layers(shape, path):
    layers = _layers(3)
    found_path, found = find_decoder_layers(shape(layers))
    assert (found_path, found) == (path, layers)


def test_a_model_without_decoder_layers_is_refused_by_name():
    model = KimiK25ForConditionalGeneration(vision_tower=_Node(layers=_layers(2)), language_model=_Node(head=nn.Linear(4, 4)))
    with pytest.raises(BadInput) as e:
        find_decoder_layers(model)
    msg = str(e.value)
    assert msg.startswith("KimiK25ForConditionalGeneration: found no decoder layers")
    assert all("." + p in msg for p in LAYER_PATHS)


def test_an_empty_layer_list_does_not_count():
    with pytest.raises(BadInput):
        find_decoder_layers(_Node(model=_Node(layers=nn.ModuleList())))


def test_default_aux_ids_are_hf_indices():
    assert default_layer_ids(30) == (2, 15, 27)  # SmolLM2
    assert default_layer_ids(61) == (2, 30, 58)  # Kimi-K2.5
    assert default_layer_ids(7) == (2, 3, 4)
    for shallow in (3, 6):  # (2, 3, 3) for 6 layers: one aux layer twice
        with pytest.raises(BadInput, match="layer_ids explicitly"):
            default_layer_ids(shallow)


def test_layer_ids_outside_1_to_n_minus_1_are_refused():
    assert check_layer_ids([1, 3, 5], 6) == (1, 3, 5)
    for bad in ([0, 2], [2, 6], [2, 2], []):
        with pytest.raises(BadInput, match="1..5"):
            check_layer_ids(bad, 6)


def test_the_hooked_layer_output_is_hf_hidden_state_i(tiny_llama):
    """The off-by-one, on a real model: output of layer hooked_layer(i) == HF hidden_states[i]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    _, layers = find_decoder_layers(model)
    outputs = {}
    for i, layer in enumerate(layers):
        layer.register_forward_hook(lambda m, a, o, i=i: outputs.__setitem__(i, o[0] if isinstance(o, tuple) else o))
    with torch.no_grad():
        hs = model(torch.arange(3, 40)[None], output_hidden_states=True).hidden_states
    for i in range(1, len(layers)):
        assert torch.equal(outputs[hooked_layer(i)], hs[i])
    assert not torch.allclose(outputs[hooked_layer(2)], hs[3])  # the neighbour differs: the test can fail
    # HF's last hidden state is after the final norm; the captured final state is before it
    assert torch.allclose(model.model.norm(outputs[len(layers) - 1]), hs[-1], atol=1e-6)
    assert not torch.allclose(outputs[len(layers) - 1], hs[-1], atol=1e-3)


def test_target_config_reads_plain_and_nested_configs(tiny_llama, tmp_path):
    plain = TargetConfig.read(tiny_llama)
    assert (plain.num_layers, plain.hidden_size, plain.dtype, plain.is_mla) == (6, 64, "float32", False)
    assert plain.weight_bytes == (tiny_llama / "model.safetensors").stat().st_size
    nested = {"architectures": ["KimiK25ForConditionalGeneration"], "vision_config": {"hidden_size": 64},
              "text_config": {"num_hidden_layers": 61, "hidden_size": 7168, "vocab_size": 163840,
                              "kv_lora_rank": 512, "dtype": "bfloat16"}}
    (tmp_path / "config.json").write_text(json.dumps(nested))
    kimi = TargetConfig.read(tmp_path)
    assert (kimi.num_layers, kimi.hidden_size, kimi.vocab_size, kimi.dtype, kimi.is_mla) == (61, 7168, 163840, "bfloat16", True)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["X"], "hidden_size": 8}))
    with pytest.raises(BadInput, match="lacks"):
        TargetConfig.read(tmp_path)
    with pytest.raises(BadInput, match="no config.json"):
        TargetConfig.read(tmp_path / "nowhere")
