"""The draft kinds, found by name: each kind is one module, registered here by one line of KINDS.

    from remote.draft.registry import kind
    k = kind("eagle3")                                    # remote.draft.eagle3.Eagle3 (BadInput: no such kind)
    k = kind_for_target("auto", read_config(target))      # eagle3_mla for an MLA target, else eagle3
    cfg = k.config.from_target_dir(target, draft_vocab_size=32000, aux_layer_ids=(2, 16, 29))
    draft = k.model(cfg)                                  # the nn.Module the trainer trains
    objective = k.objective(draft, ttt_steps, decay, attention, compiled)   # loss, per-step stats
    guesses = k.guesses(draft, batch, steps)              # [T, steps] draft ids: its proposal rule, offline
    config_json = k.export_config(cfg, "bfloat16", k.engines(cfg))         # what vLLM reads

A kind is a subclass of DraftKind (below): its config dataclass, its model class, its training objective, its
proposal rule (a chain for EAGLE-3, a block for a block drafter: either way the guesses row t makes for tokens
t+2..t+1+steps, which remote.evaluate.chains scores), how it is exported (config.json, the engines that serve
it, the model card) and how its config.json is read back. remote/draft/folder.py is the one reader and writer
of the exported folder (config.json, model.safetensors), and finds a folder's kind by its architecture
(kind_of_export). Adding a kind: docs/MAP.md, Recipes, "A draft kind".
"""
from __future__ import annotations

import importlib
from functools import cache
from typing import TYPE_CHECKING, Any

from remote.step import BadInput
from remote.target import is_mla

if TYPE_CHECKING:
    import torch
    from torch import nn

# name -> "module:class" of its DraftKind; one line a kind
KINDS = {
    "eagle3": "remote.draft.eagle3:Eagle3",
    "dflash": "remote.draft.dflash:DFlash",
    "eagle3_mla": "remote.draft.eagle3_mla:Eagle3MLA",
    "dspark": "remote.draft.dspark:DSpark",
}
DEFAULT = "eagle3"  # the kind a train folder without a recorded kind holds
AUTO = "auto"  # train.draft's default: the EAGLE-3 kind whose layer is the target's attention (kind_for_target)


class DraftKind:
    """What a draft kind offers; subclass it (or its nearest relative) and register the subclass in KINDS.

    The model class takes the config alone and offers what the trainer and the evaluation use of every draft:
    `embed_tokens` (the target's embedding, frozen, never exported), `lm_head` over the draft vocabulary,
    `trainable_state_dict()` (the weights a checkpoint and the export keep, under the names vLLM loads) and
    `compile_layers()` (torch.compile of its dense parts, on a GPU).
    """

    name: str = ""  # the key in KINDS: what a train manifest records (train.kind)
    architecture: str = ""  # config.json's architectures[0]: how an exported folder names its kind
    method: str = ""  # vLLM's speculative_config method that serves it
    export_format: str = ""  # the export manifest's export.format
    config: type  # its config dataclass: from_target_dir(target, draft_vocab_size=, aux_layer_ids=, **overrides),
    #               from_dict, to_dict, and the shapes the trainer reads (hidden_size, rms_norm_eps, target_vocab_size)
    model: type  # its nn.Module, built from a config

    def objective(self, draft: nn.Module, ttt_steps: int, decay: float, attention: str, compiled: bool) -> nn.Module:
        """The training objective: a module called as objective(batch, targets, denom) -> (loss, stats [K, 3])."""
        raise NotImplementedError

    def guesses(self, draft: nn.Module, batch, steps: int, attention: str = "dense",
                compiled: bool = False) -> torch.Tensor:
        """[T, steps] draft ids: at row t, the guesses for tokens t+2..t+1+steps (teacher-forced on the batch)."""
        raise NotImplementedError

    def serving_problems(self, target_config: dict) -> list[str]:
        """Why vLLM 0.32 could not serve a draft of this kind beside this target ([]: it can)."""
        return []

    def drafted_tokens(self, cfg: Any) -> int | None:
        """The tokens a draft of this config proposes a step, the num_speculative_tokens it is served with: a block
        drafter's block is part of the model; None for a chain drafter (any k)."""
        return None

    def auto_overrides(self, target_config: dict) -> dict:
        """draft_overrides this kind takes when train.draft "auto" chose it (the user's own still win)."""
        return {}

    def engines(self, cfg: Any) -> tuple[str, ...]:
        """The serving engines this draft is exported for by default (those that run it as trained)."""
        return ("vllm",)

    def export_config(self, cfg: Any, dtype: str, engines: tuple[str, ...]) -> dict:
        """config.json of the exported folder; BadInput for what the engines cannot serve (before any write)."""
        raise NotImplementedError

    def config_from_export(self, config: dict) -> Any:
        """The config of an exported folder's config.json: the inverse of export_config."""
        raise NotImplementedError

    def export_record(self, cfg: Any) -> dict:
        """The kind's own keys of the export manifest's `export` record."""
        return {}

    def card(self, name: str, train_m: dict, vocab_m: dict | None, cfg: Any, engines: tuple[str, ...]) -> str:
        """The exported folder's README.md: what the draft is and how each engine serves it."""
        raise NotImplementedError


@cache
def kind(name: str) -> DraftKind:
    """The registered kind of this name; BadInput naming the kinds there are."""
    if name not in KINDS:
        raise BadInput(f"draft kind {name!r} is not one of {sorted(KINDS)}")
    module, _, cls = KINDS[name].partition(":")
    return getattr(importlib.import_module(module), cls)()


def kind_for_target(name: str, target_config: dict) -> DraftKind:
    """train.draft's kind: the one named, or for "auto" eagle3_mla when the target's attention is MLA (its text
    config has kv_lora_rank: DeepSeek-V3, Kimi-K2.5; published Kimi-K2.5 drafts at k = 3 on MT-Bench read 2.94
    with an MLA layer against 2.69 with a Llama one), else eagle3."""
    if name != AUTO:
        return kind(name)
    return kind("eagle3_mla" if is_mla(target_config) else DEFAULT)


def kinds() -> list[DraftKind]:
    return [kind(name) for name in KINDS]


def kind_of_export(config: dict, where: str) -> DraftKind:
    """The kind of an exported folder, by its config.json's architectures; BadInput when no kind has them."""
    got = config.get("architectures") or []
    for k in kinds():
        if k.architecture in got:
            return k
    raise BadInput(f"{where}: architectures {config.get('architectures')} is not {[k.architecture for k in kinds()]}")


def kind_of_model(draft: nn.Module) -> DraftKind:
    """The kind whose model class built this draft (its own class, not a relative's)."""
    for k in kinds():
        if type(draft) is k.model:
            return k
    raise TypeError(f"{type(draft).__name__} is no registered draft kind's model ({sorted(KINDS)})")
