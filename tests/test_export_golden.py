"""The export's bytes stay the ones 9aa4e1d wrote: config.json (keys, values, layout) and model.safetensors
(tensor names, dtypes, bytes) of a tiny EAGLE-3 draft, hashed, against the hashes 9aa4e1d's export step gave for
the very same train folder (computed once there: the folder is built below from the draft config and the model's
own weight names alone, which both codes share, with weights made from arange, no random numbers).

A change that moves a byte of the export breaks vLLM and SGLang users' folders or the nightly's comparisons:
if one is meant, say so in the commit and update the hashes (run this test at the old commit and at the new).
"""
import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from remote.draft.config import DraftConfig
from remote.draft.model import EagleDraft
from remote.draft.vocab import DraftVocab
from remote.train.export import main as export_main

TARGET = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96, "vocab_size": 300,
          "num_hidden_layers": 8, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 2048,
          "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 1024}, "bos_token_id": 1, "eos_token_id": [2, 3]}
# (draft options, export dtype, engines) -> sha256 of (config.json, model.safetensors) as 9aa4e1d wrote them
CASES = {
    "plain-bf16-both": (({}, "bfloat16", []),
                        ("ebdecbb8d7a7eb13cfeaff6e587458b2a89f9f46833d0f6d9e57351f627a62b3",
                         "dfb7c04d52b643aa250799c8b7d5c33bd36c5756ae9c3cd94b496128adc4b221")),
    "options-fp32-vllm": (({"norm_before_fc": True, "norm_before_residual": True, "norm_output": True}, "float32",
                           ["vllm"]), ("37ca6776c9402e2ca0eaa531c88c03ee47db27e72912db055e07ba34db6453c2",
                                       "11ec1681123ef2195625fef60e1a6a55320e52eefb5d41c5a3aeff4abdc681c8")),
    "fc_norm-fp16-vllm": (({"fc_norm": True}, "float16", ["vllm"]),
                          ("7f3dbea19b2bc970d5ca80bfc04ef38db439872d078bcd2f098d0d5aa4df9df8",
                           "f811987f45fbde6aa81e04c1c33d0188560abdcc2f51f7cac7a87eea718721cc")),
}


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _folders(tmp: Path, options: dict) -> tuple[Path, Path]:
    """(train folder, vocab folder) as the train and vocab steps leave them, made without either."""
    d = DraftConfig.from_target_config(TARGET, draft_vocab_size=40, aux_layer_ids=(2, 4, 5), **options)
    train, vocab = tmp / "train", tmp / "vocab"
    train.mkdir()
    vocab.mkdir()
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in EagleDraft(d).trainable_state_dict().items()}
    weights = {k: ((torch.arange(s.numel()) % 251 - 125) / 256.0).reshape(s).float() for k, s in shapes.items()}
    save_file(weights, str(train / "model.safetensors"))
    (train / "draft_config.json").write_text(json.dumps(d.to_dict()))
    manifest = {"step": "train", "code_hash": "golden", "counts": {"train_samples": 7, "tokens": 1234},
                "figures": {"steps": 3, "final_loss": 1.5, "final_acc": [0.5, 0.25]},
                "train": {"weights": "model.safetensors", "draft_config": "draft_config.json",
                          "target": "/models/golden", "data_fingerprint": "fp"}}
    (train / "manifest.json").write_text(json.dumps(manifest))
    counts = torch.zeros(300, dtype=torch.int64)
    counts[::7] = torch.arange(1, 44)
    t2d = counts > 0
    chosen = t2d.nonzero().squeeze(1)[:40]
    t2d = torch.zeros(300, dtype=torch.bool)
    t2d[chosen] = True
    DraftVocab(chosen - torch.arange(40), t2d, counts).save(vocab / "vocab.safetensors")
    return train, vocab


def export_hashes(tmp: Path, options: dict, dtype: str, engines: list[str]) -> tuple[str, str, Path]:
    train, vocab = _folders(tmp, options)
    cfg = tmp / "export.json"
    cfg.write_text(json.dumps({"train_dir": str(train), "vocab_dir": str(vocab), "out_dir": str(tmp / "export"),
                               "dtype": dtype, "engines": engines}))
    assert export_main(["--config", str(cfg)]) == 0
    out = tmp / "export"
    return _sha(out / "config.json"), _sha(out / "model.safetensors"), out


@pytest.mark.parametrize("case", sorted(CASES))
def test_export_bytes_are_the_ones_9aa4e1d_wrote(case, tmp_path):
    (options, dtype, engines), want = CASES[case]
    config_sha, weights_sha, out = export_hashes(tmp_path, options, dtype, engines)
    names = sorted(load_file(str(out / "model.safetensors")))
    assert (config_sha, weights_sha) == want, (case, json.loads((out / "config.json").read_text()), names)
