"""The training flow's parameters, shown by the Prefect UI as a form.

The groups of step settings are the steps' own Options dataclasses (remote/<stage>/config.py: one
name and one default per setting, from the form to the host; pydantic reads them, with each
field's docstring as its description). Every default runs the embedded demo (the local host,
SmolLM2-135M-Instruct and a ShareGPT sample from PyPI); a preset in deployments/ overrides a few.

The host's GPU count is stated once, `host.gpus`: capture, data.regenerate and eval tensor_parallel_size and
train.nproc_per_node left at 0 take it when the parameters are read (`TrainDraftParams`), each still set
on its own where it should differ; a count above host.gpus is refused, naming the parameter.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from remote.capture.config import CaptureOptions as CaptureParams
from remote.config import TargetOptions as TargetParams
from remote.config import bounded
from remote.data.config import DataOptions as DataParams
from remote.engine.config import HOST_GPUS, gpu_count
from remote.evaluate.config import EvaluateOptions as EvalParams
from remote.train.config import BLOCK_FIRST_SLOT, TrainOptions, VocabOptions
from tasks.host import HostParams
from tasks.multihost import DEFAULT_RDZV_PORT

__all__ = ["CaptureParams", "DataParams", "EvalParams", "RendezvousParams", "TargetParams", "TrainDraftParams",
           "TrainParams"]


class _Params(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt key is an error, not a silent default


@dataclass(frozen=True, kw_only=True)
class TrainParams(TrainOptions, VocabOptions):
    """The train group: the draft vocabulary's size (the vocab step) and the trainer's settings."""

    nproc_per_node: int = bounded(HOST_GPUS, ge=0)
    """training processes on each host (one a GPU, or gloo processes on a CPU); 0: the host's, host.gpus (1 when
    it is not stated or 0)"""


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

    @model_validator(mode="after")
    def _counts_from_host_gpus(self) -> "TrainDraftParams":
        """Every GPU count left at 0 takes host.gpus (1 on a one-device backend); one above it is refused."""
        gpus = self.host.gpus
        for i, h in enumerate(self.extra_hosts):
            if h.gpus is not None and h.gpus != gpus:
                raise ValueError(f"extra_hosts[{i}].gpus={h.gpus} differs from host.gpus={gpus}: the hosts of a run "
                                 "capture and train alike; state the same count on each")
        regen = self.data.regenerate
        counted = {"capture": replace(self.capture, tensor_parallel_size=_tp("capture", self.capture, gpus)),
                   "data": replace(self.data, regenerate=replace(regen, tensor_parallel_size=_tp(
                       "data.regenerate", regen, gpus))),
                   "eval": replace(self.eval, tensor_parallel_size=_tp("eval", self.eval, gpus)),
                   "train": replace(self.train, nproc_per_node=gpu_count("train.nproc_per_node",
                                                                         self.train.nproc_per_node, gpus))}
        for name, value in counted.items():
            if value != getattr(self, name):
                given = name in self.model_fields_set
                setattr(self, name, value)
                if not given:  # derived, not given: a preset's dump (flows.presets) keeps only its own sections
                    self.model_fields_set.discard(name)
        return self

    @model_validator(mode="after")
    def _block_from_eval_k(self) -> "TrainDraftParams":
        """A block drafter (train.draft "dflash" or "dspark") is served with the tokens its block drafts (its block is
        part of the model: num_speculative_tokens = block_size - first slot, DFlash's 1, DSpark's 0):
        train.draft_overrides.block_size, when not stated, is eval.num_speculative_tokens + that slot; a stated one
        that differs, or ttt_steps past the block's drafted slots, is refused by name."""
        t, k = self.train, self.eval.num_speculative_tokens
        if t.draft not in BLOCK_FIRST_SLOT:
            return self
        first = BLOCK_FIRST_SLOT[t.draft]
        block = t.draft_overrides.get("block_size")
        rule = f"block_size - {first}" if first else "block_size"
        if block is None:
            given, block = "train" in self.model_fields_set, k + first
            self.train = replace(t, draft_overrides={**t.draft_overrides, "block_size": block})
            if not given:  # derived, not given: a preset's dump (flows.presets) keeps only its own sections
                self.model_fields_set.discard("train")
        elif block != k + first:
            raise ValueError(f"train.draft_overrides.block_size={block} with eval.num_speculative_tokens={k}: a "
                             f"{t.draft} draft is served with num_speculative_tokens = {rule}; set "
                             f"eval.num_speculative_tokens={block - first}, or leave block_size out (then it is "
                             f"k{f' + {first}' if first else ''})")
        if t.ttt_steps > block - first:
            raise ValueError(f"train.ttt_steps={t.ttt_steps}: a {t.draft} draft of block_size {block} drafts "
                             f"{block - first} tokens a block (eval.num_speculative_tokens {k}); set train.ttt_steps "
                             f"<= {block - first}, or eval.num_speculative_tokens={t.ttt_steps}")
        return self

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


def _tp(group: str, opts, gpus: int | None) -> int:
    """`group`.tensor_parallel_size with 0 resolved: the transformers backend runs on one device."""
    if getattr(opts, "backend", "vllm") == "transformers":
        return opts.tensor_parallel_size or 1  # another count is refused by the step's own config, by name
    return gpu_count(f"{group}.tensor_parallel_size", opts.tensor_parallel_size, gpus)
