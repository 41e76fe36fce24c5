"""Reading conversations: every input kind, every bad-row kind, where each was found. Real files."""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from remote.data import chat_data as cd
from remote.step import BadInput
from tests.fixtures.limits import deadline

GOOD_SHAREGPT = {"id": "a", "conversations": [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "hi there"}]}
GOOD_OPENAI = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"},
                            {"role": "assistant", "content": "4"}]}


def read(*inputs, report=None):
    report = report if report is not None else cd.ReadReport()
    return list(cd.read_conversations([str(p) for p in inputs], report)), report


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


def sharegpt(*turns):
    return {"conversations": [{"from": f, "value": v} for f, v in turns]}


def test_sharegpt_and_openai_records_normalize_to_the_same_turns(tmp_path):
    sg = sharegpt(("system", "be brief"), ("human", "2+2?"), ("gpt", "4"))
    convs, report = read(write_jsonl(tmp_path / "a.jsonl", [sg, GOOD_OPENAI]))
    assert [c.turns for c in convs] == [(("system", "be brief"), ("user", "2+2?"), ("assistant", "4"))] * 2
    assert convs[0].sample_id == convs[1].sample_id  # same text, same sample, whatever the format
    assert [c.where for c in convs] == [f"{tmp_path / 'a.jsonl'}:1", f"{tmp_path / 'a.jsonl'}:2"]
    assert report.rows == 2 and not report.bad


@pytest.mark.parametrize("spelling", ["gpt", "chatgpt", "bing", "bard", "assistant", "model", "GPT"])
def test_every_assistant_spelling_is_the_assistant(tmp_path, spelling):
    rec = {"conversations": [{"from": "user", "value": "q"}, {"from": spelling, "value": "a"}]}
    convs, _ = read(write_jsonl(tmp_path / "a.jsonl", [rec]))
    assert convs[0].turns == (("user", "q"), ("assistant", "a"))


def test_the_hash_is_of_the_content_only():
    a = cd.conversation_hash([("user", "q"), ("assistant", "a")])
    assert a == cd.conversation_hash((("user", "q"), ("assistant", "a")))
    assert a != cd.conversation_hash([("user", "q"), ("assistant", "a ")])
    assert a != cd.conversation_hash([("system", "q"), ("assistant", "a")])
    assert len(a) == 64 and int(a, 16) >= 0


