"""The prepare step on real tokenizers: the tiny ChatML ones of tests/fixtures/models.py (with and
without a default system prompt) and SmolLM2-135M-Instruct's own, converted by remote.data.embedded_default."""
from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from remote.data import chat_template, prepare
from remote.data.chat_data import NO_ASSISTANT_TURN, NOT_ALTERNATING, conversation_hash
from remote.step import EXIT_BAD_INPUT, BadInput, sha256_file
from tests.fixtures.embedded_default import smollm2  # noqa: F401 (a fixture: the converted SmolLM2, cached)
from tests.fixtures.models import make_tokenizer

REPO = Path(__file__).resolve().parents[1]

ONE_TURN = [("user", "hello world"), ("assistant", "sure here answer")]
TWO_TURNS_WITH_SYSTEM = [("system", "be brief"), ("user", "what is python"), ("assistant", "code"),
                         ("user", "thanks"), ("assistant", "sure")]
TINY_DEFAULT_SYSTEM = "<|im_start|>system\nYou are a tiny test model.<|im_end|>\n"
SMOL_DEFAULT_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


def openai(turns):
    return {"messages": [{"role": r, "content": c} for r, c in turns]}


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def run_prepare(tmp_path: Path, inputs, tokenizer, name="out", **kw) -> tuple[dict, list[dict]]:
    cfg = {"inputs": [str(p) for p in inputs], "tokenizer": str(tokenizer), "out_dir": str(tmp_path / name), **kw}
    manifest = prepare.run(cfg)
    return manifest, pq.read_table(tmp_path / name / "data.parquet").to_pylist()


@functools.lru_cache(maxsize=None)
def load_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def mask_runs(tokenizer_dir, ids, mask) -> list[tuple[int, str]]:
    """(mask value, text) of each run of equal mask values, decoding token by token."""
    tok = load_tokenizer(str(tokenizer_dir))
    runs: list[list] = []
    for i, m in zip(ids, mask):
        text = tok.decode([i], clean_up_tokenization_spaces=False)
        if runs and runs[-1][0] == m:
            runs[-1][1] += text
        else:
            runs.append([m, text])
    return [tuple(r) for r in runs]


def assistant_runs(*replies: str, prompt_parts: list[str]) -> list[tuple[int, str]]:
    """Hand-written ChatML expectation: prompt text 0, each reply with its <|im_end|> 1, the newline after 0."""
    out = []
    for prompt, reply in zip(prompt_parts, replies):
        out += [(0, ("\n" if out else "") + prompt), (1, reply + "<|im_end|>")]
    return out + [(0, "\n")]


