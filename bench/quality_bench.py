"""Draft quality side by side (issue 12): eaglet and speculators 0.9.0 on one capture, vocabulary and evaluator.

Here, once: every clean ShareGPT conversation prepared (cut to 1,024 tokens) and split with the
SmolLM2 GGUF into two carried parts (bench/eval_bench.py's docstring says how they travel):

    .venv/bin/python bench/eval_bench.py --out /dev/null --pack PACK --conversations 0 --dtype bfloat16

The first 5,000 clean conversations are the first 4,468 rows of that data.parquet (prepare keeps input
order; checked against a prepare of 5,000): `--subset-rows 4468`. On the H200 (the transformers
capture; no vLLM there), with PACK/a and PACK/b joined into smollm2.gguf beside data.parquet:

    python3 bench/quality_bench.py --gguf smollm2.gguf --prepared data.parquet --subset-rows 4468 \
        --arms budget --deadline 540 --cache-root /dev/shm/qb --work /root/qb/work --out $OUT
    python3 bench/quality_bench.py --model-dir /root/qb/work/model --prepared data.parquet \
        --arms ten-minutes --cache-root /dev/shm/qb --work /root/qb/work --out $OUT

bench/h200_queue.sh is the queue the last session ran there and how it travels.

Seen there (2026-12-03): conversion and data selection about 45 s; the transformers capture ran
at 37k tokens/s alone into /dev/shm while it packed samples into one row (transformers' block-diagonal
mask costs the row's length squared), 133.7k since it forwards padded rows (all 9,870 conversations
in 72 s; bench/hf_capture_bench.py). Arms in
parallel on the one GPU do not pay: processes time-slice it (no MPS), so 8 arms at once made
eaglet's top-1 pre-pass 200 s instead of seconds and no arm finished in 9 minutes; run them one
after another (the default) and order a preset by importance.

On this 2-core CPU, the same comparison at a small scale (bench/results/quality-cpu-20261203.json: the arms
and the figures; PACK from eval_bench.py --pack with --conversations 1500 --max-length 512 --dtype float32,
speculators' wheel unpacked on PYTHONPATH):

    .venv/bin/python bench/quality_bench.py --model-dir CACHE/embedded-default/smollm2-135m-instruct-float32 \
        --prepared PACK/a/data.parquet --subset-rows 400 --arms ARMS.json --backend vllm --dtype float32 \
        --capture-tokens 4096 --work WORK --out OUT

The CPU dress rehearsal (a tiny random target of SmolLM2's vocabulary, a few rows, a few steps of
every arm; the same code paths, compiled ones on a GPU):

    .venv/bin/python bench/quality_bench.py --smoke --prepared PACK/a/data.parquet --out /tmp/qsmoke

An arm (bench/quality_arms.json holds the presets; `--arms FILE` takes a JSON list) is a dict:
impl "eaglet" runs `python -m remote.train.train --config` with its `train` dict as TrainConfig keys,
then remote.train.export (its `export` dict as ExportConfig keys); impl "speculators" runs bench.speculators_arm (speculators' own draft of
the `train` dict's kind, eagle3, dflash or dspark, with its loss and optimiser on the same packed capture, converted to eaglet's
export). Both then go through
the same remote.evaluate step, offline, at each `--k` (default 3; `--k 3 5`: two evaluations of the one draft,
the first k the headline `offline`, every k under `offline_by_k`): acceptance length, the replayed one and the
conditional accuracies p1..pk on the held-out split. An arm with "storage": "fp8" trains and is
evaluated on an fp8 copy of its data's capture (the same states, stored as capture.storage_dtype fp8 stores them). Arms share the capture and the vocabulary of
their data ("subset": the first --subset-rows samples; "all": every one); an arm with own_capture
captures its data itself into a fresh cache, timed as its own (the 10-minute arm: capture +
training + offline evaluation within budget_seconds: the trainer gets what is left as its own deadline,
max_seconds, and cuts its steps to what fits at the pace it measures; an eaglet one compiles the trainer's graphs
beside its capture, bench.warm, unless --no-compile-ahead). Arms run one after another, or --parallel at a
time (each a process; `concurrent` in each record names the arms that ran beside it, so its wall
time is read with that). Results go to OUT/quality.json, rewritten as each
arm ends; an arm marked keep leaves its draft in OUT/draft-<name>.tar (the lm_head left out when
it is the target's rows: `--unpack` puts it back here, from the target; a tar over 15 MiB comes in
pieces .00, .01, ... to join with cat).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tarfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.eval_bench import gguf_as_package, run_step  # noqa: E402

ARMS_FILE = Path(__file__).with_name("quality_arms.json")
PIECE = 15 * 2 ** 20  # bytes of one piece of a kept draft
SMOKE_TARGET = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=49152, max_position_embeddings=2048, tie_word_embeddings=False)


# ----------------------------------------------------------------------------- data and target
def select_rows(src: str, dst: Path, rows: int = 0, max_tokens: int = 0, min_heldout: int = 0) -> Path:
    """dst: the first `rows` samples of a prepared data.parquet (0: all), plus held-out ones up to
    `min_heldout`, each cut to `max_tokens` (0: as they are)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    t = pq.read_table(src)
    take = list(range(min(rows, t.num_rows) if rows else t.num_rows))
    split = t.column("split").to_pylist()
    for i in (i for i in range(len(take), t.num_rows) if split[i] == "heldout"):
        if sum(split[j] == "heldout" for j in take) >= min_heldout:
            break
        take.append(i)
    t = t.take(take)
    if max_tokens:
        cols = {c: t.column(c).to_pylist() for c in t.column_names}
        for c in ("input_ids", "loss_mask"):
            cols[c] = [v[:max_tokens] for v in cols[c]]
        cols["length"] = [len(v) for v in cols["input_ids"]]
        t = pa.table(cols, schema=t.schema)
    dst.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(t, dst)
    return dst


