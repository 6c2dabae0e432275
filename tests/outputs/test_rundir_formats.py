"""Run directories carry a format version, and a directory written by an older cbgen still resumes.

tests/fixtures/rundir-v1 is a directory written by cbgen before run directories had a version (format 1), stopped
after 2 of its 6 requests; see its README. That cbgen numbered rows even when they carried an `id` field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from cbgen.cli import run_cli
from cbgen.errors import CbgenError
from cbgen.rows import read_shards
from cbgen.rows.rundir import FORMAT, RunDirectory, read_stored_run
from tests.helpers import write_jsonl

FIXTURE = Path(__file__).parent.parent / "fixtures" / "rundir-v1"


@pytest.fixture
def v1(tmp_path) -> Path:
    """A copy of the format-1 directory and its input."""
    shutil.copytree(FIXTURE, tmp_path / "v1")
    return tmp_path / "v1"


def test_format_1_is_read_as_such(v1):
    stored = read_stored_run(v1 / "out")
    assert stored.format == 1 and stored.ids is None and not stored.detects_ids
    assert stored.fingerprint["model"]["gguf"] == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_status_of_a_format_1_directory_counts_its_rows_by_number(v1, capsys):
    code = run_cli(["status", str(v1 / "out"), "--input", str(v1 / "prompts.jsonl"), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 1 and (report["done"], report["remaining"]) == (2, 4)  # ids 0 and 1 of 0..5 are done


@pytest.mark.embedded
def test_a_format_1_directory_resumes_and_is_brought_to_the_current_format(v1):
    before = {p.name: p.read_bytes() for p in (v1 / "out").glob("part-*.jsonl")}
    code = run_cli(["run", str(v1 / "prompts.jsonl"), "-o", str(v1 / "out"), "--max-new-tokens", "8", "-q",
                    "--rows-per-shard", "1"])
    assert code == 0
    rows = list(read_shards(v1 / "out"))
    assert sorted(r["id"] for r in rows) == [str(i) for i in range(6)]  # each once, still numbered
    assert all(r["finish_reason"] in ("stop", "length") for r in rows)
    assert {p.name: p.read_bytes() for p in (v1 / "out").glob("part-*.jsonl") if p.name in before} == before
    stored = json.loads((v1 / "out" / "fingerprint.json").read_text())
    assert stored["format"] == FORMAT and stored["upgraded_from"] == 1
    assert stored["ids"] == {"column": None, "chosen_by": "row number"}
    manifest = json.loads((v1 / "out" / "run.json").read_text())
    assert manifest["format"] == FORMAT and manifest["counts"]["resumed_requests"] == 2
    # and it resumes again in the current format: nothing left to do, no model loaded
    assert run_cli(["run", str(v1 / "prompts.jsonl"), "-o", str(v1 / "out"), "--max-new-tokens", "8", "-q"]) == 0


def test_a_newer_format_is_refused(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "fingerprint.json").write_text(json.dumps({"format": FORMAT + 1, "fingerprint": {}, "job": {}}))
    with pytest.raises(CbgenError, match=rf"written by a newer cbgen \(format {FORMAT + 1}"):
        RunDirectory(out).open({}, {}, {})


def test_new_directories_record_their_format_and_ids(tiny_model_dir, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "hi"}, {"id": "b", "prompt": "yo"}])
    out = tmp_path / "out"
    assert run_cli(["run", str(prompts), "-o", str(out), "--model", str(tiny_model_dir), "--max-new-tokens", "2",
                    "-q"]) == 0
    assert sorted(r["id"] for r in read_shards(out)) == ["a", "b"]
    stored = json.loads((out / "fingerprint.json").read_text())
    assert stored["format"] == FORMAT and stored["ids"] == {"column": "id", "chosen_by": "the rows' own id field"}
    manifest = json.loads((out / "run.json").read_text())
    assert manifest["format"] == FORMAT and manifest["ids"] == stored["ids"]


def test_settings_added_later_match_while_they_are_off():
    from cbgen.rows.rundir import compare_fingerprints

    stored = {"generation": {"seed": 1}}  # written before json_object and top_logprobs existed
    assert compare_fingerprints(stored, {"generation": {"seed": 1, "json_object": False, "top_logprobs": None}}) == []
    assert compare_fingerprints(stored, {"generation": {"seed": 1, "json_object": True}}) == [
        "generation.json_object: None -> True"]
    assert compare_fingerprints({"generation": {"seed": 1, "top_logprobs": 5}},
                                {"generation": {"seed": 1, "top_logprobs": None}}) == [
        "generation.top_logprobs: 5 -> None"]
