"""Batch invariance: with --batch-invariant (the default wherever cbgen's compiled attention runs), a sequence's tokens
and logprobs are bitwise the same whatever shares its batches. As a property: random batch compositions (requests per
step, order, chunk budget, page size, -n forks, shared prefixes, seeded or greedy) on tiny models of every attention
kind cbgen serves, with grouped and ungrouped query heads, in bfloat16 and float32, each sequence against itself
computed alone; and whole jobs under other batch limits, input order, kill -9 and resume, shards and --data-parallel."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode

import cbgen
from cbgen.cli import run_cli
from cbgen.config.cpu import cpu_row
from cbgen.model.invariant import batch_invariant_linear
from cbgen.model.linear import LINEAR_KINDS, TILES
from cbgen.rows import read_shards
from tests.helpers import property_examples, write_jsonl
from tests.model.test_architectures import ARCHITECTURES, BASE

DTYPES = [torch.bfloat16, torch.float32]
# On a CPU without bfloat16 units (AVX2 only) bfloat16 is emulated (about 1 GFLOP/s a core, 50-100 times float32's
# time): there bfloat16 runs on one architecture's three batchings (its own code paths, the same check), and the
# properties and the whole jobs run in the machine's own dtype, float32, which is what a job there runs by default;
# on a CPU with bf16 units every case runs in both (2-core AMD EPYC Zen 3, AVX2: the file took 614 s of the suite,
# 90 s on a Zen 4)
BF16_UNITS = cpu_row().dtype == "bfloat16"
MACHINE_DTYPE = cpu_row().dtype  # what --dtype auto runs here


def _folder(name: str, tiny_model_dir: Path, root: Path) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = AutoConfig.for_model(**{**BASE, "vocab_size": len(tokenizer), **ARCHITECTURES[name][0]})
    torch.manual_seed(0)
    folder = root / name
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tiny_model_dir, tmp_path_factory):
    """The tiny model of an architecture (ARCHITECTURES), saved once for the module when first asked for: the tests
    only read them."""
    root = tmp_path_factory.mktemp("architectures")
    made: dict[str, Path] = {}

    def folder(name: str) -> Path:
        if name not in made:
            made[name] = _folder(name, tiny_model_dir, root)
        return made[name]

    return folder


def test_the_block_puts_the_model_back(folders):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folders("qwen3-moe"))
    before = model.get_experts_implementation()
    with batch_invariant_linear(model):
        assert "forward" in vars(model) and "forward" in vars(model.get_output_embeddings())
        assert set(model.get_experts_implementation().values()) == {"eager"}
    assert model.get_experts_implementation() == before
    assert all("forward" not in vars(m) for m in model.modules())


class _CountLinear(TorchFunctionMode):
    """Counts the `F.linear` calls that reach it: inside the block, only those no tile served."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        self.calls += func is torch.nn.functional.linear
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["llama", "gemma3", "qwen3-moe", "mixtral"])
def test_every_linear_of_a_forward_pass_runs_in_tiles(name, folders):
    """Dense models through their nn.Linear layers, MoE models' routers and experts too: a forward pass inside the
    block leaves no F.linear to the stock matmul (and outside it, the same pass does call it)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folders(name))
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        with _CountLinear() as outside:
            expected = model(ids).logits
        with batch_invariant_linear(model), _CountLinear() as inside:
            tiled = model(ids).logits
    assert outside.calls > 0 and inside.calls == 0
    torch.testing.assert_close(tiled, expected, atol=1e-4, rtol=1e-4)


# the property ------------------------------------------------------------------------------------------------------

# Tiny models of each attention kind cbgen serves. Query heads per KV head matter to the CPU kernels (an odd count left
# float32 flash attention's per-thread buffers misaligned: docs/generation.md), so both kinds of grouping are here.
PROPERTY_MODELS = {
    "llama, 3 query heads per KV head": dict(model_type="llama", hidden_size=96, head_dim=64, num_attention_heads=6,
                                             num_key_value_heads=2),
    "mistral, sliding window, no grouping": dict(model_type="mistral", head_dim=64, sliding_window=16,
                                                 num_key_value_heads=4),
    "gemma3, sliding and full layers": dict(model_type="gemma3_text", hidden_size=96, head_dim=64,
                                            query_pre_attn_scalar=64,
                                            sliding_window=16, num_attention_heads=6, num_key_value_heads=2,
                                            layer_types=["sliding_attention", "full_attention"]),
    "qwen3-moe, 3 query heads per KV head": dict(model_type="qwen3_moe", head_dim=64, num_attention_heads=3,
                                                 num_key_value_heads=1, num_experts=4, num_experts_per_tok=2,
                                                 moe_intermediate_size=32, norm_topk_prob=True),
}
_SHARED = "You are a careful assistant. Answer the question about the river in two sentences. "
# 40 prompts of 1 to about 70 tokens, across 16- and 32-token pages; half share a 17-token prefix
POOL = [_SHARED + "Which river is " + "longer and wider " * (i % 5) + f"than river {i}?" for i in range(20)] + [
    "Count: " + "one two three " * (i % 8) + str(i) for i in range(17)] + ["Hi", "The Danube", "Why?"]


FUSED_PROPERTY_MODELS = {"llama, 3 query heads per KV head", "mistral, sliding window, no grouping"}


@pytest.fixture(scope="module")
def property_models(tiny_model_dir, tmp_path_factory):
    """One Generator per (model, dtype), made when first drawn, and the sequences of each computed alone (one
    request per step: --max-requests-per-batch 1), per n and sampling. Counts the fused decoder layers' forward
    passes (cbgen.model.fused: on by default for Llama and Mistral), so the property is checked with them on."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from cbgen.model import fused

    fused_calls = [0]
    fused_forward = fused._Fused.forward

    def counted(self, *args, **kwargs):
        fused_calls[0] += 1
        return fused_forward(self, *args, **kwargs)

    fused._Fused.forward = counted  # type: ignore[method-assign]

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    root = tmp_path_factory.mktemp("property-models")
    generators: dict = {}
    alone: dict = {}

    def generator(name: str, dtype: str):
        if (name, dtype) not in generators:
            folder = root / name.split(",")[0]
            if not folder.exists():
                config = AutoConfig.for_model(**{**BASE, "vocab_size": len(tokenizer), **PROPERTY_MODELS[name]})
                torch.manual_seed(0)
                AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
                tokenizer.save_pretrained(folder)
            generators[name, dtype] = cbgen.Generator(model=str(folder), dtype=dtype, progress=False,
                                                      raw_prompts=True, batch_invariant=True)
        return generators[name, dtype]

    def reference(name: str, dtype: str, settings: tuple, chosen: list[int]) -> dict:
        known = alone.setdefault((name, dtype, settings), {})
        missing = [{"id": str(i), "prompt": POOL[i]} for i in chosen if str(i) not in {k[0] for k in known}]
        if missing:
            known.update(_sequences(generator(name, dtype).generate(missing, max_requests_per_batch=1,
                                                                    **dict(settings))))
        return known

    try:
        yield generator, reference, fused_calls
    finally:
        fused._Fused.forward = fused_forward  # type: ignore[method-assign]
        for made in generators.values():
            made.close()


