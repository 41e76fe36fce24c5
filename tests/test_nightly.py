"""The nightly retrain: what is new by sample hash, promotion only of a better draft, one run a host.

Unit tier first (the host-side steps remote.data.delta and remote.evaluate.promote, run in-process on real
files), then the flow itself against a real Prefect server with the tiny preset.

    .venv/bin/python -m pytest tests/test_nightly.py -x -q
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from remote.data import delta as data_delta
from remote.evaluate import promote
from remote.data.chat_data import ReadReport, read_conversations
from remote.data.config import STATE, next_state
from remote.evaluate.config import HISTORY, RECORD
from remote.split import split_of
from remote.step import EXIT_BAD_INPUT, read_manifest


# ----------------------------------------------------------------------------- helpers
def conversations(n: int, start: int = 0) -> list[dict]:
    """n distinct, valid ShareGPT records (the i-th is the same text in every call)."""
    return [{"conversations": [{"from": "human", "value": f"question {i}: what is {i} plus {i}?"},
                               {"from": "gpt", "value": f"the answer to question {i} is {2 * i}."}]}
            for i in range(start, start + n)]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def run_step(module, config: dict, tmp_path: Path) -> int:
    cfg = tmp_path / f"{module.STEP}-{len(list(tmp_path.glob('*.json')))}.json"
    cfg.write_text(json.dumps(config))
    return module.main(["--config", str(cfg)])


def night(tmp_path: Path, source: list[str], run: str, permille: int = 250) -> dict:
    """One data_delta run committed the way commit_night does it; returns its manifest."""
    state_dir = tmp_path / "nightly"
    out = state_dir / "nights" / run
    assert run_step(data_delta, {"inputs": source, "state_dir": str(state_dir), "out_dir": str(out),
                                 "heldout_permille": permille}, tmp_path) == 0
    m = read_manifest(out)
    if m["counts"]["new"]:
        state = data_delta.read_state(state_dir)
        (state_dir / STATE).write_text(json.dumps(next_state(state, m, run)))
    return m


def ids_of(paths: list[str]) -> list[str]:
    return [c.sample_id for c in read_conversations(paths, ReadReport())]


# ----------------------------------------------------------------------------- data_delta
def test_new_data_is_found_by_sample_hash(tmp_path):
    src = write_jsonl(tmp_path / "src" / "a.jsonl", conversations(12))
    first = night(tmp_path, [str(src.parent)], "n1")
    assert first["counts"]["new"] == 12 and first["counts"]["already_seen"] == 0
    # what the night trains on reads back to the very same samples (the hashes prepare will see)
    assert sorted(ids_of(first["train_inputs"])) == sorted(ids_of([str(src)]))

    again = night(tmp_path, [str(src.parent)], "n2")
    assert again["counts"]["new"] == 0 and again["counts"]["already_seen"] == 12
    assert again["train_inputs"] == first["train_inputs"]  # nothing of tonight's, all of the first night's

    write_jsonl(tmp_path / "src" / "b.jsonl", conversations(12, start=12) + conversations(3))  # 3 repeats
    third = night(tmp_path, [str(src.parent)], "n3")
    new_ids = ids_of([third["new_data"]])
    fresh = [sid for sid in ids_of([str(tmp_path / "src" / "b.jsonl")])[:12]]
    kept = [sid for sid in fresh if split_of(sid, 250) == "train"]
    assert new_ids == kept, "only the new conversations, and of them only the train split"
    assert third["counts"]["new_heldout_left_out"] == len(fresh) - len(kept) > 0
    assert third["train_inputs"] == first["train_inputs"] + [third["new_data"]]


def test_uncommitted_night_is_found_again(tmp_path):
    src = write_jsonl(tmp_path / "src.jsonl", conversations(5))
    state_dir, out = tmp_path / "nightly", tmp_path / "nightly" / "nights" / "failed"
    cfg = {"inputs": [str(src)], "state_dir": str(state_dir), "out_dir": str(out)}
    assert run_step(data_delta, cfg, tmp_path) == 0  # the night then fails: nothing is committed
    assert night(tmp_path, [str(src)], "next")["counts"]["new"] == 5


def test_bad_delta_inputs_fail_as_bad_input(tmp_path):
    state_dir = tmp_path / "nightly"
    empty = write_jsonl(tmp_path / "empty.jsonl", [{"conversations": [{"from": "human", "value": "hi"}]}])
    assert run_step(data_delta, {"inputs": [str(empty)], "state_dir": str(state_dir),
                                 "out_dir": str(state_dir / "x")}, tmp_path) == EXIT_BAD_INPUT
    assert run_step(data_delta, {"inputs": [], "state_dir": str(state_dir),
                                 "out_dir": str(state_dir / "y")}, tmp_path) == EXIT_BAD_INPUT
    state_dir.mkdir(exist_ok=True)
    (state_dir / STATE).write_text("{not json")
    good = write_jsonl(tmp_path / "good.jsonl", conversations(2))
    assert run_step(data_delta, {"inputs": [str(good)], "state_dir": str(state_dir),
                                 "out_dir": str(state_dir / "z")}, tmp_path) == EXIT_BAD_INPUT
    assert not (state_dir / "z").exists(), "no output that looks finished"


# ----------------------------------------------------------------------------- promote
def fake_export(path: Path, tag: str) -> Path:
    """A folder shaped like an export (config.json + weights file); promotion only copies it."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"], "tag": tag,
                                                  "draft_vocab_size": 32}))
    (path / "model.safetensors").write_bytes(os.urandom(256))
    return path


