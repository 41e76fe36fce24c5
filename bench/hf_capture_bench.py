"""The transformers capture backend's forward: padded rows (what remote.capture.backend_transformers does)
against samples packed back to back into one row (what it did before: transformers then builds a
block-diagonal mask over the whole row), on the same samples, target and device, side by side.

    .venv/bin/python bench/hf_capture_bench.py --model-dir MODEL --prepared data.parquet --samples 64 \
        --pack-tokens 2048 8192 --dtype float32 --out f.json                       # this CPU
    python3 bench/hf_capture_bench.py --model-dir MODEL --prepared data.parquet --samples 2048 \
        --pack-tokens 8192 32768 --out $OUT/hf_capture.json                        # the H200

For each --pack-tokens, both arms take the first --samples prepared samples in shards of 256 (the
capture's planning), run the same forward (output_hidden_states, the last layer's hook) and copy the
states to the CPU, alternating which goes first over --rounds rounds; tokens/s is the samples' tokens
over the seconds of all forwards (the first round of each is a warm-up and not counted when there are
more). The states of the two arms are compared (the largest difference over the largest value).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from remote.capture.backend_transformers import HfCapture  # noqa: E402
from remote.capture.cache import SampleRow, ShardPlan  # noqa: E402
from remote.capture.config import CaptureConfig  # noqa: E402
from remote.capture.layers import TargetConfig, default_layer_ids  # noqa: E402

SHARD = 256


def packed_forward(backend: HfCapture, plan: ShardPlan) -> list:
    """The former path: plan order, back to back into one row of <= max_num_batched_tokens, positions restarting."""
    out, row, size = [], [], 0
    packs = []
    for s in plan.samples:
        if row and size + s.input_ids.size > backend.cfg.max_num_batched_tokens:
            packs.append(row)
            row, size = [], 0
        row.append(s)
        size += s.input_ids.size
    packs += [row] if row else []
    for pack in packs:
        lengths = [int(s.input_ids.size) for s in pack]
        ids = torch.cat([torch.from_numpy(s.input_ids).long() for s in pack])[None].to(backend.device)
        pos = torch.cat([torch.arange(n) for n in lengths])[None].to(backend.device)
        final = {}
        hook = backend.layers[-1].register_forward_hook(lambda m, a, o: final.__setitem__("h", o[0] if isinstance(o, tuple) else o))
        try:
            with torch.inference_mode():
                res = backend.model(input_ids=ids, position_ids=pos, attention_mask=None, use_cache=False,
                                    output_hidden_states=True, logits_to_keep=1)
        finally:
            hook.remove()
        aux = torch.cat([res.hidden_states[i][0] for i in backend.layer_ids], -1).to("cpu")
        out += list(zip(aux.split(lengths), final["h"][0].to("cpu").split(lengths)))
    return out


def timed(fn, backend, plans) -> tuple[float, list]:
    if backend.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    states = [fn(backend, p) for p in plans]
    return time.perf_counter() - t0, states


def main(argv: list[str] | None = None) -> int:
    import pyarrow.parquet as pq

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--prepared", required=True, help="a prepare step's data.parquet")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--pack-tokens", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--device", default="auto")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    t = pq.read_table(a.prepared).slice(0, a.samples).to_pylist()
    import numpy as np
    samples = [SampleRow(f"s{i}", r["split"], np.asarray(r["input_ids"], np.int64), np.asarray(r["loss_mask"], np.uint8))
               for i, r in enumerate(t)]
    plans = [ShardPlan(index=k // SHARD, path="", samples=tuple(samples[k:k + SHARD])) for k in range(0, len(samples), SHARD)]
    target = TargetConfig.read(Path(a.model_dir))
    tokens = sum(int(s.input_ids.size) for s in samples)
    result = {"settings": vars(a), "tokens": tokens, "arms": []}
    for pack_tokens in a.pack_tokens:
        cfg = CaptureConfig(dataset="", target=a.model_dir, out_dir="", cache_root="", backend="transformers",
                            max_num_batched_tokens=pack_tokens, dtype=a.dtype, device=a.device)
        backend = HfCapture(cfg, target, a.dtype, default_layer_ids(target.num_layers), 1 << 20)
        backend.start()
        secs, states = {"packed": [], "rows": []}, {}
        for r in range(a.rounds):
            for name in (("packed", "rows") if r % 2 == 0 else ("rows", "packed")):
                s, states[name] = timed(packed_forward if name == "packed" else HfCapture.shard_states, backend, plans)
                secs[name].append(s)
        flat = [(x, y) for p, q in zip(states["packed"], states["rows"]) for x, y in zip(p, q)]
        diff = max(max((a0 - b0).abs().max().item(), (a1 - b1).abs().max().item()) for (a0, a1), (b0, b1) in flat)
        scale = max(max(a0.abs().max().item(), a1.abs().max().item()) for (a0, a1), _ in flat)
        counted = {k: (v[1:] if len(v) > 1 else v) for k, v in secs.items()}
        tps = {k: tokens * len(v) / sum(v) for k, v in counted.items()}
        arm = {"pack_tokens": pack_tokens, "seconds": secs, "tokens_per_s": tps, "ratio_rows_over_packed":
               tps["rows"] / tps["packed"], "max_diff_over_max": diff / scale, "device": str(backend.device)}
        result["arms"].append(arm)
        print(json.dumps(arm), flush=True)
        backend.close()
    Path(a.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
