"""Train an EAGLE-3 draft on captured hidden states (the training-time-test objective).

    python -m remote.train.train --config c.json
    # {"capture_dir": "/runs/r1/capture", "vocab_dir": "/runs/r1/vocab", "out_dir": "/runs/r1/train",
    #  "nproc_per_node": 8}

With nproc_per_node (or nnodes) above 1 this process re-runs itself under torchrun, one process a
GPU (or that many gloo processes on a CPU); several hosts join through torchrun's c10d rendezvous
(nnodes, node_rank, rdzv_endpoint, local_addr). With several hosts each host trains on the capture
on its own disk (its share of the samples): it plans its own micro-batches and splits them over its
ranks, and every host takes as many optimizer steps as the host with the fewest. The draft is
written on node 0 (node_rank 0); the other hosts publish a manifest of what they trained. The
inputs are checked before the launch, so a bad input still exits 65.

Parallelism is DDP, not FSDP: the trainable draft is ~0.4B (Llama-8B shape) to ~1.2B (Kimi-K2.5)
parameters, whose fp32 weights, grads and AdamW moments (16 B/param, <20 GB) fit every GPU; the
frozen embedding and target head are bf16 copies per GPU. Sharding them would add gathers to every
step and save memory nobody is short of. Each rank reads only its own micro-batches.

The recipe (docs/TRAINING.md): AdamW, or Muon for the hidden weight matrices beside AdamW; a
linear warmup, then a linear or cosine fall to min_lr_ratio over the budget (max_steps, or
train_tokens, or epochs, or by default auto_train_tokens' worth of the data; a deadline, max_seconds, cuts
it to the steps that fit at the pace the run measures, and again if the steps slow down). Every `eval_every`
steps the draft's offline acceptance length on the held-out split is measured with the evaluate
step's own chain count (remote.evaluate.chains.chain_tally, no engine); the best draft is kept
aside (checkpoints/best-N/) and the run stops after `patience` evaluations without a better one.

Writes out_dir/model.safetensors (the best held-out draft's weights, or the last ones when there
was no evaluation; fp32, no embedding), draft_config.json, loss.jsonl (one line an optimizer
step; an evaluation's figures under "heldout") and checkpoints/step-N/ (the last one). Checkpoints
every `checkpoint_every` steps and at the end hold model, optimiser, the data position (the step:
the packing plan is a function of seed and epoch, the learning rate of the step), every rank's RNG
and the config; a killed run started again with the same config continues from the newest one
exactly, and one started with another config (beyond RESUMABLE_CHANGES) is refused by key. A run in
windows (TrainConfig.windows) keeps its target top-1 flags beside its checkpoints too (Top1Flags), so
a sample's top-1 is checked once a run however many windows read it.
"""
from __future__ import annotations

import gc
import json
import math
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import torch

from remote.capture.store import CaptureSet
from remote.draft.data import CaptureIndex, epochs_for, plan_steps
from remote.draft.folder import read_weights
from remote.draft.loss import TargetHead, step_weights
from remote.draft.registry import AUTO, kind_for_target
from remote.draft.vocab import DraftVocab
from remote.engine.devices import check_gpu_count
from remote.evaluate.chains import chain_tally, heldout_plan
from remote.step import BadInput, StepOutput, begin_step, emit, log, progress, step_main, write_json_atomic
from remote.target import read_config
from remote.train.config import TrainConfig
from remote.train.optimizers import build_optimizer, lr_factor
from remote.train.pacing import DeadlinePacing
from remote.train.profiling import GcClock, Profiled, compile_figures
from remote.train.state import (Checkpoints, Distributed, Top1Flags, cpu_bf16_matmuls, load_target_head_weights,
                                save_weights)
from remote.train.window import TrainWindow

STEP = "train"


# Settings a resumed run may change: they decide what is logged and kept, not what is trained.
RESUMABLE_CHANGES = ("checkpoint_every", "keep_checkpoints", "log_every", "profile_steps", "rdzv_endpoint",
                     "local_addr")
# ... and what a run in windows changes from one window to the next (the window's capture, its step folder)
WINDOW_CHANGES = ("window", "capture_dir", "out_dir")


CPU_BF16_MIN_HIDDEN = 256  # precision auto on a CPU: bf16 autocast from this draft hidden size up

