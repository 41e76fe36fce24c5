"""remote.engine: the engine settings stated once (EngineOptions, host.gpus and the counts it defaults), the
one device check, and the lifecycle's start and close. Fast: no engine starts here (the vLLM tests of the
capture, regenerate and online evaluation start real ones through it). This machine has no GPU: the CUDA
checks get nvidia-smi's answers from a small script standing in for it (its output format is
nvidia-smi's), and check_gpus is fed such answers directly."""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import stat
import sys
import types
from pathlib import Path

import pytest

from remote.capture.config import CaptureConfig, CaptureOptions, PatchWorkerConfig
from remote.config import ConfigError
from remote.data.config import RegenerateConfig, RegenerateOptions
from remote.engine import devices
from remote.engine.config import EngineOptions
from remote.evaluate.config import EvaluateConfig, OnlineConfig, OnlineOptions
from remote.step import BadInput

REPO = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------- the settings, stated once
def test_every_engine_group_takes_the_same_engine_settings():
    names = {f.name for f in dataclasses.fields(EngineOptions)}
    for group in (CaptureOptions, RegenerateOptions, OnlineOptions):
        assert issubclass(group, EngineOptions) and names <= {f.name for f in dataclasses.fields(group)}
    # where online evaluation differs it says so: small batches, vLLM's own step budget
    assert (OnlineOptions().max_num_seqs, OnlineOptions().max_num_batched_tokens, CaptureOptions().max_num_seqs) == (8, 0, 64)


def test_counts_left_at_zero_take_host_gpus_and_each_is_still_its_own():
    from flows.params import TrainDraftParams

    p = TrainDraftParams.from_preset(None, {"host.gpus": 4, "eval.tensor_parallel_size": 2})
    assert (p.capture.tensor_parallel_size, p.data.regenerate.tensor_parallel_size, p.eval.tensor_parallel_size,
            p.train.nproc_per_node) == (4, 4, 2, 4)
    assert p.model_fields_set == {"host", "eval"}, "derived counts are not sections the preset gave"
    for stated in ({}, {"host.gpus": 0}):  # not stated, or a CPU host: one each, as before host.gpus
        q = TrainDraftParams.from_preset(None, stated)
        assert (q.capture.tensor_parallel_size, q.data.regenerate.tensor_parallel_size, q.eval.tensor_parallel_size,
                q.train.nproc_per_node) == (1, 1, 1, 1)
    one = TrainDraftParams.from_preset(None, {"host.gpus": 8, "capture.backend": "transformers",
                                              "data.regenerate.backend": "transformers"})
    assert (one.capture.tensor_parallel_size, one.data.regenerate.tensor_parallel_size) == (1, 1), "one device"
    assert TrainDraftParams.model_validate(one.model_dump()) == one, "resolving twice changes nothing"


@pytest.mark.parametrize("key", ["capture.tensor_parallel_size", "data.regenerate.tensor_parallel_size",
                                 "eval.tensor_parallel_size", "train.nproc_per_node"])
def test_a_count_above_host_gpus_is_refused_by_name(key):
    from flows.params import TrainDraftParams

    with pytest.raises(ValueError, match=f"{key}=16 is more than host.gpus=8"):
        TrainDraftParams.from_preset(None, {"host.gpus": 8, key: 16})


def test_the_hosts_of_a_run_state_one_gpu_count():
    from flows.params import TrainDraftParams

    hosts = {"host": {"kind": "ssh", "gpus": 8}, "extra_hosts": [{"kind": "ssh", "hostname": "b", "gpus": 4}]}
    with pytest.raises(ValueError, match=r"extra_hosts\[0\].gpus=4 differs from host.gpus=8"):
        TrainDraftParams.model_validate(hosts)
    hosts["extra_hosts"][0]["gpus"] = None  # not stated: the first host's count
    assert TrainDraftParams.model_validate(hosts).train.nproc_per_node == 8


