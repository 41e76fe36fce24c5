"""Step: the target writes the assistant turns itself, so the draft learns the target's own words.

    python -m remote.data.regenerate --config c.json
    # {"inputs": ["/data/chats/"], "target": "/models/Kimi-K2.5", "out_dir": "<run>/regenerate",
    #  "cache_root": "<root>/cache", "tensor_parallel_size": 8, "temperature": 0.6, "top_p": 0.95}

Where it sits: before `prepare`. It reads the same conversations prepare would read
(remote.data.chat_data: the same formats and sample hashes; the same prompts answered once), keeps their
system and user turns, and has the target answer them with its own chat template: turn by turn, each
later user turn seeing the target's own earlier answers (`turns="last"`: the original conversation up
to its last user turn, and only that answered). It writes `conversations.jsonl`, OpenAI `messages`
records, which the prepare step then renders and masks as usual, so the loss mask covers what the
target wrote: its text and its end-of-turn token (the tests check this token for token). Each record
also names its `split`, the split prepare gives the original conversation: the held-out prompts stay
held out, and they are answered greedily (one answer), so offline acceptance on them is what vLLM
counts when it serves greedy requests. The flow (tasks/regenerate.py) points prepare at that file.
With turns="last" the earlier assistant turns stay the data's own, and prepare masks them as well.

Reasoning targets (`thinking`): "keep" keeps the thinking block as the target wrote it, "drop" keeps
only what follows `</think>` (an answer whose thinking never closed is left out), "disable" renders
the generation prompt with `enable_thinking=False` (only for a template that has that switch; the
prompt prepare renders afterwards does not carry the switch's marker).

Unusable answers are counted by reason and left out (the conversation keeps the turns before them):
empty, cut at max_tokens (kept when `keep_cut`), holding a control token of the tokenizer, thinking
not closed, refused by the chat template; a conversation whose next prompt would not fit the
engine's context ends there (`context_full`).

Like the capture: the answers live in a cache, `<cache_root>/regenerate/<target key>/`, one JSONL
shard per `samples_per_shard` prompts, each written whole (a temporary name, then a rename); a prompt
is keyed by its turns and the sampling it got (temperature, top_p, max_tokens, seed, n, thinking,
keep_cut), so a re-run or the nightly run generates only new prompts and a killed run resumes at the
first missing shard. Every request has its own seed (from `seed` and the prompt), so an answer does
not depend on what it was batched with, nor on a resume. Memory holds one shard of conversations.

Backends (remote.data.regenerate_engines): "vllm" (tensor parallel; the engine's life is remote.engine's)
and "transformers" (one device, for hosts without vLLM; batched `generate`, so a seed is per batch).
Bad input fails before the engine starts: a target without a chat template or without an end-of-turn
token, sampling parameters out of range, a first prompt longer than the engine's context.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Iterator

from remote.data.chat_data import BadRecord, Conversation, ReadReport, input_files, read_conversations
from remote.data.config import RegenerateConfig, RegenerateOptions
from remote.data.regenerate_engines import Answer, Request
from remote.step import BadInput, begin_step, emit, log, progress, step_main
from remote.target import read_config, text_settings

STEP = "regenerate"
OUTPUT = "conversations.jsonl"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# Why an answer was left out (the keys of the manifest's counts["unusable"]).
EMPTY, CUT, SPECIAL, NOT_CLOSED, TEMPLATE = ("empty", "cut_at_max_tokens", "special_token_in_answer",
                                             "thinking_not_closed", "template_error")
CONTEXT_FULL = "context_full"  # no answer: the next prompt would not fit the engine's context
SAME_PROMPT = "same_prompt_as_an_earlier_conversation"  # a note: answered once
SAMPLE_ANSWERS = 3  # answers shown in the manifest (the flow's artifact)


class Writer:
    """The target's tokenizer and template as the regeneration needs them: prompts in, text out."""

    def __init__(self, cfg: RegenerateConfig):
        from remote.data.chat_template import ChatTokenizer

        self.chat = ChatTokenizer(cfg.target, cfg.trust_remote_code)  # BadInput: no tokenizer, no template
        self.tok = self.chat.tok
        self.end_ids = end_of_turn_ids(cfg.target, self.tok)
        self.template_kwargs = {"enable_thinking": False} if cfg.thinking == "disable" else {}
        if cfg.thinking == "disable" and "enable_thinking" not in str(self.tok.chat_template):
            raise BadInput(f"thinking='disable': the chat template of {cfg.target} has no enable_thinking "
                           "switch; choose thinking='keep' or 'drop'")

    def prompt(self, turns: list[tuple[str, str]]) -> list[int]:
        """The generation prompt of a conversation, as vLLM's chat entry point would tokenize it."""
        from jinja2 import TemplateError

        msgs = [{"role": r, "content": c} for r, c in turns]
        try:
            return list(self.tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True,
                                                     return_dict=False, **self.template_kwargs))
        except TemplateError as e:
            raise BadRecord(TEMPLATE, f"the chat template refused it: {e}") from e

    def content(self, answer: Answer, thinking: str, keep_cut: bool) -> str:
        """The answer as the next turn's (and prepare's) assistant content; BadRecord when unusable."""
        ids = answer.token_ids[:-1] if answer.stopped else answer.token_ids
        if not answer.stopped and not keep_cut:
            raise BadRecord(CUT, f"cut at max_tokens ({len(ids)} tokens)")
        if any(i in self.chat.special_ids for i in ids):
            raise BadRecord(SPECIAL, "the answer holds a control token of the tokenizer")
        text = self.tok.decode(ids, skip_special_tokens=False)
        if thinking == "drop" and (THINK_OPEN in text or THINK_CLOSE in text):
            if THINK_CLOSE not in text:
                raise BadRecord(NOT_CLOSED, "the thinking block never closed")
            text = text.rsplit(THINK_CLOSE, 1)[1].lstrip()
        if not text.strip():
            raise BadRecord(EMPTY, "the answer is empty")
        return text


