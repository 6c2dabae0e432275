"""Each row's nearest rows by cosine similarity, from an HNSW graph index (faiss): the dedup stage's search.

Vectors come in unit length, so inner product is cosine. Building the graph costs about as much as searching it;
both run on every core (faiss's OpenMP). Similarities are the index's exact inner products of the found pairs.
"""

from __future__ import annotations

import numpy as np

NEIGHBOURS = 16  # nearest rows looked at per row (the row itself among them)
GRAPH_DEGREE, BUILD_EFFORT, SEARCH_EFFORT = 32, 80, 64  # HNSW's M, efConstruction, efSearch
EXACT_BELOW = 20_000  # fewer rows: an exact search costs less than building a graph


def neighbours(vectors: np.ndarray, k: int = NEIGHBOURS) -> tuple[np.ndarray, np.ndarray]:
    """(ids, similarities) [rows, k], most similar first; -1 where fewer than k were found."""
    import faiss

    n, dim = vectors.shape
    k = min(k, n)
    if n < EXACT_BELOW:
        flat = faiss.IndexFlatIP(dim)
        flat.add(vectors)
        similarities, ids = flat.search(vectors, k)
        return ids, similarities
    graph = faiss.IndexHNSWFlat(dim, GRAPH_DEGREE, faiss.METRIC_INNER_PRODUCT)
    graph.hnsw.efConstruction = BUILD_EFFORT
    graph.add(vectors)
    graph.hnsw.efSearch = max(SEARCH_EFFORT, k)
    similarities, ids = graph.search(vectors, k)
    return ids, similarities
