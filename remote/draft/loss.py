"""The training-time-test objective of an EAGLE-3 draft.

    head = TargetHead.from_weights(norm_w, lm_head_w, t2d, eps)     # frozen target pieces
    tgt = head.targets(batch, ttt_steps)                            # no grad: soft targets, valid masks
    obj = TTTObjective(draft, cfg.ttt_steps, cfg.step_decay)        # the train options' (TrainOptions)
    loss, stats = obj(batch, tgt, denom=tgt.counts)                 # denom: valid positions per step
    for k, normed in unroll(draft, batch, steps, attn): ...          # the unroll both of them use

One unroll and one alignment rule, here, for the training objective, the logged loss and the
offline evaluation (remote.draft.eagle3.Eagle3.guesses). Alignment (vLLM's proposer, which tests/test_export_options.py
checks against eaglet's forward):
the draft at packed position t of step k reads token t+1+k with rotary position pos[t]+k and
predicts token t+2+k, whose target distribution is the target's softmax at t+1+k (its lm_head
over its final norm of the captured last state), restricted to the draft vocabulary. Step k at t
is known when token t+2+k is in the same sample and loss-masked (the assistant wrote it); it
counts in the loss when, besides, the target's full-vocabulary top-1 at t+1+k is inside the
draft vocabulary (the evaluation scores such a step as a miss: the draft cannot guess it).

loss = sum_k w_k * (sum of soft CE over step k's counted positions) / denom[k],  w_k = decay**k

Soft CE against the target's distribution p is forward KL(p || q) plus p's entropy, a constant of
the draft: the same gradient, so the one loss serves both names (the logged value is the CE).

With denom the count over the whole global batch (every rank, every accumulated micro-batch), the
gradient is the same whether the batch is split over processes or not (the trainer multiplies by
the world size to undo DDP's averaging).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from remote.draft.model import EagleDraft, TTTAttention


@dataclass
class PackedBatch:
    """Samples packed back to back (no padding compute); what the draft trains on."""

    input_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] bool
    aux: torch.Tensor  # [T, n_aux*H] captured aux hidden states
    last: torch.Tensor  # [T, H] captured final (pre-norm) state
    positions: torch.Tensor  # [T] int64, position inside its sample
    doc_ids: torch.Tensor  # [T] int64, which sample (padding rows get their own id)
    n_tokens: int = 0  # rows that are real tokens (the rest is padding at the end)
    in_draft: torch.Tensor | None = None  # [T] bool, precomputed TargetHead.in_draft (None: computed per step)

    def to(self, device, dtype=None) -> "PackedBatch":
        f = self._map(lambda v: v.to(device, non_blocking=True))
        if dtype is not None:
            f["aux"], f["last"] = f["aux"].to(dtype), f["last"].to(dtype)
        return PackedBatch(**f, n_tokens=self.n_tokens)

    def _map(self, fn) -> dict:
        """fn of each tensor field that is set (n_tokens and unset ones left out)."""
        return {k: fn(v) for k in self.__dataclass_fields__ if k != "n_tokens" and (v := getattr(self, k)) is not None}


@dataclass
class StepTargets:
    logits: torch.Tensor  # [T, Vd] target logits over the draft vocabulary (compute dtype)
    valid: torch.Tensor  # [K, T] bool: position t of step k counts in the loss (known, top-1 in the draft vocabulary)
    counts: torch.Tensor  # [K] float32: valid positions per step in this batch
    in_draft: torch.Tensor | None = None  # [T] bool: the target's full-vocabulary top-1 at t is in the draft vocabulary
    known: torch.Tensor | None = None  # [K, T] bool: token t+2+k is in t's sample and loss-masked


def read_rows(t: int, k: int, device) -> torch.Tensor:
    """[T] the row whose token step k reads at each position (t+1+k; the target's distribution there
    is the one to match), clamped inside the batch (rows past the end are never known)."""
    return (torch.arange(t, device=device) + 1 + k).clamp(max=t - 1)


def flag_rows(loss_mask: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """[T] bool, of one sample (or of a packed batch, given its doc_ids): the rows whose in-draft flag a loss or an
    evaluation ever reads. Row r's target distribution is the one for token r + 1 (read_rows), and a step counts
    it only where that token is a loss token of the same sample (StepTargets.known): no other row's flag is read."""
    rows = torch.zeros(len(loss_mask), dtype=torch.bool, device=loss_mask.device)
    rows[:-1] = loss_mask[1:].bool()
    if doc_ids is not None:
        rows[:-1] &= doc_ids[1:] == doc_ids[:-1]
    return rows


def step_weights(ttt_steps: int, decay: float) -> list[float]:
    """The loss weight of each TTT step (decay**k), for the objective and the logged loss alike."""
    return [decay ** k for k in range(ttt_steps)]


