"""The first check of a run and how a run is refused: one line a problem, naming the parameter and the
fix, and no traceback.

    problems = check_inputs(hosts, target, data, wait_s=0)   # [] when every host answers and every path exists
    if problems:
        return bad_input(problems)                    # the flow fails with one message, no traceback

    @flow(...)
    @refusals_fail_the_run                            # a Refusal raised in the flow or a task ends it the same way
    def train_draft(...): ...

Checked: every host answers (one that does not is tried again with backoff for `host.wait_s`, else the
flow's default; a name that does not resolve, an unknown host key, a refused login or a missing Secret
block is refused at once), `target.model` is a model folder and every `data.inputs` path exists on the
first host. Empty fields are the embedded default and pass.
"""
from __future__ import annotations

import functools
import inspect
import logging
import posixpath
import sys
import time
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.errors import BadInputError, HostDown, HostUnreachable, Refusal, name_unresolved
from tasks.host import Host, HostParams, open_host

BAD_INPUT = "bad input: "  # how a bad-input state's message starts
BACKOFF_MAX_S = 30.0  # the longest pause between two tries of a host that does not answer


class _NoTracebackForRefusals(logging.Filter):
    """Prefect logs a failed task ("Task run failed with exception", prefect.task_runs) and a failed flow
    ("Encountered exception during execution", and in a deployment's flow-run process "Engine execution
    exited with unexpected exception", prefect.flow_runs) with a traceback. A refusal's message says all,
    so its traceback is dropped from those records; a failure of any other kind keeps it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], Refusal):
            record.exc_info, record.exc_text = None, None
        return True


for _name in ("prefect.task_runs", "prefect.flow_runs"):
    logging.getLogger(_name).addFilter(_NoTracebackForRefusals())


@task(name="check-inputs", cache_policy=NO_CACHE)
def check_inputs(hosts: list[HostParams], target: Any, data: Any, wait_s: float = 0.0) -> list[str]:
    """What is wrong with the hosts, target.model and data.inputs, one sentence each. A host is waited for
    its own wait_s, else this flow's default wait_s."""
    problems: list[str] = []
    for i, params in enumerate(hosts):
        field = "host" if i == 0 else f"extra_hosts[{i - 1}]"
        try:
            with reach(params, wait_s if params.wait_s is None else params.wait_s) as host:
                if i == 0:
                    problems += missing_paths(host, target, data)
        except Refusal as e:
            problems.append(e.line(field))
    return problems


def reach(params: HostParams, wait_s: float) -> Host:
    """The host, connected. One that does not answer is tried again, 1, 2, 4 ... BACKOFF_MAX_S seconds
    apart, until wait_s have passed (0: one try); then HostDown says how long it waited."""
    started, pause, tries = time.monotonic(), 1.0, 0
    while True:
        host, tries = open_host(params), tries + 1
        try:
            host.exists(host.root)  # connects: the name must resolve, the key and the login must pass
            return host
        except HostUnreachable as e:
            host.close()
            if name_unresolved(e):
                raise BadInputError(f"{params.hostname!r} does not resolve on the controller; correct the name (or add "
                                    "it to DNS or /etc/hosts)", param="hostname") from None
            waited = time.monotonic() - started
            if waited >= wait_s:
                raise HostDown(f"{host.name} did not answer in {waited:.0f} s of trying ({tries} "
                               f"{'try' if tries == 1 else 'tries'}, wait_s {wait_s:g}): {e}; check that it is up and "
                               f"that sshd listens on {params.hostname}:{params.port} (hostname, port), or give it "
                               "longer (wait_s)") from None
            pause = min(pause, wait_s - waited)
            _logger().info("%s does not answer (%s); trying again in %.0f s (%.0f s of wait_s %g gone)",
                           host.name, e, pause, waited, wait_s)
            time.sleep(pause)
            pause = min(2 * pause, BACKOFF_MAX_S)
        except BaseException:
            host.close()
            raise


def _logger():
    """The run's logger in a flow or task, else this module's (a check called as a plain function)."""
    from prefect import get_run_logger
    from prefect.exceptions import MissingContextError

    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("eaglet.inputs")


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
    """The flow's Failed state for bad parameters: one message, no traceback in the log. A flow that calls
    this one as a subflow gets its BadInputError back, and is refused the same way."""
    from prefect.states import Failed

    text = "; ".join(problems)
    return Failed(message=BAD_INPUT + text, data=BadInputError(text))  # the engine logs it once, as the final state


def refusals_fail_the_run(fn):
    """A flow function that ends in `bad_input` when it, or a task it waits for, raises a Refusal (under
    `@flow`, so the parameters Prefect reads are fn's own)."""

    @functools.wraps(fn)
    def refused_cleanly(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Refusal as e:
            return bad_input([str(e)])

    # fn's signature with its annotations read in fn's own module: Prefect resolves the names it finds there in
    # the namespace of the function it is given, this one's
    refused_cleanly.__signature__ = inspect.signature(fn, eval_str=True)
    return refused_cleanly


def refuse_preset(preset: str | None, error: Exception) -> int:
    """A command line's answer to a preset or --set that cannot be read: one line on stderr, exit 65."""
    from remote.step import EXIT_BAD_INPUT

    if hasattr(error, "errors"):  # pydantic's ValidationError: each error's place and message
        what = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']} (got {err['input']!r})"
                         for err in error.errors())
    else:
        what = str(error)
    print(f"{BAD_INPUT}{'preset ' + preset if preset else 'parameters'}: {what}", file=sys.stderr)
    return EXIT_BAD_INPUT


def exit_status(state) -> int:
    """A command line's exit status for a flow's final state: 0, 65 for bad input (its message on stderr), 1."""
    from remote.step import EXIT_BAD_INPUT

    if state.is_completed():
        return 0
    print(f"{state.name}: {state.message}", file=sys.stderr)
    return EXIT_BAD_INPUT if (state.message or "").startswith(BAD_INPUT) else 1