def end_of_turn_ids(target: str, tok) -> tuple[int, ...]:
    """The tokens a generation stops at: the generation config's eos ids and the tokenizer's eos.
    BadInput when there is none, or when the template never writes one after an assistant turn."""
    ids = set()
    gen = Path(target, "generation_config.json")
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else [])
    if tok.eos_token_id is not None:
        ids.add(tok.eos_token_id)
    if not ids:
        raise BadInput(f"target {target}: no end-of-turn token (no eos_token in its tokenizer, no eos_token_id in "
                       "generation_config.json): a generation would never stop")
    msgs = [{"role": "user", "content": "ping"}, {"role": "assistant", "content": "pong"}]
    rendered = tok.apply_chat_template(msgs, tokenize=False)
    after = rendered[rendered.rfind("pong") + 4:]
    if not any(tok.decode([i]) in after for i in ids):
        raise BadInput(f"target {target}: the chat template ends an assistant turn with {after!r}, which holds none "
                       f"of the end-of-turn tokens {sorted(tok.decode([i]) for i in ids)}")
    return tuple(sorted(ids))


def make_generator(cfg: RegenerateConfig, writer: Writer):
    """The configured backend, not started: `start()`, `generate(requests, options) -> answers`, `close()`."""
    from remote.capture.layers import TargetConfig, resolve_dtype
    from remote.data.regenerate_engines import HfGenerator, VllmGenerator

    target = TargetConfig.read(cfg.target)
    engine = VllmGenerator if cfg.backend == "vllm" else HfGenerator
    return engine(cfg, target, resolve_dtype(cfg, target), writer.end_ids, context_length(cfg))


# ----------------------------------------------------------------------------- prompts and their keys
@dataclass(frozen=True)
class Prompt:
    """One conversation to answer: what the target is shown as is, the user turns it answers, its split."""

    source_id: str  # the original conversation's sample id (remote.data.chat_data.conversation_hash)
    split: str  # the original's split: held-out prompts are answered greedily, once
    context: tuple[tuple[str, str], ...]  # the system turn; with turns="last" every turn before the last user one
    users: tuple[str, ...]  # the user turns the target answers, in order
    key: str  # the cache key: the prompt and the sampling it gets


def sampling_signature(cfg: RegenerateOptions, split: str) -> dict:
    """What changes an answer besides the prompt (and the target): part of every prompt's cache key."""
    greedy = split == "heldout"
    return {"temperature": 0.0 if greedy else cfg.temperature, "top_p": 1.0 if greedy else cfg.top_p,
            "max_tokens": cfg.max_tokens, "seed": cfg.seed, "n": 1 if greedy else cfg.n,
            "thinking": cfg.thinking, "keep_cut": cfg.keep_cut}