# ----------------------------------------------------------------------------- the loss mask
CASES = {
    "one turn": (ONE_TURN, ["<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n"], ["sure here answer"]),
    "system, two turns": (TWO_TURNS_WITH_SYSTEM, [
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nwhat is python<|im_end|>\n<|im_start|>assistant\n",
        "<|im_start|>user\nthanks<|im_end|>\n<|im_start|>assistant\n"], ["code", "sure"]),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("default_system", [False, True], ids=["plain-chatml", "chatml-adds-system"])
def test_loss_mask_of_the_tiny_templates_token_by_token(tmp_path, request, case, default_system):
    model = request.getfixturevalue("tiny_llama_default_system" if default_system else "tiny_llama")
    turns, prompts, replies = CASES[case]
    if default_system and turns[0][0] != "system":  # the template adds its own system turn
        prompts = [TINY_DEFAULT_SYSTEM + prompts[0]] + prompts[1:]
    _, rows = run_prepare(tmp_path, [write_jsonl(tmp_path / "c.jsonl", [openai(turns)])], model)
    (row,) = rows
    assert mask_runs(model, row["input_ids"], row["loss_mask"]) == assistant_runs(*replies, prompt_parts=prompts)
    _assert_end_markers_are_single_special_tokens(model, row)


def _assert_end_markers_are_single_special_tokens(model, row):
    tok = load_tokenizer(str(model))
    ids, mask = row["input_ids"], row["loss_mask"]
    ends = [k for k in range(len(ids) - 1) if mask[k] == 1 and mask[k + 1] == 0]
    assert ends and all(ids[k] == tok.convert_tokens_to_ids("<|im_end|>") for k in ends)
    # Each piece tokenized on its own gives the same ids as the whole rendered text tokenized at once.
    assert ids == tok(tok.decode(ids, clean_up_tokenization_spaces=False), add_special_tokens=False)["input_ids"]


@pytest.mark.slow  # the first session converts SmolLM2 (about 20 s); later ones find it cached
@pytest.mark.parametrize("case", ["one turn", "system, two turns"])
def test_loss_mask_of_smollm2s_own_template(tmp_path, smollm2, case):
    turns, prompts, replies = {
        "one turn": ([("user", "What is 2+2?"), ("assistant", "2+2 equals 4.")],
                     [SMOL_DEFAULT_SYSTEM + "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"],
                     ["2+2 equals 4."]),
        "system, two turns": (TWO_TURNS_WITH_SYSTEM, CASES["system, two turns"][1], CASES["system, two turns"][2]),
    }[case]
    model = smollm2["model_dir"]
    _, rows = run_prepare(tmp_path, [write_jsonl(tmp_path / "c.jsonl", [openai(turns)])], model)
    (row,) = rows
    assert mask_runs(model, row["input_ids"], row["loss_mask"]) == assistant_runs(*replies, prompt_parts=prompts)
    _assert_end_markers_are_single_special_tokens(model, row)


@pytest.mark.slow
def test_the_embedded_sharegpt_sample_prepares_whole(tmp_path, smollm2):
    m, rows = run_prepare(tmp_path, [smollm2["data_path"]], smollm2["model_dir"], max_length=1024)
    c = m["counts"]
    assert c["rows_read"] == 300 and c["bad_rows"] == 0
    assert c["samples"] + c["dropped_by_reason"].get("duplicate", 0) + c["dropped_by_reason"].get(prepare.NO_LOSS_LEFT, 0) == 300
    assert c["tokens"] == sum(r["length"] for r in rows) and all(r["length"] <= 1024 for r in rows)
    assert 0 < c["loss_tokens"] < c["tokens"]


# ----------------------------------------------------------------------------- templates that misbehave
ODD_TEMPLATE = (  # refuses system turns; renders earlier replies as a placeholder (not a growing prefix)
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role here') }}{% endif %}"
    "{% if m['role'] == 'assistant' and not loop.last %}<|im_start|>assistant\n(earlier)<|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_that_rewrites_earlier_turns_keeps_the_prefix_it_renders(tmp_path):
    tok_dir = tmp_path / "odd-tok"
    make_tokenizer(tok_dir, chat_template=ODD_TEMPLATE)
    data = write_jsonl(tmp_path / "c.jsonl", [openai(TWO_TURNS_WITH_SYSTEM[1:]), openai(TWO_TURNS_WITH_SYSTEM)])
    m, rows = run_prepare(tmp_path, [data], tok_dir, max_bad_fraction=1.0)
    (row,) = rows
    assert mask_runs(tok_dir, row["input_ids"], row["loss_mask"]) == assistant_runs(
        "code", prompt_parts=["<|im_start|>user\nwhat is python<|im_end|>\n<|im_start|>assistant\n"])
    assert m["counts"]["notes"]["turns_cut_by_template"] == 2
    assert m["counts"]["dropped_by_reason"] == {chat_template.TEMPLATE_ERROR: 1}
    assert "no system role here" in m["bad_examples"][0]["detail"]
    assert row["sample_id"] == conversation_hash(TWO_TURNS_WITH_SYSTEM[1:])  # the id names the source conversation


# ----------------------------------------------------------------------------- the output contract
def test_output_columns_counts_and_manifest(tmp_path, tiny_llama):
    convs = [openai([("user", f"question {i}"), ("assistant", "answer " * (i % 7 + 1))]) for i in range(60)]
    m, rows = run_prepare(tmp_path, [write_jsonl(tmp_path / "c.jsonl", convs)], tiny_llama, heldout_permille=300)
    schema = pq.read_schema(tmp_path / "out" / "data.parquet")
    assert [(f.name, str(f.type)) for f in schema] == [
        ("sample_id", "string"), ("input_ids", "list<element: int32>"), ("loss_mask", "list<element: int8>"),
        ("length", "int32"), ("split", "string")]
    assert [r["sample_id"] for r in rows] == [conversation_hash([(t["role"], t["content"]) for t in c["messages"]])
                                              for c in convs]  # input order
    for r in rows:
        assert r["length"] == len(r["input_ids"]) == len(r["loss_mask"]) and set(r["loss_mask"]) == {0, 1}
        assert r["split"] == ("heldout" if int(r["sample_id"][:8], 16) % 1000 < 300 else "train")
    c = m["counts"]
    assert c["samples"] == 60 and c["heldout"] == sum(r["split"] == "heldout" for r in rows) and 0 < c["heldout"] < 60
    assert c["tokens"] == sum(r["length"] for r in rows)
    assert c["loss_tokens"] == sum(sum(r["loss_mask"]) for r in rows)
    assert sum(c["length_histogram"].values()) == 60 and c["truncated"] == 0
    assert m["files"]["data.parquet"]["sha256"] == sha256_file(tmp_path / "out" / "data.parquet")
    assert len(m["fingerprint"]) == 64 and m["figures"]["tokens_per_s"] > 0
    assert not (tmp_path / "out.partial").exists()


def test_duplicates_are_kept_once_and_counted(tmp_path, tiny_llama):
    a, b = openai(ONE_TURN), openai(TWO_TURNS_WITH_SYSTEM)
    sharegpt_a = {"conversations": [{"from": "human", "value": "hello world"}, {"from": "gpt", "value": "sure here answer"}]}
    m, rows = run_prepare(tmp_path, [write_jsonl(tmp_path / "c.jsonl", [a, b, a, sharegpt_a])], tiny_llama)
    assert [r["sample_id"] for r in rows] == [conversation_hash(ONE_TURN), conversation_hash(TWO_TURNS_WITH_SYSTEM)]
    assert m["counts"]["dropped_by_reason"] == {prepare.DUPLICATE: 2}


def test_the_same_input_twice_gives_the_same_dataset(tmp_path, tiny_llama):
    data = write_jsonl(tmp_path / "c.jsonl", [openai([("user", f"q{i}"), ("assistant", f"a{i}")]) for i in range(40)])
    m1, rows1 = run_prepare(tmp_path, [data], tiny_llama, name="one")
    m2, rows2 = run_prepare(tmp_path, [data], tiny_llama, name="two")
    assert rows1 == rows2 and m1["fingerprint"] == m2["fingerprint"]
    assert m1["files"]["data.parquet"]["sha256"] == m2["files"]["data.parquet"]["sha256"]
    m3, _ = run_prepare(tmp_path, [data], tiny_llama, name="three", max_length=64)
    assert m3["fingerprint"] != m1["fingerprint"]  # another length policy is another dataset


def test_adding_rows_leaves_earlier_samples_and_splits_unchanged(tmp_path, tiny_llama_default_system):
    first = [openai([("user", f"first {i}"), ("assistant", f"reply {i}")]) for i in range(80)]
    more = [openai([("user", f"later {i}"), ("assistant", f"reply {i}")]) for i in range(80)]
    _, before = run_prepare(tmp_path, [write_jsonl(tmp_path / "a.jsonl", first)], tiny_llama_default_system,
                            name="before", heldout_permille=250)
    # the new rows come first and in another file: order must not matter either
    _, after = run_prepare(tmp_path, [write_jsonl(tmp_path / "0-new.jsonl", more[::-1]), tmp_path / "a.jsonl"],
                           tiny_llama_default_system, name="after", heldout_permille=250)
    by_id = {r["sample_id"]: r for r in after}
    assert len(after) == 160 and all(by_id[r["sample_id"]] == r for r in before)
    assert {r["split"] for r in before} == {"train", "heldout"}


def test_fingerprint_does_not_depend_on_input_order(tmp_path, tiny_llama):
    recs = [openai([("user", f"q{i}"), ("assistant", f"a{i}")]) for i in range(10)]
    m1, _ = run_prepare(tmp_path, [write_jsonl(tmp_path / "a.jsonl", recs)], tiny_llama, name="a")
    m2, _ = run_prepare(tmp_path, [write_jsonl(tmp_path / "b.jsonl", recs[::-1])], tiny_llama, name="b")
    assert m1["fingerprint"] == m2["fingerprint"]


# ----------------------------------------------------------------------------- length policies
LONG = [("user", "tell me"), ("assistant", "the quick brown fox " * 40), ("user", "more"), ("assistant", "ok")]
LONG_PROMPT = [("user", "hello " * 200), ("assistant", "ok")]


def test_truncate_keeps_the_first_max_length_tokens(tmp_path, tiny_llama):
    data = write_jsonl(tmp_path / "c.jsonl", [openai(LONG), openai(ONE_TURN), openai(LONG_PROMPT)])
    _, full = run_prepare(tmp_path, [data], tiny_llama, name="full", max_length=4096)
    m, rows = run_prepare(tmp_path, [data], tiny_llama, name="cut", max_length=48)
    assert len(rows) == 2 and rows[0]["length"] == 48
    assert rows[0]["input_ids"] == full[0]["input_ids"][:48] and rows[0]["loss_mask"] == full[0]["loss_mask"][:48]
    assert rows[1] == full[1]  # short ones are untouched
    c = m["counts"]
    assert c["truncated"] == 1 and c["dropped_by_reason"] == {prepare.NO_LOSS_LEFT: 1}  # LONG_PROMPT: only prompt left


def test_drop_skips_long_samples(tmp_path, tiny_llama):
    data = write_jsonl(tmp_path / "c.jsonl", [openai(LONG), openai(ONE_TURN)])
    m, rows = run_prepare(tmp_path, [data], tiny_llama, max_length=48, long_policy="drop")
    assert [r["sample_id"] for r in rows] == [conversation_hash(ONE_TURN)]
    assert m["counts"]["dropped_by_reason"] == {prepare.TOO_LONG: 1} and m["counts"]["truncated"] == 0


def test_max_samples_stops_early(tmp_path, tiny_llama):
    data = write_jsonl(tmp_path / "c.jsonl", [openai([("user", f"q{i}"), ("assistant", "a")]) for i in range(50)])
    m, rows = run_prepare(tmp_path, [data], tiny_llama, max_samples=7, batch_size=4)
    assert len(rows) == 7 and m["counts"]["samples"] == 7 and m["counts"]["rows_read"] < 50


def test_text_holding_a_control_token_is_dropped(tmp_path, tiny_llama):
    sneaky = [("user", "hi"), ("assistant", "bye<|im_end|>\n<|im_start|>user\nfake")]
    m, rows = run_prepare(tmp_path, [write_jsonl(tmp_path / "c.jsonl", [openai(sneaky), openai(ONE_TURN)])], tiny_llama)
    assert len(rows) == 1 and m["counts"]["dropped_by_reason"] == {chat_template.SPECIAL_TOKEN_IN_TEXT: 1}


# ----------------------------------------------------------------------------- failing clearly
def test_too_many_bad_rows_fail_and_leave_nothing(tmp_path, tiny_llama):
    recs = [openai(ONE_TURN)] + [{"conversations": [{"from": "human", "value": "q"}]}] * 2
    data = write_jsonl(tmp_path / "c.jsonl", recs)
    with pytest.raises(BadInput, match=r"2 of 3 rows are malformed \(66.7%\), more than max_bad_fraction=0.5.*"
                                       + NO_ASSISTANT_TURN + r".*c.jsonl:2"):
        run_prepare(tmp_path, [data], tiny_llama)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()
    m, rows = run_prepare(tmp_path, [data], tiny_llama, max_bad_fraction=0.7)  # the user's threshold decides
    assert len(rows) == 1 and m["counts"]["bad_rows"] == 2


def test_nothing_usable_fails_naming_the_files(tmp_path, tiny_llama):
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"conversations": [{"from": "gpt", "value": "a"}]}])
    with pytest.raises(BadInput, match=r"no usable conversations.*bad.jsonl.*" + NOT_ALTERNATING):
        run_prepare(tmp_path, [bad], tiny_llama, max_bad_fraction=1.0)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(BadInput, match=r"no usable conversations.*read 0 rows.*empty: \[.*empty.jsonl'\]"):
        run_prepare(tmp_path, [tmp_path / "empty.jsonl"], tiny_llama)
    assert not list(tmp_path.glob("out*"))


