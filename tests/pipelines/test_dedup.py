"""Dedup stages: planted near-duplicates found exactly (precision and recall 1 by the exact search; recall >= 0.99
and precision 1 through the HNSW graph), the first of each group kept and each dropped row's original named, a
chain keeping both ends, exact-text duplicates by hash, an embed stage deduplicated end to end, and bad stages
refused before anything runs."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import cbgen
from cbgen.errors import CbgenError
from cbgen.pipelines import dedup, neighbours
from cbgen.rows import read_shards
from tests.helpers import write_jsonl


def planted(n: int, copies: int, dim: int = 64, seed: int = 0) -> tuple[np.ndarray, dict[int, int]]:
    """n random unit vectors, then `copies` more, each a slightly moved copy (cosine >= 0.97) of an earlier
    original: their rows and originals."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((n, dim)).astype(np.float32)
    sources = rng.choice(n, copies, replace=False)
    noise = rng.standard_normal((copies, dim)).astype(np.float32)
    near = base[sources] / np.linalg.norm(base[sources], axis=1, keepdims=True) + 0.02 * noise / np.sqrt(dim)
    vectors = np.concatenate([base, near])
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    order = rng.permutation(len(vectors))  # the copies anywhere after... or before their originals
    vectors = vectors[order]
    position = {old: new for new, old in enumerate(order)}
    pairs = {}
    for c, s in enumerate(sources):
        a, b = position[n + c], position[int(s)]
        pairs[max(a, b)] = min(a, b)  # the later of the two is the duplicate
    return vectors, pairs


def test_planted_near_duplicates_are_found_and_the_first_kept(tmp_path):
    vectors, pairs = planted(3000, 300)
    file = tmp_path / "vectors.parquet"
    pq.write_table(pa.table({"id": [f"v{i}" for i in range(len(vectors))],
                             "embedding": pa.FixedSizeListArray.from_arrays(pa.array(vectors.ravel()), 64)}), file)
    stages = [{"name": "rows", "kind": "sql", "read_files": True, "query": f"SELECT * FROM read_parquet('{file}')"},
              {"name": "unique", "kind": "dedup", "input": "rows", "embedding_column": "embedding",
               "threshold": 0.95}]
    cbgen.pipeline({"stages": stages}, tmp_path / "out", progress=False)
    kept = pq.read_table(tmp_path / "out" / "unique" / "part-00000.parquet").column("id").to_pylist()
    dropped = pq.read_table(tmp_path / "out" / "unique" / dedup.DUPLICATES_FILE).to_pylist()
    assert {row["id"] for row in dropped} == {f"v{i}" for i in pairs}  # precision and recall 1
    assert all(row["duplicate_of"] == f"v{pairs[int(row['id'][1:])]}" and row["similarity"] >= 0.95
               for row in dropped)
    assert kept == [f"v{i}" for i in range(len(vectors)) if i not in pairs]  # in table order
    stored = json.loads((tmp_path / "out" / "unique" / "stage.json").read_text()) \
        if (tmp_path / "out" / "unique" / "stage.json").exists() else None
    assert stored is None or stored["dropped"] == len(pairs)


def test_the_graph_index_finds_the_planted_pairs(monkeypatch):
    monkeypatch.setattr(neighbours, "EXACT_BELOW", 0)
    vectors, pairs = planted(8000, 400, seed=1)
    of, similarity = dedup.near_duplicates(vectors, 0.95)
    found = set(np.flatnonzero(of >= 0).tolist())
    assert found <= set(pairs)  # precision 1: nothing under the threshold
    assert len(found) >= 0.99 * len(pairs)
    assert (similarity[list(found)] >= 0.95).all()


