"""Prefect tasks of the capture: make the host's vLLM ready, then capture the target's hidden states.

    ready = patch_worker(ctx, target, capture)                        # -> WorkerReady (None: transformers)
    captured = capture_hidden_states(ctx, target, dataset, capture)   # -> CapturedStates(path, shards, ...)
    free_capture(ctx, captured)                                       # a trained window's shards (tasks/windows.py)

Both are thin: build the step's config from the flow's parameters, run `remote.capture.patch_worker` /
`remote.capture.capture` through the host (tasks.remote_step: the log streams into the run log, progress
events into a progress artifact), and return paths and figures, never tensors. The capture's
figures (tokens, bytes, bytes per token, tokens/s, wall time) become a table artifact of the run.
The shards live in the host's cache (<root>/cache/captures/<key>/): a retry or the next night's run
captures only what the cache lacks. In a run over several hosts each host captures its part of the
samples (ctx.part of ctx.parts, tasks/multihost.py), mapped over the hosts by the flow.
"""
from __future__ import annotations

import posixpath
from dataclasses import asdict
from typing import Optional

from prefect import get_run_logger
from prefect.artifacts import create_table_artifact
from pydantic import BaseModel

from remote.capture.config import (CaptureConfig, CaptureOptions, FreeCaptureConfig, PatchWorkerConfig,
                                   PatchWorkerOptions)
from remote.config import TargetOptions, pick
from tasks.context import RunContext, step_task
from tasks.prepare import PreparedData

PATCH_TIMEOUT_S = 1800  # a 1T-parameter model built on the meta device takes minutes, not hours
CAPTURE_TIMEOUT_S = 24 * 3600  # the long step: ~10k conversations take minutes; millions take many hours
FREE_TIMEOUT_S = 600


class WorkerReady(BaseModel):
    """What patch_worker verified on the host."""

    vllm: str
    model_class: str
    layers_path: str  # where the capture hooks the decoder layers, e.g. "language_model.model.layers"
    num_layers: int
    layer_ids: list[int]
    devices: str


class CapturedStates(BaseModel):
    """A finished capture on the host: `CaptureSet.from_manifest(path)` reads it there."""

    path: str  # the capture step's folder (its manifest lists the shards)
    cache_dir: str  # where the shards are
    shards: list[str]
    layer_ids: list[int]
    hidden_size: int
    dtype: str
    samples: int
    captured: int  # samples captured by this run (the others came from the cache)
    reused: int
    tokens: int  # tokens of all the samples
    figures: dict


def patch_config(out_dir: str, target: TargetOptions, capture: PatchWorkerOptions) -> dict:
    """The remote config of remote.capture.patch_worker (checked here): the worker's part of the capture options."""
    return asdict(PatchWorkerConfig(**pick(PatchWorkerOptions, capture), target=target.model, out_dir=out_dir,
                                    trust_remote_code=target.trust_remote_code))


def capture_config(ctx: RunContext, dataset: PreparedData, target: TargetOptions, capture: CaptureOptions,
                   folder: str = "capture", sample_ids: str = "") -> dict:
    """The remote config of remote.capture.capture (checked here) from the flow's options and the prepared dataset;
    a window of a run in windows has its own folder and its list of sample ids."""
    return asdict(CaptureConfig(**pick(CaptureOptions, capture), dataset=dataset.path, target=target.model,
                                out_dir=ctx.step_dir(folder), cache_root=ctx.cache_root,
                                target_revision=target.revision, trust_remote_code=target.trust_remote_code,
                                host_part=ctx.part, host_parts=ctx.parts, sample_ids=sample_ids))


