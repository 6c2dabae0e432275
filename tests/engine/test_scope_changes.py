"""cbgen.engine.scope and cbgen.engine.changes: every process-wide change of a run (transformers' logging, gc, the
caller's OpenMP pool, the manager's num_return_sequences) is the scope's, made on entry, undone on exit, and checked
by `check()` both ways; and two Generator calls on one model merge its fused weights once."""

from __future__ import annotations

import gc
import logging
from types import SimpleNamespace

import pytest
import torch

from cbgen.engine import openmp
from cbgen.engine.scope import EngineScope, ScopePlan
from cbgen.process.quiet import ENGINE_LOGGER


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(config).eval()


def _manager(n: int) -> SimpleNamespace:
    """What `EngineScope.building` reads of a manager it built."""
    return SimpleNamespace(continuous_batching_config=SimpleNamespace(), batch_processor=SimpleNamespace(),
                           num_return_sequences=n)


@pytest.fixture
def settings(monkeypatch):
    """transformers' logging and gc as a library caller would have them before a run: loud, nothing frozen."""
    from transformers.utils import logging as hf_logging

    monkeypatch.delenv("CBGEN_DEBUG", raising=False)
    verbosity, bar, level = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled(), \
        logging.getLogger(ENGINE_LOGGER).level
    hf_logging.set_verbosity_info()
    hf_logging.enable_progress_bar()
    logging.getLogger(ENGINE_LOGGER).setLevel(logging.DEBUG)
    frozen = gc.get_freeze_count()
    gc.unfreeze()
    yield hf_logging
    hf_logging.set_verbosity(verbosity)
    (hf_logging.enable_progress_bar if bar else hf_logging.disable_progress_bar)()
    logging.getLogger(ENGINE_LOGGER).setLevel(level)
    if frozen:
        gc.freeze()


def test_each_change_is_in_effect_inside_and_undone_after(settings, monkeypatch):
    hf_logging = settings
    pauses = []
    monkeypatch.setattr(openmp, "release_caller_pool", lambda: pauses.append(1) or True)
    manager = _manager(3)
    threads = torch.get_num_threads()
    with EngineScope(_model(), ScopePlan()) as scope:
        with scope.building(manager):
            pass
        scope.check()
        assert gc.get_freeze_count() > 0
        assert hf_logging.get_verbosity() == logging.ERROR and not hf_logging.is_progress_bar_enabled()
        assert logging.getLogger(ENGINE_LOGGER).level == logging.CRITICAL
        assert scope.release_caller_pool() and len(pauses) == 1
        with scope.forking(1):
            assert manager.num_return_sequences == 1
            scope.check()
        assert manager.num_return_sequences == 3
        manager.num_return_sequences = 5  # left changed: the scope puts its own value back
    scope.check()
    assert gc.get_freeze_count() == 0
    assert hf_logging.get_verbosity() == logging.INFO and hf_logging.is_progress_bar_enabled()
    assert logging.getLogger(ENGINE_LOGGER).level == logging.DEBUG
    assert manager.num_return_sequences == 3
    assert not scope.release_caller_pool() and len(pauses) == 1  # the policy ended with the scope
    assert torch.get_num_threads() == threads
    whats = {change.what for change in scope.changes}
    assert {"transformers's logging quietened", "older objects frozen (gc)", "SimpleNamespace.num_return_sequences",
            "the caller's idle OpenMP pool freed while the engine waits", "the model held by its engine"} <= whats


@pytest.mark.parametrize("breaking", ["gc", "logging", "manager", "openmp"])
def test_check_finds_a_change_undone_while_the_scope_is_open(settings, breaking):
    hf_logging = settings
    manager = _manager(2)
    threads = torch.get_num_threads()
    with EngineScope(_model(), ScopePlan()) as scope:
        with scope.building(manager):
            pass
        if breaking == "gc":
            gc.unfreeze()
        elif breaking == "logging":
            hf_logging.set_verbosity_info()
        elif breaking == "manager":
            manager.num_return_sequences = 4
        else:
            torch.set_num_threads(threads + 1)
        try:
            with pytest.raises(RuntimeError, match="the engine scope's changes are not as they should be"):
                scope.check()
        finally:
            torch.set_num_threads(threads)


@pytest.mark.parametrize("breaking", ["gc", "logging"])
def test_check_finds_a_change_left_after_the_scope(settings, breaking):
    hf_logging = settings
    with EngineScope(_model(), ScopePlan()) as scope:
        pass
    scope.check()
    if breaking == "gc":
        gc.freeze()
        match = "objects are frozen after the engines ended"
    else:
        hf_logging.set_verbosity_warning()
        match = "logging was not put back"
    try:
        with pytest.raises(RuntimeError, match=match):
            scope.check()
    finally:
        gc.unfreeze()


def test_two_open_scopes_share_the_process_changes(settings):
    """Two engines at once (two models, two threads in a notebook): the first one out leaves gc and logging as the
    other needs them; the last one out puts them back."""
    hf_logging = settings
    first, second = EngineScope(_model(), ScopePlan()), EngineScope(_model(), ScopePlan())
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    second.check()
    first.check()
    assert gc.get_freeze_count() > 0 and hf_logging.get_verbosity() == logging.ERROR
    second.__exit__(None, None, None)
    second.check()
    assert gc.get_freeze_count() == 0 and hf_logging.get_verbosity() == logging.INFO


def test_two_generator_calls_merge_the_fused_weights_once(tiny_model_dir, monkeypatch):
    import cbgen
    from cbgen.model import fused

    merges: list = []
    original = fused._merged
    monkeypatch.setattr(fused, "_merged", lambda parts: merges.append(parts) or original(parts))
    rows = [{"id": str(i), "prompt": f"Count to {i}"} for i in range(3)]
    with cbgen.Generator(model=str(tiny_model_dir), dtype="float32", progress=False, raw_prompts=True) as generator:
        layers = fused.decoder_layers(generator.loaded.model)
        first = [r.token_ids for r in generator.generate(rows, max_new_tokens=4)]
        assert len(merges) == 2 * len(layers)  # qkv and gate_up of each layer
        pointer = layers[0].self_attn.q_proj.weight.data_ptr()
        second = [r.token_ids for r in generator.generate(rows, max_new_tokens=4)]
    assert len(merges) == 2 * len(layers)  # none merged again
    assert layers[0].self_attn.q_proj.weight.data_ptr() == pointer  # nor copied back
    assert first == second
