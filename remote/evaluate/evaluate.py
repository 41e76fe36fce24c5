"""The evaluate step: the exported draft's acceptance, offline on held-out captures and online in vLLM.

    python -m remote.evaluate.evaluate --config c.json
    # {"target": "/models/target", "draft_dir": "/runs/r1/export", "data": "/runs/r1/prepare/data.parquet",
    #  "capture_dir": "/runs/r1/capture", "out_dir": "/runs/r1/evaluate", "num_speculative_tokens": 3,
    #  "online": {"prompts": 32, "max_tokens": 64, "temperature": 0.7}}

Offline: the draft runs its chain of `offline_steps` guesses over the held-out split's captured
states (teacher-forced on the data's tokens, as in training) and each guess is compared with the
target's top-1 (from the captured final state through the target's norm and lm_head); the chain
math is remote.evaluate.acceptance. Two offline figures come of it: the expected acceptance length from
the per-step conditional accuracies (every position a chain start), and the "replayed" one, which
walks each assistant turn the way greedy decoding does (a chain starts where the last one ended);
on text the target wrote itself the replayed one is what vLLM counts. Online: remote.evaluate.online
(vLLM's own counters). The draft is checked against the target before either starts, so a draft
for another model is a BadInput.

Writes out_dir/evaluation.json: offline and online results, the training loss curve and the
draft's provenance (vocabulary coverage, data fingerprint); the manifest's figures are the flat
summary a flow returns and a promotion compares (`acceptance_length`: online when measured,
else the replayed offline one).
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from remote.evaluate.acceptance import ChainCounts, chain_counts, greedy_walk, leading_right, turn_spans
from remote.evaluate.online import OnlineConfig, check_draft, measure_online, summary
from remote.step import BadInput, StepOutput, load_config, log, read_manifest, step_main, write_json_atomic

STEP = "evaluate"
RESULT_FILE = "evaluation.json"
LOSS_POINTS = 256  # the loss curve kept for the report, at most this many points


@dataclass(frozen=True, kw_only=True)
class EvaluateConfig:
    target: str  # the target model's folder on this host
    draft_dir: str  # the exported draft (remote.train.export)
    data: str  # the prepare step's data.parquet (or folder): held-out prompts for the online run
    out_dir: str  # where evaluation.json and the manifest go (through out_dir.partial)
    capture_dir: str = ""  # a finished capture: the offline run reads its held-out samples ("": no offline run)
    num_speculative_tokens: int = 3  # k: the acceptance length reported is for k speculative tokens
    offline_steps: int = 0  # chain steps measured offline (0: k); the per-position table shows them all
    offline_max_tokens: int = 262144  # held-out captured tokens the offline run reads at most
    token_budget: int = 2048  # tokens per offline batch (dense attention: memory grows with its square)
    device: str = "auto"  # offline device: "auto" (cuda when there is one), "cuda" or "cpu"
    run_online: bool = True  # measure in vLLM too
    online: dict = field(default_factory=dict)  # remote.evaluate.online.OnlineConfig fields (prompts, max_tokens, ...)
    train_dir: str = ""  # the train step folder (loss curve); "": the one the draft's export manifest names
    vocab_dir: str = ""  # the vocab step folder (coverage); "": the one the export manifest names

    def __post_init__(self):
        if self.num_speculative_tokens < 1 or self.offline_steps < 0:
            raise ValueError("num_speculative_tokens must be >= 1 and offline_steps >= 0")
        if self.device not in ("auto", "cuda", "cpu"):
            raise ValueError(f"device={self.device!r}: choose auto, cuda or cpu")
        if not self.capture_dir and not self.run_online:
            raise ValueError("nothing to measure: give capture_dir (offline) or run_online=true")

    def online_config(self) -> OnlineConfig:
        fixed = {"target": self.target, "draft_dir": self.draft_dir, "data": self.data,
                 "num_speculative_tokens": self.num_speculative_tokens}
        clash = sorted(set(fixed) & set(self.online))
        if clash:
            raise BadInput(f"online: {clash} are set at the top level of the evaluate config, not under online")
        return load_config(OnlineConfig, {**self.online, **fixed}, where="online")


# ----------------------------------------------------------------------------- the draft as a model
def draft_config_from_export(c: dict):
    """The DraftConfig of an exported draft's config.json (the inverse of remote.train.export.vllm_config)."""
    from remote.draft.config import DraftConfig

    heads = int(c["num_attention_heads"])
    return DraftConfig(
        hidden_size=int(c["hidden_size"]), num_heads=heads, num_kv_heads=int(c.get("num_key_value_heads") or heads),
        head_dim=int(c.get("head_dim") or int(c["hidden_size"]) // heads), intermediate_size=int(c["intermediate_size"]),
        target_vocab_size=int(c["vocab_size"]), draft_vocab_size=int(c["draft_vocab_size"]),
        aux_layer_ids=tuple(c["eagle_aux_hidden_state_layer_ids"]), rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        rope_theta=float(c.get("rope_theta", 10000.0)), rope_scaling=c.get("rope_scaling"),
        max_position_embeddings=int(c.get("max_position_embeddings", 8192)),
        target_hidden_size=c.get("target_hidden_size"))


def load_draft(draft_dir: str, target: str, device: torch.device, dtype: torch.dtype):
    """(EagleDraft with the target's embedding, TargetHead, t2d) for an exported draft folder."""
    from safetensors.torch import load_file

    from remote.draft.loss import TargetHead
    from remote.draft.model import EagleDraft
    from remote.train.state import load_target_head_weights

    dcfg = draft_config_from_export(json.loads((Path(draft_dir) / "config.json").read_text()))
    weights = {}
    for f in sorted(Path(draft_dir).glob("*.safetensors")):
        weights.update(load_file(str(f)))
    weights.pop("d2t")  # offline guesses are compared in draft ids; t2d maps the target's
    t2d = weights.pop("t2d").bool()
    embed, lm_head, norm = load_target_head_weights(Path(target), dcfg)
    draft = EagleDraft(dcfg)
    missing, unexpected = draft.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False)
    if set(missing) != {"embed_tokens.weight"} or unexpected:
        raise BadInput(f"draft {draft_dir}: weights missing {sorted(set(missing) - {'embed_tokens.weight'})}, "
                       f"unexpected {sorted(unexpected)}")
    draft.embed_tokens.weight = torch.nn.Parameter(embed.to(dtype), requires_grad=False)
    head = TargetHead.from_weights(norm, lm_head, t2d, dcfg.rms_norm_eps, drop_outside_top1=True)
    return draft.to(device, dtype).eval(), head.to(device, dtype), t2d


