"""Tensor parallelism on CPU: `torchrun --nproc-per-node 2 -m cbgen run ... --tp 2` (gloo) writes the same tokens
as a single process, for a model whose heads split two ways and for one whose heads do not (MLP-only sharding); and
when rank 0 fails before the followers have its plan, they exit at once with its message."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from cbgen.cli import run_cli
from cbgen.rows import read_shards
from tests.helpers import torchrun_cbgen, write_jsonl

pytestmark = pytest.mark.slow  # every test starts torchrun


@pytest.fixture(scope="module")
def odd_heads_model(tiny_model_dir, tmp_path_factory):
    """Like the tiny model, with 6 attention heads and 3 KV heads: not divisible by 2."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("odd-heads")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.save_pretrained(folder)
    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=256,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp") / "p.jsonl"
    rows = [{"id": f"q{i}", "prompt": f"Tell me something about the number {i}."} for i in range(8)]
    rows.append({"id": "stopper", "prompt": "Count up.", "max_new_tokens": 3})
    rows.append({"id": "bad", "prompt": ""})  # an error record, written by rank 0 like any other
    return write_jsonl(path, rows)


def tokens(out):
    return {r["id"]: (r["token_ids"], r["finish_reason"]) for r in read_shards(out)}


@pytest.mark.parametrize("model", ["tiny", "odd"])
def test_two_process_tp_matches_one_process(model, tiny_model_dir, odd_heads_model, prompts, tmp_path):
    folder = tiny_model_dir if model == "tiny" else odd_heads_model
    common = ["--model", str(folder), "--dtype", "float32", "--id-column", "id", "--max-new-tokens", "10", "-q"]
    assert run_cli(["run", str(prompts), "-o", str(tmp_path / "one"), *common]) == 1  # the bad row
    done = torchrun_cbgen(prompts, "-o", tmp_path / "tp", *common)
    assert done.returncode == 1, done.stderr[-3000:]  # rank 0's exit code: one request failed
    assert tokens(tmp_path / "tp") == tokens(tmp_path / "one")
    assert not list((tmp_path / "tp").glob("shard-*"))  # one writer: rank 0


def test_tp_without_torchrun_says_how_to_start_it(tiny_model_dir, prompts, tmp_path, capsys):
    code = run_cli(["run", str(prompts), "-o", str(tmp_path / "o"), "--model", str(tiny_model_dir), "--tp", "2"])
    assert code == 2
    assert "--tp 2 needs 2 processes: start the job with `torchrun --nproc-per-node 2 -m cbgen run ... --tp 2`" in \
        capsys.readouterr().err


def test_tp_with_step_control_matches_one_process(tiny_model_dir, tmp_path):
    """Formats, seeded draws and top logprobs under TP: every rank masks and draws alike, so rank 0 writes what a
    single process writes."""
    rows = [{"id": f"q{i}", "prompt": f"Pick for {i}."} for i in range(4)]
    rows.append({"id": "digits", "prompt": "Digits?", "response_format": {"type": "regex", "pattern": "[0-9]{4}"}})
    rows.append({"id": "yn", "prompt": "Yes?", "response_format": {"type": "choice", "choices": ["yes", "no"]}})
    prompts = write_jsonl(tmp_path / "p.jsonl", rows)
    common = ["--model", str(tiny_model_dir), "--dtype", "float32", "--max-new-tokens", "8", "-q", "--seed", "5",
              "--temperature", "0.9", "--top-logprobs", "2"]
    # batch invariance does not apply under TP (README), so the one-process run uses the same stock numerics
    assert run_cli(["run", str(prompts), "-o", str(tmp_path / "one"), "--no-batch-invariant", *common]) == 0
    done = torchrun_cbgen(prompts, "-o", tmp_path / "tp", *common)
    assert done.returncode == 0, done.stderr[-3000:]
    one = {r["id"]: r for r in read_shards(tmp_path / "one")}
    tp = {r["id"]: r for r in read_shards(tmp_path / "tp")}
    assert {k: r["token_ids"] for k, r in tp.items()} == {k: r["token_ids"] for k, r in one.items()}
    assert one["yn"]["text"] in ("yes", "no") and len(one["digits"]["text"]) == 4
    for key in one:
        assert [[e["token_id"] for e in p] for p in tp[key]["top_logprobs"]] == \
            [[e["token_id"] for e in p] for p in one[key]["top_logprobs"]]