def unroll(draft: EagleDraft, b: PackedBatch, steps: int, attn: TTTAttention):
    """Yield (k, normed state [T, H]) of each TTT step: step k reads the tokens at read_rows(k) and
    the previous step's own output state (step 0: fc of the captured aux states)."""
    t = len(b.input_ids)
    hidden = draft.fc(b.aux)
    for k in range(steps):
        prenorm, normed = draft.step(draft.embed(b.input_ids[read_rows(t, k, b.input_ids.device)]), hidden,
                                     b.positions + k, attn)
        yield k, normed
        hidden = prenorm


class TargetHead:
    """The frozen target pieces the loss needs: final norm and lm_head rows (draft ones, the rest)."""

    def __init__(self, norm_weight: torch.Tensor, draft_rows: torch.Tensor, other_rows: torch.Tensor | None,
                 eps: float, chunk: int = 4096):
        self.norm_weight, self.draft_rows, self.other_rows, self.eps, self.chunk = norm_weight, draft_rows, other_rows, eps, chunk

    @classmethod
    def from_weights(cls, norm_weight, lm_head, t2d: torch.Tensor, eps: float, drop_outside_top1: bool = True, **kw):
        """lm_head [V, H] of the target; t2d [V] bool. Without drop_outside_top1 the other rows are not kept."""
        rows = t2d.nonzero().squeeze(1)
        other = lm_head[~t2d].contiguous() if drop_outside_top1 and bool((~t2d).any()) else None
        return cls(norm_weight, lm_head[rows].contiguous(), other, eps, **kw)

    def to(self, device, dtype) -> "TargetHead":
        mv = lambda x: None if x is None else x.to(device, dtype)  # noqa: E731
        return TargetHead(self.norm_weight.to(device, dtype), mv(self.draft_rows), mv(self.other_rows), self.eps, self.chunk)

    def _normed(self, last: torch.Tensor) -> torch.Tensor:
        x = last.float()
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)).to(last.dtype) * self.norm_weight

    @torch.no_grad()
    def in_draft(self, last: torch.Tensor, draft_logits: torch.Tensor | None = None) -> torch.Tensor:
        """[T] bool: the target's full-vocabulary top-1 at each row is a draft-vocabulary token.

        The costly part of the targets (2*H*(V - Vd) a row, forward only) and the same in every
        epoch: the trainer computes it once per sample before training (PackedBatch.in_draft).
        """
        flags = torch.ones(len(last), dtype=torch.bool, device=last.device)
        if self.other_rows is None:
            return flags
        normed = self._normed(last)
        for a in range(0, len(last), self.chunk):  # chunked: [T, V - Vd] would not fit at 128k vocab
            n = normed[a:a + self.chunk]
            best = (n @ self.draft_rows.T if draft_logits is None else draft_logits[a:a + self.chunk]).max(-1).values
            flags[a:a + self.chunk] = best >= (n @ self.other_rows.T).max(-1).values
        return flags

    @torch.no_grad()
    def targets(self, b: PackedBatch, ttt_steps: int) -> StepTargets:
        logits = self._normed(b.last) @ self.draft_rows.T
        t = len(b.last)
        if b.in_draft is not None:
            in_draft = b.in_draft
        else:  # checked where a step reads it (flag_rows); no step reads the other rows' flags, left True
            in_draft = torch.ones(t, dtype=torch.bool, device=b.last.device)
            if self.other_rows is not None:
                read = flag_rows(b.loss_mask, b.doc_ids)
                in_draft[read] = self.in_draft(b.last[read], logits[read])
        idx = torch.arange(t, device=b.last.device)
        known = []
        for k in range(ttt_steps):
            j = (idx + 2 + k).clamp(max=t - 1)  # the predicted token
            known.append((idx + 2 + k < t) & (b.doc_ids[j] == b.doc_ids) & b.loss_mask[j])
        known = torch.stack(known)
        valid = torch.stack([known[k] & in_draft[read_rows(t, k, b.last.device)] for k in range(ttt_steps)])
        return StepTargets(logits, valid, valid.sum(1).float(), in_draft, known)


# ----------------------------------------------------------------------------- fused head + soft CE
def _soft_ce_chunk(logits: torch.Tensor, target_logits: torch.Tensor, w: torch.Tensor):
    """Per-row weighted soft CE, its gradient w.r.t. logits, and top-1 agreement."""
    logits, tl = logits.float(), target_logits.float()
    logp = torch.log_softmax(logits, -1)
    pt = torch.softmax(tl, -1)
    ce = -(pt * logp).sum(-1)
    grad = (logp.exp() - pt) * w[:, None]
    agree = logits.argmax(-1) == tl.argmax(-1)
    return (ce * w).sum(), ce.detach(), grad, agree


