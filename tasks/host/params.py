"""Where and how to reach a host (`HostParams`, also saved as an `eaglet-host` block), and its name.

    params = HostParams(kind="ssh", hostname="gpu1", user="me", root="/data/eaglet", key_secret="gpu1-key")
    params.display_name    # 'gpu1': the one name logs, slots and errors use for this host
"""
from __future__ import annotations

import re
from typing import Literal, Mapping, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tasks.errors import BadInputError

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def check_env_names(env: Mapping[str, str]) -> Mapping[str, str]:
    """Refuse names a shell or `env` would misread (`A=B`, spaces): they must be identifiers."""
    bad = [k for k in env if not ENV_NAME.match(k)]
    if bad:
        raise ValueError(f"env names must be shell identifiers; bad: {bad}")
    return env


class HostParams(BaseModel):
    """Where and how to reach a host; flow parameters or a saved block. Holds no secret itself."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["local", "ssh"] = Field("local", description="local: subprocesses here; ssh: a host reached over SSH")
    name: Optional[str] = Field(None, description="name in logs; none: 'local' or the hostname")
    hostname: str = Field("127.0.0.1", description="address of the SSH host")
    port: int = Field(22, ge=1, le=65535, description="SSH port")
    user: Optional[str] = Field(None, description="login user; none: the controller's user")
    root: Optional[str] = Field(None, description="working root on the host; none: ./work (local) or ~/eaglet (ssh)")
    python: Optional[str] = Field(None, description="the host's interpreter; none: this one (local) or python3 (ssh)")
    known_hosts: Optional[str] = Field(None, description="known_hosts file checked; none: ~/.ssh/known_hosts")
    trust_unknown_host_key: bool = Field(False, description="accept an unknown host key once and record it (a changed key is always refused)")
    key_filename: Optional[str] = Field(None, description="private key file on the controller")
    key_secret: Optional[str] = Field(None, description="name of a Prefect Secret block holding the private key text")
    passphrase_secret: Optional[str] = Field(None, description="name of a Prefect Secret block holding the key's passphrase")
    connect_timeout: float = Field(10.0, gt=0, description="seconds to wait for the TCP connect, banner and login")
    wait_s: Optional[float] = Field(None, ge=0, description="seconds a run keeps trying a host that does not answer "
                                    "(with backoff) before it fails; none: 600 for the nightly, 0 (one try) otherwise")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment of every remote command")
    gpus: Optional[int] = Field(None, ge=0, description="GPUs on the host, stated once: capture, data.regenerate and "
                                "eval tensor_parallel_size and train.nproc_per_node left at 0 take it (0: a CPU host, "
                                "1 each); none: not stated, 1 each. The device check on the host refuses a count its "
                                "GPUs cannot hold")

    @property
    def display_name(self) -> str:
        """The host's one name in logs, slots and errors: `name`, else 'local' or the hostname (with a
        port other than 22)."""
        if self.name:
            return self.name
        if self.kind == "local":
            return "local"
        return self.hostname if self.port == 22 else f"{self.hostname}:{self.port}"

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        return check_env_names(env)

    @classmethod
    def from_block(cls, name: str) -> "HostParams":
        """The settings saved in an `eaglet-host` block (see `save_block`)."""
        try:
            return HostBlock.load(name).host
        except ValueError as e:
            raise BadInputError(f"no eaglet-host block named {name!r}: {e}") from e

    def save_block(self, name: str, overwrite: bool = True) -> None:
        HostBlock(host=self).save(name, overwrite=overwrite)


def _block_class():
    from prefect.blocks.core import Block

    class HostBlock(Block):
        """Saved host settings for eaglet. Keys and passphrases stay in Secret blocks named here."""

        _block_type_name = "eaglet host"
        host: HostParams

    return HostBlock


HostBlock = _block_class()