# Runs `cbgen run` under torchrun with one failure injected on rank 0 (CBGEN_TEST_FAIL_AT): while it plans the job
# ("plan"), or while it converts a GGUF model for the cache the followers wait on ("gguf").
FAILING_DRIVER = """
import os, sys
where = os.environ.get("CBGEN_TEST_FAIL_AT", "")
if os.environ.get("RANK") == "0" and where:
    from cbgen.errors import CbgenError

    def fail(*args, **kwargs):
        raise CbgenError(f"injected failure at {where}")

    if where == "plan":
        import cbgen.job.plan
        cbgen.job.plan.plan_job = fail
    elif where == "gguf":
        import cbgen.model.sharded
        cbgen.model.sharded.load_gguf = fail
from cbgen.cli import main
sys.argv = ["cbgen", *sys.argv[1:]]
main()
"""


def torchrun_failing(tmp_path, where: str, *args) -> tuple[subprocess.CompletedProcess, float]:
    driver = tmp_path / "driver.py"
    driver.write_text(FAILING_DRIVER)
    env = os.environ | {"OMP_NUM_THREADS": "1", "CBGEN_TEST_FAIL_AT": where,
                        "CBGEN_CACHE_DIR": str(tmp_path / "model-cache")}  # a GGUF cache that misses
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(driver), "run", *map(str, args), "--tp", "2", "-q"],
                          env=env, capture_output=True, text=True, timeout=300)
    return done, time.monotonic() - started


@pytest.mark.parametrize(("where", "message"), [
    ("input", "rank 0 failed before 'load': input file '{missing}' does not exist"),
    ("gguf", "rank 0 failed before 'gguf-ready': injected failure at gguf"),
    ("plan", "rank 0 failed before 'plan': injected failure at plan"),
])
def test_followers_exit_promptly_with_rank_0s_message(tiny_model_dir, prompts, tmp_path, where, message):
    """Whenever rank 0 fails before its plan is sent (reading its input, converting the GGUF model the followers
    wait for, planning), the followers get its message at once instead of waiting for gloo's timeout (minutes)."""
    missing = tmp_path / "missing.jsonl"
    source = missing if where == "input" else prompts
    model = [] if where == "gguf" else ["--model", str(tiny_model_dir)]  # the embedded GGUF model, uncached
    done, seconds = torchrun_failing(tmp_path, where, source, "-o", tmp_path / "out", *model, "--dtype", "float32")
    assert done.returncode != 0
    assert message.format(missing=missing) in done.stderr, done.stderr[-3000:]
    assert seconds < 120, f"{seconds:.0f} s"


def test_followers_go_home_when_rank_0_needs_no_model(tiny_model_dir, tmp_path):
    """Every row is an error record: rank 0 writes them without loading a model, and tells the followers so."""
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"id": "a", "prompt": ""}, {"id": "b", "prompt": 3}])
    done, seconds = torchrun_failing(tmp_path, "", bad, "-o", tmp_path / "out", "--model", str(tiny_model_dir))
    assert done.returncode == 1, done.stderr[-3000:]  # rank 0's: the requests failed
    assert "rank 0 failed" not in done.stderr and "SIGABRT" not in done.stderr, done.stderr[-3000:]
    assert seconds < 120, f"{seconds:.0f} s"
    assert sorted(r["id"] for r in read_shards(tmp_path / "out")) == ["a", "b"]
