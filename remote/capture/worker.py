"""The vLLM worker extension that records a target's hidden states during prefill and writes shards.

    llm = vllm.LLM(target, worker_extension_cls="remote.capture.worker.CaptureWorkerExtension",
                   enforce_eager=True, enable_prefix_caching=False, ...)
    llm.collective_rpc("eaglet_capture_begin", args=([2, 15, 27], "fp8"))  # hooks on; the storage dtype
    llm.collective_rpc("eaglet_plan_shard", args=(plan,))                 # before its requests
    llm.llm_engine.add_request(request_id("3", 0), {"prompt_token_ids": ids}, SamplingParams(max_tokens=1))
    llm.collective_rpc("eaglet_capture_status")    # -> [{"written": [...], "error": ...}, None, ...]
    llm.collective_rpc("eaglet_capture_end")       # drains the writer, hooks off

remote.capture.capture drives it; this module needs vLLM only inside the worker. Why it looks like this:
- Forward hooks on the decoder layers read `hidden_states + residual` (vLLM's decoder layer returns the two
  apart; their sum is the residual stream, HF's hidden state: tests/test_capture_vllm.py compares them) at the
  aux layers and the last layer. vLLM compiles the model once and then skips Python hooks
  added later without a word, so the engine runs eager (`enforce_eager=True`) and every pass checks
  that the hooks fired. Prefix caching is off: a cached prefix is never computed, so never captured.
- One pass holds several requests, one request spans several passes (chunked prefill), a preempted
  request is computed again: rows go to their sample at `num_computed_tokens + offset`, split by the
  forward context's `query_start_loc` in `input_batch.req_ids` order, and a coverage mask (not a
  count) says when a sample is whole.
- The driver names each request after its shard and slot (`request_id`), sends the shard's plan
  (paths, ids, tokens, masks) first, and keeps only a few shards in flight, so memory is bounded.
- After the all-reduce every tensor-parallel rank holds the same states: only rank 0 hooks and
  writes; the other ranks do nothing. A writer thread packs (fp8: quantizes) and writes finished shards
  (capture_store.write_shard: temporary name, then rename) off the forward path; its queue is
  short, so a slow disk holds the engine back instead of filling memory.
"""
from __future__ import annotations

import errno
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from remote.capture.store import Sample, write_shard
from remote.capture.layers import find_decoder_layers, hooked_layer

REQUEST_PREFIX = "eaglet"
WRITE_QUEUE = 2  # finished shards waiting for the disk; more would only hold more memory
DISK_FULL = "disk full writing"  # how a writer error caused by a full disk starts


def request_id(shard: int, slot: int) -> str:
    """The external request id of sample `slot` of shard `shard` (vLLM appends '-<random>')."""
    return f"{REQUEST_PREFIX}.{shard}.{slot}"


def parse_request_id(req_id: str) -> tuple[int, int] | None:
    """(shard, slot) of a request named by request_id, or None for anyone else's request."""
    parts = req_id.split("-", 1)[0].split(".")
    if len(parts) != 3 or parts[0] != REQUEST_PREFIX:
        return None
    return int(parts[1]), int(parts[2])


@dataclass
class _PlannedShard:
    """One shard being filled: its samples' buffers and which of their rows have been seen."""

    index: int
    path: str
    sample_ids: list[str]
    splits: list[str]
    input_ids: list[torch.Tensor]
    loss_mask: list[torch.Tensor]
    hidden: list[torch.Tensor | None] = field(default_factory=list)  # [L, n_aux * H], allocated on first rows
    last: list[torch.Tensor | None] = field(default_factory=list)  # [L, H]
    seen: list[torch.Tensor | None] = field(default_factory=list)  # [L] bool
    missing: list[int] = field(default_factory=list)  # rows still unseen, per sample
    passes: list[int] = field(default_factory=list)  # forward passes that carried rows of each sample

    def __post_init__(self):
        n = len(self.sample_ids)
        self.hidden, self.last, self.seen = [None] * n, [None] * n, [None] * n
        self.missing = [int(t.numel()) for t in self.input_ids]
        self.passes = [0] * n

    @property
    def complete(self) -> bool:
        return not any(self.missing)

    def samples(self) -> list[Sample]:
        return [Sample(sid, sp, ids, mask, h, last) for sid, sp, ids, mask, h, last in
                zip(self.sample_ids, self.splits, self.input_ids, self.loss_mask, self.hidden, self.last)]


