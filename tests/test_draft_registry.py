"""The draft registry (remote/draft/registry.py) and the exported folder's one reader (remote/draft/folder.py):
kinds found by name, by an export's architecture and by a model; a folder read back into its kind's config and
model, equal to what was exported."""
import json

import pytest
import torch

from remote.draft.config import DraftConfig
from remote.draft.eagle3 import Eagle3
from remote.draft.folder import load_model, read_folder, read_weights, weight_names
from remote.draft.model import EagleDraft
from remote.draft.registry import AUTO, DEFAULT, KINDS, kind, kind_for_target, kind_of_export, kind_of_model
from remote.step import BadInput
from tests.fixtures.golden import export_hashes
from tests.fixtures.kimi import tiny_kimi  # noqa: F401  (a fixture)


def test_kinds_are_found_by_name_architecture_and_model():
    eagle3 = kind("eagle3")
    assert isinstance(eagle3, Eagle3) and kind(DEFAULT) is eagle3 and "eagle3" in KINDS
    assert eagle3.config is DraftConfig and eagle3.model is EagleDraft and eagle3.method == "eagle3"
    assert kind_of_export({"architectures": ["LlamaForCausalLMEagle3"]}, "draft d") is eagle3
    with pytest.raises(BadInput, match=r"draft d: architectures \['LlamaForCausalLM'\] is not \['LlamaForCausalLMEagle3'"):
        kind_of_export({"architectures": ["LlamaForCausalLM"]}, "draft d")
    with pytest.raises(BadInput, match=r"draft kind 'nope' is not one of \["):
        kind("nope")
    cfg = DraftConfig(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48,
                      target_vocab_size=100, draft_vocab_size=20, aux_layer_ids=(1, 2, 3))
    assert kind_of_model(EagleDraft(cfg)) is eagle3
    with pytest.raises(TypeError, match="no registered draft kind's model"):
        kind_of_model(torch.nn.Linear(2, 2))


def test_an_export_reads_back_into_its_kind_config_and_model(tmp_path):
    _, _, out = export_hashes(tmp_path, {"norm_before_fc": True}, "float32", ["vllm"])
    folder = read_folder(out)
    d = folder.draft_config()
    assert folder.kind is kind("eagle3") and d.norm_before_fc and d.aux_layer_ids == (2, 4, 5)
    assert set(folder.tensors) == set(weight_names(folder.kind, d)) | {"d2t", "t2d"}
    assert folder.tensors["t2d"] == (300,) and folder.tensors["d2t"] == (40,)
    embed = torch.randn(300, 64)
    draft, t2d = load_model(folder, d, embed, torch.float32)
    exported = read_weights(out, "here")
    assert int(t2d.sum()) == 40 and torch.equal(draft.embed_tokens.weight, embed)
    for k, v in draft.trainable_state_dict().items():
        assert torch.equal(v, exported[k]), k
    record = json.loads((out / "manifest.json").read_text())["export"]
    assert record["kind"] == "eagle3" and record["format"] == "vllm-eagle3" and record["options"] == ["norm_before_fc"]


def test_a_folder_without_what_the_reader_needs_is_refused_by_name(tmp_path):
    with pytest.raises(BadInput, match="no config.json"):
        read_folder(tmp_path)
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(BadInput, match="is not valid JSON"):
        read_folder(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(BadInput, match=r"no \*.safetensors weights"):
        read_folder(tmp_path)
    with pytest.raises(BadInput, match=r"warm_start x: no \*.safetensors weights"):
        read_weights(tmp_path, "warm_start x")


def test_train_draft_auto_is_the_mla_kind_for_an_mla_target(tiny_llama, tiny_kimi, tmp_path):
    """train.draft's default "auto": eagle3 for a Llama target; eagle3_mla for an MLA one (the tiny Kimi-K2.5's
    DeepSeek-V3 text config), with plain rotary where the target has yarn (an explicit eagle3_mla refuses it)."""
    from remote.target import read_config
    from remote.train.config import TrainOptions

    assert TrainOptions().draft == AUTO
    assert kind_for_target(AUTO, read_config(tiny_llama)) is kind("eagle3")
    assert kind_for_target("dflash", read_config(tiny_kimi.vllm_dir)) is kind("dflash")  # a named kind is that kind
    kimi = read_config(tiny_kimi.vllm_dir)
    mla = kind_for_target(AUTO, kimi)
    assert mla is kind("eagle3_mla") and mla.auto_overrides(kimi) == {}
    cfg = mla.config.from_target_config(kimi, draft_vocab_size=64, aux_layer_ids=(1, 2, 3))
    assert cfg.kv_lora_rank == kimi["text_config"]["kv_lora_rank"] and cfg.hidden_size == 256
    yarn = {**kimi, "text_config": {**kimi["text_config"], "rope_scaling": {
        "type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0}}}
    with pytest.raises(ValueError, match=r"plain rotary for now; pass draft_overrides=\{'rope_scaling': None\}"):
        mla.config.from_target_config(yarn, draft_vocab_size=64, aux_layer_ids=(1, 2, 3))
    assert mla.auto_overrides(yarn) == {"rope_scaling": None}
    cfg = mla.config.from_target_config(yarn, draft_vocab_size=64, aux_layer_ids=(1, 2, 3), **mla.auto_overrides(yarn))
    assert cfg.rope_scaling is None
