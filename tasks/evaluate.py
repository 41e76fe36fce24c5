"""The Prefect task of the evaluate step: measure the draft on the host, show it in the Prefect UI.

    report = evaluate_draft(ctx, target, draft, dataset, captured, eval_params)
    report.figures["acceptance_length"]     # online, greedy, k = eval_params.num_speculative_tokens

The step (remote/evaluate/evaluate.py) does the measuring; this side builds its config, reads what it wrote
and makes three things of it: a markdown artifact `draft-evaluation` (target, data fingerprint,
vocabulary coverage, training loss, offline and online acceptance, speed-up, the baselines and the
previously published draft, with the loss curve and acceptance per position as SVG images), and a
table artifact `acceptance-per-position`. The previously published draft (drafts/current) is
measured on the same prompts in the same run when it fits the target.
"""
from __future__ import annotations

import base64
import json
import posixpath
from typing import Any

from dataclasses import asdict

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from pydantic import BaseModel

from remote.config import TargetOptions, pick
from remote.evaluate.config import EvaluateConfig, EvaluateOptions
from tasks.context import RunContext, step_task
from tasks.host import open_host
from tasks.promote import CurrentDraft, read_current_draft

EVAL_TIMEOUT_S = 3 * 3600  # a TP=8 target starts once per arm (minutes each); generation is bounded by max_seconds
REPORT_KEY, TABLE_KEY = "draft-evaluation", "acceptance-per-position"


class EvalReport(BaseModel):
    """What the flow keeps of an evaluation: where it is on the host and its figures."""

    out_dir: str
    figures: dict
    previous_draft: str | None = None  # the published draft it was compared with


def evaluate_config(ctx: RunContext, target_dir: str, draft_dir: str, data_path: str, capture_dir: str,
                    params: EvaluateOptions, previous_dir: str = "") -> dict:
    """The remote config of remote.evaluate.evaluate (checked here) from the flow's evaluation options."""
    return asdict(EvaluateConfig(**pick(EvaluateOptions, params), target=target_dir, draft_dir=draft_dir,
                                 data=data_path, capture_dir=capture_dir, out_dir=ctx.step_dir("evaluate"),
                                 previous_draft_dir=previous_dir))


@step_task(name="evaluate-draft")
def evaluate_draft(ctx: RunContext, target: TargetOptions, draft: Any, dataset: Any, captured: Any,
                   params: EvaluateOptions, compare_previous: bool = True) -> EvalReport:
    """Offline and online acceptance of the exported draft; a report and a table in the UI."""
    logger = get_run_logger()
    previous = _previous_draft(ctx) if compare_previous else None
    target_dir = target.model
    config = evaluate_config(ctx, target_dir, draft.path, dataset.path, getattr(captured, "path", "") or "",
                             params, previous.path if previous else "")
    m = ctx.run_step("evaluate", config, timeout=EVAL_TIMEOUT_S, title="Evaluating the draft")
    with open_host(ctx.host) as host:
        evaluation = json.loads(host.read_text(posixpath.join(config["out_dir"], m["evaluation"])))
    figures = m["figures"]
    context = {"run": ctx.run_name, "host": ctx.host.name or ctx.host.kind, "target": target_dir,
               "data_fingerprint": getattr(dataset, "fingerprint", None) or figures.get("data_fingerprint")}
    create_markdown_artifact(key=REPORT_KEY, markdown=report_markdown(evaluation, figures, context, previous),
                             description=f"draft evaluation: acceptance length {_num(figures.get('acceptance_length'))}")
    create_table_artifact(key=TABLE_KEY, table=position_rows(evaluation),
                          description="acceptance per speculative position (online: vLLM's counters)")
    logger.info("acceptance length %s (%s), speed-up %s, in %.0f s", _num(figures.get("acceptance_length")),
                figures.get("acceptance_length_source"), _num(figures.get("speedup")), figures["evaluate_seconds"])
    return EvalReport(out_dir=config["out_dir"], figures=figures, previous_draft=previous.path if previous else None)


def _previous_draft(ctx: RunContext) -> CurrentDraft | None:
    with open_host(ctx.host) as host:
        return read_current_draft(host, ctx.root)


