"""remote.step.begin_step, the first lines of every step: the config checked by name, the output
folder, an earlier finished run found (and said in the log). tests/test_finished_step.py runs each
step against a finished folder of another config."""
from dataclasses import dataclass

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
