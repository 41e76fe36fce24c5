"""Training throughput of the EAGLE-3 draft step, eaglet beside the speculators anchor.

    python bench/train_bench.py --shape llama8b kimi25 --ttt 3 7 --impl eaglet speculators --out r.jsonl
    python bench/train_bench.py --shape llama8b kimi25 --settings defaults --impl eaglet speculators --out r.jsonl
    python bench/train_bench.py --shape tiny --ttt 2 --impl eaglet --steps 2      # the CPU smoke
    torchrun --nproc-per-node 2 bench/train_bench.py --shape llama8b --ttt 3      # DDP scaling (issue 8)

One step = what remote.train.train does for an optimizer step (remote.train.train.optimizer_step): target
logits and masks, the unrolled TTT forward, loss, backward, gradient clipping, the optimizer. Inputs are
synthetic with the real shapes: `--tokens` packed positions a step (samples of `--doc-len`), bf16
hidden states, an all-ones loss mask. tokens/s counts positions a step (not times TTT).

FLOPs (stated, per step, what MFU divides by the step time and the bf16 dense peak):
  matmuls: per TTT step and position 2*(q,k,v,o,gate,up,down,lm_head params), plus fc (3H*H) once;
  times 3 for forward + backward (the standard 6N; counted the same for both implementations even
  where a frozen lm_head skips its weight gradient), plus the target's draft-vocab logits 2*H*Vd
  once a position, plus attention 4*d*heads*(keys seen) forward, times 3.5 with its backward.
  Not counted: eaglet's full-vocabulary top-1 check (2*H*(V-Vd) a position, forward only), which
  the trainer runs once a sample before training (remote.train.train), not in the step: it is timed
  apart and reported as `top1_pass_tokens_per_s`.
The speculators side (0.9.0, if importable) is its own compiled Eagle3DraftModel.forward with
its fused KL loss under bf16 autocast, then backward, clip (1.0) and its optimizer (its own build_optimizers:
Muon + AdamW, or AdamW), as its trainer does.

Settings (`--settings`, one record each): `equal` runs both trainers at the flags' settings (--ttt, --optimizer,
--norms, --train-lm-head, --step-decay: the same for both); `defaults` runs each at its own defaults, what a user
gets who sets nothing (eaglet: TrainOptions and DraftConfig; speculators 0.9.0: its trainer's, as
bench.speculators_arm.SpeculatorsArmConfig states them), with the flags and --ttt unused. A record's `settings`
and `setting` say which ran.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from remote.draft.config import DraftConfig  # noqa: E402
from remote.draft.loss import PackedBatch, TargetHead, TTTObjective  # noqa: E402
from remote.draft.model import EagleDraft  # noqa: E402
from remote.train.config import TrainOptions  # noqa: E402
from remote.train.optimizers import build_optimizer  # noqa: E402
from remote.train.profiling import profile_tables  # noqa: E402
from remote.train.train import optimizer_step  # noqa: E402
from remote.train.state import Distributed  # noqa: E402

SHAPES = {  # H, heads, kv heads, head dim, intermediate, target vocab, draft vocab
    "llama8b": dict(hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336,
                    target_vocab_size=128256, draft_vocab_size=32000, rope_theta=500000.0),
    "kimi25": dict(hidden_size=7168, num_heads=64, num_kv_heads=64, head_dim=128, intermediate_size=18432,
                   target_vocab_size=163840, draft_vocab_size=32000, rope_theta=50000.0),
    "smollm2": dict(hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64, intermediate_size=1536,
                    target_vocab_size=49152, draft_vocab_size=8192, rope_theta=100000.0),  # the demo's, CPU
    "tiny": dict(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
                 target_vocab_size=512, draft_vocab_size=128),
}
PEAK_BF16 = 989e12  # H200 SXM dense bf16, datasheet
NORMS = ("norm_before_fc", "norm_before_residual", "norm_output")


class Setting(NamedTuple):
    """What one trainer's step runs with (the speed depends on these; the learning rate is recorded, not timed)."""

    ttt: int
    step_decay: float
    optimizer: str  # "muon" (Muon + AdamW) or "adamw"
    lr: float
    norms: bool  # the three norms of NORMS (eaglet's defaults may set some: `norm_flags` says which)
    train_lm_head: bool
    norm_flags: tuple = ()

    def record(self) -> dict:
        return {**self._asdict(), "norm_flags": list(self.norm_flags)}


