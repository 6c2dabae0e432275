"""`cbgen run` end to end on a tiny random Llama: exactness against model.generate, outputs, failures, recovery."""

from __future__ import annotations

import io
import json
import sys

import pytest
import torch

from cbgen.cli import run_cli
from cbgen.rows import read_shards
from tests.helpers import read_jsonl, write_jsonl

CHATS = [
    "Hello!",
    "What is the capital of France? Answer briefly.",
    "Write a long story about a dragon who learns to paint, with many details about colours and brushes.",
    "2+2?",
    "Name three rivers.",
]


def cbgen(tiny_model_dir, *args) -> int:
    return run_cli(["run", *map(str, args), "--model", str(tiny_model_dir), "--dtype", "float32", "-q"])


@pytest.fixture
def chat_file(tmp_path):
    return write_jsonl(tmp_path / "p.jsonl", [{"id": f"q{i}", "prompt": p, "lang": "en"} for i, p in enumerate(CHATS)])


def load(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return model, tokenizer


def test_greedy_tokens_and_logprobs_match_the_model(tiny_model_dir, chat_file, tmp_path):
    out = tmp_path / "out"
    assert cbgen(tiny_model_dir, chat_file, "-o", out, "--id-column", "id", "--max-new-tokens", 12, "--logprobs") == 0
    rows = {r["id"]: r for r in read_shards(out)}
    assert sorted(rows) == [f"q{i}" for i in range(len(CHATS))]
    model, tokenizer = load(tiny_model_dir)
    for i, prompt in enumerate(CHATS):
        row = rows[f"q{i}"]
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)["input_ids"]
        expected = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
        assert row["token_ids"] == expected[0, len(ids):].tolist()
        assert row["num_prompt_tokens"] == len(ids)
        assert row["text"] == tokenizer.decode(row["token_ids"], skip_special_tokens=True)
        with torch.no_grad():
            logits = model(torch.tensor([ids + row["token_ids"]])).logits[0]
        reference = torch.log_softmax(logits[len(ids) - 1 : -1].float(), dim=-1)
        reference = reference.gather(1, torch.tensor(row["token_ids"])[:, None])[:, 0]
        assert torch.allclose(torch.tensor(row["logprobs"]), reference, atol=1e-3)
        assert row["finish_reason"] == ("stop" if row["token_ids"][-1] == tokenizer.eos_token_id else "length")


def test_jsonl_and_parquet_outputs_agree(tiny_model_dir, chat_file, tmp_path):
    args = ["--id-column", "id", "--keep-columns", "lang", "--max-new-tokens", 6, "--rows-per-shard", 2]
    assert cbgen(tiny_model_dir, chat_file, "-o", tmp_path / "j", *args) == 0
    assert cbgen(tiny_model_dir, chat_file, "-o", tmp_path / "p", "--output-format", "parquet", *args) == 0
    as_jsonl = sorted(read_shards(tmp_path / "j"), key=lambda r: r["id"])
    as_parquet = sorted(read_shards(tmp_path / "p"), key=lambda r: r["id"])
    assert as_jsonl == as_parquet
    assert [r["lang"] for r in as_jsonl] == ["en"] * len(CHATS)
    names = sorted(p.name for p in (tmp_path / "p").iterdir())
    shards = [name for name in names if name.startswith("part-")]
    assert [n for n in names if n not in shards] == [".cbgen.lock", "README.md", "fingerprint.json", "run.json"]
    assert len(shards) == 3 and all(name.endswith(".parquet") for name in shards)  # 5 rows, 2 per shard


def test_parquet_input_and_run_manifest(tiny_model_dir, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"question": ["Hi", "Bye", "Why?"], "n": [1, 2, 3]}), path)
    out = tmp_path / "out"
    assert cbgen(tiny_model_dir, path, "-o", out, "--prompt-column", "question", "--keep-columns", "n",
                 "--max-new-tokens", 5) == 0
    rows = sorted(read_shards(out), key=lambda r: r["id"])
    assert [(r["id"], r["n"]) for r in rows] == [("0", 1), ("1", 2), ("2", 3)]
    manifest = json.loads((out / "run.json").read_text())
    assert manifest["counts"]["requests"] == 3 and manifest["counts"]["failed"] == 0
    assert manifest["counts"]["generated_tokens"] == sum(r["num_generated_tokens"] for r in rows)
    assert manifest["kv_cache"]["chosen_by"] == "cbgen" and manifest["kv_cache"]["num_blocks"] > 0
    assert manifest["continuous_batching"]["num_blocks"] == manifest["kv_cache"]["num_blocks"]
    assert manifest["versions"]["transformers"] and manifest["throughput"]["generated_tokens_per_s"] > 0
    assert manifest["config"]["input"]["prompt_column"] == "question"


