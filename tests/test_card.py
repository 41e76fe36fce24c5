"""The draft card's measured part (remote/evaluate/card.py) and the rewrite of one published file
(remote.step.replace_published_file), on real step folders. The evaluate step writing it for a trained draft is
tests/test_evaluate.py's (and test_bench_online.py's, with the benchmark sets)."""
import json

import pytest

from remote.evaluate.card import MARK, card_text, measured_markdown, write_card
from remote.step import BadInput, StepOutput, read_manifest, replace_published_file, verify_outputs

RESULT = {"provenance": {"kind": "dflash", "method": "dflash", "target": "/models/t", "data_fingerprint": "ab" * 32,
                         "train_figures": {"steps": 40, "train_seconds": 12.5, "tokens_per_s": 5000.0},
                         "train_counts": {"tokens": 62500, "train_samples": 300}},
          "offline": {"acceptance_length": 1.8, "replayed_acceptance_length": 1.7, "k": 3, "tokens": 4096,
                      "part": "test"}}


def _published(tmp_path, text="# d: a draft\n"):
    out = StepOutput(tmp_path / "export", "export", {})
    (out.open() / "README.md").write_text(text)
    (out.staging / "config.json").write_text("{}")
    out.publish()
    return out


def test_the_measured_part_names_the_kind_target_budget_and_figures():
    capture_m = {"config": {"target_revision": ""}, "capture": {"cache_key": "0123456789abcdef0123"}}
    md = measured_markdown(RESULT, {}, "NVIDIA H100", capture_m)
    assert md.startswith(MARK) and "on NVIDIA H100)" in md
    assert "| kind | dflash (vLLM method `dflash`) |" in md
    assert "capture cache key `0123456789abcdef`" in md
    assert "| budget | 62,500 tokens seen, 40 steps, 12 s of training (5,000 tokens/s) |" in md
    assert "offline 1.80 at k = 3 (replayed 1.70) over 4,096 tokens" in md and "online" not in md
    assert "## Serving" not in md and "Benchmarks" not in md  # none measured: no empty sections
    labelled = measured_markdown(RESULT, {}, "cpu", {"config": {"target_revision": "v2"}, "capture": {}})
    assert "revision `v2`" in labelled


def test_a_second_evaluation_replaces_the_first_ones_part():
    card = "# d: a draft\n\n## Serving\n"
    once = card_text(card, measured_markdown(RESULT, {}, "cpu"))
    again = card_text(once, measured_markdown({**RESULT, "offline": {**RESULT["offline"], "acceptance_length": 2.4}},
                                              {}, "cpu"))
    assert again.count(MARK) == 1 and again.startswith(card.rstrip("\n")) and "offline 2.40" in again
    assert "offline 1.80" not in again


def test_the_card_is_rewritten_with_its_manifest_entry(tmp_path):
    out = _published(tmp_path)
    assert write_card(str(out.final), measured_markdown(RESULT, {}, "cpu"))
    m = read_manifest(out.final)
    assert MARK in (out.final / "README.md").read_text()
    assert verify_outputs(out.final, m, deep=True) == [] and out.done() is not None
    assert not [p for p in out.final.iterdir() if p.name.startswith(".")]  # no temporary left


def test_a_kill_between_the_file_and_its_manifest_entry_leaves_a_folder_that_does_not_check_out(tmp_path):
    out = _published(tmp_path)
    (out.final / "README.md").write_text("# d: a draft\n" + MARK + "\nhalf")  # the file renamed, the manifest not yet
    assert out.done() is None  # so the export step runs again rather than a stale card passing as finished


def test_a_folder_eaglet_did_not_export_is_left_alone(tmp_path):
    (tmp_path / "README.md").write_text("theirs")
    (tmp_path / "config.json").write_text(json.dumps({}))
    assert not write_card(str(tmp_path), measured_markdown(RESULT, {}, "cpu"))
    assert (tmp_path / "README.md").read_text() == "theirs"
    with pytest.raises(BadInput, match="not a finished step folder"):
        replace_published_file(tmp_path, "README.md", "x")
