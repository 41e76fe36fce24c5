"""Shared test set-up: an isolated Prefect home, no hub access, the fixture plugins."""
import atexit
import os
import shutil
import tempfile

import pytest
import torch

if "PREFECT_HOME" not in os.environ:  # the session's own, removed when it ends
    os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="eaglet-prefect-")
    atexit.register(shutil.rmtree, os.environ["PREFECT_HOME"], ignore_errors=True)
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

pytest_plugins = ["tests.fixtures.models", "tests.fixtures.sshd", "tests.fixtures.prefect", "tests.fixtures.prefect_server"]


@pytest.fixture(autouse=True)
def _process_state_restored():
    """Each test leaves this process's environment and torch thread count as it found them. The steps' in-process
    engines set both, as a step's own process may (VLLM_ENABLE_V1_MULTIPROCESSING=0, one thread a core), and
    vLLM's CPU worker turns torch.set_num_threads into a no-op: left as they were, a later test's step started
    no engine-core process, and tests after a `cpu_threads: 1` run computed on one thread."""
    env, setter, threads = dict(os.environ), torch.set_num_threads, torch.get_num_threads()
    yield
    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads = setter
    setter(threads)