def test_the_gpu_presets_state_the_count_once():
    from flows.params import TrainDraftParams

    for name in ("kimi-k25-8gpu", "multi-host"):
        raw = (REPO / "deployments" / f"{name}.json").read_text()
        assert "tensor_parallel_size" not in raw and "nproc_per_node" not in raw, name
        p = TrainDraftParams.from_preset(REPO / "deployments" / f"{name}.json")
        assert p.host.gpus == 8 and all(h.gpus == 8 for h in p.extra_hosts), name
        # multi-host's online evaluation used to run the 1T target at TP=1
        assert (p.capture.tensor_parallel_size, p.data.regenerate.tensor_parallel_size, p.eval.tensor_parallel_size,
                p.train.nproc_per_node) == (8, 8, 8, 8), name


def test_a_step_config_built_without_the_flow_counts_one():
    common = {"target": "/m", "out_dir": "/o"}
    configs = [PatchWorkerConfig(**common), CaptureConfig(dataset="d", cache_root="c", **common),
               RegenerateConfig(inputs=["i"], cache_root="c", **common), OnlineConfig(draft_dir="d", data="x", **common),
               EvaluateConfig(draft_dir="d", data="x", **common)]
    assert [c.tensor_parallel_size for c in configs] == [1] * 5
    assert json.loads(json.dumps(dataclasses.asdict(configs[1])))["tensor_parallel_size"] == 1
    assert EvaluateConfig(draft_dir="d", data="x", **common).online_config().tensor_parallel_size == 1
    with pytest.raises(ConfigError, match="one device"):
        RegenerateOptions(backend="transformers", tensor_parallel_size=2)


# ----------------------------------------------------------------------------- the device check
def test_cpu_check_binds_one_core_group_per_rank():
    cores = sorted(os.sched_getaffinity(0))
    report = devices.check_cpu(1, 1, 10 * 2**20)
    assert report.kind == "cpu" and report.cpu_threads_bind == ",".join(map(str, cores))
    if len(cores) >= 2:
        assert devices.check_cpu(2, 1, 0).cpu_threads_bind.count("|") == 1
    with pytest.raises(BadInput, match="GiB is available"):
        devices.check_cpu(1, 1, 10**15)
    with pytest.raises(BadInput, match=f"^eval.tensor_parallel_size={len(cores) + 1} on a CPU host needs"):
        devices.check_cpu(len(cores) + 1, 1, 0, param="eval.tensor_parallel_size")


GPUS = [devices.Gpu(i, f"GPU-{i}aaaa", "NVIDIA H200", 143771, 143000) for i in range(8)]


def test_gpu_check_names_the_processes_holding_them():
    procs = [devices.GpuProcess("GPU-3aaaa", 4242, "python3", 70000), devices.GpuProcess("GPU-7aaaa", 99, "vllm", 100)]
    with pytest.raises(BadInput) as e:
        devices.check_gpus(8, 0.85, 10**9, GPUS, procs)
    assert "pid 4242 (python3) uses 70000 MiB on GPU 3" in str(e.value) and "pid 99 (vllm)" in str(e.value)
    assert devices.check_gpus(4, 0.85, 10**9, GPUS, procs[1:]).kind == "cuda"  # GPU 7 is not one of the four


def test_gpu_check_counts_memory_and_visibility(monkeypatch):
    with pytest.raises(BadInput, match="needs 8 GPUs; this host shows 4"):
        devices.check_gpus(8, 0.85, 0, GPUS[:4], [])
    low = [*GPUS[:7], devices.Gpu(7, "GPU-7aaaa", "NVIDIA H200", 143771, 20000)]
    with pytest.raises(BadInput, match="GPU 7 has 20000 of 143771 MiB free"):
        devices.check_gpus(8, 0.85, 0, low, [])
    with pytest.raises(BadInput, match="raise capture.tensor_parallel_size"):
        devices.check_gpus(2, 0.85, 600 * 2**30, GPUS, [], param="capture.tensor_parallel_size")  # 600 GiB on two
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6,7")
    with pytest.raises(BadInput, match="needs 4 GPUs; this host shows 2 \\(6: NVIDIA H200, 7: NVIDIA H200\\)"):
        devices.check_gpus(4, 0.85, 0, GPUS, [])


