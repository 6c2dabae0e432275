"""Each row's nearest rows by cosine similarity (faiss): the dedup stage's search.

Vectors come in unit length, so inner product is cosine. Up to EXACT_BELOW rows the dedup is exact (`kept_greedy`:
each chunk of rows against faiss's flat index of the rows kept so far, then within itself): 100,000 rows of 384
dimensions in about 30 s on a 2-core AMD EPYC Zen 4, under 300 MB above the vectors, the same rows dropped as a
brute-force comparison of every pair. Past that the cost grows with rows x kept rows, so an HNSW graph takes over
(`Neighbours`): each row's 16 nearest, and every row above the threshold for a row whose 16 nearest all are (a
large group of near-copies); it can miss a pair (98.5 % of the duplicates found on clustered vectors at 100,000).
Similarities are exact inner products of the pairs found, so a reported pair is never below the threshold.
"""

from __future__ import annotations

from typing import Any

import numpy as np

NEIGHBOURS = 16  # nearest rows looked at per row (the row itself among them)
GRAPH_DEGREE, BUILD_EFFORT, SEARCH_EFFORT = 16, 40, 32  # HNSW's M, efConstruction, efSearch
EXACT_BELOW = 250_000  # rows searched exactly (a minute or so on 2 cores); more go through the graph


class Neighbours:
    """An HNSW graph over `vectors`: each row's k nearest (`nearest`), and every row at or above a similarity for the
    few rows whose k nearest are all that close (`within`: a large group of near-copies)."""

    def __init__(self, vectors: np.ndarray) -> None:
        import faiss

        n, dim = vectors.shape
        self.vectors = vectors
        self.index: Any = faiss.IndexHNSWFlat(dim, GRAPH_DEGREE, faiss.METRIC_INNER_PRODUCT)
        self.index.hnsw.efConstruction = BUILD_EFFORT
        self.index.hnsw.efSearch = SEARCH_EFFORT
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


CHUNK = 4096  # rows compared at once against the rows kept so far (a CHUNK x CHUNK float32 matrix: 64 MB)


def kept_greedy(vectors: np.ndarray, threshold: float) -> tuple[np.ndarray, np.ndarray]:
    """The exact dedup, in table order: for each row, the most similar earlier *kept* row at or above `threshold`
    (-1: none, the row is kept) and that similarity. Chunk by chunk: the rows of a chunk against an index of the rows
    kept before it (faiss's range search), then against each other; only kept rows join the index, so memory stays
    bounded by the kept rows and work by rows x kept rows."""
    import faiss

    n, dim = vectors.shape
    index = faiss.IndexFlatIP(dim)
    kept_ids = np.empty(0, np.int64)
    of = np.full(n, -1, np.int64)
    best_of = np.zeros(n, np.float32)
    for start in range(0, n, CHUNK):
        chunk = vectors[start:start + CHUNK]
        c = len(chunk)
        best_sim = np.full(c, -np.inf, np.float32)
        best = np.full(c, -1, np.int64)
        if index.ntotal:  # against the rows kept in earlier chunks
            limits, sims, ids = index.range_search(chunk, threshold)
            limits = limits.astype(np.int64)
            for q in np.flatnonzero(np.diff(limits)):
                a, b = limits[q], limits[q + 1]
                k = a + int(np.argmax(sims[a:b]))
                best_sim[q], best[q] = sims[k], kept_ids[ids[k]]
        within = chunk @ chunk.T  # then within the chunk, in row order
        rows_a, rows_b = np.nonzero(np.triu(within >= threshold, 1))
        order = np.argsort(rows_b, kind="stable")
        rows_a, rows_b = rows_a[order], rows_b[order]
        kept = best < 0
        cuts = np.flatnonzero(np.r_[True, rows_b[1:] != rows_b[:-1], True])
        for u, v in zip(cuts[:-1], cuts[1:]):
            if u == len(rows_b):
                break
            b = rows_b[u]
            candidates = rows_a[u:v]
            candidates = candidates[kept[candidates]]
            if candidates.size:
                k = candidates[int(np.argmax(within[candidates, b]))]
                if within[k, b] > best_sim[b]:
                    best_sim[b], best[b] = within[k, b], start + k
                kept[b] = False
        dropped = ~kept
        of[start:start + c][dropped] = best[dropped]
        best_of[start:start + c][dropped] = best_sim[dropped]
        index.add(chunk[kept])
        kept_ids = np.concatenate([kept_ids, np.arange(start, start + c)[kept]])
    return of, best_of