def test_several_sequences_per_prompt(tiny_model_dir, chat_file, tmp_path):
    out = tmp_path / "out"
    assert cbgen(tiny_model_dir, chat_file, "-o", out, "-n", 3, "--temperature", 1.0, "--seed", 7,
                 "--max-new-tokens", 4) == 0
    rows = list(read_shards(out))
    assert len(rows) == 3 * len(CHATS)
    for i in range(len(CHATS)):
        assert sorted(r["sample_index"] for r in rows if r["id"] == f"q{i}") == [0, 1, 2]


def test_several_sequences_of_a_one_token_prompt(tiny_model_dir, tmp_path):
    """transformers forks a prompt's sequences before its last token: a one-token prompt, alone in a step, ran a step
    of no tokens and took the loop down. Its sequences run as copies, and equal those of the prompt run alone."""
    source = tmp_path / "p.jsonl"
    source.write_text("".join(json.dumps({"id": str(i), "input_ids": ids}) + "\n"
                              for i, ids in enumerate([[5], [6, 7, 8, 9], [10]])))
    out = tmp_path / "out"
    assert cbgen(tiny_model_dir, source, "-o", out, "-n", 2, "--temperature", 1.0, "--seed", 7, "--max-new-tokens", 4,
                 "--max-requests-per-batch", 1) == 0
    rows = {(r["id"], r["sample_index"]): r for r in read_shards(out)}
    assert sorted(rows) == [(str(i), k) for i in range(3) for k in range(2)]
    assert all(r["error"] is None and len(r["token_ids"]) == 4 for r in rows.values())
    assert rows["0", 0]["token_ids"] != rows["0", 1]["token_ids"]  # still two samples, not one twice


def test_bad_rows_become_error_records_and_good_rows_all_answered(tiny_model_dir, tmp_path):
    rows = [
        {"prompt": "good one"},
        '{"prompt": "broken',
        {"prompt": "   "},
        {"messages": [{"role": "wizard", "content": "hi"}]},
        {"input_ids": [1, 2, 10**9]},
        {"messages": [{"role": "user", "content": "good two"}]},
        {"input_ids": [1, 2, 3]},
    ]
    out = tmp_path / "out"
    assert cbgen(tiny_model_dir, write_jsonl(tmp_path / "p.jsonl", rows), "-o", out, "--max-new-tokens", 3) == 1
    result = {r["id"]: r for r in read_shards(out)}
    assert sorted(result) == [str(i) for i in range(len(rows))]
    good = {"0", "5", "6"}
    for key, row in result.items():
        if key in good:
            assert row["finish_reason"] in ("stop", "length") and row["error"] is None and row["text"] is not None
        else:
            assert row["finish_reason"] == "error" and row["error"] and row["text"] is None
    assert "invalid JSON" in result["1"]["error"]
    assert "outside the vocabulary" in result["4"]["error"]


def test_impossible_requests_are_rejected_before_admission(tiny_model_dir, tmp_path):
    """A request longer than the context or than the whole KV cache fails alone; the engine never sees it."""
    rows = [{"input_ids": [5] * 10}, {"input_ids": [6] * 300}, {"input_ids": [7] * 60}, {"input_ids": [8] * 12}]
    out = tmp_path / "out"
    code = cbgen(tiny_model_dir, write_jsonl(tmp_path / "p.jsonl", rows), "-o", out, "--max-new-tokens", 8,
                 "--page-size", 16, "--num-blocks", 4)
    assert code == 1
    result = {r["id"]: r for r in read_shards(out)}
    assert "does not fit the model's context of 256 tokens" in result["1"]["error"]
    assert "can never fit in the KV cache (64 tokens)" in result["2"]["error"]
    assert result["0"]["error"] is None and result["3"]["error"] is None
    assert json.loads((out / "run.json").read_text())["engine_restarts"] == 0


