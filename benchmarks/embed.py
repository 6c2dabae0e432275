"""cbgen's embeddings against sentence-transformers' encode: the embedded all-MiniLM-L6-v2, the same real texts
(the standard library's docstrings, 20 to 2,000 characters: cbgen.bench.embedding's, as `cbgen bench --suite`'s),
the same threads, each model loaded once, runs interleaved; prints each run's seconds, the speed ratio (goal >= 1.5)
and the smallest cosine between the two.

    python benchmarks/embed.py                  # 2,000 texts, 3 rounds, float32 and the machine's dtype
    python benchmarks/embed.py --texts 200 --rounds 1   # a quick check that it runs

sentence-transformers runs as its users run it (encode, batch_size 32, float32). cbgen runs in float32 and in
the dtype it picks for the machine (bfloat16 where the CPU has bf16 units). Name the machine beside the figures.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--texts", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from sentence_transformers import SentenceTransformer

    import cbgen
    from cbgen.bench.embedding import real_texts
    from cbgen.model.source import embedded_embedder_path

    texts = real_texts(args.texts)
    reference_model = SentenceTransformer(str(embedded_embedder_path()), device="cpu")
    ours = {"float32": cbgen.Embedder(dtype="float32"), "auto": cbgen.Embedder()}
    print(f"{len(texts)} texts, {torch.get_num_threads()} threads; cbgen auto dtype: {ours['auto'].loaded.dtype}")
    reference = reference_model.encode(texts[:64], batch_size=32)  # warm-up
    for embedder in ours.values():
        embedder.embed(texts[:64], progress=False)
    seconds: dict[str, list[float]] = {"sentence-transformers": [], **{f"cbgen {k}": [] for k in ours}}
    vectors: dict[str, np.ndarray] = {}
    for _ in range(args.rounds):
        started = time.perf_counter()
        reference = reference_model.encode(texts, batch_size=32, convert_to_numpy=True)
        seconds["sentence-transformers"].append(time.perf_counter() - started)
        for name, embedder in ours.items():
            started = time.perf_counter()
            vectors[name] = embedder.embed(texts, progress=False)
            seconds[f"cbgen {name}"].append(time.perf_counter() - started)
    base = statistics.median(seconds["sentence-transformers"])
    for name, runs in seconds.items():
        line = f"{name:24s} " + " ".join(f"{s:6.2f}" for s in runs) + f"  median {statistics.median(runs):6.2f} s"
        if name.startswith("cbgen"):
            got = vectors[name.removeprefix("cbgen ")]
            cosine = (got * reference).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(reference, axis=1)
            line += f"  speed x{base / statistics.median(runs):.2f}  min cosine {cosine.min():.6f}"
        print(line)


if __name__ == "__main__":
    main()
