"""Serving advice: the number of speculative tokens that maximises the expected decode speed-up, from what the
evaluate step measured, and the lines to paste into vLLM and SGLang.

    advice = advise(result["offline"], result["online"], "eagle3", "/models/target", "/runs/r1/export")
    advice["k"], advice["speedup_by_k"]["2"], advice["vllm"]    # 2, 1.04, '--speculative-config ...'

The model. A decode step with k speculative tokens yields E(k) tokens (the acceptance length at k) and costs
T(k) = T_target x (1 + c k): the target's own step plus, for each drafted token, a share c of it (the draft's
forward and the target verifying one more token). Both come from the run's own measurements:
- E(k) for k = 1..offline steps: the offline chain count's expected acceptance length at each k (a chain draft
  is measured offline at ADVICE_MAX_K steps), scaled so that it equals the online figure at the served k;
- c from the served k0's online speed-up s0 over the target alone: s0 = E(k0) / (1 + c k0), so
  c = (E(k0) / s0 - 1) / k0, at the batch the online run decoded (eval.max_num_seqs).
The expected speed-up at k is E(k) / (1 + c k); the advice is its argmax over k. A block drafter (DFlash) is
served at its block size - 1, fixed by the model: no advice is made for it.
"""
from __future__ import annotations

import json

ADVICE_MAX_K = 7  # the speculative tokens the advice weighs, 1..this (a chain draft is measured offline that far)


def advise(offline: dict | None, online: dict | None, method: str, target: str, draft_dir: str) -> dict | None:
    """The advice, or None when the run measured too little for it (no offline chain, no online speed-up)."""
    if not offline or not online or "eagle3" not in online.get("arms", {}):
        return None
    by_k = offline.get("acceptance_length_by_k") or []
    served = online["arms"]["eagle3"]["greedy"]
    k0, e0, s0 = online["num_speculative_tokens"], served.get("acceptance_length"), served.get("speedup")
    if len(by_k) < 2 or e0 is None or not s0 or k0 >= len(by_k):
        return None
    cost = max(0.0, (e0 / s0 - 1) / k0)
    scale = (e0 - 1) / (by_k[k0] - 1) if by_k[k0] > 1 else 1.0
    expected = {k: 1 + scale * (by_k[k] - 1) for k in range(1, len(by_k))}
    speedup = {k: e / (1 + cost * k) for k, e in expected.items()}
    best = max(speedup, key=lambda k: (round(speedup[k], 9), -k))  # a tie goes to the smaller k
    return {"k": best, "speedup": speedup[best], "worth_it": speedup[best] > 1, "measured_at_k": k0,
            "draft_step_cost": cost, "offline_to_online": scale,
            "acceptance_length_by_k": {str(k): v for k, v in expected.items()},
            "speedup_by_k": {str(k): v for k, v in speedup.items()},
            "batch": online.get("max_num_seqs"), **serving_lines(method, target, draft_dir, best)}


def serving_lines(method: str, target: str, draft_dir: str, k: int) -> dict:
    """The flags that serve this draft at k: vLLM's --speculative-config; SGLang's for an EAGLE-3 draft."""
    spec = json.dumps({"method": method, "model": draft_dir, "num_speculative_tokens": k})
    out = {"vllm": f"vllm serve {target} --speculative-config '{spec}'"}
    if method == "eagle3":
        out["sglang"] = (f"python -m sglang.launch_server --model-path {target} --speculative-algorithm EAGLE3 "
                         f"--speculative-draft-model-path {draft_dir} --speculative-num-steps {k} "
                         f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}")
    return out


def advice_text(advice: dict) -> str:
    """One line for the log: the advised k, its expected speed-up, and the curve over k."""
    curve = ", ".join(f"{k}: {s:.2f}x" for k, s in advice["speedup_by_k"].items())
    verdict = "" if advice["worth_it"] else " (below 1x on this host: serve the target alone here)"
    return (f"serving advice: k = {advice['k']}, expected speed-up {advice['speedup']:.2f}x{verdict} "
            f"[{curve}]; a draft token costs {advice['draft_step_cost']:.3f} of a target step at batch "
            f"{advice['batch']} (from k = {advice['measured_at_k']})")
