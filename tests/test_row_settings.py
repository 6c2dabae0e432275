"""Rows with their own sampling settings, caps and stop strings; `--stop` for the whole job."""

from __future__ import annotations

import json

import pytest

from cbgen.cli import run_cli
from cbgen.config import JobConfig
from cbgen.control.sampling import SamplingPlan
from cbgen.errors import RowError
from cbgen.inputs.settings import parse_settings
from cbgen.rows import read_shards
from tests.helpers import write_jsonl

PROMPTS = ["Tell me a story.", "List some fruits.", "Why is the sky blue?"]


def run(tiny_model_dir, *args) -> int:
    return run_cli(["run", *map(str, args), "--model", str(tiny_model_dir), "--dtype", "float32", "-q"])


def rows_by_id(out):
    return {(r["id"], r["sample_index"]): r for r in read_shards(out)}


@pytest.mark.parametrize(("row", "message"), [
    ({"temperature": -0.5}, "'temperature' must be a number >= 0 (0 = greedy), got -0.5"),
    ({"temperature": "hot"}, "'temperature' must be a number >= 0 (0 = greedy), got a string"),
    ({"top_p": 0}, "'top_p' must be a number in (0, 1], got 0"),
    ({"top_p": 1.5}, "'top_p' must be a number in (0, 1], got 1.5"),
    ({"top_k": 2.5}, "'top_k' must be an integer >= 0 (0 = no limit), got 2.5"),
    ({"max_new_tokens": 0}, "'max_new_tokens' must be a positive integer, got 0"),
    ({"max_new_tokens": True}, "'max_new_tokens' must be a positive integer, got a boolean"),
    ({"stop": ""}, "'stop' must be a non-empty string of at most 1000 characters, or a list of at most 16 of them, "
                   "got a string"),
    ({"stop": ["a", 3]}, "'stop' must be a non-empty string of at most 1000 characters, or a list of at most 16 of "
                         "them, got a list"),
    ({"stop": ["x" * 1001]}, "'stop' must be a non-empty string of at most 1000 characters, or a list of at most 16 "
                             "of them, got a list"),
])
def test_bad_settings_name_the_field(row, message):
    with pytest.raises(RowError) as e:
        parse_settings(row)
    assert str(e.value) == message


def test_settings_are_normalised():
    assert parse_settings({"temperature": 1, "top_k": -1, "stop": "###", "max_new_tokens": 4.0, "n": 5}) == {
        "temperature": 1.0, "top_k": 0, "stop": ("###",), "max_new_tokens": 4}  # n is not a plain-row setting


def test_sampling_plan_builds_only_the_stages_rows_use():
    job = JobConfig()  # greedy
    assert not SamplingPlan.build(job, {"max_new_tokens", "stop"}, 100).per_request
    plan = SamplingPlan.build(job, {"top_p"}, 100)
    assert plan.stages == {"top_p", "top_k"}  # top_k: the job's greedy rows sample from their top token
    assert plan.generation_fields() == {"do_sample": True, "temperature": None, "top_p": 0.5, "top_k": 1}
    assert plan.request_kwargs({}) == {"top_p": 1.0, "top_k": 1}  # greedy
    assert plan.request_kwargs({"top_p": 0.9}) == {"top_p": 1.0, "top_k": 1}  # greedy still: no temperature
    job.generation.temperature = 0.7
    plan = SamplingPlan.build(job, {"top_k"}, 100)
    assert plan.stages == {"temperature", "top_k"}
    assert plan.request_kwargs({}) == {"temperature": 0.7, "top_k": 100}
    assert plan.request_kwargs({"top_k": 5}) == {"temperature": 0.7, "top_k": 5}
    # a row read after the plan (stdin) that needs a stage the plan lacks is refused, naming the way out
    with pytest.raises(RowError, match="--top-p"):
        SamplingPlan.build(job, set(), 100).request_kwargs({"top_p": 0.5})