# ----------------------------------------------------------------------------- offline
def chain_of_batch(draft, head, b, steps: int, k: int) -> tuple[ChainCounts, int, int]:
    """Chain counts of one packed batch (start row t, step k guesses token t+2+k from token t+1+k)
    and (drafts, accepted) of greedy decoding with k speculative tokens replayed along its turns."""
    from remote.draft.model import TTTAttention

    t = len(b.input_ids)
    idx = torch.arange(t, device=b.input_ids.device)
    attn = TTTAttention(b.doc_ids, "dense")
    hidden = draft.fc(b.aux)
    guesses = []
    for k in range(steps):
        nxt = (idx + 1 + k).clamp(max=t - 1)  # the token read
        prenorm, normed = draft.step(draft.embed(b.input_ids[nxt]), hidden, b.positions + k, attn)
        guesses.append(draft.lm_head(normed).argmax(-1))
        hidden = prenorm
    return score_chains(torch.stack(guesses, 1), head, b, k)


def score_chains(guesses: torch.Tensor, head, b, k: int) -> tuple[ChainCounts, int, int]:
    """Chain counts and the greedy replay (drafts, accepted) of a draft's guesses [T, steps] (draft ids;
    row t, step j guesses token t+2+j) against the target's top-1 on this packed batch."""
    t, steps = guesses.shape
    idx = torch.arange(t, device=b.input_ids.device)
    tgt = head.targets(b, steps)
    truths, known = [], []
    for j in range(steps):
        nxt = (idx + 1 + j).clamp(max=t - 1)  # the token read; the target's top-1 there is the one to match
        # outside the draft vocabulary the target's choice cannot be guessed: -1 never matches
        truths.append(torch.where(tgt.in_draft[nxt], tgt.logits[nxt].argmax(-1), torch.full_like(nxt, -1)))
        nj = (idx + 2 + j).clamp(max=t - 1)
        known.append((idx + 2 + j < t) & (b.doc_ids[nj] == b.doc_ids) & b.loss_mask[nj])
    g, tr, kn = guesses.cpu(), torch.stack(truths, 1).cpu(), torch.stack(known, 1).cpu()
    drafts, accepted = greedy_walk(leading_right(g, tr, kn).tolist(), turn_spans(b.loss_mask.cpu(), b.doc_ids.cpu()), k)
    return chain_counts(g, tr, kn), drafts, accepted


