"""Training data from a capture: an index of the train samples, packing plans, packed batches.

    index = CaptureIndex.build(CaptureSet.from_manifest(capture_dir), split="train")
    held = CaptureIndex.build(capture, split="heldout", part="validation")  # held.part: "validation" or "heldout"
    plan = pack(index.lengths, 8192, epoch_order(len(index.refs), seed=0, epoch=0))  # [[sample indices], ...]
    plans, total_steps = plan_steps(index.lengths, train_options, micro=8, epochs=epochs_for(train_options, tokens))
    batch = index.load(plan[i], token_budget=8192)                   # a remote.draft.loss.PackedBatch
    index.set_in_draft(flags)        # per-sample [length] bool, precomputed once (remote.train.train)

The index reads only shard headers and `cu_seqlens`; a batch reads its samples' rows through
safetensors slices, so a capture larger than memory trains without loading whole shards. States
stored as fp8 come back dequantized to the capture dtype; a set of shards that mixes storage dtypes
is refused by name. (remote.capture.store owns the format; this reads it through read_rows.)
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass

import torch
from safetensors import safe_open

from remote.capture.store import SHARD_KEYS, CaptureSet, read_rows
from remote.draft.loss import PackedBatch, flag_rows
from remote.split import in_part
from remote.step import BadInput, log


@dataclass(frozen=True)
class SampleRef:
    shard: str
    start: int  # first row in the shard
    length: int
    sample_id: str


class CaptureIndex:
    def __init__(self, refs: list[SampleRef], hidden_size: int, n_aux: int, dtype: torch.dtype = torch.float32,
                 part: str = "train"):
        self.refs, self.hidden_size, self.n_aux = refs, hidden_size, n_aux
        self.dtype = dtype  # the capture's: fp8 states are dequantized to it
        self.in_draft: list[torch.Tensor] | None = None
        self.part = part  # what build read: a split, or a held-out half (remote.split)

    def set_in_draft(self, flags: list[torch.Tensor]) -> None:
        """Per sample, whether the target's top-1 at each row is in the draft vocabulary; batches carry it."""
        bad = [r.sample_id for r, f in zip(self.refs, flags) if len(f) != r.length]
        if len(flags) != len(self.refs) or bad:
            raise ValueError(f"in-draft flags do not match the samples ({len(flags)} for {len(self.refs)}; {bad[:3]})")
        self.in_draft = [f.bool().cpu() for f in flags]

    def last_states(self, sample_idxs: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The captured final states of these samples, whole, each with the rows whose top-1 flag is ever read
        (remote.draft.loss.flag_rows): what TargetHead.in_draft needs to read."""
        return [(r["last_hidden_state"], flag_rows(r["loss_mask"]))
                for r in self._read(sample_idxs, ("last_hidden_state", "loss_mask"))]

    def _read(self, sample_idxs: list[int], keys: tuple[str, ...], limit: int | None = None) -> list[dict]:
        """These samples' rows of `keys` (each cut to `limit`), one shard opened once, in the order asked."""
        by_shard: dict[str, list[int]] = {}
        for pos, i in enumerate(sample_idxs):
            by_shard.setdefault(self.refs[i].shard, []).append(pos)
        rows: list[dict] = [{} for _ in sample_idxs]
        for shard, positions in by_shard.items():
            with safe_open(shard, framework="pt") as f:
                for pos in positions:
                    r = self.refs[sample_idxs[pos]]
                    n = r.length if limit is None else min(r.length, limit)
                    rows[pos] = read_rows(f, keys, r.start, r.start + n, self.dtype)
        return rows

    @property
    def lengths(self) -> list[int]:
        return [r.length for r in self.refs]

    @classmethod
    def build(cls, capture: CaptureSet, split: str = "train", part: str | None = None) -> "CaptureIndex":
        """The samples of `split`; of a held-out one, only the half `part` names (remote.split.in_part: all of
        them when that half is empty). `index.part` says which: the part, or the split."""
        refs = []
        for shard in capture.shards:
            with safe_open(shard, framework="pt") as f:
                meta = f.metadata() or {}
                missing = [k for k in SHARD_KEYS if k not in f.keys()]
                if missing or "sample_ids" not in meta:
                    raise BadInput(f"{shard}: not an eaglet capture shard (missing {missing or ['sample_ids']})")
                capture.check_storage(shard, f)
                cu = f.get_tensor("cu_seqlens").tolist()
            ids, splits = json.loads(meta["sample_ids"]), json.loads(meta["splits"])
            for i, (sid, sp) in enumerate(zip(ids, splits)):
                if sp == split and (capture.sample_ids is None or sid in capture.sample_ids):
                    refs.append(SampleRef(shard, cu[i], cu[i + 1] - cu[i], sid))
        if not refs:
            raise BadInput(f"the capture has no {split!r} samples (shards: {list(capture.shards)})")
        if part is not None:
            keep, part = in_part([r.sample_id for r in refs], part)
            refs = [refs[i] for i in keep]
        return cls(refs, capture.hidden_size, len(capture.layer_ids), getattr(torch, capture.dtype), part or split)

    def load(self, sample_idxs: list[int], token_budget: int, pad_multiple: int = 1, pin: bool = False) -> PackedBatch:
        """Pack these samples (each cut to the budget) into one batch, padded to pad_multiple rows; `pin`: in
        page-locked memory (what a copy to a GPU wants), written there once rather than copied again."""
        keys = ("input_ids", "loss_mask", "hidden_states", "last_hidden_state")
        rows = self._read(sample_idxs, keys, token_budget)
        for i, row in zip(sample_idxs, rows):
            _check(row, self.refs[i], self.n_aux * self.hidden_size, self.hidden_size)
        lengths = [len(row["input_ids"]) for row in rows]
        t = sum(lengths)
        n = t + (-t) % pad_multiple  # padding rows: their own sample id, no loss; only so compiled kernels see few shapes
        # the states (nearly all the bytes) page-locked where they are packed; the rest changes dtype first
        out = {k: _packed([row[k] for row in rows], n, pin and k in ("hidden_states", "last_hidden_state")) for k in keys}
        doc = torch.full((n,), len(lengths), dtype=torch.long)
        doc[:t] = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        positions = torch.arange(n)
        positions[:t] = torch.cat([torch.arange(m) for m in lengths])
        positions[t:] -= t
        small = {"input_ids": out["input_ids"].long(), "loss_mask": out["loss_mask"].bool(), "positions": positions,
                 "doc_ids": doc}
        if self.in_draft is not None:
            small["in_draft"] = _packed([self.in_draft[i][:m] for i, m in zip(sample_idxs, lengths)], n, False)
        if pin:
            small = {k: v.pin_memory() for k, v in small.items()}
        return PackedBatch(aux=out["hidden_states"], last=out["last_hidden_state"], n_tokens=t, **small)


def _packed(parts: list[torch.Tensor], n: int, pin: bool) -> torch.Tensor:
    """The parts one after the other in one tensor of n rows (the rows past them zero), page-locked if `pin`."""
    t = sum(len(x) for x in parts)
    out = torch.empty((n, *parts[0].shape[1:]), dtype=parts[0].dtype, pin_memory=pin)
    torch.cat(parts, out=out[:t])
    out[t:] = 0
    return out


def _check(t: dict[str, torch.Tensor], r: SampleRef, aux_width: int, hidden: int) -> None:
    """Capture -> train hand-off: shapes and finite values, naming the sample that is wrong."""
    n = len(t["input_ids"])
    where = f"sample {r.sample_id!r} of {r.shard}"
    if t["hidden_states"].shape != (n, aux_width) or t["last_hidden_state"].shape != (n, hidden):
        raise BadInput(f"{where}: hidden states {tuple(t['hidden_states'].shape)} / {tuple(t['last_hidden_state'].shape)}, "
                       f"expected ({n}, {aux_width}) / ({n}, {hidden})")
    for k in ("hidden_states", "last_hidden_state"):
        # A sum is finite when every value is (and ~40x cheaper than isfinite on bf16: the reader's main cost
        # was this check); only a sum too large for its dtype is finite values that fail it, so the exact check decides.
        if not torch.isfinite(t[k].sum()) and not torch.isfinite(t[k]).all():
            raise BadInput(f"{where}: {k} holds NaN or Inf")


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """The train samples' order in an epoch: the only randomness of the data, so the same (seed,
    epoch) gives the same plan on every rank and after every resume."""
    order = list(range(n))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


def pack(lengths: list[int], token_budget: int, order: list[int], max_tokens: int = 0) -> list[list[int]]:
    """Pack the samples greedily, in this order, into batches of at most token_budget tokens.

    A sample longer than the budget gets a batch to itself (cut). With max_tokens, packing stops
    before the sample that would pass it, once a batch is whole (the held-out evaluation's cap).
    The one packer of training (epoch_order) and the offline evaluation (samples by id).
    """
    batches, cur, used, total = [], [], 0, 0
    for i in order:
        n = min(lengths[i], token_budget)
        if max_tokens and total + n > max_tokens and batches:
            break
        if cur and used + n > token_budget:
            batches.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
        total += n
    if cur:
        batches.append(cur)
    return batches


def epochs_for(cfg, data_tokens: float) -> float:
    """Passes over the train split a TrainOptions budget asks for, given the split's tokens (each sample cut to
    token_budget, every host's): epochs, or train_tokens' worth, or auto_train_tokens' worth within 1 to 10;
    with max_steps the plan is cut by steps instead."""
    if cfg.max_steps or (cfg.epochs and not cfg.train_tokens):
        return cfg.epochs or 1.0
    if cfg.train_tokens:
        return cfg.train_tokens / data_tokens
    epochs = min(10.0, max(1.0, cfg.auto_train_tokens / data_tokens))
    log(f"train: {epochs:.2f} epochs of {data_tokens:.0f} train tokens (about auto_train_tokens={cfg.auto_train_tokens})")
    return epochs


def plan_steps(lengths: list[int], cfg, micro: int, epochs: float,
               fewest=lambda steps: steps) -> tuple[list[list[list[int]]], int]:
    """(per epoch the packing plan cut to whole optimizer steps of `micro` micro-batches, the steps to train):
    the training's one plan, a function of the samples' lengths and the TrainOptions (seed, token_budget,
    max_steps). `fewest` makes an epoch's steps those of the host with the fewest (several hosts)."""
    plans, steps = [], 0
    for e in range(math.ceil(epochs) if not cfg.max_steps else 10 ** 9):
        plan = pack(lengths, cfg.token_budget, epoch_order(len(lengths), cfg.seed, e))
        n = fewest(len(plan) // micro)
        if n == 0:
            raise BadInput(f"{len(plan)} micro-batches of {cfg.token_budget} tokens (on the host with the fewest) "
                           f"are fewer than one optimizer step needs ({micro} = {micro // cfg.grad_accum} processes "
                           f"x grad_accum {cfg.grad_accum})")
        plans.append(plan[: n * micro])
        steps += n
        if cfg.max_steps and steps >= cfg.max_steps:
            break
    return plans, cfg.max_steps or max(1, round(steps * epochs / math.ceil(epochs)))