@st.composite
def compositions(draw, dtypes=("bfloat16", "float32")):
    """A model, a dtype (of `dtypes`), how its sequences are sampled, and a batching of some of the pool's prompts."""
    chosen = draw(st.permutations(range(len(POOL))))[: draw(st.integers(2, len(POOL)))]
    sampled = draw(st.booleans())
    n = draw(st.sampled_from([1, 2])) if sampled else 1
    settings = (("logprobs", True), ("max_new_tokens", 6), ("num_return_sequences", n),
                *((("temperature", 1.0), ("seed", 3)) if sampled else (("do_sample", False),)))
    batching = dict(max_requests_per_batch=draw(st.integers(1, 64)),
                    max_batch_tokens=draw(st.sampled_from([16, 24, 40, 64, 100, 1024])),
                    page_size=draw(st.sampled_from([16, 32, 256])))
    return dict(model=draw(st.sampled_from(sorted(PROPERTY_MODELS))), dtype=draw(st.sampled_from(dtypes)),
                settings=settings, order=chosen, batching=batching)


def _check_composition(property_models, case) -> None:
    generator, reference, fused_calls = property_models
    rows = [{"id": str(i), "prompt": POOL[i]} for i in case["order"]]
    before = fused_calls[0]
    got = _sequences(generator(case["model"], case["dtype"]).generate(rows, **dict(case["settings"]),
                                                                         **case["batching"]))
    assert (fused_calls[0] > before) == (case["model"] in FUSED_PROPERTY_MODELS)
    expected = reference(case["model"], case["dtype"], case["settings"], case["order"])
    assert got and all(len(tokens) > 0 for tokens, _ in got.values())
    moved = sorted(key for key in got if got[key] != expected[key])
    assert not moved, f"sequences moved with the batch: {moved}"


