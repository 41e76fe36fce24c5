"""The exported config.json as each engine reads its aux layer ids, for a Llama and a Kimi-K2.5 target,
default and non-default layers: both engines must feed the draft the HF hidden states it trained on.

vLLM's side is vLLM's own code: its get_config reads the folder, EAGLEConfig wraps it as
SpeculativeConfig does, and GPUModelRunner._get_eagle3_aux_layers_from_config (the CPU runner's
too) picks the ids; llama.py and deepseek_v2.py then append the state after layer id-1 (id 0: the
embeddings), i.e. HF hidden-state index id. SGLang cannot be installed here (CUDA wheels), so its
side is a transcription of the code read (sgl-project/sglang, python/sglang/srt/):
model_runner_components/spec_aux_hidden_state.py takes eagle_config["eagle_aux_hidden_state_layer_ids"]
(None when absent); models/llama.py's set_eagle3_layers_to_capture captures layers [id + 1] (None:
its default 2, N//2, N-3), deepseek_v2.py the same in older releases and, in newer ones, [id + 1]
only when the first id is 1, else the ids as they are; the capture loop appends the input of layer
i (hidden + residual, so never layer 0's: no residual yet) for i in 0..N-1; llama_eagle3.py's fc
takes exactly 3 states.
"""
import json
from types import SimpleNamespace

import pytest

from remote.draft.config import DraftConfig
from remote.step import BadInput
from remote.draft.eagle3 import vllm_config

# The shapes of the targets' own config.json files.
LLAMA31_8B = {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
              "intermediate_size": 14336, "vocab_size": 128256, "num_hidden_layers": 32, "rope_theta": 500000.0}
KIMI_K25 = {"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"], "text_config": {
    "model_type": "deepseek_v3", "hidden_size": 7168, "num_attention_heads": 64, "num_key_value_heads": 64,
    "intermediate_size": 18432, "vocab_size": 163840, "num_hidden_layers": 61, "rope_theta": 50000.0}}
READABLE = {  # (target, aux ids): default layers (2, N//2, N-3), and others both engines can take
    "llama-default": (LLAMA31_8B, (2, 16, 29)),
    "llama-other": (LLAMA31_8B, (1, 10, 31)),
    "kimi-default": (KIMI_K25, (2, 30, 58)),
    "kimi-other": (KIMI_K25, (2, 20, 40)),
}


def _draft(target: dict, ids, **options) -> DraftConfig:
    return DraftConfig.from_target_config(target, draft_vocab_size=32000, aux_layer_ids=ids, **options)


def vllm_reads(config: dict, tmp_path) -> list[int]:
    """HF hidden-state indices vLLM captures for this draft config.json (vLLM's own functions)."""
    from vllm.transformers_utils.config import get_config
    from vllm.transformers_utils.configs.eagle import EAGLEConfig
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    (tmp_path / "config.json").write_text(json.dumps(config))
    hf = EAGLEConfig(get_config(str(tmp_path), trust_remote_code=False), method="eagle3", model_type="eagle")
    runner = SimpleNamespace(speculative_config=SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=hf)))
    return list(GPUModelRunner._get_eagle3_aux_layers_from_config(runner))


def sglang_reads(config: dict, n_layers: int, deepseek: bool, newer: bool) -> list[int]:
    """HF hidden-state indices SGLang feeds the draft (the transcription the module docstring describes)."""
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        capture = [2, n_layers // 2, n_layers - 3]
    elif deepseek and newer and ids[0] != 1:
        capture = list(ids)
    else:
        capture = [i + 1 for i in ids]
    if 0 in capture:
        raise RuntimeError("SGLang adds a missing residual at layer 0's input")
    states = [i for i in range(n_layers) if i in capture]  # the input of layer i is HF hidden state i
    if len(states) != 3:
        raise RuntimeError(f"SGLang's fc takes 3 states, it captured {len(states)}")
    return states


@pytest.mark.parametrize("case", list(READABLE))
def test_both_engines_read_the_layers_the_draft_trained_on(case, tmp_path):
    target, ids = READABLE[case]
    d = _draft(target, ids)
    config = vllm_config(d, "bfloat16", ("vllm", "sglang"))
    assert vllm_reads(config, tmp_path) == list(ids)
    deepseek = case.startswith("kimi")
    for newer in (False, True):  # both releases of SGLang's deepseek_v2.py (the same code for Llama)
        assert sglang_reads(config, d.target_layers, deepseek, newer) == list(ids), (case, newer)


def test_without_sglangs_key_sglang_drafts_from_its_own_default_layers(tmp_path):
    """What the key prevents: non-default layers exported for vLLM only read as SGLang's default."""
    d = _draft(LLAMA31_8B, (1, 10, 31))
    config = vllm_config(d, "bfloat16", ("vllm",))
    assert "eagle_config" not in config and vllm_reads(config, tmp_path) == [1, 10, 31]
    assert sglang_reads(config, 32, deepseek=False, newer=True) == [2, 16, 29]


REFUSED = {  # (target, ids, options, the engine that cannot, words of the message)
    "the last layer's output": (LLAMA31_8B, (2, 16, 32), {}, "sglang", "aux layer ids [32]"),
    "the embeddings": (LLAMA31_8B, (0, 16, 29), {}, "sglang", "aux layer ids [0]"),
    "four layers": (LLAMA31_8B, (2, 10, 20, 29), {}, "sglang", "exactly 3"),
    "a kimi first id other than 2": (KIMI_K25, (3, 30, 58), {}, "sglang", "deepseek_v3 target"),
    "a draft option": (LLAMA31_8B, (2, 16, 29), {"norm_before_residual": True}, "sglang", "['norm_before_residual']"),
    "past the last layer": (LLAMA31_8B, (2, 16, 33), {}, "vllm", "outside 0..32"),
    "not ascending": (KIMI_K25, (30, 2, 58), {}, "vllm", "not strictly ascending"),
    "twice the same": (LLAMA31_8B, (2, 16, 16), {}, "vllm", "not strictly ascending"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_ids_an_engine_cannot_express_are_refused_by_name(case, tmp_path):
    target, ids, options, engine, words = REFUSED[case]
    d = _draft(target, ids, **options)
    with pytest.raises(BadInput, match=words.replace("[", r"\[").replace("]", r"\]")):
        vllm_config(d, "bfloat16", ("vllm", "sglang"))
    if engine == "sglang":  # vLLM alone takes them, and reads what the draft trained on
        assert vllm_reads(vllm_config(d, "bfloat16", ("vllm",)), tmp_path) == list(ids)
    else:
        with pytest.raises(BadInput):
            vllm_config(d, "bfloat16", ("vllm",))