def promote_cfg(tmp_path: Path, name: str, value, margin: float = 0.05) -> dict:
    return {"out_dir": str(tmp_path / "runs" / name / "promote"), "drafts_root": str(tmp_path / "drafts"),
            "candidate_dir": str(fake_export(tmp_path / "runs" / name / "export", name)), "name": name,
            "figures": {"acceptance_length": value, "other": 1}, "margin": margin, "context": {"run": name}}


def current_tag(drafts: Path) -> str:
    assert (drafts / "current").is_symlink()
    return json.loads((drafts / "current" / "config.json").read_text())["tag"]


def test_decide():
    def cur(**figures):
        return {"name": "a", "figures": figures}

    def decide(figures, current, metric, margin):  # a draft well above the floors, compared on metric m
        return promote.decide({"acceptance_length": 2.5, **figures}, current, metric, margin, floor_margin=0.1,
                              draft_vocab_size=32)

    assert decide({"m": 1.5}, None, "m", 0.1).promote
    better = decide({"m": 2.0}, cur(m=1.8), "m", 0.1)
    assert better.promote and better.gain == pytest.approx(0.2) and "recorded" in better.reason
    assert not decide({"m": 1.85}, cur(m=1.8), "m", 0.1).promote  # within the margin
    assert not decide({"m": 1.0}, cur(m=1.8), "m", 0.0).promote  # worse
    assert not decide({"m": 9.0}, cur(), "m", 0.0).promote  # nothing to compare with
    # the current draft measured beside the candidate in the same run wins over its old record
    same_run = decide({"m": 2.0, "previous_m": 1.95}, cur(m=1.0), "m", 0.1)
    assert not same_run.promote and same_run.current_value == 1.95 and "this run" in same_run.reason
    # an online figure is not compared with an offline one
    mixed = decide({"m": 3.0, "m_source": "offline"}, cur(m=1.0, m_source="online"), "m", 0.0)
    assert not mixed.promote and "not comparable" in mixed.reason
    with pytest.raises(promote.BadInput, match="figure 'm'"):
        decide({"other": 1.0}, None, "m", 0.0)


