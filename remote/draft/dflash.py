"""The DFlash draft (block drafting, vLLM 0.32's `method: dflash`): its config, model and export; its objective
and block proposal are remote/draft/dflash_loss.py. Registered as kind "dflash" (remote/draft/registry.py).

    cfg = DFlashConfig.from_target_dir(target, draft_vocab_size=32000, aux_layer_ids=(2, 16, 29),
                                       num_layers=1, block_size=8)
    draft = DFlashDraft(cfg)
    ctx = draft.context(aux)                                  # [T, n_aux*H] -> [T, H]: hidden_norm(fc(aux))
    normed = draft(block_ids, block_pos, ctx, ctx_pos, ctx_mask)   # [A*B, H], lm_head's input

    LLM(target, speculative_config={"method": "dflash", "model": "<export>", "num_speculative_tokens": B - 1})

One forward drafts a whole block. A block anchored at packed row a holds the token at a (at inference
the target's own next token, the "bonus") followed by B - 1 copies of the mask token, at positions
pos[a] .. pos[a] + B - 1; slot j > 0 predicts the token at a + j. The draft is a stack of Qwen3-style
decoder layers (per-head q/k RMSNorm, SwiGLU) whose attention sees, besides the whole block (not
causal inside it), the target's context: the captured aux states of the rows before a in the same
sample, fused by fc and hidden_norm, projected by each layer's own k_proj/v_proj (k_norm and rotary
at the row's position). The context never passes through the layers: it is injected as keys and
values. This is vLLM 0.32's DFlashQwen3ForCausalLM (qwen3_dflash.py: `precompute_and_store_context_kv`
writes the context's K/V, `forward` runs the block; v1/spec_decode/dflash.py builds the block as
[bonus, mask x K] and samples slots 1..K); tests/test_dflash.py checks that vLLM's forward of an
exported draft equals this one. The block's length is part of the model (the block attends to all of
itself): serve it with num_speculative_tokens = block_size - 1.

The export (remote.draft.folder writes it): config.json (a Qwen3 config named DFlashDraftModel) and
model.safetensors under the names vLLM loads (`fc`, `hidden_norm`, `layers.i.*`, `norm`, `lm_head`,
`d2t`, `t2d`; no `embed_tokens`: vLLM shares the target's). The aux ids are HF hidden-state indices, as
the EAGLE-3 kind's: config.json carries them as `eagle_aux_hidden_state_layer_ids` (what vLLM's layer
capture reads first) and as `dflash_config.target_layer_ids` in DFlash's own numbering (id - 1).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from remote.draft.config import DraftConfig
from remote.draft.dflash_loss import BlockObjective, block_guesses
from remote.draft.eagle3 import OPTIONS, draft_config_from_export, vllm_layer_ids
from remote.draft.eagle3 import vllm_config as eagle3_config
from remote.draft.model import MLP, RMSNorm, apply_rope, rope_frequencies
from remote.draft.registry import DraftKind
from remote.step import BadInput

ARCHITECTURE = "DFlashDraftModel"  # vLLM 0.32's registry: qwen3_dflash.DFlashQwen3ForCausalLM


@dataclass(frozen=True, kw_only=True)
class DFlashConfig(DraftConfig):
    """DraftConfig's shapes (all from the target) plus the block drafter's own settings."""

    num_layers: int = 1  # draft decoder layers (speculators' default is 5; each adds its K/V of the context)
    block_size: int = 8  # B: the anchor token and B - 1 drafted tokens; served with num_speculative_tokens B - 1
    mask_token_id: int = -1  # the target token whose embedding fills the drafted slots (-1: the last id)

    def __post_init__(self):
        super().__post_init__()
        on = [o for o in OPTIONS if getattr(self, o)]
        if on:
            raise ValueError(f"{on}: EAGLE-3 draft options; a DFlash draft has none")
        if self.num_layers < 1:
            raise ValueError(f"num_layers={self.num_layers}: need at least 1")
        if self.block_size < 2:
            raise ValueError(f"block_size={self.block_size}: a block is the anchor and at least one drafted token")
        if self.mask_token_id < 0:
            object.__setattr__(self, "mask_token_id", self.target_vocab_size - 1)
        if self.mask_token_id >= self.target_vocab_size:
            raise ValueError(f"mask_token_id={self.mask_token_id} is not a token of the target's "
                             f"{self.target_vocab_size}")


# ----------------------------------------------------------------------------- the model
class DFlashAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.cfg = cfg
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) [N, Hkv, d] of states x [N, H]: k normed per head and rotated."""
        n, c = len(x), self.cfg
        k = apply_rope(self.k_norm(self.k_proj(x).view(n, c.num_kv_heads, c.head_dim)), cos, sin)
        return k, self.v_proj(x).view(n, c.num_kv_heads, c.head_dim)

    def forward(self, x, cos, sin, ctx_kv, ctx_mask, block: int) -> torch.Tensor:
        n, c = len(x), self.cfg
        q = apply_rope(self.q_norm(self.q_proj(x).view(n, c.num_heads, c.head_dim)), cos, sin)
        k, v = self.keys_values(x, cos, sin)
        return self.o_proj(block_attention(q, k, v, *ctx_kv, ctx_mask, block).flatten(1))


