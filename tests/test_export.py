"""The export: the folder's contract (what vLLM and SGLang read), on a draft trained on the tiny target's own
greedy continuations.

That vLLM speculates with an exported draft, and that a trained one is accepted more often than a random one of
the same shape with what the target writes unchanged, is tests/test_evaluate.py's online run (vLLM's own
counters); that vLLM computes each export option as eaglet does is tests/test_export_options.py's.
"""
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from remote.draft.eagle3 import OPTIONS
from remote.draft.folder import read_folder, weight_names
from remote.train.export import main as export_main
from remote.step import EXIT_BAD_INPUT
from remote.train.train import main as train_main
from tests.fixtures.export import target  # noqa: F401  (target: a fixture)
from tests.fixtures.train_inputs import hf_capture, save_vocab

PROMPT_LEN, NEW_TOKENS = 12, 24


def _write(p: Path, obj) -> str:
    p.write_text(json.dumps(obj))
    return str(p)


def _prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, PROMPT_LEN), generator=g).tolist()


@pytest.fixture(scope="module")
def exported(target, tmp_path_factory):
    """Self-distilled data -> capture -> vocab -> train (in this process) -> export."""
    from transformers import AutoModelForCausalLM

    d = tmp_path_factory.mktemp("draft")
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    with torch.no_grad():
        gen = model.generate(torch.tensor(_prompts(192, vocab, seed=0)), max_new_tokens=NEW_TOKENS, do_sample=False,
                             min_new_tokens=NEW_TOKENS, pad_token_id=0)
    seqs = gen.tolist()
    masks = [[0] * PROMPT_LEN + [1] * NEW_TOKENS for _ in seqs]
    cap = hf_capture(target, seqs, masks, d / "capture", per_shard=128)
    voc = save_vocab(seqs, masks, vocab, 256, d / "vocab")
    cfg = {"capture_dir": str(cap), "vocab_dir": str(voc), "out_dir": str(d / "train"), "device": "cpu",
           "ttt_steps": 3, "token_budget": 1152, "epochs": 4, "optimizer": "adamw", "lr": 3e-3, "warmup_steps": 2, "checkpoint_every": 1000}
    # AdamW: the acceptance this test asserts was set with it at this tiny scale
    assert train_main(["--config", _write(d / "train.json", cfg)]) == 0
    exp = {"train_dir": str(d / "train"), "vocab_dir": str(voc), "out_dir": str(d / "export"), "dtype": "float32"}
    assert export_main(["--config", _write(d / "export.json", exp)]) == 0
    return d


def test_folder_has_what_vllm_reads(target, exported):
    out = exported / "export"
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]  # the capture's, top level
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [0, 2, 4]}  # SGLang's numbering: HF - 1
    assert cfg["num_aux_hidden_states"] == 3 and not any(cfg[o] for o in OPTIONS)  # today's draft: no option on
    n = cfg["draft_vocab_size"]  # 256 asked; fewer when the generations use fewer distinct tokens
    assert 0 < n <= 256 and cfg["vocab_size"] == 512 and cfg["target_hidden_size"] == 128
    w = load_file(str(out / "model.safetensors"))
    folder = read_folder(out)  # the one reader: its kind by architecture, its config read back
    weights = weight_names(folder.kind, folder.draft_config())  # no options: fc, midlayer.*, norm, lm_head
    assert len(weights) == 13 and not any(k.startswith(("input_norm", "fc_norm")) for k in weights)
    assert set(w) == set(weights) | {"d2t", "t2d"} and not any("embed_tokens" in k for k in w)
    assert w["midlayer.self_attn.q_proj.weight"].shape == (128, 256)  # q/k/v read [embedding, state]: 2H
    assert w["fc.weight"].shape == (128, 384) and w["lm_head.weight"].shape == (n, 128)
    assert w["d2t"].dtype == torch.int64 and w["t2d"].dtype == torch.bool and int(w["t2d"].sum()) == n
    assert torch.equal(torch.arange(n) + w["d2t"], w["t2d"].nonzero().squeeze(1))
    card = (out / "README.md").read_text()
    assert "test-192" in card and str(target) in card  # data fingerprint and target on the model card
    assert f"vllm serve {target} --speculative-config" in card and "--speculative-algorithm EAGLE3" in card


def test_ids_sglang_cannot_express_are_refused_by_name_unless_exported_for_vllm_only(exported, tmp_path, capsys):
    """The trained draft relabelled as taken from the last layer's output (HF 6 of 6): vLLM captures it,
    SGLang never does (it captures layer inputs)."""
    train = tmp_path / "train"
    shutil.copytree(exported / "train", train)
    dcfg = json.loads((train / "draft_config.json").read_text())
    assert dcfg["target_layers"] == 6 and dcfg["target_model_type"] == "llama"  # recorded from the target
    (train / "draft_config.json").write_text(json.dumps({**dcfg, "aux_layer_ids": [1, 3, 6]}))
    both = {"train_dir": str(train), "vocab_dir": str(exported / "vocab"), "out_dir": str(tmp_path / "both"),
            "engines": ["vllm", "sglang"]}
    assert export_main(["--config", _write(tmp_path / "both.json", both)]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "aux layer ids [6]" in err and "SGLang" in err and "engines ['vllm']" in err
    assert not (tmp_path / "both").exists()  # nothing half-written
    vllm_only = {**both, "out_dir": str(tmp_path / "vllm"), "engines": ["vllm"]}
    assert export_main(["--config", _write(tmp_path / "vllm.json", vllm_only)]) == 0
    cfg = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 3, 6] and "eagle_config" not in cfg
    assert "Not for SGLang" in (tmp_path / "vllm" / "README.md").read_text()
    auto = {**both, "out_dir": str(tmp_path / "auto"), "engines": []}  # the default: vLLM, SGLang where it can
    assert export_main(["--config", _write(tmp_path / "auto.json", auto)]) == 0
    assert "export for vLLM only: aux layer ids [6]" in capsys.readouterr().out
    assert json.loads((tmp_path / "auto" / "config.json").read_text()) == cfg


def test_export_refuses_a_vocab_it_was_not_trained_with(exported, tmp_path, capsys):
    from remote.train.vocab import choose_vocab

    other = tmp_path / "vocab"
    other.mkdir()
    choose_vocab(torch.ones(512, dtype=torch.int64), 100).save(other / "vocab.safetensors")
    cfg = {"train_dir": str(exported / "train"), "vocab_dir": str(other), "out_dir": str(tmp_path / "e")}
    assert export_main(["--config", _write(tmp_path / "e.json", cfg)]) == EXIT_BAD_INPUT
    assert "not the one the draft was trained with" in capsys.readouterr().err
    assert not (tmp_path / "e").exists()
