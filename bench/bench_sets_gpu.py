"""A draft on the standard benchmark sets, offline (issue 34): for a GPU host with transformers and no vLLM.

The target answers every prompt of the sets remote.evaluate.benchmarks knows itself (transformers' greedy
generate, batched with left padding, in its chat template; MT-Bench's second turn is asked after the target's
own first answer, as remote.evaluate.bench_online asks it), the target's states on each (prompt + its answer)
are captured, and eaglet's offline evaluator (remote.evaluate.chains: the draft kind's guesses and score_chains,
what the evaluate step's chain_tally runs on each batch) scores the draft on them at each k, counting only the
answer tokens (the loss mask: what the target wrote, its end-of-turn token included). Each turn is one sample, as
vLLM sees one request a turn: a second turn's sample is its whole prompt (the first turn and answer re-rendered by the
template) and its answer. On text the target wrote itself, the replayed acceptance length is what vLLM
counts; the per-position one (from p1..pk) runs higher.

The pieces are eaglet's: the prompts are remote.data.regenerate's (Writer: the target's template and end-of-turn
tokens; HfGenerator: batched greedy generate), the states remote.capture.backend_transformers' (HfCapture,
written as a capture shard), the batches remote.draft.data's, the draft remote.evaluate.evaluate's load_draft
(checked as the evaluate step checks it), the figures ChainTally.summary.

Here (the benchmark packages are installed here, not on the GPU host), once:

    .venv/bin/python bench/bench_sets_gpu.py --write-prompts bench/results/bench_prompts.json

CAPS below: MT-Bench all 80 questions (both turns), GSM8K 200 of 1,319 (round-robin: its first 200), HumanEval
all 164, AIME 2025 all 30: 474 first turns and 80 second ones. At 256 new tokens a turn and 128 prompts a batch,
that is 4 + 1 batches of at most 256 decode steps of SmolLM2-135M, each step bound by kernel launches rather
than by the batch (an estimate, not yet timed on the GPU: about 20-30 ms a step on an H100, so 30-40 s; the
capture and scoring of the ~250k tokens take seconds there). The first call there can check it with --limit 8.

On the GPU host, in the same device call as bench/quality_bench.py, after it (its trained arm's export is
<work>/<arm>/export; the target it used is <work>/model when it converted the GGUF, else its --model-dir; the
prompts file travels in the working tree):

    python3 bench/quality_bench.py --gguf smollm2.gguf --prepared data.parquet --subset-rows 4468 \\
        --arms budget --cache-root /dev/shm/qb --work /root/qb/work --out $OUT && \\
    python3 bench/bench_sets_gpu.py --prompts bench/results/bench_prompts.json --model-dir /root/qb/work/model \\
        --draft /root/qb/work/<arm>/export --k 3 5 7 --max-new-tokens 256 --out $OUT/bench_sets.json

(<arm>: an eaglet arm of the preset run, e.g. eaglet-e1-lr1e-3 of `budget`. A draft kept by an earlier call,
OUT/draft-<arm>.tar, comes back whole with `quality_bench.py --unpack TAR DEST --model-dir M`.)

`--limit 4` takes 4 prompts a set (a smoke run). Writes OUT (per set: prompts, turns, answer tokens, answers cut
at max_new_tokens; at each k the acceptance length, the replayed one, p1..pk; the same per category and, for
MT-Bench, per turn (by_turn); the seconds of generation, capture and scoring; the device; the draft's kind) and
OUT with .md: the table, sets by k, which it also prints.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Prompts a set (0: all); see the docstring for what fits a couple of minutes of generation on an H100.
CAPS = {"mt-bench": 0, "gsm8k": 200, "humaneval": 0, "aime2025": 0}
BATCH = 128  # prompts generated together (a decode step costs about the same at 8 or 128 rows)
PACK_TOKENS = 16384  # tokens (padding counted) of one capture forward
SPLIT = "heldout"  # every sample's split in the shard: the index reads all of them (no held-out half is taken)


# ----------------------------------------------------------------------------- prompts (here)
def write_prompts(path: Path, caps: dict[str, int]) -> dict:
    """The sets' prompts, capped, as one JSON file (what the GPU host cannot read from packages)."""
    from dataclasses import asdict

    from remote.evaluate.benchmarks import load, version_of

    doc = {"caps": caps, "versions": {n: version_of(n) for n in caps},
           "sets": {n: [asdict(p) for p in load(n, c)] for n, c in caps.items()}}
    path.write_text(json.dumps(doc, indent=1))
    return doc


