"""`cbgen score` as a user runs it: rows of every kind in one file, bad rows as error records beside the good ones,
templates and job-wide choices, Parquet in and out, and a stopped job resumed with each row scored exactly once."""

from __future__ import annotations

import json
import math
import threading

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cbgen.cli import run_cli
from cbgen.records import SCORE_FIELDS
from cbgen.rows import read_shards
from tests.helpers import write_jsonl

ROWS = [
    {"id": "answer", "prompt": "What is two plus two?", "completion": "Four."},
    {"id": "chat", "messages": [{"role": "user", "content": "Name a colour."}], "completion": "Blue."},
    {"id": "pick", "prompt": "Name a colour.", "choices": ["red", "blue", "green"]},
    {"id": "doc", "text": "The quick brown fox jumps over the lazy dog."},
    {"id": "empty", "prompt": "Hi", "completion": ""},
    {"id": "numbers", "prompt": "Hi", "choices": [1, 2]},
    {"id": "nothing", "prompt": "Hi"},
    {"id": "long", "text": "word " * 400},  # more tokens than the tiny model's 256 positions
]


def _rows(out) -> dict[str, dict]:
    return {row["id"]: row for row in read_shards(out)}


def test_every_kind_of_row_and_every_bad_row(tiny_model_dir, tmp_path):
    rows_file = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    out = tmp_path / "out"
    code = run_cli(["score", str(rows_file), "-o", str(out), "--model", str(tiny_model_dir), "--dtype", "float32",
                    "--logprobs", "-q"])
    assert code == 1  # some rows failed: they are error records, the others are scored
    rows = _rows(out)
    assert set(rows) == {row["id"] for row in ROWS}
    assert list(rows["answer"])[: len(SCORE_FIELDS)] == list(SCORE_FIELDS)
    for key in ("answer", "chat", "doc"):
        row = rows[key]
        assert row["error"] is None
        assert row["num_scored_tokens"] == len(row["token_ids"]) == len(row["logprobs"]) > 0
        assert row["logprob"] == pytest.approx(sum(row["logprobs"]), abs=1e-4)
        assert row["mean_logprob"] == pytest.approx(row["logprob"] / row["num_scored_tokens"])
        assert row["perplexity"] == pytest.approx(math.exp(-row["mean_logprob"]))
        assert row["choices"] is None and row["best_choice"] is None
    assert rows["doc"]["num_prompt_tokens"] == 1  # a text: every token after its first is scored
    pick = rows["pick"]
    assert pick["logprob"] is None and pick["token_ids"] is None
    assert pick["choices"] == ["red", "blue", "green"]
    assert sum(pick["choice_probs"]) == pytest.approx(1.0)
    assert pick["best_choice"] == pick["choices"][pick["choice_logprobs"].index(max(pick["choice_logprobs"]))]
    assert "'completion' is empty" in rows["empty"]["error"]
    assert "must be a list of non-empty strings; item 0 is an integer" in rows["numbers"]["error"]
    assert "nothing to score" in rows["nothing"]["error"]
    assert "longer than the model's context of 256" in rows["long"]["error"]
    assert rows["long"]["error"].startswith(f"{rows_file}:8: ")  # where the row is, as cbgen run says it
    manifest = json.loads((out / "run.json").read_text())
    assert manifest["kind"] == "score"
    assert manifest["counts"]["rows"] == len(ROWS) and manifest["counts"]["failed"] == 4
    assert json.loads((out / "fingerprint.json").read_text())["columns"]["kind"] == "score"


