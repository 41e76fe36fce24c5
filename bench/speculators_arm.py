"""The speculators 0.9.0 arms of bench/quality_bench.py: its drafts, losses and optimiser on eaglet's capture.

    python -m bench.speculators_arm --config c.json
    # {"capture_dir": "<capture step>", "vocab_dir": "<vocab step>", "target": "<model>", "out_dir": "<arm>/export",
    #  "epochs": 1}                                                  (kind "eagle3", the default)
    # {..., "kind": "dflash", "block_size": 8, "num_layers": 1}     (speculators' DFlash)
    # {..., "kind": "dspark", "block_size": 8, "num_layers": 1}     (speculators' DSpark)

Every kind trains with speculators' trainer defaults (speculators/train/config/schema.py): Muon for the
matrices and AdamW for the rest through its own `build_optimizers`, lr 1e-3 both, weight decay 0.1 / 0.01,
a linear schedule with 1% warmup, 8,192 tokens a step, gradient clip 1.0, bf16 autocast over fp32 weights;
embedding and lm_head frozen from the target's rows of the draft vocabulary (what its load_verifier_weights
loads).

kind "eagle3" (SpeculatorsArmConfig): its own Eagle3DraftModel (bench.train_bench.speculators_draft: its
eagle3 defaults norm_before_fc, norm_before_residual, norm_output), TTT 3 with every step weighted 1.0,
forward KL (its fused kernel). Each sample is shifted the way its own pipeline does
(speculators/models/eagle3/data.py: token t+1 beside the state of token t, so n tokens train n - 1 rows).

kind "dflash" (SpeculatorsDFlashConfig): its own DFlashDraftModel (speculators.models.dflash) at its dflash
defaults but the block size and layer count the arm sets (its own are 16 and 5): cross-entropy to the
target's top-1 weighted per slot by D-PACE (alpha 0.5), 512 random anchors a step (its select_anchors),
unshifted samples (its pipeline shifts no DFlash batch), padded as its collate pads (document -1). Its
architecture is vLLM's DFlash and eaglet's (remote/draft/dflash.py) name for name: fc + hidden_norm over
the aux states, Qwen3 layers whose k_proj/v_proj also project that context, the block [anchor, mask x
B-1] at positions pos[a]..pos[a]+B-1 seeing its sample's rows before the anchor and all of itself, slot j
predicting token a + j. One setting differs by default: speculators' CLI makes every DFlash layer a
sliding-window layer (window 2048; --full-attention-indices empty), and for dflash a sliding layer is
causal inside the block (sliding_window_non_causal false), where vLLM's `dflash_config.causal: false`
and eaglet attend the block both ways. The arm builds its layers as full-attention ones (what
--full-attention-indices 0..n-1 gives: always bidirectional, no window), the variant that matches, so
the conversion is weight-exact (tests/test_quality_bench.py). Its mask token is eaglet's dflash default
(the target's last id; speculators' CLI would take the tokenizer's), so both arms embed the same one.

kind "dspark" (SpeculatorsDSparkConfig): its own DSparkDraftModel (speculators.models.dspark: DFlashDraftModel
plus a Markov head and a confidence head) at its dspark trainer defaults but the layer count (5 there) and the
confidence head: forward KL (its fused kernel) weighted per slot by exp(-j / 4) (fixed-exp-decay, gamma 4, slot
j = 0..B-1), 512 anchors a step, block 8, sample_from_anchor (slot j predicts token a + j + 1, all B slots
draft), the vanilla Markov head of rank 256 (slot j's logits plus markov_w2(markov_w1[token at a + j]), the real
token in training). Its DFlash backbone is built as the dflash arm builds it (full-attention layers, eaglet's mask
token), so the draft is vLLM's Qwen3DSparkModel and eaglet's (remote/draft/dspark.py) name for name: DFlash's
weights plus markov_head.markov_w1 [target vocab, r] and markov_head.markov_w2 [draft vocab, r]. Two of its
settings differ from what vLLM serves or eaglet builds, and the arm takes the ones that match:
- markov_head_type: "gated" and "rnn" add gate_proj / joint_proj, which vLLM's DSparkMarkovHead has no place
  for (it serves the vanilla bias only); the arm builds "vanilla", its default.
- the confidence head (confidence_head.proj: a linear map of [h, markov_w1[prev]] to a per-slot acceptance
  logit, trained by a BCE to 1 - TV at weight 1.0, its default on): eaglet's DSpark has none, so the arm turns it
  off (enable_confidence_head false) and every trained weight converts. vLLM could load it (its
  DSparkConfidenceHead, read only by its adaptive verification; greedy guesses never read it). Set
  enable_confidence_head true for speculators' own recipe: the head trains (its BCE's gradient also reaches the
  backbone and markov_w1) and is left out of the export (`confidence_head_left_out` in the manifest's export).
Its loss also computes a TV distance per slot (no gradient: its accept-rate metric and the confidence target).
On a GPU its forward is compiled, and the fused TV is a second call of the Triton loss kernel its fused KL calls
in the same graph, whose shared autotune `configs` list fails to trace twice; the arm passes its TV through the
non-fused twin speculators ships (resolve_loss_config("tv", "eager"): speculators.losses.eager.tv_loss, traced
by torch.compile with the rest of the forward), its KL through the fused kernel as its trainer does. On a CPU
every loss is the eager one (as for the other kinds). own_forward scores its guesses at every k = 1..B (by_k;
the headline at k = B): its _backbone_forward plus its Markov head's block_bias of the real previous token,
which is what vLLM's left-to-right sampling conditions on wherever the chain scorer counts a guess.

The data is eaglet's for every kind: the same capture, draft vocabulary and packing plan (remote.draft.data.pack:
the same samples in the same order per seed and epoch). The trained draft is written as eaglet's export
of its kind (remote.draft.folder's files; remote.draft.eagle3's config.json with the norm flags set,
remote.draft.dflash's or remote.draft.dspark's), so remote.evaluate measures it exactly as it measures
eaglet's. The manifest also holds `own_forward`: speculators' own forward on the held-out split, its guesses
scored by remote.evaluate.chains' chain math (score_chains, the same batches as the evaluate step); equal
figures prove the conversion. A block draft's own_forward runs on the export's rounded (bf16) weights at every
k of its block (`by_k`; the headline at k = block_size - 1 for DFlash, block_size for DSpark), so it equals the
evaluator's figure at each --k. Nothing here is speculators' code copied: it is imported.
"""
from __future__ import annotations

