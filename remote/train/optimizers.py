"""The trainer's optimiser and its schedule: AdamW, or Muon for the hidden matrices beside AdamW, stepped, saved and
scheduled as one; the learning rate a function of the step alone.

    opt = build_optimizer(cfg, draft, cuda)
    opt.set_lr(lr_factor(step, total, warmup, "linear", min_ratio=0.0))
"""
from __future__ import annotations

import math

import torch

from remote.step import BadInput
from remote.train.config import TrainConfig


def lr_factor(step: int, total: int, warmup: int, schedule: str, min_ratio: float) -> float:
    """The learning rate of optimizer step `step` (from 0) as a share of the peak: a linear warmup
    over `warmup` steps, then down to min_ratio at `total`, along a line or a half cosine."""
    if step < warmup:
        return (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    fall = 1 - frac if schedule == "linear" else 0.5 * (1 + math.cos(math.pi * frac))
    return min_ratio + (1 - min_ratio) * fall


class Optimizers:
    """AdamW alone, or Muon beside it: stepped, zeroed, saved and scheduled as one optimiser.

    The schedule sets each group's lr to its peak (`peak_lr`, kept in the group and so in the
    checkpoint) times the step's factor: the learning rate is a function of the step alone.
    """

    def __init__(self, parts: dict[str, torch.optim.Optimizer]):
        self.parts = parts
        for g in self.param_groups:
            g["peak_lr"] = g["lr"]

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self.parts.values() for g in o.param_groups]

    def set_lr(self, factor: float) -> float:
        """Every group at factor x its peak; returns the first group's lr (what the log shows)."""
        for g in self.param_groups:
            g["lr"] = g["peak_lr"] * factor
        return self.param_groups[0]["lr"]

    def step(self) -> None:
        for o in self.parts.values():
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.parts.values():
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {name: o.state_dict() for name, o in self.parts.items()}

    def load_state_dict(self, state: dict) -> None:
        if set(state) != set(self.parts):
            raise BadInput(f"the checkpoint's optimiser holds {sorted(state)}, this run's {sorted(self.parts)}")
        for name, o in self.parts.items():
            o.load_state_dict(state[name])


def build_optimizer(cfg: TrainConfig, draft: torch.nn.Module, cuda: bool) -> Optimizers:
    """AdamW for every trainable weight, or (optimizer "muon") Muon for the 2-D hidden matrices (fc, attention,
    MLP) and AdamW for norms and lm_head (an output layer: Muon's orthogonalised step suits hidden layers)."""
    named = [(n, p) for n, p in draft.named_parameters() if p.requires_grad]
    muon = [p for n, p in named if cfg.optimizer == "muon" and p.ndim == 2 and not n.startswith("lm_head.")]
    rest = [p for n, p in named if not any(p is q for q in muon)]
    parts = {"adamw": torch.optim.AdamW(rest, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay,
                                        fused=cuda or None)}
    if muon:
        parts["muon"] = torch.optim.Muon(muon, lr=cfg.muon_lr or cfg.lr, momentum=cfg.muon_momentum,
                                         weight_decay=cfg.muon_weight_decay, adjust_lr_fn="match_rms_adamw")
    return Optimizers(parts)
