"""Step configs (remote/<stage>/config.py, checked by remote/config.py): a value of the wrong type, a
null where a path belongs, a value out of bounds is refused naming the key and what was expected,
on the host (exit 65), on the controller (before anything runs) and in the flow's form. One
setting has one name and one default from the form to the host."""
import dataclasses
import json

import pytest

from remote.capture.config import CaptureConfig, CaptureOptions, PatchWorkerConfig
from remote.config import ConfigError, TargetOptions
from remote.data.config import DataDeltaConfig, DataOptions, EmbeddedDefaultConfig, PrepareConfig, PrepareOptions, RegenerateConfig
from remote.evaluate.config import EvaluateConfig, EvaluateOptions, OnlineConfig, PromoteConfig
from remote.step import EXIT_BAD_INPUT, BadInput, load_config
from remote.train.config import ExportConfig, TrainConfig, TrainOptions, VocabConfig

PREPARE = {"inputs": ["a.jsonl"], "tokenizer": "/m", "out_dir": "/o"}
CAPTURE = {"dataset": "/d.parquet", "target": "/m", "out_dir": "/o", "cache_root": "/c"}
TRAIN = {"capture_dir": "/c", "vocab_dir": "/v", "out_dir": "/o"}
EVALUATE = {"target": "/m", "draft_dir": "/d", "data": "/d.parquet", "out_dir": "/o"}
PROMOTE = {"out_dir": "/o", "drafts_root": "/d", "candidate_dir": "/c", "name": "r1", "figures": {}}

BAD = [  # (config class, a valid config, the bad keys, the message)
    (PrepareConfig, PREPARE, {"max_length": "512"}, r"max_length: expected an integer >= 16, got '512' \(a string\)"),
    (PrepareConfig, PREPARE, {"tokenizer": None}, r"tokenizer: expected a string, got null"),
    (PrepareConfig, PREPARE, {"inputs": "a.jsonl"}, r"inputs: expected a list of strings, got 'a.jsonl' \(a string\)"),
    (PrepareConfig, PREPARE, {"inputs": ["a.jsonl", None]}, r"inputs: expected a list of strings, got \['a.jsonl', None\]"),
    (PrepareConfig, PREPARE, {"inputs": []}, r"inputs: expected a non-empty list of paths, got \[\]"),
    (PrepareConfig, PREPARE, {"max_length": 8}, r"max_length: expected an integer >= 16, got 8$"),
    (PrepareConfig, PREPARE, {"max_length": 512.0}, r"max_length: expected an integer >= 16, got 512.0"),
    (PrepareConfig, PREPARE, {"max_length": True}, r"max_length: expected an integer >= 16, got true \(a boolean\)"),
    (PrepareConfig, PREPARE, {"heldout_permille": 1001}, r"heldout_permille: expected an integer >= 0 and <= 1000, got 1001"),
    (PrepareConfig, PREPARE, {"max_samples": 0}, r"max_samples: expected an integer >= 1 or null, got 0"),
    (PrepareConfig, PREPARE, {"long_policy": "shorten"}, r"long_policy 'shorten': choose one of 'truncate', 'drop'"),
    (PrepareConfig, PREPARE, {"trust_remote_code": "yes"}, r"trust_remote_code: expected true or false, got 'yes'"),
    (PrepareConfig, PREPARE, {"max_bad_fraction": "half"}, r"max_bad_fraction: expected a number >= 0 and <= 1"),
    (EmbeddedDefaultConfig, {"out_dir": "/o"}, {"conversations": "300"}, r"conversations: expected an integer, got '300'"),
    (EmbeddedDefaultConfig, {"out_dir": "/o"}, {"out_dir": None}, r"out_dir: expected a string, got null"),
    (DataDeltaConfig, {"inputs": ["a"], "state_dir": "/s", "out_dir": "/o"}, {"state_dir": 3},
     r"state_dir: expected a string, got 3"),
    (RegenerateConfig, {"inputs": ["a"], "target": "/m", "out_dir": "/o", "cache_root": "/c"}, {"inputs": []},
     r"inputs: expected a non-empty list of paths, got \[\]"),
    (DataDeltaConfig, {"inputs": ["a"], "state_dir": "/s", "out_dir": "/o"}, {"inputs": ["a", ""]},
     r"inputs: expected a non-empty list of paths, got \['a', ''\]"),
    (PatchWorkerConfig, {"target": "/m", "out_dir": "/o"}, {"gpu_memory_utilization": 1.5},
     r"gpu_memory_utilization: expected a number > 0 and <= 1, got 1.5"),
    (PatchWorkerConfig, {"target": "/m", "out_dir": "/o"}, {"layer_ids": [2, "x"]},
     r"layer_ids: expected a list of integers or null, got \[2, 'x'\] \(a list\)"),
    (CaptureConfig, CAPTURE, {"backend": "sglang"}, r"backend 'sglang': choose one of 'vllm', 'transformers'"),
    (CaptureConfig, CAPTURE, {"cache_root": None}, r"cache_root: expected a string, got null"),
    (CaptureConfig, CAPTURE, {"host_part": 2, "host_parts": 2}, r"host_part=2 of host_parts=2"),
    (VocabConfig, {"data": "/d", "out_dir": "/o", "target": "/m"}, {"draft_vocab_size": "32k"},
     r"draft_vocab_size: expected an integer >= 1, got '32k'"),
    (TrainConfig, TRAIN, {"lr": "fast"}, r"lr: expected a number > 0, got 'fast' \(a string\)"),
    (TrainConfig, TRAIN, {"betas": [0.9]}, r"betas: expected a list of 2 numbers, got \[0.9\]"),
    (TrainConfig, TRAIN, {"draft_overrides": []}, r"draft_overrides: expected an object, got \[\] \(a list\)"),
    (TrainConfig, TRAIN, {"device": "tpu"}, r"device 'tpu': choose one of 'auto', 'cuda', 'cpu'"),
    (TrainConfig, TRAIN, {"nnodes": 2}, r"rdzv_endpoint: nnodes=2 needs host:port of node 0"),
    (ExportConfig, {"train_dir": "/t", "vocab_dir": "/v", "out_dir": "/o"}, {"dtype": "int8"},
     r"dtype 'int8': choose one of 'bfloat16', 'float16', 'float32'"),
    (EvaluateConfig, EVALUATE, {"prompts": 0}, r"prompts: expected an integer >= 1, got 0"),
    (EvaluateConfig, EVALUATE, {"online": False}, r"online: nothing to measure"),
    (OnlineConfig, {"target": "/m", "draft_dir": "/d", "data": "/d.parquet"}, {"ngram_min": 5},
     r"ngram_min=5, ngram_max=4: need 1 <= min <= max"),
    (PromoteConfig, PROMOTE, {"margin": "0.1"}, r"margin: expected a number >= 0, got '0.1' \(a string\)"),
    (PromoteConfig, PROMOTE, {"figures": None}, r"figures: expected an object, got null"),
]


