"""The DFlash objective and proposal rule: a block opened at every row, each drafted slot matched to the target.
DSpark's too (remote/draft/dspark.py): its model's first_slot (0: the anchor's slot drafts) and head_inputs (the
Markov bias of the token before each slot) are all that differ.

    tgt = head.targets(batch, steps)                  # remote.draft.loss.TargetHead: the EAGLE-3 kind's own targets
    obj = BlockObjective(draft, steps=7, decay=0.78)  # draft: remote.draft.dflash.DFlashDraft (its kind imports
                                                      # this module, so no import back), block_size >= steps + 1
    loss, stats = obj(batch, tgt, denom=tgt.counts)   # stats[k] = (CE sum, top-1 hits, count) of slot k + 1
    guesses = block_guesses(draft, batch, steps)      # [T, steps]: the block opened at t + 1, slots 1..steps

What one forward of the draft does at inference is what it trains on. The block opened at packed row
a = t + 1 holds the real token at a (vLLM's bonus token: the target's own last output) in slot 0 and the
mask token in slots 1..B-1, at positions pos[a] .. pos[a] + B - 1; it sees the fused aux states of its
sample's rows before a (vLLM's context: every token the target has verified) and all of itself.

Alignment: the EAGLE-3 kind's, so its targets, counts and chain scoring serve unchanged. Slot k + 1 of
the block opened at t + 1 predicts token t + 2 + k (what TTT step k at row t predicts); its target is
the target's distribution at row t + 1 + k (its softmax over the captured last state there, restricted
to the draft vocabulary), and it counts where StepTargets.valid[k, t] does: the token is a loss token
of t's sample and the target's full-vocabulary top-1 is in the draft vocabulary. Rows with no counted
slot open no block. Slot 0 predicts nothing (vLLM samples slots 1..K only).

loss = sum_k w_k * (sum of soft CE over slot k+1's counted blocks) / denom[k],  w_k = decay**k

Later slots are harder and matter less (a slot's token is accepted only when every earlier one was):
DFlash's exp(-(j - 1) / gamma) is decay = exp(-1 / gamma) (speculators 0.9.0's gamma 4: decay 0.7788).
Soft CE against the target's distribution is forward KL plus a constant of the draft: the same gradient.

Attention is dense whichever backend is named ('flex', the trainer's choice on a GPU, included): it keeps
[heads, A*B, T] scores for A blocks over T context rows (A ~ the loss tokens of the batch); block_guesses
runs its blocks in chunks, the objective all at once. A block-sparse (flex) path is what a GPU run at
thousands of tokens a step needs next.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from remote.draft.loss import HeadSoftCE, PackedBatch, StepTargets, _soft_ce_chunk, loss_chunk_rows, step_weights


def _check_steps(draft: nn.Module, steps: int, attention: str) -> None:
    most = draft.cfg.block_size - draft.first_slot
    if not 1 <= steps <= most:
        raise ValueError(f"{steps} drafted tokens: a {type(draft).__name__} of block_size {draft.cfg.block_size} "
                         f"drafts 1..{most} (the block's length is part of the model)")
    if attention not in ("dense", "flex"):
        raise ValueError(f"attention backend {attention!r}: choose 'dense' or 'flex'")


def blocks_of(tgt: StepTargets, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(anchors [A]: the rows t + 1 whose block has a counted slot, valid [A, steps]: which slots count)."""
    rows = tgt.valid[:steps].any(0).nonzero().squeeze(1)
    return rows + 1, tgt.valid[:steps, rows].T


def block_inputs(draft: nn.Module, b: PackedBatch, anchors: torch.Tensor):
    """(block ids [A, B], block positions [A, B], context mask [A, T]) of the blocks opened at anchors."""
    bs, t = draft.cfg.block_size, len(b.input_ids)
    ids = draft.block_ids(b.input_ids[anchors])
    pos = b.positions[anchors][:, None] + torch.arange(bs, device=anchors.device)[None, :]
    before = torch.arange(t, device=anchors.device)[None, :] < anchors[:, None]
    return ids, pos, before & (b.doc_ids[None, :] == b.doc_ids[anchors][:, None])


