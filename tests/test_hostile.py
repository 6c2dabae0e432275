"""Hostile input: no row can end the job or blow its memory (the cases found trying messy files by hand)."""

from __future__ import annotations

import gzip
import json
import random

from cbgen.cli import run_cli
from cbgen.rows import read_shards
from tests.helpers import write_jsonl

GOOD = [{"prompt": "What is the capital of France?"}, {"prompt": "Name a colour."}]


def run(tiny_model_dir, path, out, *args) -> int:
    return run_cli(["run", str(path), "-o", str(out), "--model", str(tiny_model_dir), "--max-new-tokens", "3", "-q",
                    *map(str, args)])


def rows_by_id(out) -> dict[str, dict]:
    return {row["id"]: row for row in read_shards(out)}


def test_a_row_nested_100000_deep_is_one_error_record(tiny_model_dir, tmp_path):
    deep = '{"id": "deep", "prompt": ' + "[" * 100_000 + "]" * 100_000 + "}"
    path = write_jsonl(tmp_path / "p.jsonl", [GOOD[0], deep, GOOD[1]])
    assert run(tiny_model_dir, path, tmp_path / "out") == 1
    rows = rows_by_id(tmp_path / "out")
    assert sorted(rows) == ["0", "1", "2"]
    assert rows["0"]["error"] is None and rows["2"]["error"] is None
    assert rows["1"]["finish_reason"] == "error" and rows["1"]["error"].startswith(f"{path}:2: unreadable JSON")


class LargestRead:
    """Wraps a binary file and remembers the longest piece one read returned."""

    def __init__(self, f):
        self.f, self.largest = f, 0

    def readline(self, size=-1):
        line = self.f.readline(size)
        self.largest = max(self.largest, len(line))
        return line

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def test_a_60_mb_line_is_refused_without_being_read_whole(tiny_model_dir, tmp_path, monkeypatch):
    huge = json.dumps({"prompt": "lorem ipsum " * 5_000_000})  # 60 MB
    path = write_jsonl(tmp_path / "p.jsonl", [GOOD[0], huge, GOOD[1]])
    from cbgen.inputs.jsonl import JsonlReader

    opened: list[LargestRead] = []
    real_open = JsonlReader._open
    monkeypatch.setattr(JsonlReader, "_open", lambda self: opened.append(LargestRead(real_open(self))) or opened[-1])
    assert run(tiny_model_dir, path, tmp_path / "out") == 1
    assert opened and max(f.largest for f in opened) <= (32 << 20) + 1  # never more than the limit in one piece
    rows = rows_by_id(tmp_path / "out")
    assert rows["0"]["error"] is None and rows["2"]["error"] is None
    assert rows["1"]["error"] == (f"{path}:2: the line is {len(huge) + 1:,} bytes long, more than --max-line-bytes "
                                  f"({32 << 20:,}); raise it if such rows are meant")
    assert rows["1"]["num_prompt_tokens"] == 0


def test_the_line_limit_is_a_setting(tiny_model_dir, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [GOOD[0], {"prompt": "x" * 3000}, GOOD[1]])
    assert run(tiny_model_dir, path, tmp_path / "out", "--max-line-bytes", 2048) == 1
    assert "more than --max-line-bytes (2,048)" in rows_by_id(tmp_path / "out")["1"]["error"]


def test_a_prompt_longer_than_the_context_is_refused_untokenized_and_not_counted(tiny_model_dir, tmp_path,
                                                                                monkeypatch):
    from transformers import PreTrainedTokenizerBase

    tokenized = []
    real_call = PreTrainedTokenizerBase.__call__

    def spy(self, text, *args, **kwargs):
        tokenized.append(len(text) if isinstance(text, str) else 0)
        return real_call(self, text, *args, **kwargs)

    monkeypatch.setattr(PreTrainedTokenizerBase, "__call__", spy)
    path = write_jsonl(tmp_path / "p.jsonl", [GOOD[0], {"prompt": "word " * 200_000}, GOOD[1]])
    assert run(tiny_model_dir, path, tmp_path / "out", "--raw-prompts") == 1
    rows = rows_by_id(tmp_path / "out")
    assert "prompt of 1,000,000 characters cannot fit the model's context of 256 tokens" in rows["1"]["error"]
    assert max(tokenized) < 1000  # the million characters never reached the tokenizer
    assert rows["1"]["num_prompt_tokens"] == 0
    counts = json.loads((tmp_path / "out" / "run.json").read_text())["counts"]
    assert counts["prompt_tokens"] == rows["0"]["num_prompt_tokens"] + rows["2"]["num_prompt_tokens"]


