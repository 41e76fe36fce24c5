"""Step: online evaluation on its own, the draft as vLLM's eagle3 speculator (for benchmarks).

    python -m remote.evaluate.online --config c.json
    # {"target": "/models/target", "draft_dir": "/runs/r1/export", "data": "/runs/r1/prepare/data.parquet",
    #  "out_dir": "/runs/r1/online", "num_speculative_tokens": 3, "prompts": 32, "max_tokens": 64}

The measuring is remote.evaluate.online_measure's (the arms, the prompts, the counters); the evaluate
step runs the same measurement in-process. This step writes its report as online.json.
"""
from __future__ import annotations

from remote.evaluate.config import OnlineConfig
from remote.evaluate.online_measure import measure_online, summary
from remote.step import begin_step, step_main, write_json_atomic

STEP = "online_eval"


def run(raw: dict) -> dict:
    cfg, out, done = begin_step(OnlineConfig, raw, STEP)  # out_dir may be "" only inside evaluate
    if done is not None:
        return done
    report = measure_online(cfg)
    stage = out.open()
    write_json_atomic(stage / "online.json", report)
    return out.publish(counts={"prompts": len(report["prompt_ids"])}, figures=summary(report))


def main(argv: list[str] | None = None) -> int:
    return step_main(STEP, run, argv)


if __name__ == "__main__":  # vLLM spawns worker processes, which import this module again
    raise SystemExit(main())
