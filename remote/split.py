"""Where a sample goes, from its id alone: its split (train or held-out) and, in a run over several
hosts, the host that captures it. The same on the controller and on every host (standard library only).

    split_of(sample_id, heldout_permille=50)    # "train" or "heldout"
    heldout_part(sample_id)                     # of a held-out sample: "validation" or "test"
    in_part(heldout_ids, "test")                # ([positions in that half], "test"), or all as "heldout"
    host_of(sample_id, n_hosts=2)               # 0 or 1

The held-out split has two halves: the trainer chooses the checkpoint it publishes on "validation", the
evaluate step reports on "test", so the reported figure is never measured on the samples it was chosen by.

A sample id is the hex sha256 of its conversation (remote.data.chat_data.conversation_hash), so neither
moves as data is added or reordered.
"""
from __future__ import annotations

import hashlib

HELDOUT_PARTS = ("validation", "test")


def split_of(sample_id: str, heldout_permille: int) -> str:
    """The split of a sample, from its hash alone: it never moves as data is added or reordered."""
    return "heldout" if int(sample_id[:8], 16) % 1000 < heldout_permille else "train"


def heldout_part(sample_id: str) -> str:
    """The half of the held-out split a held-out sample is in, from a hash of its id: independent of the
    digits split_of and host_of read, and defined for any id (a test's "s7" as a conversation hash)."""
    return HELDOUT_PARTS[hashlib.sha256(sample_id.encode()).digest()[0] & 1]


def in_part(sample_ids: list[str], part: str) -> tuple[list[int], str]:
    """The positions of the held-out ids that are in `part`, and what they are: `part`, or "heldout" (all of
    them) when `part` holds none, as in a split of one sample (the manifests say which was used)."""
    mine = [i for i, sid in enumerate(sample_ids) if heldout_part(sid) == part]
    return (mine, part) if mine else (list(range(len(sample_ids))), "heldout")


def host_of(sample_id: str, n_hosts: int) -> int:
    """The host (0..n-1) that captures this sample in a run over n hosts, from its hash alone. Uses
    other hex digits than split_of (the first 8), so every host gets its share of both splits."""
    if n_hosts < 1:
        raise ValueError(f"n_hosts={n_hosts}: need at least one host")
    return int(sample_id[8:16], 16) % n_hosts