def test_a_prompt_of_too_many_tokens_is_not_counted_as_processed(tiny_model_dir, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [GOOD[0], {"input_ids": [5] * 300}])
    assert run(tiny_model_dir, path, tmp_path / "out") == 1
    rows = rows_by_id(tmp_path / "out")
    assert "prompt of 300 tokens does not fit the model's context of 256 tokens" in rows["1"]["error"]
    counts = json.loads((tmp_path / "out" / "run.json").read_text())["counts"]
    assert counts["prompt_tokens"] == rows["0"]["num_prompt_tokens"] > 0


def test_binary_garbage_loads_no_model_and_reserves_no_cache(tiny_model_dir, tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded for an input where no row can run")

    monkeypatch.setattr("cbgen.model.load.load_model", refuse)
    rng = random.Random(0)
    path = tmp_path / "garbage.jsonl"
    path.write_bytes(bytes(rng.randrange(256) for _ in range(150_000)))
    lines = sum(1 for line in path.read_bytes().split(b"\n") if line.strip())
    assert run(tiny_model_dir, path, tmp_path / "out") == 1
    rows = list(read_shards(tmp_path / "out"))
    assert len(rows) == lines and all(r["finish_reason"] == "error" for r in rows)
    assert all(r["error"].startswith(f"{path}:") for r in rows)
    manifest = json.loads((tmp_path / "out" / "run.json").read_text())
    assert manifest["kv_cache"] == {} and manifest["attention"] is None and "device" not in manifest["model"]


def test_rows_that_fail_only_when_rendered_never_start_an_engine(tiny_model_dir, tmp_path, monkeypatch):
    """Every row reads fine but none can run (ids outside the vocabulary): the model loads, no manager starts."""
    import cbgen.engine.manager as manager

    def refuse(*args, **kwargs):
        raise AssertionError("a manager (and its KV cache) started although no request can run")

    monkeypatch.setattr(manager, "start_manager", refuse)
    monkeypatch.setattr("cbgen.engine.engine.start_manager", refuse)
    path = write_jsonl(tmp_path / "p.jsonl", [{"input_ids": [10**9]}, {"input_ids": [10**9, 1]}])
    assert run(tiny_model_dir, path, tmp_path / "out") == 1
    assert all("outside the vocabulary" in r["error"] for r in read_shards(tmp_path / "out"))


def test_a_truncated_gzip_file_keeps_the_rows_before_the_cut_and_resumes_once_whole(tiny_model_dir, tmp_path,
                                                                                    capsys):
    rows = [{"id": f"r{i}", "prompt": f"Say {i}."} for i in range(400)]
    whole = gzip.compress(("\n".join(json.dumps(row) for row in rows) + "\n").encode())
    path = tmp_path / "p.jsonl.gz"
    path.write_bytes(whole[: len(whole) // 2])  # a download cut short
    out = tmp_path / "out"
    assert run(tiny_model_dir, path, out) == 2
    err = capsys.readouterr().err
    assert "cannot read input file" in err and "Compressed file ended before the end-of-stream marker" in err
    assert "rerun the same command to resume" in err and "Traceback" not in err
    before = [r["id"] for r in read_shards(out)]
    assert 0 < len(before) < len(rows) and before == sorted(before, key=lambda i: int(i[1:]))
    assert all(r["error"] is None for r in read_shards(out))  # every row before the cut ran
    path.write_bytes(whole)  # fetched again, whole
    assert run(tiny_model_dir, path, out) == 0
    after = [r["id"] for r in read_shards(out)]
    assert sorted(after) == sorted(r["id"] for r in rows) and len(after) == len(set(after))
    assert json.loads((out / "run.json").read_text())["counts"]["resumed_requests"] == len(before)
    other = tmp_path / "other.jsonl.gz"  # another file that merely begins differently is another job
    other.write_bytes(gzip.compress(b'{"id": "x", "prompt": "y"}\n'))
    path.write_bytes(whole[: len(whole) // 2])
    assert run(tiny_model_dir, path, tmp_path / "cut") == 2
    path.write_bytes(other.read_bytes() + whole)
    assert run(tiny_model_dir, path, tmp_path / "cut") == 2
    assert "holds a run of a different job (input." in capsys.readouterr().err