def test_a_count_the_host_cannot_hold_is_one_line_naming_the_parameter():
    with pytest.raises(BadInput) as e:
        devices.check_gpus(8, 0.85, 0, GPUS[:4], [], param="eval.tensor_parallel_size")
    assert str(e.value) == ("eval.tensor_parallel_size=8 needs 8 GPUs; this host shows 4 (0: NVIDIA H200, "
                            "1: NVIDIA H200, 2: NVIDIA H200, 3: NVIDIA H200): state this host's GPU count in "
                            "host.gpus, or set it lower")


def fake_nvidia_smi(folder: Path, monkeypatch, gpus: str, apps: str = "") -> None:
    """A stand-in for nvidia-smi (there is no GPU here) printing its csv answers."""
    script = folder / "nvidia-smi"
    script.write_text("#!/bin/sh\ncase \"$1\" in\n"
                      f"  --query-gpu=*) printf '{gpus}';;\n"
                      f"  --query-compute-apps=*) printf '{apps}';;\n"
                      "esac\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{folder}:{os.environ['PATH']}")


def test_nvidia_smi_answers_are_read(tmp_path, monkeypatch):
    fake_nvidia_smi(tmp_path, monkeypatch, "0, GPU-0aaaa, NVIDIA H200, 143771, 143000\\n1, GPU-1aaaa, NVIDIA H200, "
                    "143771, 1000\\n", "GPU-1aaaa, 777, /usr/bin/python3, 140000\\n")
    gpus, procs = devices._nvidia_smi()
    assert [g.free_mib for g in gpus] == [143000, 1000]
    assert procs == [devices.GpuProcess("GPU-1aaaa", 777, "/usr/bin/python3", 140000)]
    with pytest.raises(BadInput, match="pid 777 \\(/usr/bin/python3\\) uses 140000 MiB on GPU 1"):
        devices.check_gpus(2, 0.85, 0, gpus, procs)


def test_the_trainers_process_count_is_checked_on_a_cuda_host(tmp_path, monkeypatch):
    fake_nvidia_smi(tmp_path, monkeypatch, "0, GPU-0aaaa, NVIDIA H100, 81559, 81000\\n1, GPU-1aaaa, NVIDIA H100, "
                    "81559, 81000\\n")
    monkeypatch.setattr(devices, "host_kind", lambda: "cuda")
    devices.check_gpu_count(2, "train.nproc_per_node")
    with pytest.raises(BadInput, match="^train.nproc_per_node=8 needs 8 GPUs; this host shows 2 .*host.gpus"):
        devices.check_gpu_count(8, "train.nproc_per_node")
    monkeypatch.setattr(devices, "host_kind", lambda: "cpu")
    devices.check_gpu_count(8, "train.nproc_per_node")  # CPU processes: no GPU to count


# ----------------------------------------------------------------------------- the lifecycle
class _Refusing:
    """vLLM's LLM as a start that fails (a real failing start is tests/test_capture_ends.py's, minutes)."""

    def __init__(self, **kwargs):
        raise ValueError("no such model")


def test_a_failed_start_says_what_and_leaves_nothing_installed(monkeypatch):
    from remote.engine.lifecycle import ENDING_SIGNALS, VllmEngine

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=_Refusing))
    monkeypatch.setattr("remote.engine.lifecycle.check_devices",
                        lambda *a: devices.DeviceReport("cuda", "2 of 2 GPUs free"))
    before = {sig: signal.getsignal(sig) for sig in (*ENDING_SIGNALS, signal.SIGALRM)}
    engine = VllmEngine(CaptureOptions(tensor_parallel_size=2, engine_start_s=30), 0)
    with pytest.raises(RuntimeError, match=r"^vLLM could not start target /m \(TP=2, engine_start_s=30\): "
                                           r"ValueError: no such model"):
        engine.start(lambda on_cpu: {"model": "/m", "dtype": "float32"})
    assert {sig: signal.getsignal(sig) for sig in before} == before and engine.llm is None
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    engine.close()  # twice is fine
