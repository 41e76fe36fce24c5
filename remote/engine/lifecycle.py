"""One vLLM engine's life, the same for the capture, regenerate and online evaluation:

    engine = VllmEngine(opts, weight_bytes, param="capture.tensor_parallel_size")  # opts: EngineOptions
    llm = engine.start(lambda on_cpu: {...LLM()'s arguments...}, cpu_env={...})
    ... llm.generate(...), llm.collective_rpc(...) ...
    engine.close()                                       # nothing of the engine is left

start: the device check (remote.engine.devices; BadInput naming `param`), vLLM's CPU settings on a CPU
host, SIGTERM / SIGHUP turned into an unwinding SystemExit for the engine's life (so close() runs and
ends the engine's processes), and a start that hangs (a worker gone, a peer never reached) ended at
engine_start_s instead of vLLM's own timeouts (VLLM_ENGINE_READY_TIMEOUT_S and the collectives',
minutes each). close: the engine core shut down, the distributed state of an in-process engine freed
(so another engine can start in this process), and every process the engine started and left ended
(SIGTERM, then SIGKILL). The log lines: the devices found, the engine up and how long it took, and the
processes that had to be killed.
"""
from __future__ import annotations

import contextlib
import gc
import os
import signal
import time
from typing import Callable, Mapping

from remote.engine.config import EngineOptions
from remote.engine.devices import DeviceReport, check_devices
from remote.step import log

ENDING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
END_GRACE_S = 5.0  # after SIGTERM, seconds the engine's processes get before SIGKILL
# The batch engines' cpu_env (capture, regenerate): vLLM's CPU auto-bind keeps a core a rank out of the model's
# threads for its scheduler; on 2 cores that halved a TP=1 capture: 1,338-1,392 tokens/s with none kept, 685-711
# with one (bench/results/capture_reserved-cpu-20261205.json). An explicit bind (TP > 1) keeps none.
ALL_CORES_CPU_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


class EngineStartTimedOut(Exception):
    """vLLM was not up within engine_start_s (raised in the main thread by SIGALRM)."""


class VllmEngine:
    """Start one vLLM `LLM` (`start`) and end all of it (`close`); `llm`, `report` and `startup_s` once up."""

    def __init__(self, opts: EngineOptions, weight_bytes: int, param: str = "tensor_parallel_size",
                 name: str = "vLLM engine"):
        self.opts, self.weight_bytes, self.param, self.name = opts, weight_bytes, param, name
        self.llm = None
        self.report: DeviceReport | None = None
        self.startup_s = 0.0
        self._handlers: dict = {}  # the signal handlers start() replaced, put back by close()
        self._spared: set[int] | None = None  # child processes from before start(); None: not started

    def start(self, engine_kwargs: Callable[[bool], dict], cpu_env: Mapping[str, str] | None = None):
        """Check the devices, then `LLM(**engine_kwargs(on_cpu))`; `cpu_env`: more environment defaults for
        a CPU host. A start that fails or is signalled closes what it began."""
        t0 = time.monotonic()
        self.report = self.check_devices()
        on_cpu = self.report.kind == "cpu"
        kwargs = engine_kwargs(on_cpu)
        if on_cpu:  # before vLLM is imported: it reads its environment once
            self._cpu_environment(cpu_env or {})
        os.environ.setdefault("VLLM_ENGINE_READY_TIMEOUT_S", str(int(self.opts.engine_start_s)))
        from vllm import LLM

        self._handlers = {sig: signal.signal(sig, _ended_by_signal) for sig in ENDING_SIGNALS}
        self._spared = child_pids()  # processes that were there before: not the engine's to end
        try:
            self.llm = self._construct(LLM, kwargs)
        except BaseException:
            self.close()
            raise
        self.startup_s = time.monotonic() - t0
        log(f"{self.name} up in {self.startup_s:.1f} s (TP={self.opts.tensor_parallel_size}, {kwargs.get('dtype')})")
        return self.llm

    def check_devices(self) -> DeviceReport:
        """The device check for these options (BadInput naming self.param), logged."""
        o = self.opts
        report = check_devices(o.tensor_parallel_size, o.gpu_memory_utilization, o.cpu_kvcache_gib,
                               self.weight_bytes, self.param)
        log(f"devices: {report.summary}")
        return report

    def _cpu_environment(self, extra: Mapping[str, str]) -> None:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.opts.cpu_kvcache_gib))
        if self.opts.tensor_parallel_size > 1:  # each rank on its own cores (vLLM cannot bind them itself here)
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", self.report.cpu_threads_bind)
        for key, value in extra.items():
            os.environ.setdefault(key, value)

    def _construct(self, llm_class, kwargs: dict):
        previous_alarm = signal.signal(signal.SIGALRM, _start_timed_out)
        signal.setitimer(signal.ITIMER_REAL, self.opts.engine_start_s)
        try:
            return llm_class(**kwargs)
        except Exception as e:
            raise RuntimeError(f"vLLM could not start target {kwargs.get('model')} (TP={self.opts.tensor_parallel_size}, "
                               f"engine_start_s={self.opts.engine_start_s:g}): {type(e).__name__}: {e}") from e
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous_alarm)

    def close(self) -> None:
        """Shut the engine down and end whatever of it is left: nothing outlives it. Safe to call twice."""
        try:
            if self.llm is not None:
                self.llm, llm = None, self.llm
                _shut_down(llm)
        finally:
            if self._spared is not None and (killed := end_child_processes(self._spared)):
                log(f"vLLM processes that outlived the engine's shutdown, killed: {', '.join(killed)}")
            self._spared = None
            for sig, handler in self._handlers.items():
                signal.signal(sig, handler)
            self._handlers = {}