import json
import math
import sys
import time
import types
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from bench.train_bench import speculators_draft
from remote.capture.store import CaptureSet
from remote.draft.config import DraftConfig
from remote.draft.data import CaptureIndex, epoch_order, pack
from remote.draft.dflash import DFlash, DFlashConfig, dflash_layer_ids
from remote.draft.dspark import DSpark, DSparkConfig
from remote.draft.eagle3 import vllm_config
from remote.draft.folder import DTYPES, export_tensors, weight_names, write_folder
from remote.draft.loss import PackedBatch, TargetHead
from remote.draft.vocab import DraftVocab
from remote.evaluate.acceptance import ChainCounts
from remote.evaluate.chains import heldout_plan, score_chains
from remote.step import BadInput, StepOutput, load_config, log, step_main
from remote.train.state import load_target_head_weights

STEP = "speculators_arm"
NORM_FLAGS = ("norm_before_fc", "norm_before_residual", "norm_output")


@dataclass(frozen=True, kw_only=True)
class ArmBase:
    """What both kinds share: the data, speculators' optimiser and schedule, the held-out scoring."""

    capture_dir: str  # a finished capture step (eaglet's)
    vocab_dir: str  # a finished vocab step (eaglet's draft vocabulary)
    out_dir: str  # the converted draft, an eaglet export folder
    kind: str = "eagle3"  # the draft: "eagle3", "dflash" or "dspark" (the class of each: CONFIGS)
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
    grad_clip: float = 1.0
    seed: int = 0  # the packing order (eaglet's) and the draft's initialisation
    device: str = "auto"
    eval_token_budget: int = 2048  # the evaluate step's offline batches (own_forward uses the same)
    eval_max_tokens: int = 262144
    log_every: int = 50

    def __post_init__(self):
        own = type(self).__dataclass_fields__["kind"].default
        if self.kind != own:
            raise ValueError(f"kind {self.kind!r} given to {type(self).__name__} (kind {own!r}); "
                             f"pick the class with config_class")


@dataclass(frozen=True, kw_only=True)
class SpeculatorsArmConfig(ArmBase):
    """speculators' EAGLE-3 draft."""

    ttt_steps: int = 3
    ttt_step_loss_decay: float = 1.0
    loss: str = "kl_div"
    norms: bool = True  # its eagle3 norms (norm_before_fc, norm_before_residual, norm_output)