def test_a_draft_not_above_no_draft_or_a_random_draft_is_never_promoted():
    """First night or not: acceptance 1.00 (no token ever accepted) never beats "no current draft"."""
    useless = promote.decide({"acceptance_length": 1.0}, None, "acceptance_length", 0.05, floor_margin=0.1,
                             draft_vocab_size=32000)
    assert not useless.promote and useless.held_back_by == "no-draft floor"
    assert useless.reason.startswith("acceptance_length 1.0000 is not above the no-draft floor 1.1000 (no draft 1 + "
                                     "floor_margin 0.1): never promoted; no current draft")
    # a random draft of 4 tokens accepts up to 1 + 1/3: just above no draft is not enough
    guess = promote.decide({"acceptance_length": 1.2}, None, "acceptance_length", 0.05, floor_margin=0.1,
                           draft_vocab_size=4)
    assert not guess.promote and guess.held_back_by == "random-draft floor" and "random draft of 4 tokens" in guess.reason
    assert promote.random_draft_acceptance(32000) == pytest.approx(1 + 1 / 31999)
    good = promote.decide({"acceptance_length": 1.5}, None, "acceptance_length", 0.05, floor_margin=0.1,
                          draft_vocab_size=4)
    assert good.promote and good.held_back_by is None
    # below a floor wins over a better current comparison, and the figures compared stay in the decision
    worse = promote.decide({"acceptance_length": 1.0}, {"name": "a", "figures": {"acceptance_length": 2.0}},
                           "acceptance_length", 0.0, floor_margin=0.1, draft_vocab_size=32000)
    assert worse.held_back_by == "no-draft floor" and worse.current_value == 2.0
    kept = promote.decide({"acceptance_length": 1.9}, {"name": "a", "figures": {"acceptance_length": 2.0}},
                          "acceptance_length", 0.0, floor_margin=0.1, draft_vocab_size=32000)
    assert not kept.promote and kept.held_back_by == "current draft"


def test_a_draft_that_loses_a_benchmark_set_by_more_than_the_allowed_drop_is_kept_back():
    """max_benchmark_drop: a better held-out figure does not promote a draft that lost a benchmark set by more."""
    current = {"name": "a", "figures": {"acceptance_length": 2.0, "bench_gsm8k_acceptance_length": 2.4,
                                        "bench_mt-bench_acceptance_length": 2.1}}
    night = {"acceptance_length": 2.3, "bench_gsm8k_acceptance_length": 2.2, "bench_mt-bench_acceptance_length": 2.15}

    def decide(drop, figures=night):
        return promote.decide(figures, current, "acceptance_length", 0.05, floor_margin=0.1, draft_vocab_size=32000,
                              max_benchmark_drop=drop)

    assert decide(-1).promote  # not checked: the held-out gain decides
    held = decide(0.1)
    assert not held.promote and held.held_back_by == "benchmark gsm8k" and held.gain == pytest.approx(0.3)
    assert "on the benchmark gsm8k 2.2000 is below the current draft's 2.4000 by 0.2000 (> max_benchmark_drop 0.1)" \
        in held.reason
    assert decide(0.25).promote  # within the allowed drop
    assert decide(0.1, {k: v for k, v in night.items() if "gsm8k" not in k}).promote  # a set not measured: no check
    assert not decide(0.1, {**night, "acceptance_length": 2.02}).promote  # not better on held-out: as before
    from remote.step import load_config

    with pytest.raises(promote.BadInput, match="max_benchmark_drop"):
        load_config(promote.PromoteConfig, {"out_dir": "o", "drafts_root": "d", "candidate_dir": "c", "name": "n",
                                            "figures": {}, "max_benchmark_drop": -2})


def test_the_trend_has_a_column_a_benchmark_set():
    from tasks.nightly_data import trend_rows

    state = {"nights": []}
    manifest = {"new_data": [], "counts": {"new": 5}, "seen": []}
    state = next_state(state, manifest, "n1", figures={"acceptance_length": 2.0, "bench_gsm8k_acceptance_length": 2.41})
    state = next_state(state, {**manifest, "counts": {"new": 3}}, "n2", figures={"acceptance_length": 2.2})
    history = [{"name": "n1", "value": 2.0, "current_value": None, "promote": True},
               {"name": "n2", "value": 2.2, "current_value": 2.0, "promote": True}]
    rows = trend_rows(state, history)
    assert [r["gsm8k"] for r in rows] == [2.41, None] and [r["conversations trained on"] for r in rows] == [5, 8]
    assert list(rows[0]) == ["night", "new conversations", "conversations trained on", "acceptance length",
                             "current draft before", "gsm8k", "promoted"]


