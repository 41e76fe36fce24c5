"""The shape of an EAGLE-3 draft, read from its target's config.json.

    cfg = DraftConfig.from_target_config(json.load(open("target/config.json")),
                                         draft_vocab_size=32000, aux_layer_ids=(2, 16, 29))

The draft is one Llama-style decoder layer on top of the target's hidden states, so every shape
but the draft vocabulary comes from the target (the layout vLLM's and SGLang's EAGLE-3 models load: remote/draft/eagle3.py).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

# The rope types the draft trains with, each with the keys vLLM's get_rope needs for it (the draft's rotary
# must be the one vLLM applies at inference: tests/test_rope.py compares the two).
ROPE_TYPES = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


@dataclass(frozen=True, kw_only=True)
class DraftConfig:
    hidden_size: int  # H: the draft's width, equal to the target's hidden size
    num_heads: int  # attention query heads
    num_kv_heads: int  # attention key/value heads (grouped-query attention when fewer than num_heads)
    head_dim: int  # width of one attention head
    intermediate_size: int  # SwiGLU inner width
    target_vocab_size: int  # the target's vocabulary (rows of its embedding)
    draft_vocab_size: int  # rows of the draft's lm_head (the draft vocabulary)
    aux_layer_ids: tuple[int, ...]  # HF hidden-state indices the capture took (vLLM's eagle_aux_hidden_state_layer_ids)
    rms_norm_eps: float = 1e-6  # epsilon of every RMSNorm
    rope_theta: float = 10000.0  # rotary base
    rope_scaling: dict | None = None  # HF rope_scaling dict (a rope_type of ROPE_TYPES and its keys), or None
    max_position_embeddings: int = 8192  # written to the exported config (vLLM sizes its rope cache by it)
    target_hidden_size: int | None = None  # width of the captured states when it differs from H (None: H)
    target_layers: int | None = None  # the target's decoder layers N (the export checks aux ids by it; None: unknown)
    target_model_type: str = ""  # the target's text model_type (SGLang numbers DeepSeek/Kimi aux ids its own way)
    # The draft options vLLM 0.32's eagle3 Llama draft reads from config.json (speculators 0.9.0 trains with
    # the first three on). Each changes the forward; the export writes it so vLLM runs the same model.
    norm_before_fc: bool = False  # one RMSNorm (`input_norm`, width n_aux*H) over the concatenated aux states before fc
    fc_norm: bool = False  # one RMSNorm per aux state (`fc_norm.i`, width H) before fc; not with norm_before_fc
    norm_before_residual: bool = False  # the residual around attention is hidden_norm(state), not the raw state
    norm_output: bool = False  # the state a step hands the next one is the final-normed one, not the pre-norm one
    extra: dict = field(default_factory=dict)  # target config keys copied into the export verbatim (bos/eos ids)

    def __post_init__(self):
        for name in ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                     "target_vocab_size", "draft_vocab_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be positive")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.draft_vocab_size > self.target_vocab_size:
            raise ValueError(f"draft_vocab_size={self.draft_vocab_size} exceeds target_vocab_size={self.target_vocab_size}")
        if not self.aux_layer_ids:
            raise ValueError("aux_layer_ids is empty: EAGLE-3 needs the capture's aux layer ids")
        object.__setattr__(self, "aux_layer_ids", tuple(int(i) for i in self.aux_layer_ids))
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("norm_before_fc and fc_norm are two ways to normalise the aux states before fc: "
                             "choose one")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        object.__setattr__(self, "rope_scaling", _rope_scaling(self.rope_scaling))

    @property
    def n_aux(self) -> int:
        return len(self.aux_layer_ids)

    @property
    def fc_in(self) -> int:
        return self.n_aux * (self.target_hidden_size or self.hidden_size)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DraftConfig":
        return cls(**d)

    @classmethod
    def from_target_config(cls, target: dict, *, draft_vocab_size: int, aux_layer_ids, **overrides) -> "DraftConfig":
        """Shapes from a target's config.json dict (multimodal wrappers: its `text_config`)."""
        t = target.get("text_config") or target
        heads = int(t["num_attention_heads"])
        hidden = int(t["hidden_size"])
        rope = t.get("rope_parameters") or {}  # transformers 5 folds theta and scaling into one dict
        scaling = t.get("rope_scaling") or ({k: v for k, v in rope.items() if k != "rope_theta"} or None)
        values = dict(
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(t.get("num_key_value_heads") or heads),
            head_dim=int(t.get("head_dim") or hidden // heads),
            intermediate_size=int(t["intermediate_size"]),
            target_vocab_size=int(t["vocab_size"]),
            draft_vocab_size=int(draft_vocab_size),
            aux_layer_ids=tuple(aux_layer_ids),
            rms_norm_eps=float(t.get("rms_norm_eps", 1e-6)),
            rope_theta=float(t.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            rope_scaling=scaling,
            max_position_embeddings=int(t.get("max_position_embeddings") or 8192),
            target_layers=int(t["num_hidden_layers"]) if "num_hidden_layers" in t else None,
            target_model_type=str(t.get("model_type") or ""),
            extra={k: t[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in t},
        )
        values.update(overrides)
        return cls(**values)

    @classmethod
    def from_target_dir(cls, target_dir: str | Path, **kw) -> "DraftConfig":
        from remote.target import read_config

        return cls.from_target_config(read_config(target_dir), **kw)


def _rope_scaling(s: dict | None) -> dict | None:
    """A rope_scaling dict checked and in the modern spelling (`rope_type`, not the legacy `type`); None for plain rope."""
    if not s:
        return None
    s = dict(s)
    kind = s.pop("type", None)
    kind = s.setdefault("rope_type", kind or "default")
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope_scaling type {kind!r} is not supported by the draft (supported: {sorted(ROPE_TYPES)}); "
                         "pass draft_overrides={'rope_scaling': None} to train the draft with plain rotary")
    missing = [k for k in ROPE_TYPES[kind] if s.get(k) is None]
    if missing:
        raise ValueError(f"rope_scaling type {kind!r} lacks {missing}")
    if kind == "dynamic" and ("alpha" in s or "max_trained_positions" in s):
        # vLLM turns these into another rotary (NTK alpha / a rescaled base) than transformers computes.
        raise ValueError("rope_scaling type 'dynamic' with alpha or max_trained_positions is not supported by the draft")
    return None if kind == "default" else s
