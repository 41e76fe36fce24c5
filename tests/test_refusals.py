"""One failure path for what refuses a run before the GPUs start: a missing Secret block, an unknown host
key, a refused login, a host that does not answer (tried again for host.wait_s), bad data. Each ends the
run with one line naming the parameter and the fix, and no traceback in the run log or on the command
line. A real sshd (tests/fixtures/sshd.py), the real Prefect test harness, the real CLI in a subprocess.

    .venv/bin/python -m pytest tests/test_refusals.py -q
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from flows.params import DataParams, TargetParams
from flows.train_draft import train_draft
from tasks.inputs import check_inputs
from tests.fixtures.sshd import make_key

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.ssh


def _closed_port() -> int:
    with socket.socket() as s:  # bound, never listened on: a connect is refused at once
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_log(state) -> tuple[list[str], list[str]]:
    """The run's log messages and its task names, as the Prefect API has them."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, LogFilter
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()
    run_id = state.state_details.flow_run_id
    with get_client(sync_client=True) as client:
        logs = [e.message for e in client.read_logs(LogFilter(flow_run_id={"any_": [run_id]}))]
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [run_id]}))
    return logs, [t.name.rsplit("-", 1)[0] for t in tasks]


def test_a_missing_secret_block_is_one_line_naming_host_key_secret(prefect_harness, sshd, tmp_path):
    host = sshd.params(key_filename=None, key_secret="eaglet-test-no-such-key", root=str(tmp_path / "root"))
    state = train_draft(host=host, return_state=True)
    assert state.is_failed()
    assert state.message.startswith("bad input: host.key_secret: the Prefect server has no Secret block named "
                                    "'eaglet-test-no-such-key'; save the private key that logs in to the host in "
                                    "one: `python -c \"from prefect.blocks.system import Secret; ")
    assert "\n" not in state.message and "or leave key_secret empty" in state.message
    logs, tasks = _run_log(state)
    assert tasks == ["check-inputs"], "refused before any step"
    assert not [m for m in logs if "Traceback" in m], logs


def test_the_shipped_kimi_preset_without_its_secret_block_exits_65_in_one_line(prefect_harness):
    """`python -m flows.train_draft --preset deployments/kimi-k25-8gpu.json` as the docs run it, against the
    harness's server (a command line without PREFECT_API_URL starts its own, which takes 10-20 s more)."""
    from prefect.settings import PREFECT_API_URL

    started = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "flows.train_draft", "--preset", "deployments/kimi-k25-8gpu.json"],
                       cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()})
    seconds = time.monotonic() - started
    out = r.stdout + r.stderr
    assert r.returncode == 65, out
    assert "Traceback" not in out, out
    (line,) = r.stderr.strip().splitlines()[-1:]
    assert line.startswith("Failed: bad input: host.key_secret: the Prefect server has no Secret block named "
                           "'kimi-node-1-ssh-key'")
    assert seconds < 30, f"{seconds:.0f} s"


def test_a_bad_preset_value_is_one_line_on_the_command_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "flows.train_draft", "--set", "train.epochs=-1"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 65 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip() == ("bad input: parameters: train.epochs: Input should be greater than or equal to 0 "
                                "(got -1)")


def test_a_host_that_does_not_answer_is_tried_for_wait_s_then_refused(prefect_harness, sshd, tmp_path):
    port = _closed_port()
    started = time.monotonic()
    state = train_draft(host=sshd.params(port=port, wait_s=4, root=str(tmp_path / "root")), return_state=True)
    seconds = time.monotonic() - started
    assert state.is_failed() and seconds >= 4
    assert state.message.startswith(f"bad input: host: 127.0.0.1:{port} did not answer in 4 s of trying ("), \
        state.message
    assert f"wait_s 4): " in state.message and f"sshd listens on 127.0.0.1:{port}" in state.message
    logs, tasks = _run_log(state)
    assert tasks == ["check-inputs"]
    retries = [m for m in logs if "does not answer" in m and "trying again in" in m]
    assert len(retries) >= 2, logs  # 1 s, 2 s, then what is left of the 4
    assert not [m for m in logs if "Traceback" in m], logs


def test_a_host_that_comes_up_during_the_wait_is_used(own_sshd):
    own_sshd.stop()
    threading.Timer(2.0, own_sshd.start).start()
    started = time.monotonic()
    params = own_sshd.params(root=str(own_sshd.dir / "root"), wait_s=60)
    assert check_inputs.fn([params], TargetParams(), DataParams()) == []
    assert 2.0 <= time.monotonic() - started < 30


def test_an_unknown_host_key_and_a_refused_login_are_one_line_each(sshd, tmp_path):
    unknown = sshd.params(known_hosts=str(tmp_path / "empty_known_hosts"))
    (problem,) = check_inputs.fn([unknown], TargetParams(), DataParams())
    assert problem.startswith(f"host.known_hosts: host key of [127.0.0.1]:{sshd.port} is unknown: it offers ")
    assert "ssh-keyscan" in problem and "trust_unknown_host_key=true" in problem

    make_key(tmp_path / "stranger")
    stranger = sshd.params(key_filename=str(tmp_path / "stranger"))
    (problem,) = check_inputs.fn([sshd.params(), stranger], TargetParams(), DataParams())
    assert problem.startswith(f"extra_hosts[0].user: 127.0.0.1:{sshd.port} refused the login as 'root' (")
    assert problem.endswith("check user and the key (key_secret, key_filename or the SSH agent's)")


def test_bad_data_fails_the_run_with_the_steps_message_and_no_traceback(prefect_harness, tiny_llama, tmp_path):
    from flows.params import TrainDraftParams
    from tests.fixtures.tiny_run import tiny_params

    chats = tmp_path / "chats.jsonl"
    chats.write_text('{"conversations": "not a list"}\n' * 3)
    params = TrainDraftParams.model_validate(tiny_params(tmp_path / "root", tiny_llama, [chats]))
    state = train_draft(**{name: getattr(params, name) for name in TrainDraftParams.model_fields}, return_state=True)
    assert state.is_failed() and state.message.startswith("bad input: step prepare on local: "), state.message
    logs, tasks = _run_log(state)
    assert "prepare-data" in tasks and "capture-hidden-states" not in tasks
    assert not [m for m in logs if "Traceback" in m], logs
