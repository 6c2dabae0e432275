"""The output folder is a dataset: once a run is complete its rows are in input order (not finish order), its card
makes `datasets.load_dataset(DIR)` load the shards and records how they were made, and a reorder killed part-way
never shows a reader half of it."""

from __future__ import annotations

import json

import pytest

from cbgen.cli import run_cli
from cbgen.outputs.dataset import load
from cbgen.rows import read_shards
from tests.helpers import write_jsonl


@pytest.fixture
def prompts(tmp_path):
    # caps rising with the input: the engine starts the longest first, so requests finish out of input order
    rows = [{"id": f"q{i:02d}", "prompt": f"Tell me about {i}.", "max_new_tokens": 1 + 3 * (i % 5)}
            for i in range(15)]
    return write_jsonl(tmp_path / "p.jsonl", rows)


def run(tiny_model_dir, prompts, out, *flags) -> int:
    return run_cli(["run", str(prompts), "-o", str(out), "--model", str(tiny_model_dir), "--dtype", "float32",
                    "--rows-per-shard", "4", "--max-requests-per-batch", "2", "-q", *map(str, flags)])


def ids(rows) -> list[str]:
    return [row["id"] for row in rows]


EXPECTED = [f"q{i:02d}" for i in range(15)]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_a_complete_run_reads_in_input_order_through_its_card(tiny_model_dir, prompts, tmp_path, fmt):
    import datasets
    from huggingface_hub import DatasetCard

    out = tmp_path / "out"
    finished = []
    real = __import__("cbgen.rows.writers", fromlist=["ShardWriter"]).ShardWriter.write_group

    def spy(self, rows):
        finished.extend(r["id"] for r in rows)
        return real(self, rows)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("cbgen.rows.writers.ShardWriter.write_group", spy)
        patch.setattr("sys.argv", ["cbgen", "run", "p.jsonl", "--template", "About {{ prompt }}"])  # as the CLI has it
        assert run(tiny_model_dir, prompts, out, "--output-format", fmt, "--template", "About {{ prompt }}") == 0
    assert finished[:15] != EXPECTED  # the engine finished them in another order...
    assert ids(read_shards(out)) == EXPECTED  # ...and the folder reads as the input did
    assert ids(datasets.load_dataset(str(out), split="train")) == EXPECTED
    assert ids(load(out)) == EXPECTED
    card = DatasetCard.load(out / "README.md")
    meta = card.data.to_dict()["cbgen"]
    assert meta["counts"]["requests"] == 15 and meta["input_order"] is True
    assert meta["model"] == str(tiny_model_dir)
    assert meta["command"] == "cbgen run p.jsonl --template 'About {{ prompt }}'"
    assert meta["templates"]["template"] == "About {{ prompt }}" and meta["generation"]["max_new_tokens"] == 256
    assert card.data.to_dict()["configs"][0]["data_files"][0]["path"] == sorted(p.name for p in out.glob("part-*"))


def test_a_stopped_run_says_so_and_its_resume_puts_the_rows_in_order(tiny_model_dir, prompts, tmp_path):
    out = tmp_path / "out"
    assert run(tiny_model_dir, prompts, out, "--max-errors", 0, "--request-timeout", 0.0001) == 4
    assert "not complete" in (out / "README.md").read_text()
    assert run(tiny_model_dir, prompts, out, "--redo", "failed") == 0
    assert ids(read_shards(out)) == EXPECTED and "not complete" not in (out / "README.md").read_text()


class Killed(BaseException):
    """What a kill -9 leaves: nothing after it runs (no handler catches a BaseException of this kind)."""


def test_a_reorder_killed_after_its_commit_point(tiny_model_dir, prompts, tmp_path, monkeypatch):
    """Killed between the journal and the swap: readers already see the new set, whole, and the next run finishes
    the swap."""
    import cbgen.rows.order as order

    out = tmp_path / "out"
    calls = {"n": 0}
    real = order.finish_reorder

    def killed(directory):
        calls["n"] += 1
        if calls["n"] == 2:  # before the reorder, then once the journal is written
            raise Killed
        real(directory)

    monkeypatch.setattr(order, "finish_reorder", killed)
    with pytest.raises(Killed):
        run(tiny_model_dir, prompts, out)
    assert (out / ".ordered.json").exists()
    assert ids(read_shards(out)) == EXPECTED  # the journal's set, from the staging folder and the directory
    monkeypatch.setattr(order, "finish_reorder", real)
    assert run(tiny_model_dir, prompts, out) == 0
    assert not (out / ".ordered.json").exists() and not (out / ".ordered").exists()
    assert ids(read_shards(out)) == EXPECTED


def test_merged_jobs_are_in_input_order_and_carry_a_card(tiny_model_dir, prompts, tmp_path):
    import datasets

    out = tmp_path / "out"
    for index in (0, 1):
        assert run(tiny_model_dir, prompts, out, "--num-shards", 2, "--shard-index", index) == 0
    assert run_cli(["merge", str(out)]) == 0
    assert ids(read_shards(out / "merged")) == EXPECTED
    assert ids(datasets.load_dataset(str(out / "merged"), split="train")) == EXPECTED
    assert run_cli(["merge", str(out), "--to-dataset", "-o", str(tmp_path / "ds")]) == 0
    assert ids(datasets.load_from_disk(str(tmp_path / "ds"))) == EXPECTED
    assert "load_from_disk" in (tmp_path / "ds" / "README.md").read_text()
    assert json.loads((out / "merged" / "run.json").read_text())["rows"] == 15


def test_a_folder_rewritten_in_place_loads_its_new_rows_with_datasets(tiny_model_dir, tmp_path):
    """datasets caches a local folder by its card's metadata: the card names its data files by size and time, so
    a rerun with --overwrite (or another folder of the same name) is a new cache entry, not the old rows."""
    import datasets

    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": f"q{i}", "prompt": f"Tell me about {i}."} for i in range(6)])
    out = tmp_path / "best"
    assert run(tiny_model_dir, prompts, out, "--max-new-tokens", "2") == 0
    first = datasets.load_dataset(str(out), split="train")
    assert run(tiny_model_dir, prompts, out, "--max-new-tokens", "1", "--overwrite", "--seed", "3") == 0
    again = datasets.load_dataset(str(out), split="train")
    assert again["num_generated_tokens"] == [row["num_generated_tokens"] for row in load(out)]
    assert again["num_generated_tokens"] != first["num_generated_tokens"]
    (tmp_path / "elsewhere").mkdir()
    other = tmp_path / "elsewhere" / "best"  # another folder of the same name
    assert run(tiny_model_dir, prompts, other, "--max-new-tokens", "3") == 0
    assert datasets.load_dataset(str(other), split="train")["num_generated_tokens"] == \
        [row["num_generated_tokens"] for row in load(other)]