def test_a_group_larger_than_the_neighbours_looked_at_is_dropped_whole():
    """40 near-copies of each of 3 rows, shuffled among 500 others: a copy's 16 nearest may all be other copies,
    dropped before it; the range search finds the kept original."""
    rng = np.random.default_rng(5)
    others = rng.standard_normal((500, 32)).astype(np.float32)
    originals = rng.standard_normal((3, 32)).astype(np.float32)
    copies = np.repeat(originals, 40, axis=0) + 0.01 * rng.standard_normal((120, 32)).astype(np.float32)
    vectors = np.concatenate([originals, rng.permutation(np.concatenate([others, copies]))])
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    of, _ = dedup.near_duplicates(vectors, 0.95)
    assert int((of >= 0).sum()) == 120 and set(of[of >= 0].tolist()) == {0, 1, 2}


def test_a_chain_keeps_both_ends_and_exact_text_duplicates_go_by_hash():
    a = np.array([1.0, 0.0], dtype=np.float32)
    b = np.array([np.cos(0.3), np.sin(0.3)], dtype=np.float32)  # 0.955 from a
    c = np.array([np.cos(0.6), np.sin(0.6)], dtype=np.float32)  # 0.955 from b, 0.825 from a
    of, _ = dedup.near_duplicates(np.stack([a, b, c]), 0.95)
    assert of.tolist() == [-1, 0, -1]
    of, similarity = dedup.exact_duplicates(["x", "y", "x", None, "y ", "y"])
    assert of.tolist() == [-1, -1, 0, -1, -1, 1] and similarity.tolist() == [0, 0, 1, 0, 0, 1]


def test_an_embed_stage_deduplicated_end_to_end(tmp_path):
    from tests.encoders.test_embed import bert_folder, texts

    folder = bert_folder(tmp_path, "mean", True)
    unique = texts(30, seed=9)
    rows = [{"id": f"r{i}", "text": t} for i, t in enumerate(unique)]
    rows += [{"id": f"again{i}", "text": unique[i]} for i in (3, 7, 11)]  # the same text: cosine 1
    stages = [{"name": "vectors", "kind": "embed", "input": str(write_jsonl(tmp_path / "in.jsonl", rows)),
               "model": str(folder), "dtype": "float32"},
              {"name": "unique", "kind": "dedup", "input": "vectors", "embedding_column": "vectors.embedding",
               "threshold": 0.999},
              {"name": "same_text", "kind": "dedup", "input": "vectors", "text_column": "text"}]
    cbgen.pipeline({"stages": stages}, tmp_path / "out", progress=False)
    for name in ("unique", "same_text"):
        dropped = {row["id"]: row["duplicate_of"]
                   for row in pq.read_table(tmp_path / "out" / name / dedup.DUPLICATES_FILE).to_pylist()}
        assert dropped == {"again3": "r3", "again7": "r7", "again11": "r11"}
        assert len(list(read_shards(tmp_path / "out" / name))) == 30


@pytest.mark.parametrize(("stage", "message"), [
    ({"input": "rows", "embedding_column": "nope"}, "no column 'nope'"),
    ({"input": "rows", "embedding_column": "id"}, "not a list of floats"),
    ({"input": "rows", "text_column": "embedding"}, "not text"),
    ({"input": "rows", "embedding_column": "embedding", "threshold": 2}, "between -1 and 1"),
    ({"input": "rows", "embedding_column": "embedding", "text_column": "id"}, "give one of"),
    ({"input": "elsewhere", "embedding_column": "embedding"}, "must name an earlier stage"),
    ({"input": "rows", "embedding_column": "embedding", "model": "x"}, "takes only"),
])
def test_bad_dedup_stages_are_refused_before_anything_runs(tmp_path, stage, message):
    file = tmp_path / "v.parquet"
    pq.write_table(pa.table({"id": ["a"], "embedding": [[1.0, 0.0]]}), file)
    stages = [{"name": "rows", "kind": "sql", "read_files": True, "query": f"SELECT * FROM read_parquet('{file}')"},
              {"name": "unique", "kind": "dedup", **stage}]
    with pytest.raises(CbgenError, match=message):
        cbgen.pipeline({"stages": stages}, tmp_path / "out", progress=False)
    assert not (tmp_path / "out" / "rows").exists()
