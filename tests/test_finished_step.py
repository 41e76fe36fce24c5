"""One rule for a finished step, run against every step of the pipeline (remote.step.begin_step):
a re-run with another config is never served the old output, a re-run with the same one is, and a
killed run's staging folder is removed on the next start unless the step resumes from it (train).

Each row is a step with a config whose paths need not exist (the rule acts before any is read) and
one key changed. The finished folder is made by StepOutput, as the steps publish theirs."""
import importlib
import json

import pytest

from remote.data.embedded_default import FORMAT
from remote.step import STEP_MODULES, BadInput, StepOutput, begin_step, load_config

NOWHERE = "/nonexistent/eaglet"

STEPS = {  # step -> (its config, a changed key and value)
    "prepare": ({"inputs": [f"{NOWHERE}/a.jsonl"], "tokenizer": f"{NOWHERE}/model"}, ("max_length", 64)),
    "embedded_default": ({"conversations": 5}, ("conversations", 6)),
    "regenerate": ({"inputs": [f"{NOWHERE}/a.jsonl"], "target": f"{NOWHERE}/model", "cache_root": f"{NOWHERE}/cache"},
                   ("temperature", 0.7)),
    "data_delta": ({"inputs": [f"{NOWHERE}/a.jsonl"], "state_dir": f"{NOWHERE}/state"}, ("heldout_permille", 20)),
    "patch_worker": ({"target": f"{NOWHERE}/model"}, ("tensor_parallel_size", 2)),
    "capture": ({"dataset": f"{NOWHERE}/data.parquet", "target": f"{NOWHERE}/model", "cache_root": f"{NOWHERE}/cache"},
                ("samples_per_shard", 8)),
    "vocab": ({"data": f"{NOWHERE}/prepare", "target": f"{NOWHERE}/model"}, ("draft_vocab_size", 100)),
    "free_capture": ({"capture_dir": f"{NOWHERE}/capture-w000"}, ("capture_dir", f"{NOWHERE}/capture-w001")),
    "windows": ({"dataset": f"{NOWHERE}/data.parquet", "target": f"{NOWHERE}/model", "capture": {"max_disk_gb": 1.0},
                 "train": {}}, ("capture", {"max_disk_gb": 2.0})),
    "train": ({"capture_dir": f"{NOWHERE}/capture", "vocab_dir": f"{NOWHERE}/vocab"}, ("lr", 5e-4)),
    "export": ({"train_dir": f"{NOWHERE}/train", "vocab_dir": f"{NOWHERE}/vocab"}, ("dtype", "float32")),
    "evaluate": ({"target": f"{NOWHERE}/model", "draft_dir": f"{NOWHERE}/draft", "data": f"{NOWHERE}/data.parquet"},
                 ("prompts", 4)),
    "online_eval": ({"target": f"{NOWHERE}/model", "draft_dir": f"{NOWHERE}/draft", "data": f"{NOWHERE}/data.parquet"},
                    ("max_tokens", 8)),
    "promote": ({"drafts_root": f"{NOWHERE}/drafts", "candidate_dir": f"{NOWHERE}/draft", "name": "r1",
                 "figures": {"acceptance_length": 2.0}}, ("margin", 0.1)),
}
# what a step reads of a finished output besides the config (capture: its shards in the cache; the log's summary)
EXTRA = {"capture": {"capture": {"shards": [], "shard_bytes": {}}}, "embedded_default": {"format": FORMAT},
         "prepare": {"counts": {"samples": 3}}, "data_delta": {"counts": {"new": 3}},
         "promote": {"decision": {"reason": "better"}}, "regenerate": {"counts": {"conversations": 3}}}
CONFIG_CLASS = {"prepare": "PrepareConfig", "embedded_default": "EmbeddedDefaultConfig", "data_delta": "DataDeltaConfig",
                "patch_worker": "PatchWorkerConfig", "capture": "CaptureConfig", "vocab": "VocabConfig",
                "train": "TrainConfig", "windows": "WindowsConfig", "free_capture": "FreeCaptureConfig", "export": "ExportConfig", "evaluate": "EvaluateConfig",
                "online_eval": "OnlineConfig", "promote": "PromoteConfig", "regenerate": "RegenerateConfig"}
