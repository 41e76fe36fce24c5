"""Export a trained draft as the folder vLLM (0.32) loads as an eagle3 speculator, and SGLang too.

    python -m remote.train.export --config c.json
    # {"train_dir": "/runs/r1/train", "vocab_dir": "/runs/r1/vocab", "out_dir": "/runs/r1/export"}

    LLM(target, speculative_config={"method": "eagle3", "model": "<out_dir>", "num_speculative_tokens": 3})

Writes out_dir/config.json (LlamaForCausalLMEagle3, one hidden layer, draft and target vocab sizes,
the draft options, and the aux layer ids in each engine's numbering: vLLM's top-level
eagle_aux_hidden_state_layer_ids, SGLang's eagle_config.eagle_aux_hidden_state_layer_ids),
model.safetensors (`fc`, `midlayer.*`, `norm`, `lm_head`, the options' `input_norm` / `fc_norm.i`,
`d2t`, `t2d`; no `embed_tokens`: the engines then share the target's) and README.md, a model card
(target, data fingerprint, figures, how to serve it in each engine).

Aux layer numbering. eaglet's ids are HF hidden-state indices (0 the embeddings, N the last layer's
output), which vLLM reads as they are. SGLang reads the layer whose output is taken (HF index - 1):
its Llama path adds one and captures at that layer's input; its DeepSeek/Kimi path (deepseek_v2.py)
adds one only when the first id is 1 in newer releases (always in older ones), so a DeepSeek/Kimi
draft is expressed for SGLang only when its first HF id is 2. An id an engine cannot express is
refused by name: export for the engines that can (`engines`).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from remote.draft.config import DraftConfig
from remote.draft.model import EagleDraft
from remote.draft.vocab import DraftVocab
from remote.step import BadInput, begin_step, log, read_manifest, step_main, write_json_atomic
from remote.train.config import ExportConfig

STEP = "export"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
ENGINES = ("vllm", "sglang")
OPTIONS = ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output")  # DraftConfig fields vLLM reads
# Targets SGLang serves through its deepseek_v2.py (Kimi-K2.5's language model is a DeepSeek-V3).
SGLANG_DEEPSEEK_TYPES = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2", "kimi_k25")


def draft_weight_names(d: DraftConfig) -> list[str]:
    """The tensors an exported draft of this config holds (d2t and t2d aside): the model's own names."""
    with torch.device("meta"):  # the names and nothing else: no memory for a large target's shapes
        return list(EagleDraft(d).trainable_state_dict())


def vllm_layer_ids(d: DraftConfig) -> list[int]:
    """The aux ids in vLLM's numbering (HF hidden-state indices, as eaglet's); BadInput for ids it cannot take.

    vLLM (llama.py, deepseek_v2.py) appends a state when the layer loop passes its index: in layer
    order, once each, for 0..N.
    """
    ids = list(d.aux_layer_ids)
    if ids != sorted(set(ids)):
        raise BadInput(f"aux layer ids {ids} are not strictly ascending: vLLM and SGLang take the states in layer "
                       "order, once each, so a draft trained on them cannot be served; capture them in ascending order")
    bad = [i for i in ids if i < 0 or (d.target_layers is not None and i > d.target_layers)]
    if bad:
        raise BadInput(f"aux layer ids {bad} are outside 0..{d.target_layers} (HF hidden-state indices of a target "
                       f"with {d.target_layers} layers): vLLM cannot capture them")
    return ids


def sglang_layer_ids(d: DraftConfig) -> list[int]:
    """The aux ids in SGLang's numbering (the layer whose output is taken: HF index - 1); BadInput for a draft
    SGLang cannot run as trained: ids it cannot express, or options its LlamaForCausalLMEagle3 lacks."""
    ids, fix = vllm_layer_ids(d), "; export with engines ['vllm'] to serve it in vLLM only"
    on = [o for o in OPTIONS if getattr(d, o)]
    if on:
        raise BadInput(f"draft options {on}: SGLang's LlamaForCausalLMEagle3 does not implement them (it would load "
                       f"the draft and draft with another model){fix}")
    if len(ids) != 3:
        raise BadInput(f"{len(ids)} aux layers {ids}: SGLang's eagle3 draft fuses exactly 3 (its fc is 3 x hidden)"
                       f"{fix}")
    last = d.target_layers - 1 if d.target_layers is not None else None
    bad = [i for i in ids if i < 1 or (last is not None and i > last)]
    if bad:  # it captures at the input of layers 0..N-1: neither the embeddings (no residual yet) nor the last output
        raise BadInput(f"aux layer ids {bad} (HF hidden-state indices): SGLang captures only 1..{last or 'N-1'}{fix}")
    if d.target_model_type in SGLANG_DEEPSEEK_TYPES and ids[0] != 2:
        raise BadInput(f"aux layer ids {ids} of a {d.target_model_type} target: SGLang's deepseek_v2.py reads ids "
                       f"whose first is not 1 (HF 2) as layer inputs in newer releases and as outputs in older "
                       f"ones, so no numbering serves both{fix}")
    return [i - 1 for i in ids]


def serving_engines(d: DraftConfig) -> tuple[str, ...]:
    """vLLM, and SGLang too when it can run this draft as trained."""
    try:
        sglang_layer_ids(d)
    except BadInput as e:
        log(f"export for vLLM only: {e}")
        return ("vllm",)
    return ENGINES


def vllm_config(d: DraftConfig, dtype: str, engines: tuple[str, ...] = ("vllm",)) -> dict:
    """config.json of an eagle3 draft as vLLM's LlamaForCausalLMEagle3 reads it (and SGLang's, with "sglang")."""
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
        "eagle_aux_hidden_state_layer_ids": vllm_layer_ids(d),
        # vLLM sizes fc by this key (else by eagle_config's ids, else 3)
        "num_aux_hidden_states": d.n_aux,
        **{o: getattr(d, o) for o in OPTIONS},  # vLLM reads each at the top level (norm_before_fc: eagle_config first)
        **d.extra,
    }
    if "sglang" in engines:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": sglang_layer_ids(d)}
    return cfg