def smoke_target(folder: Path, data: str, boost: int) -> str:
    """A random Llama of SmolLM2's vocabulary and a few layers: the dress rehearsal's target. The lm_head
    rows of the data's `boost` most frequent tokens are made longer, so its top-1 mostly lies in the
    draft vocabulary and the figures are not all trivially 1."""
    import pyarrow.parquet as pq
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if not (folder / "config.json").is_file():
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**SMOKE_TARGET))
        rows = pq.read_table(data).slice(0, 64).column("input_ids").to_pylist()
        ids = torch.tensor([i for row in rows for i in row])
        with torch.no_grad():
            model.lm_head.weight[torch.bincount(ids, minlength=SMOKE_TARGET["vocab_size"]).topk(boost).indices] *= 4
        model.save_pretrained(folder)
    return str(folder)


def target_model(a: argparse.Namespace, work: Path) -> str:
    if a.smoke:
        return smoke_target(work / "smoke-target", a.prepared, a.draft_vocab_size)
    if a.model_dir:
        return a.model_dir
    gguf_as_package(a.gguf)
    from remote.data import embedded_default

    model, _ = embedded_default.ensure_model(work / "model", a.dtype)
    return str(model)


# ----------------------------------------------------------------------------- steps
def capture_and_vocab(data: str, model: str, folder: Path, cache_root: str, a) -> dict:
    """The capture and vocab steps of one dataset: their folders, seconds and figures."""
    folder.mkdir(parents=True, exist_ok=True)
    cap_s, cap_m = run_step("capture", {
        "dataset": data, "target": model, "out_dir": str(folder / "capture"), "cache_root": cache_root,
        "backend": a.backend, "samples_per_shard": 256, "max_num_batched_tokens": a.capture_tokens,
        **({"dtype": "float32", "cpu_kvcache_gib": 2} if a.backend == "vllm" else {})}, folder)
    voc_s, voc_m = run_step("vocab", {"data": data, "target": model, "out_dir": str(folder / "vocab"),
                                      "draft_vocab_size": a.draft_vocab_size}, folder)
    return {"data": data, "capture_dir": str(folder / "capture"), "vocab_dir": str(folder / "vocab"),
            "seconds": {"capture": cap_s, "vocab": voc_s}, "capture_figures": cap_m.get("figures"),
            "capture_counts": cap_m.get("counts"), "vocab_coverage": voc_m["figures"]["coverage"]}


def fp8_copy(own: dict, work: Path) -> dict:
    """`own` with its capture's states stored as fp8: the same states quantized as capture.storage_dtype
    fp8 stores them (remote.capture.store), so an arm on it differs from one on `own` by the storage alone."""
    from remote.capture.store import read_shard, write_shard

    src = Path(own["capture_dir"])
    dest = work / f"{src.parent.name}-fp8" / "capture"
    if not (dest / "manifest.json").is_file():
        m = json.loads((src / "manifest.json").read_text())
        c = m["capture"]
        shards = [str(dest / Path(s).name) for s in c["shards"]]
        dest.mkdir(parents=True, exist_ok=True)
        sizes = {d: write_shard(d, list(read_shard(s)), c["layer_ids"], "fp8") for s, d in zip(c["shards"], shards)}
        m["capture"] = {**c, "shards": shards, "shard_bytes": sizes, "storage_dtype": "fp8"}
        (dest / "manifest.json").write_text(json.dumps(m))
    return {**own, "capture_dir": str(dest)}