def own_defaults(impl: str) -> Setting:
    """A trainer's defaults: what a user who sets nothing trains with."""
    if impl == "eaglet":
        t = TrainOptions()
        draft = {f.name: f.default for f in dataclasses.fields(DraftConfig) if f.name in NORMS}
        on = tuple(n for n in NORMS if draft[n])
        return Setting(t.ttt_steps, t.step_decay, t.optimizer, t.lr, len(on) == len(NORMS), t.train_lm_head, on)
    from bench.speculators_arm import SpeculatorsArmConfig  # its trainer's defaults (it imports this module)

    f = {x.name: x.default for x in dataclasses.fields(SpeculatorsArmConfig) if x.default is not dataclasses.MISSING}
    return Setting(f["ttt_steps"], f["ttt_step_loss_decay"], f["optimizer"], f["lr"], f["norms"], False,
                   NORMS if f["norms"] else ())


def equal_settings(args, ttt: int) -> Setting:
    """The flags' settings, the same for both trainers."""
    return Setting(ttt, args.step_decay, args.optimizer, args.lr, args.norms, args.train_lm_head,
                   NORMS if args.norms else ())


def draft_config(shape: str, draft_vocab: int = 0) -> DraftConfig:
    c = {**SHAPES[shape], **({"draft_vocab_size": draft_vocab} if draft_vocab else {})}
    return DraftConfig(**c, aux_layer_ids=(2, 16, 29), rms_norm_eps=1e-5)


def step_flops(c: DraftConfig, tokens: int, doc_len: int, ttt: int) -> float:
    h, d = c.hidden_size, c.head_dim
    per_pos = (2 * h * c.num_heads * d + 2 * 2 * h * c.num_kv_heads * d + c.num_heads * d * h
               + 3 * h * c.intermediate_size + h * c.draft_vocab_size)
    matmul = 3 * 2 * tokens * (ttt * per_pos + 3 * h * h) + 2 * tokens * h * c.draft_vocab_size
    keys = (doc_len + 1) / 2  # causal, averaged over a sample; plus the diagonal keys of earlier steps
    attn = sum(3.5 * 4 * d * c.num_heads * tokens * (keys + k) for k in range(ttt))
    return matmul + attn


def synthetic_batch(c: DraftConfig, tokens: int, doc_len: int, device, dtype, seed: int = 0) -> PackedBatch:
    g = torch.Generator(device="cpu").manual_seed(seed)
    lengths = [doc_len] * (tokens // doc_len) + ([tokens % doc_len] if tokens % doc_len else [])
    b = PackedBatch(
        input_ids=torch.randint(0, c.target_vocab_size, (tokens,), generator=g),
        loss_mask=torch.ones(tokens, dtype=torch.bool),
        aux=torch.randn(tokens, c.fc_in, generator=g),
        last=torch.randn(tokens, c.hidden_size, generator=g),
        positions=torch.cat([torch.arange(n) for n in lengths]),
        doc_ids=torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)),
        n_tokens=tokens,
    )
    return b.to(device, dtype)


def _target_weights(c: DraftConfig, device, dtype, seed: int = 1):
    g = torch.Generator(device="cpu").manual_seed(seed)
    embed = (torch.randn(c.target_vocab_size, c.hidden_size, generator=g) * 0.02).to(device, dtype)
    lm_head = (torch.randn(c.target_vocab_size, c.hidden_size, generator=g) * 0.02).to(device, dtype)
    t2d = torch.zeros(c.target_vocab_size, dtype=torch.bool)
    t2d[torch.randperm(c.target_vocab_size, generator=g)[: c.draft_vocab_size]] = True
    # Real data: the target's top-1 lies in the draft vocabulary almost always (coverage ~95%+), so
    # nearly every position counts. Random rows would put it outside ~75% of the time and let eaglet
    # (which drops those positions from the loss) skip most of its head work: larger draft rows keep
    # the synthetic top-1 inside.
    lm_head[t2d.to(lm_head.device)] *= 2.0
    return embed, lm_head, t2d.to(device)


