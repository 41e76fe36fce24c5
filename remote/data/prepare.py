"""The prepare step: chat conversations -> the tokenized dataset that capture and training read.

    python -m remote.data.prepare --config c.json
    # {"inputs": ["chats/", "more.jsonl"], "tokenizer": "/models/target", "out_dir": "/runs/r1/prepare"}

writes out_dir/data.parquet, one row a sample, in input order (first occurrence of each conversation):

    sample_id  str            hex sha256 of the normalized conversation (remote.data.chat_data.conversation_hash)
    input_ids  list<int32>    the conversation rendered with the target's own chat template
    loss_mask  list<int8>     1 on what the assistant wrote: its text and its end-of-turn marker
    length     int32          len(input_ids)
    split      str            "train" or "heldout", decided by sample_id alone (or named by the record:
                              regenerated answers keep their prompt's split, remote.data.regenerate)

and manifest.json with the counts (samples, dropped_by_reason, tokens, loss_tokens, truncated,
length_histogram) and `fingerprint`: sha256 over the sorted sample ids, the tokenizer and template,
and the length policy, so the same data prepared the same way has the same fingerprint.

The loss mask comes from rendering, never from token ids: for each assistant turn j the text of
render(turns[:j], add_generation_prompt=True) is what the model is prompted with and the text that
render(turns[:j+1]) adds to it is the reply. Each piece is tokenized on its own (as in serving: the
prompt is tokenized, the reply is generated) and the reply's tokens are 1 through the last special
token the template puts after the text (`<|im_end|>`, `<|eot_id|>`, `</s>`); what follows that
marker (ChatML's newline) is template scaffolding the model never writes, so it is 0. A template
that does not render a conversation as a growing prefix (e.g. one that rewrites earlier turns) keeps
the turns up to the first place where it stops doing so.

A conversation's work and memory are bounded by what max_length can keep, whatever its size: its text
is cut before it is rendered (remote.data.chat_template's `within`: past max_length plus a margin of
tokens, counted with the most characters a token spells), then its tokens are cut to max_length, to the
same first max_length tokens as tokenizing it whole (counted in notes.text_cut_before_tokenizing).
A crash of the tokenizer fails the step naming the records (file:line) it was given; the log names each
input file as its reading starts, so one that ends the process at once (an abort) is named there too.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Iterable, Iterator

from remote.data.chat_data import BadRecord, Conversation, ReadReport, input_files, read_conversations
from remote.data.chat_template import CUT_MARGIN_TOKENS, ChatTokenizer
from remote.data.config import PrepareConfig
from remote.data.dataset import DATA_FILE, DatasetWriter
from remote.split import split_of
from remote.step import BadInput, begin_step, log, progress, step_main

STEP = "prepare"
# Drops by policy, not by bad data: they do not count against max_bad_fraction.
DUPLICATE, TOO_LONG, NO_LOSS_LEFT = "duplicate", "too_long", "no_loss_tokens_after_truncation"
POLICY_DROPS = (DUPLICATE, TOO_LONG, NO_LOSS_LEFT)


# ----------------------------------------------------------------------------- the dataset file
@dataclass
class Tally:
    """Counts of what was kept and dropped, for the manifest."""

    samples: int = 0
    heldout: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    truncated: int = 0
    turns_cut_by_template: int = 0
    cut_before_tokenizing: int = 0  # conversations whose text passed what max_length can keep (chat_template.within)
    dropped: Counter = field(default_factory=Counter)  # policy drops (POLICY_DROPS) -> samples
    lengths: Counter = field(default_factory=Counter)  # histogram bucket -> samples

    def keep(self, ids: list[int], mask: list[int], split: str) -> None:
        self.samples += 1
        self.heldout += split == "heldout"
        self.tokens += len(ids)
        self.loss_tokens += sum(mask)
        self.lengths[_bucket(len(ids))] += 1


def _bucket(n: int) -> int:
    """The upper end of n's histogram bucket: powers of two from 64 (1-64, 65-128, 129-256, ...)."""
    top = 64
    while top < n:
        top *= 2
    return top