def size_training(arm: dict, spent: float, a) -> dict:
    """The train dict of a budget_seconds arm: the trainer's own deadline (max_seconds) is what the budget leaves
    after what was spent, --reserve-s (export, evaluate) and --startup-s (the train step's start before the
    trainer's clock runs); its step budget, unless the arm sets one, is the most a run plans (10 epochs), which
    the deadline cuts to what fits at the pace it measures."""
    train = dict(arm.get("train", {}))
    left = arm["budget_seconds"] - spent - a.reserve_s - a.startup_s
    if left < 1:
        raise SystemExit(f"arm {arm['name']}: {spent:.0f} s spent before training leaves no time for it")
    if not any(train.get(k) for k in ("max_steps", "train_tokens", "epochs")):
        train["epochs"] = 10.0
    return {**train, "max_seconds": round(left, 1)}


def run_arm(arm: dict, shared: dict, model: str, a, work: Path, t_start: float, running: list) -> dict:
    name, impl = arm["name"], arm["impl"]
    folder = work / name
    folder.mkdir(parents=True, exist_ok=True)
    rec = {"name": name, "impl": impl, "data": arm.get("data", "subset"), "arm": arm, "seconds": {},
           "started_s": round(time.perf_counter() - t_start, 1), "concurrent": running}
    t0 = time.perf_counter()

    def left() -> float | None:
        """Seconds the next step may run: to the run's deadline and the arm's own budget."""
        limits = ([a.deadline - (time.perf_counter() - t_start)] if a.deadline else []) + (
            [arm["budget_seconds"] - (time.perf_counter() - t0)] if "budget_seconds" in arm else [])
        return max(1.0, min(limits)) if limits else None
    ahead = None
    try:
        if arm.get("own_capture"):
            if impl == "eaglet" and a.compile_ahead:  # the trainer's graphs compiled while the capture runs
                warm = {"target": model, "out_dir": str(folder / "warm"), "draft_vocab_size": a.draft_vocab_size,
                        "train": arm.get("train", {})}
                pool = ThreadPoolExecutor(1)
                ahead = pool.submit(run_step, "warm", warm, folder, left(), "bench.warm")
                pool.shutdown(wait=False)  # its one task runs on; the thread ends with it
            data = shared["datasets"][rec["data"]]
            own = capture_and_vocab(data, model, folder, str(Path(a.cache_root) / name), a)
            rec.update(setup=own)
            rec["seconds"].update(own["seconds"])
        else:
            own = shared[rec["data"]]
        if ahead is not None:  # waited for inside the arm's time: the trainer gets what is left after it
            t = time.perf_counter()
            try:
                rec["seconds"]["warm"], wm = ahead.result()
                rec["warm"] = {**wm["figures"], "waited_s": round(time.perf_counter() - t, 1)}
            except SystemExit as e:  # the run goes on, compiling for itself
                rec["warm"] = {"error": str(e)[-1000:]}
        if arm.get("storage") == "fp8":
            own = fp8_copy(own, work)
        train = size_training(arm, time.perf_counter() - t0, a) if "budget_seconds" in arm else dict(arm.get("train", {}))
        rec["train_settings"] = train
        common = {"capture_dir": own["capture_dir"], "vocab_dir": own["vocab_dir"], "target": model}
        if impl == "eaglet":
            cfg = {**common, "out_dir": str(folder / "train"), "checkpoint_every": 10 ** 9, **train}
            rec["seconds"]["train"], tm = run_step("train", cfg, folder, left())
            rec["seconds"]["export"], _ = run_step("export", {"train_dir": str(folder / "train"), "vocab_dir":
                                                              own["vocab_dir"], "out_dir": str(folder / "export"),
                                                              **arm.get("export", {})}, folder, left())
        elif impl == "speculators":
            cfg = {**common, "out_dir": str(folder / "export"), **train}
            rec["seconds"]["train"], tm = run_step("speculators_arm", cfg, folder, left(), module="bench.speculators_arm")
            rec["own_forward"] = tm.get("own_forward")
        else:
            raise SystemExit(f"arm {name}: impl {impl!r} is neither eaglet nor speculators")
        rec["train"] = {**tm.get("figures", {}), **{k: v for k, v in tm.get("counts", {}).items()}}
        rec["train"].pop("history", None)
        ks = arm_ks(a.k, folder / "export")
        rec["offline_by_k"] = evaluate_at(ks, model, own, folder, left(), rec["seconds"])
        rec["offline"] = rec["offline_by_k"][str(ks[0])]
        if arm.get("keep"):
            rec["kept"] = keep_draft(folder / "export", model, Path(a.out) / f"draft-{name}.tar")
    except SystemExit as e:  # a failed or killed step: the other arms go on; the record says why
        rec["error"] = str(e)[-3000:]
    rec["wall_s"] = round(time.perf_counter() - t0, 1)
    return rec


