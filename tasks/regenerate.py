"""Prefect task of the regenerate step: the target answers the prompts itself, on the host, before prepare.

    data = regenerate_answers(ctxs, target, data)   # data.regenerate.enabled: inputs -> [<run>/regenerate/conversations.jsonl]

Thin, like every step task: build remote.data.regenerate's config from the flow's parameters (the
options are the step's own RegenerateOptions, so nothing is renamed on the way), run the step, show
its counts (answers, left out by reason) and a few sample answers as artifacts, and hand prepare
the regenerated conversations in place of the data's own. The nightly run goes through the same
call: the answer cache on the host makes it generate only tonight's new prompts.
"""
from __future__ import annotations

import dataclasses
import posixpath

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from remote.config import TargetOptions, pick
from remote.data.config import DataOptions, RegenerateConfig, RegenerateOptions
from tasks.context import RunContext, step_task
from tasks.errors import BadInputError

REGENERATE_TIMEOUT_S = 24 * 3600  # a million prompts answered at TP=8 take hours


def regenerate_config(ctx: RunContext, target: TargetOptions, data: DataOptions) -> dict:
    """The remote config of remote.data.regenerate (checked here) from the flow's target and data options."""
    return dataclasses.asdict(RegenerateConfig(
        **pick(RegenerateOptions, data.regenerate), inputs=list(data.inputs), target=target.model,
        out_dir=ctx.step_dir("regenerate"), cache_root=ctx.cache_root, target_revision=target.revision,
        heldout_permille=data.heldout_permille, max_samples=data.max_samples, trust_remote_code=target.trust_remote_code))


def regenerate_answers(ctxs: list[RunContext], target: TargetOptions, data: DataOptions) -> DataOptions:
    """`data` itself when regeneration is off; else a copy whose inputs are the target's own answers."""
    if not data.regenerate.enabled:
        return data
    if len(ctxs) > 1:  # each host would answer every prompt: regenerate on one host, then train on several
        raise BadInputError(f"data.regenerate runs on one host; this run has {len(ctxs)}. Regenerate in a run on "
                            "the first host, then give its conversations.jsonl as data.inputs (on every host)")
    return dataclasses.replace(data, inputs=[regenerate(ctxs[0], target, data)])


@step_task(name="regenerate-answers")
def regenerate(ctx: RunContext, target: TargetOptions, data: DataOptions) -> str:
    """Have the target answer the conversations on the host; the path of what it wrote."""
    m = ctx.run_step("regenerate", regenerate_config(ctx, target, data), timeout=REGENERATE_TIMEOUT_S,
                     title="The target answers the prompts")
    c, f = m["counts"], m["figures"]
    rows = [{"count": k, "value": c[k]} for k in ("prompts", "cached", "answered_now", "conversations", "answers",
                                                  "train", "heldout")]
    rows += [{"count": f"left out: {reason}", "value": n} for reason, n in c["unusable"].items()]
    rows.append({"count": "generated tokens/s", "value": f["tokens_per_s"]})
    create_table_artifact(key="regenerated-answers", table=rows,
                          description=f"regenerate: {c['conversations']} conversations in the target's own words")
    create_markdown_artifact(key="regenerated-samples", description="a few answers the target wrote",
                             markdown=_samples_markdown(m["sample_answers"]))
    get_run_logger().info("regenerated %d conversations (%d prompts answered now, %d from the cache), left out %s",
                          c["conversations"], c["answered_now"], c["cached"], c["unusable"] or "none")
    return posixpath.join(ctx.step_dir("regenerate"), m["conversations"])


def _samples_markdown(samples: list[dict]) -> str:
    parts = ["## Answers the target wrote\n"]
    for s in samples:
        parts.append(f"**user** ({s['source_id'][:12]}):\n\n{_quoted(s['user'])}\n\n**target**:\n\n{_quoted(s['answer'])}\n")
    return "\n".join(parts)


def _quoted(text: str) -> str:
    return "\n".join(f"> {line}" for line in text.splitlines()) or "(empty)"