BAD_ROWS = [
    (cd.NO_ASSISTANT_TURN, sharegpt(("human", "anyone?"))),
    (cd.NO_ASSISTANT_TURN, {"conversations": []}),
    (cd.EMPTY_CONTENT, sharegpt(("human", "q"), ("gpt", "  \n"))),
    (cd.NON_STRING_CONTENT, sharegpt(("human", "q"), ("gpt", 42))),
    (cd.NON_STRING_CONTENT, {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None}]}),
    (cd.NON_STRING_CONTENT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "q"}]},
                                          {"role": "assistant", "content": "a"}]}),
    (cd.UNKNOWN_ROLE, sharegpt(("human", "q"), ("wizard", "a"))),
    (cd.UNKNOWN_ROLE, {"messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "a"}]}),
    (cd.UNKNOWN_ROLE, {"conversations": [{"value": "no role"}, {"from": "gpt", "value": "a"}]}),
    (cd.NOT_ALTERNATING, sharegpt(("gpt", "I start"), ("human", "q"), ("gpt", "a"))),
    (cd.NOT_ALTERNATING, sharegpt(("human", "q1"), ("human", "q2"), ("gpt", "a"))),
    (cd.NOT_ALTERNATING, sharegpt(("human", "q"), ("gpt", "a1"), ("gpt", "a2"))),
    (cd.NOT_ALTERNATING, sharegpt(("human", "q"), ("system", "late"), ("gpt", "a"))),
    (cd.MALFORMED_TURN, {"conversations": ["just a string", {"from": "gpt", "value": "a"}]}),
    (cd.NOT_A_CONVERSATION, {"text": "plain text, no turns"}),
    (cd.NOT_A_CONVERSATION, {"conversations": "not a list"}),
    (cd.NOT_A_CONVERSATION, ["a", "list"]),
]


@pytest.mark.parametrize("reason,rec", BAD_ROWS, ids=[f"{r}-{i}" for i, (r, _) in enumerate(BAD_ROWS)])
def test_each_bad_row_is_skipped_and_counted_by_its_reason(tmp_path, reason, rec):
    f = write_jsonl(tmp_path / "d.jsonl", [GOOD_SHAREGPT, rec, GOOD_OPENAI])
    convs, report = read(f)
    assert len(convs) == 2 and report.rows == 3
    assert report.bad == {reason: 1}
    assert report.examples[0]["where"] == f"{f}:2" and report.examples[0]["reason"] == reason


def test_broken_json_lines_are_rows_that_count_and_show_their_line(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps(GOOD_SHAREGPT) + "\n{not json\n\n" + json.dumps(GOOD_OPENAI) + '\n{"conversations": [')
    convs, report = read(f)
    assert len(convs) == 2
    assert report.bad == {cd.BROKEN_JSON: 2} and report.rows == 4  # the blank line is no row
    assert [e["where"] for e in report.examples] == [f"{f}:2", f"{f}:5"]


def test_only_the_first_few_examples_of_each_reason_are_kept(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", [sharegpt(("human", "q"))] * 7 + [{"x": 1}] * 2)
    _, report = read(f)
    assert report.bad == {cd.NO_ASSISTANT_TURN: 7, cd.NOT_A_CONVERSATION: 2}
    assert [e["reason"] for e in report.examples] == [cd.NO_ASSISTANT_TURN] * cd.EXAMPLES_PER_REASON + [cd.NOT_A_CONVERSATION] * 2


def test_a_trailing_user_turn_is_trimmed_not_dropped(tmp_path):
    rec = sharegpt(("human", "q"), ("gpt", "a"), ("human", "and then?"))
    convs, report = read(write_jsonl(tmp_path / "d.jsonl", [rec]))
    assert convs[0].turns == (("user", "q"), ("assistant", "a"))
    assert report.notes["trailing_user_turn_trimmed"] == 1 and not report.bad


def test_lines_split_only_at_newlines(tmp_path):
    # json.dumps(ensure_ascii=False) leaves U+2028 and U+0085 raw; str.splitlines would cut the record there.
    rec = sharegpt(("human", "one\u2028two\x85three\x1cfour"), ("gpt", "ok"))
    f = tmp_path / "d.jsonl"
    f.write_bytes((json.dumps(rec, ensure_ascii=False) + "\r\n").encode())
    convs, report = read(f)
    assert convs[0].turns[0][1] == "one\u2028two\x85three\x1cfour" and not report.bad


def test_a_json_array_cut_off_mid_record_keeps_the_whole_records_and_says_where(tmp_path):
    body = json.dumps([GOOD_SHAREGPT, GOOD_OPENAI, GOOD_SHAREGPT], indent=2)
    cut = body.rindex('"hi there"')  # inside the third record
    f = tmp_path / "cut.json"
    f.write_text(body[:cut])
    convs, report = read(f)
    assert len(convs) == 2
    assert report.bad == {cd.TRUNCATED_FILE: 1} and report.rows == 3
    line_of_third = body[:cut].count("\n", 0, body.index("{", body.index('"4"'))) + 1
    assert report.examples[0]["where"] == f"{f}:{line_of_third}"


def test_a_json_array_cut_between_records_is_reported_too(tmp_path):
    f = tmp_path / "cut.json"
    f.write_text("[" + json.dumps(GOOD_SHAREGPT) + ",\n")
    convs, report = read(f)
    assert len(convs) == 1 and report.bad == {cd.TRUNCATED_FILE: 1} and report.examples[0]["where"] == f"{f}:2"


def test_json_file_forms(tmp_path):
    (tmp_path / "one.json").write_text(json.dumps(GOOD_OPENAI, indent=1))  # a single record
    write_jsonl(tmp_path / "lines.json", [GOOD_SHAREGPT, GOOD_OPENAI])  # JSON lines named .json
    (tmp_path / "array.json").write_text(json.dumps([GOOD_SHAREGPT]))
    convs, report = read(tmp_path / "one.json", tmp_path / "lines.json", tmp_path / "array.json")
    assert len(convs) == 4 and not report.bad


def test_empty_files_give_nothing_and_are_listed(tmp_path):
    for name in ("e.jsonl", "e.json"):
        (tmp_path / name).write_text("  \n")
    convs, report = read(tmp_path / "e.jsonl", tmp_path / "e.json")
    assert convs == [] and report.rows == 0
    assert report.rows_by_file == {str(tmp_path / "e.jsonl"): 0, str(tmp_path / "e.json"): 0}


def test_a_folder_of_mixed_files_in_name_order(tmp_path):
    import datasets

    d = tmp_path / "data"
    (d / "sub").mkdir(parents=True)
    write_jsonl(d / "a.jsonl", [GOOD_SHAREGPT])
    (d / "b.json").write_text(json.dumps([GOOD_OPENAI, {"oops": 1}]))
    pq.write_table(pa.Table.from_pylist([sharegpt(("human", "from parquet"), ("gpt", "yes"))]), d / "c.parquet")
    datasets.Dataset.from_list([{"messages": [{"role": "user", "content": "from a saved dataset"},
                                              {"role": "assistant", "content": "yes"}]}]).save_to_disk(str(d / "sub" / "saved"))
    (d / "README.txt").write_text("not data")
    (d / ".hidden.jsonl").write_text("{broken")
    convs, report = read(d)
    assert [c.turns[0][1] for c in convs] == ["hello", "be brief", "from parquet", "from a saved dataset"]
    assert report.bad == {cd.NOT_A_CONVERSATION: 1} and report.examples[0]["where"] == f"{d / 'b.json'}:1"
    assert report.notes["ignored_files"] == 1  # README.txt; hidden files are not even counted
    assert convs[2].where == f"{d / 'c.parquet'}:row 1"
    assert convs[3].where == f"{d / 'sub' / 'saved'}:row 1"
    assert report.files == 4 and sum(report.rows_by_file.values()) == 5


def test_parquet_with_both_shapes_and_nulls(tmp_path):
    # A Parquet file mixing formats stores the absent column as null: the row is still found.
    rows = [{"conversations": GOOD_SHAREGPT["conversations"], "messages": None},
            {"conversations": None, "messages": GOOD_OPENAI["messages"]}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "m.parquet")
    convs, report = read(tmp_path / "m.parquet")
    assert len(convs) == 2 and not report.bad


def test_a_saved_dataset_dict_reads_every_split(tmp_path):
    import datasets

    rec = {"conversations": GOOD_SHAREGPT["conversations"]}
    datasets.DatasetDict({"train": datasets.Dataset.from_list([rec, rec]),
                          "test": datasets.Dataset.from_list([rec])}).save_to_disk(str(tmp_path / "dd"))
    convs, _ = read(tmp_path / "dd")
    assert [c.where for c in convs] == [f"{tmp_path / 'dd'}[test]:row 1", f"{tmp_path / 'dd'}[train]:row 1",
                                        f"{tmp_path / 'dd'}[train]:row 2"]


def test_inputs_that_cannot_be_read_fail_naming_them(tmp_path):
    with pytest.raises(BadInput, match="nope.jsonl does not exist"):
        read(tmp_path / "nope.jsonl")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(BadInput, match=r"notes.txt: unsupported file type '.txt'"):
        read(tmp_path / "notes.txt")
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(BadInput, match="bad.parquet: not a readable Parquet file"):
        read(tmp_path / "bad.parquet")
    (tmp_path / "latin1.jsonl").write_bytes('{"x": "caf\xe9"}\n'.encode("latin-1"))
    with pytest.raises(BadInput, match="latin1.jsonl: not UTF-8"):
        read(tmp_path / "latin1.jsonl")


def test_a_missing_input_fails_before_anything_is_read(tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", [GOOD_SHAREGPT])
    report = cd.ReadReport()
    with pytest.raises(BadInput, match="missing.json does not exist"):
        read(good, tmp_path / "missing.json", report=report)
    assert report.rows == 0


def test_a_hub_name_without_a_network_fails_clearly():
    # No network here (HF_HUB_OFFLINE=1 in conftest): the hub path can only be checked failing.
    with pytest.raises(BadInput, match="hub:someone/some-chats: cannot load the dataset 'someone/some-chats'"):
        read("hub:someone/some-chats")


# ----------------------------------------------------------------------------- odd files (issue 15)
@pytest.mark.parametrize("name", ["bom.jsonl", "bom.json"])
def test_a_byte_order_mark_at_the_start_is_not_text(tmp_path, name):
    f = tmp_path / name
    body = json.dumps([GOOD_SHAREGPT, GOOD_OPENAI]) if name.endswith(".json") else \
        json.dumps(GOOD_SHAREGPT) + "\n" + json.dumps(GOOD_OPENAI) + "\n"
    f.write_bytes(b"\xef\xbb\xbf" + body.encode())
    convs, report = read(f)
    assert len(convs) == 2 and report.rows == 2 and not report.bad


def test_several_json_values_in_one_json_file_are_all_read(tmp_path):
    f = tmp_path / "many.json"
    f.write_text(json.dumps([GOOD_SHAREGPT]) + json.dumps([GOOD_OPENAI, {"x": 1}]) + "\n"
                 + json.dumps(sharegpt(("human", "third"), ("gpt", "yes"))) + "\n[]\n")
    convs, report = read(f)
    assert [c.turns[0][1] for c in convs] == ["hello", "be brief", "third"]
    assert report.rows == 4 and report.bad == {cd.NOT_A_CONVERSATION: 1}
    assert [c.where for c in convs] == [f"{f}:1", f"{f}:1", f"{f}:2"]


DEEP = "[" * 5000 + "]" * 5000


@pytest.mark.parametrize("form", ["jsonl", "json array", "json values"])
def test_a_row_too_deep_or_unencodable_is_one_counted_bad_row(tmp_path, form):
    surrogate = '{"conversations": [{"from": "human", "value": "half \\ud800 a pair"}, {"from": "gpt", "value": "a"}]}'
    deep = '{"conversations": [{"from": "human", "value": %s}]}' % DEEP
    # a number Python refuses to convert (over 4300 digits) in a field nobody reads: still a good row
    huge_id = '{"id": %s, "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "big"}]}' % ("1" * 5000)
    rows = [json.dumps(GOOD_SHAREGPT), deep, surrogate, DEEP, huge_id, json.dumps(GOOD_OPENAI)]
    f = tmp_path / ("d.jsonl" if form == "jsonl" else "d.json")
    f.write_text("[" + ",\n".join(rows) + "]" if form == "json array" else "\n".join(rows))
    convs, report = read(f)
    assert [c.turns[-1][1] for c in convs] == ["hi there", "big", "4"] and report.rows == 6
    assert report.bad == {cd.TOO_DEEP: 2, cd.INVALID_UNICODE: 1}
    assert [e["where"] for e in report.examples] == [f"{f}:2", f"{f}:3", f"{f}:4"]


def test_links_back_up_the_tree_are_not_followed_and_each_file_is_read_once(tmp_path):
    d = tmp_path / "data"
    (d / "sub").mkdir(parents=True)
    write_jsonl(d / "a.jsonl", [GOOD_SHAREGPT])
    write_jsonl(d / "sub" / "b.jsonl", [GOOD_OPENAI])
    (d / "sub" / "up").symlink_to("..")  # two loops: without a guard the walk grows without end
    (d / "sub" / "root").symlink_to(d)
    (d / "same.jsonl").symlink_to("a.jsonl")  # the same real file under another name
    with deadline(20):
        convs, report = read(d, d / "sub" / "b.jsonl")  # b given again, directly
    assert [c.where for c in convs] == [f"{d / 'a.jsonl'}:1", f"{d / 'sub' / 'b.jsonl'}:1"]
    assert report.files == 2 and report.rows == 2
    assert report.notes["links_to_files_or_folders_already_read"] == 4