@dataclass(frozen=True, kw_only=True)
class SpeculatorsDFlashConfig(ArmBase):
    """speculators' DFlash draft; its dflash defaults but block_size and num_layers (16 and 5 there)."""

    kind: str = "dflash"
    block_size: int = 8  # B: the anchor and B - 1 drafted tokens (speculators' dflash default: 16)
    num_layers: int = 1  # draft decoder layers (speculators' dflash default: 5)
    loss: str = "ce"  # its loss_fn for dflash
    per_position_loss_weight: str = "dpace"  # its dflash default ("fixed-exp-decay": exp(-(j-1)/gamma))
    dpace_alpha: float = 0.5
    dflash_decay_gamma: float = 4.0  # fixed-exp-decay's gamma
    max_anchors: int = 512  # blocks a step (its max_anchors)
    mask_token_id: int = -1  # -1: eaglet's dflash default, the target's last id

    def __post_init__(self):
        super().__post_init__()
        if self.block_size < 2 or self.num_layers < 1:
            raise ValueError(f"block_size {self.block_size}, num_layers {self.num_layers}: need >= 2 and >= 1")
        if self.per_position_loss_weight == "dpace" and self.loss != "ce":
            raise ValueError(f"per_position_loss_weight dpace needs loss 'ce' (speculators refuses {self.loss!r})")


@dataclass(frozen=True, kw_only=True)
class SpeculatorsDSparkConfig(SpeculatorsDFlashConfig):
    """speculators' DSpark draft: its dspark trainer defaults (kl_div, fixed-exp-decay, block 8) but num_layers
    (5 there) and the confidence head (on there)."""

    kind: str = "dspark"
    loss: str = "kl_div"  # its loss_fn for dspark (the schema's default for every kind but dflash and xpress)
    per_position_loss_weight: str = "fixed-exp-decay"  # exp(-j / gamma) for slot j = 0..B-1 (sample_from_anchor)
    markov_rank: int = 256  # r of its vanilla Markov head (its default)
    enable_confidence_head: bool = False  # its default True: trained, then left out of the export (eaglet has none)
    confidence_head_alpha: float = 1.0  # the confidence BCE's weight, when the head is on

    def __post_init__(self):
        super().__post_init__()
        if self.markov_rank < 1:
            raise ValueError(f"markov_rank {self.markov_rank}: need >= 1 (a draft without the Markov head is kind "
                             f"dflash)")


CONFIGS = {"eagle3": SpeculatorsArmConfig, "dflash": SpeculatorsDFlashConfig, "dspark": SpeculatorsDSparkConfig}


def config_class(raw: dict) -> type[ArmBase]:
    """The config class of an arm's raw settings, by their `kind`."""
    kind = raw.get("kind", "eagle3")
    if kind not in CONFIGS:
        raise BadInput(f"kind {kind!r}: speculators arms are {sorted(CONFIGS)}")
    return CONFIGS[kind]


def import_speculators(cuda: bool) -> None:
    """speculators' models import its training data module (datasets, openai, hs_connectors) for one type
    name; stand in a module holding it (as bench.train_bench.speculators_draft does). On a GPU, give its
    fused loss's backward kernel its own autotune list (torch 2.11 / triton 3.6: the shared one fails; issue 5)."""
    if "speculators.train.data" not in sys.modules:
        stub = types.ModuleType("speculators.train.data")
        stub.BatchType = dict
        sys.modules["speculators.train.data"] = stub
    if cuda:
        import speculators.losses.fused as fused

        fused.loss_backward_kernel.configs = list(fused._tile_configs())