# ----------------------------------------------------------------------------- the two steps
def eaglet_step(c: DraftConfig, s: Setting, device, dist: Distributed, loss_chunk: int = 0):
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    embed, lm_head, t2d = _target_weights(c, device, dtype)
    torch.manual_seed(0)
    c = DraftConfig(**{**c.to_dict(), **{n: n in s.norm_flags for n in NORMS}})
    draft = EagleDraft(c)
    draft.embed_tokens.weight = torch.nn.Parameter(embed, requires_grad=False)
    draft.to(device)
    with torch.no_grad():
        draft.lm_head.weight.copy_(lm_head[t2d].float())
    draft.lm_head.weight.requires_grad_(s.train_lm_head)
    if cuda:
        draft.compile_layers()
    head = TargetHead.from_weights(torch.ones(c.hidden_size, device=device, dtype=dtype), lm_head, t2d, c.rms_norm_eps)
    del lm_head
    obj = TTTObjective(draft, s.ttt, s.step_decay, "flex" if cuda else "dense", compiled=cuda, chunk=loss_chunk)
    model = dist.wrap(obj)
    params = [p for p in draft.parameters() if p.requires_grad]
    # the trainer's own: AdamW, or Muon for the hidden matrices and AdamW beside it
    opt = build_optimizer(TrainOptions(optimizer=s.optimizer, lr=s.lr), draft, cuda)

    def step(batch: PackedBatch):
        stats, _ = optimizer_step(model, head, [batch], opt, params, dist, s.ttt, 0.5)
        return stats

    return step, obj, head


def speculators_draft(c: DraftConfig, ttt: int, norms: bool = False, attn: str = "simple_flex_attention"):
    """speculators 0.9.0's own Eagle3DraftModel of this shape (its weights unset: NaN lm_heads).

    norms: its eagle3 defaults norm_before_fc, norm_before_residual and norm_output (off: plain EAGLE-3).
    attn: its draft attention ("simple_flex_attention" on a GPU, "eager" on a CPU).
    """
    import types

    # speculators.models.eagle3.data imports its training data module (datasets, openai,
    # hs_connectors) for one type name; the model step needs none of it, the GPU image has no
    # datasets/openai: stand in a module holding that name.
    stub = types.ModuleType("speculators.train.data")
    stub.BatchType = dict
    sys.modules["speculators.train.data"] = stub
    import speculators.losses.fused as fused
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig

    # torch 2.11 / triton 3.6: the fused loss's two kernels share one autotune `configs` list and the
    # backward's launch fails; giving the backward kernel its own copy is the known fix (issue 5).
    fused.loss_backward_kernel.configs = list(fused._tile_configs())
    tl = LlamaConfig(hidden_size=c.hidden_size, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
                     head_dim=c.head_dim, intermediate_size=c.intermediate_size, vocab_size=c.target_vocab_size,
                     num_hidden_layers=1, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
                     max_position_embeddings=c.max_position_embeddings)
    tl._attn_implementation = attn
    cfg = Eagle3SpeculatorConfig(
        transformer_layer_config=tl, draft_vocab_size=c.draft_vocab_size, norm_before_residual=norms,
        norm_before_fc=norms, norm_output=norms, eagle_aux_hidden_state_layer_ids=list(c.aux_layer_ids),
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=ttt)],
            default_proposal_method="greedy", verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"])))
    return Eagle3DraftModel(cfg)


def speculators_step(c: DraftConfig, s: Setting, device):
    from types import SimpleNamespace

    from speculators.losses import resolve_loss_config
    from speculators.train.optimizers import build_optimizers

    from bench.speculators_arm import SpeculatorsArmConfig

    model = speculators_draft(c, s.ttt, s.norms)
    embed, lm_head, t2d = _target_weights(c, torch.device("cpu"), torch.float32)
    with torch.no_grad():  # its verifier pieces start as NaN until loaded from a verifier: load ours
        model.embed_tokens.weight.copy_(embed)
        model.lm_head.weight.copy_(lm_head[t2d])
        model.verifier_lm_head.weight.copy_(lm_head[t2d])
        ids = t2d.nonzero().squeeze(1)
        model.t2d.copy_(t2d)
        model.d2t.copy_(ids - torch.arange(len(ids)))
    model.lm_head.weight.requires_grad_(s.train_lm_head)
    model.to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    d = SpeculatorsArmConfig(capture_dir="", vocab_dir="", out_dir="")  # its trainer's optimizer settings but these
    opts = build_optimizers(model, SimpleNamespace(
        optimizer=s.optimizer, lr=s.lr, weight_decay=d.weight_decay, muon_lr=s.lr, muon_momentum=d.muon_momentum,
        muon_weight_decay=d.muon_weight_decay, muon_ns_steps=d.muon_ns_steps, muon_adjust_lr_fn=d.muon_adjust_lr_fn))
    loss_config = resolve_loss_config("kl_div", "fused")

    def step(b: PackedBatch):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            _, loss, _ = model(hidden_states=b.aux[None], input_ids=b.input_ids[None], document_ids=b.doc_ids[None],
                               loss_mask=b.loss_mask[None], position_ids=b.positions[None],
                               verifier_last_hidden_states=b.last[None], ttt_steps=s.ttt,
                               ttt_step_loss_decay=s.step_decay, loss_config=loss_config)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)
        return loss.detach()

    return step, model


