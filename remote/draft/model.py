"""The EAGLE-3 draft in plain PyTorch: fc, one decoder layer over [embedding, fused state], lm_head.

    draft = EagleDraft(cfg)                      # cfg: remote.draft.config.DraftConfig
    h = draft.fc(aux_hidden_states)              # [T, n_aux*H] -> [T, H] (the input norms included)
    attn = TTTAttention(doc_ids)                 # one per packed batch, shared by the TTT steps
    h, normed = draft.step(draft.embed(ids), h, positions, attn)   # h: the state the next step reads
    logits = draft.lm_head(normed)               # over the draft vocabulary

Parameter names are the ones vLLM and SGLang load (`fc`, `midlayer.*`, `norm`, `lm_head`, and with
the options `input_norm`, `fc_norm.i`), so the export only converts dtypes. The data flow is vLLM
0.32's eagle3 Llama draft (llama_eagle3.py), options included:
    h = fc(aux)                              norm_before_fc: fc(input_norm(aux)); fc_norm: fc(cat(fc_norm.i(aux_i)))
    x = cat(input_layernorm(embed), hidden_norm(h))             (embedding first)
    residual = h                             norm_before_residual: hidden_norm(h)
    out = mlp(post_attention_layernorm(attn(x) + residual)) + attn(x) + residual
    logits = lm_head(norm(out)); the next step's state is out    norm_output: norm(out)

Training-time test (TTT): step k's queries see the step-0 keys of their own sample causally plus
the keys that steps 1..k wrote at their own position (the "diagonal"). TTTAttention keeps every
step's keys and values, so step k costs one causal attention over T keys plus k diagonal terms.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from remote.draft.config import DraftConfig


# ----------------------------------------------------------------------------- building blocks
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 (bf16 squares lose the small components), then back to x's dtype.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight.to(x.dtype)


def rope_frequencies(cfg: DraftConfig) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim/2], cos/sin scale) of the target's rope, from transformers' own rope init.

    vLLM builds the exported draft's rotary from the same settings (get_rope over the LlamaConfig's
    rope_parameters); tests/test_rope.py checks the two agree for every type in config.ROPE_TYPES.
    The scale is 1 except for yarn (its attention factor multiplies cos and sin, as in vLLM).
    Unscaled rope (DraftConfig keeps rope_scaling None for it) is theta ** (-2i / head_dim), written here:
    importing transformers costs a step 2-4 s.
    """
    if cfg.rope_scaling is None:
        return 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim), 1.0
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope = {"rope_theta": cfg.rope_theta, **cfg.rope_scaling}
    hf = LlamaConfig(hidden_size=cfg.num_heads * cfg.head_dim, num_attention_heads=cfg.num_heads,
                     head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings,
                     rope_parameters=rope)
    # The inverse frequencies at construction are the static ones vLLM uses; transformers' dynamic
    # type would only change them past max_position_embeddings, which vLLM never does.
    emb = LlamaRotaryEmbedding(hf)
    return emb.inv_freq.float(), float(emb.attention_scaling)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half (NeoX) rotary on x [T, heads, d]; cos/sin [T, d/2] in float32."""
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


class SelfAttention(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(2 * h, cfg.num_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, cfg.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, cfg.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)


class FC(nn.Linear):
    """fc, after the input norms vLLM's combine_hidden_states applies (norm_before_fc, fc_norm).

    The norms are registered on the draft under vLLM's weight names (`input_norm`, `fc_norm.i`); fc
    only calls them (a tuple: not submodules), so every caller of draft.fc (the loss, the
    evaluation) gets the state vLLM drafts from, and the names stay the ones vLLM loads.
    """

    def __init__(self, cfg: DraftConfig):
        super().__init__(cfg.fc_in, cfg.hidden_size, bias=False)
        self.norms: tuple[nn.Module, ...] = ()

    def forward(self, aux: torch.Tensor) -> torch.Tensor:
        for norm in self.norms:
            aux = norm(aux)
        return super().forward(aux)


class AuxNorms(nn.ModuleList):
    """fc_norm: one RMSNorm per aux state of the concatenation (Eagle 3.1)."""

    def __init__(self, cfg: DraftConfig):
        super().__init__(RMSNorm(cfg.fc_in // cfg.n_aux, cfg.rms_norm_eps) for _ in range(cfg.n_aux))

    def forward(self, aux: torch.Tensor) -> torch.Tensor:
        return torch.cat([norm(x) for norm, x in zip(self, aux.chunk(len(self), dim=-1))], dim=-1)


class MLP(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    """The draft's one decoder layer; `pre_attention` and `post_attention` are compiled apart,
    the attention between them keeps Python state (the TTT key cache)."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.cfg = cfg
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = SelfAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def pre_attention(self, embeds, hidden, cos, sin):
        """(q, k, v, the residual around attention)."""
        c, a = self.cfg, self.self_attn
        normed = self.hidden_norm(hidden)
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        t = x.shape[0]
        q = apply_rope(a.q_proj(x).view(t, c.num_heads, c.head_dim), cos, sin)
        k = apply_rope(a.k_proj(x).view(t, c.num_kv_heads, c.head_dim), cos, sin)
        v = a.v_proj(x).view(t, c.num_kv_heads, c.head_dim)
        return q, k, v, (normed if c.norm_before_residual else hidden)

    def post_attention(self, attn_out, residual):
        h = self.self_attn.o_proj(attn_out.flatten(1)) + residual
        return self.mlp(self.post_attention_layernorm(h)) + h