def read_prompts(path: Path, limit: int) -> dict:
    """{set: [BenchPrompt]} of a --write-prompts file, each set cut to `limit` over its categories (0: all)."""
    from remote.evaluate.benchmarks import BenchPrompt, cap

    doc = json.loads(path.read_text())
    return {n: cap([BenchPrompt(p["id"], p["category"], tuple(p["turns"])) for p in ps], limit)
            for n, ps in doc["sets"].items()}


# ----------------------------------------------------------------------------- generation
def settings(a: argparse.Namespace):
    """The transformers engine's settings, as the regenerate step's (greedy; cut answers kept)."""
    from remote.data.config import RegenerateConfig

    return RegenerateConfig(inputs=[str(a.prompts)], target=a.model_dir, out_dir="", cache_root="",
                            backend="transformers", max_tokens=a.max_new_tokens, batch_size=a.batch_size,
                            keep_cut=True, device=a.device, dtype=a.dtype, max_num_batched_tokens=PACK_TOKENS)


def generate(cfg, sets: dict) -> tuple[list[dict], dict]:
    """Every turn answered greedily, turn by turn (a later turn sees the target's own earlier answers): one
    record a turn (set, id, category, turn, prompt_ids, answer_ids, stopped), and what was left out, by reason."""
    from remote.capture.layers import TargetConfig, resolve_dtype
    from remote.data.chat_data import BadRecord
    from remote.data.regenerate import Writer
    from remote.data.regenerate_engines import HfGenerator, Request

    writer, target = Writer(cfg), TargetConfig.read(cfg.target)
    engine = HfGenerator(cfg, target, resolve_dtype(cfg, target), writer.end_ids, 0)
    engine.start()
    history = {(n, p.id): [] for n, ps in sets.items() for p in ps}
    records, left_out = [], {}
    try:
        for t in range(max(len(p.turns) for ps in sets.values() for p in ps)):
            asking = [(n, p) for n, ps in sets.items() for p in ps if len(p.turns) > t and history[n, p.id] is not None]
            prompts = [writer.prompt(history[n, p.id] + [("user", p.turns[t])]) for n, p in asking]
            answers = engine.generate([Request(ids, 0, True) for ids in prompts], cfg)
            for (n, p), ids, ans in zip(asking, prompts, answers):
                records.append({"set": n, "id": p.id, "category": p.category, "turn": t + 1, "prompt_ids": ids,
                                "answer_ids": ans.token_ids, "stopped": ans.stopped})
                try:  # the next turn's context: the answer as its text (regenerate's rule)
                    history[n, p.id] += [("user", p.turns[t]), ("assistant", writer.content(ans, "keep", True))]
                except BadRecord as e:
                    if len(p.turns) > t + 1:  # no later turn asked after an unusable answer
                        left_out[e.reason] = left_out.get(e.reason, 0) + len(p.turns) - t - 1
                    history[n, p.id] = None
    finally:
        engine.close()
    return records, left_out


# ----------------------------------------------------------------------------- capture and scoring
def capture(cfg, records: list[dict], layer_ids, shard: Path):
    """The target's states on every (prompt + answer), loss-masked on the answer, as one capture shard."""
    import numpy as np

    from remote.capture.backend_transformers import HfCapture
    from remote.capture.cache import SampleRow, ShardPlan
    from remote.capture.layers import TargetConfig, resolve_dtype
    from remote.capture.store import CaptureSet, Sample, write_shard

    target = TargetConfig.read(cfg.target)
    dtype = resolve_dtype(cfg, target)
    rows = tuple(SampleRow(sample_id(r), SPLIT, np.array(r["prompt_ids"] + r["answer_ids"], np.int32),
                           np.array([0] * len(r["prompt_ids"]) + [1] * len(r["answer_ids"]), np.uint8))
                 for r in records)
    engine = HfCapture(cfg, target, dtype, layer_ids, 0)
    engine.start()
    try:
        states = engine.shard_states(ShardPlan(0, str(shard), rows))
    finally:
        engine.close()
    write_shard(shard, [Sample(s.sample_id, s.split, torch.from_numpy(s.input_ids), torch.from_numpy(s.loss_mask), aux,
                               last) for s, (aux, last) in zip(rows, states)], layer_ids)
    return CaptureSet((str(shard),), tuple(layer_ids), target.hidden_size, dtype, cfg.target)


