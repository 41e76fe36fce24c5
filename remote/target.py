"""The target model's own config.json: the one reader every step uses (no weights loaded).

    config = read_config("/models/Kimi-K2.5")      # the file as it is; BadInput naming the folder
    text = text_settings(config)                    # the text model's settings over the top level
    is_mla(config)                                  # its attention is MLA
"""
from __future__ import annotations

import json
from pathlib import Path

from remote.step import BadInput


def read_config(target: str | Path) -> dict:
    """config.json of a HF model folder; BadInput when it is missing or not JSON."""
    path = Path(target) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (FileNotFoundError, NotADirectoryError):
        raise BadInput(f"target {target}: no config.json (expected a HF model folder)") from None
    except json.JSONDecodeError as e:
        raise BadInput(f"target {target}: config.json is not valid JSON: {e}") from e
    if not isinstance(config, dict):
        raise BadInput(f"target {target}: config.json holds {type(config).__name__}, not an object")
    return config


def is_mla(config: dict) -> bool:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2.5, an MLA draft): its text config has kv_lora_rank."""
    return bool(text_settings(config).get("kv_lora_rank"))


def text_settings(config: dict) -> dict:
    """The top level with the text model's settings over it: multimodal wrappers (Kimi-K2.5, PaliGemma)
    nest those in text_config (or language_config)."""
    text = config.get("text_config") or config.get("language_config") or {}
    return {**config, **{k: v for k, v in text.items() if v is not None}}
