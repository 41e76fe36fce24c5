"""What every step task of one flow run shares: the host, the shipped code, the run's folder;
and the one retry policy every step task uses."""
from __future__ import annotations

import posixpath
from dataclasses import dataclass
from functools import partial

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.tasks import exponential_backoff

from tasks.errors import retry_condition
from tasks.host import HostParams, open_host
from tasks.remote_step import run_step_in_task
from tasks.ship import ShippedCode

# A step task retries transient faults (SSH drops, a killed process) with backoff, never bad input.
# No Prefect cache: a step's own manifest on the host is what makes a re-run skip finished work.
step_task = partial(task, retries=3, retry_delay_seconds=exponential_backoff(backoff_factor=2),
                    retry_jitter_factor=0.5, retry_condition_fn=retry_condition, cache_policy=NO_CACHE)


@dataclass(frozen=True)
class RunContext:
    host: HostParams
    code: ShippedCode
    run_name: str
    part: int = 0  # this host's index in a run over several hosts (node 0 first)
    parts: int = 1  # hosts in the run

    @property
    def root(self) -> str:
        return self.code.root

    @property
    def run_dir(self) -> str:
        return posixpath.join(self.root, "runs", self.run_name)

    @property
    def cache_root(self) -> str:
        return posixpath.join(self.root, "cache")

    def step_dir(self, step: str) -> str:
        return posixpath.join(self.run_dir, step)

    def run_step(self, step: str, config: dict, *, timeout: float, title: str | None = None) -> dict:
        """Run `remote.<step>` on the host with this config; the manifest it wrote comes back."""
        with open_host(self.host) as host:
            return run_step_in_task(host, self.code, step, config, run_dir=self.run_dir,
                                    timeout=timeout, progress_title=title or step)
