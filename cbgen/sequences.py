"""How the engine names the sequences of a request: the manager knows each by an id made from the request's key.

A request asking for the job's number of sequences is one manager request: its first sequence is the key itself and
transformers names the others `<key>__child#<k>` (k from 0, for sample index k + 1). A request asking for another
number runs as that many separate manager requests, which cbgen names `<key>~copy<j>` (sample index j). The engine
builds these ids, and the step control reads a sequence's sample index back from them.
"""

from __future__ import annotations

CHILD_MARK = "__child#"  # transformers' suffix for a request's extra sequences
COPY_MARK = "~copy"  # cbgen's own suffix for the separate copies of a request


def sequence_ids(key: str, n: int, *, copies: bool) -> dict[str, int]:
    """The manager id of each of the request's `n` sequences, with its sample index."""
    if copies:
        return {f"{key}{COPY_MARK}{j}": j for j in range(n)}
    return {key: 0} | {f"{key}{CHILD_MARK}{k}": k + 1 for k in range(n - 1)}


def request_key(manager_id: str) -> str:
    """The key of the request a sequence belongs to."""
    return manager_id.partition(CHILD_MARK)[0].partition(COPY_MARK)[0]


def sample_index(manager_id: str) -> int:
    """A sequence's index among its request's sequences (the inverse of `sequence_ids`)."""
    key, child, k = manager_id.rpartition(CHILD_MARK)
    if child and key and k.isdigit():
        return int(k) + 1
    key, copy, j = manager_id.rpartition(COPY_MARK)
    if copy and key and j.isdigit():
        return int(j)
    return 0