def shifted(b: PackedBatch, length: int = 0) -> dict:
    """speculators' EAGLE-3 inputs from an eaglet packed batch: per sample, token t+1 beside the state of t.

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


def padded(b: PackedBatch, length: int) -> dict:
    """speculators' DFlash inputs from an eaglet packed batch: unshifted, padded to `length` rows as its collate
    pads (zeros, no loss, document -1: a row no block sees)."""
    x = {"input_ids": b.input_ids, "hidden_states": b.aux, "verifier_last_hidden_states": b.last,
         "loss_mask": b.loss_mask, "position_ids": b.positions, "document_ids": b.doc_ids}
    pad = max(0, length - len(b.input_ids))
    out = {}
    for k, v in x.items():
        fill = v.new_full((pad, *v.shape[1:]), -1 if k == "document_ids" else 0)
        out[k] = torch.cat([v, fill])[None]
    return out


# ----------------------------------------------------------------------------- the arms
class Arm:
    """speculators' EAGLE-3 draft on eaglet's capture; DFlashArm (and DSparkArm on it) overrides the kind's parts
    (build, inputs, loss, export, guesses)."""

    def __init__(self, cfg: ArmBase):
        self.cfg = cfg
        want = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        self.device = torch.device(want)
        self.cuda = self.device.type == "cuda"
        self.capture = CaptureSet.from_manifest(cfg.capture_dir)
        self.vocab = DraftVocab.load(cfg.vocab_dir)
        self.target = Path(cfg.target or self.capture.target)
        self.dcfg = self.draft_config()
        torch.manual_seed(cfg.seed)
        self.model = self.build("simple_flex_attention" if self.cuda else "eager")
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

    # --- the kind's parts
    def draft_config(self) -> DraftConfig:
        if self.cfg.norms and not all(f in DraftConfig.__dataclass_fields__ for f in NORM_FLAGS):
            raise BadInput(f"eaglet's DraftConfig has no {NORM_FLAGS}: its evaluator could not run speculators' "
                           "normed draft (set norms false, or merge the draft's norm options)")
        return DraftConfig.from_target_dir(self.target, draft_vocab_size=len(self.vocab.d2t),
                                           aux_layer_ids=self.capture.layer_ids)

    def build(self, attn: str) -> torch.nn.Module:
        return speculators_draft(self.dcfg, self.cfg.ttt_steps, self.cfg.norms, attn)

    def inputs(self, b: PackedBatch, length: int) -> dict:
        x = shifted(b, length)
        x.pop("rows")
        return x

    def loss(self, x: dict, loss_config) -> tuple[torch.Tensor, dict]:
        c = self.cfg
        _, loss, metrics = self.model(**x, ttt_steps=c.ttt_steps, ttt_step_loss_decay=c.ttt_step_loss_decay,
                                      loss_config=loss_config)
        return loss, metrics

    def progress(self, metrics: dict) -> dict:
        """A logged step's accuracies (TTT step k's)."""
        return {"acc": [round(float(metrics[f"full_acc_{k}_sum"] / metrics[f"full_acc_{k}_total"].clamp(min=1)), 6)
                        for k in range(self.cfg.ttt_steps)]}

    def trained_rows(self, x: dict, b: PackedBatch, batch: list[int]) -> int:
        """The step's trained rows: a sample of n tokens trains n - 1."""
        return b.n_tokens - len(batch)

    def export(self, stage: Path) -> None:
        """The trained draft as eaglet's export folder: `layers.0.` is eaglet's `midlayer.`, the rest keeps its name."""
        sd = self.model.state_dict()
        keep = ("fc.weight", "norm.weight", "lm_head.weight") + (("input_norm.weight",) if self.cfg.norms else ())
        w = {k: sd[k] for k in keep}
        w.update({"midlayer." + k[len("layers.0."):]: v for k, v in sd.items() if k.startswith("layers.0.")})
        flags = {f: True for f in NORM_FLAGS} if self.cfg.norms else {}
        d = DraftConfig(**{**self.dcfg.to_dict(), **flags})
        write_folder(stage, vllm_config(d, "bfloat16"), self.tensors(w))

    def export_record(self) -> dict:
        return {"format": "vllm-eagle3", "layer_ids": list(self.dcfg.aux_layer_ids)}

    def scorings(self) -> list[tuple[int, int]]:
        """(k, guesses scored) of own_forward: the evaluate step's default k 3 over every TTT step's guesses."""
        return [(min(3, self.cfg.ttt_steps), self.cfg.ttt_steps)]

    def for_scoring(self) -> torch.dtype:
        """Ready the model for own_forward; the dtype of its inputs."""
        return torch.bfloat16 if self.cuda else torch.float32

    def guesses(self, b: PackedBatch) -> torch.Tensor:
        """[T, steps] draft ids of speculators' own forward, in eaglet's rows (row t guesses token t+2+j)."""
        c, m = self.cfg, self.model
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
        return g

    # --- shared
    def tensors(self, w: dict) -> dict:
        """The export's tensors: the draft's weights in bf16, eaglet's vocabulary maps."""
        tensors = {k: v.detach().to("cpu", DTYPES["bfloat16"]).contiguous() for k, v in w.items()}
        tensors["d2t"] = self.vocab.d2t.to(torch.int64).contiguous()
        tensors["t2d"] = self.vocab.t2d.to(torch.bool).contiguous()
        return tensors

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
            x = self.inputs(b.to(self.device, dtype), c.token_budget if self.cuda else 0)
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cuda):
                loss, metrics = self.loss(x, loss_config)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(m.parameters(), c.grad_clip)
            for o in opts:
                o.step()
                o.zero_grad(set_to_none=True)
            for s in scheds:
                s.step()
            tokens += b.n_tokens
            rows_trained += self.trained_rows(x, b, batch)
            if step % c.log_every == 0 or step == len(batches):
                history.append({"step": step, "loss": float(loss.detach()), **self.progress(metrics),
                                "grad_norm": float(gnorm), "lr": opts[0].param_groups[0]["lr"], "tokens": tokens,
                                "seconds": time.perf_counter() - t0})
                log(f"speculators {c.kind}: step {step}/{len(batches)} loss {history[-1]['loss']:.4f} "
                    f"acc {history[-1]['acc']}")
        seconds = time.perf_counter() - t0
        return {"steps": len(batches), "tokens": tokens, "rows": rows_trained, "train_seconds": seconds,
                "tokens_per_s": tokens / seconds if seconds else 0.0, "final_loss": history[-1]["loss"],
                "final_acc": history[-1]["acc"], "history": history}

    @torch.no_grad()
    def own_forward(self) -> dict:
        """speculators' forward on the evaluate step's held-out batches, scored by remote.evaluate's chain math."""
        c = self.cfg
        self.model.eval()
        dtype = self.for_scoring()
        index = CaptureIndex.build(self.capture, split="heldout", part="test")
        norm, lm_head = self.head_pieces
        head = TargetHead.from_weights(norm, lm_head, self.vocab.t2d, self.dcfg.rms_norm_eps).to(self.device, dtype)
        scored = {k: [ChainCounts.zeros(n), 0, 0] for k, n in self.scorings()}
        for batch in heldout_plan(index, c.eval_token_budget, c.eval_max_tokens):  # the evaluate step's batches
            b = index.load(batch, c.eval_token_budget).to(self.device, dtype)
            g = self.guesses(b)
            for k, n in self.scorings():
                cc, d, a = score_chains(g[:, :n], head, b, k)
                s = scored[k]
                scored[k] = [s[0] + cc, s[1] + d, s[2] + a]
        figures = {k: {"acceptance_length": cc.acceptance_length(k),
                       "replayed_acceptance_length": 1 + a / d if d else None, **cc.to_dict()}
                   for k, (cc, d, a) in scored.items()}
        head_k = max(figures)
        if len(figures) == 1:
            return figures[head_k]
        return {"k": head_k, **figures[head_k], "by_k": {str(k): {n: f[n] for n in (
            "acceptance_length", "replayed_acceptance_length")} for k, f in figures.items()}}


