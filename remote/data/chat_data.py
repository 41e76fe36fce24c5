"""Reading chat conversations from the files people have, into one normalized form.

    from remote.data.chat_data import ReadReport, read_conversations
    report = ReadReport()
    for conv in read_conversations(["data/", "more.jsonl"], report):
        conv.turns      # (("system", "..."), ("user", "hi"), ("assistant", "hello"))
        conv.sample_id  # sha256 of the normalized turns: the same text is the same sample
    report.bad          # Counter: reason -> rows skipped; report.examples: the first few, with file:line

Accepted records: ShareGPT (`{"conversations": [{"from": "human", "value": ...}, ...]}`, roles
human/user, gpt/chatgpt/bing/bard/assistant/model, system) and OpenAI (`{"messages": [{"role":
"user", "content": ...}, ...]}`). Accepted inputs: JSONL, JSON (an array of records, also one cut
off mid-record: the whole records before the cut are kept and the cut is reported; one record; or
several arrays and records one after another, all read), Parquet, a folder of these (walked in
name order), a `datasets` dataset saved with `save_to_disk`, and `hub:NAME[:SPLIT]` for a hub
dataset where a network exists. Text files may start with a UTF-8 byte-order mark.

Every real file and folder is read once: a symbolic link back up the tree (or the same file given
twice) is counted in `report.notes`, not followed again. Anything given, or met in a folder with a
data suffix, that is not a readable regular file or folder (a FIFO, a device, a symbolic link loop
or to nothing, a file this user may not read) is BadInput naming it; it is never opened.

A good conversation is: an optional system turn first, then user and assistant turns strictly
alternating from a user turn, every content a non-empty string, at least one assistant turn. A
trailing user turn (no answer to learn from) is trimmed and counted in `report.notes`.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import stat
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generator, Iterable, Iterator

from remote.step import BadInput

# Every role spelling seen in ShareGPT dumps and OpenAI files, and what it means.
ROLES = {
    "system": "system", "developer": "system",
    "human": "user", "user": "user",
    "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
    "assistant": "assistant", "model": "assistant",
}
FILE_SUFFIXES = (".jsonl", ".ndjson", ".json", ".parquet")
EXAMPLES_PER_REASON = 3  # bad rows shown in the report: the first ones met of each reason
HASH_SLICE_CHARS = 1 << 20  # a long text is hashed (and checked) this many characters at a time

# Reasons a row is skipped (the keys of ReadReport.bad).
BROKEN_JSON = "broken_json"  # a JSONL line (or a value of a .json file) that does not parse
TOO_DEEP = "nested_too_deep"  # valid JSON nested deeper than the decoder's recursion limit
TOO_DEEP_DETAIL = "valid JSON, nested too deep to decode"
TRUNCATED_FILE = "truncated_file"  # a JSON array cut off: counted once, where it broke
NOT_A_CONVERSATION = "not_a_conversation"  # no `conversations` / `messages` list in the record
MALFORMED_TURN = "malformed_turn"  # a turn that is not an object
UNKNOWN_ROLE = "unknown_role"
NON_STRING_CONTENT = "non_string_content"
EMPTY_CONTENT = "empty_content"
INVALID_UNICODE = "invalid_unicode"  # text with a lone surrogate ("\ud800"): valid JSON, not encodable as UTF-8
NOT_ALTERNATING = "not_alternating"  # system not first, two users in a row, starts with the assistant
NO_ASSISTANT_TURN = "no_assistant_turn"
UNKNOWN_SPLIT = "unknown_split"  # a record's `split` that is neither "train" nor "heldout"


@dataclass(frozen=True, slots=True)
class Conversation:
    """One normalized conversation and where it was read."""

    turns: tuple[tuple[str, str], ...]  # (role, content), roles "system" | "user" | "assistant"
    where: str  # "file:line" (JSON), "file:row N" (Parquet, datasets)
    split: str | None = None  # the split the record names (regenerated data keeps its prompt's); None: by hash

    @property
    def sample_id(self) -> str:
        return conversation_hash(self.turns)


def conversation_hash(turns: Iterable[tuple[str, str]]) -> str:
    """The stable content hash of a normalized conversation: hex sha256 of its canonical JSON,
    `json.dumps([list(t) for t in turns], ensure_ascii=False, separators=(",", ":"))` in UTF-8, fed to
    the hash a slice of a text at a time, so a text of hundreds of MB is not copied whole."""
    h = hashlib.sha256(b"[")
    for i, (role, content) in enumerate(turns):
        h.update(b'%s["%s","' % (b"," if i else b"", _json_string(role)))
        for at in range(0, len(content), HASH_SLICE_CHARS):  # JSON escapes one character at a time
            h.update(_json_string(content[at:at + HASH_SLICE_CHARS]))
        h.update(b'"]')
    h.update(b"]")
    return h.hexdigest()


def _json_string(text: str) -> bytes:
    """text as a JSON string's body (no quotes), in UTF-8."""
    return json.dumps(text, ensure_ascii=False)[1:-1].encode("utf-8")


