"""The first check of a run: the parameters that name things on the hosts, before anything expensive.

    problems = check_inputs(hosts, target, data)     # [] when every name resolves and every path exists
    if problems:
        return bad_input(problems)                    # the flow fails with one message, no traceback

Each problem names the parameter, what is wrong and what to do. Checked: every host's name resolves
(a misspelt hostname is bad input, not a fault to retry), `target.model` is a model folder and every
`data.inputs` path exists on the first host. Empty fields are the embedded default and pass.
"""
from __future__ import annotations

import logging
import posixpath
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.errors import HostUnreachable, name_unresolved
from tasks.host import HostParams, open_host

BAD_INPUT = "bad input: "  # how a bad-input state's message starts


class _NoTracebackForBadInput(logging.Filter):
    """A deployment's flow-run process logs the failure of its run with a traceback ("Engine execution
    exited with unexpected exception", prefect.flow_engine); for bad input the state's message says
    all, so the traceback is dropped from that record (a failure of any other kind keeps it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and BAD_INPUT in str(record.exc_info[1]):
            record.exc_info, record.exc_text = None, None
        return True


logging.getLogger("prefect.flow_runs").addFilter(_NoTracebackForBadInput())


@task(name="check-inputs", cache_policy=NO_CACHE)
def check_inputs(hosts: list[HostParams], target: Any, data: Any) -> list[str]:
    """What is wrong with the hosts, target.model and data.inputs, one sentence each."""
    problems: list[str] = []
    for i, params in enumerate(hosts):
        field = "host" if i == 0 else f"extra_hosts[{i - 1}]"
        try:
            with open_host(params) as host:
                host.exists(host.root)  # connects: the name must resolve
                if i == 0:
                    problems += missing_paths(host, target, data)
        except HostUnreachable as e:
            if not name_unresolved(e):
                raise  # a host that is down is a fault: the step tasks retry it
            problems.append(f"{field}.hostname: {params.hostname!r} does not resolve on the controller; correct the "
                            "name (or add it to DNS or /etc/hosts)")
    return problems


def missing_paths(host: Any, target: Any, data: Any) -> list[str]:
    problems = []
    if target.model and not host.exists(posixpath.join(target.model, "config.json")):
        what = "has no config.json" if host.exists(target.model) else "does not exist"
        problems.append(f"target.model: {target.model} {what} on {host.name}; set it to a Hugging Face model folder "
                        "on the host (config.json, weights, tokenizer), or leave it empty for the embedded "
                        "SmolLM2-135M-Instruct")
    for i, path in enumerate(data.inputs):
        if not host.exists(path):
            problems.append(f"data.inputs[{i}]: {path} does not exist on {host.name}; name chat files or folders on "
                            "the host (JSONL, JSON, Parquet), or leave data.inputs empty for the embedded ShareGPT sample")
    return problems


def bad_input(problems: list[str]):
    """The flow's Failed state for bad parameters: one message, no traceback in the log."""
    from prefect.states import Failed

    return Failed(message=BAD_INPUT + "; ".join(problems))  # the engine logs it once, as the final state


def exit_status(state) -> int:
    """A command line's exit status for a flow's final state: 0, 65 for bad input (its message on stderr), 1."""
    import sys

    from remote.step import EXIT_BAD_INPUT

    if state.is_completed():
        return 0
    print(f"{state.name}: {state.message}", file=sys.stderr)
    return EXIT_BAD_INPUT if (state.message or "").startswith(BAD_INPUT) else 1
