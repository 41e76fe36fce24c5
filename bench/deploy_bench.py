"""Figures of the deployments: what a worker adds over running the flow directly, and how long a
nightly run with no new data takes.

    .venv/bin/python bench/deploy_bench.py [--repeats 2] [--json out/deploy_bench.json]

On a real Prefect server (its own PREFECT_HOME, a free 127.0.0.1 port), with the tiny preset
(deployments/tiny-local.json) on a tiny random Llama and 24 generated conversations:

1. direct: `python -m flows.train_draft --preset ...` against the server, wall time;
2. deployed: `prefect --no-prompt deploy --all` once, then `prefect deployment run
   'train-draft/tiny' -p ... --watch` through a worker started beforehand (a worker is
   long-lived; its start is reported apart), wall time. Direct and deployed runs alternate, each on
   a fresh host root, so both do the same work;
3. nightly: `python -m flows.nightly` twice on the same data; the second finds nothing new.

Targets (issue 7): deploy + run adds under 30 s over direct; the no-new-data night under 60 s.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.fixtures.models import make_tiny_llama  # noqa: E402
from tests.fixtures.prefect_server import POOL, TINY, PrefectServer  # noqa: E402
from tests.fixtures.tiny_run import prefect_args, tiny_params, write_chats  # noqa: E402


def timed(argv: list[str], server: PrefectServer, log: Path) -> float:
    started = time.monotonic()
    with open(log, "wb") as f:
        r = subprocess.run(argv, cwd=REPO, env=server.env(), stdout=f, stderr=subprocess.STDOUT,
                           stdin=subprocess.DEVNULL)
    seconds = time.monotonic() - started
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(argv[:4])}... exited {r.returncode}; see {log}")
    return seconds


def preset_file(tmp: Path, params: dict) -> Path:
    path = tmp / f"preset-{len(list(tmp.glob('preset-*')))}.json"
    path.write_text(json.dumps(params))
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=2, help="direct/deployed pairs")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="eaglet-deploy-bench-"))
    model = make_tiny_llama(tmp / "tiny-llama")
    chats = write_chats(tmp / "chats.jsonl", 24)
    server = PrefectServer.start(tmp / "server")
    figures: dict = {"server_start_s": round(server.started_s, 1), "load_avg_1m_at_start": os.getloadavg()[0]}
    try:
        server.cli("work-pool", "create", POOL, "--type", "process")
        started = time.monotonic()
        server.cli("--no-prompt", "deploy", "--all")
        figures["deploy_s"] = round(time.monotonic() - started, 1)
        server.start_worker(POOL, tmp / "worker.log")  # long-lived: its start is no part of a run's cost
        direct, deployed = [], []
        for i in range(args.repeats):
            params = tiny_params(tmp / f"root-direct-{i}", model, [chats])
            direct.append(timed([sys.executable, "-m", "flows.train_draft", "--preset", str(preset_file(tmp, params))],
                                server, tmp / f"direct-{i}.log"))
            params = tiny_params(tmp / f"root-deployed-{i}", model, [chats])
            deployed.append(timed([sys.executable, "-m", "prefect", "deployment", "run", TINY, *prefect_args(params),
                                   "--watch", "--watch-interval", "1"], server, tmp / f"deployed-{i}.log"))
        figures["direct_run_s"] = [round(s, 1) for s in direct]
        figures["deployed_run_s"] = [round(s, 1) for s in deployed]
        run_overhead = min(deployed) - min(direct)
        figures["worker_run_overhead_s"] = round(run_overhead, 1)
        figures["deploy_plus_run_overhead_s"] = round(figures["deploy_s"] + run_overhead, 1)

        nightly = preset_file(tmp, tiny_params(tmp / "root-nightly", model, [chats]))
        cmd = [sys.executable, "-m", "flows.nightly", "--preset", str(nightly)]
        figures["nightly_first_s"] = round(timed(cmd, server, tmp / "nightly-1.log"), 1)
        figures["nightly_no_new_data_s"] = round(timed(cmd, server, tmp / "nightly-2.log"), 1)
    finally:
        server.stop()
    figures["load_avg_1m_at_end"] = os.getloadavg()[0]
    figures["targets_met"] = {"deploy_plus_run_overhead_under_30s": figures["deploy_plus_run_overhead_s"] < 30,
                              "no_new_data_night_under_60s": figures["nightly_no_new_data_s"] < 60}
    print(json.dumps(figures, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