class Recorder:
    """What rank 0 keeps between passes: the planned shards, the rows seen, the writer thread.

    Knows nothing of vLLM: `on_pass` takes the pass's request ids, query_start_loc, the tokens each
    request had computed before the pass, and the pass's states [T, (n_aux + 1) * H].
    """

    def __init__(self, layer_ids: Sequence[int], storage: str = "auto"):
        self.layer_ids = list(layer_ids)
        self.storage = storage  # of the shards' states: "auto" (as captured) or "fp8"
        self.shards: dict[int, _PlannedShard] = {}
        self.written: list[int] = []
        self.error: str | None = None
        self.passes = 0
        self.multi_request_passes = 0  # passes that held rows of more than one sample
        self.max_passes_per_sample = 0  # > 1 means chunked prefill split some sample
        self.tokens = 0
        self._queue: queue.Queue = queue.Queue(maxsize=WRITE_QUEUE)
        self._writer = threading.Thread(target=self._write_loop, name="eaglet-shard-writer", daemon=True)
        self._writer.start()

    # -------------------------------------------------------------- from the driver
    def plan(self, plan: dict) -> None:
        lengths = [int(n) for n in plan["lengths"]]
        ids = torch.from_numpy(np.frombuffer(plan["input_ids"], dtype=np.int32).copy())
        mask = torch.from_numpy(np.frombuffer(plan["loss_mask"], dtype=np.uint8).copy())
        if ids.numel() != sum(lengths) or mask.numel() != sum(lengths):
            raise ValueError(f"shard {plan['index']}: plan has {ids.numel()} ids, {mask.numel()} mask values "
                             f"for {sum(lengths)} tokens")
        self.shards[int(plan["index"])] = _PlannedShard(
            index=int(plan["index"]), path=plan["path"], sample_ids=list(plan["sample_ids"]),
            splits=list(plan["splits"]), input_ids=list(ids.split(lengths)), loss_mask=list(mask.split(lengths)))

    def status(self) -> dict:
        return {"written": list(self.written), "error": self.error, "passes": self.passes, "tokens": self.tokens,
                "multi_request_passes": self.multi_request_passes,
                "max_passes_per_sample": self.max_passes_per_sample,
                "pending": {i: [s.sample_ids[k] for k, m in enumerate(s.missing) if m]
                            for i, s in self.shards.items()}}

    def close(self) -> dict:
        """Wait for the writer to finish what it has; the final status."""
        self._queue.put(None)
        self._writer.join()
        return self.status()

    # -------------------------------------------------------------- from the hooks
    def on_pass(self, req_ids: Sequence[str], query_start_loc: Sequence[int], computed: Sequence[int],
                states: torch.Tensor) -> None:
        """File the rows of one forward pass under their samples; queue every shard that became whole."""
        self.passes += 1
        aux_width = states.shape[1] - states.shape[1] // (len(self.layer_ids) + 1)
        carried, done = 0, []
        for k, rid in enumerate(req_ids):
            where = parse_request_id(rid)
            a, b = int(query_start_loc[k]), int(query_start_loc[k + 1])
            shard = self.shards.get(where[0]) if where else None
            if shard is None or b <= a:
                continue
            slot = where[1]
            length = int(shard.input_ids[slot].numel())
            start = int(computed[k])
            stop = min(start + (b - a), length)  # a decode row (past the prompt) is not captured
            if stop <= start:
                continue
            rows = states[a:a + stop - start]
            if shard.hidden[slot] is None:
                shard.hidden[slot] = torch.empty((length, aux_width), dtype=states.dtype)
                shard.last[slot] = torch.empty((length, states.shape[1] - aux_width), dtype=states.dtype)
                shard.seen[slot] = torch.zeros(length, dtype=torch.bool)
            shard.hidden[slot][start:stop] = rows[:, :aux_width]
            shard.last[slot][start:stop] = rows[:, aux_width:]
            seen = shard.seen[slot][start:stop]
            shard.missing[slot] -= int((~seen).sum())
            seen.fill_(True)
            shard.passes[slot] += 1
            self.max_passes_per_sample = max(self.max_passes_per_sample, shard.passes[slot])
            self.tokens += stop - start
            carried += 1
            if shard.complete:
                done.append(shard.index)
        self.multi_request_passes += carried > 1
        for index in done:
            self._queue.put(self.shards.pop(index))  # blocks while the disk is behind: back-pressure

    def _write_loop(self) -> None:
        while (shard := self._queue.get()) is not None:
            if self.error is not None:
                continue  # after a failed write, drop the rest: the run fails and resumes later
            try:
                write_shard(shard.path, shard.samples(), self.layer_ids, self.storage)
                self.written.append(shard.index)
            except Exception as e:  # noqa: BLE001 - reported to the driver through status()
                full = isinstance(e, OSError) and e.errno == errno.ENOSPC
                self.error = f"{DISK_FULL if full else 'writing'} shard {shard.path}: {type(e).__name__}: {e}"


def _residual_stream(output: Any) -> torch.Tensor:
    """hidden_states + residual of a decoder layer's output (a tensor for layers without residual)."""
    if isinstance(output, torch.Tensor):
        return output
    hidden, residual = output[0], output[1] if len(output) > 1 else None
    return hidden if residual is None else hidden + residual  # a new tensor: the next layer's norm works in place


def _query_start_loc(attn_metadata: Any) -> list[int]:
    if not isinstance(attn_metadata, dict):
        raise RuntimeError(f"eaglet capture: attention metadata of type {type(attn_metadata).__name__} "
                           "(micro-batching?) is not supported; run without dual-batch overlap")
    for md in attn_metadata.values():
        qsl = getattr(md, "query_start_loc_cpu", None)
        if qsl is None:
            qsl = getattr(md, "query_start_loc", None)
        if qsl is not None:
            return qsl.tolist()
    raise RuntimeError("eaglet capture: no attention metadata of this pass has query_start_loc")


