"""The converted-GGUF cache: the first load of a GGUF saves it as safetensors, later loads read that instead.

Runs on a tiny Llama GGUF written here (2 layers, Q8_0 weights, a 512-token slice of SmolLM2's tokenizer), so
each load takes well under a second.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from cbgen.config import ModelSection
from cbgen.model import gguf as model_cache
from cbgen.model import load as model_load
from cbgen.model import source as model_source

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, VOCAB = 64, 2, 4, 2, 128, 512


def write_tiny_gguf(path: Path) -> Path:
    """A tiny Llama GGUF with random Q8_0 weights and the first VOCAB tokens of the embedded SmolLM2 tokenizer
    (with the merges among them, and its chat template)."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(model_source.embedded_model_path()))
    field = lambda key: reader.fields[key].contents()  # noqa: E731
    tokens = field("tokenizer.ggml.tokens")[:VOCAB]
    kept = set(tokens)
    merges = [m for m in field("tokenizer.ggml.merges")
              if (parts := m.split(" ")) and len(parts) == 2 and {parts[0], parts[1], "".join(parts)} <= kept]

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(field("tokenizer.ggml.token_type")[:VOCAB])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(field("tokenizer.chat_template"))

    rng = np.random.default_rng(0)

    def q8(name: str, rows: int, cols: int) -> None:
        packed = gguf.quants.quantize((rng.standard_normal((rows, cols)) * 0.1).astype(np.float32),
                                      gguf.GGMLQuantizationType.Q8_0)
        writer.add_tensor(name, packed, raw_shape=packed.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)

    def norm(name: str) -> None:
        writer.add_tensor(name, (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))

    kv = HIDDEN // HEADS * KV_HEADS
    q8("token_embd.weight", VOCAB, HIDDEN)  # no output.weight: tied embeddings
    for i in range(LAYERS):
        norm(f"blk.{i}.attn_norm.weight")
        norm(f"blk.{i}.ffn_norm.weight")
        q8(f"blk.{i}.attn_q.weight", HIDDEN, HIDDEN)
        q8(f"blk.{i}.attn_k.weight", kv, HIDDEN)
        q8(f"blk.{i}.attn_v.weight", kv, HIDDEN)
        q8(f"blk.{i}.attn_output.weight", HIDDEN, HIDDEN)
        q8(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN)
        q8(f"blk.{i}.ffn_up.weight", FFN, HIDDEN)
        q8(f"blk.{i}.ffn_down.weight", HIDDEN, FFN)
    norm("output_norm.weight")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny-gguf") / "tiny-llama.Q8_0.gguf")


def load(gguf: Path, cache_dir: Path | None, dtype: str = "float32", **settings) -> model_load.LoadedModel:
    """The file loaded as these tests compare it: dequantized to float (--quantize none; the default for a Q8_0 file
    such as this one holds its matrices as int8: tests/model/test_int8.py and the last test here)."""
    return model_load.load_model(ModelSection(model=str(gguf), dtype=dtype, device="cpu",
                                         cache_dir=str(cache_dir) if cache_dir else None,
                                         **{"quantize": "none", **settings}))


def greedy(loaded: model_load.LoadedModel, text: str = "What is the capital of France?") -> list[int]:
    ids = loaded.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                               return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        out = loaded.model.generate(ids, max_new_tokens=12, do_sample=False, min_new_tokens=12)
    return out[0].tolist()


def entry_folder(cache_dir: Path, gguf: Path, entry: str) -> Path:
    return model_cache.GgufCache(cache_dir, gguf).folder / entry


