"""Export a trained draft as the folder its serving engine loads (vLLM 0.32; SGLang too where it can run it).

    python -m remote.train.export --config c.json
    # {"train_dir": "/runs/r1/train", "vocab_dir": "/runs/r1/vocab", "out_dir": "/runs/r1/export"}

    LLM(target, speculative_config={"method": "eagle3", "model": "<out_dir>", "num_speculative_tokens": 3})
    LLM(target, speculative_config={"method": "dflash", "model": "<out_dir>", "num_speculative_tokens": 7})  # block 8

The train step's manifest names the draft's kind (train.kind: the flow's train.draft; a folder from before kinds
were recorded holds remote.draft.registry.DEFAULT's), served with that kind's method (the manifest's export.kind
and export.format say which); the kind (remote/draft/<kind>.py: eagle3.py, dflash.py) says what config.json holds,
which engines can serve the draft and what the model card says, and remote.draft.folder writes the folder:
out_dir/config.json, model.safetensors (the draft's weights under the engines' names in `dtype`, `d2t`, `t2d`;
no `embed_tokens`: the engines share the target's) and README.md, the model card (target, data fingerprint,
figures, how to serve it in each engine). What no engine asked for can serve is refused by name before anything
is written (`engines`).
"""
from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file

from remote.draft.folder import DTYPES, export_tensors, write_folder
from remote.draft.registry import DEFAULT, kind
from remote.draft.vocab import DraftVocab
from remote.step import BadInput, begin_step, read_manifest, step_main
from remote.train.config import ExportConfig

STEP = "export"


def run(raw: dict) -> dict:
    cfg, out, done = begin_step(ExportConfig, raw, STEP)
    if done is not None:
        return done
    train_m = read_manifest(cfg.train_dir)
    if train_m is None:
        raise BadInput(f"train_dir {cfg.train_dir}: no finished train step (no manifest.json)")
    tdir = Path(cfg.train_dir)
    draft_kind = kind(train_m["train"].get("kind", DEFAULT))
    d = draft_kind.config.from_dict(json.loads((tdir / train_m["train"]["draft_config"]).read_text()))
    vocab = DraftVocab.load(cfg.vocab_dir)
    if len(vocab.d2t) != d.draft_vocab_size or len(vocab.t2d) != d.target_vocab_size:
        raise BadInput(f"vocab {cfg.vocab_dir} ({len(vocab.d2t)} of {len(vocab.t2d)}) is not the one the draft was "
                       f"trained with ({d.draft_vocab_size} of {d.target_vocab_size})")
    engines = tuple(cfg.engines) or draft_kind.engines(d)
    config = draft_kind.export_config(d, cfg.dtype, engines)  # first: what no engine can serve is refused before any write
    tensors = export_tensors(draft_kind, load_file(str(tdir / train_m["train"]["weights"])), d, vocab,
                             DTYPES[cfg.dtype], tdir)
    stage = out.open()
    write_folder(stage, config, tensors)
    name = cfg.name or Path(cfg.out_dir).name
    (stage / "README.md").write_text(draft_kind.card(name, train_m, read_manifest(cfg.vocab_dir), d, engines))
    params = sum(t.numel() for k, t in tensors.items() if k not in ("d2t", "t2d"))
    return out.publish(counts={"parameters": params}, figures=train_m.get("figures", {}),
                       export={"kind": draft_kind.name, "format": draft_kind.export_format, "layer_ids": list(d.aux_layer_ids),
                               "dtype": cfg.dtype, "engines": list(engines), **draft_kind.export_record(d),
                               "target": train_m["train"].get("target", "")})


def main(argv: list[str] | None = None) -> int:
    return step_main(STEP, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