def draft_config_from_export(c: dict) -> DraftConfig:
    """The DraftConfig of an exported draft's config.json: the inverse of vllm_config."""
    heads = int(c["num_attention_heads"])
    return DraftConfig(
        hidden_size=int(c["hidden_size"]), num_heads=heads, num_kv_heads=int(c.get("num_key_value_heads") or heads),
        head_dim=int(c.get("head_dim") or int(c["hidden_size"]) // heads), intermediate_size=int(c["intermediate_size"]),
        target_vocab_size=int(c["vocab_size"]), draft_vocab_size=int(c["draft_vocab_size"]),
        aux_layer_ids=tuple(c["eagle_aux_hidden_state_layer_ids"]), rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        rope_theta=float(c.get("rope_theta", 10000.0)), rope_scaling=c.get("rope_scaling"),
        max_position_embeddings=int(c.get("max_position_embeddings", 8192)),
        target_hidden_size=c.get("target_hidden_size"), **{o: bool(c.get(o, False)) for o in OPTIONS})


def model_card(name: str, train_m: dict, vocab_m: dict | None, d: DraftConfig, engines: tuple[str, ...]) -> str:
    t, f = train_m.get("train", {}), train_m.get("figures", {})
    acc = ", ".join(f"{a:.3f}" for a in f.get("final_acc", []))
    cov = (vocab_m or {}).get("figures", {}).get("coverage")
    target = t.get("target", "<target>")
    on = [o for o in OPTIONS if getattr(d, o)]
    lines = [
        f"# {name}: an EAGLE-3 draft",
        "",
        f"- target: `{t.get('target', '?')}`",
        f"- data fingerprint: `{t.get('data_fingerprint', '?')}` ({train_m.get('counts', {}).get('train_samples', '?')} train samples, "
        f"{train_m.get('counts', {}).get('tokens', '?')} tokens seen)",
        f"- aux layers (HF hidden-state indices): {list(d.aux_layer_ids)}"
        + (f"; SGLang numbering (eagle_config): {sglang_layer_ids(d)}" if "sglang" in engines else ""),
        f"- draft options: {', '.join(on) if on else 'none'}",
        f"- draft vocabulary: {d.draft_vocab_size} of {d.target_vocab_size} target tokens"
        + (f", covering {cov:.1%} of the train loss tokens" if cov is not None else ""),
        f"- training: {f.get('steps', '?')} steps, final loss {f.get('final_loss', float('nan')):.4f}, "
        f"top-1 agreement by TTT step [{acc}]",
        f"- code: `{train_m.get('code_hash', '')}`",
        "",
        "## Serving",
        "",
        "vLLM (0.32; the draft options and aux layers are read from config.json):",
        "",
        f"    vllm serve {target} --speculative-config "
        "'{\"method\": \"eagle3\", \"model\": \"<this folder>\", \"num_speculative_tokens\": 3}'",
        "",
        "or in Python `LLM(target, speculative_config={\"method\": \"eagle3\", \"model\": \"<this folder>\", "
        "\"num_speculative_tokens\": 3})`.",
        "",
    ]
    if "sglang" in engines:
        lines += ["SGLang (reads the aux layers from eagle_config):", "",
                  f"    python -m sglang.launch_server --model-path {target} --speculative-algorithm EAGLE3 "
                  "--speculative-draft-model-path <this folder> --speculative-num-steps 3 "
                  "--speculative-eagle-topk 1 --speculative-num-draft-tokens 4", ""]
    else:
        lines += ["Not for SGLang: exported for vLLM only (SGLang cannot run it as trained; see the export's "
                  "`engines`).", ""]
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
    engines = tuple(cfg.engines) or serving_engines(d)
    config = vllm_config(d, cfg.dtype, engines)  # first: what no engine can serve is refused before any write
    tensors = draft_tensors(load_file(str(tdir / train_m["train"]["weights"])), d, vocab, DTYPES[cfg.dtype], tdir)
    stage = out.open()
    save_file(tensors, str(stage / "model.safetensors"), metadata={"format": "pt"})
    write_json_atomic(stage / "config.json", config)
    name = cfg.name or Path(cfg.out_dir).name
    (stage / "README.md").write_text(model_card(name, train_m, read_manifest(cfg.vocab_dir), d, engines))
    params = sum(t.numel() for k, t in tensors.items() if k not in ("d2t", "t2d"))
    return out.publish(counts={"parameters": params}, figures=train_m.get("figures", {}),
                       export={"format": "vllm-eagle3", "layer_ids": list(d.aux_layer_ids), "dtype": cfg.dtype,
                               "engines": list(engines), "options": [o for o in OPTIONS if getattr(d, o)],
                               "target": train_m["train"].get("target", "")})


def draft_tensors(w: dict, d: DraftConfig, vocab: DraftVocab, dtype: torch.dtype, where) -> dict:
    """The exported tensors: the draft's weights under its own names (the engines' names) in dtype, d2t and t2d."""
    names = draft_weight_names(d)
    missing = [k for k in names if k not in w]
    if missing:
        raise BadInput(f"{where}: draft weights lack {missing}")
    tensors = {k: w[k].to(dtype).contiguous() for k in names}
    tensors["d2t"] = vocab.d2t.to(torch.int64).contiguous()
    tensors["t2d"] = vocab.t2d.to(torch.bool).contiguous()
    return tensors


def main(argv: list[str] | None = None) -> int:
    return step_main(STEP, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
