"""The export's bytes stay the ones 9aa4e1d wrote: config.json (keys, values, layout) and model.safetensors
(tensor names, dtypes, bytes) of a tiny EAGLE-3 draft, hashed, against the hashes 9aa4e1d's export step gave for
the very same train folder (computed once there: the folder is built by tests/fixtures/golden.py from the draft config and the model's
own weight names alone, which both codes share, with weights made from arange, no random numbers).

A change that moves a byte of the export breaks vLLM and SGLang users' folders or the nightly's comparisons:
if one is meant, say so in the commit and update the hashes (run this test at the old commit and at the new).
"""
import json

import pytest
from safetensors.torch import load_file

from tests.fixtures.golden import export_hashes

# (draft options, export dtype, engines) -> sha256 of (config.json, model.safetensors) as 9aa4e1d wrote them
CASES = {
    "plain-bf16-both": (({}, "bfloat16", []),
                        ("ebdecbb8d7a7eb13cfeaff6e587458b2a89f9f46833d0f6d9e57351f627a62b3",
                         "dfb7c04d52b643aa250799c8b7d5c33bd36c5756ae9c3cd94b496128adc4b221")),
    "options-fp32-vllm": (({"norm_before_fc": True, "norm_before_residual": True, "norm_output": True}, "float32",
                           ["vllm"]), ("37ca6776c9402e2ca0eaa531c88c03ee47db27e72912db055e07ba34db6453c2",
                                       "11ec1681123ef2195625fef60e1a6a55320e52eefb5d41c5a3aeff4abdc681c8")),
    "fc_norm-fp16-vllm": (({"fc_norm": True}, "float16", ["vllm"]),
                          ("7f3dbea19b2bc970d5ca80bfc04ef38db439872d078bcd2f098d0d5aa4df9df8",
                           "f811987f45fbde6aa81e04c1c33d0188560abdcc2f51f7cac7a87eea718721cc")),
}




@pytest.mark.parametrize("case", sorted(CASES))
def test_export_bytes_are_the_ones_9aa4e1d_wrote(case, tmp_path):
    (options, dtype, engines), want = CASES[case]
    config_sha, weights_sha, out = export_hashes(tmp_path, options, dtype, engines)
    names = sorted(load_file(str(out / "model.safetensors")))
    assert (config_sha, weights_sha) == want, (case, json.loads((out / "config.json").read_text()), names)
