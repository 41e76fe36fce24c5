"""Step: capture the target's hidden states on the prepared data, into the capture cache.

    python -m remote.capture --config capture.config.json
    # {"dataset": "<run>/prepare/data.parquet", "target": "/models/Kimi-K2.5", "out_dir": "<run>/capture",
    #  "cache_root": "<root>/cache", "backend": "vllm", "tensor_parallel_size": 8}

For every sample of the dataset: the residual stream at the aux layers (HF hidden-state indices,
default 2, N//2, N-3) and the last layer's pre-norm output, in the target's dtype, packed into
shards (remote.capture_store) under `<cache_root>/captures/<key>/` (remote.capture_cache). Samples
the cache already holds are not captured again; a killed run resumes at the first missing shard.
The manifest (`<out_dir>/manifest.json`) lists the shards that hold this dataset's samples:
`CaptureSet.from_manifest(out_dir)` reads them.

Backends: "vllm" (the serving engine, tensor parallel; remote.capture_worker hooks its layers) and
"transformers" (remote.capture_hf: plain HF forwards, packed; the numerical reference, and the path
for hosts without vLLM). Both write the same shards. In a run over several hosts each host captures
only its part of the samples (host_part of host_parts, chosen before either backend starts).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from remote.capture_cache import CaptureCache, SampleRow, ShardPlan, cache_key
from remote.layers import TargetConfig, check_layer_ids, default_layer_ids
from remote.prepare import host_of
from remote.step import BadInput, StepOutput, emit, load_config, log, progress, step_main

STEP = "capture"
BACKENDS = ("vllm", "transformers")
DTYPES = ("auto", "bfloat16", "float16", "float32")
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
PROGRESS_EVERY_S = 2.0
WORKER_EXTENSION = "remote.capture_worker.CaptureWorkerExtension"


@dataclass(frozen=True, kw_only=True)
class CaptureConfig:
    dataset: str  # the prepare step's data.parquet (sample_id, input_ids, loss_mask, length, split)
    target: str  # the target model folder on this host (HF layout: config.json, safetensors, tokenizer)
    out_dir: str  # this step's folder; it holds the manifest, the shards live in the cache
    cache_root: str  # the host's cache folder: shards are kept in <cache_root>/captures/<key>/
    target_revision: str = ""  # a label for the weights, part of the cache key; "": hashes of the target's files
    backend: str = "vllm"  # "vllm" or "transformers"
    tensor_parallel_size: int = 1  # GPUs (CPU ranks on a CPU host) the target is split over (vllm)
    layer_ids: list[int] | None = None  # aux hidden-state indices, HF numbering; None: (2, N//2, N-3)
    samples_per_shard: int = 256  # samples in one shard, the unit of resume
    max_shard_gib: float = 4.0  # a shard also closes before it would pass this size (GiB): bounds memory
    max_num_seqs: int = 64  # requests in flight in one engine step (vllm)
    max_num_batched_tokens: int = 8192  # tokens of one forward pass: vLLM's step budget, HF's pack size
    dtype: str = "auto"  # of the forward and the shards; "auto": the target's own (config.json)
    gpu_memory_utilization: float = 0.85  # share of each GPU vLLM may take
    max_model_len: int = 0  # vLLM's context length; 0: the longest sample + 1
    cpu_kvcache_gib: int = 2  # KV cache per rank on a CPU host (VLLM_CPU_KVCACHE_SPACE), GiB
    device: str = "auto"  # transformers backend: "auto" (cuda when there is one), "cuda", "cpu"
    trust_remote_code: bool = False  # let vLLM / transformers run the target's own code (its config classes)
    engine_start_s: float = 1800.0  # seconds vLLM may take to start (load the weights, warm up); then it fails
    host_part: int = 0  # this host's part of a run over host_parts hosts: it captures only the samples
    host_parts: int = 1  # with remote.prepare.host_of(sample_id, host_parts) == host_part (1: all of them)

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"backend {self.backend!r}: choose one of {BACKENDS}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r}: choose one of {DTYPES}")
        for name in ("tensor_parallel_size", "samples_per_shard", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be at least 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization}: must be in (0, 1]")
        if self.max_shard_gib <= 0:
            raise ValueError(f"max_shard_gib={self.max_shard_gib}: must be positive")
        if self.engine_start_s <= 0:
            raise ValueError(f"engine_start_s={self.engine_start_s}: must be positive")
        if not 0 <= self.host_part < self.host_parts:
            raise ValueError(f"host_part={self.host_part} of host_parts={self.host_parts}: need 0 <= host_part < host_parts")
        if self.backend == "transformers" and self.tensor_parallel_size != 1:
            raise ValueError("the transformers backend runs on one device: set tensor_parallel_size=1")


# ----------------------------------------------------------------------------- the dataset
DATASET_COLUMNS = ("sample_id", "input_ids", "loss_mask", "length", "split")


def read_dataset(path: str | os.PathLike, vocab_size: int) -> list[SampleRow]:
    """The prepared samples, checked: the columns, lengths, token ids, unique ids. BadInput names the row."""
    import pyarrow.parquet as pq

    path = Path(path)
    if not path.is_file():
        raise BadInput(f"dataset {path} does not exist (expected the prepare step's data.parquet)")
    try:
        table = pq.read_table(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several kinds for a bad file
        raise BadInput(f"dataset {path} is not a readable parquet file: {e}") from e
    missing = [c for c in DATASET_COLUMNS if c not in table.column_names]
    if missing:
        raise BadInput(f"dataset {path}: missing column(s) {missing}; has {table.column_names}")
    cols = {c: table.column(c).to_pylist() for c in ("sample_id", "length", "split")}
    ids_col, mask_col = table.column("input_ids"), table.column("loss_mask")
    rows, seen = [], set()
    for i, sid in enumerate(cols["sample_id"]):
        where = f"dataset {path} row {i} (sample {sid})"
        ids = np.asarray(ids_col[i].values, dtype=np.int64)
        mask = np.asarray(mask_col[i].values, dtype=np.int64)
        if not sid or sid in seen:
            raise BadInput(f"{where}: sample_id is empty or repeated")
        if ids.size == 0 or ids.size != mask.size or ids.size != cols["length"][i]:
            raise BadInput(f"{where}: {ids.size} input_ids, {mask.size} loss_mask values, length {cols['length'][i]}")
        if ids.min() < 0 or ids.max() >= vocab_size:
            raise BadInput(f"{where}: token id {int(ids.max()) if ids.max() >= vocab_size else int(ids.min())} "
                           f"outside the target's vocabulary of {vocab_size}")
        if not np.isin(mask, (0, 1)).all():
            raise BadInput(f"{where}: loss_mask holds values other than 0 and 1")
        if cols["split"][i] not in ("train", "heldout"):
            raise BadInput(f"{where}: split {cols['split'][i]!r} is neither 'train' nor 'heldout'")
        seen.add(sid)
        rows.append(SampleRow(sid, cols["split"][i], ids.astype(np.int32), mask.astype(np.uint8)))
    if not rows:
        raise BadInput(f"dataset {path} has no samples")
    return rows


def host_share(samples: list[SampleRow], cfg: CaptureConfig) -> list[SampleRow]:
    """The samples this host captures: all of them, or its part of a run over several hosts."""
    if cfg.host_parts == 1:
        return samples
    mine = [s for s in samples if host_of(s.sample_id, cfg.host_parts) == cfg.host_part]
    if not mine:
        raise BadInput(f"dataset {cfg.dataset}: none of its {len(samples)} samples falls to host part "
                       f"{cfg.host_part} of {cfg.host_parts}; use fewer hosts for this little data")
    log(f"host part {cfg.host_part} of {cfg.host_parts}: {len(mine)} of {len(samples)} samples")
    return mine


# ----------------------------------------------------------------------------- progress
class Progress:
    """Counts what a backend captured and sends a progress event at most every PROGRESS_EVERY_S."""

    def __init__(self, total_samples: int, total_tokens: int):
        self.total_samples, self.total_tokens = total_samples, total_tokens
        self.samples = self.tokens = 0
        self.started = time.monotonic()
        self._sent = 0.0

    def add(self, samples: int, tokens: int) -> None:
        self.samples += samples
        self.tokens += tokens
        now = time.monotonic()
        if now - self._sent >= PROGRESS_EVERY_S or self.samples >= self.total_samples:
            self._sent = now
            progress(self.samples, self.total_samples, samples=self.samples, tokens=self.tokens,
                     total_tokens=self.total_tokens, tokens_per_s=round(self.tokens_per_s, 1))

    @property
    def seconds(self) -> float:
        return time.monotonic() - self.started

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


OnWritten = Callable[[ShardPlan], None]


# ----------------------------------------------------------------------------- the vLLM backend
ENDING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
END_GRACE_S = 5.0  # after SIGTERM, seconds the engine's processes get before SIGKILL


class EngineStartTimedOut(Exception):
    """vLLM was not up within engine_start_s (raised in the main thread by SIGALRM)."""


def _ended_by_signal(signum, frame):
    """SIGTERM / SIGHUP: unwind (SystemExit passes the step's error handling), so close() ends the engine."""
    for sig in ENDING_SIGNALS:  # once: a second signal must not cut the shutdown short
        signal.signal(sig, signal.SIG_IGN)
    raise SystemExit(128 + signum)


def _start_timed_out(signum, frame):
    raise EngineStartTimedOut("not up within engine_start_s")


def child_pids() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


def end_child_processes(spared: set[int], grace_s: float = END_GRACE_S) -> list[str]:
    """SIGTERM the processes below this one (vLLM's engine core, its workers) but the spared ones and
    multiprocessing's resource tracker (it ends with this process, after cleaning up shared memory);
    SIGKILL those left after grace_s. Returns the ones that had to be killed."""
    import psutil

    children = []
    for p in psutil.Process().children(recursive=True):
        with _gone_is_fine():
            if p.pid not in spared and _running(p) and "resource_tracker" not in " ".join(p.cmdline()):
                children.append(p)
    for p in children:
        with _gone_is_fine():
            p.terminate()
    killed = []
    for p in _wait_ended(children, grace_s):
        with _gone_is_fine():
            killed.append(f"{p.pid} {p.name()}")
            p.kill()
    _wait_ended(children, grace_s)
    return killed


def _running(p) -> bool:
    """Alive and not a zombie (an orphan's zombie may never be reaped in a container: it has ended)."""
    import psutil

    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_ended(procs: list, timeout: float) -> list:
    """Wait until none of procs runs, for at most timeout seconds; those still running."""
    deadline = time.monotonic() + timeout
    while (alive := [p for p in procs if _running(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


@contextlib.contextmanager
def _gone_is_fine():
    import psutil

    try:
        yield
    except psutil.NoSuchProcess:
        pass


class VllmCapture:
    """A vLLM engine with the capture extension: `capture` writes shards, `prefill` only runs them.

        engine = VllmCapture(cfg, target, dtype, layer_ids, max_len)
        engine.start()
        engine.capture(plans, on_written, progress)
        engine.close()
    """

    def __init__(self, cfg: CaptureConfig, target: TargetConfig, dtype: str, layer_ids: Sequence[int], max_len: int):
        self.cfg, self.target, self.dtype, self.layer_ids = cfg, target, dtype, list(layer_ids)
        self.max_model_len = cfg.max_model_len or max_len + 1
        self.llm = None
        self.startup_s = 0.0
        self.layers_path = ""  # where the hooked decoder layers sit in vLLM's model (set by capture)
        self._handlers: dict = {}  # the signal handlers start() replaced, put back by close()
        self._spared: set[int] | None = None  # child processes from before start(); None: not started

    def engine_kwargs(self, on_cpu: bool) -> dict:
        kw = dict(
            model=self.cfg.target, dtype=self.dtype, tensor_parallel_size=self.cfg.tensor_parallel_size,
            max_model_len=self.max_model_len, max_num_seqs=self.cfg.max_num_seqs,
            max_num_batched_tokens=self.cfg.max_num_batched_tokens, enable_chunked_prefill=True,
            gpu_memory_utilization=self.cfg.gpu_memory_utilization, worker_extension_cls=WORKER_EXTENSION,
            enforce_eager=True,  # hooks added after vLLM compiled the model would be skipped silently
            enable_prefix_caching=False,  # a cached prefix is not computed, so it could not be captured
            language_model_only=True,  # text prompts: a multimodal target's encoders stay unloaded
            skip_tokenizer_init=True, seed=0, disable_log_stats=True, trust_remote_code=self.cfg.trust_remote_code,
        )
        if on_cpu and self.target.is_mla:
            # vLLM's CPU rotary kernel is wrong for MLA's 3-D query (FACTS.md); the native one is right
            kw["compilation_config"] = {"custom_ops": ["all", "-rotary_embedding"]}
        return kw

    def start(self) -> None:
        from remote.patch_worker import check_devices

        t0 = time.monotonic()
        report = check_devices(self.cfg.tensor_parallel_size, self.cfg.gpu_memory_utilization,
                               self.cfg.cpu_kvcache_gib, self.target.weight_bytes)
        log(f"devices: {report.summary}")
        if report.kind == "cpu":
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.cfg.cpu_kvcache_gib))
            if self.cfg.tensor_parallel_size > 1:
                os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", report.cpu_threads_bind)
        from vllm import LLM

        # Signalled, the step unwinds through close(), which ends the engine's processes; a start that
        # hangs (a worker gone, a peer never reached) ends at engine_start_s instead of vLLM's own
        # timeouts (VLLM_ENGINE_READY_TIMEOUT_S and the collectives', minutes each).
        self._handlers = {sig: signal.signal(sig, _ended_by_signal) for sig in ENDING_SIGNALS}
        self._spared = child_pids()  # processes that were there before: not the engine's to end
        os.environ.setdefault("VLLM_ENGINE_READY_TIMEOUT_S", str(int(self.cfg.engine_start_s)))
        previous_alarm = signal.signal(signal.SIGALRM, _start_timed_out)
        signal.setitimer(signal.ITIMER_REAL, self.cfg.engine_start_s)
        try:
            self.llm = LLM(**self.engine_kwargs(report.kind == "cpu"))
        except Exception as e:
            raise RuntimeError(f"vLLM could not start target {self.cfg.target} (TP={self.cfg.tensor_parallel_size}, "
                               f"engine_start_s={self.cfg.engine_start_s:g}): {type(e).__name__}: {e}") from e
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous_alarm)
        self.startup_s = time.monotonic() - t0
        log(f"vLLM engine up in {self.startup_s:.1f} s (TP={self.cfg.tensor_parallel_size}, {self.dtype})")

    def close(self) -> None:
        """Shut the engine down and end whatever of it is left: nothing outlives the capture."""
        try:
            if self.llm is not None:
                self.llm, llm = None, self.llm
                llm.llm_engine.engine_core.shutdown()
        finally:
            if self._spared is not None and (killed := end_child_processes(self._spared)):
                log(f"vLLM processes that outlived the engine's shutdown, killed: {', '.join(killed)}")
            self._spared = None
            for sig, handler in self._handlers.items():
                signal.signal(sig, handler)
            self._handlers = {}

    def _rank0(self, method: str, *args) -> dict:
        """Call a worker method on every rank; the answer of the one rank that captures."""
        answers = [a for a in self.llm.collective_rpc(method, args=args) if a is not None]
        if len(answers) != 1:
            raise RuntimeError(f"{method}: expected one capturing rank, got {len(answers)} answers")
        return answers[0]

    def _run(self, requests: Sequence[tuple[str, np.ndarray, Callable[[], None] | None]],
             on_finished: Callable[[str], None], poll: Callable[[], None] = lambda: None) -> None:
        """Feed (request id, prompt, called-before-submit) through the engine, ~2x max_num_seqs in flight."""
        from vllm import SamplingParams

        engine = self.llm.llm_engine
        params = SamplingParams(max_tokens=1, detokenize=False)
        head, window = 0, 2 * self.cfg.max_num_seqs
        while head < len(requests) or engine.has_unfinished_requests():
            while head < len(requests) and engine.get_num_unfinished_requests() < window:
                rid, ids, before = requests[head]
                if before is not None:
                    before()
                engine.add_request(rid, {"prompt_token_ids": ids.tolist()}, params)
                head += 1
            for out in engine.step():
                if out.finished:
                    on_finished(out.request_id)
            poll()

    def capture(self, plans: Sequence[ShardPlan], on_written: OnWritten, prog: Progress) -> dict:
        """Capture the planned shards; on_written(plan) after each shard is whole on disk."""
        from remote.capture_worker import DISK_FULL, parse_request_id, request_id

        hooked = self._rank0("eaglet_capture_begin", self.layer_ids)
        self.layers_path = hooked["layers"]
        log(f"hooked .{hooked['layers']}: layers {hooked['hooked']} of {hooked['num_layers']}")
        by_index = {p.index: p for p in plans}
        recorded: set[int] = set()
        last_poll = [0.0]

        def collect(status: dict) -> None:
            if status["error"]:  # a full disk is bad input (retrying cannot help); anything else a fault
                raise (BadInput if status["error"].startswith(DISK_FULL) else RuntimeError)(
                    f"capture worker: {status['error']}")
            for index in status["written"]:
                if index not in recorded:
                    recorded.add(index)
                    on_written(by_index[index])

        def poll() -> None:
            if time.monotonic() - last_poll[0] >= 1.0:
                last_poll[0] = time.monotonic()
                collect(self._rank0("eaglet_capture_status"))

        def on_finished(req_id: str) -> None:
            where = parse_request_id(req_id)
            if where is not None:
                prog.add(1, int(by_index[where[0]].samples[where[1]].input_ids.size))

        # a shard's plan reaches the worker before the first of its requests
        requests = [(request_id(p.index, slot), s.input_ids,
                     (lambda p=p: self._rank0("eaglet_plan_shard", _wire_plan(p))) if slot == 0 else None)
                    for p in plans for slot, s in enumerate(p.samples)]
        try:
            self._run(requests, on_finished, poll)
        finally:
            final = self._rank0("eaglet_capture_end")
        collect(final)
        pending = {i: ids for i, ids in final["pending"].items() if ids}
        if pending or len(recorded) != len(plans):
            raise RuntimeError(f"capture ended with shards unwritten: {sorted(set(by_index) - recorded)}; "
                               f"samples never fully seen: {pending}")
        return {k: final[k] for k in ("passes", "multi_request_passes", "max_passes_per_sample")}

    def prefill(self, prompts: Sequence[np.ndarray]) -> float:
        """Run prompts through the same engine and batching without capturing; returns seconds."""
        t0 = time.monotonic()
        self._run([(f"prefill.{i}", p, None) for i, p in enumerate(prompts)], lambda req_id: None)
        return time.monotonic() - t0


def _wire_plan(plan: ShardPlan) -> dict:
    """A shard plan as the worker takes it: plain lists and bytes (collective_rpc serializes them)."""
    return {"index": plan.index, "path": plan.path, "sample_ids": [s.sample_id for s in plan.samples],
            "splits": [s.split for s in plan.samples], "lengths": [int(s.input_ids.size) for s in plan.samples],
            "input_ids": b"".join(s.input_ids.astype(np.int32).tobytes() for s in plan.samples),
            "loss_mask": b"".join(s.loss_mask.astype(np.uint8).tobytes() for s in plan.samples)}


# ----------------------------------------------------------------------------- the step
def resolve_dtype(cfg: CaptureConfig, target: TargetConfig) -> str:
    dtype = target.dtype if cfg.dtype == "auto" else cfg.dtype
    if dtype not in DTYPE_BYTES:
        raise BadInput(f"target {cfg.target}: dtype {dtype!r} from config.json is not one of {sorted(DTYPE_BYTES)}; "
                       "set dtype in the capture config")
    return dtype


def check_disk(folder: Path, need: int) -> None:
    """Refuse to start hours of capture that the disk cannot hold (10% and 1 GiB to spare)."""
    free = shutil.disk_usage(folder).free
    if need * 1.1 + 2**30 > free:
        raise BadInput(f"the capture needs about {need / 2**30:.1f} GiB in {folder}; {free / 2**30:.1f} GiB is free")


def make_backend(cfg: CaptureConfig, target: TargetConfig, dtype: str, layer_ids: Sequence[int], max_len: int):
    if cfg.backend == "vllm":
        return VllmCapture(cfg, target, dtype, layer_ids, max_len)
    from remote.capture_hf import HfCapture

    return HfCapture(cfg, target, dtype, layer_ids)


def _finished(out: StepOutput) -> dict | None:
    """The manifest of a finished run whose shards are all still there, whole."""
    m = out.done()
    if m is None or m.get("config") != out.config:
        return None
    sizes = m["capture"].get("shard_bytes", {})
    if all(Path(p).is_file() and Path(p).stat().st_size == sizes.get(p) for p in m["capture"]["shards"]):
        return m
    return None


def run(raw: dict) -> dict:
    started = time.monotonic()
    cfg = load_config(CaptureConfig, raw, where="capture config")
    out = StepOutput(cfg.out_dir, STEP, dataclasses.asdict(cfg))
    if (done := _finished(out)) is not None:
        log(f"capture already finished in {cfg.out_dir}: nothing to do")
        return done
    target = TargetConfig.read(cfg.target)
    layer_ids = check_layer_ids(cfg.layer_ids if cfg.layer_ids is not None else default_layer_ids(target.num_layers),
                                target.num_layers)
    dtype = resolve_dtype(cfg, target)
    samples = host_share(read_dataset(cfg.dataset, target.vocab_size), cfg)
    max_len = max(int(s.input_ids.size) for s in samples)
    if cfg.max_model_len and max_len + 1 > cfg.max_model_len:
        longest = max(samples, key=lambda s: s.input_ids.size)
        raise BadInput(f"sample {longest.sample_id} has {max_len} tokens: more than max_model_len={cfg.max_model_len} - 1")
    bytes_per_token = (len(layer_ids) + 1) * target.hidden_size * DTYPE_BYTES[dtype] + 5
    key, material = cache_key(cfg.target, cfg.target_revision, layer_ids, dtype)
    with CaptureCache.open(cfg.cache_root, key, material) as cache:
        plans, cached = cache.plan(samples, cfg.samples_per_shard, int(cfg.max_shard_gib * 2**30), bytes_per_token)
        todo_tokens = sum(p.tokens for p in plans)
        log(f"{len(samples)} samples: {len(cached)} already in {cache.folder}, "
            f"{len(samples) - len(cached)} to capture ({todo_tokens} tokens) into {len(plans)} shard(s)")
        check_disk(cache.folder, todo_tokens * bytes_per_token)
        engine_s, detail, written, layers_path = 0.0, {}, [], ""
        prog = Progress(len(samples) - len(cached), todo_tokens)
        if plans:
            backend = make_backend(cfg, target, dtype, layer_ids, max_len)
            try:
                backend.start()
                engine_s = backend.startup_s
                prog = Progress(len(samples) - len(cached), todo_tokens)  # the clock starts with the engine up
                detail = backend.capture(plans, lambda p: (cache.add(p), written.append(p.path)), prog)
                layers_path = backend.layers_path
            finally:
                backend.close()
        shards = cache.shards_for(samples)
        shard_bytes = cache.shard_bytes(shards)
    new_bytes = sum(Path(p).stat().st_size for p in written)
    figures = {
        "tokens": prog.tokens, "bytes": new_bytes,
        "bytes_per_token": round(new_bytes / prog.tokens, 2) if prog.tokens else None,
        "bytes_per_token_bound": bytes_per_token + 16,
        "tokens_per_s": round(prog.tokens_per_s, 1) if prog.tokens else None,
        "capture_seconds": round(prog.seconds, 2) if plans else 0.0,
        "engine_start_seconds": round(engine_s, 2), "seconds": round(time.monotonic() - started, 2), **detail,
    }
    counts = {"samples": len(samples), "reused": len(cached), "captured": len(samples) - len(cached),
              "tokens": int(sum(s.input_ids.size for s in samples)), "shards": len(shards),
              "shards_written": len(written)}
    out.open()
    manifest = out.publish(counts=counts, figures=figures, capture={
        "shards": shards, "shard_bytes": shard_bytes, "layer_ids": list(layer_ids),
        "hidden_size": target.hidden_size, "dtype": dtype, "target": str(Path(cfg.target).resolve()),
        "sample_ids": [s.sample_id for s in samples], "cache_dir": str(Path(shards[0]).parent), "cache_key": key,
        "backend": cfg.backend, "num_layers": target.num_layers, "layers_path": layers_path,
    })
    emit("figures", **figures)
    log(f"capture done: {counts['captured']} samples captured, {counts['reused']} reused, {len(shards)} shards")
    return manifest


def main(argv: list[str] | None = None) -> int:
    return step_main(STEP, run, argv)


if __name__ == "__main__":  # the guard vLLM needs: its workers are spawned processes
    sys.exit(main())
