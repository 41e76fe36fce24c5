"""tasks.capture.capture_hidden_states through a real local host (subprocesses, as on a GPU host)
and the Prefect test harness: it runs the capture step (here with the transformers backend, which
needs no engine start: the vLLM path of the same step is tested in test_capture_vllm.py), its
figures become a table artifact, a second run reuses the cache, and bad input fails the task at
once. The patch_worker task is tested in test_patch_worker.py."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.fixtures.capture import random_samples, write_dataset
from tests.fixtures.models import make_tiny_llama


@pytest.mark.slow
def test_the_capture_task_on_a_local_host(prefect_harness, tmp_path):
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    from flows.params import CaptureParams, TargetParams
    from remote.capture.store import CaptureSet
    from tasks.capture import capture_hidden_states
    from tasks.context import RunContext
    from tasks.errors import BadInputError
    from tasks.host import HostParams, open_host
    from tasks.prepare import PreparedData
    from tasks.ship import ship_code

    model = make_tiny_llama(tmp_path / "llama", num_layers=8, hidden=128)
    samples = random_samples(np.random.default_rng(5).integers(5, 60, 10).tolist(), vocab=500, seed=5)
    data = write_dataset(tmp_path / "data.parquet", samples)
    params = HostParams(root=str(tmp_path / "root"))
    with open_host(params) as host:
        code = ship_code(host)
    target = TargetParams(model=str(model))

    def dataset(path: Path) -> PreparedData:
        return PreparedData(path=str(path), out_dir=str(path.parent), fingerprint="f", samples=10, train=7, heldout=3,
                            tokens=0, loss_tokens=0)

    @flow
    def capture_flow(run_name: str, data_path: str):
        ctx = RunContext(host=params, code=code, run_name=run_name)
        return capture_hidden_states(ctx, target, dataset(Path(data_path)),
                                     CaptureParams(backend="transformers", samples_per_shard=4))

    state = capture_flow("r1", str(data), return_state=True)
    got = state.result()
    assert got.path.endswith("runs/r1/capture") and (got.samples, got.captured, got.reused) == (10, 10, 0)
    assert len(got.shards) == 3 and all(Path(p).parent == Path(got.cache_dir) for p in got.shards)
    assert CaptureSet.from_manifest(got.path).sample_ids == {s.sample_id for s in samples}
    assert got.figures["bytes_per_token"] <= 4 * 128 * 4 + 16 and got.figures["tokens"] == sum(s.input_ids.size for s in samples)
    with get_client(sync_client=True) as client:
        arts = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id])))
    (table,) = [a for a in arts if a.type == "table"]
    rows = {r["figure"]: r["value"] for r in json.loads(table.data)}
    assert rows["captured now"] == 10 and rows["bytes per token"] == got.figures["bytes_per_token"]
    assert rows["tokens per second"] > 0 and not any(a.type == "progress" for a in arts)  # removed once done

    again = capture_flow("r2", str(data))  # the next night, the same samples
    assert (again.captured, again.reused) == (0, 10) and again.shards == got.shards

    failed = capture_flow("r3", str(tmp_path / "gone.parquet"), return_state=True)
    with pytest.raises(BadInputError, match="gone.parquet does not exist"):
        failed.result()
