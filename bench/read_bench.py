"""What reading a training step's states costs, beside the step itself: the trainer's reader thread hides it.

    python bench/read_bench.py --shape smollm2 llama8b kimi25 --dir /dev/shm/read-bench --out r.jsonl
    .venv/bin/python bench/read_bench.py --shape smollm2 --samples 16 --steps 4        # the CPU smoke

Writes a synthetic capture of each shape (bf16 states, `--samples` samples of `--doc-len` tokens, the
capture store's own shards) and times what remote.train.train does for a step's data before the draft
sees it: CaptureIndex.load of the step's packed samples, pinned (on a GPU), copied to the device.
Two loops over the same steps: read then "train" one after the other, and the trainer's way, the next
step read in a thread while this one "trains", where training a step is a GPU wait of `--step-s`
seconds (bench/train_bench.py's measured step time of the shape: pass it), or by default a wait as long
as the read itself (the case where hiding it pays most). Reports each loop's seconds a step and their
ratio (how much faster a step gets when its read is hidden).

    .venv/bin/python bench/read_bench.py --shape smollm2 --host-bound --steps 30 --out r.jsonl

--host-bound measures what that model leaves out: a small draft's step is bound by the host launching its
kernels, so the main thread is busy, not waiting, while the reader runs. The "step" is then `--launches` tiny
torch ops on the host, timed alone, beside a read in a thread (the trainer's way) and beside the same read in a
worker process; the thread's extra over the process is what the two threads' turns at the GIL cost the step.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.train_bench import SHAPES  # noqa: E402
from remote.capture.store import CaptureSet, Sample, write_shard  # noqa: E402
from remote.draft.data import CaptureIndex, epoch_order, pack  # noqa: E402

LAYERS = (2, 16, 29)


def synthetic_capture(folder: Path, hidden: int, samples: int, doc_len: int) -> CaptureSet:
    folder.mkdir(parents=True, exist_ok=True)
    shards = []
    for s in range(0, samples, 8):
        p = folder / f"shard-{s // 8:05d}.safetensors"
        if not p.is_file():
            g = torch.Generator().manual_seed(s)
            write_shard(p, [Sample(f"s{i}", "train", torch.randint(0, 1000, (doc_len,), generator=g),
                                   torch.ones(doc_len, dtype=torch.uint8),
                                   torch.randn(doc_len, len(LAYERS) * hidden, generator=g).bfloat16(),
                                   torch.randn(doc_len, hidden, generator=g).bfloat16())
                            for i in range(s, min(s + 8, samples))], LAYERS)
        shards.append(str(p))
    return CaptureSet(tuple(shards), LAYERS, hidden, "bfloat16", "synthetic")


def step_reader(shape: str, args, pin: bool = False):
    """read(i): step i's packed batch of the shape's synthetic capture, as the trainer loads it (steps cycle)."""
    hidden = SHAPES[shape]["hidden_size"]
    index = CaptureIndex.build(synthetic_capture(Path(args.dir) / shape, hidden, args.samples, args.doc_len))
    plan = pack(index.lengths, args.tokens, epoch_order(len(index.refs), 0, 0))
    return lambda i: index.load(plan[i % len(plan)], args.tokens, args.tokens, pin=pin)


def measure(shape: str, args, device) -> dict:
    cuda = device.type == "cuda"
    read = step_reader(shape, args, pin=cuda)

    def train(b, wait: float):  # the step: the batch on the device, then the device busy for `wait` seconds
        b = b.to(device, torch.bfloat16)
        if cuda:
            torch.cuda._sleep(int(wait * cycles_per_s))
            torch.cuda.synchronize()
        else:
            time.sleep(wait)
        return b

    cycles_per_s = _cycles_per_s() if cuda else 0
    for i in range(2):  # warm the page cache and the allocator
        train(read(i), 0)
    reads = []
    for i in range(args.steps):
        t = time.perf_counter()
        train(read(i), 0)
        reads.append(time.perf_counter() - t)
    read_s = statistics.median(reads)
    step_s = args.step_s or read_s
    t = time.perf_counter()
    for i in range(args.steps):
        train(read(i), step_s)
    serial = (time.perf_counter() - t) / args.steps
    with ThreadPoolExecutor(1) as pool:
        t = time.perf_counter()
        ahead = pool.submit(read, 0)
        for i in range(args.steps):
            b = ahead.result()
            ahead = pool.submit(read, i + 1)
            train(b, step_s)
        ahead.result()
        overlapped = (time.perf_counter() - t) / args.steps
    states = args.tokens * (len(LAYERS) + 1) * SHAPES[shape]["hidden_size"] * 2  # bytes of a step's bf16 states
    return {"shape": shape, "tokens": args.tokens, "bytes_per_step": states,
            "read_s": round(read_s, 4), "read_gb_per_s": round(states / read_s / 1e9, 2),
            "step_s": round(step_s, 4), "serial_s_per_step": round(serial, 4),
            "read_ahead_s_per_step": round(overlapped, 4), "speedup": round(serial / overlapped, 3),
            "device": torch.cuda.get_device_name() if cuda else "cpu"}


def host_bound(shape: str, args) -> dict:
    """A host-bound step (--launches tiny ops on the main thread) alone, with the next step's read in a thread, and
    with it in a worker process (forked before any step: no GIL shared), interleaved over --steps rounds."""
    import multiprocessing as mp

    torch.set_num_threads(1)  # one thread, as a launching host's; and a fork after a pool of threads can hang
    read = step_reader(shape, args)
    x = torch.ones(4)

    def step() -> float:
        t = time.perf_counter()
        for _ in range(args.launches):
            x.add_(1)
        return time.perf_counter() - t

    fork = mp.get_context("fork")
    todo, done = fork.Queue(), fork.Queue()
    worker = fork.Process(target=_read_worker, args=(read, todo, done), daemon=True)
    worker.start()
    reads, times = [], {"alone": [], "thread": [], "process": []}
    with ThreadPoolExecutor(1) as pool:
        for i in range(args.steps):
            t = time.perf_counter()
            read(i)
            reads.append(time.perf_counter() - t)
            times["alone"].append(step())
            ahead = pool.submit(read, i)
            times["thread"].append(step())
            ahead.result()
            todo.put(i)
            times["process"].append(step())
            done.get()
    todo.put(None)
    worker.join()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"shape": shape, "tokens": args.tokens, "launches": args.launches, "read_s": round(statistics.median(reads), 4),
            **{f"step_{k}_s": round(v, 5) for k, v in med.items()},
            "thread_cost_s": round(med["thread"] - med["alone"], 5), "process_cost_s": round(med["process"] - med["alone"], 5),
            "torch_threads": torch.get_num_threads(), "device": "cpu"}


def _read_worker(read, todo, done) -> None:
    while (i := todo.get()) is not None:
        read(i)
        done.put(i)


def _cycles_per_s() -> float:
    """GPU clock cycles a second, for torch.cuda._sleep (a busy device without a workload's kernels)."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    torch.cuda._sleep(100_000_000)
    torch.cuda.synchronize()
    return 100_000_000 / (time.perf_counter() - t)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", nargs="+", default=["smollm2"], choices=sorted(SHAPES))
    ap.add_argument("--tokens", type=int, default=8192, help="packed positions a step")
    ap.add_argument("--doc-len", type=int, default=1024)
    ap.add_argument("--samples", type=int, default=64, help="samples of the synthetic capture (steps cycle over it)")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--step-s", type=float, default=0.0, help="seconds a training step keeps the device busy")
    ap.add_argument("--dir", default="/tmp/read-bench", help="where the synthetic captures go (/dev/shm on a GPU host)")
    ap.add_argument("--host-bound", action="store_true",
                    help="the step is the host launching --launches tiny ops: the read in a thread against a process")
    ap.add_argument("--launches", type=int, default=3000, help="--host-bound: tiny torch ops a step")
    ap.add_argument("--out", default="", help="append one JSON line a shape here")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for shape in args.shape:
        rec = host_bound(shape, args) if args.host_bound else measure(shape, args, device)
        print(json.dumps(rec), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(rec) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