@torch.no_grad()
def measure_offline(cfg: EvaluateConfig, steps: int) -> dict:
    from remote.capture.store import CaptureSet
    from remote.draft.data import CaptureIndex

    capture = CaptureSet.from_manifest(cfg.capture_dir)
    aux = json.loads((Path(cfg.draft_dir) / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"]
    if list(capture.layer_ids) != list(aux):
        raise BadInput(f"capture {cfg.capture_dir} holds layers {list(capture.layer_ids)}, the draft reads {aux}")
    index = CaptureIndex.build(capture, split="heldout")
    cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    device, dtype = torch.device("cuda" if cuda else "cpu"), torch.bfloat16 if cuda else torch.float32
    draft, head, t2d = load_draft(cfg.draft_dir, cfg.target, device, dtype)
    t0 = time.perf_counter()
    k = min(cfg.num_speculative_tokens, steps)
    counts, tokens, loss_tokens, covered, drafts, accepted = ChainCounts.zeros(steps), 0, 0, 0, 0, 0
    order = sorted(range(len(index.refs)), key=lambda i: index.refs[i].sample_id)  # a stable subset
    batches = _batches(order, index.lengths, cfg.token_budget, cfg.offline_max_tokens)
    for batch in batches:  # seconds even on a CPU: no progress events (the online run's are the step's)
        b = index.load(batch, cfg.token_budget).to(device, dtype)
        c, d, a = chain_of_batch(draft, head, b, steps, k)
        counts, drafts, accepted = counts + c, drafts + d, accepted + a
        tokens += b.n_tokens
        loss_ids = b.input_ids[b.loss_mask].cpu()
        loss_tokens += len(loss_ids)
        covered += int(t2d[loss_ids].sum())
    return {"steps": steps, "samples": sum(len(b) for b in batches), "tokens": tokens,
            "heldout_coverage": covered / loss_tokens if loss_tokens else None,
            "acceptance_length": counts.acceptance_length(k), "k": k,
            "replayed_acceptance_length": 1 + accepted / drafts if drafts else None,
            "replayed": {"drafts": drafts, "accepted": accepted},
            "acceptance_length_by_k": [counts.acceptance_length(j) for j in range(steps + 1)],
            **counts.to_dict(), "seconds": time.perf_counter() - t0}


def _batches(order: list[int], lengths: list[int], budget: int, max_tokens: int) -> list[list[int]]:
    out, cur, used, total = [], [], 0, 0
    for i in order:
        n = min(lengths[i], budget)
        if total + n > max_tokens and out:
            break
        if cur and used + n > budget:
            out.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
        total += n
    return out + ([cur] if cur else [])


# ----------------------------------------------------------------------------- provenance
def provenance(cfg: EvaluateConfig) -> dict:
    """What the report says about the draft: its vocabulary, training run and data."""
    export_m = read_manifest(cfg.draft_dir) or {}
    made_from = export_m.get("config", {})
    train_dir, vocab_dir = cfg.train_dir or made_from.get("train_dir", ""), cfg.vocab_dir or made_from.get("vocab_dir", "")
    train_m = read_manifest(train_dir) if train_dir else None
    vocab_m = read_manifest(vocab_dir) if vocab_dir else None
    out: dict = {"draft_dir": cfg.draft_dir, "target": cfg.target, "train_dir": train_dir, "vocab_dir": vocab_dir}
    if vocab_m:
        out["draft_vocab_size"] = vocab_m.get("vocab", {}).get("draft_vocab_size")
        out["target_vocab_size"] = vocab_m.get("vocab", {}).get("target_vocab_size")
        out["coverage"] = vocab_m.get("figures", {}).get("coverage")
    if train_m:
        t = train_m.get("train", {})
        out["data_fingerprint"] = t.get("data_fingerprint")
        out["train_figures"] = train_m.get("figures", {})
        out["loss_curve"] = _loss_curve(Path(train_dir) / t.get("loss_curve", "loss.jsonl"))
    return out


def _loss_curve(path: Path) -> list[list[float]]:
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    every = max(1, len(rows) // LOSS_POINTS)
    keep = rows[::every] + ([rows[-1]] if rows and (len(rows) - 1) % every else [])
    return [[r["step"], r["loss"]] for r in keep]


# ----------------------------------------------------------------------------- the step
def figures_of(result: dict) -> dict:
    """The flat figures of the manifest (what the flow returns and promotion compares)."""
    f: dict = {}
    off, on = result.get("offline"), result.get("online")
    if off:
        f.update(offline_acceptance_length=off["acceptance_length"],
                 offline_replayed_acceptance_length=off["replayed_acceptance_length"],
                 offline_conditional_accuracy=off["conditional_accuracy"], heldout_coverage=off["heldout_coverage"])
    if on:
        f.update({f"online_{k}" if k == "acceptance_length" else k: v for k, v in summary(on).items()})
    # Without vLLM the replayed figure stands in: it counts the way decoding does (the per-position
    # estimate weights easy stretches more than decoding visits them, so it runs high).
    offline_best = f.get("offline_replayed_acceptance_length") or f.get("offline_acceptance_length")
    f["acceptance_length"] = f["online_acceptance_length"] if on else offline_best
    f["acceptance_length_source"] = "online" if on else "offline, replayed"
    prov = result["provenance"]
    for key in ("coverage", "draft_vocab_size", "data_fingerprint"):
        if prov.get(key) is not None:
            f[key] = prov[key]
    if prov.get("train_figures", {}).get("final_loss") is not None:
        f["final_loss"] = prov["train_figures"]["final_loss"]
    f["evaluate_seconds"] = result["seconds"]
    return f


def run(raw: dict) -> dict:
    cfg = load_config(EvaluateConfig, raw)
    online_cfg = cfg.online_config() if cfg.run_online else None  # its errors are bad input too
    out = StepOutput(cfg.out_dir, STEP, asdict(cfg))
    if (m := out.done()) is not None:
        log(f"evaluate: {cfg.out_dir} is already done")
        return m
    check_draft(cfg.draft_dir, cfg.target)  # before any model is loaded or any engine starts
    t0 = time.perf_counter()
    result: dict = {"provenance": provenance(cfg)}
    if cfg.capture_dir:
        result["offline"] = measure_offline(cfg, cfg.offline_steps or cfg.num_speculative_tokens)
        off = result["offline"]
        log(f"evaluate: offline acceptance length {off['acceptance_length']:.3f} at k={off['k']} "
            f"over {off['tokens']} held-out tokens, {off['seconds']:.1f} s")
    if online_cfg is not None:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the offline model's blocks back to the GPU, for vLLM's share
        result["online"] = measure_online(online_cfg)
        log(f"evaluate: online acceptance length {summary(result['online'])['acceptance_length']} "
            f"in {result['online']['seconds']:.1f} s")
    result["seconds"] = time.perf_counter() - t0
    stage = out.open()
    write_json_atomic(stage / RESULT_FILE, result)
    figures = figures_of(result)
    return out.publish(counts={"offline_samples": result.get("offline", {}).get("samples", 0),
                               "online_prompts": len(result.get("online", {}).get("prompt_ids", []))},
                       figures=figures, evaluation=RESULT_FILE)


def main(argv: list[str] | None = None) -> int:
    return step_main(STEP, run, argv)


if __name__ == "__main__":  # vLLM spawns worker processes, which import this module again
    raise SystemExit(main())