def figures_table(manifest: dict) -> list[dict]:
    """The capture's counts and figures as rows of a table artifact."""
    c, f = manifest["counts"], manifest["figures"]
    rows = [("samples", c["samples"]), ("captured now", c["captured"]), ("reused from the cache", c["reused"]),
            ("shards", c["shards"]), ("shards written now", c["shards_written"]),
            ("tokens captured", f["tokens"]), ("bytes written", f["bytes"]), ("bytes per token", f["bytes_per_token"]),
            ("bytes per token, bound", f["bytes_per_token_bound"]), ("tokens per second", f["tokens_per_s"]),
            ("capture seconds", f["capture_seconds"]), ("engine start seconds", f["engine_start_seconds"]),
            ("wall seconds", f["seconds"])]
    if plan := manifest.get("disk_plan"):  # the plan made before the engine started
        rows += [("disk plan: storage dtype", plan["storage_dtype"]), ("disk plan: bytes to write", plan["need_bytes"]),
                 ("disk plan: bytes the cache held", plan["held_bytes"]), ("disk plan: bytes free", plan["free_bytes"]),
                 ("disk plan: budget bytes (0: none)", plan["budget_bytes"])]
    return [{"figure": name, "value": value} for name, value in rows]


@step_task(name="patch-worker")
def patch_worker(ctx: RunContext, target: TargetOptions, capture: CaptureOptions) -> Optional[WorkerReady]:
    """Check the host's vLLM, the capture extension and the target's layers, and the free devices."""
    if capture.backend != "vllm":
        get_run_logger().info("capture backend %s: no vLLM worker to patch", capture.backend)
        return None
    m = ctx.run_step("patch_worker", patch_config(ctx.step_dir("patch_worker"), target, capture),
                     timeout=PATCH_TIMEOUT_S, title="Checking the capture worker")
    ready = WorkerReady(vllm=m["vllm"], model_class=m["model_class"], layers_path=m["layers_path"],
                        num_layers=m["num_layers"], layer_ids=m["layer_ids"], devices=m["devices"])
    get_run_logger().info("vLLM %s ready: %s, %d layers at .%s, aux layers %s; %s", ready.vllm, ready.model_class,
                          ready.num_layers, ready.layers_path, ready.layer_ids, ready.devices)
    return ready


@step_task(name="capture-hidden-states")
def capture_hidden_states(ctx: RunContext, target: TargetOptions, dataset: PreparedData, capture: CaptureOptions,
                          folder: str = "capture", sample_ids: str = "") -> CapturedStates:
    """Capture the target's hidden states on the prepared data, or on the samples a file of ids names (a window;
    its own step folder); a retry resumes at the first missing shard."""
    m = ctx.run_step("capture", capture_config(ctx, dataset, target, capture, folder, sample_ids),
                     timeout=CAPTURE_TIMEOUT_S, title="Capturing hidden states")
    c, f, cap = m["counts"], m["figures"], m["capture"]
    create_table_artifact(key="capture-figures", table=figures_table(m),
                          description=f"capture: {c['captured']} samples captured, {c['reused']} reused, "
                                      f"{_rate(f)}")
    get_run_logger().info("captured %d samples (%d reused) into %d shards in %s; %s", c["captured"], c["reused"],
                          c["shards"], cap["cache_dir"], _rate(f))
    return CapturedStates(path=ctx.step_dir(folder), cache_dir=cap["cache_dir"], shards=cap["shards"],
                          layer_ids=cap["layer_ids"], hidden_size=cap["hidden_size"], dtype=cap["dtype"],
                          samples=c["samples"], captured=c["captured"], reused=c["reused"], tokens=c["tokens"],
                          figures=f)


@step_task(name="free-capture")
def free_capture(ctx: RunContext, captured: CapturedStates) -> int:
    """Remove a trained window's shards from the host's cache (remote.capture.free); the bytes freed."""
    folder = posixpath.basename(captured.path).replace("capture", "free", 1)
    config = asdict(FreeCaptureConfig(capture_dir=captured.path, out_dir=ctx.step_dir(folder)))
    m = ctx.run_step("free_capture", config, timeout=FREE_TIMEOUT_S, title="Freeing the window's states")
    get_run_logger().info("freed %d shard(s), %d bytes, of %s", m["counts"]["shards"], m["figures"]["bytes"],
                          captured.path)
    return m["figures"]["bytes"]


def _rate(f: dict) -> str:
    """The capture's speed and size, or that nothing was captured (all of it came from the cache)."""
    if not f["tokens_per_s"]:
        return "nothing captured now"
    return f"{f['tokens_per_s']} tokens/s, {f['bytes_per_token']} bytes/token"