def prompts(cfg: RegenerateConfig, report: ReadReport) -> Iterator[Prompt]:
    """The conversations to answer, in input order, once each (the first max_samples of them)."""
    from remote.split import split_of

    seen: set[str] = set()
    for conv in read_conversations(cfg.inputs, report):
        sid = conv.sample_id
        context, users = split_turns(conv, cfg.turns)
        split = conv.split or split_of(sid, cfg.heldout_permille)
        body = json.dumps([context, users, sampling_signature(cfg, split)], ensure_ascii=False, separators=(",", ":"))
        key = hashlib.sha256(body.encode()).hexdigest()
        if key in seen:  # the same conversation, or the same prompts with other answers: one set of answers
            report.notes[SAME_PROMPT] += 1
            continue
        seen.add(key)
        yield Prompt(sid, split, context, users, key)
        if cfg.max_samples is not None and len(seen) >= cfg.max_samples:
            return


def split_turns(conv: Conversation, turns: str) -> tuple[tuple[tuple[str, str], ...], tuple[str, ...]]:
    """(context, user turns to answer): "all" keeps the system turn and answers every user turn;
    "last" keeps the conversation up to its last user turn (a conversation ends with an answer)."""
    if turns == "last":
        return conv.turns[:-2], (conv.turns[-2][1],)
    return (tuple(t for t in conv.turns if t[0] == "system"),
            tuple(c for r, c in conv.turns if r == "user"))


def request_seed(base: int, key: str, branch: int, turn: int) -> int:
    """A request's own seed: the same answer whatever it is batched with, and after a resume."""
    return int(hashlib.sha256(f"{base}:{key}:{branch}:{turn}".encode()).hexdigest()[:8], 16)


# ----------------------------------------------------------------------------- the cache
class AnswerCache:
    """`<cache_root>/regenerate/<key>/`: JSONL shards, each a header line with the prompt keys it holds,
    then one line a prompt: {"key", "source_id", "split", "branches": [{"turns", "answered", "left_out"}]}."""

    def __init__(self, folder: Path):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.where: dict[str, Path] = {}  # prompt key -> its shard (keys only: answers stay on disk)
        for tmp in folder.glob(".shard-*.jsonl.tmp-*"):  # a shard a killed writer left half-written
            if not _alive(int(tmp.name.rpartition("-")[2])):
                tmp.unlink(missing_ok=True)
        for shard in sorted(folder.glob("shard-*.jsonl")):
            with open(shard, encoding="utf-8") as f:
                for key in json.loads(f.readline())["keys"]:
                    self.where[key] = shard

    @staticmethod
    def folder_of(cfg: RegenerateConfig) -> tuple[Path, dict]:
        """The cache folder of a target (its path and revision label), and what names it."""
        material = {"target": str(Path(cfg.target).resolve()), "revision": cfg.target_revision}
        key = hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:24]
        return Path(cfg.cache_root) / "regenerate" / key, material

    def add(self, rows: list[dict]) -> Path:
        """Write one shard whole (a temporary name, then a rename): a kill leaves it absent, never half."""
        keys = [r["key"] for r in rows]
        name = f"shard-{hashlib.sha256(''.join(keys).encode()).hexdigest()[:16]}.jsonl"
        path, tmp = self.folder / name, self.folder / f".{name}.tmp-{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps({"keys": keys}) + "\n")
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        self.where.update(dict.fromkeys(keys, path))
        return path

    def rows(self, keys: list[str]) -> Iterator[dict]:
        """The cached rows of these keys, one shard read at a time, the shards in the keys' order."""
        wanted = set(keys)
        for shard in dict.fromkeys(self.where[k] for k in keys):
            with open(shard, encoding="utf-8") as f:
                f.readline()
                for line in f:
                    if (row := json.loads(line))["key"] in wanted:
                        yield row


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


# ----------------------------------------------------------------------------- answering, turn by turn
@dataclass
class Tally:
    requests: int = 0  # answers the engine generated in this run
    generated_tokens: int = 0
    seconds: float = 0.0  # spent in the engine