# ----------------------------------------------------------------------------- the report
def _num(x, digits: int = 2) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def online_rows(online: dict) -> list[tuple[str, dict]]:
    """(label, greedy or sampled figures) of each online arm, in the order they ran."""
    labels = {"baseline": "target alone", "eagle3": "this draft (eagle3)", "previous": "published draft (eagle3)",
              "ngram": "n-gram lookup"}
    rows = []
    for arm in online.get("order") or list(online["arms"]):  # the order they ran (JSON keys come back sorted)
        res = online["arms"][arm]
        for mode in ("greedy", "sampled"):
            if mode in res:
                rows.append((f"{labels.get(arm, arm)}, {mode}", res[mode]))
    return rows


def report_markdown(evaluation: dict, figures: dict, context: dict, previous: CurrentDraft | None) -> str:
    prov, off, on = evaluation["provenance"], evaluation.get("offline"), evaluation.get("online")
    tf = prov.get("train_figures", {})
    out = [f"# Draft evaluation: {context['run']}", "",
           "| | value |", "|---|---|",
           f"| target | `{context['target']}` on {context['host']} |",
           f"| draft | `{prov['draft_dir']}` |",
           f"| data fingerprint | `{context.get('data_fingerprint') or prov.get('data_fingerprint') or 'n/a'}` |",
           f"| draft vocabulary | {prov.get('draft_vocab_size', 'n/a')} of {prov.get('target_vocab_size', 'n/a')} tokens, "
           f"coverage {_pct(prov.get('coverage'))} (train), {_pct(off.get('heldout_coverage') if off else None)} (held out) |",
           f"| training | {tf.get('steps', 'n/a')} steps, final loss {_num(tf.get('final_loss'), 4)} |",
           f"| acceptance length | **{_num(figures.get('acceptance_length'))}** ({figures.get('acceptance_length_source')}, "
           f"k = {on['num_speculative_tokens'] if on else off['k']}) |",
           f"| speed-up (decode) | **{_num(figures.get('speedup'))}x** |",
           f"| evaluation time | {_num(figures.get('evaluate_seconds'), 0)} s |", ""]
    if off:
        out += ["## Offline (held-out captures)", "",
                f"{off['samples']} samples, {off['tokens']} tokens; expected acceptance length at k = {off['k']}: "
                f"**{_num(off['acceptance_length'])}**. Conditional accuracy per step (step k counts where steps < k "
                f"were right): {', '.join(_pct(a) for a in off['conditional_accuracy'])}.", ""]
    if on:
        out += [f"## Online (vLLM, {len(on['prompt_ids'])} held-out prompts x {on['max_tokens']} tokens)", "",
                "| run | acceptance length | per position | decode tokens/s | speed-up |", "|---|---|---|---|---|"]
        for label, r in online_rows(on):
            per = ", ".join(_pct(a) for a in r["acceptance_per_position"]) or "-"
            out.append(f"| {label} | {_num(r['acceptance_length']) if r['acceptance_length'] else '1.00 (none)'} | {per} "
                       f"| {_num(r['decode_tokens_per_s'], 1)} | {_num(r.get('speedup'))} |")
        out.append("")
    if previous is not None:
        recorded = previous.figures.get("acceptance_length")
        now = on["arms"].get("previous", {}).get("greedy", {}).get("acceptance_length") if on else None
        why_not = (on or {}).get("skipped", {}).get("previous")
        out += ["## Against the published draft", "",
                f"`{previous.name}`: acceptance length {_num(recorded)} when it was promoted, "
                + (f"not measured now ({why_not})" if why_not else f"{_num(now)} on these prompts now")
                + f"; this draft: {_num(figures.get('acceptance_length'))}.", ""]
    curve = prov.get("loss_curve") or []
    if curve:
        out += ["## Training loss", "", markdown_image(svg_line(curve, "step", "loss"), "training loss"), ""]
    series = position_series(evaluation)
    if series:
        out += ["## Acceptance per position", "",
                markdown_image(svg_bars(series, "speculative position", "accepted share"), "acceptance per position"), ""]
    return "\n".join(out)


def position_series(evaluation: dict) -> dict[str, list[float]]:
    """Per position: the share of drafts accepted through it (vLLM's per-position rate; offline: prefix rate)."""
    s: dict[str, list[float]] = {}
    if evaluation.get("offline"):
        s["offline"] = evaluation["offline"]["prefix_rate"]
    for label, r in online_rows(evaluation.get("online") or {"arms": {}}):
        if r["acceptance_per_position"]:
            s[label] = r["acceptance_per_position"]
    return s


def position_rows(evaluation: dict) -> list[dict]:
    series = position_series(evaluation)
    off = evaluation.get("offline") or {}
    n = max((len(v) for v in series.values()), default=0)
    rows = []
    for i in range(n):
        row: dict = {"position": i + 1}
        if off:
            row["offline conditional accuracy"] = _round(off["conditional_accuracy"], i)
        row.update({name: _round(v, i) for name, v in series.items()})
        rows.append(row)
    return rows


