"""Where a job's shards run when not in this process: `--executor ray` (ray.py)."""
