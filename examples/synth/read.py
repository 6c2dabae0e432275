"""Reads the example's output back as a dataset: the JSON answers are columns (parsed.question, parsed.difficulty).

    python examples/synth/read.py [synth-out]
"""

import sys

import datasets

rows = datasets.load_dataset(sys.argv[1] if len(sys.argv) > 1 else "synth-out", split="train").flatten()
for row in rows:
    if row["finish_reason"] == "stop":
        print(f"{row['topic']:>22} | {row['parsed.difficulty']:<6} | {row['parsed.question']}")
print(f"{sum(r == 'stop' for r in rows['finish_reason'])} of {len(rows)} records complete")
