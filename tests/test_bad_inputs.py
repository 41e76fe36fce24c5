"""A catalogue of bad inputs, one table, each with the outcome the user gets: the step refuses it with
exit 65 and a message naming the thing (`Refused`), or reads what it can and counts the rest
(`Read`: samples kept, rows dropped by reason, notes). Never a hang, a traceback (exit 1, which the
controller would retry) or unbounded memory.

Prepare (files, rows, formats) and capture inputs (the dataset, the target, the layers) run in
process through their steps' `main` (the exit codes the controller sees); inputs that could hang or
eat memory before issue 15 (FIFOs, devices), and the ones only another user cannot read (tests run
as root), run in a forked child with a time and memory bound, the latter as user nobody. No vLLM
engine starts. The whole table runs in well under two minutes:

    .venv/bin/python -m pytest tests/test_bad_inputs.py -q --durations=5
"""
from __future__ import annotations

import json
import os
import re
import resource
import shutil
import socket
import stat
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from remote.capture import capture
from remote.data import prepare
from remote.step import EXIT_BAD_INPUT
from tests.fixtures.capture import random_samples, write_dataset
from tests.fixtures.limits import deadline

NOBODY = 65534


@dataclass(frozen=True)
class Refused:
    """Exit 65; stderr says `names` (a regex, with {tmp} for the case's folder)."""

    names: str


@dataclass(frozen=True)
class Read:
    """Exit 0 with these counts in the manifest: samples kept, rows dropped by reason, notes."""

    samples: int
    dropped: dict = field(default_factory=dict)
    notes: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[Path], dict]  # writes the input under the case's folder; returns config keys
    expect: Refused | Read
    isolated: bool = False  # run in a forked child with a time and memory bound
    as_nobody: bool = False  # ... as user nobody, in a folder every user can enter


def chat(q: str, a: str = "sure here answer") -> dict:
    return {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}


GOOD = [chat("hello world"), chat("what is python", "code"), {"messages": [
    {"role": "system", "content": "be brief"}, {"role": "user", "content": "thanks"},
    {"role": "assistant", "content": "you can"}]}]


def lines(*records) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)


def put(tmp: Path, name: str, body: str | bytes) -> Path:
    path = tmp / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(body if isinstance(body, bytes) else body.encode())
    return path


def inputs(*paths) -> dict:
    return {"inputs": [str(p) for p in paths]}


def with_good_rows(*bad: str) -> Callable[[Path], dict]:
    """A JSONL file of the good rows with the bad ones between them."""
    return lambda tmp: inputs(put(tmp, "d.jsonl", lines(GOOD[0], *bad, GOOD[1], GOOD[2])))


def folder_with(name: str, make: Callable[[Path], None]) -> Callable[[Path], dict]:
    """A folder holding a good file and one odd entry `name`, made by make(path)."""
    def build(tmp: Path) -> dict:
        put(tmp, "d/good.jsonl", lines(*GOOD))
        make(tmp / "d" / name)
        return inputs(tmp / "d")
    return build


def fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def unix_socket(path: Path) -> Path:
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.close()
    return path


def loops(tmp: Path) -> dict:
    put(tmp, "d/a.jsonl", lines(GOOD[0]))
    put(tmp, "d/sub/b.jsonl", lines(GOOD[1], GOOD[2]))
    (tmp / "d/sub/up").symlink_to("..")
    (tmp / "d/sub/top").symlink_to(tmp / "d")
    return inputs(tmp / "d")


def not_readable_by_others(tmp: Path, entry: str) -> dict:
    """A world-readable folder with one root-only entry (a file, or a folder holding a good file)."""
    put(tmp, "d/good.jsonl", lines(*GOOD))
    put(tmp, "d/secret/more.jsonl", lines(chat("more")))
    for p in [tmp, tmp / "d", tmp / "d/good.jsonl", tmp / "d/secret", tmp / "d/secret/more.jsonl"]:
        p.chmod(0o755)
    if entry != "secret":
        shutil.move(tmp / "d/secret/more.jsonl", tmp / "d" / entry)
    (tmp / "d" / entry).chmod(0o700 if entry == "secret" else 0o600)
    return inputs(tmp / "d")


def saved_dataset_broken(tmp: Path) -> dict:
    put(tmp, "saved/dataset_info.json", "{}")
    put(tmp, "saved/state.json", "not json")
    return inputs(tmp / "saved")


