"""The transformers backend of remote.capture.capture: plain HF forwards, packed, writing the same shards.

    python -m remote.capture.capture --config c.json     # with "backend": "transformers"

For hosts without vLLM (the lent GPU machine), targets vLLM cannot load, and as the numerical
reference. A shard's samples go through the target longest first, as the rows of one batch of at
most max_num_batched_tokens tokens (rows x the longest row), each row padded on the right and no
attention mask: causal attention never lets a sample's tokens see the padding after them, and
attention costs each row its own length squared. (Packing samples back to back into one row, which
transformers reads as packed sequences, costs the whole row's length squared: its block-diagonal mask
is materialised, 2.5x slower a token at 8,192 tokens than at 2,048 on this CPU.) The shard is written
in its planned order. Aux states come from `output_hidden_states` (index i is layer i-1's output);
the final pre-norm state from a hook on the last decoder layer (HF's last hidden state has the norm applied).

The capture is causal for every target, as vLLM serves it: a config that asks for bidirectional
attention (PaliGemma's text model does by default) is loaded with it off, since a sample alone in its
pack gets no mask and attention then follows the layers' own `is_causal`; and a probe at start
refuses, naming the target, any model whose states at a position still change with a later token.
"""
from __future__ import annotations

import errno
import time
from typing import Sequence

import numpy as np
import torch

from remote.capture.cache import SampleRow, ShardPlan
from remote.capture.store import Sample, write_shard
from remote.capture.layers import TargetConfig, find_decoder_layers
from remote.step import BadInput, log


