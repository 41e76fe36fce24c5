"""torch.optim.Muon with its step done for all of a group's matrices in one function, compiled on a GPU.

    opt = StackedMuon(matrices, lr=1e-3, momentum=0.95, weight_decay=0.0, adjust_lr_fn="match_rms_adamw",
                      compiled=True)

torch.optim.Muon steps each matrix in Python: ~25 kernels a matrix (momentum, Newton-Schulz's five rounds of
three matmuls, the update), each launched from eager code. A draft's step is bound by its host, not its GPU
(an H200 profile of the 10-minute recipe: 15 ms of GPU work in a 52-ms step, Muon's step 6.5 ms of host time
for eight matrices: bench/results/profile-h200-ten-minutes-20261204c-A.txt). Here the same arithmetic runs
as one function over every matrix of the group, which torch.compile turns into one graph (the matmuls stay
cuBLAS calls, the element-wise work is fused, the launches come from generated code); the learning rate is a
device tensor, so a new value each step is not a new graph.

Same state (a momentum_buffer per matrix) and state_dict as torch.optim.Muon: a checkpoint of either loads into
the other. The arithmetic is torch.optim.Muon's (its Newton-Schulz in bf16, its lr adjustment); the update is
added in the parameter's dtype times lr, where torch's adds it with lr as alpha (equal up to rounding).
"""
from __future__ import annotations

import torch
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz


def muon_update(params: list[torch.Tensor], grads: list[torch.Tensor], bufs: list[torch.Tensor],
                lr: torch.Tensor, scales: list[float], *, weight_decay: float, momentum: float, nesterov: bool,
                ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float) -> None:
    """One Muon step of every matrix, in place: momentum into bufs, the orthogonalised update into params.

    lr: a 0-d tensor on the params' device; scales[i]: matrix i's lr adjustment (its shape's)."""
    for p, g, buf, scale in zip(params, grads, bufs, scales):
        buf.lerp_(g, 1 - momentum)
        u = g.lerp(buf, momentum) if nesterov else buf
        u = _zeropower_via_newtonschulz(u, ns_coefficients, ns_steps, eps)
        p.mul_(1 - lr * weight_decay)
        p.sub_(u.to(p.dtype) * (lr * scale))


class StackedMuon(torch.optim.Muon):
    """torch.optim.Muon (same options, state and checkpoints) whose step is muon_update, compiled when asked."""

    def __init__(self, params, *, compiled: bool = False, **kw):
        super().__init__(params, **kw)
        self._update = torch.compile(muon_update) if compiled else muon_update
        self._lr: dict[torch.device, torch.Tensor] = {}

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("StackedMuon.step takes no closure")
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:
                if p.grad.ndim != 2 or torch.is_complex(p):
                    raise ValueError(f"Muon steps real 2-D matrices; got a {p.dtype} of shape {tuple(p.shape)}")
                if "momentum_buffer" not in self.state[p]:
                    self.state[p]["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            dev = params[0].device
            lr = self._lr.setdefault(dev, torch.zeros((), dtype=torch.float32, device=dev))
            lr.fill_(group["lr"])
            self._update(params, [p.grad for p in params], [self.state[p]["momentum_buffer"] for p in params], lr,
                         [_adjust_lr(1.0, group["adjust_lr_fn"], p.shape) for p in params],
                         weight_decay=group["weight_decay"], momentum=group["momentum"], nesterov=group["nesterov"],
                         ns_coefficients=group["ns_coefficients"], ns_steps=group["ns_steps"], eps=group["eps"])