class DFlashArm(Arm):
    """speculators' DFlash draft (full-attention layers: the variant of vLLM's and eaglet's DFlash)."""

    chunk = 256  # own_forward's blocks a forward (eager attention keeps [heads, chunk*B, T + chunk*B] scores)
    export_kind = DFlash()  # eaglet's kind it is exported as

    def draft_config(self) -> DFlashConfig:
        c = self.cfg
        return DFlashConfig.from_target_dir(self.target, draft_vocab_size=len(self.vocab.d2t),
                                            aux_layer_ids=self.capture.layer_ids, num_layers=c.num_layers,
                                            block_size=c.block_size, mask_token_id=c.mask_token_id)

    def build(self, attn: str) -> torch.nn.Module:
        return speculators_dflash(self.dcfg, attn, self.cuda)

    def inputs(self, b: PackedBatch, length: int) -> dict:
        # its collate pads every batch to total_seq_len and its select_anchors skips the last block_size rows;
        # on a CPU (no compiled shapes) the batch gets just those rows, so no anchor of eaglet's batch is lost
        return padded(b, length or len(b.input_ids) + self.cfg.block_size)

    def loss(self, x: dict, loss_config) -> tuple[torch.Tensor, dict]:
        c = self.cfg
        _, loss, metrics = self.model(**x, loss_config=loss_config, gamma=c.dflash_decay_gamma,
                                      max_anchors=c.max_anchors, per_position_loss_weight=c.per_position_loss_weight,
                                      dpace_alpha=c.dpace_alpha)
        return loss, metrics

    def progress(self, metrics: dict) -> dict:
        acc = [float(metrics[f"position_{j}_acc_sum"] / metrics[f"position_{j}_acc_total"].clamp(min=1))
               for j in range(1, self.cfg.block_size)]
        return {"acc": [round(a, 6) for a in acc],
                "eal": round(float(metrics["eal_sum"] / metrics["eal_total"].clamp(min=1)), 6)}

    def trained_rows(self, x: dict, b: PackedBatch, batch: list[int]) -> int:
        """The step's blocks: select_anchors' count (loss rows but the last block_size, at most max_anchors)."""
        return min(self.cfg.max_anchors, int(x["loss_mask"][0, :-self.cfg.block_size].sum()))

    def export(self, stage: Path) -> None:
        write_folder(stage, self.export_kind.export_config(self.dcfg, "bfloat16", ("vllm",)),
                     block_export(self.model, self.export_kind, self.dcfg, self.vocab, torch.bfloat16, stage))

    def export_record(self) -> dict:
        return {"format": self.export_kind.export_format, "layer_ids": list(self.dcfg.aux_layer_ids),
                "block_size": self.cfg.block_size, "num_layers": self.cfg.num_layers,
                "mask_token_id": self.dcfg.mask_token_id}

    def scorings(self) -> list[tuple[int, int]]:
        """Every k the block serves (1..B-1), each over its first k slots: the evaluate step's guesses at that k."""
        return [(k, k) for k in range(1, self.cfg.block_size)]

    def for_scoring(self) -> torch.dtype:
        """The weights as the export holds them (bf16), run as the evaluate step runs them: bf16 on a GPU,
        float32 on a CPU."""
        dtype = torch.bfloat16 if self.cuda else torch.float32
        round_as_exported(self.model, torch.bfloat16)
        self.model.to(dtype)
        return dtype

    def guesses(self, b: PackedBatch) -> torch.Tensor:
        length = self.cfg.eval_token_budget + self.cfg.block_size if self.cuda else 0  # one shape on a GPU
        return dflash_guesses(self.model, b, self.chunk, length)


