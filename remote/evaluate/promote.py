"""Promote a draft when it measures better than the current one: an atomic switch of drafts/current.
A draft whose acceptance length is not above no draft's and a random draft's (by floor_margin) is never
promoted, first night or not (`decide`, `floors`).

    python -m remote.evaluate.promote --config c.json
    # {"out_dir": "<run>/promote", "drafts_root": "<root>/drafts", "candidate_dir": "<run>/export",
    #  "name": "<run>", "figures": {"acceptance_length": 2.1, ...}, "metric": "acceptance_length",
    #  "margin": 0.05, "floor_margin": 0.1, "max_benchmark_drop": -1}

On the host:

    drafts/<name>/                 a promoted draft (a copy of the run's export, so runs/ may be cleaned)
    drafts/<name>/promotion.json   what was promoted and why (figures, the draft it replaced, margin)
    drafts/current -> <name>       the draft serving should load; swapped by rename, never half-made
    drafts/history.jsonl           every decision, promoted or not, one JSON line each

The decision, the copy and the switch happen under a lock on drafts/, so two runs that finish at
once cannot both promote against the same current draft. The step's own manifest (in out_dir)
holds the decision; a re-run after a crash finds either that manifest or its own draft already
current, and does not decide twice.
"""
from __future__ import annotations

import fcntl
import json
import math
import os
import shutil
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from remote.evaluate.config import CURRENT, HISTORY, RECORD, PromoteConfig
from remote.step import BadInput, begin_step, log, step_main, write_json_atomic

STEP = "promote"


@dataclass(frozen=True)
class Decision:
    promote: bool
    reason: str
    value: float  # the candidate's metric
    current_value: float | None  # the current draft's metric (None: no current draft or no record)
    gain: float | None  # value - current_value
    held_back_by: str | None = None  # what kept it: a floor, the current draft, a benchmark set


NO_DRAFT = 1.0  # the mean acceptance length without a draft: each step makes the target's own one token


def random_draft_acceptance(draft_vocab_size: int) -> float:
    """A bound on the mean acceptance length of a draft of this vocabulary that proposes at random: a proposal
    is the target's greedy token with chance 1/d, so it accepts 1 + 1/d + 1/d^2 + ... < 1 + 1/(d - 1)."""
    return NO_DRAFT + 1.0 / max(draft_vocab_size - 1, 1)


def floors(draft_vocab_size: int, floor_margin: float) -> dict[str, tuple[float, str]]:
    """The acceptance lengths a draft must be above to be promoted at all: (floor, what it is), by name."""
    rand = random_draft_acceptance(draft_vocab_size)
    return {"no-draft floor": (NO_DRAFT + floor_margin, f"no draft {NO_DRAFT:g} + floor_margin {floor_margin:g}"),
            "random-draft floor": (rand + floor_margin, f"a random draft of {draft_vocab_size} tokens <= {rand:.6f} "
                                                        f"+ floor_margin {floor_margin:g}")}


def figure(figures: dict, metric: str, where: str) -> float:
    """The metric as a finite float, or BadInput naming what the figures do hold."""
    v = figures.get(metric)
    if not _finite(v):
        raise BadInput(f"{where}: figure {metric!r} is {v!r}, not a finite number; figures: {sorted(figures)}")
    return float(v)


def decide(figures: dict, current: dict | None, metric: str, margin: float, *, floor_margin: float,
           draft_vocab_size: int, max_benchmark_drop: float = -1.0) -> Decision:
    """Promote a draft above both floors (`floors`: its acceptance length beats no draft and a random draft
    of its vocabulary by more than floor_margin) when there is no current draft, or when it beats the
    current one by more than margin. Below a floor it is never promoted, first night or not.

    The current draft's value is, first choice, `previous_<metric>` in the candidate's own figures
    (the evaluation measured the current draft on the same prompts in the same run); else the
    figure recorded when it was promoted, if it was measured the same way (online or offline). With
    max_benchmark_drop >= 0, a draft that would be promoted is held back by a benchmark set it measures worse on
    than the current draft did (its recorded bench_<set>_acceptance_length) by more than that.
    """
    against = _against_current(figures, current, metric, margin)
    acceptance = figure(figures, "acceptance_length", "the candidate's figures")
    for name, (floor, what) in floors(draft_vocab_size, floor_margin).items():
        if acceptance <= floor:
            return Decision(False, f"acceptance_length {acceptance:.4f} is not above the {name} {floor:.4f} ({what}): "
                                   f"never promoted; {against.reason}", against.value, against.current_value,
                            against.gain, held_back_by=name)
    if against.promote and current is not None and max_benchmark_drop >= 0:
        return _against_benchmarks(figures, current.get("figures", {}), max_benchmark_drop, against)
    return against


def _against_benchmarks(figures: dict, recorded: dict, drop: float, against: Decision) -> Decision:
    """The decision against the current draft, held back by the first benchmark set lost by more than `drop`."""
    for key in sorted(k for k in figures if k.startswith("bench_") and k.endswith("_acceptance_length")):
        now, before = figures[key], recorded.get(key)
        if _finite(now) and _finite(before) and now < before - drop:
            name = key.removeprefix("bench_").removesuffix("_acceptance_length")
            return Decision(False, f"{against.reason}; but on the benchmark {name} {now:.4f} is below the current "
                                   f"draft's {before:.4f} by {before - now:.4f} (> max_benchmark_drop {drop:g}): "
                                   "kept the current draft", against.value, against.current_value, against.gain,
                            held_back_by=f"benchmark {name}")
    return against