class BlockObjective(nn.Module):
    """The DFlash draft over its blocks, with its loss (the module DDP wraps)."""

    def __init__(self, draft: nn.Module, steps: int = 7, decay: float = 1.0, attention: str = "dense",
                 compiled: bool = False, chunk: int = 0):
        super().__init__()
        _check_steps(draft, steps, attention)
        self.draft, self.steps, self.decay = draft, steps, decay
        self.chunk = chunk or loss_chunk_rows(draft.lm_head.weight.shape[0], compiled)
        self._chunk_fn = torch.compile(_soft_ce_chunk, dynamic=True) if compiled else _soft_ce_chunk

    def forward(self, b: PackedBatch, tgt: StepTargets, denom: torch.Tensor):
        """Returns (loss, stats) with stats[k] = (sum of CE, top-1 agreements, counted blocks) of slot k + 1."""
        d, bs, first = self.draft, self.draft.cfg.block_size, self.draft.first_slot
        dev = b.input_ids.device
        anchors, valid = blocks_of(tgt, self.steps)
        ids, pos, ctx_mask = block_inputs(d, b, anchors)
        normed = d(ids, pos, d.context(b.aux), b.positions, ctx_mask)  # [A*B, H]
        loss = torch.zeros((), dtype=torch.float32, device=dev)
        stats = []
        for k, w_k in enumerate(step_weights(self.steps, self.decay)):
            blocks = valid[:, k].nonzero().squeeze(1)
            w = torch.full((len(blocks),), w_k, device=dev) / denom[k].clamp(min=1.0)
            trows = anchors[blocks] + k  # the target's row of the predicted token, and the token before it
            h, weight, rows = d.head_inputs(normed, blocks * bs + k + first, b.input_ids[trows])
            lk, ce, correct = HeadSoftCE.apply(h, weight, tgt.logits, rows, trows, w, self.chunk, self._chunk_fn)
            loss = loss + lk
            stats.append(torch.stack([ce, correct, tgt.counts[k]]))
        return loss, torch.stack(stats)


@torch.no_grad()
def block_guesses(draft: nn.Module, b: PackedBatch, steps: int, attention: str = "dense",
                  chunk: int = 256) -> torch.Tensor:
    """[T, steps] draft ids: row t holds the drafted slots (1..steps for DFlash, 0..steps-1 for DSpark: the
    model's first_slot on) of the block opened at t + 1, the guesses for tokens t+2..t+1+steps, as
    remote.evaluate.chains scores them; the last row, which opens no block, holds 0.

    A head that reads the token before each slot's (DSpark's Markov bias) is given the real one: where every
    earlier guess of the block was right, the only guesses the chain scorer counts, that is the guess itself,
    so this scores what vLLM's left-to-right sampling would draft."""
    _check_steps(draft, steps, attention)
    t, bs, dev = len(b.input_ids), draft.cfg.block_size, b.input_ids.device
    out = torch.zeros(t, steps, dtype=torch.long, device=dev)
    ctx = draft.context(b.aux)
    offsets = torch.arange(steps, device=dev)[None, :]
    for a in range(1, t, chunk):
        anchors = torch.arange(a, min(a + chunk, t), device=dev)
        ids, pos, mask = block_inputs(draft, b, anchors)
        normed = draft(ids, pos, ctx, b.positions, mask)
        slots = torch.arange(len(anchors), device=dev)[:, None] * bs + draft.first_slot + offsets
        prev = b.input_ids[(anchors[:, None] + offsets).clamp(max=t - 1)]
        h, weight, rows = draft.head_inputs(normed, slots.reshape(-1), prev.reshape(-1))
        out[anchors - 1] = F.linear(h[rows], weight).view(len(anchors), steps, -1).argmax(-1)
    return out
