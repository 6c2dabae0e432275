"""Each row's nearest rows by cosine similarity (faiss): the dedup stage's search.

Vectors come in unit length, so inner product is cosine. Up to EXACT_BELOW rows the search is exact (faiss's flat
index: every pair's product by blocked matrix products, on every core): 100,000 rows of 384 dimensions in 28 s on a
2-core AMD EPYC Zen 4, 230 MB above the vectors. Past that the cost grows with the square of the rows, so an HNSW
graph takes over: 100,000 rows in 15 s there, finding 98.5 % of the duplicates. Similarities are the exact inner
products of the pairs found, so a reported pair is never below the threshold.
"""

from __future__ import annotations

from typing import Any

import numpy as np

NEIGHBOURS = 16  # nearest rows looked at per row (the row itself among them)
GRAPH_DEGREE, BUILD_EFFORT, SEARCH_EFFORT = 16, 40, 32  # HNSW's M, efConstruction, efSearch
EXACT_BELOW = 250_000  # rows searched exactly (a minute or so on 2 cores); more go through the graph


class Neighbours:
    """An index over `vectors`: each row's k nearest (`nearest`), and every row at or above a similarity for the
    few rows whose k nearest are all that close (`within`: a large group of near-copies)."""

    def __init__(self, vectors: np.ndarray) -> None:
        import faiss

        n, dim = vectors.shape
        self.vectors = vectors
        self.index: Any
        if n < EXACT_BELOW:
            self.index = faiss.IndexFlatIP(dim)
        else:
            graph = faiss.IndexHNSWFlat(dim, GRAPH_DEGREE, faiss.METRIC_INNER_PRODUCT)
            graph.hnsw.efConstruction = BUILD_EFFORT
            graph.hnsw.efSearch = SEARCH_EFFORT
            self.index = graph
        self.index.add(vectors)

    def nearest(self, k: int = NEIGHBOURS) -> tuple[np.ndarray, np.ndarray]:
        """(ids, similarities) [rows, k], most similar first; -1 where fewer than k were found."""
        similarities, ids = self.index.search(self.vectors, min(k, len(self.vectors)))
        return ids, similarities

    def within(self, rows: np.ndarray, threshold: float) -> list[tuple[np.ndarray, np.ndarray]]:
        """For each of `rows`, (ids, similarities) of every row at or above `threshold`, most similar first."""
        limits, similarities, ids = self.index.range_search(self.vectors[rows], threshold)
        found = []
        for r in range(len(rows)):
            a, b = limits[r], limits[r + 1]
            order = np.argsort(-similarities[a:b], kind="stable")
            found.append((ids[a:b][order], similarities[a:b][order]))
        return found
