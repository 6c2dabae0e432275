"""The engine: transformers' ContinuousBatchingManager driven over a stream of requests.

    plan.py       set-up shared by `cbgen run` and `cbgen bench`: generation config, CPU defaults, KV-cache sizing,
                  ContinuousBatchingConfig, attention choice
    engine.py     the loop: bounded in-flight window, n-copy fan-out, timeouts, finish reasons, recovery
    admission.py  what may enter and when: requests that never fit, the prefix gate
    stops.py      stop strings
    manager.py    one manager's life (also served by tensor-parallel followers)
    cache_memory.py  the KV cache's RAM on CPU, taken as pages are written
"""