def sample_id(r: dict) -> str:
    return f"{r['id']}#{r['turn']}"


def load_checked_draft(draft_dir: str, model_dir: str, ks: list[int]):
    """(folder, draft model, TargetHead, device, dtype): the evaluate step's checks and loading."""
    from remote.evaluate.evaluate import load_draft
    from remote.evaluate.online_measure import check_draft
    from remote.step import BadInput

    folder = check_draft(draft_dir, model_dir)
    most = folder.kind.drafted_tokens(folder.draft_config())
    if most is not None and max(ks) > most:
        raise BadInput(f"--k {max(ks)}: the {folder.kind.name} draft {draft_dir} guesses at most {most} tokens")
    cuda = torch.cuda.is_available()
    device, dtype = torch.device("cuda" if cuda else "cpu"), torch.bfloat16 if cuda else torch.float32
    draft, head, _ = load_draft(folder, model_dir, device, dtype)
    return folder, draft, head, device, dtype


def score(capture_set, records: list[dict], draft, head, device, dtype, ks: list[int]) -> dict:
    """{(set, category, turn): {k: ChainTally}}: each group's samples, every row of them, batched as the evaluate step
    batches its held-out split."""
    from remote.draft.data import CaptureIndex
    from remote.evaluate.chains import chain_tallies, heldout_plan

    index = CaptureIndex.build(capture_set, split=SPLIT)
    group = {sample_id(r): (r["set"], r["category"], r["turn"]) for r in records}
    budget = max(index.lengths)  # no sample cut: the evaluator's budget cuts each sample to it
    tallies = {}
    for key in dict.fromkeys(group.values()):
        sub = CaptureIndex([r for r in index.refs if group[r.sample_id] == key], index.hidden_size, index.n_aux,
                           index.dtype, SPLIT)
        plan = heldout_plan(sub, budget, sum(sub.lengths))
        tallies[key] = chain_tallies(draft, head, (sub.load(p, budget).to(device, dtype) for p in plan), max(ks), ks)
    return tallies


def summed(tallies: list[dict]) -> dict:
    """{k: ChainTally} of several groups added up."""
    return {k: sum((t[k] for t in tallies[1:]), tallies[0][k]) for k in tallies[0]}


def figures(tally: dict, records: list[dict]) -> dict:
    """One group's report: its size, and at each k the acceptance length, the replayed one and p1..pk."""
    by_k = {}
    for k, t in tally.items():
        s = t.summary(k)
        by_k[str(k)] = {"acceptance_length": s["acceptance_length"], "replayed_acceptance_length":
                        s["replayed_acceptance_length"], "conditional_accuracy": s["conditional_accuracy"][:k],
                        "replayed": s["replayed"]}
    last = tally[max(tally)].summary(max(tally))
    return {"prompts": len({r["id"] for r in records}), "turns": len(records),
            "answer_tokens": sum(len(r["answer_ids"]) for r in records),
            "cut_at_max_tokens": sum(not r["stopped"] for r in records), "by_k": by_k,
            "attempts": last["attempts"], "accepted": last["accepted"]}