@pytest.mark.slow
def test_miss_then_hit_gives_the_same_model(tiny_gguf, tmp_path):
    cold = load(tiny_gguf, tmp_path)
    assert cold.cache == model_cache.CACHE_WRITTEN
    assert (entry_folder(tmp_path, tiny_gguf, "model-float32") / "model.safetensors").is_file()
    assert (entry_folder(tmp_path, tiny_gguf, "tokenizer") / "tokenizer.json").is_file()
    warm = load(tiny_gguf, tmp_path)
    assert warm.cache == model_cache.CACHE_HIT
    for loaded in (cold, warm):
        assert getattr(loaded.model, "hf_quantizer", None) is None
        assert not hasattr(loaded.model.config, "quantization_config")
    cold_state, warm_state = cold.model.state_dict(), warm.model.state_dict()
    assert cold_state.keys() == warm_state.keys()
    for name, tensor in cold_state.items():
        assert warm_state[name].dtype == tensor.dtype == torch.float32, name
        assert torch.equal(warm_state[name], tensor), name
    assert greedy(cold) == greedy(warm)
    assert warm.tokenizer.chat_template == cold.tokenizer.chat_template
    assert len(warm.tokenizer) == len(cold.tokenizer) == VOCAB
    # the same as a plain GGUF load, untouched by the cache
    direct = load(tiny_gguf, None, use_cache=False)
    assert direct.cache == model_cache.CACHE_OFF
    assert greedy(direct) == greedy(warm)


def test_gguf_model_saves_once_the_quantizer_marker_is_dropped(tiny_gguf, tmp_path):
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name, dtype=torch.float32)
    with pytest.raises(ValueError, match="not serializable"):
        loaded.save_pretrained(tmp_path / "refused")
    assert model_cache.drop_gguf_marker(loaded)
    loaded.save_pretrained(tmp_path / "saved")
    assert (tmp_path / "saved" / "model.safetensors").is_file()


def test_a_different_dtype_is_a_different_entry(tiny_gguf, tmp_path):
    assert load(tiny_gguf, tmp_path, "float32").cache == model_cache.CACHE_WRITTEN
    bf16 = load(tiny_gguf, tmp_path, "bfloat16")
    assert bf16.cache == model_cache.CACHE_WRITTEN  # tokenizer hit, model written
    assert bf16.model.dtype == torch.bfloat16
    assert load(tiny_gguf, tmp_path, "bfloat16").cache == model_cache.CACHE_HIT
    assert load(tiny_gguf, tmp_path, "float32").cache == model_cache.CACHE_HIT
    folder = model_cache.GgufCache(tmp_path, tiny_gguf).folder
    entries = sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))  # not the writers' locks
    assert entries == ["model-bfloat16", "model-float32", "tokenizer"]


def test_an_interrupted_write_is_never_trusted(tiny_gguf, tmp_path):
    final = entry_folder(tmp_path, tiny_gguf, "model-float32")
    final.parent.mkdir(parents=True)
    leftover = final.with_name(".tmp-model-float32-999-dead")  # a killed first run's half-written folder
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"\0" * 100)
    old = leftover.stat().st_mtime - 7 * 3600
    os.utime(leftover, (old, old))
    loaded = load(tiny_gguf, tmp_path)
    assert loaded.cache == model_cache.CACHE_WRITTEN
    assert not leftover.exists()  # swept: older than any running writer
    assert [p.name for p in final.parent.glob(".tmp-*")] == []


def test_an_entry_without_its_marker_or_with_broken_weights_is_rebuilt(tiny_gguf, tmp_path, caplog):
    reference = greedy(load(tiny_gguf, tmp_path))
    final = entry_folder(tmp_path, tiny_gguf, "model-float32")
    (final / "model.safetensors").write_bytes(b"not safetensors")
    with caplog.at_level(logging.WARNING, logger="cbgen.model"):
        rebuilt = load(tiny_gguf, tmp_path)
    assert rebuilt.cache == model_cache.CACHE_WRITTEN and "is broken (SafetensorError" in caplog.text
    assert greedy(rebuilt) == reference
    (final / "cbgen-cache.json").unlink()  # as if written by hand, or by a foreign tool
    assert load(tiny_gguf, tmp_path).cache == model_cache.CACHE_WRITTEN