def parquet(tmp: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), tmp / "d.parquet")
    return tmp / "d.parquet"


DEEP = "[" * 5000 + "]" * 5000
LONE_SURROGATE = '{"conversations": [{"from": "human", "value": "\\ud800 alone"}, {"from": "gpt", "value": "a"}]}'
NOT_A_CONV = "not_a_conversation"

PREPARE_CASES = [
    # ---- files
    Case("a missing input", lambda t: inputs(t / "nope.jsonl"), Refused(r"input {tmp}/nope.jsonl does not exist")),
    Case("a file of another type", lambda t: inputs(put(t, "notes.txt", "x")), Refused(r"notes.txt: unsupported file type '.txt'")),
    Case("a Latin-1 file", lambda t: inputs(put(t, "l.jsonl", '{"x": "caf\xe9"}\n'.encode("latin-1"))),
         Refused(r"{tmp}/l.jsonl: not UTF-8 text")),
    Case("a .parquet that is not Parquet", lambda t: inputs(put(t, "d.parquet", "PAR1 no")),
         Refused(r"{tmp}/d.parquet: not a readable Parquet file")),
    Case("a broken saved dataset", saved_dataset_broken, Refused(r"{tmp}/saved: not a readable saved dataset")),
    Case("a FIFO given directly", lambda t: inputs(fifo(t / "pipe.jsonl")),
         Refused(r"input {tmp}/pipe.jsonl is a FIFO \(named pipe\)"), isolated=True),
    Case("a FIFO with a data suffix in a folder", folder_with("pipe.jsonl", fifo),
         Refused(r"input {tmp}/d/pipe.jsonl is a FIFO"), isolated=True),
    Case("a FIFO without a data suffix in a folder", folder_with("pipe", fifo),
         Read(3, notes={"ignored_files": 1}), isolated=True),
    Case("/dev/zero given directly", lambda t: inputs("/dev/zero"),
         Refused(r"input /dev/zero is a character device"), isolated=True),
    Case("/dev/zero linked as data in a folder", folder_with("zero.jsonl", lambda p: p.symlink_to("/dev/zero")),
         Refused(r"input {tmp}/d/zero.jsonl is a character device"), isolated=True),
    Case("/dev/zero linked as a .json given directly", lambda t: (t / "z.json").symlink_to("/dev/zero") or inputs(t / "z.json"),
         Refused(r"input {tmp}/z.json is a character device"), isolated=True),
    Case("a socket with a data suffix in a folder", folder_with("s.json", unix_socket),
         Refused(r"input {tmp}/d/s.json is a socket")),
    Case("a symlink loop given directly", lambda t: (t / "a.jsonl").symlink_to(t / "a.jsonl") or inputs(t / "a.jsonl"),
         Refused(r"input {tmp}/a.jsonl: a symbolic link loop")),
    Case("a symlink loop with a data suffix in a folder", folder_with("x.jsonl", lambda p: p.symlink_to(p)),
         Refused(r"input {tmp}/d/x.jsonl: a symbolic link loop")),
    Case("a symlink loop without a data suffix in a folder", folder_with("x", lambda p: p.symlink_to(p)),
         Read(3, notes={"ignored_files": 1})),
    Case("a link to nothing in a folder", folder_with("gone.jsonl", lambda p: p.symlink_to(p.parent / "missing")),
         Refused(r"input {tmp}/d/gone.jsonl is a symbolic link to a missing path")),
    Case("two links back up the tree", loops, Read(3, notes={"links_to_files_or_folders_already_read": 2})),
    Case("the same file given twice", lambda t: inputs(put(t, "d.jsonl", lines(*GOOD)), t / "d.jsonl"),
         Read(3, notes={"links_to_files_or_folders_already_read": 1})),
    Case("a file only root may read", lambda t: not_readable_by_others(t, "secret.jsonl"),
         Refused(r"input {tmp}/d/secret.jsonl: permission denied"), isolated=True, as_nobody=True),
    Case("a folder only root may enter", lambda t: not_readable_by_others(t, "secret"),
         Refused(r"input {tmp}/d/secret: permission denied"), isolated=True, as_nobody=True),
    Case("a folder named like a file, empty", lambda t: (t / "d.jsonl").mkdir() or inputs(t / "d.jsonl"),
         Refused(r"no usable conversations in \['{tmp}/d.jsonl'\]")),
    Case("a folder with no data files", lambda t: inputs(put(t, "d/readme.md", "hi").parent),
         Refused(r"no usable conversations in \['{tmp}/d'\]")),
    Case("an empty file", lambda t: inputs(put(t, "e.jsonl", "\n\n")), Refused(r"empty: \['{tmp}/e.jsonl'\]")),
    # ---- formats
    Case("a byte-order mark before JSON lines", lambda t: inputs(put(t, "b.jsonl", "\ufeff" + lines(*GOOD))), Read(3)),
    Case("a byte-order mark before a JSON array", lambda t: inputs(put(t, "b.json", "\ufeff" + json.dumps(GOOD))), Read(3)),
    Case("two JSON arrays in one file", lambda t: inputs(put(t, "two.json", json.dumps(GOOD[:1]) + json.dumps(GOOD[1:]))),
         Read(3)),
    Case("an array then records in one .json", lambda t: inputs(put(t, "m.json", json.dumps(GOOD[:1]) + "\n" + lines(*GOOD[1:]))),
         Read(3)),
    Case("a JSON array cut off mid-record", lambda t: inputs(put(t, "cut.json", json.dumps(GOOD)[:-20])),
         Read(2, dropped={"truncated_file": 1})),
    Case("a JSON array of strings", lambda t: inputs(put(t, "s.json", json.dumps(["a", "b"]))),
         Refused(r"no usable conversations.*not_a_conversation': 2")),
    Case("Parquet without a conversations column", lambda t: inputs(parquet(t, [{"text": "x"}, {"text": "y"}])),
         Refused(r"no usable conversations.*not_a_conversation': 2")),
    Case("a hub name without a network", lambda t: inputs("hub:someone/chats"),
         Refused(r"input hub:someone/chats: cannot load the dataset 'someone/chats'")),
    # ---- rows
    Case("a lone surrogate", with_good_rows(LONE_SURROGATE), Read(3, dropped={"invalid_unicode": 1})),
    Case("a row nested 5000 deep", with_good_rows(DEEP), Read(3, dropped={"nested_too_deep": 1})),
    Case("a turn nested 5000 deep", with_good_rows('{"conversations": [%s]}' % DEEP), Read(3, dropped={"nested_too_deep": 1})),
    Case("a record nested 5000 deep in an array", lambda t: inputs(put(t, "a.json", "[%s, %s]" % (json.dumps(GOOD[0]), DEEP))),
         Read(1, dropped={"nested_too_deep": 1})),
    Case("a 5000-digit number in an unused field", with_good_rows('{"id": %s, "messages": [{"role": "user", "content": "q"},'
                                                                  ' {"role": "assistant", "content": "a"}]}' % ("9" * 5000)), Read(4)),
    Case("a broken JSON line", with_good_rows("{not json"), Read(3, dropped={"broken_json": 1})),
    Case("a record with no turns", with_good_rows({"text": "plain"}), Read(3, dropped={NOT_A_CONV: 1})),
    Case("an unknown role", with_good_rows(chat("q") | {"conversations": [{"from": "wizard", "value": "x"}]}),
         Read(3, dropped={"unknown_role": 1})),
    Case("content that is not a string", with_good_rows({"messages": [{"role": "user", "content": ["q"]},
                                                                      {"role": "assistant", "content": "a"}]}),
         Read(3, dropped={"non_string_content": 1})),
    Case("an empty reply", with_good_rows(chat("q", "  ")), Read(3, dropped={"empty_content": 1})),
    Case("turns out of order", with_good_rows({"conversations": [{"from": "gpt", "value": "a"}, {"from": "human", "value": "q"},
                                                                 {"from": "gpt", "value": "b"}]}),
         Read(3, dropped={"not_alternating": 1})),
    Case("no assistant turn", with_good_rows({"conversations": [{"from": "human", "value": "q"}]}),
         Read(3, dropped={"no_assistant_turn": 1})),
    Case("a turn that is a string", with_good_rows({"conversations": ["q", {"from": "gpt", "value": "a"}]}),
         Read(3, dropped={"malformed_turn": 1})),
    Case("a control token in the text", with_good_rows(chat("end <|im_end|> early")),
         Read(3, dropped={"special_token_in_text": 1})),
    Case("the same conversation twice", with_good_rows(GOOD[0]), Read(3, dropped={"duplicate": 1})),
    Case("a NUL character in the text", with_good_rows(chat("nul \x00 inside")), Read(4)),
    Case("mostly bad rows", lambda t: inputs(put(t, "d.jsonl", lines(GOOD[0], "{x", "{y", "[1]"))),
         Refused(r"3 of 4 rows are malformed \(75.0%\), more than max_bad_fraction=0.5")),
]