class DSparkArm(DFlashArm):
    """speculators' DSpark draft (its DFlash backbone in full-attention layers, its vanilla Markov head)."""

    export_kind = DSpark()

    def draft_config(self) -> DSparkConfig:
        c = self.cfg
        return DSparkConfig(**super().draft_config().to_dict(), markov_rank=c.markov_rank)

    def build(self, attn: str) -> torch.nn.Module:
        return speculators_dspark(self.dcfg, attn, self.cuda, self.cfg.enable_confidence_head)

    def loss(self, x: dict, loss_config) -> tuple[torch.Tensor, dict]:
        from speculators.losses import resolve_loss_config

        c = self.cfg
        # its TV (no gradient: the acceptance metric, the confidence head's target) through its non-fused
        # twin: the fused one puts a second call of the KL's Triton kernel in the compiled graph (issue 5)
        tv = resolve_loss_config("tv", "eager")["tv"][0]
        _, loss, metrics = self.model(**x, loss_config=loss_config, tv_loss_fn=tv, gamma=c.dflash_decay_gamma,
                                      max_anchors=c.max_anchors, confidence_head_alpha=c.confidence_head_alpha,
                                      per_position_loss_weight=c.per_position_loss_weight, dpace_alpha=c.dpace_alpha)
        return loss, metrics

    def progress(self, metrics: dict) -> dict:
        acc = [float(metrics[f"position_{j}_acc_sum"] / metrics[f"position_{j}_acc_total"].clamp(min=1))
               for j in range(self.cfg.block_size)]
        return {"acc": [round(a, 6) for a in acc],
                "eal": round(float(metrics["eal_sum"] / metrics["eal_total"].clamp(min=1)), 6)}

    def export_record(self) -> dict:
        return {**super().export_record(), "markov_rank": self.cfg.markov_rank,
                "confidence_head_left_out": self.cfg.enable_confidence_head}

    def scorings(self) -> list[tuple[int, int]]:
        """Every k the block serves (1..B: all its slots draft), each over its first k slots."""
        return [(k, k) for k in range(1, self.cfg.block_size + 1)]

    def guesses(self, b: PackedBatch) -> torch.Tensor:
        length = self.cfg.eval_token_budget + self.cfg.block_size if self.cuda else 0
        return dspark_guesses(self.model, b, self.chunk, length)