def test_promotion_switches_current_only_for_a_better_draft(tmp_path):
    drafts = tmp_path / "drafts"
    assert run_step(promote, promote_cfg(tmp_path, "r1", 1.40), tmp_path) == 0
    assert current_tag(drafts) == "r1" and os.readlink(drafts / "current") == "r1"
    record = json.loads((drafts / "current" / RECORD).read_text())
    assert record["reason"] == "no current draft" and record["figures"]["acceptance_length"] == 1.40

    assert run_step(promote, promote_cfg(tmp_path, "r2", 1.42), tmp_path) == 0  # better, but not by the margin
    assert current_tag(drafts) == "r1" and not (drafts / "r2").exists()
    assert read_manifest(tmp_path / "runs" / "r2" / "promote")["decision"]["promote"] is False

    assert run_step(promote, promote_cfg(tmp_path, "r3", 1.60), tmp_path) == 0
    assert current_tag(drafts) == "r3"
    record = json.loads((drafts / "current" / RECORD).read_text())
    assert record["replaced"]["name"] == "r1" and "beats 1.4000" in record["reason"]
    assert (drafts / "r1" / "config.json").is_file(), "the replaced draft stays for a rollback"

    cfg = promote_cfg(tmp_path, "r4", 1.2)
    assert run_step(promote, cfg, tmp_path) == 0 and run_step(promote, cfg, tmp_path) == 0  # a retry
    history = [json.loads(line) for line in (drafts / HISTORY).read_text().splitlines()]
    assert [(h["name"], h["promote"]) for h in history] == [("r1", True), ("r2", False), ("r3", True), ("r4", False)]
    assert not [p for p in drafts.iterdir() if p.name.startswith(".") and p.name != ".lock"], "no temporary left"


def test_bad_candidate_leaves_current_as_it_was(tmp_path):
    drafts = tmp_path / "drafts"
    assert run_step(promote, promote_cfg(tmp_path, "good", 1.5), tmp_path) == 0
    missing = promote_cfg(tmp_path, "nofig", None)
    assert run_step(promote, missing, tmp_path) == EXIT_BAD_INPUT
    broken = promote_cfg(tmp_path, "broken", 9.9)
    (Path(broken["candidate_dir"]) / "config.json").unlink()
    assert run_step(promote, broken, tmp_path) == EXIT_BAD_INPUT
    assert current_tag(drafts) == "good"
    assert not (tmp_path / "runs" / "broken" / "promote").exists()


# ----------------------------------------------------------------------------- Prefect: slots, failure hook
pytest_plugins = ["tests.fixtures.prefect_server"]


@pytest.mark.prefect_server
def test_host_slot_queues_runs_on_one_host_and_is_reentrant(prefect_api):
    import contextvars
    import threading
    import time as _time

    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter
    from prefect.runtime import flow_run

    from flows.params import TargetParams
    from flows.run_names import tag_run
    from tasks.host_slot import host_slot, slot_name
    from tasks.host import HostParams

    host = HostParams(kind="ssh", hostname="10.200.9.9", name="slot-test")
    held: dict[str, tuple[float, float, float]] = {}
    names: dict[str, str] = {}
    both_started = threading.Barrier(2, timeout=60)  # both runs ask for the host at the same moment
    waiting_states = []

    @flow(name="slot-holder")
    def hold(tag: str, seconds: float) -> None:
        names[tag] = flow_run.name
        tag_run(host, TargetParams())  # host:slot-test: how a waiting run finds who holds the host
        both_started.wait()
        with host_slot(host) as waited:
            start = _time.monotonic()
            with host_slot(host) as again:  # the nightly calls the training flow, which asks again
                assert again == 0.0
            _time.sleep(seconds)
            held[tag] = (waited, start, _time.monotonic())

    def watch_states() -> None:  # what the UI shows of the run that waits
        deadline = _time.monotonic() + 30
        with get_client(sync_client=True) as client:
            while len(held) < 2 and _time.monotonic() < deadline:
                for run in client.read_flow_runs(flow_run_filter=FlowRunFilter(name={"any_": list(names.values())})):
                    if run.state and run.state.name == "Waiting for host":
                        waiting_states.append((run.name, run.state.message))
                _time.sleep(0.3)

    # each thread runs in a copy of this context, so its flow talks to the same server
    runs = [threading.Thread(target=contextvars.copy_context().run, args=(hold, tag, 3.0)) for tag in ("a", "b")]
    watcher = threading.Thread(target=contextvars.copy_context().run, args=(watch_states,))
    for t in [*runs, watcher]:
        t.start()
    for t in [*runs, watcher]:
        t.join()
    early, late = sorted(held.values(), key=lambda h: h[1])
    assert late[1] >= early[2] - 0.2, f"the two runs held the host at once: {held}"
    assert late[0] > 2.0, f"the later run waited only {late[0]:.1f} s for a 3 s holder"
    first, second = sorted(held, key=lambda t: held[t][1])
    assert waiting_states, "the waiting run never showed 'Waiting for host'"
    run_name, message = waiting_states[0]
    assert run_name == names[second]
    assert message == f"waiting for gpu-host:slot-test, held by '{names[first]}'"

    with get_client(sync_client=True) as client:
        limit = client.read_global_concurrency_limit_by_name(slot_name(host))
        states = {r.name: r.state.name for r in client.read_flow_runs(
            flow_run_filter=FlowRunFilter(name={"any_": list(names.values())}))}
    assert (limit.name, limit.limit, limit.active_slots) == ("gpu-host:slot-test", 1, 0)
    assert set(states.values()) == {"Completed"}


