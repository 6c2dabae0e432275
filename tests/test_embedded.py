"""End to end on the embedded SmolLM2-135M-Instruct, through the installed `cbgen` command, in float32 (bf16 greedy
tokens drift with batch composition even on transformers' own path, so exactness is checked in fp32)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cbgen.cli import run_cli
from cbgen.rows import read_shards
from tests.helpers import write_jsonl

pytestmark = pytest.mark.embedded

QUESTIONS = [
    "What is the capital of France?",
    "Name a colour of the rainbow.",
    "Write one sentence about the sea.",
    "What is 3 + 4?",
    "Give me a word that rhymes with cat.",
    "Who wrote Hamlet?",
]
SYSTEM = "You are a helpful assistant. Answer in one short sentence."
MAX_NEW = 16


CBGEN = Path(sys.executable).parent / "cbgen"  # the console script `pip install` made, beside this interpreter


def cbgen_cli(*args) -> subprocess.CompletedProcess:
    assert CBGEN.is_file(), f"the installed command {CBGEN} is missing: pip install -e ."
    return subprocess.run([str(CBGEN), "run", *map(str, args)], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("embedded")
    rows = [{"id": f"m{i}", "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]}
            for i, q in enumerate(QUESTIONS[:4])]
    rows += [{"id": f"p{i}", "prompt": q} for i, q in enumerate(QUESTIONS[4:])]
    return write_jsonl(folder / "prompts.jsonl", rows)


@pytest.fixture(scope="module")
def greedy_runs(prompts):
    """The same greedy job written as JSONL (by the installed `cbgen` command, in its own process) and as Parquet
    (in this process, as the Python API runs it)."""
    args = ["--id-column", "id", "--dtype", "float32", "--logprobs", "--max-new-tokens", MAX_NEW]
    done = cbgen_cli(prompts, "-o", prompts.parent / "out-jsonl", *args, "--output-format", "jsonl")
    assert done.returncode == 0, done.stderr
    assert run_cli(["run", str(prompts), "-o", str(prompts.parent / "out-parquet"), *map(str, args),
                    "--output-format", "parquet", "-q"]) == 0
    return {fmt: prompts.parent / f"out-{fmt}" for fmt in ("jsonl", "parquet")}


@pytest.fixture(scope="module")
def model_and_tokenizer(greedy_runs):
    """The model in plain transformers, from the float32 safetensors copy the runs above converted the GGUF into
    (dequantizing it again would take ~16 s): the reference runs its own `generate` and forward, no engine of
    cbgen's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cbgen.model.gguf import TOKENIZER_ENTRY, GgufCache, default_cache_dir, model_entry
    from cbgen.model.source import embedded_model_path

    cache = GgufCache(default_cache_dir(), embedded_model_path())
    model_folder, tokenizer_folder = cache.find(model_entry(torch.float32)), cache.find(TOKENIZER_ENTRY)
    assert model_folder is not None and tokenizer_folder is not None  # the runs wrote them
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
    model = AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    return model, tokenizer


def rendered(tokenizer, index: int) -> list[int]:
    if index < 4:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[index]}]
    else:
        messages = [{"role": "user", "content": QUESTIONS[index]}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                         return_dict=True)["input_ids"]


def test_every_id_once_with_real_text(greedy_runs):
    rows = list(read_shards(greedy_runs["jsonl"]))
    assert sorted(r["id"] for r in rows) == sorted([f"m{i}" for i in range(4)] + ["p0", "p1"])
    assert all(r["finish_reason"] in ("stop", "length") and r["text"].strip() for r in rows)
    manifest = json.loads((greedy_runs["jsonl"] / "run.json").read_text())
    # a Q4_1 file: no 8-bit path, said so (a Q8_0 one runs as int8: tests/model/test_int8.py)
    assert manifest["model"]["quantized"] == "dequantized to float (the file's weight type is not Q8_0)"