def test_a_dead_generation_loop_is_restarted_without_losing_work(tiny_model_dir, tmp_path, monkeypatch):
    """If a request that cannot fit reaches the engine anyway, its loop dies: cbgen fails what was in flight,
    restarts it, and answers everything else."""
    from cbgen.engine.admission import Limits

    monkeypatch.setattr(Limits, "never_fits", lambda self, request: None)
    rows = [{"input_ids": [5] * 10}, {"input_ids": [7] * 200}, {"input_ids": [8] * 12}, {"input_ids": [9] * 9}]
    out = tmp_path / "out"
    code = cbgen(tiny_model_dir, write_jsonl(tmp_path / "p.jsonl", rows), "-o", out, "--max-new-tokens", 4,
                 "--page-size", 16, "--num-blocks", 4, "--max-in-flight", 1)
    assert code == 1
    result = {r["id"]: r for r in read_shards(out)}
    assert sorted(result) == ["0", "1", "2", "3"]
    assert result["1"]["finish_reason"] == "error" and "No requests can be scheduled" in result["1"]["error"]
    assert all(result[k]["error"] is None for k in ("0", "2", "3"))
    assert json.loads((out / "run.json").read_text())["engine_restarts"] == 1


def test_stdin_and_plain_progress(tiny_model_dir, tmp_path, monkeypatch, capsys):
    lines = "".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(4))
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(lines.encode())))
    out = tmp_path / "out"
    code = run_cli(["run", "-", "-o", str(out), "--model", str(tiny_model_dir), "--max-new-tokens", "3"])
    assert code == 0
    err = capsys.readouterr().err
    assert "[cbgen" in err and "4 sequences" in err  # plain progress lines, not a terminal
    assert "cbgen run summary" in err
    assert len(read_jsonl(out / "part-00000.jsonl")) == 4


def test_extra_stop_token_ends_the_sequence(tiny_model_dir, tmp_path):
    rows = [{"input_ids": [11, 12, 13, 14]}]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    assert cbgen(tiny_model_dir, path, "-o", tmp_path / "a", "--max-new-tokens", 10) == 0
    free = next(read_shards(tmp_path / "a"))["token_ids"]
    stop = free[3]
    assert cbgen(tiny_model_dir, path, "-o", tmp_path / "b", "--max-new-tokens", 10, "--stop-token-id", stop) == 0
    stopped = next(read_shards(tmp_path / "b"))
    assert stopped["token_ids"] == free[: free.index(stop) + 1]
    assert stopped["finish_reason"] == "stop"


@pytest.mark.slow
def test_attention_choice_is_recorded(tiny_model_dir, chat_file, tmp_path):
    """Default on CPU: cbgen's per-sequence attention through its compiled kernel; --no-compiled-attention: the eager
    per-sequence path; --attn-implementation sdpa: transformers' stock path. All give the same greedy tokens in fp32."""
    compiled = "per-sequence, compiled kernel (batch-invariant by construction)"
    tokens = {}
    for name, extra, expected in (("default", [], compiled), ("sdpa", ["--attn-implementation", "sdpa"], "stock"),
                                  ("per-sequence", ["--attn-implementation", "per-sequence"], compiled),
                                  ("eager", ["--no-compiled-attention"], "per-sequence")):
        out = tmp_path / name
        assert cbgen(tiny_model_dir, chat_file, "-o", out, "--max-new-tokens", 8, *extra) == 0
        assert json.loads((out / "run.json").read_text())["attention"] == expected
        tokens[name] = sorted((r["id"], r["token_ids"]) for r in read_shards(out))
    assert tokens["default"] == tokens["sdpa"] == tokens["per-sequence"] == tokens["eager"]


def test_per_sequence_attention_refused_where_it_does_not_apply(tiny_model_dir, chat_file, tmp_path, capsys,
                                                               monkeypatch):
    monkeypatch.setattr("cbgen.attention.cpu_attention_unavailable_reason", lambda model: "the model uses soft-capping")
    code = run_cli(["run", str(chat_file), "-o", str(tmp_path / "o"), "--model", str(tiny_model_dir),
                    "--attn-implementation", "per-sequence", "-q"])
    assert code == 2
    assert "--attn-implementation per-sequence does not apply here: the model uses soft-capping; use sdpa" in (
        capsys.readouterr().err)
