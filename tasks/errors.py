"""What can go wrong when the controller acts on a host, sorted by whether a retry can help.

Transient (retried with backoff): the connection was refused, dropped or reset (`HostUnreachable`);
the remote process crashed, was killed or ran out of time (`RemoteFault`, `CommandTimedOut`).
Not transient (fail at once): a `Refusal`, one line that names the parameter and what to do: the input
is wrong (`BadInputError`, a remote exit 65), the host key is unknown or changed (`HostKeyRefused`), the
login was refused (`LoginRefused`), the host did not answer for as long as the run waits for it
(`HostDown`, after `HostParams.wait_s`). A `HostUnreachable` caused by the resolver's "no such name" (a
misspelt hostname, not a fault of the moment) is not retried either. A run ends on a refusal with that
line as its state's message and no traceback (tasks/inputs.py).

A Prefect task opts in with `@task(retries=3, retry_condition_fn=retry_condition)`.
"""
from __future__ import annotations

import socket
from typing import Any


class EagletError(Exception):
    """Base of every error eaglet raises on purpose."""


class Refusal(EagletError):
    """The run cannot go on as asked and trying again will not help. The message says what to do; `param`
    names the setting at fault (of the host: `key_secret`; a run names it `host.key_secret`). Never retried."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(f"{param}: {message}" if param else message)
        self.param, self.message = param, message

    def line(self, field: str) -> str:
        """The refusal as one line about the parameter group `field` (`host`, `extra_hosts[0]`)."""
        return f"{field}.{self.param}: {self.message}" if self.param else f"{field}: {self.message}"


class BadInputError(Refusal):
    """The input is wrong (a missing file, a bad parameter, a remote exit 65). Never retried."""


class HostUnreachable(EagletError):
    """The SSH connection was refused, timed out, dropped or reset. Transient."""


class RemoteFault(EagletError):
    """A remote command failed for a reason other than bad input (a crash, a kill). Transient."""


class CommandTimedOut(RemoteFault):
    """A command ran past its timeout; its process tree on the host was ended."""


class HostKeyRefused(Refusal):
    """The host's key is unknown or differs from known_hosts. A configuration error: not retried."""


class LoginRefused(Refusal):
    """The host refused every key offered (wrong user, key or passphrase). Not retried."""


class HostDown(Refusal):
    """The host did not answer for as long as the run waits for one (`HostParams.wait_s`). Not retried."""


_TRANSIENT = (HostUnreachable, RemoteFault)


def is_transient(exc: BaseException | None) -> bool:
    """True when trying again may succeed: a connection fault or a remote crash, never bad input."""
    return isinstance(exc, _TRANSIENT) and not name_unresolved(exc)


# The resolver's answers that a name does not exist; EAI_AGAIN ("temporary failure") may pass and is retried.
_NO_SUCH_NAME = {getattr(socket, n) for n in ("EAI_NONAME", "EAI_NODATA", "EAI_ADDRFAMILY") if hasattr(socket, n)}


def name_unresolved(exc: BaseException | None) -> bool:
    """True when exc was caused (at any depth) by the resolver saying the host's name does not exist."""
    while exc is not None:
        if isinstance(exc, socket.gaierror) and exc.errno in _NO_SUCH_NAME:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def retry_condition(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect `retry_condition_fn`: retry the task run only when it failed on a transient error."""
    exc = state.data if isinstance(state.data, BaseException) else state.result(raise_on_failure=False)
    return is_transient(exc)