def _shut_down(llm) -> None:
    """The engine core shut down; the distributed state and memory an in-process engine held, freed."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None:
        core.shutdown()
    del llm, core
    gc.collect()
    cleanup_dist_env_and_memory()


def _ended_by_signal(signum, frame):
    """SIGTERM / SIGHUP: unwind (SystemExit passes the step's error handling), so close() ends the engine."""
    for sig in ENDING_SIGNALS:  # once: a second signal must not cut the shutdown short
        signal.signal(sig, signal.SIG_IGN)
    raise SystemExit(128 + signum)


def _start_timed_out(signum, frame):
    raise EngineStartTimedOut("not up within engine_start_s")


# ----------------------------------------------------------------------------- the engine's processes
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


# ----------------------------------------------------------------------------- a target's engine arguments
def target_engine_kwargs(opts: EngineOptions, model: str, dtype: str, max_model_len: int, is_mla: bool,
                         trust_remote_code: bool, on_cpu: bool) -> dict:
    """LLM()'s arguments that the capture and regenerate engines share (each adds its own)."""
    kw = dict(
        model=model, dtype=dtype, tensor_parallel_size=opts.tensor_parallel_size, max_model_len=max_model_len,
        max_num_seqs=opts.max_num_seqs, max_num_batched_tokens=opts.max_num_batched_tokens,
        enable_chunked_prefill=True, gpu_memory_utilization=opts.gpu_memory_utilization,
        language_model_only=True,  # text prompts: a multimodal target's encoders stay unloaded
        seed=0, disable_log_stats=True, trust_remote_code=trust_remote_code,
    )
    if on_cpu and is_mla:
        kw.update(cpu_mla_kwargs(dtype))
    return kw


def cpu_mla_kwargs(dtype: str) -> dict:
    """LLM()'s settings for an engine on the CPU that runs MLA attention (the target's or the draft's)."""
    # vLLM's CPU rotary kernel is wrong for MLA's 3-D query (a tiny Kimi's states 1e-2 off transformers');
    # the native one is right (tests/test_capture_kimi.py: within 1e-4)
    kw = {"compilation_config": {"custom_ops": ["all", "-rotary_embedding"]}}
    if dtype == "float32":  # on a CPU with AMX vLLM picks its AMX MLA kernels, which take no float32
        kw["attention_backend"] = "CPU_MLA"
    return kw
