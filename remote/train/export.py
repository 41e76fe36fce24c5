"""Export a trained draft as the folder vLLM (0.32) loads as an eagle3 speculator, and SGLang too.

    python -m remote.train.export --config c.json
    # {"train_dir": "/runs/r1/train", "vocab_dir": "/runs/r1/vocab", "out_dir": "/runs/r1/export"}

    LLM(target, speculative_config={"method": "eagle3", "model": "<out_dir>", "num_speculative_tokens": 3})

Writes out_dir/config.json (LlamaForCausalLMEagle3, one hidden layer, draft and target vocab sizes,
top-level eagle_aux_hidden_state_layer_ids = the capture's), model.safetensors (`fc`, `midlayer.*`,
`norm`, `lm_head`, `d2t`, `t2d`; no `embed_tokens`: vLLM then shares the target's) and README.md,
a short model card (target, data fingerprint, figures).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from remote.draft.config import DraftConfig
from remote.step import BadInput, begin_step, read_manifest, step_main, write_json_atomic
from remote.train.config import ExportConfig
from remote.train.vocab import DraftVocab

STEP = "export"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
WEIGHTS = ("fc.weight", "norm.weight", "lm_head.weight") + tuple(
    f"midlayer.{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm", "self_attn.q_proj",
                                     "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                                     "mlp.up_proj", "mlp.down_proj"))


def vllm_config(d: DraftConfig, dtype: str) -> dict:
    """config.json of an eagle3 draft as vLLM's LlamaForCausalLMEagle3 reads it."""
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": d.hidden_size,
        "target_hidden_size": d.target_hidden_size or d.hidden_size,
        "num_attention_heads": d.num_heads,
        "num_key_value_heads": d.num_kv_heads,
        "head_dim": d.head_dim,
        "intermediate_size": d.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": d.rms_norm_eps,
        # vLLM builds the draft's rotary from config.rope_parameters, which transformers 5 (LlamaConfig)
        # assembles from these two legacy keys; transformers 4 and SGLang read them as they are.
        "rope_theta": d.rope_theta,
        "rope_scaling": d.rope_scaling,
        "max_position_embeddings": d.max_position_embeddings,
        "vocab_size": d.target_vocab_size,
        "draft_vocab_size": d.draft_vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "torch_dtype": dtype,
        "eagle_aux_hidden_state_layer_ids": list(d.aux_layer_ids),
        **d.extra,
    }
    return cfg


def model_card(name: str, train_m: dict, vocab_m: dict | None, d: DraftConfig) -> str:
    t, f = train_m.get("train", {}), train_m.get("figures", {})
    acc = ", ".join(f"{a:.3f}" for a in f.get("final_acc", []))
    cov = (vocab_m or {}).get("figures", {}).get("coverage")
    lines = [
        f"# {name}: an EAGLE-3 draft",
        "",
        f"- target: `{t.get('target', '?')}`",
        f"- data fingerprint: `{t.get('data_fingerprint', '?')}` ({train_m.get('counts', {}).get('train_samples', '?')} train samples, "
        f"{train_m.get('counts', {}).get('tokens', '?')} tokens seen)",
        f"- aux layers (HF hidden-state indices): {list(d.aux_layer_ids)}",
        f"- draft vocabulary: {d.draft_vocab_size} of {d.target_vocab_size} target tokens"
        + (f", covering {cov:.1%} of the train loss tokens" if cov is not None else ""),
        f"- training: {f.get('steps', '?')} steps, final loss {f.get('final_loss', float('nan')):.4f}, "
        f"top-1 agreement by TTT step [{acc}]",
        f"- code: `{train_m.get('code_hash', '')}`",
        "",
        "Load with vLLM: `LLM(target, speculative_config={\"method\": \"eagle3\", \"model\": \"<this folder>\", "
        "\"num_speculative_tokens\": 3})`.",
        "",
    ]
    return "\n".join(lines)


def run(raw: dict) -> dict:
    cfg, out, done = begin_step(ExportConfig, raw, STEP)
    if done is not None:
        return done
    train_m = read_manifest(cfg.train_dir)
    if train_m is None:
        raise BadInput(f"train_dir {cfg.train_dir}: no finished train step (no manifest.json)")
    tdir = Path(cfg.train_dir)
    d = DraftConfig.from_dict(json.loads((tdir / train_m["train"]["draft_config"]).read_text()))
    vocab = DraftVocab.load(cfg.vocab_dir)
    if len(vocab.d2t) != d.draft_vocab_size or len(vocab.t2d) != d.target_vocab_size:
        raise BadInput(f"vocab {cfg.vocab_dir} ({len(vocab.d2t)} of {len(vocab.t2d)}) is not the one the draft was "
                       f"trained with ({d.draft_vocab_size} of {d.target_vocab_size})")
    w = load_file(str(tdir / train_m["train"]["weights"]))
    missing = [k for k in WEIGHTS if k not in w]
    if missing:
        raise BadInput(f"{tdir}: draft weights lack {missing}")
    dt = DTYPES[cfg.dtype]
    tensors = {k: w[k].to(dt).contiguous() for k in WEIGHTS}
    tensors["d2t"] = vocab.d2t.to(torch.int64).contiguous()
    tensors["t2d"] = vocab.t2d.to(torch.bool).contiguous()
    stage = out.open()
    save_file(tensors, str(stage / "model.safetensors"), metadata={"format": "pt"})
    write_json_atomic(stage / "config.json", vllm_config(d, cfg.dtype))
    name = cfg.name or Path(cfg.out_dir).name
    (stage / "README.md").write_text(model_card(name, train_m, read_manifest(cfg.vocab_dir), d))
    params = sum(t.numel() for k, t in tensors.items() if k not in ("d2t", "t2d"))
    return out.publish(counts={"parameters": params}, figures=train_m.get("figures", {}),
                       export={"format": "vllm-eagle3", "layer_ids": list(d.aux_layer_ids), "dtype": cfg.dtype,
                               "target": train_m["train"].get("target", "")})


def main(argv: list[str] | None = None) -> int:
    return step_main(STEP, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
