"""An engine gives its KV cache back when its run ends: nothing of cbgen's (a patched method's closure, an undo kept
by the scope) keeps the manager's cache alive, so the next engine in the process (an adapter's group, a pipeline
stage, a second Generator call) sizes its cache from memory that is really free."""

from __future__ import annotations

import gc
import weakref

import pytest

import cbgen
from cbgen.engine import engine as engine_module


@pytest.mark.parametrize("extra", [{}, {"attn_implementation": "sdpa", "logprobs": True, "top_logprobs": 2},
                                   {"seed": 3, "temperature": 0.8, "repetition_penalty": 1.2}])
def test_the_kv_cache_is_freed_when_a_run_ends(tiny_model_dir, monkeypatch, extra):
    caches: list[weakref.ref] = []
    start = engine_module.start_manager

    def recording(*args, **kwargs):
        manager, facts = start(*args, **kwargs)
        caches.append(weakref.ref(manager.batch_processor.cache))
        return manager, facts

    monkeypatch.setattr(engine_module, "start_manager", recording)
    generator = cbgen.Generator(str(tiny_model_dir), dtype="float32", max_new_tokens=4, progress=False,
                                allow_block_sharing=True, **extra)  # its prefix matches are counted
    gc.disable()  # a reference cycle must not be what frees it: on a GPU that waits for a collection
    try:
        first = generator.generate(["one", "two three"])
        assert len(caches) == 1 and len(first) == 2
        assert caches[0]() is None, [type(r).__name__ for r in gc.get_referrers(caches[0]())]
        generator.generate(["four"])
        assert len(caches) == 2 and caches[1]() is None
    finally:
        gc.enable()