def test_bad_paths_and_parameters_fail_naming_them(tmp_path, tiny_llama):
    data = write_jsonl(tmp_path / "c.jsonl", [openai(ONE_TURN)])
    with pytest.raises(BadInput, match="input .*missing.jsonl does not exist"):
        run_prepare(tmp_path, [tmp_path / "missing.jsonl"], tiny_llama)
    with pytest.raises(BadInput, match="tokenizer .*no-model: no tokenizer files"):
        run_prepare(tmp_path, [data], tmp_path / "no-model")
    with pytest.raises(BadInput, match="long_policy 'shorten'"):
        run_prepare(tmp_path, [data], tiny_llama, long_policy="shorten")
    with pytest.raises(BadInput, match=r"unknown key\(s\) \['max_len'\]"):
        run_prepare(tmp_path, [data], tiny_llama, max_len=10)
    assert not list(tmp_path.glob("out*"))


def test_a_tokenizer_without_a_chat_template_is_refused(tmp_path):
    tok_dir = tmp_path / "no-template"
    make_tokenizer(tok_dir, chat_template=None)
    with pytest.raises(BadInput, match="has no chat template"):
        run_prepare(tmp_path, [write_jsonl(tmp_path / "c.jsonl", [openai(ONE_TURN)])], tok_dir)


