"""cbgen.process.runtime: the process's caches, owned by one object that lists and forgets them."""

from __future__ import annotations

import pytest
import torch

import cbgen.config.cpu
import cbgen.kernels.build
import cbgen.model.adapters
import cbgen.model.gguf_parse
import cbgen.model.invariant  # noqa: F401 - each room asks the runtime for its caches when it is imported
from cbgen.model import packs
from cbgen.process.runtime import RUNTIME, Runtime

ROOMS = {"packed weights", "linear tile sizes", "linear tile probes read", "kernel builds", "adapters resolved",
         "adapter hub folders", "gguf readers", "gguf name maps", "cpu info", "onednn linear probe",
         "linear chunks probe", "draw kernel", "openmp pause"}


def test_every_cache_of_the_process_is_the_runtimes():
    import cbgen.control.draw
    import cbgen.engine.openmp  # noqa: F401

    assert ROOMS <= set(RUNTIME.names())
    assert all(RUNTIME.names()[name] for name in ROOMS)  # each says what it holds


def test_clear_forgets_a_pack_and_the_next_use_packs_again():
    weight = torch.randn(4, 4)
    calls = []

    def pack(tensor):
        calls.append(1)
        return tensor.t().contiguous()

    first = packs.kept(weight, "test-layout", pack)
    assert packs.kept(weight, "test-layout", pack) is first and len(calls) == 1
    assert RUNTIME.sizes()["packed weights"] >= 1
    assert "packed weights" in RUNTIME.clear("packed weights")
    assert RUNTIME.sizes()["packed weights"] == 0
    again = packs.kept(weight, "test-layout", pack)
    assert len(calls) == 2 and torch.equal(again, first) and again is not first


def test_clear_of_a_memo_reads_again(monkeypatch):
    reads = []
    real = cbgen.config.cpu._cpuinfo.__wrapped__

    def counted():
        reads.append(1)
        return real()

    runtime = Runtime()
    memo = runtime.memo("probe", "a counted probe")(__import__("functools").lru_cache(maxsize=1)(counted))
    memo(), memo()
    assert reads == [1] and runtime.sizes() == {"probe": 1}
    assert runtime.clear() == ["probe"] and runtime.sizes() == {"probe": 0}
    memo()
    assert reads == [1, 1]


def test_a_name_is_one_rooms_and_an_unknown_one_is_refused():
    runtime = Runtime()
    cache = runtime.cache("things", "id -> thing")
    assert runtime.cache("things", "id -> thing") is cache and runtime.named("things") is cache
    with pytest.raises(ValueError, match="is 'id -> thing' already"):
        runtime.cache("things", "something else")
    with pytest.raises(ValueError, match="no process cache named nothing; there are: things"):
        runtime.clear("nothing")
    with pytest.raises(TypeError, match="not cached by functools"):
        runtime.memo("plain", "a plain function")(lambda: 1)


def test_the_folders_are_the_cache_roots(tmp_path, monkeypatch):
    monkeypatch.setenv("CBGEN_CACHE_DIR", str(tmp_path / "c"))
    monkeypatch.setenv("CBGEN_KERNEL_CACHE_DIR", str(tmp_path / "k"))
    assert RUNTIME.folders() == {"cache": tmp_path / "c", "kernels": tmp_path / "k"}
