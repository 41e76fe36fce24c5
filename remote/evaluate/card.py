"""The draft card's measured part: what the evaluate step measured, written into the exported folder's README.md.

    write_card("/runs/r1/export", measured_markdown(result, figures, "NVIDIA H100", capture_manifest))
    # README.md: the export's card, then "## Measured ..."

The export step writes the card (remote/draft/<kind>.py: target, data fingerprint, training, how to serve it);
the evaluate step appends what it measured below MARK, as published drafts carry it: the kind, the target and its
revision, the data and the training budget, the held-out figures, each benchmark set's acceptance (greedy, at the
temperature, per position) and the advised serving line. A later evaluation of the same folder replaces that part.
The export's manifest lists README.md's size and checksum, so the card is written by a rename and the manifest's
entry follows it (remote.step.replace_published_file): the export still checks out and a resumed run keeps it.

The markdown pieces it shares with the Prefect report (tasks/evaluate.py) are remote/report.py's.
"""
from __future__ import annotations

import time
from pathlib import Path

from remote.report import advice_section, benchmark_tables, num
from remote.step import read_manifest, replace_published_file

MARK = "<!-- eaglet: what the evaluate step measured; each evaluation rewrites what follows -->"
CARD = "README.md"


# ----------------------------------------------------------------------------- the card's measured part
def _revision(capture_m: dict | None) -> str:
    """The target's revision label (capture.target_revision), else the capture cache key that names its weights."""
    label = ((capture_m or {}).get("config") or {}).get("target_revision")
    if label:
        return f"revision `{label}`"
    key = ((capture_m or {}).get("capture") or {}).get("cache_key")
    return (f"no revision label; the capture cache key `{key[:16]}` hashes its config, weights index and tokenizer"
            if key else "no revision label")


def measured_markdown(result: dict, figures: dict, device: str, capture_m: dict | None = None) -> str:
    """The part of the card below MARK: what this evaluation measured, where and on what."""
    prov, off, on = result["provenance"], result.get("offline"), result.get("online")
    tf, tc = prov.get("train_figures") or {}, prov.get("train_counts") or {}
    budget = [f"{tc['tokens']:,} tokens seen" if tc.get("tokens") is not None else None,
              f"{tf['steps']} steps" if tf.get("steps") is not None else None,
              f"{tf['train_seconds']:.0f} s of training ({tf['tokens_per_s']:,.0f} tokens/s)"
              if tf.get("train_seconds") and tf.get("tokens_per_s") else None]
    held = []
    if off:
        held.append(f"offline {num(off['acceptance_length'])} at k = {off['k']} (replayed "
                    f"{num(off['replayed_acceptance_length'])}) over {off['tokens']:,} tokens")
    if on:
        held.append(f"online {num(figures.get('online_acceptance_length'))} at k = {on['num_speculative_tokens']} "
                    f"(vLLM's counters, {len(on['prompt_ids'])} prompts x {on['max_tokens']} tokens)")
    lines = [MARK, "", f"## Measured (eaglet's evaluate step, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
                       f"on {device})", "",
             "| | |", "|---|---|",
             f"| kind | {prov.get('kind', 'eagle3')} (vLLM method `{prov.get('method', 'eagle3')}`) |",
             f"| target | `{prov.get('target', '?')}`: {_revision(capture_m)} |",
             f"| data | fingerprint `{prov.get('data_fingerprint') or 'n/a'}`"
             + (f", {tc['train_samples']:,} train samples" if tc.get("train_samples") is not None else "") + " |",
             f"| budget | {', '.join(b for b in budget if b) or 'n/a'} |",
             f"| held-out acceptance length ({(off or {}).get('part') or 'test'} half) | {'; '.join(held) or 'n/a'} |",
             f"| decode speed-up on this host | {num(figures.get('speedup'))}x |" if figures.get("speedup") else None,
             ""]
    lines = [x for x in lines if x is not None]
    lines += ["#" + x if x.startswith("## ") else x for x in benchmark_tables(result.get("benchmarks"))]
    lines += ["#" + x if x.startswith("## ") else x for x in advice_section(result.get("advice"))]
    return "\n".join(lines).rstrip("\n") + "\n"


def card_text(card: str, measured: str) -> str:
    """The card with its measured part replaced (an earlier evaluation's is dropped)."""
    return card.split(MARK, 1)[0].rstrip("\n") + "\n\n" + measured


def write_card(draft_dir: str, measured: str) -> bool:
    """The measured part into the exported folder's card; False (nothing written) for a folder eaglet's export
    step did not make (a draft from elsewhere has no manifest to keep true, and its card is not ours to edit)."""
    folder = Path(draft_dir)
    if read_manifest(folder) is None or not (folder / CARD).is_file():
        return False
    replace_published_file(folder, CARD, card_text((folder / CARD).read_text(encoding="utf-8"), measured))
    return True
