"""cbgen.engine.scope: everything cbgen installs for an engine comes from the plan, is checked on entry, and is gone
when the engine ends; two engines in one process each run their own plan, or the second is refused."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from transformers import AttentionInterface
from transformers.generation.continuous_batching import input_outputs

import cbgen
from cbgen.attention import registry
from cbgen.engine import scope as scope_module
from cbgen.engine.scope import PER_SEQUENCE, EngineScope, ScopePlan
from cbgen.errors import CbgenError
from cbgen.model import tiles_kernel

ROWS = [{"id": str(i), "prompt": "Tell me about the river number " + "and its banks " * (i % 4) + str(i)}
        for i in range(12)]
SEEDED = dict(temperature=1.0, seed=5, num_return_sequences=2, max_new_tokens=12, logprobs=True)
GREEDY = dict(max_new_tokens=12, logprobs=True)


def _sequences(results) -> dict:
    return {(r.id, r.sample_index): (r.token_ids, r.logprobs) for r in results}


def _pristine(model: torch.nn.Module) -> list[str]:
    """What of cbgen's is still in place on the model or in transformers and torch (empty: nothing)."""
    left = [f"forward of {name or 'the model'}" for name, m in model.named_modules() if "forward" in vars(m)]
    left += [f"hooks on {name or 'the model'}" for name, m in model.named_modules()
             if m._forward_hooks or m._forward_pre_hooks]
    left += [f"attribute {key} on {name or 'the model'}" for name, m in model.named_modules() for key in vars(m)
             if key.startswith("_cbgen")]
    for name in ("sdpa", "paged|eager"):
        if registry.bound_function(model, name) is not None:
            left.append(f"a bound {name} function")
        if AttentionInterface()[name] is not registry.stock(name):
            left.append(f"transformers' {name} attention replaced")
    if getattr(input_outputs.attn_mask_is_needed, "__module__", "").startswith("cbgen"):
        left.append("attn_mask_is_needed replaced")
    if torch.overrides._get_current_function_mode_stack():
        left.append("a torch function mode")
    if scope_module._held:
        left.append("a model held by a scope")
    return left


@pytest.fixture(scope="module")
def pair(tiny_model_dir):
    """Two Generators on the same folder: two loaded models, as two threads of a notebook would have."""
    first = cbgen.Generator(model=str(tiny_model_dir), dtype="float32", progress=False, raw_prompts=True)
    second = cbgen.Generator(model=str(tiny_model_dir), dtype="float32", progress=False, raw_prompts=True)
    yield first, second
    first.close()
    second.close()


@pytest.fixture(scope="module")
def alone(pair):
    """What each Generator gives alone: the first seeded (so batch-invariant), the second greedy (not)."""
    first, second = pair
    return _sequences(first.generate(ROWS, **SEEDED)), _sequences(second.generate(ROWS, **GREEDY))


def test_nothing_stays_installed_after_a_run(pair, alone):
    first, second = pair
    assert _pristine(first.loaded.model) == [] and _pristine(second.loaded.model) == []
    stock = registry.stock("sdpa")
    assert AttentionInterface()["sdpa"] is stock