# ----------------------------------------------------------------------------- speculators' blocks, eaglet's export
# the target's pieces and its vocabulary maps; DSpark's confidence head (eaglet's DSpark has none, and vLLM serves a
# checkpoint without one: its guesses do not read it)
NOT_EXPORTED = ("embed_tokens.", "verifier_lm_head.", "verifier_norm.", "t2d", "d2t", "confidence_head.")


def block_export(model, kind, d: DFlashConfig, vocab: DraftVocab, dtype: torch.dtype, where) -> dict:
    """The export tensors of speculators' DFlashDraftModel or DSparkDraftModel as eaglet's kind (DFlash() or
    DSpark()): its names are vLLM's and eaglet's (fc, hidden_norm, layers.i.self_attn.{q,k,v,o}_proj/q_norm/k_norm,
    layers.i.mlp.*, the two layer norms, norm, lm_head; DSpark's markov_head.markov_w1/markov_w2); the target's
    embedding and verifier pieces, its own vocabulary buffers and a confidence head stay behind (eaglet's d2t and
    t2d go in). A weight of its draft that eaglet's has no name for is refused by name."""
    w = {k: v for k, v in model.state_dict().items() if not k.startswith(NOT_EXPORTED)}
    extra = sorted(set(w) - set(weight_names(kind, d)))
    if extra:
        raise BadInput(f"{where}: speculators' {kind.name} weights {extra} have no place in eaglet's export")
    return export_tensors(kind, w, d, vocab, dtype, where)


@torch.no_grad()
def round_as_exported(model, dtype: torch.dtype) -> None:
    """The exported weights rounded to the export's dtype in place (the target's pieces kept as they are)."""
    for name, p in model.named_parameters():
        if not name.startswith(NOT_EXPORTED):
            p.copy_(p.to(dtype))


@torch.no_grad()
def speculators_blocks(model, b: PackedBatch, first: int, head, chunk: int = 256, length: int = 0) -> torch.Tensor:
    """[T, B - first] draft ids: row t holds slots first..B-1 of speculators' block anchored at t + 1 (its
    _backbone_forward: its forward up to the draft logits, then head(model, x, hidden, logits, block indices) ->
    [chunk, B, V]), remote.draft.dflash_loss.block_guesses' rows; the last row holds 0.

    A forward's loss rows are the chunk's anchors, max_anchors the chunk: its select_anchors then takes all of
    them, sorted, and pads the rest of the chunk with invalid ones (one shape a forward). The batch is padded
    to `length` rows (at least block_size more: select_anchors skips the last block_size)."""
    bs, t = model.block_size, len(b.input_ids)
    x = padded(b, max(length, t + bs))
    out = torch.zeros(t, bs - first, dtype=torch.long, device=b.input_ids.device)
    for a in range(1, t, chunk):
        anchors = torch.arange(a, min(a + chunk, t), device=out.device)
        mask = torch.zeros_like(x["loss_mask"])
        mask[0, anchors] = True
        hidden, logits, _, _, idx = model._backbone_forward(**{**x, "loss_mask": mask}, max_anchors=chunk)
        out[anchors - 1] = head(model, x, hidden, logits, idx)[:len(anchors), first:].argmax(-1)
    return out


def dflash_guesses(model, b: PackedBatch, chunk: int = 256, length: int = 0) -> torch.Tensor:
    """[T, B-1]: slots 1..B-1 (slot 0 holds the anchor), the draft logits as they are."""
    return speculators_blocks(model, b, 1, lambda m, x, h, logits, idx: logits[0].view(chunk, m.block_size, -1),
                              chunk, length)


