"""The engines of remote.data.regenerate: the target answering prompts, in vLLM or in transformers.

    engine = VllmGenerator(cfg, target, dtype, end_ids, max_model_len)   # or HfGenerator: the same calls
    engine.start()
    answers = engine.generate([Request(prompt_ids, seed, greedy), ...], options)  # an Answer a request, in order
    engine.close()                                                        # nothing of the engine is left

A library module below the step (which imports its Request and Answer); torch, vLLM and transformers
are imported only when an engine starts, so the step's module stays light. The vLLM engine's life is
remote.engine's (the device check, signals, a start timeout, every engine process ended at close);
the transformers one loads the target as the transformers capture does (remote.capture.backend_transformers).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from remote.data.config import RegenerateOptions
from remote.engine.lifecycle import ALL_CORES_CPU_ENV, VllmEngine, target_engine_kwargs

PARAM = "data.regenerate.tensor_parallel_size"  # the flow's name of the count the device check may refuse


@dataclass(frozen=True)
class Request:
    prompt_ids: list[int]
    seed: int
    greedy: bool


@dataclass(frozen=True)
class Answer:
    token_ids: list[int]  # what the target wrote, its end-of-turn token included when it wrote one
    stopped: bool  # ended at an end-of-turn token (False: cut at max_tokens)


def sampling_params(cfg: RegenerateOptions, request: Request, end_ids: Iterable[int]):
    """vLLM's SamplingParams of one request (the tests give the same ones to vLLM's own generate)."""
    from vllm import SamplingParams

    return SamplingParams(n=1, temperature=0.0 if request.greedy else cfg.temperature,
                          top_p=1.0 if request.greedy else cfg.top_p, max_tokens=cfg.max_tokens,
                          seed=request.seed, stop_token_ids=list(end_ids), detokenize=False)


class VllmGenerator:
    """A vLLM engine of the target set up for generation (remote.engine's lifecycle)."""

    def __init__(self, cfg, target, dtype: str, end_ids: Iterable[int], max_model_len: int):
        self.cfg, self.target, self.dtype = cfg, target, dtype
        self.max_model_len = max_model_len  # the step's context (cfg.max_model_len 0: the target's own)
        self.end_ids = list(end_ids)
        self.engine = VllmEngine(cfg, target.weight_bytes, PARAM)

    @property
    def llm(self):
        return self.engine.llm

    def engine_kwargs(self, on_cpu: bool) -> dict:
        kw = target_engine_kwargs(self.cfg, self.cfg.target, self.dtype, self.max_model_len, self.target.is_mla,
                                  self.cfg.trust_remote_code, on_cpu)
        # Compiled graphs and prefix caching (later turns share their prompt) pay for generation; on
        # the CPU compiling would cost minutes. vLLM's tokenizer gives it the target's own stop tokens.
        kw.update(enforce_eager=on_cpu, enable_prefix_caching=True, skip_tokenizer_init=False, seed=self.cfg.seed)
        return kw

    def start(self) -> None:
        self.engine.start(self.engine_kwargs, ALL_CORES_CPU_ENV)

    def close(self) -> None:
        self.engine.close()

    def generate(self, requests: list[Request], opts: RegenerateOptions) -> list[Answer]:
        params = [sampling_params(opts, r, self.end_ids) for r in requests]
        outs = self.llm.generate([{"prompt_token_ids": r.prompt_ids} for r in requests], params, use_tqdm=False)
        return [Answer(list(o.outputs[0].token_ids), o.outputs[0].finish_reason == "stop") for o in outs]


class HfGenerator:
    """transformers' generate on one device, batch_size prompts of similar length at a time. Batched
    sampling draws from one generator, so a sampled answer depends on its batch (greedy ones do not).
    The target is loaded and checked as the transformers capture loads it (HfCapture, no aux layers)."""

    def __init__(self, cfg, target, dtype: str, end_ids: Iterable[int], max_model_len: int):
        from remote.capture.backend_transformers import HfCapture

        self.cfg = cfg
        self.loaded = HfCapture(cfg, target, dtype, (), max_model_len)
        self.end_ids = list(end_ids)

    def start(self) -> None:
        self.loaded.start()
        self.model, self.device = self.loaded.model, self.loaded.device

    def close(self) -> None:
        self.loaded.close()
        self.model = None

    def generate(self, requests: list[Request], opts: RegenerateOptions) -> list[Answer]:
        answers: list[Answer | None] = [None] * len(requests)
        # one split (greedy or not) a batch, similar lengths together: little padding
        order = sorted(range(len(requests)), key=lambda i: (requests[i].greedy, len(requests[i].prompt_ids)))
        step = self.cfg.batch_size
        for batch in (order[k:k + step] for k in range(0, len(order), step)):
            for greedy in (True, False):
                part = [i for i in batch if requests[i].greedy == greedy]
                if part:
                    for i, a in zip(part, self._batch([requests[i] for i in part], opts)):
                        answers[i] = a
        return answers

    def _batch(self, requests: list[Request], opts: RegenerateOptions) -> list[Answer]:
        import torch

        width, pad = max(len(r.prompt_ids) for r in requests), self.end_ids[0]
        ids = torch.tensor([[pad] * (width - len(r.prompt_ids)) + r.prompt_ids for r in requests])
        attn = torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in requests])
        greedy = requests[0].greedy
        torch.manual_seed(requests[0].seed)
        sampling = {} if greedy else {"temperature": opts.temperature, "top_p": opts.top_p, "top_k": 0}
        with torch.no_grad():
            out = self.model.generate(input_ids=ids.to(self.device), attention_mask=attn.to(self.device),
                                      do_sample=not greedy, max_new_tokens=opts.max_tokens,
                                      eos_token_id=self.end_ids, pad_token_id=pad, **sampling)
        return [until_end(row[width:].tolist(), self.end_ids) for row in out]


def until_end(ids: list[int], end_ids: list[int]) -> Answer:
    """An answer up to and with its first end-of-turn token (what follows is padding)."""
    for k, t in enumerate(ids):
        if t in end_ids:
            return Answer(ids[: k + 1], True)
    return Answer(ids, False)
