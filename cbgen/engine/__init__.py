"""The engine: transformers' ContinuousBatchingManager driven over a stream of requests.

    job_plan.py   the frozen plan a job hands its engine (decided by cbgen.job.plan)
    setup.py      set-up shared by `cbgen run` and `cbgen bench`: generation config, CPU defaults, KV-cache sizing,
                  ContinuousBatchingConfig, the scope's plan (attention, linear layers, dense mask)
    scope.py      the scope that installs that plan for one engine's life, checks it and takes it out
    engine.py     the loop: bounded in-flight window, n-copy fan-out, timeouts, finish reasons, recovery
    admission.py  what may enter and when: requests that never fit, the prefix gate
    stops.py      stop strings
    manager.py    one manager's life (also served by tensor-parallel followers)
    kv_memory.py  the KV cache's RAM on CPU, taken as pages are written
    replicas.py   --data-parallel: the plan run by replica processes
"""