def markov_logits(model, x: dict, hidden: torch.Tensor, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """[N, B, V] DSpark's logits: the draft logits plus its Markov head's block_bias of the real token at each slot's
    own row (its forward's prev_token_ids with sample_from_anchor: slot k predicts a + k + 1, after the token at
    a + k)."""
    n, bs = idx.numel() // model.block_size, model.block_size
    prev = x["input_ids"][0, idx].view(n, bs)
    bias = model.markov_head.block_bias(prev_token_ids=prev, hidden_states=hidden.view(n, bs, -1))
    return logits.view(n, bs, -1) + bias


def dspark_guesses(model, b: PackedBatch, chunk: int = 256, length: int = 0) -> torch.Tensor:
    """[T, B]: every slot 0..B-1 (slot 0 drafts the token after the anchor), with the Markov bias of the real
    previous token: where every earlier guess of the block was right, the only guesses the chain scorer counts,
    that is what vLLM's left-to-right sampling conditions on."""
    return speculators_blocks(model, b, 0, markov_logits, chunk, length)


def layer_config(d: DFlashConfig, attn: str):
    """speculators' decoder config as its CLI's create_transformer_layer_config builds one from the verifier (a
    Qwen3Config: the target's shapes, silu, the target's rope, untied), but every layer full attention (layer_types;
    the CLI's default is sliding-window layers, causal inside the block for dflash and dspark). attn:
    "simple_flex_attention" on a GPU, "eager" on a CPU."""
    from transformers import Qwen3Config

    n = d.num_layers
    tl = Qwen3Config(vocab_size=d.target_vocab_size, hidden_size=d.hidden_size, intermediate_size=d.intermediate_size,
                     num_hidden_layers=n, num_attention_heads=d.num_heads, num_key_value_heads=d.num_kv_heads,
                     head_dim=d.head_dim, hidden_act="silu", max_position_embeddings=d.max_position_embeddings,
                     rms_norm_eps=d.rms_norm_eps, tie_word_embeddings=False, sliding_window=2048,
                     use_sliding_window=False, layer_types=["full_attention"] * n,
                     rope_parameters={"rope_type": "default", "rope_theta": d.rope_theta, **(d.rope_scaling or {})})
    tl._attn_implementation = attn
    return tl


def block_settings(d: DFlashConfig, attn: str, algorithm: str, drafted: int) -> dict:
    """The settings of speculators' DFlash-family configs that eaglet's shape decides (its verifier weights unset)."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    return dict(transformer_layer_config=layer_config(d, attn), draft_vocab_size=d.draft_vocab_size,
                block_size=d.block_size, aux_hidden_state_layer_ids=dflash_layer_ids(d),
                mask_token_id=d.mask_token_id, sliding_window_non_causal=False,
                speculators_config=SpeculatorsConfig(
                    algorithm=algorithm, proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=drafted)],
                    default_proposal_method="greedy",
                    verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"])))


def speculators_dflash(d: DFlashConfig, attn: str, cuda: bool = False):
    """speculators 0.9.0's own DFlashDraftModel of this shape: slot 0 the anchor (sample_from_anchor false)."""
    import_speculators(cuda)
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig

    return DFlashDraftModel(DFlashSpeculatorConfig(**block_settings(d, attn, "dflash", d.block_size - 1),
                                                   sample_from_anchor=False))


def speculators_dspark(d: DSparkConfig, attn: str, cuda: bool = False, confidence: bool = False):
    """speculators 0.9.0's own DSparkDraftModel of this shape: every slot drafting (sample_from_anchor, its default),
    its vanilla Markov head of rank d.markov_rank (vLLM's only one), its confidence head when `confidence`."""
    import_speculators(cuda)
    from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig

    return DSparkDraftModel(DSparkSpeculatorConfig(
        **block_settings(d, attn, "dspark", d.block_size), sample_from_anchor=True, markov_rank=d.markov_rank,
        markov_head_type="vanilla", enable_confidence_head=confidence, confidence_head_with_markov=True))


ARMS = {"eagle3": Arm, "dflash": DFlashArm, "dspark": DSparkArm}


def run(raw: dict) -> dict:
    cfg = load_config(config_class(raw), raw)
    out = StepOutput(cfg.out_dir, STEP, asdict(cfg))
    if (m := out.done()) is not None:
        return m
    arm = ARMS[cfg.kind](cfg)
    figures = arm.train()
    history = figures.pop("history")
    stage = out.open()
    arm.export(stage)
    (stage / "loss.jsonl").write_text("".join(json.dumps(r) + "\n" for r in history))
    own = arm.own_forward()
    log(f"speculators {cfg.kind}: own forward on the held-out split: acceptance {own['acceptance_length']:.3f}, "
        f"replayed {own['replayed_acceptance_length']}")
    return out.publish(counts={"steps": figures["steps"], "tokens": figures["tokens"]}, figures=figures,
                       own_forward=own, export=arm.export_record())


def main(argv: list[str] | None = None) -> int:
    return step_main(STEP, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