def length_histogram(lengths: Counter) -> dict[str, int]:
    return {f"{top // 2 + 1 if top > 64 else 1}-{top}": lengths[top] for top in sorted(lengths)}


# ----------------------------------------------------------------------------- the step
def run(raw: dict) -> dict:
    cfg, out, done = begin_step(PrepareConfig, raw, STEP, summary=lambda m: f"{m['counts']['samples']} samples")
    if done is not None:
        return done
    input_files(cfg.inputs, ReadReport())  # a missing input fails now, before the tokenizer loads
    chat = ChatTokenizer(cfg.tokenizer, cfg.trust_remote_code)
    staging = out.open()
    try:
        report, tally, ids, seconds = prepare(cfg, chat, staging / DATA_FILE)
        _check_enough(cfg, report, tally)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)  # nothing half-written stays behind
        raise
    counts = {
        "samples": tally.samples, "train": tally.samples - tally.heldout, "heldout": tally.heldout,
        "rows_read": report.rows, "bad_rows": sum(report.bad.values()),
        "dropped_by_reason": dict(sorted((report.bad + tally.dropped).items())),
        "tokens": tally.tokens, "loss_tokens": tally.loss_tokens, "truncated": tally.truncated,
        "length_histogram": length_histogram(tally.lengths),
        "notes": dict(report.notes, turns_cut_by_template=tally.turns_cut_by_template,
                      text_cut_before_tokenizing=tally.cut_before_tokenizing),
    }
    figures = {"seconds": round(seconds, 3), "samples_per_s": round(tally.samples / seconds, 1),
               "tokens_per_s": round(tally.tokens / seconds, 1)}
    tokenizer_id = chat.identity()
    manifest = out.publish(
        counts=counts, figures=figures, dataset=DATA_FILE, bad_examples=report.examples,
        tokenizer={"path": cfg.tokenizer, "sha256": tokenizer_id},
        fingerprint=fingerprint(sorted(ids), tokenizer_id, cfg),
    )
    log(f"prepare: {tally.samples} samples, {tally.tokens} tokens ({tally.loss_tokens} by the assistant), "
        f"dropped {counts['dropped_by_reason'] or 'none'}, {figures['tokens_per_s']:.0f} tokens/s")
    return manifest


def prepare(cfg: PrepareConfig, chat: ChatTokenizer, path: Path) -> tuple[ReadReport, Tally, list[str], float]:
    """Read, render, tokenize and write every batch; returns what happened and the kept sample ids."""
    report, tally, kept = ReadReport(), Tally(), []
    start = time.perf_counter()
    writer = DatasetWriter(path)
    try:
        seen: set[str] = set()
        convs = _unique(_announced(read_conversations(cfg.inputs, report)), seen, tally)
        for batch in _batches(convs, cfg.batch_size):
            rows = _encode_batch(cfg, chat, batch, report, tally)
            if cfg.max_samples is not None:
                rows = rows[: cfg.max_samples - tally.samples]
            for sid, ids, mask, split in rows:
                tally.keep(ids, mask, split)
                kept.append(sid)
            writer.write(rows)
            progress(len(report.rows_by_file), report.files, unit="files", rows=report.rows,
                     samples=tally.samples, tokens=tally.tokens)
            if cfg.max_samples is not None and tally.samples >= cfg.max_samples:
                break
    finally:
        writer.close()
    return report, tally, kept, max(time.perf_counter() - start, 1e-9)


def _announced(convs: Iterable[Conversation]) -> Iterator[Conversation]:
    """The conversations, with a log line as each input file's first one is read: what the step read last
    before a crash that ends it at once (an abort in the tokenizer) is named in the run log."""
    current = None
    for conv in convs:
        if (file := conv.where.rsplit(":", 1)[0]) != current:
            current = file
            log(f"prepare: reading {file}")
        yield conv


