"""Markdown pieces of evaluation.json's figures that both sides write: the controller's Prefect report
(tasks/evaluate.py) and the evaluate step's draft card (remote/evaluate/card.py). Plain Python: the controller
imports it.

    "\n".join(benchmark_tables(evaluation["benchmarks"]) + advice_section(evaluation["advice"]))
"""
from __future__ import annotations


def num(x, digits: int = 2) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def benchmark_tables(bench: dict | None) -> list[str]:
    """Each benchmark set's acceptance (greedy, at the temperature when one was set, per position), then each
    category's where a set has several (MT-Bench's eight) and each turn's where it has several; [] without
    benchmarks."""
    if not bench or not bench.get("sets"):
        return []
    t = bench["temperature"]

    def row(label: str, f: dict, extra: str = "") -> str:
        g, smp = f.get("greedy", {}), f.get("sampled", {})
        per = ", ".join(pct(a) for a in g.get("acceptance_per_position", [])) or "-"
        sampled = f" {num(smp.get('acceptance_length'))} |" if t else ""
        return f"| {label} |{extra} {num(g.get('acceptance_length'))} |{sampled} {per} |"

    head = "| acceptance length (greedy) |" + (f" at temperature {t:g} |" if t else "") + " per position (greedy) |"
    rule = "---|" * (head.count("|") - 1)  # a column a heading of head's
    out = [f"## Benchmarks (vLLM, the target answering each prompt itself, k = {bench['num_speculative_tokens']}, "
           f"at most {bench['max_tokens']} tokens an answer)", "", "| set | prompts " + head, "|---|---|" + rule]
    for name, s in bench["sets"].items():
        left = f" ({s['left_out']} too long)" if s.get("left_out") else ""
        out.append(row(name, s, f" {s['prompts']}{left} |"))
    out.append("")
    for name, s in bench["sets"].items():
        parts = [(c, f) for c, f in s.get("categories", {}).items()] if len(s.get("categories", {})) > 1 else []
        parts += [(f"turn {n}", f) for n, f in s.get("turns", {}).items()]
        if parts:
            out += [f"### {name} by category" + (" and turn" if s.get("turns") else ""), "", "| part " + head,
                    "|---|" + rule] + [row(label, f) for label, f in parts] + [""]
    return out


def advice_section(advice: dict | None) -> list[str]:
    """The serving advice (remote/evaluate/advice.py): the k to serve, the expected speed-up at each k, the lines."""
    if not advice:
        return []
    ks = list(advice["speedup_by_k"])
    return ["## Serving", "",
            f"Serve at **k = {advice['k']}**: expected decode speed-up {num(advice['speedup'])}x on this host at "
            f"batch {advice['batch']}" + ("" if advice["worth_it"] else " (below 1x: on this host the target alone is "
                                                                         "faster)")
            + f". A draft token costs {num(advice['draft_step_cost'], 3)} of a target step (measured at k = "
            f"{advice['measured_at_k']}); the acceptance length at each k is the offline one, scaled to the online "
            "figure at that k. On a GPU host a draft token costs less, so rerun the evaluation there to advise it.", "",
            "| k | " + " | ".join(ks) + " |", "|---|" + "---|" * len(ks),
            "| acceptance length | " + " | ".join(num(advice["acceptance_length_by_k"][k]) for k in ks) + " |",
            "| expected speed-up | " + " | ".join(num(advice["speedup_by_k"][k]) for k in ks) + " |", "",
            "```", advice["vllm"], *([advice["sglang"]] if advice.get("sglang") else []), "```", ""]
