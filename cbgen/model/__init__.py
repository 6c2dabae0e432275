"""The model: where it comes from (source.py, no torch), the converted-GGUF cache (cache.py), loading it (load.py)
and loading it sharded for tensor parallelism (sharded.py)."""