def test_rows_sample_with_their_own_settings_and_greedy_rows_stay_greedy(tiny_model_dir, tmp_path):
    greedy_file = write_jsonl(tmp_path / "g.jsonl", [{"id": f"p{i}", "prompt": p} for i, p in enumerate(PROMPTS)])
    assert run(tiny_model_dir, greedy_file, "-o", tmp_path / "greedy", "--id-column", "id",
               "--max-new-tokens", 8) == 0
    greedy = rows_by_id(tmp_path / "greedy")

    mixed = write_jsonl(tmp_path / "m.jsonl", [
        {"id": "p0", "prompt": PROMPTS[0]},  # the job's default: greedy
        {"id": "p1", "prompt": PROMPTS[1], "temperature": 1.0, "top_p": 0.95},
        {"id": "p2", "prompt": PROMPTS[2], "temperature": 5.0, "top_k": 1},  # top_k 1: greedy whatever the temp
        {"id": "p3", "prompt": PROMPTS[1], "temperature": 1.0, "max_new_tokens": 3},
        {"id": "bad", "prompt": "x", "top_p": 2},
    ])
    out = tmp_path / "mixed"
    assert run(tiny_model_dir, mixed, "-o", out, "--id-column", "id", "--max-new-tokens", 8, "--seed", 1) == 1
    rows = rows_by_id(out)
    assert rows[("p0", 0)]["token_ids"] == greedy[("p0", 0)]["token_ids"]
    assert rows[("p2", 0)]["token_ids"] == greedy[("p2", 0)]["token_ids"]
    # random weights: sampling at temperature 1 all but never retraces the greedy path
    assert rows[("p1", 0)]["token_ids"] != greedy[("p1", 0)]["token_ids"]
    assert rows[("p3", 0)]["num_generated_tokens"] <= 3
    assert rows[("bad", 0)]["error"].endswith("'top_p' must be a number in (0, 1], got 2")
    manifest = json.loads((out / "run.json").read_text())
    assert manifest["sampling"]["stages"] == ["temperature", "top_k", "top_p"]
    assert manifest["continuous_batching"]["per_request_processors"] is True


@pytest.mark.slow
def test_stop_strings_cut_the_text_and_end_the_request_early(tiny_model_dir, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": PROMPTS[0]}, {"id": "b", "prompt": PROMPTS[2]}])
    assert run(tiny_model_dir, path, "-o", tmp_path / "full", "--id-column", "id", "--max-new-tokens", 40) == 0
    full = rows_by_id(tmp_path / "full")
    text_a = full[("a", 0)]["text"]
    assert full[("a", 0)]["num_generated_tokens"] == 40  # random weights: no end-of-sequence token
    stop = text_a[len(text_a) // 3: len(text_a) // 3 + 3]  # a piece from the first third of the text
    cut = text_a.index(stop)

    stopped = write_jsonl(tmp_path / "s.jsonl", [{"id": "a", "prompt": PROMPTS[0], "stop": [stop, "never-there"]},
                                                 {"id": "b", "prompt": PROMPTS[2]}])
    assert run(tiny_model_dir, stopped, "-o", tmp_path / "stop", "--id-column", "id", "--max-new-tokens", 40) == 0
    rows = rows_by_id(tmp_path / "stop")
    a = rows[("a", 0)]
    assert a["text"] == text_a[:cut] and a["finish_reason"] == "stop"
    assert a["num_generated_tokens"] < 40  # cancelled, not run to the limit
    assert a["token_ids"] == full[("a", 0)]["token_ids"][: a["num_generated_tokens"]]
    assert stop in full[("a", 0)]["text"][: len(rows[("a", 0)]["text"]) + len(stop) + 16]
    assert rows[("b", 0)] == full[("b", 0)]  # no stop strings: untouched

    # --stop applies to every row
    assert run(tiny_model_dir, path, "-o", tmp_path / "job-stop", "--id-column", "id", "--max-new-tokens", 40,
               "--stop", stop) == 0
    assert rows_by_id(tmp_path / "job-stop")[("a", 0)]["text"] == text_a[:cut]


def test_parquet_rows_carry_settings_as_columns(tiny_model_dir, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"prompt": PROMPTS[:2], "max_new_tokens": [2, None]})
    pq.write_table(table, tmp_path / "p.parquet")
    assert run(tiny_model_dir, tmp_path / "p.parquet", "-o", tmp_path / "o", "--max-new-tokens", 6) == 0
    rows = rows_by_id(tmp_path / "o")
    assert rows[("0", 0)]["num_generated_tokens"] == 2 and rows[("1", 0)]["num_generated_tokens"] == 6
