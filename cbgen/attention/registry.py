"""cbgen's attention functions in transformers' attention registry, per model.

transformers looks a model's attention function up by name (`"sdpa"`, `"paged|eager"`) in one process-wide registry
(`AttentionInterface`), and its continuous-batching engine accepts only those names. So while any engine of cbgen's
runs, the name holds cbgen's dispatcher (cbgen.process.shared_patch), which routes each call by the config of the module
that makes it: to the function that model's engine bound, or else to what the name held before. Two engines in one
process (two `cbgen.Generator`s in two threads) each get their own function, and a model no engine holds attends as
transformers would have it. One model takes one function per name at a time: a second engine asking another one for
the same model is refused.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from cbgen.errors import CbgenError
from cbgen.process.shared_patch import SharedPatch

# transformers' own function for each name cbgen may bind, used when nothing else was registered before
_TRANSFORMERS_DEFAULTS = {
    "sdpa": ("transformers.integrations.sdpa_attention", "sdpa_attention_forward"),
    "paged|eager": ("transformers.integrations.eager_paged", "eager_paged_attention_forward"),
}

_lock = threading.Lock()
_bound: dict[tuple[str, int], tuple[Callable[..., Any], int]] = {}  # (name, id(config)) -> (function, holds)


def registered(name: str) -> Callable[..., Any]:
    """What transformers' registry holds under `name` now (a fresh instance has no local overrides)."""
    from transformers import AttentionInterface

    return AttentionInterface()[name]


def _register(name: str, function: Callable[..., Any]) -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(name, function)


def stock(name: str) -> Callable[..., Any]:
    """The function a call that no engine of cbgen's computes goes to: what the name held before cbgen's dispatcher,
    else transformers' own."""
    original = _PATCHES[name].original
    if original is not None:
        return original
    module, function = _TRANSFORMERS_DEFAULTS[name]
    return getattr(importlib.import_module(module), function)


def _dispatcher(name: str) -> Callable[..., Any]:
    def dispatch(module: Any, *args: Any, **kwargs: Any) -> Any:
        entry = _bound.get((name, id(getattr(module, "config", None))))
        return (entry[0] if entry is not None else stock(name))(module, *args, **kwargs)

    dispatch.__name__ = dispatch.__qualname__ = f"cbgen_{name.replace('|', '_')}_dispatch"
    return dispatch


def _patch(name: str) -> SharedPatch:
    return SharedPatch(f"transformers' {name!r} attention", lambda: registered(name),
                       lambda value: _register(name, value), _dispatcher(name))


_PATCHES = {name: _patch(name) for name in _TRANSFORMERS_DEFAULTS}


def model_configs(model: torch.nn.Module) -> list[Any]:
    """Every config object the model's modules hold (a multimodal model's text config is not its own config): the
    keys its attention calls are routed by."""
    configs = {id(model.config): model.config} if getattr(model, "config", None) is not None else {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and not isinstance(config, (int, float, str, dict)):
            configs.setdefault(id(config), config)
    return list(configs.values())


def bound_function(model: torch.nn.Module, name: str) -> Callable[..., Any] | None:
    """The function bound for `model` under `name`, or None."""
    entry = _bound.get((name, id(model.config)))
    return entry[0] if entry is not None else None


def serving(model: torch.nn.Module, name: str, function: Callable[..., Any]) -> bool:
    """Whether `model`'s calls under `name` reach `function` now: the dispatcher holds the name, and every config of
    the model is bound to it."""
    return _PATCHES[name].serving() and all(
        (entry := _bound.get((name, id(config)))) is not None and entry[0] is function
        for config in model_configs(model))


@contextmanager
def bound(model: torch.nn.Module, name: str, function: Callable[..., Any]) -> Iterator[None]:
    """`model`'s attention calls under `name` go to `function` while the block runs. Binding the same function again
    (a nested engine) is counted; another function for the same model raises CbgenError."""
    keys = [(name, id(config)) for config in model_configs(model)]
    with _lock:
        for key in keys:
            entry = _bound.get(key)
            if entry is not None and entry[0] is not function:
                raise CbgenError(f"this model is generating in another engine with {entry[0].__name__} as its "
                                 f"{name!r} attention; one model runs one engine's attention at a time: give each "
                                 "thread its own cbgen.Generator")
        for key in keys:
            held = _bound.get(key)
            _bound[key] = (function, (held[1] if held else 0) + 1)
    _PATCHES[name].hold()
    try:
        yield
    finally:
        _PATCHES[name].release()
        with _lock:
            for key in keys:
                held_function, holds = _bound[key]
                if holds > 1:
                    _bound[key] = (held_function, holds - 1)
                else:
                    del _bound[key]
