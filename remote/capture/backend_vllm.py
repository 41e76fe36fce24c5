"""The vLLM backend of remote.capture.capture: the serving engine, tensor parallel, with the capture
worker extension (remote.capture.worker) hooked into its decoder layers (interface: remote.capture.backend)."""
from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import Callable, Sequence

import numpy as np

from remote.capture.backend import OnWritten, Progress
from remote.capture.cache import ShardPlan
from remote.capture.layers import TargetConfig
from remote.step import BadInput, log

WORKER_EXTENSION = "remote.capture.worker.CaptureWorkerExtension"
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

    def __init__(self, cfg, target: TargetConfig, dtype: str, layer_ids: Sequence[int], max_len: int):
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
            if self.dtype == "float32":  # on a CPU with AMX vLLM picks its AMX MLA kernels, which take no float32
                kw["attention_backend"] = "CPU_MLA"
        return kw

    def start(self) -> None:
        from remote.capture.patch_worker import check_devices

        t0 = time.monotonic()
        report = check_devices(self.cfg.tensor_parallel_size, self.cfg.gpu_memory_utilization,
                               self.cfg.cpu_kvcache_gib, self.target.weight_bytes)
        log(f"devices: {report.summary}")
        if report.kind == "cpu":
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.cfg.cpu_kvcache_gib))
            # vLLM's CPU auto-bind keeps a core a rank out of the model's threads for its scheduler; on 2 cores
            # that halved a TP=1 capture: 1,338-1,392 tokens/s with none kept, 685-711 with one
            # (bench/results/capture_reserved-cpu-20261205.json). An explicit bind (TP > 1 below) keeps none.
            os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
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
        from remote.capture.worker import DISK_FULL, parse_request_id, request_id

        hooked = self._rank0("eaglet_capture_begin", self.layer_ids, self.cfg.storage_dtype)
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