@settings(max_examples=property_examples(8), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(case=compositions(("bfloat16", "float32") if BF16_UNITS else ("float32",)))
def test_a_sequence_is_the_same_in_any_batch(property_models, case):
    _check_composition(property_models, case)


@pytest.mark.slow
@settings(max_examples=16, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(case=compositions(("bfloat16", "float32") if BF16_UNITS else ("float32",)))
def test_a_sequence_is_the_same_in_any_batch_many_batchings(property_models, case):
    _check_composition(property_models, case)


# three fixed batchings ------------------------------------------------------------------------------------------------

PROMPTS = [("Tell me about the river number " + "and its long banks " * (i % 5) + str(i)) for i in range(10)]
MATRIX = ["llama", "mistral", "gemma3", "qwen3-moe"]  # plain, sliding-window, hybrid sliding/full, MoE


def _sequences(results) -> dict:
    return {(r.id, r.sample_index): (r.token_ids, r.logprobs) for r in results}


def _three_batchings(folder: Path, dtype: str, invariant: bool, compiled: bool | None = None) -> list[dict]:
    """Seeded samples (and logprobs) of 10 prompts of 8-60 tokens (longer than the 16-token windows): one request
    per batch, then shuffled at 3 per batch, then 64 per batch with a 24-token budget that cuts prompts into chunks."""
    rows = [{"id": str(i), "prompt": p} for i, p in enumerate(PROMPTS)]
    settings = dict(num_return_sequences=2, temperature=1.0, seed=5, max_new_tokens=10, logprobs=True)
    runs = []
    with cbgen.Generator(model=str(folder), dtype=dtype, progress=False, raw_prompts=True,
                         batch_invariant=invariant, compiled_attention=compiled) as generator:
        for i, batch in enumerate([dict(max_requests_per_batch=1), dict(max_requests_per_batch=3),
                                   dict(max_requests_per_batch=64, max_batch_tokens=24)]):
            order = rows[:]
            random.Random(i).shuffle(order)
            runs.append(_sequences(generator.generate(order, **settings, **batch)))
    assert all(len(tokens) == 10 for tokens, _ in runs[0].values())
    return runs


@pytest.mark.slow
@pytest.mark.parametrize(("name", "dtype"), [(name, dtype) for dtype in ("bfloat16", "float32") for name in MATRIX
                                             if dtype == "float32" or BF16_UNITS or name == "llama"])
def test_sequences_do_not_move_with_the_batch(name, dtype, folders):
    one, three, sixty_four = _three_batchings(folders(name), dtype, invariant=True)
    assert three == one
    assert sixty_four == one


@pytest.mark.slow
def test_without_it_the_same_check_finds_sequences_that_moved(folders):
    """The control: the stock numerics (cbgen's eager attention, torch's linear layers) under the same three batchings
    (measured: 6 of 20 sequences kept their tokens and logprobs in float32), so the comparison above does see a batch's
    effect when there is one."""
    one, three, sixty_four = _three_batchings(folders("llama"), "float32", invariant=False, compiled=False)
    assert three != one or sixty_four != one


# whole jobs -------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def job_prompts(tmp_path_factory) -> Path:
    rows = [{"id": f"r{i:02d}", "prompt": f"Describe the number {i}." + " Give details." * (i % 6)}
            for i in range(24)]
    return write_jsonl(tmp_path_factory.mktemp("invariance") / "prompts.jsonl", rows)


def _job(tiny_model_dir, prompts, out, *extra) -> list[str]:
    return ["run", str(prompts), "-o", str(out), "--model", str(tiny_model_dir), "--dtype", MACHINE_DTYPE,
            "--seed", "11", "--temperature", "1", "-n", "2", "--max-new-tokens", "16", "--logprobs", "-q",
            *map(str, extra)]


def _written(*outs: Path) -> dict:
    rows = [row for out in outs for row in read_shards(out)]
    found = {(r["id"], r["sample_index"]): (r["token_ids"], r["logprobs"]) for r in rows}
    assert len(found) == len(rows)  # each sequence once
    return found


@pytest.fixture(scope="module")
def reference_job(tiny_model_dir, job_prompts, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("reference") / "out"
    assert run_cli(_job(tiny_model_dir, job_prompts, out)) == 0
    manifest = json.loads((out / "run.json").read_text())
    assert manifest["batch_invariant"]["on"] is True  # on by default
    assert manifest["attention"] == "per-sequence, compiled kernel (batch-invariant by construction)"
    return _written(out)


def _greedy_job(tiny_model_dir, prompts, out, *extra) -> list[str]:
    """A greedy job in the machine's own dtype with no flag of invariance: what a new user runs."""
    return ["run", str(prompts), "-o", str(out), "--model", str(tiny_model_dir), "--dtype", MACHINE_DTYPE,
            "--max-new-tokens", "16", "--logprobs", "-q", *map(str, extra)]


@pytest.fixture(scope="module")
def greedy_reference(tiny_model_dir, job_prompts, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("greedy-reference") / "out"
    assert run_cli(_greedy_job(tiny_model_dir, job_prompts, out)) == 0
    assert json.loads((out / "run.json").read_text())["batch_invariant"]["on"] is True
    return _written(out)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["seeded", "greedy"])
def test_a_job_under_other_batch_limits_and_order(kind, tiny_model_dir, job_prompts, tmp_path, request):
    rows = [json.loads(line) for line in job_prompts.read_text().splitlines()]
    random.Random(4).shuffle(rows)
    shuffled = write_jsonl(tmp_path / "shuffled.jsonl", rows)
    out = tmp_path / "out"
    job, reference = (_job, "reference_job") if kind == "seeded" else (_greedy_job, "greedy_reference")
    assert run_cli(job(tiny_model_dir, shuffled, out, "--max-requests-per-batch", 3, "--max-batch-tokens", 40)) == 0
    assert _written(out) == request.getfixturevalue(reference)


@pytest.mark.slow
def test_a_job_in_shards_and_in_replicas(tiny_model_dir, job_prompts, tmp_path, reference_job):
    sharded = tmp_path / "sharded"
    for i in range(2):
        assert run_cli(_job(tiny_model_dir, job_prompts, sharded, "--num-shards", 2, "--shard-index", i)) == 0
    assert run_cli(["merge", str(sharded)]) == 0
    assert _written(sharded / "merged") == reference_job
    out = tmp_path / "replicas"
    assert run_cli(_job(tiny_model_dir, job_prompts, out, "--data-parallel", 2)) == 0  # one thread each
    assert json.loads((out / "run.json").read_text())["batch_invariant"]["on"] is True
    assert _written(out) == reference_job


@pytest.mark.slow
def test_a_greedy_job_killed_and_resumed(tiny_model_dir, job_prompts, tmp_path, greedy_reference):
    out = tmp_path / "out"
    args = _greedy_job(tiny_model_dir, job_prompts, out, "--rows-per-shard", 2, "--commit-interval", 0.05,
                       "--max-in-flight", 4)
    process = subprocess.Popen([sys.executable, "-m", "cbgen", *args], stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while len(list(out.glob("part-*.jsonl"))) < 2:
        assert process.poll() is None and time.monotonic() < deadline, process.stderr.read() if process.stderr else ""
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    assert process.wait(timeout=60) == -signal.SIGKILL
    assert run_cli(args) == 0
    assert json.loads((out / "run.json").read_text())["counts"]["resumed_requests"] > 0
    assert _written(out) == greedy_reference


# when it applies --------------------------------------------------------------------------------------------------


def test_every_job_is_invariant_where_the_compiled_attention_runs(tiny_model_dir, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "Hello"}])
    common = [str(prompts), "--model", str(tiny_model_dir), "--max-new-tokens", "2", "-q"]

    def manifest(name: str, *extra: str) -> dict:
        assert run_cli(["run", *common, "-o", str(tmp_path / name), *extra]) == 0
        return json.loads((tmp_path / name / "run.json").read_text())

    plain = manifest("plain")
    assert plain["batch_invariant"]["on"] is True and plain["batch_invariant"]["why"].startswith(
        "on: cbgen's compiled attention is invariant by construction")
    assert plain["engine_scope"]["linear"] == LINEAR_KINDS[TILES]
    off = manifest("off", "--no-batch-invariant")  # the kernel stays (it is invariant anyway), the linear tiles go
    assert off["batch_invariant"] == {"on": False, "why": "off (--no-batch-invariant)"}
    assert off["attention"] == plain["attention"] and "tiles" not in off["engine_scope"]["linear"]
    # without the compiled kernel, the eager attention's rule: seeded jobs only, unless asked
    eager = manifest("eager", "--no-compiled-attention")
    assert eager["batch_invariant"] == {"on": False, "why": "off: not a seeded job (--batch-invariant turns it on)"}
    assert manifest("asked", "--no-compiled-attention", "--batch-invariant")["batch_invariant"]["on"] is True
    seeded = manifest("seeded", "--no-compiled-attention", "--seed", "1", "--temperature", "1")
    assert seeded["batch_invariant"]["on"] is True and seeded["attention"] == "per-sequence, batch-invariant"
    seeded_off = manifest("seeded-off", "--seed", "1", "--temperature", "1", "--no-compiled-attention",
                          "--no-batch-invariant")
    assert seeded_off["batch_invariant"]["on"] is False and seeded_off["attention"] == "per-sequence"


def test_asked_where_it_cannot_apply_is_a_clear_error(tiny_model_dir, tmp_path, capsys):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "Hello"}])
    code = run_cli(["run", str(prompts), "-o", str(tmp_path / "out"), "--model", str(tiny_model_dir),
                    "--attn-implementation", "sdpa", "--batch-invariant", "-q"])
    assert code == 2
    err = capsys.readouterr().err
    assert "--batch-invariant does not apply here" in err and "drop the flag" in err and "Traceback" not in err