def _unique(convs: Iterable[Conversation], seen: set[str], tally: Tally) -> Iterator[tuple[str, Conversation]]:
    for conv in convs:
        sid = conv.sample_id
        if sid in seen:
            tally.dropped[DUPLICATE] += 1
            continue
        seen.add(sid)
        yield sid, conv


def _batches(items: Iterable, n: int) -> Iterator[list]:
    it = iter(items)
    while batch := list(islice(it, n)):
        yield batch


def _encode_batch(cfg, chat, batch, report, tally) -> list[tuple[str, list[int], list[int], str]]:
    """The rows of a batch of conversations; a crash in the tokenizer names the records it was given."""
    try:
        return _rows(cfg, chat, batch, report, tally)
    except (BadInput, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # the tokenizers library's PanicException is a BaseException
        raise RuntimeError(f"prepare failed on the records {batch[0][1].where} to {batch[-1][1].where}: "
                           f"{type(e).__name__}: {e}") from e


def _rows(cfg, chat, batch, report, tally) -> list[tuple[str, list[int], list[int], str]]:
    rendered, owners = [], []
    for sid, conv in batch:
        try:
            chat.check_text(conv.turns)  # the whole text, as before the cut
            turns, shortened = chat.within(conv.turns, cfg.max_length)
            pieces, cut = chat.pieces(turns)
        except BadRecord as e:
            report.skip(e.reason, conv.where, e.detail)
            continue
        tally.turns_cut_by_template += cut
        tally.cut_before_tokenizing += shortened
        rendered.append(pieces)
        owners.append((sid, conv, shortened))
    rows = []
    for (sid, conv, shortened), (ids, mask) in zip(owners, chat.encode(rendered)):
        if shortened and len(ids) < cfg.max_length + CUT_MARGIN_TOKENS:  # the bound failed (a normalizer ate text)
            [(ids, mask)] = chat.encode([chat.pieces(conv.turns)[0]])
        if len(ids) > cfg.max_length:
            if cfg.long_policy == "drop":
                tally.dropped[TOO_LONG] += 1
                continue
            ids, mask = ids[: cfg.max_length], mask[: cfg.max_length]
            if not any(mask):
                tally.dropped[NO_LOSS_LEFT] += 1
                continue
            tally.truncated += 1
        rows.append((sid, ids, mask, conv.split or split_of(sid, cfg.heldout_permille)))
    return rows


def _check_enough(cfg: PrepareConfig, report: ReadReport, tally: Tally) -> None:
    bad = sum(report.bad.values())  # malformed rows; the policy drops (tally.dropped) do not count
    shown = "; ".join(f"{e['where']}: {e['reason']}: {e['detail']}" for e in report.examples[:5])
    if tally.samples == 0:
        empty = [f for f, n in report.rows_by_file.items() if n == 0]
        raise BadInput(f"no usable conversations in {list(cfg.inputs)}: read {report.rows} rows, "
                       f"dropped {dict(report.bad) | dict(tally.dropped)}"
                       + (f"; empty: {empty}" if empty else "") + (f"; first: {shown}" if shown else ""))
    if report.rows and bad / report.rows > cfg.max_bad_fraction:
        raise BadInput(f"{bad} of {report.rows} rows are malformed ({bad / report.rows:.1%}), more than "
                       f"max_bad_fraction={cfg.max_bad_fraction}: {dict(report.bad)}; first: {shown}. "
                       "Fix the data or raise max_bad_fraction.")


def fingerprint(sorted_ids: list[str], tokenizer_id: str, cfg: PrepareConfig) -> str:
    """Names the dataset's content: the samples, the tokenizer and template, the length policy."""
    h = hashlib.sha256()
    h.update(json.dumps({"tokenizer": tokenizer_id, "max_length": cfg.max_length,
                         "long_policy": cfg.long_policy, "heldout_permille": cfg.heldout_permille}).encode())
    for sid in sorted_ids:
        h.update(sid.encode())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    return step_main(STEP, run, argv)


if __name__ == "__main__":
    sys.exit(main())
