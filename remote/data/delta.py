"""What is new in a data source since the last successful nightly run, by sample hash.

    python -m remote.data.delta --config c.json
    # {"inputs": ["/data/chats/"], "state_dir": "<root>/nightly/default",
    #  "out_dir": "<root>/nightly/default/nights/<run>"}

The nightly flow keeps its memory on the host, in `state_dir`:

    state.json            the commit point, written (atomically) by the controller after a good night:
                          {"nights": [{"run", "data", "new"}...], "seen": ".../seen.txt", ...}
    nights/<run>/         one night's output (this step): new.jsonl, seen.txt, manifest.json

This step reads the source with remote.data.chat_data (so a sample's hash is the one `prepare` gives it),
drops every conversation whose hash is in the committed `seen` list and writes the rest to
`new.jsonl` (OpenAI `messages` records, which read back to the same hash). The held-out set is
fixed by the first night: later nights drop the new conversations that `prepare` would put in the
held-out split (marked seen, never trained on), so every night is evaluated on the same prompts and
its figures compare with the current draft's recorded ones. Its manifest names the
files the night trains on: every committed night's `new.jsonl` plus this one. A night that fails is
never committed, so the next one finds the same new data again.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from remote.data.config import EMPTY_STATE, STATE, DataDeltaConfig
from remote.data.chat_data import ReadReport, read_conversations
from remote.split import split_of
from remote.step import BadInput, begin_step, log, step_main

STEP = "data_delta"
NEW = "new.jsonl"
SEEN = "seen.txt"


def read_state(state_dir: str | os.PathLike) -> dict:
    """The committed state of a nightly (empty lists before its first good night)."""
    p = Path(state_dir) / STATE
    if not p.is_file():
        return dict(EMPTY_STATE)
    try:
        state = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise BadInput(f"{p} is not valid JSON ({e}); restore it or remove it to start the nightly afresh") from e
    if not isinstance(state.get("nights"), list):
        raise BadInput(f"{p} has no 'nights' list; it was not written by eaglet")
    return state


def read_seen(state: dict) -> set[str]:
    path = state.get("seen")
    if not path:
        return set()
    if not Path(path).is_file():
        raise BadInput(f"the committed seen list {path} is missing; the nightly state is damaged")
    return set(Path(path).read_text().split())


def run(raw: dict) -> dict:
    cfg, out, done = begin_step(DataDeltaConfig, raw, STEP, summary=lambda m: f"{m['counts']['new']} new")
    if done is not None:
        return done
    state = read_state(cfg.state_dir)
    seen = read_seen(state)
    report = ReadReport()
    freeze_heldout = bool(state["nights"])  # the first night makes the held-out set; later ones keep it
    new: dict[str, tuple] = {}  # sample id -> turns, first occurrence kept, in source order
    source_ids: set[str] = set()
    frozen_out = 0
    for conv in read_conversations(cfg.inputs, report):
        sid = conv.sample_id
        is_new = sid not in seen and sid not in source_ids
        source_ids.add(sid)
        if not is_new:
            continue
        if freeze_heldout and split_of(sid, cfg.heldout_permille) == "heldout":
            frozen_out += 1
        else:
            new[sid] = conv.turns
    if not source_ids:
        raise BadInput(f"no usable conversation in {cfg.inputs} ({report.rows} rows; bad: {dict(report.bad)})")

    staging = out.open()
    with open(staging / NEW, "w") as f:
        for turns in new.values():
            f.write(json.dumps({"messages": [{"role": r, "content": c} for r, c in turns]}, ensure_ascii=False) + "\n")
    (staging / SEEN).write_text("".join(f"{sid}\n" for sid in sorted(seen | source_ids)))
    final = Path(cfg.out_dir).resolve()
    earlier = [n["data"] for n in state["nights"] if n.get("new")]
    counts = {"source": len(source_ids), "already_seen": len(source_ids & seen), "new": len(new),
              "new_heldout_left_out": frozen_out,
              "bad_rows": sum(report.bad.values()), "earlier_nights": len(earlier)}
    log(f"{len(new)} new of {len(source_ids)} conversations in the source ({counts['already_seen']} seen before, "
        f"{frozen_out} new held-out ones left out to keep the held-out set fixed)")
    return out.publish(counts=counts, train_inputs=earlier + ([str(final / NEW)] if new else []),
                       new_data=str(final / NEW), seen=str(final / SEEN))


def main(argv: list[str] | None = None) -> int:
    return step_main(STEP, run, argv)


if __name__ == "__main__":
    sys.exit(main())