class Webhook:
    """A local HTTP endpoint that keeps what is POSTed to it (the user's channel, here)."""

    def __init__(self):
        import http.server
        import threading

        received = self.received = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def webhook():
    hook = Webhook()
    yield hook
    hook.close()


@pytest.fixture
def failure_automation(prefect_api, webhook):
    """prefect.yaml's notification set-up against this server: a webhook block (the URL lives there) and the
    automation the deploy step declares, sending each eaglet.run.failed event to it."""
    from prefect.automations import Automation
    from prefect.blocks.notifications import CustomWebhookNotificationBlock

    from tasks.notify import AUTOMATION, declare_failure_automation

    CustomWebhookNotificationBlock(name="eaglet", url=webhook.url,
                                   json_data={"subject": "{{subject}}", "text": "{{body}}"}).save("eaglet-failures",
                                                                                                 overwrite=True)
    assert declare_failure_automation("custom-webhook/eaglet-failures")["automation"]
    assert declare_failure_automation("custom-webhook/eaglet-failures")["automation"]  # a redeploy updates it
    yield webhook
    Automation.read(name=AUTOMATION).delete()


def test_a_missing_notification_block_is_said_once_a_deploy(prefect_harness, capsys):
    """`prefect deploy --all` runs the build step once a deployment (five): one line, not five."""
    from tasks.notify import declare_failure_automation

    for _ in range(5):
        assert declare_failure_automation("custom-webhook/eaglet-test-no-block") == {"automation": ""}
    assert capsys.readouterr().out.count("no notification block custom-webhook/eaglet-test-no-block") == 1


def wait_for_posts(webhook, n: int = 1, timeout: float = 90) -> list[dict]:
    import time as _time

    deadline = _time.monotonic() + timeout
    while len(webhook.received) < n and _time.monotonic() < deadline:
        _time.sleep(0.5)
    assert len(webhook.received) >= n, f"the automation posted {len(webhook.received)} of {n} in {timeout} s"
    return webhook.received


@pytest.mark.prefect_server
def test_a_failed_run_is_posted_by_the_automation_with_the_step_and_log_tail(failure_automation, prefect_api):
    from prefect import flow, get_run_logger, task

    from tasks.errors import RemoteFault
    from tasks.notify import notify_failure

    @task(name="capture-hidden-states")
    def failing_step() -> None:
        for i in range(30):
            get_run_logger().info("[gpu-1] capture line %d", i)
        raise RemoteFault("step capture on gpu-1 failed (exit 1) after 2.0 s; stderr ends:\nCUDA out of memory")

    @flow(name="failing-run", on_failure=[notify_failure])
    def failing_run() -> None:
        failing_step()

    state = failing_run(return_state=True)
    assert state.is_failed()
    (post,) = wait_for_posts(failure_automation)
    assert post["subject"].startswith("eaglet run ") and post["subject"].endswith(" failed")
    text = post["text"]
    assert "**Failed step:** `capture-hidden-states" in text and "CUDA out of memory" in text
    assert "[gpu-1] capture line 29" in text and "[gpu-1] capture line 9" not in text  # the last 20 lines
    run_id = state.state_details.flow_run_id
    assert f"[The run in the Prefect UI]({prefect_api.ui_url}/runs/flow-run/{run_id})" in text

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter

    with get_client(sync_client=True) as client:
        (report,) = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id={"any_": [state.state_details.flow_run_id]}, key={"any_": ["failure-report"]}))
    assert "capture-hidden-states" in report.data and "capture line 29" in report.data and report.description