# ----------------------------------------------------------------------------- the run
class Trainer(DeadlinePacing):
    """Builds the model, optimizer and data plan from a config; `run()` trains to the end."""

    def __init__(self, cfg: TrainConfig, dist: Distributed, stage: Path):
        self.t0 = time.perf_counter()  # max_seconds counts from here
        self.cfg, self.dist, self.stage = cfg, dist, stage
        self.cuda = dist.device.type == "cuda"
        self.compiled = cfg.compile == "yes" or (cfg.compile == "auto" and self.cuda)
        self.compiled_before = compile_figures() if self.compiled else {}  # the process's own counts are since it began
        # Compiled, every new batch length is a new graph (~30 s each on an H200: a real run of
        # ShareGPT spent its first 5 minutes recompiling); one length, the budget, compiles once and
        # costs only the packing's unfilled tail.
        self.pad = cfg.pad_multiple or (cfg.token_budget if self.compiled else 1)
        inputs = resolve_inputs(cfg)
        self.capture, self.vocab, self.kind, self.dcfg, self.target = inputs
        # bf16 autocast on a GPU; on a CPU that does bf16 in hardware, for drafts wide enough that their matmuls
        # outweigh autocast's casts: measured on an AMX Xeon, the demo's (H 576) step took 0.74x float32's time, the
        # tests' tiny drafts' (H 64) 1.3-2.5x; the line at 256 lies between the two, not measured itself
        hw_bf16 = not self.cuda and cpu_bf16_matmuls()  # /proc/cpuinfo, read once
        cpu_bf16 = hw_bf16 and self.dcfg.hidden_size >= CPU_BF16_MIN_HIDDEN
        self.amp = cfg.precision == "bf16" or (cfg.precision == "auto" and (self.cuda or cpu_bf16))
        self.dtype = torch.bfloat16 if self.amp else torch.float32  # of the states fed to the draft
        if not self.cuda and dist.rank == 0:
            log(f"train: {'bf16 autocast' if self.amp else 'float32'} on the CPU (precision {cfg.precision}; "
                f"bf16 in hardware: {'yes' if hw_bf16 else 'no'}; hidden size {self.dcfg.hidden_size})")
        self.index = CaptureIndex.build(self.capture, split="train")
        if cfg.windows and cfg.max_seconds:
            raise BadInput(f"max_seconds {cfg.max_seconds:g} with windows {cfg.windows}: a run in windows plans its "
                           "captures from its steps, which a deadline would cut; set a token or epoch budget")
        # In windows the plan numbers every train sample (the windows step's list), this capture holds the window's
        self.window = TrainWindow.load(cfg.windows, cfg.window) if cfg.windows else None
        self.lengths = self.window.lengths if self.window else self.index.lengths
        self.local = self.window.positions(self.index, cfg.capture_dir) if self.window else None
        self.heldout = self._heldout_index()
        self.ckpt = Checkpoints(Path(cfg.checkpoint_dir) if cfg.checkpoint_dir else stage / "checkpoints",
                                keep=cfg.keep_checkpoints)
        self._build_model()
        self.micro = dist.local_world * cfg.grad_accum  # micro-batches per optimizer step of this host's ranks
        # per epoch: the packing plan, cut to whole optimizer steps
        self.plans, self.total_steps = plan_steps(self.lengths, cfg, self.micro, self._epochs(), self._fewest)
        if self.window:
            self.window.check(self.total_steps)
        self.end_step = self.window.last_step if self.window else self.total_steps  # where this run stops
        self.planned_steps = self.total_steps  # the plan's total: a deadline's re-check may move the end back up to it
        self.warmup_steps = cfg.warmup_steps or math.ceil(cfg.warmup * self.total_steps)
        self.eval_every = cfg.eval_every or max(1, math.ceil(self.total_steps / 20))
        self.paced: list[float] = []  # with max_seconds, until it is met: when each step of this process began
        self.apart_s = 0.0  # seconds of held-out evaluations and profile writes among the paced steps (from the third)
        self.met = not cfg.max_seconds  # whether the deadline's cut is decided (or there is none)
        self.held: int | None = None  # after the cut: the step of the last check (the cut's, or a resume's first)
        self.told = 0  # the last total the log gave (re-cuts are logged only when they move it by 10% or more)
        self.loop_s: list[float] = []  # after the cut: each step's seconds in the loop since that check, all but
        # evaluations, checkpoints and profile writes
        self.eval_s = 0.0  # the timed held-out evaluation's seconds (with max_seconds)
        self.evaluated = False  # whether this process has evaluated (its first evaluation compiles, on a GPU)
        self.saves = 0  # checkpoints this process has written
        self.saves_s = 0.0  # and their seconds
        self.opt = build_optimizer(cfg, self.draft, self.cuda)
        self.step_weights = torch.tensor(step_weights(cfg.ttt_steps, cfg.step_decay), device=dist.device)
        self.history: list[dict] = []
        self.evals: list[dict] = []  # the records of history with a held-out evaluation (the best is among them)
        self.step = 0
        self.my_tokens = 0  # tokens this rank trained on in this run (a resumed run counts from the resume)
        # The next step's batches are read (and pinned, on a GPU) in a thread while this step trains:
        # reading a big target's states (470 MB a step for Kimi-K2.5 at 8,192 tokens) no longer stalls it.
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="eaglet-read")
        self._next: tuple[int, Future] | None = None

    def _heldout_index(self) -> CaptureIndex | None:
        """This host's validation samples, the held-out half the published checkpoint is chosen on (the evaluate
        step reports on the other; all held-out ones when this half is empty); None: evaluation off, or this
        host's capture holds no held-out sample."""
        if not self.cfg.eval_tokens:
            return None
        try:
            return CaptureIndex.build(self.capture, split="heldout", part="validation")
        except BadInput:  # the train split was read from the same shards: only "no held-out samples" lands here
            return None

    def _epochs(self) -> float:
        """Passes over the train split the budget asks for (max_steps, when set, cuts the plan instead)."""
        mine = sum(min(n, self.cfg.token_budget) for n in self.lengths) if self.dist.local_rank == 0 else 0
        data = float(self.dist.all_reduce(torch.tensor(float(mine), device=self.dist.device)))  # every host's split
        return epochs_for(self.cfg, data)

    def _fewest(self, steps: int) -> int:
        """The optimizer steps of an epoch on the host with the fewest (every host takes as many)."""
        return int(self.dist.all_reduce(torch.tensor(steps, device=self.dist.device), op="min"))

    def _build_model(self):
        cfg, dev = self.cfg, self.dist.device
        embed, lm_head, norm_w = load_target_head_weights(self.target, self.dcfg)
        torch.manual_seed(cfg.seed)  # the same initial draft on every rank (DDP also broadcasts rank 0's)
        draft = self.kind.model(self.dcfg)
        draft.embed_tokens.weight = torch.nn.Parameter(embed.to(self.dtype), requires_grad=False)
        if cfg.init_lm_head_from_target:
            with torch.no_grad():
                draft.lm_head.weight.copy_(lm_head[self.vocab.draft_ids].float())
        if cfg.warm_start:
            self._warm_start(draft)
        draft.lm_head.weight.requires_grad_(cfg.train_lm_head)
        draft.to(dev)
        if self.compiled:
            draft.compile_layers()
        self.draft = draft
        # The full head answers "is the target's top-1 a draft token" once a sample (train samples when
        # the loss drops the others, held-out ones always: the evaluation scores them as misses).
        full = TargetHead.from_weights(norm_w, lm_head, self.vocab.t2d, self.dcfg.rms_norm_eps).to(dev, self.dtype)
        if full.other_rows is not None:
            self._check_top1(full)
        full.other_rows = None  # the steps need only the draft rows
        self.head = full
        self.objective = self.kind.objective(draft, cfg.ttt_steps, cfg.step_decay, self._attention, self.compiled)
        self.model = self.dist.wrap(self.objective)
        self.params = [p for p in draft.parameters() if p.requires_grad]

    @property
    def _attention(self) -> str:
        return "flex" if self.cuda else "dense"

    def _warm_start(self, draft: torch.nn.Module) -> None:
        """Start from an exported draft (the nightly retrain): every weight as it is, but lm_head by token.

        The draft vocabulary may have changed since (new data, new top tokens): lm_head rows of
        target tokens in both vocabularies are carried over, rows of new tokens keep the fresh
        draft's start (the target's rows, with init_lm_head_from_target). Other shapes must match.
        """
        src = self.cfg.warm_start
        w = read_weights(src, f"warm_start {src}")
        own = draft.trainable_state_dict()
        missing = [k for k in own if k not in w]
        bad = [f"{k} {tuple(w[k].shape)} (this draft: {tuple(own[k].shape)})" for k in own
               if k in w and k != "lm_head.weight" and w[k].shape != own[k].shape]
        head = w.get("lm_head.weight")
        if head is not None and head.shape[1:] != own["lm_head.weight"].shape[1:]:
            bad.append(f"lm_head.weight {tuple(head.shape)} (this draft: {tuple(own['lm_head.weight'].shape)})")
        if missing or bad:
            raise BadInput(f"warm_start {src} does not fit this draft (hidden size {self.dcfg.hidden_size}, "
                           f"target {self.target}): " + "; ".join([f"{k} missing" for k in missing[:4]] + bad[:4]) +
                           "; train from scratch (warm_start empty) when the target or the draft's shape changed")
        rows, kept = self._carried_lm_head_rows(w, src)
        new_head = draft.lm_head.weight.detach().clone()  # the fresh draft's rows: the new tokens keep them
        new_head[kept] = head[rows].float()
        draft.load_state_dict({**{k: w[k].float() for k in own}, "lm_head.weight": new_head}, strict=False)
        log(f"train: warm start from {src}: lm_head rows of {len(kept)} of {len(new_head)} draft tokens carried over, "
            f"{len(new_head) - len(kept)} new ones start as in a fresh draft")

    def _carried_lm_head_rows(self, w: dict, src: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows of the warm start's lm_head, the rows of this draft they go to): the tokens both vocabularies hold."""
        n_old = len(w["lm_head.weight"])
        if "d2t" not in w:  # a draft without its vocabulary can only be the same one
            if n_old != len(self.vocab.d2t):
                raise BadInput(f"warm_start {src} has {n_old} draft tokens and no d2t to map them by; "
                               f"this vocabulary ({self.cfg.vocab_dir}) has {len(self.vocab.d2t)}")
            return torch.arange(n_old), torch.arange(n_old)
        if "t2d" in w and len(w["t2d"]) != len(self.vocab.t2d):
            raise BadInput(f"warm_start {src} was trained for a target of {len(w['t2d'])} tokens, this target has "
                           f"{len(self.vocab.t2d)}; train from scratch (warm_start empty)")
        if len(w["d2t"]) != n_old:
            raise BadInput(f"warm_start {src}: d2t has {len(w['d2t'])} entries, lm_head {n_old} rows")
        old_ids = torch.arange(n_old) + w["d2t"].long()  # target id of each old draft row, ascending
        new_ids = self.vocab.draft_ids
        at = torch.searchsorted(old_ids, new_ids).clamp(max=n_old - 1)
        shared = old_ids[at] == new_ids
        return at[shared], shared.nonzero().flatten()

    def _my_batches(self, step: int) -> list[list[int]]:
        """This rank's micro-batches of an optimizer step (data sharded by rank)."""
        for plan in self.plans:
            n = len(plan) // self.micro
            if step < n:
                first = step * self.micro + self.dist.local_rank * self.cfg.grad_accum
                batches = plan[first: first + self.cfg.grad_accum]
                return batches if self.local is None else [self.window.in_capture(b, self.local) for b in batches]
            step -= n
        raise AssertionError("step beyond the data plan")

    def _check_top1(self, head: TargetHead) -> None:
        """The top-1 flags of the samples that need them: train samples when the loss drops the others, held-out
        ones always (the evaluation scores them as misses). In windows, those an earlier window of the run
        checked are read back (Top1Flags: its next epoch captures them again) and this window's kept for later."""
        store = self._top1_store()
        known = store.read() if store else {}
        checked: dict[str, torch.Tensor] = {}
        wanted = [self.index] if self.cfg.drop_outside_top1 else []
        for index in wanted + ([self.heldout] if self.heldout is not None else []):
            t0 = time.perf_counter()
            todo = [i for i, r in enumerate(index.refs) if r.sample_id not in known]
            flags, inside, n = self._precompute_in_draft(head, index, todo)
            checked.update(flags)
            index.set_in_draft([known[r.sample_id] if r.sample_id in known else checked[r.sample_id]
                                for r in index.refs])
            back = f", {len(index.refs) - len(todo)} read back from earlier windows" if store else ""
            log(f"train: target top-1 inside the draft vocabulary at {inside / max(1, n):.2%} of {n} "
                f"{'train' if index is self.index else 'held-out'} positions before a loss token ({len(todo)} "
                f"samples checked in {time.perf_counter() - t0:.1f} s{back})")
        if store and checked and self.dist.local_rank == 0:
            store.write(f"w{self.cfg.window:03d}", checked)

    def _top1_store(self) -> Top1Flags | None:
        """A run in windows keeps its top-1 flags beside its checkpoints, under the config its windows share."""
        if not self.window:
            return None
        c, free = self.capture, RESUMABLE_CHANGES + WINDOW_CHANGES
        return Top1Flags(self.ckpt.root, {"config": {k: v for k, v in asdict(self.cfg).items() if k not in free},
                                          "capture": [c.target, list(c.layer_ids), c.dtype, c.storage_dtype]})

    @torch.no_grad()
    def _precompute_in_draft(self, head: TargetHead, index: CaptureIndex,
                             todo: list[int]) -> tuple[dict[str, torch.Tensor], int, int]:
        """The full-vocabulary top-1 check of the index's samples `todo`, once a sample instead of every epoch's step,
        at the rows whose flag is ever read (flag_rows: those before a loss token; 70% of the demo's rows); the
        others' flags stay False, as no loss or evaluation reads them. Returns the flags by sample id, and how many
        of the rows checked hold a top-1 inside the draft vocabulary, of how many.

        Rank r checks every world-th sample, in batches of token_budget rows; the flags are summed
        over the ranks so every rank holds all of them.
        """
        if not todo:  # every rank alike: the same samples, the same files read back
            return {}, 0, 0
        dev, lengths = self.dist.device, [index.refs[i].length for i in todo]
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        flat = torch.zeros(offsets[-1], dtype=torch.uint8, device=dev)  # 0: not read, 1: outside, 2: inside
        group: list[int] = []
        rows = 0  # in the group
        mine = list(range(self.dist.local_rank, len(todo), self.dist.local_world))
        for j, k in enumerate(mine):
            group.append(k)
            rows += lengths[k]
            if j + 1 < len(mine) and rows + lengths[mine[j + 1]] <= self.cfg.token_budget:
                continue
            lasts, read = zip(*index.last_states([todo[g] for g in group]))
            read = torch.cat(read)
            last = torch.cat(lasts)[read].to(dev, self.dtype)  # only the rows checked go to the device
            read = read.to(dev)
            f = read.to(torch.uint8)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=self.amp):
                f[read] += head.in_draft(last).to(torch.uint8)
            pos = 0
            for g in group:
                flat[offsets[g]:offsets[g + 1]] = f[pos:pos + lengths[g]]
                pos += lengths[g]
            group, rows = [], 0
        flat = self.dist.all_reduce(flat, node=True).cpu()
        flags = flat == 2
        return ({index.refs[i].sample_id: flags[offsets[k]:offsets[k + 1]] for k, i in enumerate(todo)},
                int(flags.sum()), int((flat > 0).sum()))

    @torch.no_grad()
    def evaluate(self) -> dict | None:
        """Offline acceptance on the held-out split (remote.evaluate.evaluate's own chain count), every
        host's samples, split over its ranks and summed; None when no host holds any."""
        cfg, dist = self.cfg, self.dist
        self.evaluated = True
        k = cfg.eval_k or cfg.ttt_steps  # at most ttt_steps (TrainOptions refuses more)
        plan = [] if self.heldout is None else heldout_plan(self.heldout, cfg.token_budget,
                                                            max(1, cfg.eval_tokens // cfg.nnodes))
        batches = (self.heldout.load(p, cfg.token_budget, self.pad).to(dist.device, self.dtype)
                   for p in plan[dist.local_rank::dist.local_world])
        with torch.autocast(dist.device.type, dtype=torch.bfloat16, enabled=self.amp):
            tally = chain_tally(self.draft, self.head, batches, k, k, self._attention, self.compiled)
        tally = tally.all_reduce(dist)
        return tally.summary(k) if tally.tokens else None

    def resume(self) -> None:
        state = self.ckpt.load_latest(self.draft, self.opt, self.dist, self.cfg, RESUMABLE_CHANGES + WINDOW_CHANGES)
        if state is not None:
            self.step, self.history = state["step"], state["history"]
            self.evals = [r for r in self.history if "heldout" in r]
            log(f"train: resumed at step {self.step} from {state['path']}")
            for r in self.history:  # a deadline met before the kill holds on: the same total, the same schedule
                for cut in ("deadline", "recut"):
                    if cut in r:
                        self._cut_to(r[cut]["total_steps"])
        if self.window:
            self.window.check_start(self.step, self.ckpt.root)

    def _read(self, step: int) -> list:
        return [self.index.load(b, self.cfg.token_budget, self.pad, pin=self.cuda) for b in self._my_batches(step)]

    def _host_batches(self) -> list:
        """This step's micro-batches on the host (read ahead by the reader thread), and the next step's asked for."""
        ahead, self._next = self._next, None
        host = ahead[1].result() if ahead and ahead[0] == self.step else self._read(self.step)
        if self.step + 1 < self.end_step:
            self._next = (self.step + 1, self._reader.submit(self._read, self.step + 1))
        return host

    def train_step(self) -> dict:
        cfg, dev = self.cfg, self.dist.device
        t0 = time.perf_counter()
        host = self._host_batches()
        batches = [b.to(dev, self.dtype) for b in host]
        lr = self.opt.set_lr(lr_factor(self.step, self.total_steps, self.warmup_steps, cfg.schedule, cfg.min_lr_ratio))
        stats, gnorm = optimizer_step(self.model, self.head, batches, self.opt, self.params, self.dist,
                                      cfg.ttt_steps, cfg.grad_clip)
        mine = sum(b.n_tokens for b in host)
        self.my_tokens += mine
        tokens = self.dist.all_reduce(torch.tensor([float(mine)], device=dev))
        n = stats[:, 2].clamp(min=1)
        per_step = stats[:, 0] / n
        k = cfg.ttt_steps
        # the record's figures come to the host in one copy: each float() of a device tensor waits for the GPU
        got = torch.cat([(self.step_weights * per_step).sum().reshape(1), stats[:, 1] / n, per_step,
                         gnorm.reshape(1).to(dev, torch.float32), stats[:1, 2], tokens]).tolist()
        dt = time.perf_counter() - t0
        self.step += 1
        rec = {"step": self.step, "loss": got[0], "acc": [round(a, 6) for a in got[1:1 + k]],
               "ce": got[1 + k:1 + 2 * k], "lr": lr, "grad_norm": got[-3], "loss_tokens": int(got[-2]),
               "tokens": int(got[-1]), "seconds": dt}
        if not rec["loss_tokens"]:  # nothing scored (all masked, or no target in the draft vocab): no loss, not a 0
            rec.update(loss=None, acc=None, ce=None)
        return rec

    def _evaluate_now(self, rec: dict) -> None:
        """Held-out evaluation when one is due: into the step's record, a new best kept aside."""
        if self.cfg.eval_tokens == 0 or (self.step % self.eval_every and self.step < self.total_steps):
            return
        heldout = self.evaluate()
        if heldout is None:
            return
        rec["heldout"] = heldout
        best = best_eval(self.evals + [rec])
        if best is rec:
            self.ckpt.save_best(self.step, self.draft, self.dist)
        if self.dist.local_rank == 0:
            emit("heldout", step=self.step, acceptance_length=heldout["acceptance_length"],
                 replayed_acceptance_length=heldout["replayed_acceptance_length"], best_step=best["step"])

    def run(self) -> dict:
        clock = GcClock()
        try:
            self.resume()
            self.ckpt.drop_bests_after(self.step, self.dist)  # kept aside after the checkpoint resumed from
            t_start = time.perf_counter()
            tokens = self._steps()
        finally:  # a step (or the resume) that raises must not leave the read-ahead thread running
            self._reader.shutdown(cancel_futures=True)
            clock.close()
        log(f"train: garbage collection took {sum(clock.seconds):.2f} s ({clock.count[2]} full collections, "
            f"{clock.seconds[2]:.2f} s of it)")
        if self.stopped_early:
            log(f"train: stopped early at step {self.step}: {self.cfg.patience} evaluations without a better "
                f"held-out acceptance length than step {best_eval(self.evals)['step']}'s")
        elapsed = time.perf_counter() - t_start
        by_node: dict[str, int] = {}
        for node, n in self.dist.gather_objects((self.cfg.node_rank, self.my_tokens)):
            by_node[str(node)] = by_node.get(str(node), 0) + n
        return {"tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0, "train_seconds": elapsed,
                "gc_seconds": round(sum(clock.seconds), 3),
                "tokens_by_node": by_node, **(compile_figures(self.compiled_before) if self.compiled else {})}

    def _steps(self) -> int:
        """Train to end_step (or an early stop), evaluating, logging and checkpointing as the config asks; the
        tokens trained."""
        tokens, first = 0, self.step + 1
        profiled = Profiled(self.cfg.profile_steps, first + 2, self.dist, self.stage) if self.cfg.profile_steps else None
        while self.step < self.end_step and not self.stopped_early:
            t_loop, apart = time.perf_counter(), self.apart_s + self.saves_s
            if not self.met:
                self.paced.append(t_loop)
            if profiled:
                profiled.before(self.step + 1, ready=self.met)
            rec = self.train_step()
            if profiled:
                t = time.perf_counter()
                profiled.after(self.step)  # the last profiled step writes its tables
                self.apart_s += time.perf_counter() - t if self.met else 0.0
            if rec["step"] == first + 1:  # what loading and compiling left (millions of objects) is never garbage:
                gc.freeze()  # out of the collector's sight, a full collection no longer walks it (GcClock times them)
            if self.compiled and rec["step"] == first:  # a cold compile costs minutes on a GPU host
                c = compile_figures(self.compiled_before)
                log(f"train: the first step took {rec['seconds']:.1f} s, compiling {c['compile_seconds']:.1f} s of it "
                    f"({c['compiled_graphs']} graphs)")
            if self.met and self.cfg.max_seconds:  # before the evaluation: a step cut to be the last one is evaluated
                self._hold_deadline(rec)
            t = time.perf_counter()
            self._evaluate_now(rec)
            if self.met or len(self.paced) > 2:  # the pace is the steps' own: evaluations are counted apart
                self.apart_s += time.perf_counter() - t
            self._meet_deadline(rec)
            self.history.append(rec)
            if "heldout" in rec:
                self.evals.append(rec)
            tokens += rec["tokens"]
            if self.dist.local_rank == 0 and (self.step % self.cfg.log_every == 0 or self.step == self.total_steps):
                if rec["loss"] is None:  # a step without loss tokens: progress, but no loss to show
                    progress(self.step, self.total_steps, what="steps")
                else:
                    emit("train", step=rec["step"], loss=rec["loss"], acc=rec["acc"], lr=rec["lr"],
                         tokens_per_s=rec["tokens"] / rec["seconds"])
                    progress(self.step, self.total_steps, what="steps", loss=round(rec["loss"], 4))
            if self.step % self.cfg.checkpoint_every == 0 or self.step == self.end_step or self.stopped_early:
                t = time.perf_counter()
                best = best_eval(self.evals)
                path = self.ckpt.save(self.step, self.draft, self.opt, self.history, self.dist, asdict(self.cfg),
                                      best_step=best["step"] if best else None)
                self.saves += 1
                self.saves_s += time.perf_counter() - t
                if self.dist.local_rank == 0:
                    emit("checkpoint", step=self.step, path=str(path))
            if self.held is not None:
                self.loop_s.append(time.perf_counter() - t_loop - (self.apart_s + self.saves_s - apart))
        if profiled:
            profiled.after(self.step, last=True)
        return tokens

    @property
    def finished(self) -> bool:
        """Whether the run is at its end (the last step, or stopped early): a window before that publishes no draft."""
        return self.step >= self.total_steps or self.stopped_early

    @property
    def stopped_early(self) -> bool:
        """patience evaluations since the best one (every rank decides alike: the figures are all-reduced)."""
        best = best_eval(self.evals)  # every step asks: the evaluations alone, not the whole history
        if not self.cfg.patience or best is None:
            return False
        return sum(1 for r in self.evals if r["step"] > best["step"]) >= self.cfg.patience


def best_eval(history: list[dict]) -> dict | None:
    """The step record with the highest held-out acceptance length (the earliest of equals); None: no evaluation.

    The expected acceptance length (every held-out position a chain start) decides rather than the
    replayed one: it counts every position, so it moves less from one evaluation to the next."""
    best = None
    for r in history:
        if "heldout" in r and (best is None or r["heldout"]["acceptance_length"] > best["heldout"]["acceptance_length"]):
            best = r
    return best


def optimizer_step(model, head: TargetHead, batches, opt, params, dist: Distributed, ttt_steps: int,
                   grad_clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step over this rank's micro-batches: targets, forward, loss, backward, clip, step.

    `opt` is anything with step() and zero_grad(set_to_none=...): Optimizers, or a torch optimiser.

    Returns the global per-TTT-step stats [K, 3] (CE sum, top-1 agreements, counted positions) and
    the gradient norm. The loss is normalised by the global count of each step's positions, so any
    split of the global batch over ranks and micro-batches gives the same gradient.
    """
    # bf16 states mean bf16 autocast (the trainer's precision), on whichever device they are
    amp = dict(device_type=batches[0].aux.device.type, dtype=torch.bfloat16,
               enabled=batches[0].aux.dtype == torch.bfloat16)
    with torch.autocast(**amp):
        targets = [head.targets(b, ttt_steps) for b in batches]
    denom = dist.all_reduce(torch.stack([t.counts for t in targets]).sum(0))
    stats = 0
    for i, (b, t) in enumerate(zip(batches, targets)):
        with dist.no_sync(model, last=i == len(batches) - 1):
            with torch.autocast(**amp):
                loss, s = model(b, t, denom)
            (loss * dist.world).backward()  # DDP averages over ranks; denom already is global
        stats = stats + s.detach()
    gnorm = torch.nn.utils.clip_grad_norm_(params, grad_clip) if grad_clip else torch.zeros(())
    opt.step()
    opt.zero_grad(set_to_none=True)
    return dist.all_reduce(stats), gnorm


def resolve_inputs(cfg: TrainConfig):
    """Open and cross-check the inputs (capture, vocab, target): the checks that make a bad input 65."""
    capture = CaptureSet.from_manifest(cfg.capture_dir)
    vocab = DraftVocab.load(cfg.vocab_dir)
    target = Path(cfg.target or capture.target)
    if not (target / "config.json").is_file():
        raise BadInput(f"target {target}: no config.json (set target in the train config)")
    target_config = read_config(target)
    draft_kind = kind_for_target(cfg.draft, target_config)  # train.draft: a kind of KINDS, or auto
    if (problems := draft_kind.serving_problems(target_config)) and not cfg.offline_only:
        raise BadInput(f"train.draft {cfg.draft} for target {target}: " + "; ".join(problems))
    overrides = cfg.draft_overrides
    if cfg.draft == AUTO:
        overrides = {**draft_kind.auto_overrides(target_config), **overrides}
        log(f"train: draft auto: {draft_kind.name}" + (f" with {overrides}" if overrides else ""))
    try:
        dcfg = draft_kind.config.from_target_config(target_config, draft_vocab_size=len(vocab.d2t),
                                                    aux_layer_ids=capture.layer_ids, **overrides)
    except (KeyError, TypeError, ValueError) as e:
        raise BadInput(f"target {target}/config.json: {e}") from e
    if len(vocab.t2d) != dcfg.target_vocab_size:
        raise BadInput(f"vocab {cfg.vocab_dir} covers {len(vocab.t2d)} target ids, the target has {dcfg.target_vocab_size}")
    if capture.hidden_size != (dcfg.target_hidden_size or dcfg.hidden_size):
        raise BadInput(f"capture {cfg.capture_dir} has hidden size {capture.hidden_size}, target {target} has "
                       f"{dcfg.hidden_size}")
    return capture, vocab, draft_kind, dcfg, target


def _curves(history: list[dict], most: int = 256) -> dict:
    """The manifest's curves: [step, loss] at every step or an even subsample ending at the last (the
    one thinning; the evaluate report reads these), and [step, acceptance length, replayed] of every
    held-out evaluation."""
    losses = [r for r in history if r["loss"] is not None]  # a step without loss tokens has none
    every = max(1, math.ceil(len(losses) / most))
    keep = losses[::every] + ([losses[-1]] if losses and (len(losses) - 1) % every else [])
    return {"loss_points": [[r["step"], round(r["loss"], 6)] for r in keep],
            "heldout_points": [[r["step"], r["heldout"]["acceptance_length"], r["heldout"]["replayed_acceptance_length"]]
                               for r in history if "heldout" in r]}


def _heldout_figures(trainer: "Trainer") -> dict:
    best = best_eval(trainer.evals)
    if best is None:
        return {}
    return {"best_step": best["step"], "heldout_acceptance_length": best["heldout"]["acceptance_length"],
            "heldout_replayed_acceptance_length": best["heldout"]["replayed_acceptance_length"],
            "heldout_k": best["heldout"]["k"], "stopped_early": trainer.stopped_early}


def _fingerprint(capture_dir: str) -> str:
    """The data's fingerprint: the prepare step's, whose data.parquet the capture read ("" when unknown)."""
    m = json.loads((Path(capture_dir) / "manifest.json").read_text())
    if m.get("fingerprint"):  # a capture folder written by hand (tests) may carry it itself
        return str(m["fingerprint"])
    dataset = m.get("config", {}).get("dataset")
    prepared = Path(dataset).parent / "manifest.json" if dataset else None
    return str(json.loads(prepared.read_text()).get("fingerprint", "")) if prepared and prepared.is_file() else ""


def train(cfg: TrainConfig, out: StepOutput) -> dict | None:
    dist = Distributed.from_env(cfg.device)
    stage = out.staging
    if dist.local_rank == 0:
        out.open()
    dist.barrier()
    try:
        trainer = Trainer(cfg, dist, stage)
        figures = trainer.run()
    except BadInput as e:
        (stage / f"bad_input.rank{dist.rank}.txt").write_text(str(e))  # the launcher reads it back
        raise
    scored = [r for r in trainer.history if r["loss"] is not None]
    if scored:  # none when no step had a loss token: no final loss then, rather than a 0
        figures.update(final_loss=scored[-1]["loss"], final_acc=scored[-1]["acc"])
    figures.update(steps=trainer.step, **_heldout_figures(trainer))
    skipped = len(trainer.history) - len(scored)
    if skipped:
        log(f"train: {skipped} of {len(trainer.history)} steps had no loss tokens (every position masked, or no "
            "target token in the draft vocabulary): left out of the logged loss, not counted as 0")
    counts = {"train_samples": len(trainer.index.refs), "steps": trainer.step, "world_size": dist.world,
              "nnodes": cfg.nnodes, "tokens": sum(r["tokens"] for r in trainer.history),
              "steps_without_loss_tokens": skipped}
    if trainer.window:
        counts.update(window=cfg.window, windows=trainer.window.windows, total_steps=trainer.total_steps)
    dist.barrier()
    m = None
    if dist.local_rank == 0 and trainer.window and not trainer.finished:  # the next window goes on from its checkpoint
        m = out.publish(counts=counts, figures=figures, train={"final": False, "window": cfg.window,
                                                               "checkpoints": str(trainer.ckpt.root)})
    elif dist.local_rank == 0 and cfg.node_rank == 0:
        m = _publish_draft(cfg, out, trainer, counts, figures)
    dist.barrier()  # the other hosts say they are done only once node 0 has published the draft
    if dist.local_rank == 0 and cfg.node_rank > 0:
        m = out.publish(counts=counts, figures=figures,
                        train={"node_rank": cfg.node_rank, "draft_on_node": 0, **_curves(trainer.history)})
    dist.close()
    return m


def _publish_draft(cfg: TrainConfig, out: StepOutput, trainer: Trainer, counts: dict, figures: dict) -> dict:
    """Write the draft (the best held-out weights when there were evaluations, else the last ones), its
    config and the loss curve into the staging folder and publish it."""
    stage = out.staging
    best = best_eval(trainer.evals)
    if best is not None:
        shutil.copyfile(trainer.ckpt.best_weights(best["step"]), stage / "model.safetensors")
    else:
        save_weights(trainer.draft, stage)
    write_json_atomic(stage / "draft_config.json", trainer.dcfg.to_dict())
    (stage / "loss.jsonl").write_text("".join(json.dumps(r) + "\n" for r in trainer.history))
    return out.publish(
        counts=counts,
        figures=figures,
        train={"final": True, "kind": trainer.kind.name, "weights": "model.safetensors", "draft_config": "draft_config.json",
               "loss_curve": "loss.jsonl",
               "weights_step": best["step"] if best else trainer.step, "precision": "bf16" if trainer.amp else "fp32",
               "chosen_on": trainer.heldout.part if best and trainer.heldout else None,
               "layer_ids": list(trainer.capture.layer_ids), "target": str(trainer.target),
               "capture_dir": cfg.capture_dir, "vocab_dir": cfg.vocab_dir, "data_fingerprint": _fingerprint(cfg.capture_dir),
               **_curves(trainer.history)},
    )


# ----------------------------------------------------------------------------- launching
def launch(cfg: TrainConfig, raw: dict, out: StepOutput) -> dict | None:
    """Run this step under torchrun (several processes) and map its outcome to ours."""
    resolve_inputs(cfg)  # a bad input fails here, with exit 65, before any process starts
    if cfg.device != "cpu":  # one process a GPU: a CUDA host with fewer is refused by name (a CPU host runs gloo)
        check_gpu_count(cfg.nproc_per_node, "train.nproc_per_node")
    stage = out.open()
    for f in stage.glob("bad_input.rank*.txt"):
        f.unlink()
    cfg_path = stage / "train.config.json"
    write_json_atomic(cfg_path, raw)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={cfg.nproc_per_node}"]
    if cfg.nnodes > 1:
        cmd += [f"--nnodes={cfg.nnodes}", f"--node-rank={cfg.node_rank}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={cfg.rdzv_endpoint}",
                # node 0 holds the rendezvous store: said outright, as torchrun's guess from the hostname
                # misses when the endpoint is an address the hostname does not resolve to
                f"--rdzv-conf=is_host={int(cfg.node_rank == 0)}"]
        cmd += [f"--local-addr={cfg.local_addr}"] if cfg.local_addr else []
    else:
        cmd += ["--standalone"]
    cmd += ["-m", "remote.train.train", "--config", str(cfg_path)]
    log("train: launching " + " ".join(cmd))
    rc = subprocess.call(cmd, env={**os.environ, "EAGLET_UNDER_TORCHRUN": "1"})
    bad = sorted(stage.glob("bad_input.rank*.txt"))
    if bad:
        raise BadInput(bad[0].read_text())
    if rc != 0:
        raise RuntimeError(f"torchrun exited {rc}")
    return out.done()


def run(raw: dict) -> dict | None:
    # every process of a torchrun job starts here too: begin_step only reads when a step resumes
    cfg, out, done = begin_step(TrainConfig, raw, STEP, resumes=True)
    if done is not None:
        return done
    if (cfg.nproc_per_node > 1 or cfg.nnodes > 1) and "EAGLET_UNDER_TORCHRUN" not in os.environ:
        return launch(cfg, raw, out)
    return train(cfg, out)


def main(argv: list[str] | None = None) -> int:
    return step_main(STEP, run, argv)


def exit_rank(rc: int) -> None:
    """End a torchrun rank without the interpreter's finalization, once its step has written all it writes.

    gloo's worker threads outlive destroy_process_group while DDP holds the group, and one that drops its last
    collective's tensors (a barrier's, an all_gather_object's) after the main thread has begun finalizing must take
    the GIL: CPython ends that thread, and the unwind through gloo's loop calls std::terminate (SIGABRT; a core of
    it: ProcessGroupGloo::runLoop -> ~AsyncBarrierWork -> decref_pyobject -> take_gil -> pthread_exit). About one
    2-rank run in 12 on a loaded 2-core machine failed so after publishing its draft. Nothing of a rank is left to
    finalize: its files are closed and renamed into place, its process group destroyed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    code = main()
    if "EAGLET_UNDER_TORCHRUN" in os.environ:
        exit_rank(code)
    raise SystemExit(code)