# ----------------------------------------------------------------------------- capture inputs
def dataset(tmp: Path, **columns) -> dict:
    """The good dataset with some columns replaced."""
    samples = random_samples([6, 9, 4], vocab=200, seed=7)
    table = pq.read_table(write_dataset(tmp / "good.parquet", samples)).to_pydict()
    pq.write_table(pa.table({**table, **columns}), tmp / "data.parquet")
    return {"dataset": str(tmp / "data.parquet")}


def target(tmp: Path, llama: Path, text: str | None = None, **config) -> dict:
    """A copy of the tiny Llama with its config.json changed (None deletes a key), or replaced by `text`."""
    shutil.copytree(llama, tmp / "target")
    path = tmp / "target" / "config.json"
    merged = {**json.loads(path.read_text()), **config}
    path.write_text(text if text is not None else json.dumps({k: v for k, v in merged.items() if v is not None}))
    return {"target": str(tmp / "target")}


def gpt2(tmp: Path, llama: Path) -> dict:
    """A model whose decoder layers are not where eaglet looks (GPT-2 keeps them at .transformer.h)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=64, n_head=2, vocab_size=512)).save_pretrained(tmp / "gpt2")
    config = json.loads((tmp / "gpt2" / "config.json").read_text())
    (tmp / "gpt2" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 4, "hidden_size": 64}))
    return {"target": str(tmp / "gpt2"), "layer_ids": [1, 2]}


CAPTURE_CASES = [
    Case("a missing dataset", lambda t, m: {"dataset": str(t / "none.parquet")},
         Refused(r"dataset {tmp}/none.parquet does not exist")),
    Case("a folder as the dataset", lambda t, m: {"dataset": str(t)}, Refused(r"dataset {tmp} does not exist")),
    Case("a dataset that is not Parquet", lambda t, m: {"dataset": str(put(t, "d.parquet", "nope"))},
         Refused(r"dataset {tmp}/d.parquet is not a readable parquet file")),
    Case("a dataset without input_ids", lambda t, m: {"dataset": str(parquet(t, [{"sample_id": "a"}]))},
         Refused(r"dataset {tmp}/d.parquet: missing column\(s\) \['input_ids'")),
    Case("an empty dataset", lambda t, m: dataset(t, sample_id=pa.array([], pa.string()), input_ids=pa.array([], pa.list_(pa.int32())),
                                                  loss_mask=pa.array([], pa.list_(pa.int8())), length=pa.array([], pa.int32()),
                                                  split=pa.array([], pa.string())),
         Refused(r"dataset {tmp}/data.parquet has no samples")),
    Case("a token id outside the vocabulary", lambda t, m: dataset(t, input_ids=[[1, 2, 3, 4, 5, 99999], [1] * 9, [1] * 4]),
         Refused(r"row 0 .*token id 99999 outside the target's vocabulary")),
    Case("a negative token id", lambda t, m: dataset(t, input_ids=[[1, 2, 3, 4, 5, -1], [1] * 9, [1] * 4]),
         Refused(r"row 0 .*token id -1 outside")),
    Case("a sample id twice", lambda t, m: dataset(t, sample_id=["a", "a", "b"]), Refused(r"row 1 \(sample a\): sample_id is empty or repeated")),
    Case("a loss mask of 2", lambda t, m: dataset(t, loss_mask=[[2] * 6, [1] * 9, [0] * 4]),
         Refused(r"row 0 .*loss_mask holds values other than 0 and 1")),
    Case("a length that disagrees", lambda t, m: dataset(t, length=[7, 9, 4]), Refused(r"row 0 .*6 input_ids, 6 loss_mask values, length 7")),
    Case("an unknown split", lambda t, m: dataset(t, split=["train", "test", "train"]), Refused(r"row 1 .*split 'test' is neither")),
    Case("a target without config.json", lambda t, m: {"target": str(t)}, Refused(r"target {tmp}: no config.json")),
    Case("a target whose config.json is broken", lambda t, m: target(t, m, text="{"),
         Refused(r"target {tmp}/target: config.json is not valid JSON")),
    Case("a target config without num_hidden_layers", lambda t, m: target(t, m, num_hidden_layers=None),
         Refused(r"lacks \['num_hidden_layers'\]")),
    Case("a target of an unknown model type", lambda t, m: target(t, m, model_type="no_such_model"),
         Refused(r"transformers cannot read the config of {tmp}/target")),
    Case("a target dtype eaglet cannot store", lambda t, m: target(t, m, torch_dtype="int8", dtype="int8"),
         Refused(r"dtype 'int8' from config.json is not one of")),
    Case("layer ids outside the target", lambda t, m: {"layer_ids": [1, 6]}, Refused(r"layer_ids \[1, 6\]: need distinct .* in 1..5")),
    Case("a target too shallow for the default layers", lambda t, m: {"layer_ids": None},
         Refused(r"6 decoder layers is too shallow for EAGLE-3's default aux layers")),
    Case("a sample longer than max_model_len", lambda t, m: {"max_model_len": 5}, Refused(r"has 9 tokens: more than max_model_len=5")),
    Case("a host part with no samples", lambda t, m: {"host_parts": 50, "host_part": 49}, Refused(r"none of its 3 samples falls to host part 49")),
    Case("a model without decoder layers where eaglet looks", gpt2, Refused(r"GPT2LMHeadModel: found no decoder layers")),
]


# ----------------------------------------------------------------------------- running a case
@pytest.fixture
def case_dir():
    """A fresh folder every user may enter (the `as_nobody` cases need one; pytest's tmp_path is root's)."""
    path = Path(tempfile.mkdtemp(prefix="eaglet-bad-input-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def in_child(main, argv: list[str], as_nobody: bool) -> int:
    """main(argv) in a forked child, its address space bounded (1 GiB more than now), as user nobody
    when asked; its exit code, or TimeoutError after 60 s (the child is then killed)."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 70
        try:
            vm = int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")
            resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), vm + (1 << 30)))
            if as_nobody:
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
            code = main(argv)
        finally:
            sys.stderr.flush()
            os._exit(code)
    try:
        with deadline(60):
            return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    except TimeoutError:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        raise


