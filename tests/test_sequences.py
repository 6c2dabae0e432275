"""The manager ids of a request's sequences: built once, read back to the same key and sample index."""

from __future__ import annotations

import pytest

from cbgen.records import request_key, sample_index, sequence_ids


@pytest.mark.parametrize("copies", [False, True])
@pytest.mark.parametrize("n", [1, 2, 5, 12])
def test_ids_read_back_to_their_request_and_sample_index(n, copies):
    ids = sequence_ids("r12", n, copies=copies)
    assert sorted(ids.values()) == list(range(n))
    for manager_id, index in ids.items():
        assert request_key(manager_id) == "r12" and sample_index(manager_id) == index


def test_transformers_names_children_from_zero():
    assert list(sequence_ids("r3", 3, copies=False)) == ["r3", "r3__child#0", "r3__child#1"]
    assert sample_index("r3") == 0 and sample_index("r3__child#1") == 2
    assert list(sequence_ids("r3", 2, copies=True)) == ["r3~copy0", "r3~copy1"]
