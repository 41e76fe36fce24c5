"""The DFlash objective and proposal rule: a block opened at every row, each drafted slot matched to the target.

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
from torch import nn

from remote.draft.loss import HeadSoftCE, PackedBatch, StepTargets, _soft_ce_chunk, loss_chunk_rows, step_weights


def _check_steps(draft: nn.Module, steps: int, attention: str) -> None:
    if not 1 <= steps <= draft.cfg.block_size - 1:
        raise ValueError(f"{steps} drafted tokens: a DFlash draft of block_size {draft.cfg.block_size} drafts "
                         f"1..{draft.cfg.block_size - 1} (the block's length is part of the model)")
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
        d, bs = self.draft, self.draft.cfg.block_size
        dev = b.input_ids.device
        anchors, valid = blocks_of(tgt, self.steps)
        ids, pos, ctx_mask = block_inputs(d, b, anchors)
        normed = d(ids, pos, d.context(b.aux), b.positions, ctx_mask)  # [A*B, H]
        loss = torch.zeros((), dtype=torch.float32, device=dev)
        stats = []
        for k, w_k in enumerate(step_weights(self.steps, self.decay)):
            blocks = valid[:, k].nonzero().squeeze(1)
            w = torch.full((len(blocks),), w_k, device=dev) / denom[k].clamp(min=1.0)
            lk, ce, correct = HeadSoftCE.apply(normed, d.lm_head.weight, tgt.logits, blocks * bs + k + 1,
                                               anchors[blocks] + k, w, self.chunk, self._chunk_fn)
            loss = loss + lk
            stats.append(torch.stack([ce, correct, tgt.counts[k]]))
        return loss, torch.stack(stats)


@torch.no_grad()
def block_guesses(draft: nn.Module, b: PackedBatch, steps: int, attention: str = "dense",
                  chunk: int = 256) -> torch.Tensor:
    """[T, steps] draft ids: row t holds slots 1..steps of the block opened at t + 1 (the guesses for tokens
    t+2..t+1+steps, as remote.evaluate.chains scores them); the last row, which opens no block, holds 0."""
    _check_steps(draft, steps, attention)
    t, bs = len(b.input_ids), draft.cfg.block_size
    out = torch.zeros(t, steps, dtype=torch.long, device=b.input_ids.device)
    ctx = draft.context(b.aux)
    for a in range(1, t, chunk):
        anchors = torch.arange(a, min(a + chunk, t), device=b.input_ids.device)
        ids, pos, mask = block_inputs(draft, b, anchors)
        normed = draft(ids, pos, ctx, b.positions, mask).view(len(anchors), bs, -1)[:, 1:steps + 1]
        out[anchors - 1] = draft.lm_head(normed).argmax(-1)
    return out
