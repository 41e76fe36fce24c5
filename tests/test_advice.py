"""Serving advice (remote/evaluate/advice.py): the k that maximises the expected speed-up, from the offline
acceptance at each k and the served k's online speed-up; the lines that serve it.

    .venv/bin/python -m pytest tests/test_advice.py -q
"""
import json

import pytest

from remote.evaluate.advice import advice_text, advise


def _run(by_k, e0, s0, k0=3):
    offline = {"acceptance_length_by_k": by_k}
    online = {"num_speculative_tokens": k0, "max_num_seqs": 16,
              "arms": {"eagle3": {"greedy": {"acceptance_length": e0, "speedup": s0}}}}
    return advise(offline, online, "eagle3", "/models/t", "/runs/r/export")


def test_the_advice_weighs_acceptance_against_the_draft_steps_cost():
    by_k = [1.0, 1.6, 2.0, 2.2, 2.3, 2.35, 2.37, 2.38]  # offline E(0..7)
    cheap = _run(by_k, e0=2.2, s0=2.2 / 1.15)  # c = 0.05: a draft token costs 5% of a target step (a GPU host)
    assert cheap["draft_step_cost"] == pytest.approx(0.05) and cheap["offline_to_online"] == pytest.approx(1.0)
    speedups = {int(k): v for k, v in cheap["speedup_by_k"].items()}
    assert speedups[3] == pytest.approx(2.2 / 1.15) and cheap["k"] == max(speedups, key=speedups.get) == 4
    dear = _run(by_k, e0=2.2, s0=2.2 / 1.9)  # c = 0.3 (a CPU host): fewer tokens pay
    assert dear["k"] == 2 and dear["speedup"] == pytest.approx(2.0 / 1.6) and dear["worth_it"]
    useless = _run([1.0, 1.1, 1.15, 1.17], e0=1.17, s0=0.7)
    assert useless["k"] == 1 and not useless["worth_it"] and "serve the target alone here" in advice_text(useless)
    cfg = json.loads(dear["vllm"].split("--speculative-config ", 1)[1].strip("'"))
    assert cfg == {"method": "eagle3", "model": "/runs/r/export", "num_speculative_tokens": 2}
    assert dear["vllm"].startswith("vllm serve /models/t ")
    assert "--speculative-num-steps 2 --speculative-eagle-topk 1 --speculative-num-draft-tokens 3" in dear["sglang"]


def test_the_offline_curve_is_scaled_to_the_online_figure_at_the_served_k():
    a = _run([1.0, 1.5, 1.8, 2.0, 2.1], e0=1.9, s0=1.9 / 1.3)  # online at k = 3 reads 0.9 where offline read 1.0
    assert a["offline_to_online"] == pytest.approx(0.9)
    assert a["acceptance_length_by_k"] == pytest.approx({"1": 1.45, "2": 1.72, "3": 1.9, "4": 1.99})


def test_no_advice_without_what_it_is_made_of():
    assert _run([1.0, 1.5], e0=1.4, s0=None) is None  # no baseline arm: no speed-up measured
    assert _run([1.0, 1.5], e0=1.4, s0=1.1) is None  # the served k (3) was not measured offline
    assert advise(None, {"arms": {}}, "eagle3", "t", "d") is None
