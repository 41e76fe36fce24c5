"""The presets of deployments/*.json as deployment parameters: a `prefect deploy` build step.

    build:
      - flows.presets.read_presets:
          id: presets
    deployments:
      - name: tiny
        parameters:                                  # deployments/tiny-local.json, checked
          host: "{{ presets.tiny-local.host }}"      # a section a line: prefect.yaml's schema wants a mapping

Each file is read through the training flow's parameter model, so a misspelt key fails the deploy,
not a run at 02:00.
"""
from __future__ import annotations

from pathlib import Path


def read_presets(folder: str = "deployments") -> dict[str, dict]:
    """{file stem: its parameters} for every preset file in folder, each checked against TrainDraftParams."""
    from flows.params import TrainDraftParams

    return {path.stem: TrainDraftParams.from_preset(path).model_dump(mode="json", exclude_unset=True)
            for path in sorted(Path(folder).glob("*.json"))}
