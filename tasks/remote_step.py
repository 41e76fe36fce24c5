"""Run one remote step on a host and bring back its manifest (docs/CONVENTIONS.md is the contract).

    code = ship_code(host)
    manifest = run_remote_step(host, code, "prepare", {"out_dir": f"{run_dir}/prepare", ...},
                               run_dir=run_dir, timeout=3600, on_event=print, log=print)

The config travels as `<run_dir>/<step>.config.json`; the step runs as
`<python> -m <step module> --config <that file>` in the shipped code folder, under `remote.guard`
(which ends it, and whatever it started, when the controller's session ends). Its exit code decides:
0 -> the manifest in `config["out_dir"]` is returned; 65 -> BadInputError (never retried); anything
else -> RemoteFault (retried). Inside a Prefect task use `run_step_in_task`, which sends the remote
lines to the run log as they arrive (an engine's warnings, tracebacks and progress bars at debug level,
counted in one line at the end), the progress events to a progress artifact (removed when the step ends
well; a failed step's stays where it stopped), and one progress line (done/total, loss and accuracy while
training, tokens/s, ETA) to the log every PROGRESS_LOG_EVERY_S.
"""
from __future__ import annotations

import json
import logging
import posixpath
import queue
import re
import threading
import time
from typing import Callable

from remote.step import EVENT_PREFIX, EXIT_BAD_INPUT, MANIFEST, step_module
from tasks.errors import BadInputError, CommandTimedOut, RemoteFault
from tasks.host import CommandResult, Host
from tasks.ship import ShippedCode

_STEP_NAME = re.compile(r"[a-z_][a-z0-9_]*\Z")
PROGRESS_EVERY_S = 1.0  # at most one progress artifact update a second: the API is not a log
PROGRESS_LOG_EVERY_S = 30.0  # a progress line in the run log this often while a long step runs
# Engine output a successful run need not show: vLLM's WARNING lines (a worker's carry a "(Name pid=N) "
# prefix), Python's warnings (and the source line under each), torch's C++ ones ("[W1205 06:51:52.300162048
# utils.cpp:68] Warning: ..."), blank lines, tqdm bars (carriage returns, "NN%|"), and the lines of a traceback
# it printed and survived.
# vLLM's own log lines, any level: the step says what matters of them in its own words ("... engine up in 11.2 s")
_VLLM_LOG = re.compile(r"^(\([\w.-]+ pid=\d+\)\s+)?(DEBUG|INFO|WARNING) \d\d-\d\d [\d:]+ \[")
_PY_WARNING = re.compile(r"^(\([\w.-]+ pid=\d+\)\s+)?\S+\.py:\d+: \w*Warning: ")
_C10_WARNING = re.compile(r"^(\([\w.-]+ pid=\d+\)\s+)?\[W\d{4} [\d:.]+ (\d+ )?[\w.]+:\d+\] Warning: ")
_TQDM = re.compile(r"\r|\d+%\|")
_TRACEBACK = re.compile(r"^(\([\w.-]+ pid=\d+\)\s+)?Traceback \(most recent call last\):")
# nanobind's leak report as an interpreter with Triton loaded exits (torch imports it on a CPU host too): a
# header line per kind ("nanobind: leaked 514 functions!"), ten " - leaked ..." lines each, and a link
# vLLM's notice as each of its processes starts on a CPU host (printed, not logged)
_TRITON_CPU = re.compile(r"^(\([\w.-]+ pid=\d+\)\s+)?Triton is installed, but doesn't include CPU backend")
_NANOBIND = re.compile(r"^(nanobind: |See https://nanobind\.|\s*- (leaked |\.\.\. skipped remainder))")


def config_path(run_dir: str, step: str) -> str:
    return posixpath.join(run_dir, f"{step}.config.json")


def run_remote_step(host: Host, code: ShippedCode, step: str, config: dict, *, run_dir: str, timeout: float,
                    on_event: Callable[[dict], None] | None = None,
                    log: Callable[[str], None] | None = None) -> dict:
    """Run `remote.<step>` with this config on the host; returns the manifest it wrote."""
    if not _STEP_NAME.match(step):
        raise BadInputError(f"step name {step!r} is not a module name of the remote package")
    out_dir = config.get("out_dir")
    if not isinstance(out_dir, str) or not out_dir:
        raise BadInputError(f"the config of step {step} needs an out_dir (a path on the host), got {out_dir!r}")
    host.makedirs(run_dir)
    cfg = config_path(run_dir, step)
    host.write_text(cfg, json.dumps(config, indent=2, sort_keys=True, default=str) + "\n")
    lines = _StepLines(host.name, on_event, log)
    try:
        # remote.guard ends the step and everything it started when the session does (docs/CONVENTIONS.md)
        result = host.run([host.python, "-m", "remote.guard", host.python, "-m", step_module(step), "--config", cfg],
                          cwd=code.path, env={"PYTHONPATH": code.path, "EAGLET_CODE_HASH": code.sha},
                          timeout=timeout, on_line=lines)
    except CommandTimedOut as e:
        raise CommandTimedOut(f"step {step}: {e}") from e
    return _outcome(host, step, out_dir, result, lines.bad_input)


