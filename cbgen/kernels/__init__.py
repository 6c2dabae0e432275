"""cbgen's compiled CPU kernels (C++ with ATen's `at::vec`, built on first use: cbgen.kernels.build).

`paged_attention`: every query row of a continuous-batching step over its own keys, read in place from
transformers' paged cache, invariant by construction (its source says how). cbgen.attention.compiled serves it to
the engine.
"""

from cbgen.kernels.build import Built, kernel

__all__ = ["Built", "kernel"]