class _Branch:
    """One line of answers to a prompt: the history so far, and why it ended early if it did."""

    def __init__(self, prompt: Prompt, index: int):
        self.prompt, self.index = prompt, index
        self.history = list(prompt.context)
        self.answered = 0
        self.left_out: str | None = None

    def wants_answer(self) -> bool:
        return self.left_out is None and self.answered < len(self.prompt.users)

    def asking(self) -> list[tuple[str, str]]:
        return self.history + [("user", self.prompt.users[self.answered])]

    def row(self) -> dict:
        return {"turns": [list(t) for t in self.history], "answered": self.answered, "left_out": self.left_out}


def answer_shard(shard: list[Prompt], cfg: RegenerateConfig, writer: Writer, engine, max_model_len: int,
                 tally: Tally) -> list[dict]:
    """Every prompt of a shard answered turn by turn: each round asks every branch's next user turn at once."""
    branches = [_Branch(p, b) for p in shard for b in range(1 if p.split == "heldout" else cfg.n)]
    while active := [b for b in branches if b.wants_answer()]:
        asked = []
        for b in active:
            try:
                ids = writer.prompt(b.asking())
            except BadRecord as e:
                b.left_out = e.reason
                continue
            if len(ids) + 1 > max_model_len:
                b.left_out = CONTEXT_FULL
                continue
            greedy = b.prompt.split == "heldout" or cfg.temperature == 0
            asked.append((b, Request(ids, request_seed(cfg.seed, b.prompt.key, b.index, b.answered), greedy)))
        t0 = time.monotonic()
        answers = engine.generate([r for _, r in asked], cfg) if asked else []
        tally.seconds += time.monotonic() - t0
        tally.requests += len(answers)
        tally.generated_tokens += sum(len(a.token_ids) for a in answers)
        for (b, _), a in zip(asked, answers):
            try:
                text = writer.content(a, cfg.thinking, cfg.keep_cut)
            except BadRecord as e:
                b.left_out = e.reason
                continue
            b.history = b.asking() + [("assistant", text)]
            b.answered += 1
    by_prompt: dict[str, list[dict]] = {}
    for b in branches:
        by_prompt.setdefault(b.prompt.key, []).append(b.row())
    return [{"key": p.key, "source_id": p.source_id, "split": p.split, "branches": by_prompt[p.key]} for p in shard]


# ----------------------------------------------------------------------------- the step
def context_length(cfg: RegenerateConfig) -> int:
    """The engine's context: max_model_len, or the target's max_position_embeddings."""
    if cfg.max_model_len:
        return cfg.max_model_len
    context = text_settings(read_config(cfg.target)).get("max_position_embeddings")
    if isinstance(context, int):
        return context
    raise BadInput(f"target {cfg.target}: config.json has no max_position_embeddings; set max_model_len")


def plan(cfg: RegenerateConfig, writer: Writer, cache: AnswerCache,
         max_model_len: int) -> tuple[list[Prompt], int, ReadReport]:
    """(this run's prompts, how many the cache lacks, what reading found). Every first prompt the cache
    lacks is rendered now, so one longer than the engine's context fails before the engine starts."""
    report, todo, out = ReadReport(), 0, []
    for p in prompts(cfg, report):
        out.append(dataclasses.replace(p, context=(), users=()))  # keys and splits only: memory stays small
        if p.key in cache.where:
            continue
        todo += 1
        try:
            first = len(writer.prompt(list(p.context) + [("user", p.users[0])]))
        except BadRecord:
            continue  # the template refuses it: counted as such when it is answered
        if first + 1 > max_model_len:
            raise BadInput(f"conversation {p.source_id[:12]}: its first prompt has {first} tokens, the engine's context "
                           f"is {max_model_len} (max_model_len): raise max_model_len or leave the conversation out")
    if not out:
        raise BadInput(f"no usable conversations in {list(cfg.inputs)}: read {report.rows} rows, dropped {dict(report.bad)}")
    return out, todo, report


def todo_shards(cfg: RegenerateConfig, cache: AnswerCache) -> Iterator[list[Prompt]]:
    """The prompts the cache lacks, read again from the inputs, samples_per_shard at a time."""
    missing = (p for p in prompts(cfg, ReadReport()) if p.key not in cache.where)
    while shard := list(islice(missing, cfg.samples_per_shard)):
        yield shard


