"""Prefect tasks of the draft steps: vocabulary, training, export, run on the host.

    vocab = build_vocab(ctx, target, dataset, train_params)          # -> DraftVocabInfo(path, size, coverage)
    trained = train_draft(ctx, target, captured, vocab, train_params) # -> TrainedDraft(path, figures)
    draft = export_draft(ctx, target, captured, vocab, trained, dataset)  # -> ExportedDraft(path, ...)

Thin, like every step task: build the remote step's config (the *_config functions, tested
directly), run it through the host (tasks.context.RunContext.run_step: log lines, progress,
manifest), turn what came back into artifacts. Training runs `remote.train.train`, which itself starts
torchrun when `nproc_per_node` > 1, so the task is the same for one GPU and eight (and, given a `node`,
for each host of a run over several; the flow maps it over them). Its loss curve
(in the train manifest) becomes a markdown artifact with a matplotlib plot (tasks.evaluate.loss_chart).
"""
from __future__ import annotations

from dataclasses import asdict

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact
from pydantic import BaseModel

from remote.config import TargetOptions, pick
from remote.train.config import ExportConfig, TrainConfig, TrainOptions, VocabConfig, VocabOptions
from tasks.capture import CapturedStates
from tasks.context import RunContext, step_task
from tasks.evaluate import HELDOUT_CAPTION, LOSS_CAPTION, heldout_chart, loss_chart
from tasks.multihost import NodeLaunch
from tasks.prepare import PreparedData

VOCAB_TIMEOUT_S = 3600  # a pass over data.parquet: minutes for millions of samples
TRAIN_TIMEOUT_S = 48 * 3600  # a Kimi-K2.5 draft on a large capture trains for many hours
EXPORT_TIMEOUT_S = 1800


class DraftVocabInfo(BaseModel):
    path: str  # the vocab step folder on the host (vocab.safetensors)
    draft_vocab_size: int  # may be below the asked size when the data has fewer distinct tokens
    coverage: float  # share of train loss tokens inside the draft vocabulary


class TrainedDraft(BaseModel):
    path: str  # the train step folder on the host
    steps: int
    figures: dict  # final_loss, final_acc (per TTT step), tokens_per_s, train_seconds
    final: bool = True  # the draft is published here (false: a window before the run's end, a checkpoint only)

    @classmethod
    def from_manifest(cls, out_dir: str, m: dict) -> "TrainedDraft":
        return cls(path=out_dir, steps=m["counts"]["steps"], figures=m["figures"], final=m["train"].get("final", True))


class ExportedDraft(BaseModel):
    path: str  # the exported folder on the host (vLLM loads it with its kind's method)
    figures: dict
    kind: str = "eagle3"  # the draft's kind (train.draft; remote.draft.registry)


def vocab_config(out_dir: str, target: TargetOptions, dataset: PreparedData, params: VocabOptions) -> dict:
    return asdict(VocabConfig(**pick(VocabOptions, params), data=dataset.out_dir, target=target.model, out_dir=out_dir))


def train_config(out_dir: str, target: TargetOptions, capture_dir: str, vocab: DraftVocabInfo,
                 params: TrainOptions, node: NodeLaunch | None = None, **window) -> dict:
    """remote.train.train's config (checked here) from the flow's train options; `node` (of a run over
    several hosts) adds where this host joins torchrun's rendezvous; `window` (windows, window,
    checkpoint_dir) the window of a run in windows."""
    wiring = dict(window)
    if node is not None and node.nnodes > 1:
        wiring.update(nnodes=node.nnodes, node_rank=node.node_rank, rdzv_endpoint=node.rdzv_endpoint,
                      local_addr=node.local_addr)
    return asdict(TrainConfig(**pick(TrainOptions, params), capture_dir=capture_dir, vocab_dir=vocab.path,
                              target=target.model, out_dir=out_dir, **wiring))


def export_config(out_dir: str, trained: TrainedDraft, vocab: DraftVocabInfo) -> dict:
    return asdict(ExportConfig(train_dir=trained.path, vocab_dir=vocab.path, out_dir=out_dir))


def final_loss_text(figures: dict) -> str:
    """The last scored step's loss, or that no step had loss tokens (the train step then records none)."""
    loss = figures.get("final_loss")
    return "no step had loss tokens" if loss is None else f"final loss {loss:.4f}"