def test_two_engines_at_once_each_give_what_they_give_alone(pair, alone):
    first, second = pair
    seeded, greedy = alone
    out: dict[str, dict] = {}
    spans: dict[str, tuple[float, float]] = {}

    def run(name, generator, settings):
        started = time.perf_counter()
        out[name] = _sequences(generator.generate(ROWS, **settings))
        spans[name] = (started, time.perf_counter())

    threads = [threading.Thread(target=run, args=("seeded", first, SEEDED)),
               threading.Thread(target=run, args=("greedy", second, GREEDY))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert spans["seeded"][0] < spans["greedy"][1] and spans["greedy"][0] < spans["seeded"][1]  # they overlapped
    assert out["seeded"] == seeded
    assert out["greedy"] == greedy
    assert _pristine(first.loaded.model) == [] and _pristine(second.loaded.model) == []


def test_two_engines_one_after_the_other(pair, alone):
    first, second = pair
    seeded, greedy = alone
    assert _sequences(second.generate(ROWS, **GREEDY)) == greedy
    assert _sequences(first.generate(ROWS, **SEEDED)) == seeded
    assert _sequences(second.generate(ROWS, **GREEDY)) == greedy


def test_a_second_engine_on_a_generating_model_is_refused(pair, alone):
    first, _ = pair
    model = first.loaded.model
    errors: list[BaseException] = []

    def long_run():
        try:
            many = [{"id": f"{k}-{row['id']}", "prompt": row["prompt"]} for k in range(3) for row in ROWS]
            first.generate(many, **{**GREEDY, "max_new_tokens": 48})
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    thread = threading.Thread(target=long_run)
    thread.start()
    deadline = time.monotonic() + 60
    while id(model) not in scope_module._held:
        assert time.monotonic() < deadline and thread.is_alive(), errors
        time.sleep(0.005)
    with pytest.raises(CbgenError) as refused:
        first.generate(ROWS[:1], **SEEDED)
    thread.join(timeout=300)
    message = str(refused.value)
    assert "\n" not in message and "already generating in another engine" in message and "cbgen.Generator" in message
    assert errors == []
    assert _pristine(model) == []


def test_entry_checks_what_serves_the_model(pair):
    """The scope's check finds the plan's attention not serving when something replaced transformers' function after
    cbgen bound its own; on exit the replacement is left in place and nothing of cbgen's stays."""
    model = pair[0].loaded.model
    before = AttentionInterface()["sdpa"]
    plan = ScopePlan(attention=PER_SEQUENCE, dense_mask=False)
    with EngineScope(model, plan) as scope:
        scope.check()
        assert registry.serving(model, "sdpa", registry.bound_function(model, "sdpa"))
        assert not input_outputs.attn_mask_is_needed(model.config)

        def theirs(*args, **kwargs):
            return before(*args, **kwargs)

        try:
            AttentionInterface.register("sdpa", theirs)
            with pytest.raises(RuntimeError, match="something replaced transformers' 'sdpa' attention"):
                scope.check()
        except BaseException:
            AttentionInterface.register("sdpa", before)  # the other tests get the stock function back, whatever failed
            raise
    try:
        assert AttentionInterface()["sdpa"] is theirs  # someone else's replacement is theirs to remove
    finally:
        AttentionInterface.register("sdpa", before)
    assert _pristine(model) == []


def test_the_plan_is_what_run_json_records(tiny_model_dir, tmp_path):
    import json

    from cbgen.cli import run_cli
    from tests.helpers import write_jsonl

    prompts = write_jsonl(tmp_path / "p.jsonl", ROWS[:3])
    out = tmp_path / "out"
    assert run_cli(["run", str(prompts), "-o", str(out), "--model", str(tiny_model_dir), "--dtype", "float32",
                    "--seed", "3", "--temperature", "1", "--max-new-tokens", "3", "-q"]) == 0
    manifest = json.loads((out / "run.json").read_text())
    kernel = manifest["engine_scope"].pop("attention_kernel")
    linear = manifest["engine_scope"].pop("linear_kernel")  # float32 on AVX2 and up: the compiled linear blocks
    assert linear == ({"compiled": True, "why": linear["why"]} if tiles_kernel.unfit_reason(torch.float32) is None
                      else {"compiled": False, "why": linear["why"]})
    assert linear["why"].endswith("; --no-compiled-linear: the fixed tiles)") if linear["compiled"] else \
        linear["why"].startswith("off: ")
    assert kernel["compiled"] is True and kernel["why"].startswith("on (")  # "on (built in 18.2 s; ..." or "cached"
    assert kernel["why"].endswith("; --no-compiled-attention turns it off)")
    assert manifest["engine_scope"] == {
        "attention": "per-sequence, compiled kernel (batch-invariant by construction)",
        "implementation": "sdpa",
        "batch_invariant": {"on": True, "why": "on: cbgen's compiled attention is invariant by construction, the "
                                               "linear layers run in fixed blocks (--no-batch-invariant turns it "
                                               "off)"},
        "linear": "batch-invariant, rows in blocks of 64 (engine_scope.linear_kernel says whose)",
        "dense_attention_mask": "not built: cbgen's per-sequence attention does not read it",
        "kv_cache_memory": "as used, freed blocks given back",
        "decoder_layers": {"fused": True, "compiled_operators": True,
                           "why": "on: the model's layers fit it (--no-fused-layers turns it off); norms, rotary and "
                                  "SiLU compiled (--no-compiled-ops: eager)"}}
    assert manifest["attention"] == manifest["engine_scope"]["attention"]
    assert manifest["model"]["linear"] == manifest["engine_scope"]["linear"]
    assert manifest["batch_invariant"] == manifest["engine_scope"]["batch_invariant"]