def run(raw: dict, engine=None) -> dict:
    """The step. `engine`: a started generator to use (tests and the benchmark share one); None:
    start the configured backend when there is something to generate, and end it when done."""
    started = time.monotonic()
    # another config's finished folder is made again: the answers are cached by their sampling settings
    cfg, out, done = begin_step(RegenerateConfig, raw, STEP, lambda m: f"{m['counts']['conversations']} conversations",
                                on_change="redo")
    if done is not None:
        return done
    input_files(cfg.inputs, ReadReport())  # a missing input fails now, before the tokenizer loads
    writer = Writer(cfg)
    max_model_len = context_length(cfg)
    folder, material = AnswerCache.folder_of(cfg)
    cache = AnswerCache(folder)
    order, todo, report = plan(cfg, writer, cache, max_model_len)
    log(f"regenerate: {len(order)} conversations, {len(order) - todo} answered before in {folder}, {todo} to answer")
    tally = Tally()
    if todo:
        _generate(cfg, writer, cache, max_model_len, tally, todo, engine)
    staging = out.open()
    counts, samples = write_conversations(cache, order, staging / OUTPUT)
    figures = {"seconds": round(time.monotonic() - started, 2), "generate_seconds": round(tally.seconds, 2),
               "generated_tokens": tally.generated_tokens,
               "tokens_per_s": round(tally.generated_tokens / tally.seconds, 1) if tally.seconds else None}
    counts |= {"prompts": len(order), "cached": len(order) - todo, "answered_now": todo, "requests": tally.requests,
               "rows_read": report.rows, "bad_rows": dict(report.bad), "notes": dict(report.notes)}
    manifest = out.publish(counts=counts, figures=figures, conversations=OUTPUT, sample_answers=samples,
                           cache={"folder": str(folder), **material}, end_of_turn_ids=list(writer.end_ids))
    emit("figures", **figures)
    log(f"regenerate: {counts['conversations']} conversations written, left out {counts['unusable'] or 'none'}")
    return manifest


def _generate(cfg, writer, cache, max_model_len, tally, todo, engine) -> None:
    own = engine is None
    if own:
        engine = make_generator(cfg, writer)
    try:
        if own:
            engine.start()
        done = 0
        for shard in todo_shards(cfg, cache):
            cache.add(answer_shard(shard, cfg, writer, engine, max_model_len, tally))
            done += len(shard)
            progress(done, todo, unit="prompts", requests=tally.requests, generated_tokens=tally.generated_tokens)
    finally:
        if own:
            engine.close()


def write_conversations(cache: AnswerCache, order: list[Prompt], path: Path) -> tuple[dict, list[dict]]:
    """conversations.jsonl from the cache (one record a usable branch), the counts, a few sample answers."""
    unusable, counts, samples = Counter(), Counter(), []
    this_run = {p.key: p for p in order}  # a cached answer may have served another conversation or split
    with open(path, "w", encoding="utf-8") as f:
        for row in cache.rows(list(this_run)):
            split, source_id = this_run[row["key"]].split, this_run[row["key"]].source_id
            for b in row["branches"]:
                if b["left_out"]:
                    unusable[b["left_out"]] += 1
                if not b["answered"]:
                    continue
                msgs = [{"role": r, "content": c} for r, c in b["turns"]]
                f.write(json.dumps({"messages": msgs, "split": split, "source_id": source_id},
                                   ensure_ascii=False) + "\n")
                counts["conversations"] += 1
                counts["answers"] += b["answered"]
                counts[split] += 1
                if len(samples) < SAMPLE_ANSWERS:
                    samples.append({"source_id": source_id, "user": b["turns"][-2][1][:300],
                                    "answer": b["turns"][-1][1][:600]})
    if not counts["conversations"]:
        raise BadInput(f"the target's answers were all unusable: {dict(unusable)}; see max_tokens, keep_cut, thinking")
    return {"conversations": counts["conversations"], "answers": counts["answers"], "train": counts["train"],
            "heldout": counts["heldout"], "unusable": dict(sorted(unusable.items()))}, samples


def main(argv: list[str] | None = None) -> int:
    return step_main(STEP, run, argv)


if __name__ == "__main__":  # the guard vLLM needs: its workers are spawned processes
    sys.exit(main())
