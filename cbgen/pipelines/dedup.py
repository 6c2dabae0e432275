"""A dedup stage: an earlier stage's table without its duplicates, written as an sql stage's result is.

    embedding_column   near-duplicates: rows whose embeddings' cosine similarity reaches `threshold`
    text_column        exact duplicates: rows whose text is byte for byte the same (a hash of each)

Rows are taken in table order, and a row is dropped when it is a duplicate of an earlier row that was kept; so the
first of each group stays, and a chain (a near b, b near c, a not near c) keeps a and c. Each dropped row is
recorded in DUPLICATES_FILE beside the result: its id, the id of the kept row it duplicates, and their similarity.

Near neighbours come from faiss (cbgen.pipelines.neighbours): each row's NEIGHBOURS nearest, of which those above the
threshold are its duplicates, and for a row whose nearest are all above it (a large group of near-copies) every row
above it, by a range search. The search is exact below 250,000 rows; above, an HNSW graph can miss a pair (its
measured recall in docs/embed.md). A reported pair is never below the threshold.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from cbgen.errors import CbgenError

DUPLICATES_FILE = "duplicates.parquet"


def column_at(table: pa.Table, path: str) -> pa.ChunkedArray:
    """The column at a dotted path of `table` (`vectors.embedding`: field `embedding` of struct column `vectors`)."""
    head, *rest = path.split(".")
    if head not in table.schema.names:
        raise CbgenError(f"no column {head!r} in the table (its columns: {', '.join(table.schema.names)})")
    column = table.column(head)
    for part in rest:
        if not pa.types.is_struct(column.type) or column.type.get_field_index(part) < 0:
            raise CbgenError(f"no field {part!r} in column {path!r}")
        column = pc.struct_field(column, part)
    return column


def check_column(schema: pa.Schema, settings: dict[str, Any]) -> None:
    """That the column a dedup stage compares exists and has the right type, before anything runs."""
    path = settings.get("embedding_column") or settings["text_column"]
    kind = column_at(schema.empty_table(), path).type
    if "embedding_column" in settings:
        if not (pa.types.is_list(kind) or pa.types.is_fixed_size_list(kind) or pa.types.is_large_list(kind)) \
                or not pa.types.is_floating(kind.value_type):
            raise CbgenError(f"embedding_column {path!r} holds {kind}, not a list of floats (an embed stage's "
                             "embedding)")
    elif not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise CbgenError(f"text_column {path!r} holds {kind}, not text")


def dedup_table(table: pa.Table, settings: dict[str, Any]) -> tuple[pa.Table, pa.Table]:
    """The rows kept, and the dropped ones as (id, duplicate_of, similarity)."""
    ids = [str(i) for i in table.column("id").to_pylist()]
    if "embedding_column" in settings:
        vectors = _vectors(column_at(table, settings["embedding_column"]))
        of, similarity = near_duplicates(vectors, settings["threshold"])
    else:
        of, similarity = exact_duplicates(column_at(table, settings["text_column"]).to_pylist())
    dropped = np.flatnonzero(of >= 0)
    kept = table.filter(pa.array(of < 0))
    duplicates = pa.table({"id": [ids[i] for i in dropped], "duplicate_of": [ids[of[i]] for i in dropped],
                           "similarity": pa.array(similarity[dropped], pa.float32())})
    return kept, duplicates


def _vectors(column: pa.ChunkedArray) -> np.ndarray:
    """The embeddings as a float32 matrix, each scaled to unit length (cosine is then a dot product)."""
    if column.null_count:
        raise CbgenError("the embedding column has rows without an embedding: filter them out first")
    values = column.combine_chunks()
    if pa.types.is_fixed_size_list(values.type):
        matrix = values.flatten().to_numpy(zero_copy_only=False).reshape(len(values), values.type.list_size)
    else:
        lengths = pc.list_value_length(values).to_numpy(zero_copy_only=False)
        if len(lengths) and (lengths != lengths[0]).any():
            raise CbgenError("the embedding column's vectors differ in length: they come from different models")
        matrix = values.flatten().to_numpy(zero_copy_only=False).reshape(len(values), -1)
    matrix = np.ascontiguousarray(matrix, dtype=np.float32)
    norms = np.linalg.norm(matrix, axis=1, keepdims=True)
    return matrix / np.where(norms > 0, norms, 1)


def exact_duplicates(texts: list[str | None]) -> tuple[np.ndarray, np.ndarray]:
    """For each text, the row of the first equal one before it (-1 for a first), and 1.0 where it has one."""
    first: dict[bytes, int] = {}
    of = np.full(len(texts), -1, dtype=np.int64)
    for i, text in enumerate(texts):
        if text is None:
            continue
        key = hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()
        j = first.setdefault(key, i)
        if j != i:
            of[i] = j
    return of, np.where(of >= 0, 1.0, 0.0)


def near_duplicates(vectors: np.ndarray, threshold: float) -> tuple[np.ndarray, np.ndarray]:
    """For each row, the earlier kept row it duplicates (-1: kept) and their cosine similarity."""
    from cbgen.pipelines.neighbours import EXACT_BELOW, Neighbours, kept_greedy

    if len(vectors) < EXACT_BELOW:
        return kept_greedy(vectors, threshold)
    index = Neighbours(vectors)
    found, similarities = index.nearest()
    # a row whose nearest are all above the threshold may have more there (a large group): all of them, by range
    crowded = np.flatnonzero(similarities[:, -1] >= threshold) if similarities.shape[1] else np.array([], int)
    wider = dict(zip(crowded.tolist(), index.within(crowded, threshold))) if len(crowded) else {}
    of = np.full(len(vectors), -1, dtype=np.int64)
    best = np.zeros(len(vectors), dtype=np.float32)
    for i in range(len(vectors)):  # in table order: whether a neighbour was kept is known when row i is reached
        ids, sims = wider.get(i, (found[i], similarities[i]))
        for j, s in zip(ids, sims):
            if s < threshold:
                break  # neighbours come most similar first
            if 0 <= j < i and of[j] < 0:
                of[i], best[i] = j, s
                break
    return of, best
