"""What a run's log and artifacts say, as plain functions: progress lines, engine noise, the report's words
and plots. No Prefect server and no host: each function is called on the figures a step hands back.

    .venv/bin/python -m pytest tests/test_run_log.py -q
"""
from __future__ import annotations

import base64
import re

from tasks.evaluate import (LOSS_CAPTION, loss_chart, position_chart, report_markdown, summary_markdown,
                            table_description)
from tasks.remote_step import EngineNoise, artifact_key, progress_line


def test_a_training_progress_line_has_step_loss_accuracy_speed_and_eta():
    line = progress_line("Draft training (train on gpu-1)", {"done": 120, "total": 500, "what": "steps"},
                         {"loss": 3.21, "acc": [0.41, 0.2], "tokens_per_s": 1234.5}, eta_s=310)
    assert line == ("Draft training (train on gpu-1): 120/500 steps (24%), loss 3.2100, accuracy 0.41/0.20, "
                    "1,234 tokens/s, ETA 5m10s")


def test_a_capture_progress_line_counts_samples_and_leaves_out_what_it_does_not_know():
    line = progress_line("Capturing (capture on local)", {"done": 64, "total": 300, "samples": 64}, {}, None)
    assert line == "Capturing (capture on local): 64/300 samples (21%)"
    assert "None" not in line and "ETA" not in line


def test_engine_noise_is_told_from_the_steps_own_lines():
    lines = {
        "capture: 300 samples to capture": False,
        "INFO 12-03 06:59:49 [core.py:1] Initializing a V1 LLM engine (v0.32.0) with config: model=...": True,
        "(MainProcess pid=4896) INFO 12-07 06:05:02 [api_utils.py:286] non-default args: {...}": True,
        "capture: vLLM engine up in 11.2 s (TP=1, float32)": False,
        "Triton is installed, but doesn't include CPU backend. Disabling Triton.": True,
        "INFO: the step's own word": False,
        "(EngineCore_DP0 pid=123) WARNING 12-03 06:59:49 [tok.py:3] tokenizer not initialised": True,
        "Traceback (most recent call last):": True,
        '  File "x.py", line 3, in f': True,
        "    raise X": True,
        "ValueError: tokenizer is None": True,
        "hooked . layers": False,  # the traceback has ended
        "Loading safetensors: 10%|##   | 1/10 [00:01<00:09]\r 20%|####": True,
        "nanobind: leaked 514 functions!": True,  # Triton's leak report at the interpreter's exit
        ' - leaked type "triton._C.libtriton.ir.integer_attr"': True,
        " - ... skipped remainder": True,
        "nanobind: this is likely caused by a reference counting issue in the binding code.": True,
        "See https://nanobind.readthedocs.io/en/latest/refleaks.html": True,
        "train: garbage collection took 0.43 s (2 full collections, 0.34 s of it)": False,
        " - the step's own list item": False,
        "/v/vllm/triton_utils/dispatcher.py:138: FutureWarning: `torch.distributed.reduce_op` is deprecated": True,
        '  if hasattr(value, "__dict__"):': True,  # the line the warning quotes
        "[W1205 06:51:52.300162048 utils.cpp:68] Warning: NUMA binding: Using MEMBIND policy": True,
        "": True,
        "  an indented line of the step's own": False,
    }
    noise = EngineNoise()
    assert {line: noise.is_noise(line) for line in lines} == lines
    assert noise.count == sum(lines.values())


def test_progress_artifact_keys_are_valid_prefect_keys():
    assert artifact_key("capture", "GPU_node.1") == "progress-capture-gpu-node-1"


def _png(markdown: str) -> bytes:
    return base64.b64decode(re.search(r"data:image/png;base64,([^)]+)\)", markdown).group(1))


def test_plots_are_png_images_with_a_caption():
    md = loss_chart([[i, 5.0 / i + 1] for i in range(1, 60)], LOSS_CAPTION)
    assert _png(md).startswith(b"\x89PNG") and md.endswith(f"*{LOSS_CAPTION}*")
    bars = position_chart({"offline": [0.6, 0.4], "this draft (eagle3), greedy": [0.5, 0.2]}, "caption")
    assert len(_png(bars)) > 5_000 and "<svg" not in bars


OFFLINE_ONLY = {"provenance": {"draft_dir": "/d", "train_figures": {"steps": 3, "final_loss": 2.5}},
                "offline": {"samples": 4, "tokens": 64, "k": 2, "acceptance_length": 1.4, "heldout_coverage": 0.9,
                            "conditional_accuracy": [0.3, 0.2], "prefix_rate": [0.3, 0.1]}}
FIGURES = {"acceptance_length": 1.4, "acceptance_length_source": "offline, replayed", "evaluate_seconds": 3.0}


def test_an_offline_only_run_says_what_was_not_measured():
    context = {"run": "r1", "target": "/m", "host": "local", "draft": "/d", "data": "24 samples", "k": 2,
               "on_cpu": True}
    report = report_markdown(OFFLINE_ONLY, FIGURES, context, previous=None)
    summary = summary_markdown(FIGURES, context)
    for text in (report, summary):
        assert "n/ax" not in text and "None" not in text
        assert "not measured (it needs eval.online and eval.baseline)" in text
    assert table_description(OFFLINE_ONLY) == "acceptance per speculative position (offline: held-out captures replayed)"
    assert "**1.40** (offline, replayed, k = 2)" in summary
    assert "speculative decoding is *slower* here" in summary


def test_a_gpu_run_is_not_told_it_is_slow():
    context = {"run": "r1", "target": "/m", "host": "gpu-1", "draft": "/d", "k": 3, "on_cpu": False}
    summary = summary_markdown({**FIGURES, "speedup": 1.8, "acceptance_length_source": "online"}, context)
    assert "| speed-up (decode) | 1.80x |" in summary and "slower" not in summary
