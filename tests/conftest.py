"""Shared test set-up: an isolated Prefect home, no hub access, the fixture plugins."""
import atexit
import os
import shutil
import tempfile

if "PREFECT_HOME" not in os.environ:  # the session's own, removed when it ends
    os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="eaglet-prefect-")
    atexit.register(shutil.rmtree, os.environ["PREFECT_HOME"], ignore_errors=True)
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

pytest_plugins = ["tests.fixtures.models", "tests.fixtures.sshd", "tests.fixtures.prefect", "tests.fixtures.prefect_server"]