# ----------------------------------------------------------------------------- the nightly flow, end to end
class Nights:
    """Runs `python -m flows.nightly` against the real server on one host root and one data source."""

    def __init__(self, server, model: Path, tmp: Path):
        from tests.fixtures.tiny_run import tiny_params

        self.server, self.tmp, self.root, self.source = server, tmp, tmp / "root", tmp / "source"
        self.source.mkdir(parents=True)
        self.preset = tmp / "preset.json"
        self.preset.write_text(json.dumps(tiny_params(self.root, model, [self.source])))
        self.count = 0

    def add_data(self, name: str, n: int, start: int) -> None:
        from tests.fixtures.tiny_run import write_chats

        write_chats(self.source / f"{name}.jsonl", n, start)

    def start(self, *sets: str):
        import subprocess
        import sys

        self.count += 1
        out = self.tmp / f"night-{self.count}.json"
        argv = [sys.executable, "-m", "flows.nightly", "--preset", str(self.preset), "--result", str(out),
                "--set", f"run_name=night-{self.count}", *[a for s in sets for a in ("--set", s)]]
        return self.server.spawn(argv, self.tmp / f"night-{self.count}.log"), out

    def run(self, *sets: str, timeout: float = 600) -> dict:
        import time as _time

        started = _time.monotonic()
        proc, out = self.start(*sets)
        code = proc.wait(timeout)
        log = (self.tmp / f"night-{self.count}.log").read_text()
        assert code == 0, f"night {self.count} exited {code}:\n{log[-4000:]}"
        return {**json.loads(out.read_text()), "seconds": _time.monotonic() - started}

    def current(self) -> str | None:
        link = self.root / "drafts" / "current"
        return os.readlink(link) if link.is_symlink() else None

    def capture_counts(self, run: str) -> dict:
        return read_manifest(self.root / "runs" / run / "capture")["counts"]


# On the one-token target (tests/fixtures/tiny_run.py) a draft whose vocabulary lacks the token the
# target always predicts accepts nothing (acceptance length 1.0); with the full vocabulary it accepts
# nearly all (2.0 replayed at k=2). Two qualities known in advance, after one short epoch each.
WORSE = ("train.draft_vocab_size=4",)
BETTER = ()


@pytest.fixture(scope="module")
def nights(prefect_server, tiny_llama, tmp_path_factory):
    from tests.fixtures.tiny_run import make_one_token_target

    tmp = tmp_path_factory.mktemp("nights")
    return Nights(prefect_server, make_one_token_target(tiny_llama, tmp / "one-token-target"), tmp)


@pytest.mark.slow
@pytest.mark.prefect_server
def test_first_night_with_a_useless_draft_trains_and_promotes_nothing(nights):
    """Its draft accepts nothing (1.00): not above no draft, so not promoted though nothing is current."""
    nights.add_data("d1", 24, start=0)
    r = nights.run(*WORSE)
    assert r["status"] == "kept-current" and r["delta"]["new"] == 24
    assert r["decision"]["value"] == 1.0 and r["decision"]["held_back_by"] == "no-draft floor", r["decision"]
    assert nights.current() is None and not (nights.root / "drafts" / r["run_name"]).exists()
    assert nights.capture_counts(r["run_name"])["captured"] == 24
    log = (nights.tmp / f"night-{nights.count}.log").read_text()
    assert "Not promoted, held back by the no-draft floor: acceptance_length 1.0000 is not above" in log


@pytest.mark.slow
@pytest.mark.prefect_server
def test_same_data_again_ends_early_without_capture(nights):
    before = nights.current()
    r = nights.run()
    assert r["status"] == "no-new-data" and r["delta"]["new"] == 0 and r["trained"] is None
    assert not (nights.root / "runs" / r["run_name"] / "capture").exists(), "nothing captured"
    assert nights.current() == before
    assert r["seconds"] < 60, f"a night with no new data took {r['seconds']:.0f} s"