def test_job_choices_with_a_template_judge_every_row(tiny_model_dir, tmp_path):
    """The LLM-as-judge case: a template over the row's columns and one label set for every row."""
    rows_file = write_jsonl(tmp_path / "answers.jsonl",
                            [{"id": f"q{i}", "answer": {"text": f"answer number {i}"}} for i in range(5)])
    out = tmp_path / "out"
    assert run_cli(["score", str(rows_file), "-o", str(out), "--model", str(tiny_model_dir),
                    "--template", "Rate this answer from 1 to 5: {{ answer.text }}", "--choices", "1,2,3,4,5",
                    "-q"]) == 0
    rows = _rows(out)
    assert len(rows) == 5
    for row in rows.values():
        assert row["choices"] == ["1", "2", "3", "4", "5"] and row["best_choice"] in row["choices"]
        assert len(row["choice_logprobs"]) == 5


def test_parquet_text_column_in_and_out(tiny_model_dir, tmp_path):
    """Documents in a Parquet column named by --text-column; scores in Parquet, loaded as a dataset."""
    import cbgen

    source = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"doc_id": ["a", "b"], "body": ["One small document.", "Another, longer document."]}),
                   source)
    out = tmp_path / "out"
    assert run_cli(["score", str(source), "-o", str(out), "--model", str(tiny_model_dir), "--text-column", "body",
                    "--id-column", "doc_id", "--keep-columns", "body", "--output-format", "parquet", "-q"]) == 0
    dataset = cbgen.load(out)
    assert dataset["id"] == ["a", "b"]
    assert dataset["body"] == ["One small document.", "Another, longer document."]
    assert all(value < 0 for value in dataset["logprob"])
    assert dataset.features["choices"].feature.dtype == "string"


def test_a_stopped_job_resumes_each_row_exactly_once(tiny_model_dir, tmp_path):
    """Stopped after a few rows (as SIGTERM stops it), then run again: every row once, scored as an uninterrupted
    run scores it."""
    from cbgen.config import build_config
    from cbgen.job.run import run_job
    from cbgen.progress import NullProgress

    rows_file = write_jsonl(tmp_path / "rows.jsonl", [{"id": f"r{i}", "text": f"document {i} " * (3 + i % 7)}
                                                      for i in range(40)])

    def job(out):
        overrides = {("input", "path"): (str(rows_file), "INPUT"), ("output", "dir"): (str(out), "-o"),
                     ("model", "model"): (str(tiny_model_dir), "--model"), ("model", "dtype"): ("float32", "--dtype"),
                     ("run", "commit_interval"): (0.001, "--commit-interval"),
                     ("score", "batch_tokens"): (64, "--score-batch-tokens")}
        return build_config(None, overrides, kind="score")

    stop = threading.Event()

    class StopAfterTen(NullProgress):
        done = 0

        def advance(self, done, prompt_tokens, generated_tokens, failed, lengths=()):
            self.done += done
            if self.done >= 10:
                stop.set()

    first = run_job(job(tmp_path / "out"), StopAfterTen(), stop)
    assert first.status == "stopped" and 10 <= first.requests < 40
    second = run_job(job(tmp_path / "out"), NullProgress(), threading.Event())
    assert second.status == "complete" and second.resumed_requests == first.requests
    resumed = [row["id"] for row in read_shards(tmp_path / "out")]
    assert sorted(resumed) == sorted(f"r{i}" for i in range(40))  # each once
    run_job(job(tmp_path / "whole"), NullProgress(), threading.Event())
    whole = _rows(tmp_path / "whole")
    for row in read_shards(tmp_path / "out"):
        assert row["logprob"] == pytest.approx(whole[row["id"]]["logprob"], abs=1e-4)


@pytest.mark.parametrize(("flags", "message"), [
    (["--choices", "a,a"], "distinct"),
    (["--redo", "length"], "--redo length applies to generated text"),
    (["--output-format", "openai"], "holds generated choices, not score rows"),
])
def test_settings_that_cannot_score_exit_2(tiny_model_dir, tmp_path, capsys, flags, message):
    rows_file = write_jsonl(tmp_path / "rows.jsonl", ROWS[:1])
    assert run_cli(["score", str(rows_file), "-o", str(tmp_path / "out"), *flags]) == 2
    assert message in capsys.readouterr().err