REMADE = ("embedded_default", "regenerate")  # caches shared by runs: another config makes the folder again


def test_the_table_holds_every_step():
    assert set(STEPS) == set(STEP_MODULES) == set(CONFIG_CLASS)


def _step(name: str):
    module = importlib.import_module(STEP_MODULES[name])
    return module, getattr(module, CONFIG_CLASS[name])


def _finished(name: str, raw: dict) -> dict:
    """A finished output folder of this step made with this config; its manifest."""
    _, cls = _step(name)
    _, out, _ = begin_step(cls, raw, name)
    (out.open() / "result.txt").write_text("the old output")
    return out.publish(**EXTRA.get(name, {}))


def _raw(name: str, tmp_path, **changes) -> dict:
    return {**STEPS[name][0], "out_dir": str(tmp_path / name), **changes}


@pytest.mark.parametrize("name", [n for n in STEPS if n not in REMADE])
def test_a_changed_config_is_refused_naming_the_key(name, tmp_path):
    module, _ = _step(name)
    _finished(name, _raw(name, tmp_path))
    key, value = STEPS[name][1]
    with pytest.raises(BadInput, match=rf"{name}: .*{name} was finished with another config \({key} .* there, "
                                       rf"{json.dumps(value)} now\): give the run another run_name, or delete"):
        module.run(_raw(name, tmp_path, **{key: value}))
    assert (tmp_path / name / "result.txt").read_text() == "the old output", "the old output is left as it was"


@pytest.mark.parametrize("name, first_work", [("embedded_default", "ensure_model"), ("regenerate", "input_files")])
def test_a_shared_cache_makes_its_folder_again_for_another_config(name, first_work, tmp_path, monkeypatch):
    """Caches shared by runs (the embedded default; regenerate's answers, keyed by their sampling settings):
    another config is not refused, and not served the old manifest either: the step starts its work again."""
    module, _ = _step(name)
    _finished(name, _raw(name, tmp_path))

    class Redoing(Exception):
        pass

    def first(*_):
        raise Redoing

    monkeypatch.setattr(module, first_work, first)
    key, value = STEPS[name][1]
    with pytest.raises(Redoing):
        module.run(_raw(name, tmp_path, **{key: value}))


@pytest.mark.parametrize("name", [n for n in STEPS if n != "patch_worker"])  # its check also starts vLLM's version probe
def test_the_same_config_is_served_the_finished_output(name, tmp_path):
    module, _ = _step(name)
    published = _finished(name, _raw(name, tmp_path))
    assert module.run(_raw(name, tmp_path)) == published


@pytest.mark.parametrize("name", [n for n in STEPS if n not in ("train", "embedded_default")])
def test_a_killed_runs_staging_folder_is_removed_on_the_next_start(name, tmp_path):
    module, _ = _step(name)
    staging = tmp_path / f"{name}.partial"
    staging.mkdir()
    (staging / "half-written.bin").write_bytes(b"\0" * 10)
    with pytest.raises(BadInput):  # an input under NOWHERE is missing: refused once the start is done
        module.run(_raw(name, tmp_path))
    assert not staging.exists()


def test_train_resumes_only_a_staging_folder_of_its_own_config(tmp_path):
    module, cls = _step("train")
    raw = _raw("train", tmp_path)
    out = StepOutput(raw["out_dir"], "train", begin_step(cls, raw, "train")[1].config)
    (out.open() / "checkpoints").mkdir()
    with pytest.raises(BadInput, match=r"train\.partial holds an unfinished run of another config \(lr 0\.006 there, "
                                       r"0\.0005 now\): run it again with that config to resume it, or delete"):
        module.run(_raw("train", tmp_path, lr=5e-4))
    _, same, done = begin_step(cls, raw, "train", resumes=True)
    assert done is None and (same.staging / "checkpoints").is_dir(), "the same config resumes: nothing removed"
    assert load_config(cls, raw).lr == 6e-3