def _round(values: list[float], i: int):
    return round(values[i], 4) if i < len(values) else None


# ----------------------------------------------------------------------------- SVG plots
W, H, PAD = 520, 240, 44
COLORS = ("#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2")


def markdown_image(svg: str, alt: str) -> str:
    """An SVG as a markdown image (a data URI): the Prefect UI strips the shapes of inline <svg>
    from a markdown artifact but draws an image (seen in headless Chromium, Prefect 3.9)."""
    return f"![{alt}](data:image/svg+xml;base64,{base64.b64encode(svg.encode()).decode()})"


def _frame(xlabel: str, ylabel: str, ymin: float, ymax: float, body: list[str]) -> str:
    ticks = [f'<text x="{PAD - 6}" y="{H - PAD - (H - 2 * PAD) * f + 4:.1f}" font-size="10" text-anchor="end">'
             f'{ymin + (ymax - ymin) * f:.4g}</text>' for f in (0, 0.5, 1)]
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" '
            f'font-family="sans-serif"><rect width="{W}" height="{H}" fill="white"/>'  # the UI's dark theme
            f'<line x1="{PAD}" y1="{H - PAD}" x2="{W - PAD}" y2="{H - PAD}" stroke="#444"/>'
            f'<line x1="{PAD}" y1="{PAD / 2}" x2="{PAD}" y2="{H - PAD}" stroke="#444"/>' + "".join(ticks) + "".join(body)
            + f'<text x="{W / 2}" y="{H - 8}" font-size="11" text-anchor="middle">{xlabel}</text>'
            f'<text x="12" y="{H / 2}" font-size="11" text-anchor="middle" transform="rotate(-90 12 {H / 2})">{ylabel}</text>'
            "</svg>")


def svg_line(points: list[list[float]], xlabel: str, ylabel: str) -> str:
    """A line plot of (x, y) points, the y axis spanning their range (a soft-CE loss sits far above 0)."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1 = min(xs), max(xs)
    pad = (max(ys) - min(ys)) * 0.05 or abs(max(ys)) * 0.05 or 1.0
    ymin, ymax = min(ys) - pad, max(ys) + pad
    sx = lambda x: PAD + (W - 2 * PAD) * ((x - x0) / (x1 - x0) if x1 > x0 else 0.5)  # noqa: E731
    sy = lambda y: H - PAD - (H - 2 * PAD) * (y - ymin) / (ymax - ymin)  # noqa: E731
    path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in zip(xs, ys))
    body = [f'<polyline fill="none" stroke="{COLORS[0]}" stroke-width="2" points="{path}"/>',
            f'<text x="{PAD}" y="{H - PAD + 14}" font-size="10">{x0:g}</text>',
            f'<text x="{W - PAD}" y="{H - PAD + 14}" font-size="10" text-anchor="end">{x1:g}</text>']
    return _frame(xlabel, ylabel, ymin, ymax, body)


def svg_bars(series: dict[str, list[float]], xlabel: str, ylabel: str) -> str:
    """Grouped bars: one group per position, one bar per series, values in [0, 1]."""
    n = max(len(v) for v in series.values())
    group = (W - 2 * PAD) / n
    bar = group * 0.8 / len(series)
    body = []
    for s, (name, values) in enumerate(series.items()):
        color = COLORS[s % len(COLORS)]
        for i, v in enumerate(values):
            h = (H - 2 * PAD) * max(0.0, min(1.0, v))
            x = PAD + i * group + group * 0.1 + s * bar
            body.append(f'<rect x="{x:.1f}" y="{H - PAD - h:.1f}" width="{bar:.1f}" height="{h:.1f}" fill="{color}">'
                        f'<title>{name}, position {i + 1}: {v:.3f}</title></rect>')
        body.append(f'<rect x="{W - PAD - 150}" y="{PAD / 2 + 14 * s}" width="10" height="10" fill="{color}"/>'
                    f'<text x="{W - PAD - 136}" y="{PAD / 2 + 14 * s + 9}" font-size="10">{name}</text>')
    for i in range(n):
        body.append(f'<text x="{PAD + (i + 0.5) * group:.1f}" y="{H - PAD + 14}" font-size="10" '
                    f'text-anchor="middle">{i + 1}</text>')
    return _frame(xlabel, ylabel, 0.0, 1.0, body)