class HfCapture:
    """Load the target once (`start`), capture planned shards in order (`capture`)."""

    def __init__(self, cfg, target: TargetConfig, dtype: str, layer_ids: Sequence[int], max_len: int):
        self.cfg, self.target, self.dtype, self.layer_ids = cfg, target, dtype, list(layer_ids)
        self.model = None
        self.startup_s = 0.0
        self.layers_path = ""
        want = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        self.device = torch.device(want)

    def start(self) -> None:
        import transformers

        t0 = time.monotonic()
        config = causal_config(self.cfg.target, self.cfg.trust_remote_code)
        errors = []
        for auto in ("AutoModelForCausalLM", "AutoModelForImageTextToText"):
            try:
                self.model = getattr(transformers, auto).from_pretrained(
                    self.cfg.target, config=config, dtype=getattr(torch, self.dtype),
                    trust_remote_code=self.cfg.trust_remote_code)
                break
            except (ValueError, KeyError) as e:  # this auto class does not know the architecture
                errors.append(f"{auto}: {e}")
        if self.model is None:
            raise BadInput(f"transformers cannot load {self.cfg.target}: {'; '.join(errors)}")
        self.model.to(self.device).eval()
        self.layers_path, self.layers = find_decoder_layers(self.model)
        if len(self.layers) != self.target.num_layers:
            raise BadInput(f"{type(self.model).__name__} has {len(self.layers)} decoder layers, "
                           f"config.json says {self.target.num_layers}")
        self.check_causal()
        self.startup_s = time.monotonic() - t0
        log(f"transformers: {type(self.model).__name__} on {self.device} ({self.dtype}) in {self.startup_s:.1f} s")

    def close(self) -> None:
        self.model = None

    def check_causal(self, n: int = 16) -> None:
        """Refuse a target whose states at a position change when only a later token does: the draft
        learns from causal states, and vLLM serves causally. Two probes that differ in their last token,
        low ids (placeholders such as image tokens sit at the end of a vocabulary)."""
        ids = np.arange(10, 10 + n, dtype=np.int64) % self.target.vocab_size
        other = ids.copy()
        other[-1] = (ids[-1] + 1) % self.target.vocab_size
        (aux_a, last_a), = self.forward_pack([SampleRow("probe", "train", ids, np.zeros(n, np.uint8))])
        (aux_b, last_b), = self.forward_pack([SampleRow("probe", "train", other, np.zeros(n, np.uint8))])
        a, b = torch.cat([aux_a, last_a], -1)[:-1].float(), torch.cat([aux_b, last_b], -1)[:-1].float()
        moved = ((a - b).abs().max() / a.abs().max().clamp(min=1.0)).item()
        if moved > 1e-3:
            raise BadInput(f"target {self.cfg.target}: {type(self.model).__name__} is not causal here (states of "
                           f"earlier tokens moved by {moved:.2%} when only the last token changed); "
                           "eaglet captures what a causal decoder computes")

    def forward_pack(self, samples: Sequence) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(aux [T, n_aux * H], final [T, H]) per sample of one pack (one row each, padded on the right
        to the longest), on the CPU in the target dtype."""
        lengths = [int(s.input_ids.size) for s in samples]
        width = max(lengths)
        ids = torch.zeros(len(samples), width, dtype=torch.long)
        for row, s in enumerate(samples):
            ids[row, :lengths[row]] = torch.from_numpy(s.input_ids)
        pos = torch.arange(width).expand(len(samples), width)
        final = {}
        hook = self.layers[-1].register_forward_hook(
            lambda m, a, out: final.__setitem__("h", out[0] if isinstance(out, tuple) else out))
        try:
            with torch.inference_mode():
                out = self.model(input_ids=ids.to(self.device), position_ids=pos.to(self.device), attention_mask=None,
                                 use_cache=False, output_hidden_states=True, logits_to_keep=1)
        finally:
            hook.remove()
        # no aux layers: a generator's target (remote.data.regenerate_engines.HfGenerator) probes causality on the last
        aux = torch.cat([out.hidden_states[i] for i in self.layer_ids] or [out.hidden_states[-1][..., :0]], dim=-1)
        real = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).to(aux.device)  # [B, width]: not padding
        aux, last = aux[real].to("cpu"), final["h"][real].to("cpu")
        return list(zip(aux.split(lengths), last.split(lengths)))

    def packs(self, plan: ShardPlan) -> list[list[int]]:
        """The shard's samples (their indices) in batches of at most max_num_batched_tokens tokens, padding
        counted: longest first, so a batch's rows are of similar length. A longer sample is a batch alone."""
        order = sorted(range(len(plan.samples)), key=lambda i: -int(plan.samples[i].input_ids.size))
        packs: list[list[int]] = []
        for i in order:
            if packs and (len(packs[-1]) + 1) * int(plan.samples[packs[-1][0]].input_ids.size) \
                    <= self.cfg.max_num_batched_tokens:
                packs[-1].append(i)
            else:
                packs.append([i])
        return packs

    def shard_states(self, plan: ShardPlan, on_pack=lambda rows: None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(aux, final) of each of the shard's samples, in its planned order; on_pack(rows) after each forward."""
        states: list = [None] * len(plan.samples)
        for pack in self.packs(plan):
            rows = [plan.samples[i] for i in pack]
            for i, st in zip(pack, self.forward_pack(rows)):
                states[i] = st
            on_pack(rows)
        return states

    def capture(self, plans: Sequence[ShardPlan], on_written, prog) -> dict:
        passes = 0

        def done(rows) -> None:
            nonlocal passes
            passes += 1
            prog.add(len(rows), sum(int(s.input_ids.size) for s in rows))
        for plan in plans:
            samples = [Sample(s.sample_id, s.split, torch.from_numpy(s.input_ids), torch.from_numpy(s.loss_mask), aux, last)
                       for s, (aux, last) in zip(plan.samples, self.shard_states(plan, done))]
            try:
                write_shard(plan.path, samples, self.layer_ids, self.cfg.storage_dtype)
            except OSError as e:
                if e.errno == errno.ENOSPC:  # a full disk is bad input: retrying cannot help
                    raise BadInput(f"disk full writing shard {plan.path}: {e}") from e
                raise
            on_written(plan)
        return {"passes": passes}


def causal_config(target: str, trust_remote_code: bool):
    """The target's transformers config, with bidirectional attention turned off wherever it is asked
    for (the model's own config and its text model's: PaliGemma's defaults to on)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(target, trust_remote_code=trust_remote_code)
    except (ValueError, KeyError, OSError) as e:  # an unknown model type, a config it cannot parse
        raise BadInput(f"transformers cannot read the config of {target}: {e}") from e
    for part in (config, config.get_text_config()):
        if getattr(part, "use_bidirectional_attention", False):
            part.use_bidirectional_attention = False
    return config
