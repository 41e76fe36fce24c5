"""remote.step.begin_step, the first lines of every step: the config checked by name, the output
folder, an earlier finished run found (and said in the log). tests/test_finished_step.py runs each
step against a finished folder of another config."""
from dataclasses import dataclass
from pathlib import Path

import pytest

from remote.step import BadInput, begin_step


@dataclass(frozen=True)
class Cfg:
    out_dir: str
    n: int = 3


def test_begin_step_finds_only_a_finished_run(tmp_path, capsys):
    raw = {"out_dir": str(tmp_path / "out"), "n": 4}
    cfg, out, done = begin_step(Cfg, raw, "demo")
    assert cfg == Cfg(str(tmp_path / "out"), 4) and done is None and out.config == raw
    (out.open() / "a.txt").write_text("a")
    assert begin_step(Cfg, raw, "demo")[2] is None  # staged, not published: not done
    assert not out.staging.exists(), "a step that does not resume starts again from nothing"
    (out.open() / "a.txt").write_text("a")
    published = out.publish(counts={"a": 1})
    capsys.readouterr()
    _, _, done = begin_step(Cfg, raw, "demo", summary=lambda m: f"{m['counts']['a']} a")
    assert done == published
    assert f"demo: {tmp_path / 'out'} is already done (1 a)" in capsys.readouterr().out
    (tmp_path / "out" / "a.txt").write_text("changed size")  # its files no longer check out
    assert begin_step(Cfg, raw, "demo")[2] is None


def test_begin_step_names_the_step_in_a_bad_config():
    with pytest.raises(BadInput, match=r"demo config: unknown key\(s\) \['m'\]"):
        begin_step(Cfg, {"out_dir": "x", "m": 1}, "demo")


@dataclass(frozen=True)
class Newer(Cfg):
    """Cfg with an option added since a folder was finished."""

    mode: str = "old-way"


def test_a_folder_finished_before_an_option_existed_is_the_options_default(tmp_path):
    raw = {"out_dir": str(tmp_path / "out"), "n": 4}
    _, out, _ = begin_step(Cfg, raw, "demo")
    out.open()
    published = out.publish()
    assert begin_step(Newer, raw, "demo")[2] == published  # the default is what the folder was made as
    with pytest.raises(BadInput, match=r'finished with another config \(mode "old-way" there, "new-way" now\)'):
        begin_step(Newer, {**raw, "mode": "new-way"}, "demo")


def test_a_window_trained_before_an_option_existed_counts_as_trained(tmp_path, monkeypatch):
    """tasks.windows skips a window an earlier run trained by remote.step's own rule: an option the recorded
    config predates counts as its default, another value of it does not. (get_run_logger is Prefect's; this runs
    outside a flow, so the log line goes to a plain logger.)"""
    import dataclasses
    import json
    import logging

    import tasks.windows as windows
    from remote.train.config import TrainConfig
    from tasks.context import RunContext
    from tasks.host.params import HostParams
    from tasks.ship import ShippedCode

    monkeypatch.setattr(windows, "get_run_logger", lambda: logging.getLogger("test"))
    ctx = RunContext(host=HostParams(kind="local"), code=ShippedCode(str(tmp_path / "code" / "x"), "x", 0, 0, 0.0),
                     run_name="r")
    config = dataclasses.asdict(TrainConfig(capture_dir="/c", vocab_dir="/v", out_dir=ctx.step_dir("train-w000")))
    recorded = {k: v for k, v in json.loads(json.dumps(config)).items() if k != "checkpoint_dir"}  # before it existed
    folder = Path(ctx.step_dir("train-w000"))
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text(json.dumps({"config": recorded, "counts": {"steps": 3}, "figures": {},
                                                      "train": {"final": False}}))
    freed = Path(ctx.step_dir("free-w000"))  # the window counts as done once its states are freed
    freed.mkdir(parents=True)
    (freed / "manifest.json").write_text(json.dumps({"step": "free", "counts": {}, "figures": {}}))
    trained = windows._finished(ctx, 0, config)
    assert trained is not None and trained.steps == 3 and not trained.final
    assert windows._finished(ctx, 0, {**config, "checkpoint_dir": "/elsewhere"}) is None
