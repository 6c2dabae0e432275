"""A dedup stage at scale: 100,000 embeddings of 384 dimensions (clustered as real embeddings are: 2,000 centres,
nearest-neighbour cosine mostly 0.6-0.8) with 5 % planted near-duplicates (cosine >= 0.97 to an earlier row),
deduplicated at 0.95 by the stage's own table function, as a pipeline runs it. Prints the seconds, the peak memory
above the table, and precision and recall against the planted pairs (goal: 100k rows in <= 60 s on 2 cores).

    python benchmarks/dedup.py                    # exact search (the default below 250,000 rows)
    python benchmarks/dedup.py --graph            # the HNSW graph the stage uses above that
    python benchmarks/dedup.py --rows 20000       # a quick check that it runs

Name the machine beside the figures (lscpu).
"""

from __future__ import annotations

import argparse
import resource
import time

import pyarrow as pa


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--graph", action="store_true", help="the HNSW graph instead of the exact search")
    args = parser.parse_args()
    from cbgen.bench.embedding import planted_set
    from cbgen.pipelines import dedup, neighbours

    if args.graph:
        neighbours.EXACT_BELOW = 0
    vectors, planted = planted_set(args.rows, args.dim)
    table = pa.table({"id": [str(i) for i in range(len(vectors))],
                      "embedding": pa.FixedSizeListArray.from_arrays(pa.array(vectors.ravel()), args.dim)})
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    kept, dropped = dedup.dedup_table(table, {"embedding_column": "embedding", "threshold": 0.95})
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    found = {int(i) for i in dropped.column("id").to_pylist()}
    true = len(found & planted)
    print(f"{args.rows:,} rows x {args.dim}, {'HNSW graph' if args.graph else 'exact'}: {seconds:.1f} s, peak "
          f"{(peak - before) / 1024:,.0f} MB above the table; {kept.num_rows:,} kept, {len(found):,} dropped; "
          f"planted {len(planted):,}: recall {true / len(planted):.4f}, precision {true / max(len(found), 1):.4f}")


if __name__ == "__main__":
    main()
