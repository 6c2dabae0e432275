"""What records a run, above the engine: what it did (summary.py, the core of run.json), its fingerprint and run.json
(manifest.py), the dataset card (card.py), the folder as a dataset (dataset.py), and the status and merge of output
folders (collect.py). The rows themselves, their columns, shards and the run directory are cbgen.rows, below the
engine."""
