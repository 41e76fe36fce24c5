"""The remote step contract (remote/step.py): configs, exit codes, the staged output folder."""
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from remote.step import (EVENT_PREFIX, EXIT_BAD_INPUT, BadInput, StepOutput, load_config, read_manifest,
                         step_main, verify_outputs)


@dataclass(frozen=True)
class Cfg:
    out_dir: str
    n: int = 3


def test_load_config_refuses_unknown_and_missing_keys_by_name():
    assert load_config(Cfg, {"out_dir": "x"}) == Cfg("x", 3)
    with pytest.raises(BadInput, match=r"unknown key\(s\) \['nn'\]"):
        load_config(Cfg, {"out_dir": "x", "nn": 1})
    with pytest.raises(BadInput, match=r"missing key\(s\) \['out_dir'\]"):
        load_config(Cfg, {"n": 1})
    with pytest.raises(BadInput, match="expected a JSON object"):
        load_config(Cfg, [1])


def test_output_is_staged_and_published_whole(tmp_path):
    out = StepOutput(tmp_path / "step", "demo", {"a": 1})
    assert out.done() is None
    staging = out.open()
    (staging / "data.bin").write_bytes(b"x" * 10)
    assert not (tmp_path / "step").exists()  # nothing looks finished before publish
    m = out.publish(counts={"rows": 1})
    assert (tmp_path / "step" / "manifest.json").is_file() and not staging.exists()
    assert m["files"]["data.bin"]["bytes"] == 10 and m["counts"] == {"rows": 1}
    assert StepOutput(tmp_path / "step", "demo", {}).done() == read_manifest(tmp_path / "step")
    (tmp_path / "step" / "data.bin").write_bytes(b"y" * 10)  # same size, other bytes
    assert verify_outputs(tmp_path / "step", m) == []
    assert verify_outputs(tmp_path / "step", m, deep=True) == ["data.bin: checksum differs from the manifest"]
    (tmp_path / "step" / "data.bin").write_bytes(b"short")
    assert StepOutput(tmp_path / "step", "demo", {}).done() is None


def _fails_bad(cfg):
    raise BadInput(f"row 7 of {cfg['file']} has no assistant turn")


def _crashes(cfg):
    raise RuntimeError("boom")


def test_step_main_maps_errors_to_exit_codes(tmp_path, capsys):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"file": "chats.jsonl"}))
    assert step_main("t", _fails_bad, ["--config", str(cfg)]) == EXIT_BAD_INPUT
    out = capsys.readouterr()
    assert "row 7 of chats.jsonl" in out.err
    event = json.loads(out.out.strip().removeprefix(EVENT_PREFIX))
    assert event == {"event": "bad_input", "message": "row 7 of chats.jsonl has no assistant turn"}
    assert step_main("t", _crashes, ["--config", str(cfg)]) == 1
    assert step_main("t", _crashes, ["--config", str(tmp_path / "absent.json")]) == EXIT_BAD_INPUT
    cfg.write_text("{not json")
    assert step_main("t", _crashes, ["--config", str(cfg)]) == EXIT_BAD_INPUT