def test_greedy_tokens_match_model_generate(greedy_runs, model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    rows = {r["id"]: r for r in read_shards(greedy_runs["jsonl"])}
    for index, key in enumerate([f"m{i}" for i in range(4)] + ["p0", "p1"]):
        ids = rendered(tokenizer, index)
        expected = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False,
                                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
        assert rows[key]["token_ids"] == expected[0, len(ids):].tolist(), key


def test_logprobs_match_log_softmax(greedy_runs, model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    rows = {r["id"]: r for r in read_shards(greedy_runs["jsonl"])}
    for index, key in enumerate([f"m{i}" for i in range(4)] + ["p0", "p1"]):
        ids, generated = rendered(tokenizer, index), rows[key]["token_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids + generated])).logits[0, len(ids) - 1 : -1]
        reference = torch.log_softmax(logits.float(), dim=-1).gather(1, torch.tensor(generated)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(rows[key]["logprobs"]), reference, atol=1e-3), key


def test_jsonl_and_parquet_agree(greedy_runs):
    def by_id(out):
        return sorted(read_shards(out), key=lambda r: r["id"])

    jsonl, parquet = by_id(greedy_runs["jsonl"]), by_id(greedy_runs["parquet"])
    assert [r["token_ids"] for r in jsonl] == [r["token_ids"] for r in parquet]
    assert [r["text"] for r in jsonl] == [r["text"] for r in parquet]
    for a, b in zip(jsonl, parquet):
        assert a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-6)


def test_each_id_n_times_with_num_return_sequences(prompts):
    out = prompts.parent / "out-n"
    assert run_cli(["run", str(prompts), "-o", str(out), "--id-column", "id", "-n", "3", "--temperature", "0.8",
                    "--seed", "1", "--max-new-tokens", "4", "-q"]) == 0
    rows = list(read_shards(out))
    assert len(rows) == 3 * 6
    for key in {r["id"] for r in rows}:
        assert sorted(r["sample_index"] for r in rows if r["id"] == key) == [0, 1, 2]


def test_personas_example_writes_records_that_validate(tmp_path, monkeypatch):
    """The README's synthetic-data example, as written: every record that stopped is JSON valid under its schema."""
    import json

    import jsonschema

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "personas"
    monkeypatch.chdir(root)  # the example's paths are the repository's
    assert run_cli(["run", "examples/personas.jsonl", "--config", "examples/personas.yaml", "-o", str(out),
                    "-q"]) == 0
    schema = json.loads((root / "examples/person.schema.json").read_text())
    rows = list(read_shards(out))
    assert len(rows) == 16 and all(r["error"] is None for r in rows)
    stopped = [r for r in rows if r["finish_reason"] == "stop"]
    assert len(stopped) >= 8, [r["text"] for r in rows]  # most records complete within 128 tokens
    for row in stopped:
        jsonschema.validate(json.loads(row["text"]), schema)
    for row in rows:
        assert row["finish_reason"] in ("stop", "length") and row["occupation"] and row["city"]


def test_the_synth_example_as_the_readme_runs_it(tmp_path):
    """examples/synth: a seed Parquet of topics and personas, a system turn, a few-shot turn and a template, answers
    under a JSON schema, read back with datasets: the parsed fields are columns, one record per seed row, in order."""
    import datasets
    import pyarrow.parquet as pq

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "synth-out"
    done = subprocess.run([str(CBGEN), "run", "examples/synth/seed.parquet", "--config", "examples/synth/synth.yaml",
                           "-o", str(out)], capture_output=True, text=True, timeout=600, cwd=root)
    assert done.returncode == 0, done.stderr
    seed = pq.read_table(root / "examples/synth/seed.parquet").to_pylist()
    rows = datasets.load_dataset(str(out), split="train").flatten()
    assert rows["id"] == [row["id"] for row in seed] and rows["topic"] == [row["topic"] for row in seed]
    complete = [row for row in rows if row["finish_reason"] == "stop"]
    assert len(complete) >= len(seed) // 2  # a 135M model: most records finish within 80 tokens
    assert all(row["parsed.difficulty"] in ("easy", "medium", "hard") and row["parsed.question"] for row in complete)
    read = subprocess.run([sys.executable, "examples/synth/read.py", str(out)], capture_output=True, text=True,
                          timeout=120, cwd=root)
    assert read.returncode == 0 and f"{len(complete)} of {len(seed)} records complete" in read.stdout


def test_make_example_leaves_what_the_readme_says(tmp_path):
    """The README's first-run sentence: the files `make example`'s command leaves (the Makefile's own line, run in a
    scratch folder), each named by the sentence, and the sentence names no file the run did not leave."""
    import re
    import shlex

    root = Path(__file__).resolve().parents[1]
    line = next(line for line in (root / "Makefile").read_text().splitlines() if "cbgen run examples/" in line)
    args = shlex.split(line.split("$(BIN)/cbgen", 1)[1])
    args = [str(root / a) if a.startswith("examples/") else a for a in args]
    done = subprocess.run([str(CBGEN), *args], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    readme = (root / "README.md").read_text()
    sentence = readme[readme.index("`make example` leaves"):].split("; the embedded model")[0]
    named = set(re.findall(r"`cbgen-out/([^`]+)`", sentence))
    left = {p.name for p in (tmp_path / "cbgen-out").iterdir() if not p.name.startswith(".")} - {"fingerprint.json"}
    assert named == left
    assert len(list(read_shards(tmp_path / "cbgen-out"))) == 20
