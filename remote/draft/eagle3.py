"""The EAGLE-3 draft with one Llama decoder layer (vLLM 0.32's LlamaForCausalLMEagle3, SGLang's too): the first
draft kind. Its config is remote/draft/config.py's DraftConfig, its model remote/draft/model.py's EagleDraft, its
objective and chain remote/draft/loss.py's TTT unroll; here is how it is proposed offline, exported and read back.

    LLM(target, speculative_config={"method": "eagle3", "model": "<export>", "num_speculative_tokens": 3})

The export (remote.train.export writes it through remote.draft.folder): config.json (LlamaForCausalLMEagle3, one
hidden layer, draft and target vocab sizes, the draft options, and the aux layer ids in each engine's numbering:
vLLM's top-level eagle_aux_hidden_state_layer_ids, SGLang's eagle_config.eagle_aux_hidden_state_layer_ids),
model.safetensors (`fc`, `midlayer.*`, `norm`, `lm_head`, the options' `input_norm` / `fc_norm.i`, `d2t`, `t2d`;
no `embed_tokens`: the engines then share the target's) and README.md, a model card (target, data fingerprint,
figures, how to serve it in each engine).

Aux layer numbering. eaglet's ids are HF hidden-state indices (0 the embeddings, N the last layer's
output), which vLLM reads as they are. SGLang reads the layer whose output is taken (HF index - 1):
its Llama path adds one and captures at that layer's input; its DeepSeek/Kimi path (deepseek_v2.py)
adds one only when the first id is 1 in newer releases (always in older ones), so a DeepSeek/Kimi
draft is expressed for SGLang only when its first HF id is 2. An id an engine cannot express is
refused by name: export for the engines that can (`engines`).
"""
from __future__ import annotations

import torch

from remote.draft.config import DraftConfig
from remote.draft.loss import TTTObjective, unroll
from remote.draft.model import EagleDraft, TTTAttention
from remote.draft.registry import DraftKind
from remote.step import BadInput, log

ARCHITECTURE = "LlamaForCausalLMEagle3"
ENGINES = ("vllm", "sglang")
OPTIONS = ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output")  # DraftConfig fields vLLM reads
# Targets SGLang serves through its deepseek_v2.py (Kimi-K2.5's language model is a DeepSeek-V3).
SGLANG_DEEPSEEK_TYPES = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2", "kimi_k25")


class Eagle3(DraftKind):
    name = "eagle3"
    architecture = ARCHITECTURE
    method = "eagle3"
    export_format = "vllm-eagle3"
    config = DraftConfig
    model = EagleDraft

    def objective(self, draft, ttt_steps, decay, attention, compiled):
        return TTTObjective(draft, ttt_steps, decay, attention, compiled=compiled)

    def guesses(self, draft, batch, steps, attention="dense", compiled=False):
        """The chain: step j at row t guesses token t+2+j from token t+1+j and step j-1's state
        (remote.draft.loss.unroll, the training objective's own)."""
        attn = TTTAttention(batch.doc_ids, attention, compiled)
        return torch.stack([draft.lm_head(normed).argmax(-1) for _, normed in unroll(draft, batch, steps, attn)], 1)

    def engines(self, cfg):
        return serving_engines(cfg)

    def export_config(self, cfg, dtype, engines):
        return vllm_config(cfg, dtype, engines)

    def config_from_export(self, config):
        return draft_config_from_export(config)

    def export_record(self, cfg):
        return {"options": [o for o in OPTIONS if getattr(cfg, o)]}

    def card(self, name, train_m, vocab_m, cfg, engines):
        return model_card(name, train_m, vocab_m, cfg, engines)


# ----------------------------------------------------------------------------- the engines' numbering
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


# ----------------------------------------------------------------------------- config.json and the model card
def vllm_config(d: DraftConfig, dtype: str, engines: tuple[str, ...] = ("vllm",)) -> dict:
    """config.json of an eagle3 draft as vLLM's LlamaForCausalLMEagle3 reads it (and SGLang's, with "sglang")."""
    cfg = {
        "architectures": [ARCHITECTURE],
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
