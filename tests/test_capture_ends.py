"""The capture step ends its vLLM engine whatever happens (`python -m remote.capture.capture` as the host runs
it, on the 8-layer random Llama of tests/test_capture_vllm.py, tensor parallel over two CPU ranks so
the engine has an engine-core process and two worker processes): SIGTERM while the engine starts
and while it captures leaves no process behind; a start that cannot finish (corrupt weights, or one
slower than engine_start_s) fails within a bound, with a message naming the target. One engine at a
time: these runs are subprocesses, one after the other, and no in-process engine is made here.

The time bounds are a quiet machine's, multiplied by how loaded this one is (`Load`): a CPU-bound
teardown on a 2-core machine at load 8 takes about four times as long, and a green suite must not go
red because the CI machine is busy. What ended the step (the signal handler's exit code, the alarm's
error) is asserted apart from the time, and the time is printed."""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from tests.fixtures.capture import kill_group, random_samples, start_step, write_dataset
from tests.fixtures.models import make_tiny_llama


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("llama128"), num_layers=8, hidden=128)


@pytest.fixture(scope="module")
def base(tmp_path_factory, llama) -> dict:
    tmp = tmp_path_factory.mktemp("capture-ends")
    # enough tokens that the capture itself runs for a while on two CPU ranks
    samples = random_samples(np.random.default_rng(5).integers(100, 200, 600).tolist(), vocab=500, seed=5)
    return {"dataset": str(write_dataset(tmp / "data.parquet", samples)), "target": str(llama),
            "cache_root": str(tmp / "cache"), "samples_per_shard": 16, "max_num_seqs": 8,
            "max_num_batched_tokens": 512, "dtype": "float32", "cpu_kvcache_gib": 1, "tensor_parallel_size": 2}


class Step:
    """A capture step in its own session, every process ever seen below it recorded."""

    def __init__(self, tmp: Path, name: str, config: dict):
        self.proc, self.log_path = start_step(tmp, name, {**config, "out_dir": str(tmp / name)})
        self.seen: dict[int, str] = {}
        self._watch = threading.Thread(target=self._record, daemon=True)
        self._watch.start()

    def _record(self) -> None:
        root = psutil.Process(self.proc.pid)
        while self.proc.poll() is None:
            try:
                for p in root.children(recursive=True):
                    self.seen[p.pid] = p.name()  # its title once vLLM set it
            except psutil.Error:
                pass
            time.sleep(0.1)

    @property
    def log(self) -> str:
        return self.log_path.read_text()

    def wait_for(self, what, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not what():
            assert self.proc.poll() is None, f"the step ended first (exit {self.proc.returncode}):\n{self.log[-3000:]}"
            assert time.monotonic() < deadline, f"waited {timeout} s in vain:\n{self.log[-3000:]}"
            time.sleep(0.1)

    def engine_processes(self) -> list[str]:
        return [n for n in self.seen.values() if n.startswith("VLLM::")]

    def survivors(self) -> list[str]:
        """Processes of the step still running: any seen below it, and any left in its session."""
        out = []
        for p in psutil.process_iter(["pid", "name", "status"]):
            mine = p.pid in self.seen or _sid(p.pid) == self.proc.pid
            if mine and p.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(f"{p.pid} {p.info['name']}")
        return out

    def end(self) -> None:
        kill_group(self.proc)
        self._watch.join(5)


class Load:
    """The machine's load over a measurement: runnable processes per core, at least 1 (a quiet machine)."""

    def __init__(self):
        self.factor = self._now()

    @staticmethod
    def _now() -> float:
        return max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))

    def bound(self, quiet_s: float) -> float:
        """quiet_s scaled by the highest load seen since the start (the 1-minute average lags)."""
        self.factor = max(self.factor, self._now())
        return quiet_s * self.factor


def _sid(pid: int) -> int:
    try:
        return os.getsid(pid)
    except OSError:
        return -1


def assert_nothing_left(step: Step, within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while (left := step.survivors()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"still running after the step ended: {left}; seen: {step.seen}"


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("when", ["starting", "capturing"])
def test_sigterm_ends_the_engine_and_its_workers(tmp_path, base, when):
    step = Step(tmp_path, f"term-{when}", base)
    try:
        if when == "starting":  # the workers run, the engine is not up yet: capture holds no LLM object
            step.wait_for(lambda: sum(n.startswith("VLLM::Worker") for n in step.seen.values()) >= 2
                          and "vLLM engine up" not in step.log)
        else:
            step.wait_for(lambda: "hooked ." in step.log)
        sent, load = time.monotonic(), Load()
        step.proc.send_signal(signal.SIGTERM)
        code = step.proc.wait(300)
        took = time.monotonic() - sent
        assert code == 128 + signal.SIGTERM, step.log[-3000:]  # the step's handler ended it, not a kill
        assert "capture done" not in step.log  # really interrupted
        assert len(step.engine_processes()) >= 3, step.seen  # engine core and two workers were there
        assert took < load.bound(30), f"SIGTERM took {took:.1f} s to end the step (load x{load.factor:.1f})"
        print(f"SIGTERM while {when}: the step ended after {took:.1f} s (load x{load.factor:.1f})")
        assert_nothing_left(step)
        assert not (tmp_path / f"term-{when}").exists()  # nothing that looks finished
    finally:
        step.end()


@pytest.mark.vllm
@pytest.mark.slow
def test_corrupt_weights_fail_the_start_soon_naming_the_target(tmp_path, base, llama):
    bad = tmp_path / "corrupt-llama"
    bad.mkdir()
    for f in Path(llama).iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # cut in half, as a broken copy
    step = Step(tmp_path, "corrupt", {**base, "target": str(bad), "cache_root": str(tmp_path / "cache")})
    try:
        started, load = time.monotonic(), Load()
        code = step.proc.wait(600)
        assert code not in (0, 65), step.log[-3000:]  # a fault: a later try may find the file mended
        assert f"vLLM could not start target {bad} (TP=2" in step.log, step.log[-3000:]
        took = time.monotonic() - started
        assert took < load.bound(120), f"failed after {took:.1f} s (load x{load.factor:.1f})"
        print(f"corrupt weights: the step failed after {took:.1f} s")
        assert_nothing_left(step)
    finally:
        step.end()


@pytest.mark.vllm
@pytest.mark.slow
def test_a_start_slower_than_engine_start_s_is_ended(tmp_path, base):
    step = Step(tmp_path, "slow-start", {**base, "engine_start_s": 4, "cache_root": str(tmp_path / "cache")})
    try:
        step.wait_for(lambda: "devices:" in step.log, timeout=120)  # the engine start begins
        started, load = time.monotonic(), Load()
        code = step.proc.wait(300)
        took = time.monotonic() - started
        assert code not in (0, 65), step.log[-3000:]
        # the alarm ended it: without engine_start_s vLLM would wait for its engine far longer
        assert "engine_start_s=4): EngineStartTimedOut: not up within engine_start_s" in step.log, step.log[-3000:]
        assert took < 4 + load.bound(15), f"ended {took:.1f} s after the start began (load x{load.factor:.1f})"
        print(f"engine_start_s=4: the step ended {took:.1f} s after the start began (load x{load.factor:.1f})")
        assert_nothing_left(step)
    finally:
        step.end()
