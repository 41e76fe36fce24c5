"""The training flow's parameters, shown by the Prefect UI as a form.

The groups of step settings are the steps' own Options dataclasses (remote/<stage>/config.py: one
name and one default per setting, from the form to the host; pydantic reads them, with each
field's docstring as its description). Every default runs the embedded demo (the local host,
SmolLM2-135M-Instruct and a ShareGPT sample from PyPI); a preset in deployments/ overrides a few.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from remote.capture.config import CaptureOptions as CaptureParams
from remote.config import TargetOptions as TargetParams
from remote.data.config import DataOptions as DataParams
from remote.evaluate.config import EvaluateOptions as EvalParams
from remote.train.config import TrainOptions, VocabOptions
from tasks.host import HostParams
from tasks.multihost import DEFAULT_RDZV_PORT

__all__ = ["CaptureParams", "DataParams", "EvalParams", "RendezvousParams", "TargetParams", "TrainDraftParams",
           "TrainParams"]


class _Params(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt key is an error, not a silent default


@dataclass(frozen=True, kw_only=True)
class TrainParams(TrainOptions, VocabOptions):
    """The train group: the draft vocabulary's size (the vocab step) and the trainer's settings."""


class RendezvousParams(_Params):
    """torchrun's rendezvous of a run over several hosts, held by the first host (docs/HOSTS.md)."""

    address: str = Field("", description="the first host as the other hosts reach it; empty: its hostname")
    port: int = Field(DEFAULT_RDZV_PORT, ge=1, le=65535, description="TCP port of the rendezvous on the first host")


class TrainDraftParams(_Params):
    """Everything one run of the training flow takes."""

    host: HostParams = Field(default_factory=HostParams, description="where the steps run (node 0 of several hosts: export and evaluation run here)")
    extra_hosts: list[HostParams] = Field(default_factory=list, description="more GPU hosts: each captures its share of the samples, training spans them all")
    rendezvous: RendezvousParams = Field(default_factory=RendezvousParams, description="where the hosts meet for training (with extra_hosts)")
    run_name: str = Field("", description="folder name under <root>/runs; empty: made from the date")
    target: TargetParams = Field(default_factory=TargetParams)
    data: DataParams = Field(default_factory=DataParams)
    capture: CaptureParams = Field(default_factory=CaptureParams)
    train: TrainParams = Field(default_factory=TrainParams)
    eval: EvalParams = Field(default_factory=EvalParams)

    @classmethod
    def from_preset(cls, path: str | Path | None, overrides: dict | None = None) -> "TrainDraftParams":
        """A preset file (JSON; none: the defaults) with dotted-key overrides, e.g. {"train.epochs": 1}."""
        data = json.loads(Path(path).read_text()) if path else {}
        for key, value in (overrides or {}).items():
            node = data
            *parents, leaf = key.split(".")
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = value
        return cls.model_validate(data)