def arm_ks(ks: list[int], export: Path) -> list[int]:
    """The k a draft is evaluated at: --k's, a block drafter's cut to the tokens its block drafts (its kind's
    drafted_tokens: DFlash block_size - 1, DSpark block_size), in --k's order without repeats."""
    from remote.draft.folder import read_folder

    folder = read_folder(export)
    most = folder.kind.drafted_tokens(folder.draft_config())
    return list(dict.fromkeys(min(k, most) if most else k for k in ks))


def evaluate_at(ks: list[int], model: str, own: dict, folder: Path, limit: float | None, seconds: dict) -> dict:
    """The arm's export through the evaluate step, offline, once for each k (at once: each is a process and the GPU
    work of one is small): {k: acceptance length, the replayed one, conditional accuracies, held-out coverage}."""
    def one(k: int) -> tuple[int, float, dict]:
        work = folder if k == ks[0] else folder / f"k{k}"  # its config and log beside the others'
        work.mkdir(exist_ok=True)
        s, em = run_step("evaluate", {
            "target": model, "draft_dir": str(folder / "export"), "data": own["data"],
            "capture_dir": own["capture_dir"], "out_dir": str(work / "evaluate"), "num_speculative_tokens": k,
            "online": False}, work, limit)
        ev = json.loads((work / "evaluate" / "evaluation.json").read_text())
        return k, s, {**em["figures"], "by_k": ev.get("offline", {}).get("acceptance_length_by_k")}

    out = {}
    with ThreadPoolExecutor(len(ks)) as pool:
        for k, s, f in pool.map(one, ks):
            seconds["evaluate" if k == ks[0] else f"evaluate_k{k}"] = s
            out[str(k)] = {"k": k, "acceptance_length": f.get("offline_acceptance_length"),
                           "replayed": f.get("offline_replayed_acceptance_length"),
                           "conditional_accuracy": f.get("offline_conditional_accuracy"),
                           "heldout_coverage": f.get("heldout_coverage"),
                           # a chain draft's expected acceptance length at every k its offline run made (1..7)
                           "acceptance_length_by_k": f.get("by_k")}
    return out


# ----------------------------------------------------------------------------- drafts that travel back
def keep_draft(export: Path, model: str, dest: Path) -> dict:
    """export as a tar at dest; its lm_head left out when it is the target's rows (a 32k x H matrix)."""
    import torch
    from safetensors.torch import load_file, save_file

    w = load_file(str(export / "model.safetensors"))
    rows = target_rows(model, w)
    frozen = bool(torch.equal(w["lm_head.weight"], rows.to(w["lm_head.weight"].dtype)))
    stage = dest.with_suffix(".d")
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    shutil.copy2(export / "config.json", stage / "config.json")
    save_file({k: v for k, v in w.items() if not (frozen and k == "lm_head.weight")}, str(stage / "model.safetensors"))
    (stage / "lm_head.json").write_text(json.dumps({"target_rows": frozen, "sha256": digest(w["lm_head.weight"])}))
    with tarfile.open(dest, "w") as tar:
        tar.add(stage, arcname="export")
    shutil.rmtree(stage)
    size, parts = dest.stat().st_size, [dest.name]
    if size > PIECE:  # one returned file may hold 16 MiB: pieces, joined here with cat
        data = dest.read_bytes()
        dest.unlink()
        parts = []
        for i in range(0, size, PIECE):
            parts.append(f"{dest.name}.{i // PIECE:02d}")
            (dest.parent / parts[-1]).write_bytes(data[i:i + PIECE])
    return {"tar": dest.name, "bytes": size, "files": parts, "lm_head_left_out": frozen}