class _StepLines:
    """Sorts a step's output: event lines to on_event, every other line to log (host-prefixed)."""

    def __init__(self, host_name: str, on_event, log):
        self.prefix, self.on_event, self.log = f"[{host_name}] ", on_event, log
        self.bad_input: str | None = None  # the message of a bad_input event, if one came

    def __call__(self, stream: str, line: str) -> None:
        event = _event(line) if stream == "stdout" else None
        if event is None:
            if self.log is not None:
                self.log(self.prefix + line)
            return
        if event.get("event") == "bad_input":
            self.bad_input = str(event.get("message", ""))
        if self.on_event is not None:
            self.on_event(event)


def _event(line: str) -> dict | None:
    """The JSON event of a line starting with EVENT_PREFIX; None for any other (or a garbled) line."""
    if not line.startswith(EVENT_PREFIX):
        return None
    try:
        event = json.loads(line[len(EVENT_PREFIX):])
    except json.JSONDecodeError:
        return None
    return event if isinstance(event, dict) and "event" in event else None


def _outcome(host: Host, step: str, out_dir: str, r: CommandResult, bad_input: str | None) -> dict:
    where = f"step {step} on {host.name}"
    if r.exit_code == 0:
        try:
            return json.loads(host.read_text(posixpath.join(out_dir, MANIFEST)))
        except FileNotFoundError:
            raise RemoteFault(f"{where} exited 0 but wrote no {posixpath.join(out_dir, MANIFEST)}") from None
        except json.JSONDecodeError as e:
            raise RemoteFault(f"{where} wrote an unreadable manifest in {out_dir}: {e}") from e
    tail = "\n".join(r.stderr_tail[-20:])
    if r.exit_code == EXIT_BAD_INPUT:
        raise BadInputError(f"{where}: {bad_input or tail or '(no message)'}")  # the flow's message says "bad input: "
    raise RemoteFault(f"{where} failed ({_describe_exit(r.exit_code)}) after {r.seconds:.1f} s; stderr ends:\n{tail}")


def _describe_exit(code: int) -> str:
    if code == -1:
        return "ended by a signal"  # what SSH reports for a process killed by a signal
    if code < 0:
        return f"killed by signal {-code}"
    if code == 137:
        return "exit 137: killed (SIGKILL; out of memory?)"
    return f"exit {code}"


# ----------------------------------------------------------------------------- inside a Prefect task
def run_step_in_task(host: Host, code: ShippedCode, step: str, config: dict, *, run_dir: str, timeout: float,
                     progress_title: str) -> dict:
    """run_remote_step from a Prefect task body: remote lines into the run log as they come, progress
    events into a progress artifact and a progress line every PROGRESS_LOG_EVERY_S; the manifest
    comes back with the other events under 'events'.

    The host's reader threads have no Prefect context, so they only fill a queue; this thread (the
    task's) drains it while a worker thread waits for the command.
    """
    from prefect import get_run_logger

    logger = get_run_logger()
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    outcome: dict = {}

    def work() -> None:
        try:
            outcome["manifest"] = run_remote_step(
                host, code, step, config, run_dir=run_dir, timeout=timeout,
                on_event=lambda e: inbox.put(("event", e)), log=lambda line: inbox.put(("log", line)))
        except BaseException as e:  # noqa: BLE001 - raised again in the task's thread below
            outcome["error"] = e
        finally:
            inbox.put(("done", None))

    title = f"{progress_title} ({step} on {host.name})"
    progress, noise = _Progress(title, artifact_key(step, host.name), logger), EngineNoise()
    events: list[dict] = []
    worker = threading.Thread(target=work, name=f"eaglet-step-{step}", daemon=True)
    worker.start()
    while (item := inbox.get())[0] != "done":
        kind, payload = item
        if kind == "log":
            logger.log(logging.DEBUG if noise.is_noise(payload.split("] ", 1)[-1]) else logging.INFO, payload)
        elif payload.get("event") == "progress":
            progress.update(payload)
        else:
            progress.note(payload)
            events.append(payload)
    worker.join()
    if noise.count:
        logger.info("%s: %d engine lines (vLLM's log, warnings, tracebacks it survived, progress bars, leak reports) "
                    "at debug level",
                    title, noise.count)
    if "error" in outcome:
        raise outcome["error"]  # the progress card stays, at the point the step reached
    progress.remove()  # done: the step's own artifacts and the log say the rest
    return {**outcome["manifest"], "events": events}