def report(tallies: dict, records: list[dict]) -> dict:
    """Per set: its figures, per category, and per turn where it has several."""
    sets = {}
    for name in dict.fromkeys(r["set"] for r in records):
        keys = [key for key in tallies if key[0] == name]
        of = lambda pick: [r for r in records if pick((r["set"], r["category"], r["turn"]))]  # noqa: E731
        out = figures(summed([tallies[k] for k in keys]), of(lambda g: g[0] == name))
        out["categories"] = {c: figures(summed([tallies[k] for k in keys if k[1] == c]),
                                        of(lambda g, c=c: g[0] == name and g[1] == c))
                             for c in dict.fromkeys(k[1] for k in keys)}
        turns = sorted({k[2] for k in keys})
        if len(turns) > 1:
            out["by_turn"] = {str(t): figures(summed([tallies[k] for k in keys if k[2] == t]),
                                            of(lambda g, t=t: g[0] == name and g[2] == t)) for t in turns}
        sets[name] = out
    return sets


def table(sets: dict, ks: list[int]) -> str:
    """Markdown: a row a set, a column a k; replayed acceptance length (per-position estimate in brackets)."""
    head = "| set | prompts | answer tokens | " + " | ".join(f"k={k}" for k in ks) + " |"
    rows = [head, "|" + "---|" * (3 + len(ks))]
    for name, s in sets.items():
        cells = [f"{s['by_k'][str(k)]['replayed_acceptance_length'] or 0:.2f} "
                 f"({s['by_k'][str(k)]['acceptance_length']:.2f})" for k in ks]
        rows.append(f"| {name} | {s['prompts']} | {s['answer_tokens']} | " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


# ----------------------------------------------------------------------------- the run
def run(a: argparse.Namespace) -> dict:
    import transformers

    from remote.step import log

    sets, cfg = read_prompts(a.prompts, a.limit), settings(a)
    folder, draft, head, device, dtype = load_checked_draft(a.draft, a.model_dir, a.k)  # refused before generating
    t0 = time.perf_counter()
    records, left_out = generate(cfg, sets)
    t1 = time.perf_counter()
    log(f"bench_sets: {len(records)} turns answered in {t1 - t0:.1f} s")
    with tempfile.TemporaryDirectory(prefix="bench-sets-") as tmp:
        capture_set = capture(cfg, records, list(folder.draft_config().aux_layer_ids), Path(tmp) / "bench.safetensors")
        t2 = time.perf_counter()
        tallies = score(capture_set, records, draft, head, device, dtype, a.k)
    t3 = time.perf_counter()
    result = {"settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
              "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                           "sets": json.loads(a.prompts.read_text())["versions"]},
              "target": a.model_dir, "draft": {"dir": a.draft, "kind": folder.kind.name, "method": folder.kind.method},
              "seconds": {"generation": t1 - t0, "capture": t2 - t1, "scoring": t3 - t2},
              "generation": {"turns": len(records), "new_tokens": sum(len(r["answer_ids"]) for r in records),
                             "left_out_turns": left_out},
              "sets": report(tallies, records)}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
    a.out.with_suffix(".md").write_text(table(result["sets"], a.k))
    return result


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--write-prompts", type=Path, help="write the capped prompts of every set here and stop")
    p.add_argument("--prompts", type=Path, help="a --write-prompts file")
    p.add_argument("--model-dir", help="the target's HF folder")
    p.add_argument("--draft", help="an eaglet export folder")
    p.add_argument("--k", type=int, nargs="+", default=[3, 5, 7], help="speculative tokens scored")
    p.add_argument("--max-new-tokens", type=int, default=256, help="tokens an answer may have (a turn)")
    p.add_argument("--limit", type=int, default=0, help="prompts a set, over its categories (0: the file's)")
    p.add_argument("--batch-size", type=int, default=BATCH, help="prompts generated together")
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    p.add_argument("--dtype", default="auto", help="the target's dtype (auto: its config.json's)")
    p.add_argument("--out", type=Path, help="the result JSON (a .md table beside it)")
    a = p.parse_args(argv)
    if not a.write_prompts and not all((a.prompts, a.model_dir, a.draft, a.out)):
        p.error("give --write-prompts FILE, or --prompts, --model-dir, --draft and --out")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.write_prompts:
        doc = write_prompts(a.write_prompts, CAPS)
        print({n: len(ps) for n, ps in doc["sets"].items()})
        return 0
    print(table(run(a)["sets"], a.k), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