@pytest.mark.slow
@pytest.mark.prefect_server
def test_two_nights_on_one_host_queue_and_a_better_draft_is_promoted(nights):
    before = nights.current()
    nights.add_data("d2", 16, start=24)
    (a, a_out), (b, b_out) = nights.start(*BETTER), nights.start(*BETTER)
    assert a.wait(600) == 0 and b.wait(600) == 0
    results = sorted((json.loads(p.read_text()) for p in (a_out, b_out)), key=lambda r: r["waited_for_host_s"])
    first, second = results
    assert first["status"] == "promoted", first["decision"]
    assert first["decision"]["current_before"] == before and nights.current() == first["run_name"]
    # the second waited for the host, then found that the first had trained on everything new
    assert second["status"] == "no-new-data" and second["waited_for_host_s"] > 5
    counts = nights.capture_counts(first["run_name"])
    assert counts["captured"] == first["delta"]["new"] > 0, "only the new samples were captured"
    assert counts["reused"] == counts["samples"] - counts["captured"] >= 24


@pytest.mark.slow
@pytest.mark.prefect_server
def test_worse_draft_is_not_promoted(nights):
    before = nights.current()
    nights.add_data("d3", 16, start=40)
    r = nights.run(*WORSE)
    assert r["status"] == "kept-current", r["decision"]
    assert r["decision"]["value"] < r["decision"]["current_value"]
    assert nights.current() == before
    assert nights.capture_counts(r["run_name"])["captured"] == r["delta"]["new"]
    # the night was good, so its data is committed: later nights skip it and train on it
    state = json.loads((nights.root / "nightly" / "default" / "state.json").read_text())
    assert state["nights"][-1] == {"run": r["run_name"], "data": r["delta"]["manifest"]["new_data"],
                                   "new": r["delta"]["new"]}
    assert state["last_success"]["promoted"] is False


@pytest.mark.slow
@pytest.mark.prefect_server
def test_failed_night_leaves_current_and_memory_as_they_were(nights, prefect_api):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter

    before = nights.current()
    state = json.loads((nights.root / "nightly" / "default" / "state.json").read_text())
    nights.add_data("d4", 8, start=56)
    proc, _ = nights.start(f"target.model={nights.tmp / 'no-such-model'}")
    assert proc.wait(300) == EXIT_BAD_INPUT
    assert nights.current() == before
    assert json.loads((nights.root / "nightly" / "default" / "state.json").read_text()) == state
    log = (nights.tmp / f"night-{nights.count}.log").read_text()
    assert "Traceback" not in log and "find-new-data" not in log, "refused before any step ran"
    with get_client(sync_client=True) as client:
        (run,) = client.read_flow_runs(flow_run_filter=FlowRunFilter(name={"like_": f"night-{nights.count} · "}))
    assert run.state.is_failed() and run.state.message.startswith(f"bad input: target.model: {nights.tmp / 'no-such-model'}")


@pytest.mark.slow
@pytest.mark.prefect_server
def test_the_nightly_trend_table_has_a_row_per_good_night(nights, prefect_api):
    from prefect.artifacts import Artifact

    trend = Artifact.get("nightly-trend-default")
    assert trend is not None and trend.type == "table" and trend.description
    rows = json.loads(trend.data) if isinstance(trend.data, str) else trend.data
    state = json.loads((nights.root / "nightly" / "default" / "state.json").read_text())
    assert [r["night"] for r in rows] == [n["run"] for n in state["nights"]]
    assert [r["promoted"] for r in rows][:2] == ["no", "yes"] and rows[-1]["promoted"] == "no"
    assert rows[-1]["conversations trained on"] == sum(n["new"] for n in state["nights"])
    assert all(isinstance(r["acceptance length"], float) for r in rows)


def test_a_nightly_preset_with_extra_hosts_is_refused_before_anything_runs(prefect_harness, tmp_path):
    """The training flow takes several hosts; the nightly's new-data files live on one, so it says so."""
    from flows.nightly import nightly_retrain
    from tasks.host import HostParams

    other = HostParams(kind="ssh", name="gpu-b", hostname="gpu-b.invalid", root=str(tmp_path / "b"))
    state = nightly_retrain(host=HostParams(kind="local", root=str(tmp_path / "a")), extra_hosts=[other],
                            return_state=True)
    assert state.is_failed() and state.message.startswith("bad input: extra_hosts: the nightly retrain runs on one "
                                                          "host (got 1 extra)")
    assert not (tmp_path / "a").exists()  # refused before the host was touched