def target_rows(model: str, w: dict):
    """The target's lm_head rows of the draft vocabulary (d2t), in the target's dtype."""
    import torch

    from remote.draft.config import DraftConfig
    from remote.train.state import load_target_head_weights

    dcfg = DraftConfig.from_target_dir(model, draft_vocab_size=len(w["d2t"]), aux_layer_ids=(0,))
    _, lm_head, _ = load_target_head_weights(Path(model), dcfg)
    return lm_head[torch.arange(len(w["d2t"])) + w["d2t"]].contiguous()


def digest(t) -> str:
    """sha256 of a tensor's bytes: the lm_head put back here must be the one left out there."""
    import hashlib

    import torch

    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def unpack(tar: str, model: str, dest: Path) -> Path:
    """A kept draft made whole again here: its lm_head from this copy of the target when it was left out."""
    from safetensors.torch import load_file, save_file

    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(tar) as t:
        t.extractall(dest, filter="data")
    export = dest / "export"
    w = load_file(str(export / "model.safetensors"))
    head = json.loads((export / "lm_head.json").read_text())
    if head["target_rows"]:
        w["lm_head.weight"] = target_rows(model, w).to(w["fc.weight"].dtype).contiguous()
        if digest(w["lm_head.weight"]) != head["sha256"]:
            raise SystemExit(f"{tar}: the target {model} gives another lm_head than the one left out; "
                             "use the target the draft was trained with (the same dtype)")
        save_file(w, str(export / "model.safetensors"), metadata={"format": "pt"})
    return export


# ----------------------------------------------------------------------------- main
def arms_of(spec: str) -> list[dict]:
    if Path(spec).is_file():
        return json.loads(Path(spec).read_text())
    presets = json.loads(ARMS_FILE.read_text())
    if spec not in presets:
        raise SystemExit(f"--arms {spec}: neither a file nor a preset of {ARMS_FILE.name} ({sorted(presets)})")
    return presets[spec]


