"""Regenerated vs original answers (issue 13): the same token budget trained on the target's own answers
and on the data's, each draft evaluated on held-out text the target wrote and on the data's own.

    python3 bench/regen_quality_bench.py --model-dir /root/qb/work/model --conversations sharegpt.jsonl \
        --prompts 4000 --max-tokens 512 --batch-size 1024 --work /root/qb/regen --cache-root /dev/shm/rq --out $OUT

One target (SmolLM2-135M-Instruct here, --gguf or --model-dir as bench/quality_bench.py takes them). The
first --prompts ShareGPT conversations whose first user turn has at most --max-prompt-chars characters,
cut to that turn and its answer, are the "original" data (ChatGPT's answers). The regenerate step
(remote.data.regenerate, the transformers backend: the lent GPU has no vLLM) has the target answer the
same prompts with its chat template: greedy, at most --max-tokens tokens, answers cut there kept (the
original data is cut at prepare's max_length too). Both go through the steps as the flow runs them:
prepare (max_length 1,024; the same held-out prompts, by sample hash), capture and vocab, then the
training recipe of quality_arms.json's ten-minutes arm for the same number of steps of --token-budget
tokens (--epochs of the smaller train split), export. Each draft is evaluated offline (k = 3) on both
held-out splits: "regenerated" is the text the target wrote, greedily, which is what vLLM's acceptance
counts when it serves; "original" is ChatGPT's. Results go to OUT/regen_quality.json.

A step whose out_dir already holds a manifest is not run again (a later call on the same work folder
goes on where an earlier one stopped). `--smoke`: a CPU dress rehearsal on the float32 SmolLM2 (a few
prompts, 32-token answers, a few steps).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.eval_bench import run_step  # noqa: E402
from bench.quality_bench import arms_of, capture_and_vocab, target_model, write_result  # noqa: E402

K = 3
DATASETS = ("original", "regenerated")


def first_turns(src: str, dst: Path, n: int, max_chars: int) -> int:
    """dst: the first n conversations of src (ShareGPT JSONL) whose first user turn has at most max_chars
    characters, cut to that turn and its answer (a system turn before them kept); returns how many."""
    out = []
    with open(src) as f:
        for line in f:
            rec = json.loads(line)
            turns = rec.get("conversations") or []
            system = [t for t in turns[:1] if t.get("from") == "system"]
            rest = turns[len(system):]
            if (len(rest) >= 2 and rest[0].get("from") == "human" and rest[1].get("from") == "gpt"
                    and 0 < len(rest[0]["value"]) <= max_chars and rest[1]["value"].strip()):
                out.append(json.dumps({"id": rec.get("id", str(len(out))), "conversations": system + rest[:2]}))
            if len(out) == n:
                break
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text("\n".join(out) + "\n")
    return len(out)


def step(name: str, config: dict, folder: Path, **kw) -> tuple[float, dict]:
    """run_step, or the manifest an earlier run of this step left in its out_dir (0 seconds)."""
    done = Path(config["out_dir"]) / "manifest.json"
    if done.is_file():
        return 0.0, json.loads(done.read_text())
    folder.mkdir(parents=True, exist_ok=True)
    return run_step(name, config, folder, **kw)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--conversations", required=True, help="ShareGPT JSONL (the embedded default's sharegpt-all)")
    ap.add_argument("--prompts", type=int, default=4000)
    ap.add_argument("--max-prompt-chars", type=int, default=2000)
    ap.add_argument("--heldout-permille", type=int, default=50, help="prepare's (and so regenerate's) held-out share")
    ap.add_argument("--max-tokens", type=int, default=512, help="of a regenerated answer")
    ap.add_argument("--batch-size", type=int, default=1024, help="prompts generated together")
    ap.add_argument("--gguf", default="")
    ap.add_argument("--model-dir", default="")
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--backend", default="transformers", choices=("transformers", "vllm"), help="capture and regenerate")
    ap.add_argument("--capture-tokens", type=int, default=32768)
    ap.add_argument("--draft-vocab-size", type=int, default=32000)
    ap.add_argument("--token-budget", type=int, default=8192, help="tokens a training step")
    ap.add_argument("--epochs", type=float, default=1.0, help="of the smaller train split: both arms' steps")
    ap.add_argument("--work", default="/tmp/regen-quality")
    ap.add_argument("--cache-root", default="")
    ap.add_argument("--smoke", action="store_true", help="CPU dress rehearsal (with --model-dir: the float32 SmolLM2)")
    a = ap.parse_args(argv)
    if a.smoke:
        a.prompts, a.max_tokens, a.batch_size, a.capture_tokens, a.draft_vocab_size = 40, 32, 8, 4096, 2048
        a.token_budget, a.dtype, a.heldout_permille = 1024, "float32", 250
    t_start = time.perf_counter()
    work, out = Path(a.work), Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cache = a.cache_root or str(work / "cache")
    model = target_model(argparse.Namespace(**{**vars(a), "smoke": False}), work)
    result: dict = {"settings": vars(a), "model": model, "seconds": {}, "datasets": {}, "arms": {}}
    n = first_turns(a.conversations, work / "original" / "conversations.jsonl", a.prompts, a.max_prompt_chars)
    result["prompts"] = n
    sources = {"original": str(work / "original" / "conversations.jsonl")}
    regen_cfg = {"inputs": [sources["original"]], "target": model, "out_dir": str(work / "regenerate"),
                 "cache_root": cache, "backend": a.backend, "max_tokens": a.max_tokens, "keep_cut": True,
                 "batch_size": a.batch_size, "samples_per_shard": 1024, "dtype": a.dtype,
                 "heldout_permille": a.heldout_permille}
    if a.backend == "vllm":
        regen_cfg.update(cpu_kvcache_gib=2)
    result["seconds"]["regenerate"], rm = step("regenerate", regen_cfg, work / "regenerate-log")
    result["regenerate"] = {k: rm.get(k) for k in ("figures", "counts", "sample_answers")}
    sources["regenerated"] = str(work / "regenerate" / "conversations.jsonl")
    print(f"regenerated {n} prompts in {result['seconds']['regenerate']:.0f} s: {rm.get('figures')}", flush=True)
    data = {}
    for name in DATASETS:
        folder = work / name
        s, pm = step("prepare", {"inputs": [sources[name]], "tokenizer": model, "out_dir": str(folder / "prepare"),
                                 "max_length": 1024, "heldout_permille": a.heldout_permille}, folder)
        data[name] = capture_and_vocab(str(folder / "prepare" / "data.parquet"), model, folder, f"{cache}/{name}", a)
        data[name]["seconds"]["prepare"] = s
        result["datasets"][name] = {**data[name], "prepare_counts": pm["counts"]}
        write_result(out / "regen_quality.json", result)
    train_tokens = {name: tokens_of(result["datasets"][name]) for name in DATASETS}
    steps = max(1, int(min(train_tokens.values()) * a.epochs // a.token_budget))
    result["train_tokens_per_epoch"], result["steps"] = train_tokens, steps
    recipe = {**arms_of("ten-minutes")[0]["train"], "token_budget": a.token_budget, "max_steps": steps}
    for name in DATASETS:
        folder = work / f"draft-{name}"
        own = data[name]
        arm: dict = {"train_settings": recipe, "seconds": {}, "evaluated_on": {}}
        arm["seconds"]["train"], tm = step("train", {"capture_dir": own["capture_dir"], "vocab_dir": own["vocab_dir"],
                                                     "target": model, "out_dir": str(folder / "train"),
                                                     "checkpoint_every": 10 ** 9, **recipe}, folder)
        arm["train"] = {k: v for k, v in tm.get("figures", {}).items() if k != "history"}
        arm["seconds"]["export"], _ = step("export", {"train_dir": str(folder / "train"), "vocab_dir": own["vocab_dir"],
                                                      "out_dir": str(folder / "export"), "engines": ["vllm"]}, folder)
        for on in DATASETS:
            s, em = step("evaluate", {"target": model, "draft_dir": str(folder / "export"), "data": data[on]["data"],
                                      "capture_dir": data[on]["capture_dir"], "out_dir": str(folder / f"evaluate-{on}"),
                                      "num_speculative_tokens": K, "online": False}, folder)
            f = em["figures"]
            arm["evaluated_on"][on] = {"acceptance_length": f.get("offline_acceptance_length"),
                                       "replayed": f.get("offline_replayed_acceptance_length"),
                                       "conditional_accuracy": f.get("offline_conditional_accuracy"), "seconds": s}
            print(f"trained on {name}, held-out {on}: {arm['evaluated_on'][on]}", flush=True)
        result["arms"][name] = arm
        result["elapsed_s"] = round(time.perf_counter() - t_start, 1)
        write_result(out / "regen_quality.json", result)
    return 0


def tokens_of(dataset: dict) -> int:
    """Train tokens of a prepared dataset."""
    import pyarrow.parquet as pq

    t = pq.read_table(dataset["data"], columns=["split", "length"]).to_pydict()
    return sum(n for sp, n in zip(t["split"], t["length"]) if sp == "train")


if __name__ == "__main__":
    raise SystemExit(main())