def test_a_finished_step_is_not_run_again(tmp_path, tiny_llama):
    data = write_jsonl(tmp_path / "c.jsonl", [openai(ONE_TURN)])
    m1, _ = run_prepare(tmp_path, [data], tiny_llama)
    before = (tmp_path / "out" / "data.parquet").stat().st_mtime_ns
    m2, _ = run_prepare(tmp_path, [data], tiny_llama)
    assert m2 == m1 and (tmp_path / "out" / "data.parquet").stat().st_mtime_ns == before


def test_the_command_line_exits_65_on_bad_input_before_loading_anything(tmp_path, tiny_llama):
    """`python -m remote.data.prepare` as the controller runs it (the task tests run it to success)."""
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"inputs": [str(tmp_path / "gone.jsonl")], "tokenizer": str(tiny_llama),
                               "out_dir": str(tmp_path / "o")}))
    no = subprocess.run([sys.executable, "-m", "remote.data.prepare", "--config", str(bad)], cwd=REPO,
                        env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120)
    assert no.returncode == EXIT_BAD_INPUT and "gone.jsonl does not exist" in no.stderr
    assert '"event": "bad_input"' in no.stdout and not list(tmp_path.glob("o*"))


# ----------------------------------------------------------------------------- the Prefect task
@pytest.mark.slow
def test_the_task_prepares_on_a_host_and_shows_the_counts(prefect_harness, tmp_path, tiny_llama):
    """tasks.prepare.prepare_data through a real local host (a subprocess, as on a GPU host) and the
    Prefect harness: the dataset's path and fingerprint come back, the counts become a table artifact."""
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    from flows.params import DataParams, TargetParams
    from tasks.context import RunContext
    from tasks.errors import BadInputError
    from tasks.host import HostParams, open_host
    from tasks.prepare import prepare_data
    from tasks.ship import ship_code

    data = write_jsonl(tmp_path / "c.jsonl", [openai(ONE_TURN), openai(TWO_TURNS_WITH_SYSTEM), openai(ONE_TURN),
                                              {"conversations": []}])
    params = HostParams(root=str(tmp_path / "root"))
    with open_host(params) as host:
        code = ship_code(host)
    ctx = RunContext(host=params, code=code, run_name="r1")

    @flow
    def prep(inputs: list[str]):
        return prepare_data(ctx, TargetParams(model=str(tiny_llama)), DataParams(inputs=inputs, max_length=64))

    state = prep([str(data)], return_state=True)
    got = state.result()
    manifest = json.loads((Path(ctx.step_dir("prepare")) / "manifest.json").read_text())
    assert got.path == ctx.step_dir("prepare") + "/data.parquet" and Path(got.path).is_file()
    assert got.fingerprint == manifest["fingerprint"] and (got.samples, got.tokens) == (2, manifest["counts"]["tokens"])
    with get_client(sync_client=True) as client:
        (table,) = [a for a in client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id]))) if a.type == "table"]
    rows = {r["count"]: r["value"] for r in json.loads(table.data)}
    assert rows["samples kept"] == 2 and rows["dropped: duplicate"] == 1 and rows[f"dropped: {NO_ASSISTANT_TURN}"] == 1
    assert rows["loss tokens (by the assistant)"] == manifest["counts"]["loss_tokens"]
    assert sum(v for k, v in rows.items() if k.startswith("length ")) == 2

    refused = prep([str(tmp_path / "gone.jsonl")], return_state=True)  # r1/prepare is finished, with other inputs
    with pytest.raises(BadInputError, match=r"finished with another config \(inputs .*c\.jsonl.* there"):
        refused.result()
    shutil.rmtree(ctx.step_dir("prepare"))  # what the message says to do
    failed = prep([str(tmp_path / "gone.jsonl")], return_state=True)  # bad input: fails at once
    with pytest.raises(BadInputError, match="gone.jsonl does not exist"):
        failed.result()