class CaptureWorkerExtension:
    """Methods vLLM mixes into its worker class; the driver calls them through collective_rpc.

    Every name starts with eaglet_ (vLLM refuses an extension whose names clash with the worker's).
    """

    def eaglet_capture_begin(self, layer_ids: list[int], storage: str = "auto") -> dict | None:
        """Hook the aux layers and the last layer (rank 0 only), shards stored in `storage` ("auto" or
        "fp8"); returns what was hooked there."""
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        if get_pp_group().world_size != 1:
            raise RuntimeError("eaglet capture supports tensor parallelism only (pipeline_parallel_size=1)")
        if get_tp_group().rank_in_group != 0:
            return None  # the all-reduce left this rank the same states as rank 0: nothing to do
        self.eaglet_capture_end()
        model = self.model_runner.get_model()
        path, layers = find_decoder_layers(model)
        rec = Recorder(layer_ids, storage)
        state = {"aux": {}, "fired": 0}
        wanted = {hooked_layer(i): n for n, i in enumerate(layer_ids)}
        last = len(layers) - 1

        def aux_hook(index):
            def hook(module, args, output):
                state["aux"][wanted[index]] = _residual_stream(output)
            return hook

        def last_hook(module, args, output):
            state["fired"] += 1
            final = _residual_stream(output)
            aux = [state["aux"].pop(n) for n in range(len(layer_ids))]
            self._eaglet_on_pass(rec, torch.cat(aux + [final], dim=-1))

        def pre_forward(module, args, kwargs):
            state["fired"], state["aux"] = 0, {}

        def post_forward(module, args, kwargs, output):
            if state["fired"] == 0 and rec.shards and rec.error is None:
                rec.error = ("the decoder-layer hooks did not run in a forward pass: the model was compiled "
                             "(capture needs enforce_eager=True)")

        handles = [layers[i].register_forward_hook(aux_hook(i)) for i in wanted]
        handles.append(layers[last].register_forward_hook(last_hook))
        handles.append(model.register_forward_pre_hook(pre_forward, with_kwargs=True))
        handles.append(model.register_forward_hook(post_forward, with_kwargs=True))
        self._eaglet = (rec, handles)
        return {"layers": path, "num_layers": len(layers), "hooked": sorted(wanted) + [last]}

    def eaglet_plan_shard(self, plan: dict) -> bool | None:
        if getattr(self, "_eaglet", None) is None:
            return None
        self._eaglet[0].plan(plan)
        return True

    def eaglet_capture_status(self) -> dict | None:
        return self._eaglet[0].status() if getattr(self, "_eaglet", None) is not None else None

    def eaglet_capture_end(self) -> dict | None:
        """Drain the writer, remove the hooks; the final status (None where nothing was hooked)."""
        if getattr(self, "_eaglet", None) is None:
            return None
        rec, handles = self._eaglet
        for h in handles:
            h.remove()
        self._eaglet = None
        return rec.close()

    def _eaglet_on_pass(self, rec: Recorder, states: torch.Tensor) -> None:
        from vllm.forward_context import get_forward_context

        batch = self.model_runner.input_batch
        req_ids = list(batch.req_ids)
        qsl = _query_start_loc(get_forward_context().attn_metadata)
        real = qsl[len(req_ids)]
        if states.shape[0] < real:
            raise RuntimeError(f"eaglet capture: a layer returned {states.shape[0]} rows for {real} tokens "
                               "(sequence-parallel layers are not supported)")
        computed = batch.num_computed_tokens_cpu[:len(req_ids)].tolist()
        rec.on_pass(req_ids, qsl, computed, states[:real].to("cpu"))


def api_problems() -> list[str]:
    """What this extension needs from vLLM and the installed vLLM lacks (run in the host's Python)."""
    import inspect

    problems = []
    for module, names in (("vllm.forward_context", ("get_forward_context",)),
                          ("vllm.distributed.parallel_state", ("get_tp_group", "get_pp_group")),
                          ("vllm.v1.worker.gpu_input_batch", ("InputBatch",)),
                          ("vllm.v1.worker.gpu_model_runner", ("GPUModelRunner",))):
        try:
            mod = __import__(module, fromlist=list(names))
        except Exception as e:  # noqa: BLE001 - any import failure is a missing API here
            problems.append(f"{module} does not import: {type(e).__name__}: {e}")
            continue
        problems += [f"{module}.{n} is missing" for n in names if not hasattr(mod, n)]
    if not problems:
        from vllm.v1.worker.gpu_input_batch import InputBatch
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        init = inspect.getsource(InputBatch.__init__)
        problems += [f"InputBatch has no {n}" for n in ("req_ids", "num_computed_tokens_cpu")
                     if n not in init and not hasattr(InputBatch, n)]
        problems += [f"GPUModelRunner has no {n}" for n in ("get_model",) if not hasattr(GPUModelRunner, n)]
    return problems