@pytest.mark.parametrize("cls,good,bad,message", BAD, ids=[f"{c.__name__}-{'-'.join(b)}" for c, _, b, _ in BAD])
def test_a_bad_value_is_refused_naming_the_key(cls, good, bad, message):
    load_config(cls, good)  # the valid config is valid: the bad keys alone are refused
    with pytest.raises(BadInput, match=rf"^config: {message}"):
        load_config(cls, {**good, **bad})


def test_the_host_step_exits_65_naming_the_key(tmp_path, capsys):
    """issue 15: tokenizer null was a TypeError (exit 1, retried as a fault)."""
    from remote.data.prepare import main

    path = tmp_path / "prepare.config.json"
    path.write_text(json.dumps({**PREPARE, "out_dir": str(tmp_path / "out"), "tokenizer": None}))
    assert main(["--config", str(path)]) == EXIT_BAD_INPUT
    assert "prepare config: tokenizer: expected a string, got null" in capsys.readouterr().err


def test_the_controller_refuses_before_anything_runs():
    """The task builds the step's config with its types: a bad value never reaches a host."""
    from types import SimpleNamespace

    from tasks.prepare import prepare_config
    from tasks.train import DraftVocabInfo, train_config

    with pytest.raises(ConfigError, match="tokenizer: expected a string, got null"):
        prepare_config("/o", SimpleNamespace(model=None, trust_remote_code=False), PrepareOptions(inputs=["a"]))
    with pytest.raises(ConfigError, match="model: expected a string, got null"):
        TargetOptions(model=None)
    with pytest.raises(ConfigError, match="ttt_steps: expected an integer >= 1, got 0"):
        train_config("/o", TargetOptions(), "/c",
                     DraftVocabInfo(path="/v", draft_vocab_size=1, coverage=1.0), SimpleNamespace(
                         **{**dataclasses.asdict(TrainOptions()), "ttt_steps": 0}))


def test_the_flow_refuses_a_bad_preset_value_by_its_dotted_key():
    from pydantic import ValidationError

    from flows.params import TrainDraftParams

    for key, value in (("data.max_length", "many"), ("train.batch_tokens", 512), ("capture.backend", "sglang"),
                       ("eval.prompts", 0)):
        with pytest.raises(ValidationError, match=key.replace(".", r"\.")):
            TrainDraftParams.from_preset(None, {key: value})


def test_every_setting_has_one_name_one_default_and_a_description_in_the_form():
    from prefect.utilities.callables import parameter_schema

    from flows.nightly import nightly_retrain
    from flows.params import CaptureParams, DataParams, EvalParams, TargetParams, TrainParams

    assert (DataParams, CaptureParams, EvalParams, TargetParams) == (DataOptions, CaptureOptions, EvaluateOptions,
                                                                    TargetOptions)
    assert {f.name for f in dataclasses.fields(TrainParams)} >= {f.name for f in dataclasses.fields(TrainOptions)}
    for options, config in ((PrepareOptions, PrepareConfig), (CaptureOptions, CaptureConfig),
                            (TrainOptions, TrainConfig), (EvaluateOptions, EvaluateConfig)):
        assert issubclass(config, options), f"{config.__name__} takes {options.__name__}'s defaults, not its own"
    assert (TrainOptions().lr, TrainOptions().epochs, TrainOptions().checkpoint_every, PrepareOptions().heldout_permille,
            DataDeltaConfig.heldout_permille) == (6e-3, 0.0, 200, 50, 50)
    schema = parameter_schema(nightly_retrain).model_dump()
    groups = schema["definitions"]
    undescribed = [f"{g}.{k}" for g, d in groups.items() for k, f in d.get("properties", {}).items()
                   if not f.get("description")]
    assert not undescribed, undescribed
    assert groups["DataOptions"]["properties"]["max_length"]["minimum"] == 16
    assert groups["TrainParams"]["additionalProperties"] is False
