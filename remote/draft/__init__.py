"""The EAGLE-3 draft: its config (config.py), model (model.py), TTT objective (loss.py), data (data.py)."""
from remote.draft.config import DraftConfig
from remote.draft.model import EagleDraft, TTTAttention

__all__ = ["DraftConfig", "EagleDraft", "TTTAttention"]
