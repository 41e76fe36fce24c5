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
import time
from contextlib import contextmanager
from typing import Iterator

from tasks.host import HostParams, open_host

PREFIX = "gpu-host:"
LEASE_S = 300  # seconds a slot outlives a run that stopped renewing it (killed, lost its network)
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
    logger = get_run_logger()
    logger.info("waiting for %s (another run on the same host holds it until it ends)", ", ".join(names))
    started = time.monotonic()
    # strict: a limit that vanished must fail the run, not silently let two runs share a host
    with concurrency(names, occupy=1, timeout_seconds=timeout_s, strict=True, lease_duration=LEASE_S):
        waited = time.monotonic() - started
        logger.info("got %s after %.1f s", ", ".join(names), waited)
        token = _held.set(_held.get() | set(names))
        try:
            yield waited
        finally:
            _held.reset(token)
