"""One run at a time on a GPU host: a Prefect global concurrency limit named after the host.

    with host_slot(params.host):          # a manual run and the nightly one queue here
        capture_hidden_states(...)
        train_draft(...)

The limit `gpu-host:<host name>` (limit 1) is created on first use; an existing one is left as the
user set it (`prefect gcl update gpu-host:NAME --limit 2` lets two runs share a big host). The slot
is a lease that Prefect renews while the run lives: a run that is killed frees its host when the
lease runs out (`LEASE_S`), so a crash never blocks the host for good. The slot is re-entrant in
one run: a flow holding it can call another flow (the nightly calls the training flow) that asks
for it again without waiting on itself. Several hosts are taken in one call, all or none, so two
multi-host runs cannot each hold half of what the other needs.
"""
from __future__ import annotations

import contextvars
import threading
import time
from contextlib import contextmanager
from typing import Iterator

from tasks.host import HostParams, open_host

PREFIX = "gpu-host:"
LEASE_S = 300  # seconds a slot outlives a run that stopped renewing it (killed, lost its network)
NOTICE_AFTER_S = 2.0  # a run still waiting for its slots this long says who holds them
_held: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar("eaglet_host_slots", default=frozenset())


def slot_name(host: HostParams) -> str:
    """The limit's name for this host: the host's own name (as it shows in logs)."""
    return PREFIX + open_host(host).name  # opening is lazy: no connection is made


def ensure_limits(names: list[str], limit: int = 1) -> None:
    """Create the missing limits (limit 1); a limit that exists keeps its settings."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    with get_client(sync_client=True) as client:
        for name in names:
            try:
                client.read_global_concurrency_limit_by_name(name)
            except ObjectNotFound:
                try:
                    client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=limit))
                except ObjectAlreadyExists:  # another run made it between our read and our create
                    pass


def busy_slots(names: list[str]) -> dict[str, list[str]]:
    """The limits among names with no free slot, each with the names of the runs holding it."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter
    from prefect.runtime import flow_run

    busy = {}
    with get_client(sync_client=True) as client:
        for name in names:
            limit = client.read_global_concurrency_limit_by_name(name)
            if limit.active_slots < limit.limit:
                continue
            holders = client.read_flow_runs(flow_run_filter=FlowRunFilter(
                tags={"all_": ["host:" + name[len(PREFIX):]]}, state={"name": {"any_": ["Running"]}},
                id={"not_any_": [flow_run.id]} if flow_run.id else None))
            busy[name] = [f"'{r.name}'" for r in holders]
    return busy


def _show_state(name: str, message: str | None = None) -> None:
    """Set this flow run's state name and message as the UI shows them; the engine's own state stays Running."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run
    from prefect.states import Running

    if flow_run.id:
        with get_client(sync_client=True) as client:  # force: Running -> Running is not a transition the rules know
            client.set_flow_run_state(flow_run.id, Running(name=name, message=message), force=True)


class _WaitNotice:
    """After NOTICE_AFTER_S of waiting: a log line and the run's state name the runs holding the slots."""

    def __init__(self, names: list[str]):
        self.names, self.shown = names, False
        # the timer's thread runs in a copy of this context: the run's logger and id are found there
        self.timer = threading.Timer(NOTICE_AFTER_S, contextvars.copy_context().run, args=(self._notice,))
        self.timer.start()

    def _notice(self) -> None:
        from prefect import get_run_logger

        busy = busy_slots(self.names)
        if busy:
            message = "waiting for " + "; ".join(f"{n}, held by {', '.join(runs) or 'a run that is ending'}"
                                                  for n, runs in busy.items())
            get_run_logger().info(message)
            _show_state("Waiting for host", message)
            self.shown = True

    def end(self) -> None:
        self.timer.cancel()
        self.timer.join()  # a notice under way finishes before the state is set back
        if self.shown:
            _show_state("Running")
            self.shown = False


@contextmanager
def host_slot(*hosts: HostParams, timeout_s: float | None = None) -> Iterator[float]:
    """Hold every named host's slot for the block; yields the seconds spent waiting for them."""
    from prefect import get_run_logger
    from prefect.concurrency.sync import concurrency

    names = sorted({slot_name(h) for h in hosts} - _held.get())
    if not names:  # this run already holds them (a flow called from a flow that took the slot)
        yield 0.0
        return
    ensure_limits(names)
    started, notice = time.monotonic(), _WaitNotice(names)
    try:
        # strict: a limit that vanished must fail the run, not silently let two runs share a host
        with concurrency(names, occupy=1, timeout_seconds=timeout_s, strict=True, lease_duration=LEASE_S):
            waited = time.monotonic() - started
            notice.end()
            get_run_logger().info("holding %s (waited %.1f s)", ", ".join(names), waited)
            token = _held.set(_held.get() | set(names))
            try:
                yield waited
            finally:
                _held.reset(token)
    finally:
        notice.end()