def loss_curve_markdown(points: list[list[float]], figures: dict, heldout: list[list[float]] | None = None,
                        kind: str = "eagle3") -> str:
    """The training run as markdown: the draft's kind, the loss curve, the held-out acceptance curve (PNG images:
    the UI strips inline SVG) and the final per-step accuracy."""
    acc = figures.get("final_acc") or []
    lines = [f"# Draft training ({kind} draft)", "",
             f"{figures.get('steps', len(points))} steps, {final_loss_text(figures)}, "
             f"{figures.get('tokens_per_s', 0):.0f} tokens/s", ""]
    if len(points) >= 2:
        lines += [loss_chart(points, LOSS_CAPTION), ""]
    if heldout:
        lines += [heldout_chart(heldout, figures.get("best_step"), HELDOUT_CAPTION), ""]
    if acc:
        lines += ["| TTT step | " + " | ".join(str(i + 1) for i in range(len(acc))) + " |",
                  "|---|" + "---|" * len(acc),
                  "| top-1 agreement | " + " | ".join(f"{a:.3f}" for a in acc) + " |", ""]
    return "\n".join(lines)


@step_task(name="build-vocab")
def build_vocab(ctx: RunContext, target: TargetOptions, dataset: PreparedData, params: VocabOptions) -> DraftVocabInfo:
    out_dir = ctx.step_dir("vocab")
    m = ctx.run_step("vocab", vocab_config(out_dir, target, dataset, params), timeout=VOCAB_TIMEOUT_S,
                     title="Draft vocabulary")
    n, cov = m["vocab"]["draft_vocab_size"], m["figures"]["coverage"]
    markdown = (f"# Draft vocabulary\n\n{n} of {m['vocab']['target_vocab_size']} target tokens (asked for "
                f"{m['counts']['requested_draft_vocab_size']}); they cover {cov:.1%} of the "
                f"{m['counts']['train_loss_tokens']} train loss tokens.\n")
    create_markdown_artifact(key="draft-vocab", markdown=markdown,
                             description=f"draft vocabulary: {n} tokens, coverage {cov:.1%}")
    get_run_logger().info("draft vocabulary: %d tokens, coverage %.3f", n, cov)
    return DraftVocabInfo(path=out_dir, draft_vocab_size=n, coverage=cov)


@step_task(name="train-draft")
def train_draft(ctx: RunContext, target: TargetOptions, captured: CapturedStates, vocab: DraftVocabInfo,
                params: TrainOptions, node: NodeLaunch | None = None, folder: str = "train", **window) -> TrainedDraft:
    """Train on this host; in a run over several hosts, this host's node of the torchrun job (the
    flow starts every node at once; the draft is written on node 0); in a run in windows, one
    window's steps (its folder, and `window`: tasks.windows.window_wiring)."""
    out_dir = ctx.step_dir(folder)
    m = ctx.run_step("train", train_config(out_dir, target, captured.path, vocab, params, node, **window),
                     timeout=TRAIN_TIMEOUT_S, title="Draft training")
    c = m["counts"]
    get_run_logger().info("trained %d steps, world size %d over %d host(s); tokens by host %s",
                          c["steps"], c["world_size"], c.get("nnodes", 1), m["figures"].get("tokens_by_node"))
    if ctx.part == 0 and m["train"].get("final", True):  # the manifest's curve: streamed events of a resumed run are partial
        kind = m["train"].get("kind", "eagle3")
        markdown = loss_curve_markdown(m["train"]["loss_points"], m["figures"], m["train"].get("heldout_points"), kind)
        create_markdown_artifact(key="draft-training", markdown=markdown, description=(
            f"draft training ({kind}): {c['steps']} steps, {final_loss_text(m['figures'])}"))
    return TrainedDraft.from_manifest(out_dir, m)


@step_task(name="export-draft")
def export_draft(ctx: RunContext, target: TargetOptions, captured: CapturedStates, vocab: DraftVocabInfo,
                 trained: TrainedDraft, dataset: PreparedData) -> ExportedDraft:
    out_dir = ctx.step_dir("export")
    m = ctx.run_step("export", export_config(out_dir, trained, vocab), timeout=EXPORT_TIMEOUT_S, title="Export")
    kind = m["export"].get("kind", "eagle3")
    get_run_logger().info("exported the %s draft for vLLM to %s (target %s, data %s)", kind, out_dir, target.model,
                          getattr(dataset, "fingerprint", ""))
    return ExportedDraft(path=out_dir, figures=m["figures"], kind=kind)
