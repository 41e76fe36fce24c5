"""The vLLM backend of remote.capture.capture: the serving engine, tensor parallel, with the capture
worker extension (remote.capture.worker) hooked into its decoder layers (interface: remote.capture.backend)."""
from __future__ import annotations

import time
from typing import Callable, Sequence

import numpy as np

from remote.capture.backend import OnWritten, Progress
from remote.capture.cache import ShardPlan
from remote.capture.layers import TargetConfig
from remote.engine.lifecycle import ALL_CORES_CPU_ENV, VllmEngine, target_engine_kwargs
from remote.step import BadInput, log

WORKER_EXTENSION = "remote.capture.worker.CaptureWorkerExtension"
PARAM = "capture.tensor_parallel_size"  # the flow's name of the count the device check may refuse


class VllmCapture:
    """A vLLM engine with the capture extension: `capture` writes shards, `prefill` only runs them.

        engine = VllmCapture(cfg, target, dtype, layer_ids, max_len)
        engine.start()
        engine.capture(plans, on_written, progress)
        engine.close()
    """

    def __init__(self, cfg, target: TargetConfig, dtype: str, layer_ids: Sequence[int], max_len: int):
        self.cfg, self.target, self.dtype, self.layer_ids = cfg, target, dtype, list(layer_ids)
        self.max_model_len = cfg.max_model_len or max_len + 1
        self.engine = VllmEngine(cfg, target.weight_bytes, PARAM)
        self.layers_path = ""  # where the hooked decoder layers sit in vLLM's model (set by capture)

    @property
    def llm(self):
        return self.engine.llm

    @property
    def startup_s(self) -> float:
        return self.engine.startup_s

    def engine_kwargs(self, on_cpu: bool) -> dict:
        return {**target_engine_kwargs(self.cfg, self.cfg.target, self.dtype, self.max_model_len, self.target.is_mla,
                                       self.cfg.trust_remote_code, on_cpu),
                "worker_extension_cls": WORKER_EXTENSION,
                "enforce_eager": True,  # hooks added after vLLM compiled the model would be skipped silently
                "enable_prefix_caching": False,  # a cached prefix is not computed, so it could not be captured
                "skip_tokenizer_init": True}

    def start(self) -> None:
        self.engine.start(self.engine_kwargs, ALL_CORES_CPU_ENV)

    def close(self) -> None:
        """Shut the engine down and end whatever of it is left: nothing outlives the capture."""
        self.engine.close()

    def _rank0(self, method: str, *args) -> dict:
        """Call a worker method on every rank; the answer of the one rank that captures."""
        answers = [a for a in self.llm.collective_rpc(method, args=args) if a is not None]
        if len(answers) != 1:
            raise RuntimeError(f"{method}: expected one capturing rank, got {len(answers)} answers")
        return answers[0]

    def _run(self, requests: Sequence[tuple[str, np.ndarray, Callable[[], None] | None]],
             on_finished: Callable[[str], None], poll: Callable[[], None] = lambda: None) -> None:
        """Feed (request id, prompt, called-before-submit) through the engine, ~2x max_num_seqs in flight."""
        from vllm import SamplingParams

        engine = self.llm.llm_engine
        params = SamplingParams(max_tokens=1, detokenize=False)
        head, window = 0, 2 * self.cfg.max_num_seqs
        while head < len(requests) or engine.has_unfinished_requests():
            while head < len(requests) and engine.get_num_unfinished_requests() < window:
                rid, ids, before = requests[head]
                if before is not None:
                    before()
                engine.add_request(rid, {"prompt_token_ids": ids.tolist()}, params)
                head += 1
            for out in engine.step():
                if out.finished:
                    on_finished(out.request_id)
            poll()

    def capture(self, plans: Sequence[ShardPlan], on_written: OnWritten, prog: Progress) -> dict:
        """Capture the planned shards; on_written(plan) after each shard is whole on disk."""
        from remote.capture.worker import DISK_FULL, parse_request_id, request_id

        hooked = self._rank0("eaglet_capture_begin", self.layer_ids, self.cfg.storage_dtype)
        self.layers_path = hooked["layers"]
        log(f"hooked .{hooked['layers']}: layers {hooked['hooked']} of {hooked['num_layers']}")
        by_index = {p.index: p for p in plans}
        recorded: set[int] = set()
        last_poll = [0.0]

        def collect(status: dict) -> None:
            if status["error"]:  # a full disk is bad input (retrying cannot help); anything else a fault
                raise (BadInput if status["error"].startswith(DISK_FULL) else RuntimeError)(
                    f"capture worker: {status['error']}")
            for index in status["written"]:
                if index not in recorded:
                    recorded.add(index)
                    on_written(by_index[index])

        def poll() -> None:
            if time.monotonic() - last_poll[0] >= 1.0:
                last_poll[0] = time.monotonic()
                collect(self._rank0("eaglet_capture_status"))

        def on_finished(req_id: str) -> None:
            where = parse_request_id(req_id)
            if where is not None:
                prog.add(1, int(by_index[where[0]].samples[where[1]].input_ids.size))

        # a shard's plan reaches the worker before the first of its requests
        requests = [(request_id(p.index, slot), s.input_ids,
                     (lambda p=p: self._rank0("eaglet_plan_shard", _wire_plan(p))) if slot == 0 else None)
                    for p in plans for slot, s in enumerate(p.samples)]
        try:
            self._run(requests, on_finished, poll)
        finally:
            final = self._rank0("eaglet_capture_end")
        collect(final)
        pending = {i: ids for i, ids in final["pending"].items() if ids}
        if pending or len(recorded) != len(plans):
            raise RuntimeError(f"capture ended with shards unwritten: {sorted(set(by_index) - recorded)}; "
                               f"samples never fully seen: {pending}")
        return {k: final[k] for k in ("passes", "multi_request_passes", "max_passes_per_sample")}

    def prefill(self, prompts: Sequence[np.ndarray]) -> float:
        """Run prompts through the same engine and batching without capturing; returns seconds."""
        t0 = time.monotonic()
        self._run([(f"prefill.{i}", p, None) for i, p in enumerate(prompts)], lambda req_id: None)
        return time.monotonic() - t0


def _wire_plan(plan: ShardPlan) -> dict:
    """A shard plan as the worker takes it: plain lists and bytes (collective_rpc serializes them)."""
    return {"index": plan.index, "path": plan.path, "sample_ids": [s.sample_id for s in plan.samples],
            "splits": [s.split for s in plan.samples], "lengths": [int(s.input_ids.size) for s in plan.samples],
            "input_ids": b"".join(s.input_ids.astype(np.int32).tobytes() for s in plan.samples),
            "loss_mask": b"".join(s.loss_mask.astype(np.uint8).tobytes() for s in plan.samples)}