def test_unwritable_cache_falls_back_and_warns_once(tiny_gguf, tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cache_dir = blocker / "cache"  # cannot be created, even by root
    with caplog.at_level(logging.WARNING, logger="cbgen.model"):
        first = load(tiny_gguf, cache_dir)
        second = load(tiny_gguf, cache_dir)
    assert first.cache == second.cache == model_cache.CACHE_UNWRITABLE
    warnings = [r for r in caplog.records if "cannot write the model cache" in r.getMessage()]
    assert len(warnings) == 1
    assert greedy(first) == greedy(load(tiny_gguf, None, use_cache=False))


def test_a_bad_setting_does_not_cost_the_cache(tiny_gguf, tmp_path):
    from cbgen.errors import CbgenError

    load(tiny_gguf, tmp_path)
    with pytest.raises(CbgenError):
        load(tiny_gguf, tmp_path, attn_implementation="no-such-attention")
    assert load(tiny_gguf, tmp_path).cache == model_cache.CACHE_HIT


def test_no_model_cache_writes_nothing(tiny_gguf, tmp_path):
    loaded = load(tiny_gguf, tmp_path, use_cache=False)
    assert loaded.cache == model_cache.CACHE_OFF
    assert list(tmp_path.iterdir()) == []


def test_cache_location(monkeypatch, tmp_path):
    monkeypatch.delenv(model_cache.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert model_cache.default_cache_dir() == tmp_path / "xdg" / "cbgen"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert model_cache.default_cache_dir() == Path.home() / ".cache" / "cbgen"
    monkeypatch.setenv(model_cache.CACHE_ENV, str(tmp_path / "env"))
    assert model_cache.default_cache_dir() == tmp_path / "env"
    assert model_cache.default_cache_dir(ModelSection(cache_dir=str(tmp_path / "flag"))) == tmp_path / "flag"


def test_file_digest_is_memoised_by_size_and_mtime(tmp_path):
    import hashlib

    data, memo = tmp_path / "weights.gguf", tmp_path / "cache" / "digests.json"
    data.write_bytes(b"one")
    assert model_cache.file_digest(data, memo) == hashlib.sha256(b"one").hexdigest()
    assert memo.is_file()
    data.write_bytes(b"two")  # same size; a new mtime
    os.utime(data, ns=(data.stat().st_atime_ns, data.stat().st_mtime_ns + 10**9))
    assert model_cache.file_digest(data, memo) == hashlib.sha256(b"two").hexdigest()


@pytest.mark.slow
def test_cached_tokenizer_describes_its_added_tokens(tmp_path):
    """The cached tokenizer of the embedded GGUF carries `added_tokens_decoder` (without it transformers parses the
    whole tokenizer.json in Python on every load), and it is still the GGUF's own tokenizer; an entry written
    without it gets it on its next load."""
    import json

    from transformers import AutoTokenizer

    gguf = model_source.embedded_model_path()
    cache = model_cache.GgufCache(tmp_path, gguf)
    written, status = model_cache.gguf_tokenizer(gguf, cache)
    config_path = cache.find("tokenizer") / "tokenizer_config.json"
    described = json.loads(config_path.read_text())["added_tokens_decoder"]
    assert described["2"]["content"] == written.eos_token
    cached, status = model_cache.gguf_tokenizer(gguf, cache)
    assert status == model_cache.CACHE_HIT
    original = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo <|im_end|> 🙂"}]
    for tokenizer in (written, cached):
        assert tokenizer.apply_chat_template(messages, tokenize=True) == original.apply_chat_template(messages,
                                                                                                   tokenize=True)
        assert tokenizer.all_special_ids == original.all_special_ids and len(tokenizer) == len(original)
    config = json.loads(config_path.read_text())
    del config["added_tokens_decoder"]  # as cbgen wrote entries before
    config_path.write_text(json.dumps(config))
    assert model_cache.gguf_tokenizer(gguf, cache)[1] == model_cache.CACHE_HIT
    assert json.loads(config_path.read_text())["added_tokens_decoder"] == described


WAITER = r"""
import json, sys, time
from pathlib import Path
from cbgen.config import ModelSection
from cbgen.model import gguf as model_cache
from cbgen.model.load import load_model

gguf, cache_dir, role = sys.argv[1], sys.argv[2], sys.argv[3]
if role == "first":  # converts slowly, and says when it holds the lock
    real = model_cache.GgufCache.converting
    def converting(self, entry):
        manager = real(self, entry)
        class Slow:
            def __enter__(s):
                manager.__enter__()
                if entry.startswith("model"):
                    Path(cache_dir, "converting").write_text("yes")
                    time.sleep(3)
            def __exit__(s, *exc):
                return manager.__exit__(*exc)
        return Slow()
    model_cache.GgufCache.converting = converting
loaded = load_model(ModelSection(model=gguf, dtype="float32", device="cpu", cache_dir=cache_dir, quantize="none"))
print(json.dumps({"cache": loaded.cache}))
"""


@pytest.mark.slow
def test_two_processes_convert_a_gguf_once(tiny_gguf, tmp_path):
    """The second process asks for the entry while the first converts it: it waits for the first (cbgen converts it
    once, not once per Slurm task on the node), then reads the entry the first wrote."""
    import json
    import subprocess
    import sys
    import time

    def start(role: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", WAITER, str(tiny_gguf), str(tmp_path), role],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    first = start("first")
    deadline = time.monotonic() + 120
    while not (tmp_path / "converting").exists():
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()
        time.sleep(0.02)
    second = start("second")
    results = [json.loads(p.communicate(timeout=300)[0].strip().splitlines()[-1]) for p in (first, second)]
    assert results == [{"cache": model_cache.CACHE_WRITTEN}, {"cache": model_cache.CACHE_HIT}]


def test_a_gguf_file_is_parsed_once_per_load_and_loads_as_transformers_loads_it(tiny_gguf, monkeypatch):
    """transformers' GGUF loader parses the file for the tokenizer, the config and the weights, and builds a tensor-name
    map per module; within a load cbgen has each done once (cbgen.model.gguf_parse: the embedded model's first load
    took 44 s, 10.5 s after, on a 2-core AMD EPYC Zen 3), and the model and tokenizer are transformers' own loads'."""
    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parses, maps = [], []
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    monkeypatch.setattr(gguf, "GGUFReader", lambda path, *a, **k: parses.append(path) or reader(path, *a, **k))
    monkeypatch.setattr(gguf, "get_tensor_name_map", lambda *a: maps.append(a) or name_map(*a))
    ours = load(tiny_gguf, None, use_cache=False)
    assert len(parses) == 1 and len(set(maps)) == len(maps) == 1
    assert gguf.GGUFReader is not reader and gguf.get_tensor_name_map is not name_map  # the test's, put back
    parses.clear()
    model = AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name)
    assert len(parses) >= 2  # transformers' own, outside a cbgen load: a parse per call
    theirs = model.state_dict()
    assert ours.model.state_dict().keys() == theirs.keys()
    assert all(torch.equal(tensor, theirs[name]) for name, tensor in ours.model.state_dict().items())
    assert ours.tokenizer.get_vocab() == tokenizer.get_vocab()
    assert ours.tokenizer.chat_template == tokenizer.chat_template


def test_a_q8_0_file_loads_as_int8_by_default_parsing_it_once(tiny_gguf, tmp_path, monkeypatch):
    """--quantize auto on a Q8_0 file: its matrices held as int8, the file's weight type read within the load's one
    parse (and kept beside its digest: the next load reads no tensor table for it)."""
    import gguf

    parses = []
    reader = gguf.GGUFReader
    monkeypatch.setattr(gguf, "GGUFReader", lambda path, *a, **k: parses.append(path) or reader(path, *a, **k))
    loaded = load(tiny_gguf, tmp_path / "cache", quantize="auto")
    assert loaded.quantized is not None and loaded.quantized["quantized"] == "int8" and loaded.dtype == torch.float32
    assert len(parses) == 1
    parses.clear()
    again = load(tiny_gguf, tmp_path / "cache", quantize="auto")  # the converted cache and the weight type kept
    assert again.quantized == loaded.quantized and parses == []