# ----------------------------------------------------------------------------- measuring
def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(impl: str, shape: str, s: Setting, args, dist: Distributed) -> dict:
    device = dist.device
    c = draft_config(shape, args.draft_vocab)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    batches = [synthetic_batch(c, args.tokens, args.doc_len, device, dtype, seed=i + 100 * dist.rank) for i in range(2)]
    top1 = {}
    if impl == "speculators":
        step, model = speculators_step(c, s, device)
    else:  # the trainer's pre-pass: the top-1 check once a sample, then the step reads the flags
        step, model, head = eaglet_step(c, s, device, dist, args.loss_chunk)
        for i in range(2):  # the first pass compiles nothing but warms the matmuls
            _sync(device)
            t = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
                flags = [head.in_draft(b.last) for b in batches]
            _sync(device)
            top1["top1_pass_tokens_per_s"] = round(len(batches) * args.tokens / (time.perf_counter() - t), 1)
        for b, f in zip(batches, flags):
            b.in_draft = f
        head.other_rows = None
    if device.type == "cuda":  # the step's peak apart from the pre-pass's (which comes first, once)
        if top1:
            top1["top1_pass_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2 ** 30, 2)
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    step(batches[0])
    _sync(device)
    first = time.perf_counter() - t0
    for i in range(args.warmup):
        step(batches[(i + 1) % 2])
    _sync(device)
    times = []
    for i in range(args.steps):
        t = time.perf_counter()
        out = step(batches[i % 2])
        _sync(device)
        times.append(time.perf_counter() - t)
    med = statistics.median(times)
    prof = profile_steps(step, batches, device, args.profile) if args.profile else {}
    flops = step_flops(c, args.tokens, args.doc_len, s.ttt)
    rec = {"impl": impl, "shape": shape, "ttt": s.ttt, "tokens": args.tokens, "doc_len": args.doc_len,
           "world": dist.world, "train_lm_head": s.train_lm_head, "setting": s.record(), "first_step_s": round(first, 2),
           "step_s_median": round(med, 5), "step_s_min": round(min(times), 5),
           "tokens_per_s": round(args.tokens / med, 1), "tflops_per_step": round(flops / 1e12, 2),
           "mfu": round(flops / med / PEAK_BF16, 4) if device.type == "cuda" else None,
           "finite": bool(torch.isfinite(out).all()), **top1, **prof}
    if impl == "eaglet":
        rec.update(draft_vocab=c.draft_vocab_size, loss_chunk=model.chunk)
    rec.update(optimizer=s.optimizer, norms=s.norms)
    if impl != "speculators":  # share of positions the loss counted (step 0), after the top-1 check
        rec["counted_share"] = round(float(out[0, 2]) / args.tokens, 4)
    if device.type == "cuda":
        rec["peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2 ** 30, 2)
        rec["gpu"] = torch.cuda.get_device_name()
    del step, model, batches, top1
    return rec


def profile_steps(step, batches, device, path: str) -> dict:
    """4 steps under torch.profiler: the ops' table (by device time, then host time) appended to `path`, how
    busy the device was over the steps' wall time (a share well under 1: the host's launches and waits bound it),
    and the kernel launches and aten ops a step."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    _sync(device)
    with profile(activities=acts) as p:
        t = time.perf_counter()
        for i in range(4):
            step(batches[i % 2])
        _sync(device)
        wall = time.perf_counter() - t
    # the device's own events (kernels, copies), each once: the table's rows also give host ops and annotations
    # (Optimizer.step) the device time of their kernels, so a sum over them counts kernels twice or more
    busy = sum(e.time_range.elapsed_us() for e in p.events() if e.device_type == DeviceType.CUDA) / 1e6
    launches = sum(1 for e in p.events() if e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx"))
    ops = sum(1 for e in p.events() if e.name.startswith("aten::"))  # nested ones too: the host's dispatches
    with open(path, "a") as f:
        f.write(profile_tables(p, device.type == "cuda", f"4 steps, {wall:.3f} s"))
    return {"profiled_wall_s": round(wall, 4), "device_busy_share": round(busy / wall, 3) if busy else None,
            "launches_per_step": launches / 4, "aten_ops_per_step": ops / 4}


def check_flex_against_dense(device) -> dict:
    """The GPU path (compiled flex attention) against the dense one, forward and gradients, bf16."""
    c = draft_config("tiny")
    c = DraftConfig(**{**c.to_dict(), "hidden_size": 256, "num_heads": 4, "num_kv_heads": 2, "head_dim": 64})
    b = synthetic_batch(c, 384, 100, device, torch.bfloat16)
    embed, lm_head, t2d = _target_weights(c, device, torch.bfloat16)
    head = TargetHead.from_weights(torch.ones(c.hidden_size, device=device, dtype=torch.bfloat16), lm_head, t2d, 1e-5)
    out = {}
    for backend in ("dense", "flex"):
        torch.manual_seed(0)
        d = EagleDraft(c)
        d.embed_tokens.weight = torch.nn.Parameter(embed, requires_grad=False)
        d.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            tgt = head.targets(b, 3)
            loss, _ = TTTObjective(d, 3, TrainOptions().step_decay, backend, compiled=backend == "flex")(b, tgt, tgt.counts)
        loss.backward()
        out[backend] = (loss.item(), torch.cat([p.grad.flatten().float() for p in d.parameters() if p.grad is not None]))
    rel = ((out["dense"][1] - out["flex"][1]).norm() / out["dense"][1].norm()).item()
    return {"check": "flex_vs_dense", "loss_dense": out["dense"][0], "loss_flex": out["flex"][0], "grad_rel_diff": rel}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", nargs="+", default=["llama8b"], choices=sorted(SHAPES))
    ap.add_argument("--ttt", nargs="+", type=int, default=[3])
    ap.add_argument("--impl", nargs="+", default=["eaglet"], choices=["eaglet", "speculators"])
    ap.add_argument("--tokens", type=int, default=8192, help="packed positions a step (per rank)")
    ap.add_argument("--doc-len", type=int, default=2048, help="sample length inside the packed batch")
    ap.add_argument("--steps", type=int, default=8, help="timed steps (median reported)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps after the first")
    ap.add_argument("--settings", nargs="+", default=["equal"], choices=["equal", "defaults"],
                    help="equal: both trainers at the flags below and --ttt; defaults: each at its own defaults")
    ap.add_argument("--train-lm-head", action="store_true", help="train lm_head (speculators 0.9.0 keeps it frozen)")
    ap.add_argument("--check", action="store_true", help="first compare flex and dense attention on the GPU")
    ap.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw",
                    help="equal settings: the optimiser of both, AdamW or Muon + AdamW (each trainer's own build)")
    ap.add_argument("--lr", type=float, default=TrainOptions().lr, help="equal settings: the peak lr of both")
    ap.add_argument("--step-decay", type=float, default=TrainOptions().step_decay,
                    help="equal settings: the loss weight of TTT step k is this**k, in both")
    ap.add_argument("--norms", action="store_true", help="equal settings: both drafts with the three norms " + "/".join(NORMS))
    ap.add_argument("--draft-vocab", type=int, default=0, help="draft vocabulary size (0: the shape's)")
    ap.add_argument("--loss-chunk", type=int, default=0,
                    help="rows a chunk of eaglet's fused head and loss (0: the trainer's, remote.draft.loss.loss_chunk_rows)")
    ap.add_argument("--profile", default="", help="also profile 4 steps (torch.profiler): tables into this file")
    ap.add_argument("--out", default="", help="append one JSON line a result here")
    args = ap.parse_args(argv)
    dist = Distributed.from_env("auto")
    if args.tokens < args.doc_len:
        args.doc_len = args.tokens
    results = []
    if args.check and dist.device.type == "cuda":
        results.append(check_flex_against_dense(dist.device))
        print(json.dumps(results[-1]), flush=True)
    runs = [(name, ttt) for name in args.settings for ttt in (args.ttt if name == "equal" else [0])]
    for shape in args.shape:
        for name, ttt in runs:
            for impl in args.impl:
                try:
                    s = equal_settings(args, ttt) if name == "equal" else own_defaults(impl)
                    rec = {"settings": name, **measure(impl, shape, s, args, dist)}
                except Exception as e:  # keep the other measurements; say what failed
                    rec = {"settings": name, "impl": impl, "shape": shape, "ttt": ttt,
                           "error": f"{type(e).__name__}: {e}"[:2000]}
                results.append(rec)
                if dist.rank == 0:
                    print(json.dumps(rec), flush=True)
                    if args.out:
                        with open(args.out, "a") as f:
                            f.write(json.dumps(rec) + "\n")
    dist.close()
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
