"""A remote step for tests: prints lines with progress events, then publishes a small output
folder with its manifest, or fails in the way the config asks for.

    python -m remote.probe --config probe.config.json      (cwd: the shipped code folder)
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass

from remote.step import BadInput, StepOutput, emit, load_config, log, progress, step_main


@dataclass(frozen=True)
class ProbeConfig:
    out_dir: str  # where the output folder and its manifest go
    mode: str = "ok"  # ok | bad_input | crash | no_manifest
    lines: int = 3  # log lines printed, each followed by a progress event
    pause_s: float = 0.0  # seconds between lines
    attempts_file: str = ""  # when set, each run appends one line to it (tests count the attempts)


def run(raw: dict) -> None:
    cfg = load_config(ProbeConfig, raw)
    if cfg.attempts_file:
        with open(cfg.attempts_file, "a") as f:
            f.write(f"{cfg.mode}\n")
    if cfg.mode == "bad_input":
        raise BadInput("probe: row 7 of data.jsonl is not a conversation")
    if cfg.mode == "crash":
        print("probe: crashing on purpose", file=sys.stderr, flush=True)
        sys.exit(3)
    out = StepOutput(cfg.out_dir, "probe", raw)
    staging = out.open()
    for i in range(cfg.lines):
        log(f"probe line {i}")
        progress(i + 1, cfg.lines, unit="lines")
        time.sleep(cfg.pause_s)
    (staging / "lines.txt").write_text("".join(f"{i}\n" for i in range(cfg.lines)))
    emit("figures", lines=cfg.lines)
    if cfg.mode != "no_manifest":
        out.publish(counts={"lines": cfg.lines}, figures={"lines": cfg.lines})


def main(argv: list[str] | None = None) -> int:
    return step_main("probe", run, argv)


if __name__ == "__main__":
    sys.exit(main())