def run_step(main, config: dict, case: Case, tmp: Path, capfd) -> tuple[int, str]:
    path = tmp / "step.config.json"
    path.write_text(json.dumps(config))
    path.chmod(0o644)
    argv = ["--config", str(path)]
    if case.isolated:
        code = in_child(main, argv, case.as_nobody)
    else:
        with deadline(60):
            code = main(argv)
    return code, capfd.readouterr().err


def check(case: Case, code: int, err: str, out_dir: Path, tmp: Path) -> None:
    if isinstance(case.expect, Refused):
        assert code == EXIT_BAD_INPUT, err[-3000:]
        assert re.search(case.expect.names.format(tmp=tmp), err), err[-3000:]
        assert not out_dir.exists()  # nothing that looks finished
        return
    assert code == 0, err[-3000:]
    counts = json.loads((out_dir / "manifest.json").read_text())["counts"]
    assert counts["samples"] == case.expect.samples
    assert counts["dropped_by_reason"] == case.expect.dropped
    assert {k: counts["notes"].get(k) for k in case.expect.notes} == case.expect.notes


@pytest.mark.parametrize("case", PREPARE_CASES, ids=[c.name for c in PREPARE_CASES])
def test_prepare(case, case_dir, tiny_llama, capfd):
    config = {"tokenizer": str(tiny_llama), "out_dir": str(case_dir / "out"), **case.build(case_dir)}
    code, err = run_step(prepare.main, config, case, case_dir, capfd)
    check(case, code, err, case_dir / "out", case_dir)


@pytest.mark.parametrize("case", CAPTURE_CASES, ids=[c.name for c in CAPTURE_CASES])
def test_capture(case, case_dir, tiny_llama, capfd):
    config = {"target": str(tiny_llama), "out_dir": str(case_dir / "out"), "cache_root": str(case_dir / "cache"),
              "backend": "transformers", "device": "cpu", "layer_ids": [1, 3, 4],
              **dataset(case_dir), **case.build(case_dir, tiny_llama)}
    code, err = run_step(capture.main, config, case, case_dir, capfd)
    check(case, code, err, case_dir / "out", case_dir)


def test_the_catalogue_is_big_enough():
    assert len(PREPARE_CASES) + len(CAPTURE_CASES) >= 40
