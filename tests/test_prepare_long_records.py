"""A record of any size prepares in what max_length can keep (issue 37, item 6): its text is cut before it is
rendered and tokenized (remote.data.chat_template's `within`), then its tokens to max_length, to the tokens
and loss mask that tokenizing it whole gives; a 200 MB one-record JSONL prepares in flat memory (the peak
measured: the step's process's ru_maxrss, as a small launcher's wait4 reports it); a crash of the tokenizer names the records it was given.

    .venv/bin/python -m pytest tests/test_prepare_long_records.py -q
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from remote.data import prepare
from remote.data.chat_template import CUT_MARGIN_TOKENS, ChatTokenizer
from tests.fixtures.models import make_tokenizer

REPO = Path(__file__).resolve().parents[1]
PARAGRAPH = 'Lorem ipsum dolor sit amet, consectetur adipiscing elit; 12345 "quoted" text.\n'


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tok")
    make_tokenizer(d)  # the tiny byte-level BPE (512 entries): the most tokens a character
    return d


def long_text(chars: int) -> str:
    return (PARAGRAPH * (chars // len(PARAGRAPH) + 1))[:chars]


def prepared(tmp_path: Path, name: str, records: list[dict], tok: Path, **kw) -> tuple[dict, list[dict]]:
    data = tmp_path / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    m = prepare.run({"inputs": [str(data)], "tokenizer": str(tok), "out_dir": str(tmp_path / name), **kw})
    return m, pq.read_table(tmp_path / name / "data.parquet").to_pylist()


@pytest.mark.slow  # tokenizes the long records whole too: about 10 s
def test_the_cut_keeps_the_tokens_and_mask_of_tokenizing_whole(tok, tmp_path, monkeypatch):
    """Records past the cut where the long text is the system's, the user's, the assistant's, or spread over many
    turns: the same rows as with no cut (a bound so high nothing is cut), each cut counted."""
    chat = ChatTokenizer(str(tok))
    cut_at = (64 + CUT_MARGIN_TOKENS) * chat.max_token_chars
    big, msg = long_text(cut_at * 5 // 4), lambda role, text: {"role": role, "content": text}
    records = [
        {"messages": [msg("system", big), msg("user", "hi"), msg("assistant", "hello")]},
        {"messages": [msg("user", big), msg("assistant", "hello"), msg("user", "more"), msg("assistant", "ok")]},
        {"messages": [msg("user", "hi"), msg("assistant", big)]},
        {"messages": [m for k in range(30) for m in (msg("user", f"q{k} " + long_text(cut_at // 20)),
                                                     msg("assistant", f"a{k} " + long_text(cut_at // 20)))]},
        {"messages": [msg("user", "short"), msg("assistant", "short too")]},
    ]
    for policy in ("truncate", "drop"):
        m, rows = prepared(tmp_path, f"cut-{policy}", records, tok, max_length=64, long_policy=policy)
        assert m["counts"]["notes"]["text_cut_before_tokenizing"] == 4
        with monkeypatch.context() as mp:
            mp.setattr(ChatTokenizer, "within", lambda self, turns, max_tokens: (turns, False))
            whole, whole_rows = prepared(tmp_path, f"whole-{policy}", records, tok, max_length=64, long_policy=policy)
        assert rows == whole_rows  # past 64 tokens of a long system or user text no loss token is left
        assert len(rows) == (2 if policy == "truncate" else 1)
        assert {k: v for k, v in m["counts"].items() if k != "notes"} == \
               {k: v for k, v in whole["counts"].items() if k != "notes"}
        assert whole["counts"]["notes"]["text_cut_before_tokenizing"] == 0


@pytest.mark.slow  # writes and reads a 200 MB file: about 15 s
def test_a_200_mb_record_prepares_in_flat_memory_cut_to_max_length(tok, tmp_path):
    """One JSONL record holding a 200 MB assistant message (valid JSON, no trailing newline), max_length 2048:
    the step's peak memory stays under 1 GB (at 9aa4e1d a 10 MB record peaked at 2.4 GB with this tokenizer)
    and its row holds the first 2048 tokens of the conversation, as tokenizing it whole gives."""
    data = tmp_path / "huge.jsonl"
    head = {"messages": [{"role": "user", "content": "Write a very long answer."},
                         {"role": "assistant", "content": ""}]}
    opening, closing = json.dumps(head).rsplit('""', 1)
    with open(data, "w") as f:
        f.write(opening + '"')
        quoted = json.dumps(long_text(1 << 20))[1:-1]  # 1 MiB of text, escaped
        for _ in range(200_000_000 // len(quoted) + 1):
            f.write(quoted)
        f.write('"' + closing)  # no newline at the end
    assert data.stat().st_size > 200_000_000
    cfg = tmp_path / "prepare.config.json"
    cfg.write_text(json.dumps({"inputs": [str(data)], "tokenizer": str(tok), "out_dir": str(tmp_path / "out"),
                               "max_length": 2048}))
    # The step starts from a small launcher, which reports its peak: a process forked from this one (GBs after
    # other tests) keeps that high-water mark through exec, so wait4 here would report pytest's size.
    launcher = ("import os, subprocess, sys; p = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL); "
                "_, status, usage = os.wait4(p.pid, 0); print(os.waitstatus_to_exitcode(status), usage.ru_maxrss)")
    done = subprocess.run([sys.executable, "-c", launcher, sys.executable, "-m", "remote.data.prepare",
                           "--config", str(cfg)], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True)
    code, peak_kib = map(int, done.stdout.split())
    assert code == 0, done.stderr[-3000:]
    peak = peak_kib * 1024  # Linux: KiB
    assert peak < 1e9, f"peak {peak:,} bytes"
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert m["counts"]["truncated"] == 1 and m["counts"]["notes"]["text_cut_before_tokenizing"] == 1
    [row] = pq.read_table(tmp_path / "out" / "data.parquet").to_pylist()
    # the same conversation with a text short enough to be tokenized whole, then cut to 2048 tokens
    short = {"messages": [head["messages"][0], {"role": "assistant", "content": long_text(40_000)}]}
    _, [ref] = prepared(tmp_path, "short", [short], tok, max_length=2048)
    assert row["length"] == 2048 and row["input_ids"] == ref["input_ids"] and row["loss_mask"] == ref["loss_mask"]


def test_a_crash_of_the_tokenizer_names_the_records(tok, tmp_path, monkeypatch, capsys):
    """A Python-level crash (a panic) fails the step naming the records; the log named the file as it started."""
    class PanicException(BaseException):  # what the tokenizers library raises when it panics
        pass

    def panic(self, batch):
        raise PanicException("out of memory")

    monkeypatch.setattr(ChatTokenizer, "encode", panic)
    records = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}]
    with pytest.raises(RuntimeError, match=r"prepare failed on the records \S+/crash\.jsonl:1 to \S+/crash\.jsonl:1: "
                                           r"PanicException: out of memory"):
        prepared(tmp_path, "crash", records, tok)
    assert not (tmp_path / "crash").exists() and not (tmp_path / "crash.partial").exists()
    assert f"prepare: reading {tmp_path / 'crash.jsonl'}\n" in capsys.readouterr().out
