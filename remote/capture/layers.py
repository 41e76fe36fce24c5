"""Where a model keeps its decoder layers, and which of their outputs EAGLE-3 reads.

    from remote.capture.layers import find_decoder_layers, default_layer_ids, hooked_layer
    path, layers = find_decoder_layers(model)   # ("model.layers", ModuleList); BadInput if none fits
    ids = default_layer_ids(len(layers))        # (2, N//2, N-3), HF hidden-state indices
    layers[hooked_layer(ids[0])]                # the layer whose output is hidden state ids[0]

Numbering (the off-by-one that silently costs acceptance): aux layer ids are HF hidden-state indices.
HF `hidden_states[0]` is the embedding output and `hidden_states[i + 1]` the output of decoder layer i,
so aux id i is the output (hidden_states + residual) of decoder layer i - 1. The final state is the
last layer's output before the final norm (HF's own hidden_states[N] has the norm applied).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from torch import nn

from remote.capture.config import DTYPES, CaptureOptions
from remote.step import BadInput
from remote.target import is_mla, read_config, text_settings

# Tried in order. Plain decoders (vLLM and HF) keep them at .model.layers; multimodal wrappers keep
# the text model under language_model: a *ForCausalLM in vLLM 0.32 (Kimi-K2.5), a bare *Model in the
# vLLM 0.16 era, and HF 5.x wrappers put language_model under .model.
LAYER_PATHS = (
    "model.layers",
    "language_model.model.layers",
    "language_model.layers",
    "model.language_model.layers",
)


def find_decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """(path, layers) of the first LAYER_PATHS entry that is a non-empty ModuleList of the model."""
    for path in LAYER_PATHS:
        node = model
        for part in path.split("."):
            node = getattr(node, part, None)
            if node is None:
                break
        if isinstance(node, nn.ModuleList) and len(node) > 0:
            return path, node
    raise BadInput(f"{type(model).__name__}: found no decoder layers; looked for a non-empty ModuleList at "
                   f"{', '.join('.' + p for p in LAYER_PATHS)}")


def default_layer_ids(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's aux hidden-state indices for a target of num_layers decoder layers."""
    ids = (2, num_layers // 2, num_layers - 3)
    if len(set(ids)) < 3 or ids[2] < 1:  # 7 layers at least
        raise BadInput(f"a target with {num_layers} decoder layers is too shallow for EAGLE-3's default aux "
                       f"layers (2, N//2, N-3) = {ids}: give layer_ids explicitly")
    return ids


def check_layer_ids(layer_ids: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """The ids as a tuple, refusing any outside 1..N-1 (0 is the embedding, N the final state, captured anyway)."""
    ids = tuple(int(i) for i in layer_ids)
    bad = [i for i in ids if not 1 <= i <= num_layers - 1]
    if not ids or bad or len(set(ids)) != len(ids):
        raise BadInput(f"layer_ids {list(ids)}: need distinct HF hidden-state indices in 1..{num_layers - 1} "
                       f"for a target of {num_layers} decoder layers")
    return ids


def hooked_layer(layer_id: int) -> int:
    """The decoder layer whose output is HF hidden state `layer_id`."""
    return layer_id - 1


@dataclass(frozen=True)
class TargetConfig:
    """What the capture needs to know of a target, read from its config.json (no weights loaded)."""

    path: str
    architectures: tuple[str, ...]
    num_layers: int  # decoder layers of the text model
    hidden_size: int
    vocab_size: int
    dtype: str  # the weights' dtype as config.json states it ("" when it does not)
    is_mla: bool  # multi-head latent attention (DeepSeek-V2/V3, Kimi): kv_lora_rank is set
    weight_bytes: int  # size of the safetensors files (what one copy of the weights needs)

    @classmethod
    def read(cls, target: str | Path) -> "TargetConfig":
        target = Path(target)
        config = read_config(target)
        get = text_settings(config).get

        missing = [k for k in ("num_hidden_layers", "hidden_size", "vocab_size") if not isinstance(get(k), int)]
        if missing:
            raise BadInput(f"target {target}: config.json ({config.get('architectures')}) lacks {missing}, "
                           f"at its top and in text_config")
        dtype = str(get("dtype") or get("torch_dtype") or "").replace("torch.", "")
        return cls(path=str(target), architectures=tuple(config.get("architectures") or ()),
                   num_layers=get("num_hidden_layers"), hidden_size=get("hidden_size"), vocab_size=get("vocab_size"),
                   dtype=dtype, is_mla=is_mla(config),
                   weight_bytes=sum(f.stat().st_size for f in target.glob("*.safetensors")))


def resolve_dtype(cfg: CaptureOptions, target: TargetConfig) -> str:
    """The dtype the target runs in: cfg.dtype, or with "auto" the one its config.json states (BadInput when
    that is none of DTYPES); the capture, the windows plan and regenerate take it alike."""
    dtype = target.dtype if cfg.dtype == "auto" else cfg.dtype
    if dtype not in DTYPES[1:]:
        raise BadInput(f"target {target.path}: dtype {dtype!r} from config.json is not one of {sorted(DTYPES[1:])}; "
                       "set dtype in the capture config")
    return dtype