def _against_current(figures: dict, current: dict | None, metric: str, margin: float) -> Decision:
    value = figure(figures, metric, "the candidate's figures")
    if current is None:
        return Decision(True, "no current draft", value, None, None)
    cur, source = figures.get(f"previous_{metric}"), "measured beside it in this run"
    if not _finite(cur):
        recorded = current.get("figures", {})
        cur, source = recorded.get(metric), "recorded when it was promoted"
        how, how_now = recorded.get(f"{metric}_source"), figures.get(f"{metric}_source")
        if _finite(cur) and how != how_now:
            return Decision(False, f"the current draft's {metric} was measured {how}, this one's {how_now}: "
                                   "not comparable, kept the current draft", value, None, None, "current draft")
    if not _finite(cur):
        return Decision(False, f"the current draft {current.get('name')!r} has no {metric} to compare with; "
                               "kept it", value, None, None, "current draft")
    gain = value - cur
    verdict = f"beats {cur:.4f} by {gain:+.4f} (> margin {margin})" if gain > margin else \
        f"vs current {cur:.4f}: gain {gain:+.4f} is not more than margin {margin}"
    return Decision(gain > margin, f"{metric} {value:.4f} {verdict}; current {source}", value, cur, gain,
                    None if gain > margin else "current draft")


def _draft_vocab_size(candidate: Path) -> int:
    """The draft's vocabulary size, from the exported config.json (vLLM's draft_vocab_size; else vocab_size)."""
    config = json.loads((candidate / "config.json").read_text())
    size = config.get("draft_vocab_size") or config.get("vocab_size")
    if not isinstance(size, int) or size < 1:
        raise BadInput(f"candidate_dir {candidate}/config.json has no draft_vocab_size: not an exported draft")
    return size


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def read_current(drafts_root: str | os.PathLike) -> dict | None:
    """The record of the current draft (None when nothing was promoted yet)."""
    link = Path(drafts_root) / CURRENT
    if not link.exists():
        return None
    p = link / RECORD
    return json.loads(p.read_text()) if p.is_file() else {"name": os.readlink(link) if link.is_symlink() else CURRENT}


def switch_current(drafts_root: Path, name: str) -> None:
    """Point drafts/current at drafts/<name> in one rename: a reader sees the old or the new link."""
    tmp = drafts_root / f".{CURRENT}.tmp-{os.getpid()}"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(name, tmp)  # relative, so the drafts folder can be moved or mounted elsewhere
    os.replace(tmp, drafts_root / CURRENT)
    _fsync_dir(drafts_root)


def publish_draft(candidate: Path, drafts_root: Path, name: str, record: dict) -> Path:
    """Copy the candidate to drafts/<name> (staged, renamed when whole) with its record inside."""
    final = drafts_root / name
    stage = drafts_root / f".{name}.partial-{os.getpid()}"
    shutil.rmtree(stage, ignore_errors=True)
    shutil.copytree(candidate, stage, symlinks=False)
    write_json_atomic(stage / RECORD, record)
    if final.exists():  # a draft of that name left by a run that crashed before switching
        shutil.rmtree(final)
    os.replace(stage, final)
    return final


def run(raw: dict) -> dict:
    cfg, out, done = begin_step(PromoteConfig, raw, STEP, summary=lambda m: f"decided: {m['decision']['reason']}")
    if done is not None:
        return done
    candidate = Path(cfg.candidate_dir)
    if not (candidate / "config.json").is_file():
        raise BadInput(f"candidate_dir {candidate} holds no config.json: not an exported draft")
    value = figure(cfg.figures, cfg.metric, "the candidate's figures")  # bad input before any lock
    figure(cfg.figures, "acceptance_length", "the candidate's figures")  # what the floors are checked on
    vocab_size = _draft_vocab_size(candidate)
    root = Path(cfg.drafts_root)
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root):
        current = read_current(root)
        if current is not None and current.get("name") == cfg.name:  # a re-run after the switch
            decision = Decision(True, "already promoted by an earlier try of this run", value,
                                None, None)
        else:
            decision = decide(cfg.figures, current, cfg.metric, cfg.margin, floor_margin=cfg.floor_margin,
                              draft_vocab_size=vocab_size, max_benchmark_drop=cfg.max_benchmark_drop)
            if decision.promote:
                record = {"name": cfg.name, "promoted_at": _now(), "metric": cfg.metric, "figures": cfg.figures,
                          "source": str(candidate.resolve()), "margin": cfg.margin, "floor_margin": cfg.floor_margin,
                          "reason": decision.reason,
                          "replaced": None if current is None else {k: current.get(k) for k in ("name", "figures")},
                          "context": cfg.context}
                publish_draft(candidate, root, cfg.name, record)
                switch_current(root, cfg.name)
        entry = {"at": _now(), "name": cfg.name, **asdict(decision),
                 "current_before": None if current is None else current.get("name")}
        with open(root / HISTORY, "a") as f:
            f.write(json.dumps(entry) + "\n")
    log(("promoted " if decision.promote else "not promoted ") + f"{cfg.name}: {decision.reason}")
    out.open()
    return out.publish(counts={"promoted": int(decision.promote)}, figures={cfg.metric: value},
                       decision=asdict(decision), current=str(root / CURRENT),
                       current_before=None if current is None else current.get("name"))


@contextmanager
def _locked(folder: Path):
    """An exclusive flock on the folder itself: held until the decision is written."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing drops the lock


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def main(argv: list[str] | None = None) -> int:
    return step_main(STEP, run, argv)


if __name__ == "__main__":
    sys.exit(main())
