"""Where a sample goes, from its id alone: its split (train or held-out) and, in a run over several
hosts, the host that captures it. The same on the controller and on every host (standard library only).

    split_of(sample_id, heldout_permille=50)    # "train" or "heldout"
    host_of(sample_id, n_hosts=2)               # 0 or 1

A sample id is the hex sha256 of its conversation (remote.data.chat_data.conversation_hash), so neither
moves as data is added or reordered.
"""
from __future__ import annotations


def split_of(sample_id: str, heldout_permille: int) -> str:
    """The split of a sample, from its hash alone: it never moves as data is added or reordered."""
    return "heldout" if int(sample_id[:8], 16) % 1000 < heldout_permille else "train"


def host_of(sample_id: str, n_hosts: int) -> int:
    """The host (0..n-1) that captures this sample in a run over n hosts, from its hash alone. Uses
    other hex digits than split_of (the first 8), so every host gets its share of both splits."""
    if n_hosts < 1:
        raise ValueError(f"n_hosts={n_hosts}: need at least one host")
    return int(sample_id[8:16], 16) % n_hosts