@dataclass
class ReadReport:
    """What reading found: rows seen, rows skipped by reason with the first few examples."""

    rows: int = 0  # records met (good and bad), broken JSON lines included
    bad: Counter = field(default_factory=Counter)  # reason -> rows skipped
    examples: list[dict] = field(default_factory=list)  # the first few skipped rows of each reason
    notes: Counter = field(default_factory=Counter)  # kept rows that were changed, files ignored
    rows_by_file: dict[str, int] = field(default_factory=dict)  # file -> records met there (files read so far)
    files: int = 0  # files to read in all

    def skip(self, reason: str, where: str, detail: str) -> None:
        self.bad[reason] += 1
        if self.bad[reason] <= EXAMPLES_PER_REASON:
            self.examples.append({"reason": reason, "where": where, "detail": detail[:200]})

    def lost(self, reason: str, where: str, detail: str) -> None:
        """A row that never became a record (broken JSON): it counts as a row and as a bad one."""
        self.rows += 1
        self.skip(reason, where, detail)


class BadRecord(Exception):
    """A record that is not a usable conversation: `reason` is one of the constants above."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason, self.detail = reason, detail


# ----------------------------------------------------------------------------- records -> turns
def parse_record(rec: Any) -> tuple[tuple[tuple[str, str], ...], bool]:
    """(turns, trimmed) of one record, or raises BadRecord. trimmed: a trailing user turn was cut."""
    if not isinstance(rec, dict):
        raise BadRecord(NOT_A_CONVERSATION, f"a record must be a JSON object, got {type(rec).__name__}")
    raw = rec.get("conversations", rec.get("messages"))
    if not isinstance(raw, list):
        raise BadRecord(NOT_A_CONVERSATION, f"no 'conversations' or 'messages' list (keys: {sorted(rec)[:8]})")
    turns = tuple(_turn(t, i) for i, t in enumerate(raw))
    trimmed = bool(turns) and turns[-1][0] == "user"
    if trimmed:
        turns = turns[:-1]
    _check_order(turns)
    return turns, trimmed


def _turn(t: Any, i: int) -> tuple[str, str]:
    if not isinstance(t, dict):
        raise BadRecord(MALFORMED_TURN, f"turn {i} is {type(t).__name__}, not an object")
    # ShareGPT spells it from/value, OpenAI role/content; some ShareGPT dumps mix the two.
    who = t.get("from", t.get("role"))
    role = ROLES.get(who.lower()) if isinstance(who, str) else None
    if role is None:
        raise BadRecord(UNKNOWN_ROLE, f"turn {i} has role {who!r}; known: {sorted(ROLES)}")
    content = t.get("value", t.get("content"))
    if not isinstance(content, str):
        raise BadRecord(NON_STRING_CONTENT, f"turn {i} ({role}) content is {type(content).__name__}, not a string")
    if not content or content.isspace():  # what strip() would leave empty, without a copy of a long text
        raise BadRecord(EMPTY_CONTENT, f"turn {i} ({role}) is empty")
    # JSON's \u escapes can spell half a surrogate pair, which no tokenizer or hash can encode
    if m := _SURROGATE.search(content):
        raise BadRecord(INVALID_UNICODE, f"turn {i} ({role}) holds {m.group()!r} at {m.start()}, "
                        "a lone surrogate, not a character")
    return role, content


def _check_order(turns: tuple[tuple[str, str], ...]) -> None:
    body = turns[1:] if turns and turns[0][0] == "system" else turns
    for i, (role, _) in enumerate(body):
        want = "user" if i % 2 == 0 else "assistant"
        if role != want:
            at = i + len(turns) - len(body)
            raise BadRecord(NOT_ALTERNATING, f"turn {at} is {role}, expected {want}")
    if not any(role == "assistant" for role, _ in body):
        raise BadRecord(NO_ASSISTANT_TURN, f"{len(turns)} turn(s), none by the assistant")


# ----------------------------------------------------------------------------- inputs -> records
def read_conversations(inputs: Iterable[str], report: ReadReport) -> Iterator[Conversation]:
    """The good conversations of every input in order; bad rows are counted in `report`."""
    for where, rec in iter_records(inputs, report):
        try:
            turns, trimmed = parse_record(rec)
            split = _named_split(rec)
        except BadRecord as e:
            report.skip(e.reason, where, e.detail)
            continue
        if trimmed:
            report.notes["trailing_user_turn_trimmed"] += 1
        yield Conversation(turns, where, split)


def _named_split(rec: dict) -> str | None:
    split = rec.get("split")
    if split not in (None, "train", "heldout"):
        raise BadRecord(UNKNOWN_SPLIT, f"split {split!r}: a record may name 'train' or 'heldout'")
    return split


def iter_records(inputs: Iterable[str], report: ReadReport) -> Iterator[tuple[str, Any]]:
    """(where, record) for every record of the inputs. Broken JSON is reported, not yielded."""
    for f in input_files(inputs, report):
        before = report.rows
        yield from _hub_records(f[4:]) if isinstance(f, str) else _file_records(f, report)
        report.rows_by_file[str(f)] = report.rows - before


def input_files(inputs: Iterable[str], report: ReadReport) -> list[Path | str]:
    """Every file to read (a saved `datasets` folder counts as one; `hub:` names stay strings).

    Checks every input exists before anything is read, so a typo fails at once and names the path.
    """
    files: list[Path | str] = []
    seen: set[tuple[int, int]] = set()  # (device, inode) of every file and folder met
    for spec in inputs:
        if spec.startswith("hub:"):
            files.append(spec)
            continue
        p = Path(spec)
        st = _data_stat(p)
        if stat.S_ISREG(st.st_mode) and p.suffix.lower() not in FILE_SUFFIXES:
            raise BadInput(f"input {spec}: unsupported file type {p.suffix!r}; give .jsonl, .json, .parquet, "
                           "a folder of them or a folder saved by datasets' save_to_disk")
        files += _walk(p, st, report, seen)
    report.files = len(files)
    return files


_KINDS = {stat.S_IFIFO: "a FIFO (named pipe)", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
          stat.S_IFSOCK: "a socket"}


def _data_stat(p: Path) -> os.stat_result:
    """p's status (through symbolic links) when p is a regular file or folder this user can read;
    else BadInput saying what it is. Nothing else is ever opened: a FIFO would block, a device never end."""
    try:
        st = p.stat()
    except FileNotFoundError:
        raise BadInput(f"input {p} is a symbolic link to a missing path" if p.is_symlink()
                       else f"input {p} does not exist") from None
    except OSError as e:  # ELOOP, or EACCES on a folder on the way
        what = "a symbolic link loop" if e.errno == errno.ELOOP else e.strerror
        raise BadInput(f"input {p}: {what}") from None
    is_dir = stat.S_ISDIR(st.st_mode)
    if not (is_dir or stat.S_ISREG(st.st_mode)):
        raise BadInput(f"input {p} is {_KINDS.get(stat.S_IFMT(st.st_mode), 'not a regular file')}, "
                       "not a regular file or folder of conversations")
    if not os.access(p, os.R_OK | (os.X_OK if is_dir else 0)):
        raise BadInput(f"input {p}: permission denied (this user may not read it)")
    return st


def _walk(p: Path, st: os.stat_result, report: ReadReport, seen: set[tuple[int, int]]) -> Iterator[Path]:
    """The readable files under p, in name order; a saved `datasets` folder counts as one. A file or
    folder met before (a link back up the tree) is counted in notes and not read again."""
    if (st.st_dev, st.st_ino) in seen:
        report.notes["links_to_files_or_folders_already_read"] += 1
        return
    seen.add((st.st_dev, st.st_ino))
    if stat.S_ISREG(st.st_mode) or is_saved_dataset(p):
        yield p
        return
    try:
        children = sorted(p.iterdir())
    except OSError as e:  # access() said yes, yet listing failed (e.g. an ACL, an I/O error)
        raise BadInput(f"input {p}: cannot list the folder ({e.strerror})") from None
    for child in children:
        if child.name.startswith("."):
            continue
        if child.suffix.lower() in FILE_SUFFIXES or child.is_dir():
            yield from _walk(child, _data_stat(child), report, seen)
        else:
            report.notes["ignored_files"] += 1


def is_saved_dataset(p: Path) -> bool:
    return p.is_dir() and ((p / "dataset_dict.json").is_file()
                           or ((p / "dataset_info.json").is_file() and (p / "state.json").is_file()))


def _file_records(p: Path, report: ReadReport) -> Iterator[tuple[str, Any]]:
    if p.is_dir():
        gen = _dataset_records(p)
    elif p.suffix.lower() == ".parquet":
        gen = _parquet_records(p)
    elif p.suffix.lower() == ".json":
        gen = _json_records(p, report)
    else:
        gen = _jsonl_records(p, _file_lines(p), report)
    for item in gen:
        report.rows += 1
        yield item


def _file_lines(p: Path) -> Iterator[str]:
    """A text file's lines, streamed. Lines end at \n (or \r\n) only: JSON text may hold U+2028 and
    other characters that str.splitlines would also split at."""
    try:
        # utf-8-sig: a byte-order mark at the start (how some systems save UTF-8) is dropped, not read
        with open(p, encoding="utf-8-sig", newline="") as f:
            yield from f
    except UnicodeDecodeError as e:
        raise BadInput(f"{p}: not UTF-8 text ({e})") from e


def _read_text(p: Path) -> str:
    try:
        return p.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise BadInput(f"{p}: not UTF-8 text ({e})") from e


def _jsonl_records(p: Path, lines: Iterable[str], report: ReadReport) -> Iterator[tuple[str, Any]]:
    n = 0  # counted by hand: enumerate's reused result would keep the last line alive beside its record
    for line in lines:
        n += 1
        if not line or line.isspace():
            continue
        try:
            rec = _DECODER.decode(line)
        except RecursionError:
            report.lost(TOO_DEEP, f"{p}:{n}", TOO_DEEP_DETAIL)
            continue
        except json.JSONDecodeError as e:
            report.lost(BROKEN_JSON, f"{p}:{n}", str(e))
            continue
        del line  # a line may be hundreds of MB: its record's texts are all that is kept of it
        yield f"{p}:{n}", rec


def _parse_int(digits: str) -> int | float:
    """An integer, or a float for one too long for int() (over 4300 digits): a conversation has no
    use for such a number, and one in a field nobody reads must not lose the row."""
    try:
        return int(digits)
    except ValueError:
        return float(digits)


_DECODER = json.JSONDecoder(parse_int=_parse_int)
_SURROGATE = re.compile("[\ud800-\udfff]")
_SKIPPED = object()  # a value counted as bad where it was met
_WS = re.compile(r"[ \t\r\n]*")
# A JSON string, or one bracket: enough to find where a value too deep to decode ends.
_STRING_OR_BRACKET = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]', re.S)


class _Lines:
    """The line number of a position in a text, counted as positions grow."""

    def __init__(self, text: str):
        self.text, self.pos, self.line = text, 0, 1

    def at(self, pos: int) -> int:
        self.line += self.text.count("\n", self.pos, pos)
        self.pos = pos
        return self.line


Records = Generator[tuple[str, Any], None, "int | None"]  # (where, record)s; then where reading goes on


def _json_records(p: Path, report: ReadReport) -> Iterator[tuple[str, Any]]:
    """The records of a .json file: its top-level values one after another (one array, one record,
    JSON lines, two arrays...); arrays are decoded record by record, so one cut off mid-record still
    gives its whole records."""
    text = _read_text(p)
    lines = _Lines(text)
    pos = _WS.match(text, 0).end()
    while pos is not None and pos < len(text):
        if text[pos] == "[":
            pos = yield from _array_records(p, text, pos, lines, report)
        else:
            pos = yield from _value_record(p, text, pos, lines, report)
        pos = pos if pos is None else _WS.match(text, pos).end()


def _value_record(p: Path, text: str, pos: int, lines: _Lines, report: ReadReport) -> Records:
    """The top-level value at pos; returns where the next may begin. A broken one is skipped to the next line."""
    where = f"{p}:{lines.at(pos)}"
    try:
        rec, end = _decode(text, pos, where, report)
    except json.JSONDecodeError as e:
        report.lost(BROKEN_JSON, where, str(e))
        nl = text.find("\n", pos)
        return len(text) if nl < 0 else nl + 1
    if rec is not _SKIPPED:
        yield where, rec
    return len(text) if end is None else end


def _array_records(p: Path, text: str, pos: int, lines: _Lines, report: ReadReport) -> Records:
    """The records of the array at pos; returns the position after it, or None where it breaks off."""
    pos += 1
    while True:
        pos = _WS.match(text, pos).end()
        if pos < len(text) and text[pos] == "]":
            return pos + 1
        where = f"{p}:{lines.at(pos)}"
        try:
            rec, end = _decode(text, pos, where, report)
        except json.JSONDecodeError as e:
            report.lost(TRUNCATED_FILE, where, f"the JSON array breaks off here ({e.msg}); "
                        "the records before it are kept")
            return None
        if rec is not _SKIPPED:
            yield where, rec
        pos = len(text) if end is None else _WS.match(text, end).end()
        if pos < len(text) and text[pos] == ",":
            pos += 1
        elif pos >= len(text) or text[pos] != "]":
            report.lost(TRUNCATED_FILE, f"{p}:{lines.at(pos)}", "the JSON array does not go on or close here; "
                        "the records before it are kept")
            return None




def _decode(text: str, pos: int, where: str, report: ReadReport) -> tuple[Any, int | None]:
    """(value, end) of the JSON value at pos. One nested too deep to decode is counted and skipped:
    (_SKIPPED, its end, None when it never closes). Broken JSON raises JSONDecodeError."""
    try:
        return _DECODER.raw_decode(text, pos)
    except RecursionError:
        report.lost(TOO_DEEP, where, TOO_DEEP_DETAIL)
        return _SKIPPED, _value_end(text, pos)


def _value_end(text: str, pos: int) -> int | None:
    """The end of the array or object at pos, by counting brackets outside strings; None if it never closes."""
    depth = 0
    for m in _STRING_OR_BRACKET.finditer(text, pos):
        depth += {"[": 1, "{": 1, "]": -1, "}": -1}.get(m.group(), 0)
        if depth == 0:
            return m.end()
    return None


def _parquet_records(p: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(p)
    except Exception as e:  # pyarrow raises several kinds for a file that is not Parquet
        raise BadInput(f"{p}: not a readable Parquet file ({e})") from e
    names = set(pf.schema_arrow.names)
    columns = [c for c in ("conversations", "messages") if c in names] or None
    row = 0
    for batch in pf.iter_batches(batch_size=1024, columns=columns):
        for rec in batch.to_pylist():
            row += 1
            yield f"{p}:row {row}", _without_nulls(rec)


def _without_nulls(rec: dict) -> dict:
    """Parquet stores a missing column as null: drop those, so `conversations` or `messages` is found."""
    return {k: v for k, v in rec.items() if v is not None}


def _dataset_records(p: Path) -> Iterator[tuple[str, Any]]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(p))
    except Exception as e:  # datasets raises FileNotFoundError, ValueError, ... for a broken folder
        raise BadInput(f"{p}: not a readable saved dataset ({e})") from e
    yield from _dataset_rows(ds, str(p))


def _dataset_rows(ds: Any, name: str) -> Iterator[tuple[str, Any]]:
    import datasets

    parts = sorted(ds.items()) if isinstance(ds, datasets.DatasetDict) else [(None, ds)]
    for split, part in parts:
        columns = [c for c in ("conversations", "messages") if c in part.column_names]
        if columns:
            part = part.select_columns(columns)
        label = f"{name}[{split}]" if split else name
        for i, rec in enumerate(part, 1):
            yield f"{label}:row {i}", _without_nulls(rec)


def _hub_records(spec: str) -> Iterator[tuple[str, Any]]:
    """A dataset by hub name, `NAME` or `NAME:SPLIT`; needs a network (not the case in tests)."""
    import datasets

    name, _, split = spec.partition(":")
    try:
        ds = datasets.load_dataset(name, split=split or None)
    except Exception as e:  # offline, unknown name, no access: all say the same to the user
        raise BadInput(f"input hub:{spec}: cannot load the dataset {name!r} ({type(e).__name__}: {e})") from e
    yield from _dataset_rows(ds, f"hub:{name}")
