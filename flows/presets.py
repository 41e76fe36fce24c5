"""The presets of deployments/*.json as deployment parameters: a `prefect deploy` build step.

    build:
      - flows.presets.read_presets:
          id: presets
    deployments:
      - name: tiny
        parameters:                                  # deployments/tiny-local.json, checked
          host: "{{ presets.tiny-local.host }}"      # a section a line: prefect.yaml's schema wants a mapping

Each file is read through its flow's parameter model (the training flow's; the nightly's for a file with a
`nightly` section, deployments/nightly-local.json), so a misspelt key fails the deploy, not a run at 02:00.
"""
from __future__ import annotations

from pathlib import Path


def read_presets(folder: str = "deployments") -> dict[str, dict]:
    """{file stem: its parameters} for every preset file in folder, each checked against its flow's parameters."""
    return {path.stem: preset_params(path).model_dump(mode="json", exclude_unset=True)
            for path in sorted(Path(folder).glob("*.json"))}


def preset_params(path: Path):
    """A preset file read through its flow's parameter model: the nightly's when it holds a `nightly` section."""
    import json

    from flows.params import TrainDraftParams

    if "nightly" in json.loads(path.read_text()):
        from flows.nightly import NightlyRunParams

        return NightlyRunParams.from_preset(path)
    return TrainDraftParams.from_preset(path)