class HeadSoftCE(torch.autograd.Function):
    """sum_r w_r * CE(softmax(target_r), softmax(h_r @ W^T)) without keeping [rows, V] logits.

    The gradients are computed chunk by chunk in the forward (they need the same softmax) and
    only scaled in the backward: no logits are stored, and no matmul is done twice.
    """

    @staticmethod
    def forward(ctx, h, weight, target_logits, rows, trows, w, chunk, chunk_fn):
        dt = h.dtype
        wc = weight.to(dt)
        hr = h[rows]
        grad_hr = torch.empty_like(hr)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device) if weight.requires_grad else None
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        ce_sum = torch.zeros((), dtype=torch.float32, device=h.device)
        correct = torch.zeros((), dtype=torch.float32, device=h.device)
        for a in range(0, len(rows), chunk):
            hc = hr[a:a + chunk]
            l, ce, g, agree = chunk_fn(hc @ wc.T, target_logits[trows[a:a + chunk]], w[a:a + chunk])
            loss += l
            ce_sum += ce.sum()
            correct += agree.sum()
            g = g.to(dt)
            grad_hr[a:a + chunk] = g @ wc
            if grad_w is not None:
                grad_w += (g.T @ hc).float()
        grad_h = torch.zeros_like(h).index_copy_(0, rows, grad_hr)
        ctx.save_for_backward(grad_h, grad_w if grad_w is not None else torch.empty(0))
        ctx.has_w = grad_w is not None
        ctx.mark_non_differentiable(ce_sum, correct)
        return loss, ce_sum, correct

    @staticmethod
    def backward(ctx, go, _ce, _correct):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * go.to(grad_h.dtype), (grad_w * go) if ctx.has_w else None, None, None, None, None, None, None


def loss_chunk_rows(vocab: int, compiled: bool) -> int:
    """Rows of one chunk of the fused head and loss: [rows, vocab] float32 logits of at most 1 GiB compiled
    (Inductor fuses the two softmaxes and the gradient: a few such buffers live at once), 256 MiB eager (some
    six live). Fewer chunks, fewer launches: on an H200 (SmolLM2 draft, 32,000-token vocabulary, 8,192 tokens a
    step) the three HeadSoftCE calls of a step, at 2,048 rows a chunk, took 8.2 ms of the host's ~39 ms a step
    (bench/results/profile-h200-ten-minutes-20261204c-A.txt); at this size they take one chunk each."""
    return max(256, (1 << (28 if compiled else 26)) // vocab)


class TTTObjective(nn.Module):
    """The draft unrolled over TTT steps, with its loss: the module DDP wraps."""

    def __init__(self, draft: EagleDraft, ttt_steps: int, decay: float, attention: str = "dense",
                 compiled: bool = False, chunk: int = 0):
        """ttt_steps and decay have no defaults here: they are TrainOptions' (ttt_steps, step_decay), stated once."""
        super().__init__()
        if ttt_steps < 1:
            raise ValueError(f"ttt_steps={ttt_steps}: need at least 1")
        self.draft, self.ttt_steps, self.decay, self.attention, self.compiled = draft, ttt_steps, decay, attention, compiled
        self.chunk = chunk or loss_chunk_rows(draft.lm_head.weight.shape[0], compiled)  # rows a chunk of the loss
        self._chunk_fn = torch.compile(_soft_ce_chunk, dynamic=True) if compiled else _soft_ce_chunk

    def forward(self, b: PackedBatch, tgt: StepTargets, denom: torch.Tensor):
        """Returns (loss, stats) with stats[k] = (sum of CE, top-1 agreements, counted positions)."""
        dev = b.input_ids.device
        attn = TTTAttention(b.doc_ids, self.attention, self.compiled)
        weights = step_weights(self.ttt_steps, self.decay)
        loss = torch.zeros((), dtype=torch.float32, device=dev)
        stats = []
        # Every step's counted rows at once, before the unroll is queued: one wait for the device a micro-batch
        # (a nonzero per step waited for each step's forward, and the host's launches then lagged the device).
        per_step = tgt.valid.sum(1).tolist()
        counted = tgt.valid.nonzero()[:, 1].split(per_step)
        for k, normed in unroll(self.draft, b, self.ttt_steps, attn):
            rows = counted[k]
            scale = weights[k] / denom[k].clamp(min=1.0)
            w = torch.full((len(rows),), 1.0, device=dev) * scale
            lk, ce, correct = HeadSoftCE.apply(normed, self.draft.lm_head.weight, tgt.logits, rows, (rows + 1 + k),
                                               w, self.chunk, self._chunk_fn)
            loss = loss + lk
            stats.append(torch.stack([ce, correct, tgt.counts[k]]))
        return loss, torch.stack(stats)
