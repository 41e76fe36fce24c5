"""The speculators 0.9.0 arm of bench/quality_bench.py: its draft, loss and optimiser on eaglet's capture.

    python -m bench.speculators_arm --config c.json
    # {"capture_dir": "<capture step>", "vocab_dir": "<vocab step>", "target": "<model>", "out_dir": "<arm>/export",
    #  "epochs": 1}

Trains speculators' own Eagle3DraftModel (bench.train_bench.speculators_draft: its eagle3 defaults
norm_before_fc, norm_before_residual, norm_output; embedding and lm_head frozen from the target's
rows of the draft vocabulary) with its trainer's defaults (speculators/train/config/schema.py):
Muon for the matrices and AdamW for the rest through its own `build_optimizers`, lr 1e-3 both,
weight decay 0.1 / 0.01, a linear schedule with 1% warmup, 8,192 tokens a step, TTT 3 with every
step weighted 1.0, forward KL (its fused kernel), gradient clip 1.0, bf16 autocast over fp32 weights.

The data is eaglet's: the same capture, draft vocabulary and packing plan (remote.draft.data.pack:
the same samples in the same order per seed and epoch), each sample shifted the way speculators'
own pipeline does (speculators/models/eagle3/data.py: token t+1 beside the state of token t, so a
sample of n tokens trains n - 1 rows).

The trained draft is written as eaglet's export (remote.draft.folder's files, remote.draft.eagle3's config.json,
the norm flags set), so remote.evaluate measures it exactly as it measures eaglet's. The manifest
also holds `own_forward`: speculators' own forward on the held-out split, its guesses scored by
remote.evaluate.chains' chain math (score_chains, the same batches as the evaluate step): equal figures
prove the conversion. Nothing here is speculators' code copied: it is imported.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from bench.train_bench import speculators_draft
from remote.capture.store import CaptureSet
from remote.draft.config import DraftConfig
from remote.draft.data import CaptureIndex, epoch_order, pack
from remote.draft.eagle3 import vllm_config
from remote.draft.folder import DTYPES, write_folder
from remote.draft.loss import PackedBatch, TargetHead
from remote.draft.vocab import DraftVocab
from remote.evaluate.acceptance import ChainCounts
from remote.evaluate.chains import heldout_plan, score_chains
from remote.step import BadInput, StepOutput, load_config, log, step_main
from remote.train.state import load_target_head_weights

STEP = "speculators_arm"
NORM_FLAGS = ("norm_before_fc", "norm_before_residual", "norm_output")


@dataclass(frozen=True, kw_only=True)
class SpeculatorsArmConfig:
    capture_dir: str  # a finished capture step (eaglet's)
    vocab_dir: str  # a finished vocab step (eaglet's draft vocabulary)
    out_dir: str  # the converted draft, an eaglet export folder
    target: str = ""  # the target's folder ("": the capture's)
    epochs: float = 1.0  # passes over the train split (fractions allowed)
    max_steps: int = 0  # optimizer steps; 0: as many as the epochs give
    token_budget: int = 8192  # speculators' total_seq_len: packed tokens a step
    optimizer: str = "muon"  # speculators' "muon" (Muon + AdamW) or "adamw"
    lr: float = 1e-3  # AdamW's lr, and Muon's (speculators: muon_lr defaults to lr)
    weight_decay: float = 0.01  # AdamW's
    muon_weight_decay: float = 0.1
    muon_momentum: float = 0.95
    muon_ns_steps: int = 5
    muon_adjust_lr_fn: str = "match_rms_adamw"
    warmup_ratio: float = 0.01  # linear warmup share of the steps, then linear decay to 0
    ttt_steps: int = 3
    ttt_step_loss_decay: float = 1.0
    loss: str = "kl_div"
    norms: bool = True  # its eagle3 norms (norm_before_fc, norm_before_residual, norm_output)
    grad_clip: float = 1.0
    seed: int = 0  # the packing order (eaglet's) and the draft's initialisation
    device: str = "auto"
    eval_token_budget: int = 2048  # the evaluate step's offline batches (own_forward uses the same)
    eval_max_tokens: int = 262144
    log_every: int = 50


def shifted(b: PackedBatch, length: int = 0) -> dict:
    """speculators' inputs from an eaglet packed batch: per sample, token t+1 beside the state of t.

    Every sample loses its first row (ids, final state, mask, position) and its last aux row, as
    speculators' shift_batch does per sample. Padded to `length` rows (own document, no loss) when
    given, so a compiled forward sees one shape. Also returns `rows`: each kept row's index in b.
    """
    first = b.positions == 0
    last = torch.ones_like(first)
    last[:-1] = b.doc_ids[1:] != b.doc_ids[:-1]
    rows = (~first).nonzero().squeeze(1)
    x = {"input_ids": b.input_ids[~first], "hidden_states": b.aux[~last], "verifier_last_hidden_states": b.last[~first],
         "loss_mask": b.loss_mask[~first], "position_ids": b.positions[~first], "document_ids": b.doc_ids[~first]}
    pad = max(0, length - len(rows))
    if pad:
        fill = {"input_ids": 0, "loss_mask": False, "position_ids": None, "document_ids": int(b.doc_ids.max()) + 1}
        for k, v in x.items():
            if k in ("hidden_states", "verifier_last_hidden_states"):
                x[k] = torch.cat([v, v.new_zeros(pad, v.shape[1])])
            elif k == "position_ids":
                x[k] = torch.cat([v, torch.arange(pad, device=v.device)])
            else:
                x[k] = torch.cat([v, torch.full((pad,), fill[k], dtype=v.dtype, device=v.device)])
    return {**{k: v[None] for k, v in x.items()}, "rows": rows}


class Arm:
    def __init__(self, cfg: SpeculatorsArmConfig):
        self.cfg = cfg
        want = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        self.device = torch.device(want)
        self.cuda = self.device.type == "cuda"
        self.capture = CaptureSet.from_manifest(cfg.capture_dir)
        self.vocab = DraftVocab.load(cfg.vocab_dir)
        self.target = Path(cfg.target or self.capture.target)
        self.dcfg = DraftConfig.from_target_dir(self.target, draft_vocab_size=len(self.vocab.d2t),
                                                aux_layer_ids=self.capture.layer_ids)
        if cfg.norms and not all(f in DraftConfig.__dataclass_fields__ for f in NORM_FLAGS):
            raise BadInput(f"eaglet's DraftConfig has no {NORM_FLAGS}: its evaluator could not run speculators' "
                           "normed draft (set norms false, or merge the draft's norm options)")
        torch.manual_seed(cfg.seed)
        self.model = speculators_draft(self.dcfg, cfg.ttt_steps, cfg.norms,
                                       "simple_flex_attention" if self.cuda else "eager")
        embed, lm_head, norm = load_target_head_weights(self.target, self.dcfg)
        rows = lm_head[self.vocab.draft_ids].float()
        m = self.model
        with torch.no_grad():  # what its load_verifier_weights loads from a verifier checkpoint
            m.embed_tokens.weight.copy_(embed.float())
            m.lm_head.weight.copy_(rows)
            m.verifier_lm_head.weight.copy_(rows)
            m.verifier_norm.weight.copy_(norm.float())
            m.t2d.copy_(self.vocab.t2d)
            m.d2t.copy_(self.vocab.d2t)
        for p in (m.embed_tokens.weight, m.lm_head.weight, m.verifier_lm_head.weight, m.verifier_norm.weight):
            p.requires_grad_(False)
        m.to(self.device)
        self.head_pieces = (norm, lm_head)

    def plan(self, index: CaptureIndex) -> list[list[int]]:
        c = self.cfg
        plans = [pack(index.lengths, c.token_budget, epoch_order(len(index.refs), c.seed, e))
                 for e in range(math.ceil(c.epochs))]
        total = c.max_steps or max(1, round(sum(len(p) for p in plans) * c.epochs / math.ceil(c.epochs)))
        return [b for p in plans for b in p][:total]

    def train(self) -> dict:
        from speculators.losses import resolve_loss_config
        from speculators.train.optimizers import build_optimizers
        from transformers import get_linear_schedule_with_warmup

        c, m = self.cfg, self.model
        index = CaptureIndex.build(self.capture, split="train")
        batches = self.plan(index)
        opts = build_optimizers(m, SimpleNamespace(
            optimizer=c.optimizer, lr=c.lr, weight_decay=c.weight_decay, muon_lr=c.lr, muon_momentum=c.muon_momentum,
            muon_weight_decay=c.muon_weight_decay, muon_ns_steps=c.muon_ns_steps, muon_adjust_lr_fn=c.muon_adjust_lr_fn))
        scheds = [get_linear_schedule_with_warmup(o, int(len(batches) * c.warmup_ratio), len(batches)) for o in opts]
        loss_config = resolve_loss_config(c.loss, "fused" if self.cuda else "eager")
        dtype = torch.bfloat16 if self.cuda else torch.float32
        history, tokens, rows_trained, t0 = [], 0, 0, time.perf_counter()
        m.train()
        for step, batch in enumerate(batches, 1):
            b = index.load(batch, c.token_budget)
            x = shifted(b.to(self.device, dtype), c.token_budget if self.cuda else 0)
            x.pop("rows")
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cuda):
                _, loss, metrics = m(**x, ttt_steps=c.ttt_steps, ttt_step_loss_decay=c.ttt_step_loss_decay,
                                     loss_config=loss_config)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(m.parameters(), c.grad_clip)
            for o in opts:
                o.step()
                o.zero_grad(set_to_none=True)
            for s in scheds:
                s.step()
            tokens += b.n_tokens
            rows_trained += b.n_tokens - len(batch)
            if step % c.log_every == 0 or step == len(batches):
                acc = [float(metrics[f"full_acc_{k}_sum"] / metrics[f"full_acc_{k}_total"].clamp(min=1))
                       for k in range(c.ttt_steps)]
                history.append({"step": step, "loss": float(loss.detach()), "acc": [round(a, 6) for a in acc],
                                "grad_norm": float(gnorm), "lr": opts[0].param_groups[0]["lr"], "tokens": tokens,
                                "seconds": time.perf_counter() - t0})
                log(f"speculators: step {step}/{len(batches)} loss {history[-1]['loss']:.4f} acc {history[-1]['acc']}")
        seconds = time.perf_counter() - t0
        return {"steps": len(batches), "tokens": tokens, "rows": rows_trained, "train_seconds": seconds,
                "tokens_per_s": tokens / seconds if seconds else 0.0, "final_loss": history[-1]["loss"],
                "final_acc": history[-1]["acc"], "history": history}

    def export(self, stage: Path) -> None:
        """The trained draft as eaglet's export folder: `layers.0.` is eaglet's `midlayer.`, the rest keeps its name."""
        sd = self.model.state_dict()
        keep = ("fc.weight", "norm.weight", "lm_head.weight") + (("input_norm.weight",) if self.cfg.norms else ())
        w = {k: sd[k] for k in keep}
        w.update({"midlayer." + k[len("layers.0."):]: v for k, v in sd.items() if k.startswith("layers.0.")})
        tensors = {k: v.detach().to("cpu", DTYPES["bfloat16"]).contiguous() for k, v in w.items()}
        tensors["d2t"] = self.vocab.d2t.to(torch.int64).contiguous()
        tensors["t2d"] = self.vocab.t2d.to(torch.bool).contiguous()
        flags = {f: True for f in NORM_FLAGS} if self.cfg.norms else {}
        d = DraftConfig(**{**self.dcfg.to_dict(), **flags})
        write_folder(stage, vllm_config(d, "bfloat16"), tensors)

    @torch.no_grad()
    def own_forward(self) -> dict:
        """speculators' forward on the evaluate step's held-out batches, scored by remote.evaluate's chain math."""
        c, m = self.cfg, self.model
        m.eval()
        index = CaptureIndex.build(self.capture, split="heldout", part="test")
        dtype = torch.bfloat16 if self.cuda else torch.float32
        norm, lm_head = self.head_pieces
        head = TargetHead.from_weights(norm, lm_head, self.vocab.t2d, self.dcfg.rms_norm_eps).to(self.device, dtype)
        counts, drafts, accepted = ChainCounts.zeros(c.ttt_steps), 0, 0
        k = min(3, c.ttt_steps)
        for batch in heldout_plan(index, c.eval_token_budget, c.eval_max_tokens):  # the evaluate step's batches
            b = index.load(batch, c.eval_token_budget).to(self.device, dtype)
            x = shifted(b, c.eval_token_budget if self.cuda else 0)  # one shape: a shifted batch is always shorter
            rows = x.pop("rows")
            for key in ("loss_mask", "verifier_last_hidden_states"):
                x.pop(key)
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cuda):
                tokens = m(**x, ttt_steps=c.ttt_steps)
            # speculators' row of (token p, state p-1) is eaglet's row of position p-1; a sample's last row
            # has no counterpart (nothing after it is known) and never matches
            g = torch.full((len(b.input_ids), c.ttt_steps), -2, dtype=torch.long, device=self.device)
            g[rows - 1] = torch.stack([t[0, :len(rows)] for t in tokens], 1)
            cc, d, a = score_chains(g, head, b, k)
            counts, drafts, accepted = counts + cc, drafts + d, accepted + a
        return {"acceptance_length": counts.acceptance_length(k),
                "replayed_acceptance_length": 1 + accepted / drafts if drafts else None, **counts.to_dict()}


def run(raw: dict) -> dict:
    cfg = load_config(SpeculatorsArmConfig, raw)
    out = StepOutput(cfg.out_dir, STEP, asdict(cfg))
    if (m := out.done()) is not None:
        return m
    arm = Arm(cfg)
    figures = arm.train()
    history = figures.pop("history")
    stage = out.open()
    arm.export(stage)
    (stage / "loss.jsonl").write_text("".join(json.dumps(r) + "\n" for r in history))
    own = arm.own_forward()
    log(f"speculators: own forward on the held-out split: acceptance {own['acceptance_length']:.3f}, "
        f"replayed {own['replayed_acceptance_length']}")
    return out.publish(counts={"steps": figures["steps"], "tokens": figures["tokens"]}, figures=figures,
                       own_forward=own, export={"format": "vllm-eagle3", "layer_ids": list(arm.dcfg.aux_layer_ids)})


def main(argv: list[str] | None = None) -> int:
    return step_main(STEP, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