def check_arms(arms: list[dict]) -> None:
    """Every arm's settings against the config it becomes (unknown keys, bad values), before anything runs."""
    from bench.speculators_arm import config_class
    from remote.step import BadInput, load_config
    from remote.train.config import ExportConfig, TrainConfig

    paths = {"capture_dir": "c", "vocab_dir": "v", "out_dir": "o"}
    for arm in arms:
        try:
            train = arm.get("train", {})
            cls = config_class(train) if arm["impl"] == "speculators" else {"eaglet": TrainConfig}[arm["impl"]]
            load_config(cls, {**paths, "max_steps": 1, **train}, where=f"arm {arm['name']} train")
            load_config(ExportConfig, {"train_dir": "t", "vocab_dir": "v", "out_dir": "o", **arm.get("export", {})},
                        where=f"arm {arm['name']} export")
        except (KeyError, BadInput) as e:
            raise SystemExit(f"arm {arm.get('name')}: {e}") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder of quality.json and the kept drafts")
    ap.add_argument("--prepared", required=True, help="a prepare step's data.parquet (every sample)")
    ap.add_argument("--subset-rows", type=int, default=0, help="the first N samples are the 'subset' data (0: all)")
    ap.add_argument("--arms", help=f"a preset of {ARMS_FILE.name} or a JSON file of arms (default: budget; with "
                                   "--smoke, smoke)")
    ap.add_argument("--only", nargs="*", default=[], help="run only these arms of the preset")
    ap.add_argument("--gguf", default="", help="the SmolLM2 GGUF file (converted once into WORK/model)")
    ap.add_argument("--model-dir", default="", help="the target as an HF folder (instead of --gguf)")
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"), help="of the converted target")
    ap.add_argument("--work", default="/tmp/quality-bench", help="working folder (kept)")
    ap.add_argument("--cache-root", default="", help="capture cache (default WORK/cache; /dev/shm is fastest)")
    ap.add_argument("--parallel", type=int, default=1, help="arms at a time")
    ap.add_argument("--deadline", type=float, default=0, help="seconds from the start; steps still running are killed")
    ap.add_argument("--draft-vocab-size", type=int, default=32000)
    ap.add_argument("--k", type=int, nargs="+", default=[3],
                    help="speculative tokens of the offline figures: each arm is evaluated at each (the first is its headline)")
    ap.add_argument("--backend", default="transformers", choices=("transformers", "vllm"),
                    help="capture backend: transformers on a GPU host without vLLM, vllm (CPU, float32) here")
    ap.add_argument("--capture-tokens", type=int, default=32768, help="tokens of one capture forward")
    ap.add_argument("--startup-s", type=float, default=10,
                    help="budget arms: the train step's seconds before the trainer's clock starts (the interpreter, imports)")
    ap.add_argument("--reserve-s", type=float, default=45,
                    help="budget arms: seconds kept for export and evaluate (they took 26-33 s on an H200)")
    ap.add_argument("--budget-s", type=float, default=0,
                    help="budget arms: this many seconds instead of the arm's budget_seconds (a run that must fit a call)")
    ap.add_argument("--no-compile-ahead", dest="compile_ahead", action="store_false",
                    help="own-capture eaglet arms: do not compile the trainer's graphs beside the capture "
                         "(bench.warm); the trainer's first step then compiles them")
    ap.add_argument("--smoke", action="store_true", help="CPU dress rehearsal: tiny random target, few rows")
    ap.add_argument("--unpack", nargs=2, metavar=("TAR", "DEST"), help="only make a kept draft whole (with --model-dir)")
    ap.add_argument("--check", action="store_true", help="only check the arms' settings against their configs")
    a = ap.parse_args(argv)
    if a.unpack:
        print(unpack(a.unpack[0], a.model_dir, Path(a.unpack[1])))
        return 0
    if a.check:
        check_arms(arms_of(a.arms or "budget"))
        return 0
    t_start = time.perf_counter()
    work, out = Path(a.work), Path(a.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    a.cache_root = a.cache_root or str(work / "cache")
    if a.smoke:
        a.subset_rows, a.draft_vocab_size, a.capture_tokens = 24, 1024, 4096
    arms = [x for x in arms_of(a.arms or ("smoke" if a.smoke else "budget")) if not a.only or x["name"] in a.only]
    if a.budget_s:
        arms = [{**x, "budget_seconds": a.budget_s} if "budget_seconds" in x else x for x in arms]
    check_arms(arms)
    model = target_model(a, work)
    cut = dict(max_tokens=256, min_heldout=3) if a.smoke else {}
    datasets = {"all": str(select_rows(a.prepared, work / "data-all" / "data.parquet", 48 if a.smoke else 0, **cut)),
                "subset": str(select_rows(a.prepared, work / "data-subset" / "data.parquet", a.subset_rows, **cut))}
    result = {"settings": {k: v for k, v in vars(a).items()}, "model": model, "setup_seconds": {}, "arms": []}
    shared: dict = {"datasets": datasets}
    for name in sorted({x.get("data", "subset") for x in arms if not x.get("own_capture")}):
        shared[name] = capture_and_vocab(datasets[name], model, work / f"shared-{name}", a.cache_root, a)
        result[f"shared_{name}"] = shared[name]
    result["setup_seconds"] = round(time.perf_counter() - t_start, 1)
    lock, running = threading.Lock(), []

    def one(arm: dict) -> None:
        with lock:
            running.append(arm["name"])
        rec = run_arm(arm, shared, model, a, work, t_start, [n for n in running if n != arm["name"]])
        with lock:
            running.remove(arm["name"])
            result["arms"].append(rec)
            result["elapsed_s"] = round(time.perf_counter() - t_start, 1)
            write_result(out / "quality.json", result)
        print(summary_line(rec), flush=True)

    with ThreadPoolExecutor(max_workers=a.parallel) as pool:
        list(pool.map(one, arms))
    write_result(out / "quality.json", result)
    print(json.dumps([summary_line(r) for r in result["arms"]], indent=1))
    return 0 if all("error" not in r for r in result["arms"]) else 1


def write_result(path: Path, result: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str))
    os.replace(tmp, path)


def summary_line(r: dict) -> str:
    off, tr = r.get("offline") or {}, r.get("train") or {}
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    acc = "/".join(f"{p:.2f}" for p in off.get("conditional_accuracy") or [])
    return (f"{r['name']}: {tr.get('tokens', '-')} tokens, wall {r['wall_s']} s (beside {len(r['concurrent'])}), "
            f"acceptance {fmt(off.get('acceptance_length'))}, replayed {fmt(off.get('replayed'))}, p {acc}"
            + (f", ERROR {r['error'][-300:]}" if "error" in r else ""))


if __name__ == "__main__":
    raise SystemExit(main())