# ----------------------------------------------------------------------------- TTT attention
class TTTAttention:
    """Attention for the unrolled TTT steps of one packed batch.

    doc_ids [T] gives each position its sample (packing); queries never see another sample.
    backend "dense": one joint softmax over [T step-0 keys | k diagonal keys], O(T^2) memory per
    step: the CPU path (flex attention has no CPU backward). backend "flex": flex attention over the
    concatenated keys of steps 0..k with a block-sparse mask (the diagonal blocks cost ~nothing).
    """

    def __init__(self, doc_ids: torch.Tensor, backend: str = "dense", compiled: bool = False):
        if backend not in ("dense", "flex"):
            raise ValueError(f"attention backend {backend!r}: choose 'dense' or 'flex'")
        self.doc, self.backend, self.compiled = doc_ids, backend, compiled
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._causal0: torch.Tensor | None = None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, d], k/v [T, Hkv, d] of the current step -> output [T, Hq, d]."""
        self.keys.append(k)
        self.values.append(v)
        return self._dense(q) if self.backend == "dense" else self._flex(q)

    def _dense(self, q):
        t, hq, d = q.shape
        rep = hq // self.keys[0].shape[1]
        ks = [x.repeat_interleave(rep, dim=1).transpose(0, 1) for x in self.keys]  # [Hq, T, d] each
        vs = [x.repeat_interleave(rep, dim=1).transpose(0, 1) for x in self.values]
        qh = q.transpose(0, 1)
        if self._causal0 is None:
            pos = torch.arange(t, device=q.device)
            self._causal0 = (self.doc[:, None] == self.doc[None, :]) & (pos[None, :] <= pos[:, None])
        s0 = (qh @ ks[0].transpose(1, 2)).float() / math.sqrt(d)
        s0 = s0.masked_fill(~self._causal0, float("-inf"))
        diag = [(qh * kj).sum(-1, keepdim=True).float() / math.sqrt(d) for kj in ks[1:]]
        p = torch.softmax(torch.cat([s0, *diag], dim=-1), dim=-1).to(q.dtype)
        out = p[..., :t] @ vs[0]
        for j, vj in enumerate(vs[1:]):
            out = out + p[..., t + j: t + j + 1] * vj
        return out.transpose(0, 1)

    def _flex(self, q):
        from torch.nn.attention.flex_attention import create_block_mask

        t = q.shape[0]
        steps = len(self.keys)
        doc = self.doc

        def mask_mod(b, h, qi, kvi):
            j = kvi // t
            s = kvi - j * t
            return ((j == 0) & (doc[qi] == doc[s]) & (s <= qi)) | ((j > 0) & (s == qi))

        block_mask = create_block_mask(mask_mod, None, None, t, steps * t, device=q.device, _compile=self.compiled)
        kk = torch.cat(self.keys, 0).transpose(0, 1)[None]  # [1, Hkv, steps*T, d]
        vv = torch.cat(self.values, 0).transpose(0, 1)[None]
        out = _flex_fn(self.compiled)(q.transpose(0, 1)[None], kk, vv, block_mask=block_mask, enable_gqa=True)
        return out[0].transpose(0, 1)


_FLEX = {}


def _flex_fn(compiled: bool):
    from torch.nn.attention.flex_attention import flex_attention

    if compiled and "c" not in _FLEX:
        # One compile per TTT step (the key length grows by T each step): 7 steps, forward and
        # backward, pass dynamo's default limit of 8 and would fall back to eager flex (dense scores).
        torch._dynamo.config.recompile_limit = max(64, torch._dynamo.config.recompile_limit)
        _FLEX["c"] = torch.compile(flex_attention, dynamic=False)
    return _FLEX["c"] if compiled else flex_attention


# ----------------------------------------------------------------------------- the draft
class EagleDraft(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.target_vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # the target's own embedding, frozen
        self.fc = FC(cfg)
        if cfg.norm_before_fc:
            self.input_norm = RMSNorm(cfg.fc_in, cfg.rms_norm_eps)
            self.fc.norms = (self.input_norm,)
        if cfg.fc_norm:
            self.fc_norm = AuxNorms(cfg)
            self.fc.norms = (self.fc_norm,)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        inv_freq, self.rope_scale = rope_frequencies(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._pre, self._post = self.midlayer.pre_attention, self.midlayer.post_attention

    def compile_layers(self) -> None:
        """torch.compile the dense parts of a step (norms, projections, rope, MLP): GPU training."""
        self._pre = torch.compile(self.midlayer.pre_attention, dynamic=False)
        self._post = torch.compile(self.midlayer.post_attention, dynamic=False)

    @torch.no_grad()
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ang = positions.float()[:, None] * self.inv_freq[None, :]
        return ang.cos() * self.rope_scale, ang.sin() * self.rope_scale

    def step(self, embeds, hidden, positions, attn: TTTAttention):
        """One draft step: (the state the next step reads, normed state for lm_head).

        The next step's state is vLLM's second output of the draft: the pre-norm state, or with
        norm_output the normed one itself.
        """
        cos, sin = self.rope(positions)
        q, k, v, residual = self._pre(embeds, hidden, cos, sin)
        prenorm = self._post(attn(q, k, v), residual)
        normed = self.norm(prenorm)
        return (normed if self.cfg.norm_output else prenorm), normed

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights a checkpoint and the export keep: everything but the target's embedding."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("embed_tokens.")}