def artifact_key(step: str, host_name: str) -> str:
    """A progress artifact's key: Prefect keys are lowercase letters, digits and dashes."""
    return re.sub(r"[^a-z0-9]+", "-", f"progress-{step}-{host_name}".lower()).strip("-")


class EngineNoise:
    """Tells the lines of an engine's noise (see _VLLM_LOG, _NANOBIND) from the step's own; counts them."""

    def __init__(self):
        self.count, self._in_traceback, self._after_warning = 0, False, False

    def is_noise(self, line: str) -> bool:
        source_line = self._after_warning and line[:1].isspace()  # the code a Python warning quotes
        self._after_warning = bool(_PY_WARNING.match(line))
        if _TRACEBACK.match(line):
            self._in_traceback = True
        elif self._in_traceback and not line[:1].isspace():
            self._in_traceback = False
            noisy = bool(re.match(r"^[\w.]+(Error|Exception|Warning)\b", line))  # the traceback's last line
            self.count += noisy
            return noisy or self.is_noise(line)
        noisy = self._in_traceback or source_line or not line.strip() or bool(
            self._after_warning or _C10_WARNING.match(line) or _VLLM_LOG.match(line) or _TQDM.search(line)
            or _NANOBIND.match(line) or _TRITON_CPU.match(line))
        self.count += noisy
        return noisy


def progress_line(title: str, event: dict, train: dict, eta_s: float | None) -> str:
    """One readable line of a step's progress: done/total, the training figures when there are, ETA."""
    done, total = event.get("done", 0), event.get("total") or 0
    what = event.get("what") or event.get("unit") or ("samples" if "samples" in event else "")
    parts = [f"{title}: {done:g}/{total:g} {what}".rstrip() + (f" ({100 * done / total:.0f}%)" if total else "")]
    loss = train.get("loss", event.get("loss"))
    if loss is not None:
        parts.append(f"loss {loss:.4f}")
    if train.get("acc"):
        parts.append("accuracy " + "/".join(f"{a:.2f}" for a in train["acc"]))
    tps = train.get("tokens_per_s", event.get("tokens_per_s"))
    if tps:
        parts.append(f"{tps:,.0f} tokens/s")
    if eta_s is not None:
        parts.append(f"ETA {_duration(eta_s)}")
    return ", ".join(parts)


def _duration(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


class _Progress:
    """A step's progress: one keyed Prefect progress artifact fed by `progress` events ({"done": n,
    "total": m}), and a line in the run log every PROGRESS_LOG_EVERY_S (with the latest `train` event)."""

    def __init__(self, title: str, key: str, logger):
        from prefect.artifacts import create_progress_artifact

        self.artifact_id, self.key = create_progress_artifact(0.0, key=key, description=title), key
        self.title, self.logger, self.train = title, logger, {}
        self.sent, self.latest, self.sent_at = 0.0, 0.0, time.monotonic()
        self.logged_at, self.first = time.monotonic(), None  # first: (time, done) of the first event, the ETA's rate

    def note(self, event: dict) -> None:
        if event.get("event") == "train":
            self.train = event

    def update(self, event: dict) -> None:
        total = float(event.get("total") or 0)
        self.latest = max(0.0, min(100.0, 100.0 * float(event.get("done", 0)) / total)) if total > 0 else 0.0
        now = time.monotonic()
        if now - self.sent_at >= PROGRESS_EVERY_S or self.latest >= 100.0:
            self._send(self.latest)
        if self.first is None:
            self.first = (now, float(event.get("done", 0)))
        if now - self.logged_at >= PROGRESS_LOG_EVERY_S:
            self.logger.info(progress_line(self.title, event, self.train, self._eta(now, event)))
            self.logged_at = now

    def _eta(self, now: float, event: dict) -> float | None:
        t0, done0 = self.first
        done, total = float(event.get("done", 0)), float(event.get("total") or 0)
        if total <= 0 or done <= done0 or now <= t0:
            return None
        return (total - done) * (now - t0) / (done - done0)

    def remove(self) -> None:
        """The step's cards off the run page (this try's, and those an earlier try of it left where it stopped):
        a finished step's 100% says nothing that its log line and artifacts do not."""
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import ArtifactFilter
        from prefect.runtime import flow_run

        with get_client(sync_client=True) as client:
            cards = {self.artifact_id}
            if flow_run.id:
                cards |= {a.id for a in client.read_artifacts(artifact_filter=ArtifactFilter(
                    key={"any_": [self.key]}, flow_run_id={"any_": [flow_run.id]}, type={"any_": ["progress"]}))}
            for card in cards:
                client.delete_artifact(card)

    def _send(self, pct: float) -> None:
        from prefect.artifacts import update_progress_artifact

        if pct != self.sent:
            update_progress_artifact(self.artifact_id, pct)
        self.sent, self.sent_at = pct, time.monotonic()