def block_attention(q, k, v, ck, cv, ctx_mask, block: int) -> torch.Tensor:
    """Attention of A blocks of B queries each (q [A*B, Hq, d]) over the context keys their mask allows
    (ck/cv [T, Hkv, d], ctx_mask [A, T]) and every key of their own block (k/v [A*B, Hkv, d]), in one
    softmax. The block part is computed block by block ([A, B, B] scores), so memory is A*B*(T + B)."""
    n, hq, d = q.shape
    a, rep = n // block, hq // ck.shape[1]
    qh = q.transpose(0, 1)  # [Hq, A*B, d]
    ckh, cvh = (x.repeat_interleave(rep, dim=1).transpose(0, 1) for x in (ck, cv))  # [Hq, T, d]
    kb, vb = (x.repeat_interleave(rep, dim=1).transpose(0, 1).reshape(hq, a, block, d) for x in (k, v))
    scale = 1.0 / math.sqrt(d)
    s_ctx = (qh @ ckh.transpose(1, 2)).float() * scale
    s_ctx = s_ctx.masked_fill(~ctx_mask.repeat_interleave(block, dim=0), float("-inf"))
    s_blk = (qh.reshape(hq, a, block, d) @ kb.transpose(2, 3)).float().reshape(hq, n, block) * scale
    p = torch.softmax(torch.cat([s_ctx, s_blk], dim=-1), dim=-1).to(q.dtype)
    t = ck.shape[0]
    out = p[..., :t] @ cvh + (p[..., t:].reshape(hq, a, block, block) @ vb).reshape(hq, n, d)
    return out.transpose(0, 1)


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h, cos, sin, ctx_kv, ctx_mask, block: int) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, ctx_kv, ctx_mask, block)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDraft(nn.Module):
    first_slot = 1  # the first drafted slot of a block: slot 0 holds the anchor (vLLM's bonus) and predicts nothing

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.target_vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # the target's own embedding, frozen (vLLM shares it)
        self.fc = nn.Linear(cfg.fc_in, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        inv_freq, self.rope_scale = rope_frequencies(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._layers = list(self.layers)  # what forward calls: the layers, or compile_layers' compiled ones

    def compile_layers(self) -> None:
        """torch.compile each decoder layer (GPU training); the number of blocks changes per batch: dynamic."""
        self._layers = [torch.compile(layer, dynamic=True) for layer in self.layers]

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ang = positions.float()[:, None] * self.inv_freq[None, :]
        return ang.cos() * self.rope_scale, ang.sin() * self.rope_scale

    def context(self, aux: torch.Tensor) -> torch.Tensor:
        """The fused target context [T, H] of captured aux states [T, n_aux*H_target]."""
        return self.hidden_norm(self.fc(aux))

    def block_ids(self, anchor_ids: torch.Tensor) -> torch.Tensor:
        """[A, B]: each anchor's token followed by B - 1 mask tokens (what vLLM's proposer feeds)."""
        ids = torch.full((len(anchor_ids), self.cfg.block_size), self.cfg.mask_token_id,
                         dtype=anchor_ids.dtype, device=anchor_ids.device)
        ids[:, 0] = anchor_ids
        return ids

    def forward(self, block_ids, block_pos, ctx, ctx_pos, ctx_mask) -> torch.Tensor:
        """The final-normed states [A*B, H] of A blocks.

        block_ids/block_pos [A, B] (token ids, positions), ctx [T, H] (context()), ctx_pos [T],
        ctx_mask [A, T] bool: which context rows each block sees (its sample's rows before its anchor).
        """
        a, b = block_ids.shape
        with torch.no_grad():
            h = self.embed_tokens(block_ids.reshape(-1))
        cos, sin = self.rope(block_pos.reshape(-1))
        ccos, csin = self.rope(ctx_pos)
        for layer, call in zip(self.layers, self._layers):
            h = call(h, cos, sin, layer.self_attn.keys_values(ctx, ccos, csin), ctx_mask, b)
        return self.norm(h)

    def head_inputs(self, normed: torch.Tensor, rows: torch.Tensor, prev_ids: torch.Tensor):
        """(h, weight, rows): the drafted logits of `rows` of normed are h[rows] @ weight.T (HeadSoftCE's inputs).
        DFlash's are lm_head's alone; prev_ids (the token before each row's: DSpark's Markov input) go unused."""
        return normed, self.lm_head.weight, rows

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights a checkpoint and the export keep: everything but the target's embedding."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("embed_tokens.")}


# ----------------------------------------------------------------------------- the kind and its export
class DFlash(DraftKind):
    name = "dflash"
    architecture = ARCHITECTURE
    method = "dflash"

    def drafted_tokens(self, cfg):
        return cfg.block_size - self.model.first_slot
    export_format = "vllm-dflash"
    config = DFlashConfig
    model = DFlashDraft

    def objective(self, draft, ttt_steps, decay, attention, compiled):
        return BlockObjective(draft, ttt_steps, decay, attention, compiled)

    def guesses(self, draft, batch, steps, attention="dense", compiled=False):
        return block_guesses(draft, batch, steps, attention)

    def export_config(self, cfg, dtype, engines):
        if tuple(engines) != ("vllm",):
            raise BadInput(f"engines {list(engines)}: a DFlash draft is exported for vLLM only (engines ['vllm'])")
        return vllm_config(cfg, dtype)

    def config_from_export(self, config):
        return config_from_export(config)

    def export_record(self, cfg):
        return {"block_size": cfg.block_size, "num_layers": cfg.num_layers, "mask_token_id": cfg.mask_token_id}

    def card(self, name, train_m, vocab_m, cfg, engines):
        return model_card(name, train_m, cfg)


def dflash_layer_ids(d: DFlashConfig) -> list[int]:
    """The aux ids in DFlash's numbering (the target layer whose output is taken: HF index - 1)."""
    ids = vllm_layer_ids(d)
    if ids[0] < 1:
        raise BadInput(f"aux layer ids {ids}: HF index 0 (the embeddings) has no DFlash target layer id")
    return [i - 1 for i in ids]


def vllm_config(d: DFlashConfig, dtype: str) -> dict:
    """config.json of a DFlash draft as vLLM 0.32 reads it: a Qwen3 config (EAGLEConfig keeps a name that starts
    with DFlash) whose shape keys are the EAGLE-3 export's, without EAGLE-3's own keys, plus DFlash's."""
    cfg = {k: v for k, v in eagle3_config(d, dtype).items() if k not in (*OPTIONS, "num_aux_hidden_states")}
    return {
        **cfg,
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "num_hidden_layers": d.num_layers,
        "block_size": d.block_size,
        # causal false: the block attends to itself both ways (vLLM then asks for a non-causal backend)
        "dflash_config": {"mask_token_id": d.mask_token_id, "target_layer_ids": dflash_layer_ids(d),
                          "causal": False, "use_aux_hidden_state": True},
    }


def config_from_export(c: dict) -> DFlashConfig:
    """The DFlashConfig of an exported draft's config.json: the inverse of vllm_config."""
    return DFlashConfig(**{**draft_config_from_export(c).to_dict(), "num_layers": int(c["num_hidden_layers"]),
                           "block_size": int(c["block_size"]),
                           "mask_token_id": int(c["dflash_config"]["mask_token_id"])})


def model_card(name: str, train_m: dict, d: DFlashConfig, title: str = "a DFlash draft (block drafting)",
               method: str = "dflash", first_slot: int = DFlashDraft.first_slot, extra: tuple[str, ...] = ()) -> str:
    """The README.md of an exported block drafter; DSpark's (remote/draft/dspark.py) names its own title, method,
    first drafted slot (0: the anchor's slot drafts too) and extra lines."""
    t, f = train_m.get("train", {}), train_m.get("figures", {})
    target = t.get("target", "<target>")
    n_spec, rule = d.block_size - first_slot, "block_size - 1" if first_slot else "block_size"
    drafted = (f"the anchor and {d.block_size - 1} drafted tokens" if first_slot else
               f"the anchor and {d.block_size - 1} mask slots, each slot drafting the token after it")
    return "\n".join([
        f"# {name}: {title}",
        "",
        f"- target: `{target}`",
        f"- data fingerprint: `{t.get('data_fingerprint', '?')}`",
        f"- {d.num_layers} draft layer(s), block {d.block_size} ({drafted}), mask token {d.mask_token_id}",
        *extra,
        f"- aux layers (HF hidden-state indices): {list(d.aux_layer_ids)}; DFlash numbering: {dflash_layer_ids(d)}",
        f"- draft vocabulary: {d.draft_vocab_size} of {d.target_vocab_size} target tokens",
        f"- training: {f.get('steps', '?')} steps, final loss {f.get('final_loss', float('nan')):.4f}",
        f"- code: `{train_m.get('code_hash', '')}`",
        "",
        "## Serving",
        "",
        f"vLLM (0.32; the block's length is part of the model, so num_speculative_tokens is {rule}):",
        "",
        f"    vllm serve {target} --speculative-config "
        f"'{{\"method\": \"{method}\", \"model\": \"<this folder>\", \"num_speculative_tokens\": {n_spec}}}'",
        "",
        "Not for SGLang: exported for vLLM only.",
        "",
    ])
