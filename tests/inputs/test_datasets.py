"""Hugging Face datasets in and out: save_to_disk folders, dataset folders of data files, hub ids (offline: a clear
error), Parquet output that `load_dataset("parquet")` reads with proper features, and `cbgen merge --to-dataset`."""

from __future__ import annotations

import datasets
import pytest

from cbgen.cli import run_cli
from cbgen.errors import CbgenError
from cbgen.inputs import open_reader
from cbgen.inputs.dataset import DatasetReader
from tests.helpers import write_jsonl

QUESTIONS = ["What is 2+2?", "Name a river.", "Say hello.", "Pick a number.", "Spell cat."]


def run(tiny_model_dir, *args) -> int:
    return run_cli(["run", *map(str, args), "--model", str(tiny_model_dir), "--dtype", "float32", "-q",
                    "--max-new-tokens", 4])


@pytest.fixture
def saved_dict(tmp_path):
    """A DatasetDict with train and test splits, saved with save_to_disk."""
    data = datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"qid": [f"t{i}" for i in range(5)], "question": QUESTIONS,
                                             "level": [1, 2, 3, 4, 5]}),
        "test": datasets.Dataset.from_dict({"qid": ["x0", "x1"], "question": QUESTIONS[:2], "level": [9, 9]}),
    })
    data.save_to_disk(str(tmp_path / "saved"))
    return tmp_path / "saved"


def test_saved_dataset_round_trip_with_features(tiny_model_dir, saved_dict, tmp_path):
    out = tmp_path / "out"
    assert run(tiny_model_dir, saved_dict, "--split", "test", "--prompt-column", "question", "--id-column", "qid",
               "--keep-columns", "level", "-o", out, "--output-format", "parquet") == 0
    loaded = datasets.load_dataset("parquet", data_files=str(out / "part-*.parquet"), split="train")
    assert sorted(loaded["id"]) == ["x0", "x1"] and loaded["level"] == [9, 9]
    assert loaded.features["token_ids"] == datasets.List(datasets.Value("int32"))
    assert loaded.features["level"] == datasets.Value("int64")  # the input's own type
    assert loaded.features["text"] == datasets.Value("string")


def test_split_is_chosen_or_named(saved_dict):
    reader = open_reader(saved_dict, prompt_column="question")
    assert isinstance(reader, DatasetReader) and reader.count() == 5  # train by default
    with pytest.raises(CbgenError, match=r"has no split 'dev'; its splits are: train, test$"):
        open_reader(saved_dict, prompt_column="question", split="dev")
    with pytest.raises(CbgenError, match=r"has no column 'prompt2' \(--prompt-column\); its columns are: qid, "):
        open_reader(saved_dict, prompt_column="prompt2")


def test_dataset_folder_of_jsonl_files(tiny_model_dir, tmp_path):
    folder = tmp_path / "repo"
    (folder / "data").mkdir(parents=True)
    write_jsonl(folder / "data" / "train.jsonl", [{"prompt": q, "temperature": 0} for q in QUESTIONS[:3]])
    write_jsonl(folder / "data" / "test.jsonl", [{"prompt": QUESTIONS[4]}])
    reader = open_reader(folder, split="test")
    assert [r.prompt for r in reader] == [QUESTIONS[4]]
    out = tmp_path / "out"
    assert run(tiny_model_dir, folder, "-o", out) == 0  # train, the default split
    assert run_cli(["status", str(out)]) == 0


def test_hub_id_offline_is_a_clear_error(tiny_model_dir, tmp_path, capsys):
    assert run(tiny_model_dir, "someone/no-such-dataset", "-o", tmp_path / "o") == 2
    err = capsys.readouterr().err
    assert "no local file or folder 'someone/no-such-dataset' exists, and the Hugging Face Hub (HF_HUB_OFFLINE is " \
           "set) gave no dataset of that name" in err
    assert "Traceback" not in err


def test_split_on_a_plain_file_is_refused(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x"}])
    with pytest.raises(CbgenError, match="--split and --subset apply to Hugging Face datasets"):
        open_reader(path, split="train")


@pytest.mark.slow
def test_merge_to_dataset(tiny_model_dir, saved_dict, tmp_path):
    out = tmp_path / "out"
    for shard in (0, 1):
        assert run(tiny_model_dir, saved_dict, "--prompt-column", "question", "--id-column", "qid",
                   "--keep-columns", "level", "-o", out, "--num-shards", 2, "--shard-index", shard, "--logprobs") == 0
    assert run_cli(["merge", str(out), "--to-dataset"]) == 0
    merged = datasets.load_from_disk(str(out / "merged"))
    assert sorted(merged["id"]) == [f"t{i}" for i in range(5)]
    assert merged.features["token_ids"] == datasets.List(datasets.Value("int32"))
    assert merged.features["logprobs"] == datasets.List(datasets.Value("float32"))
    assert sorted(merged["level"]) == [1, 2, 3, 4, 5]
    assert all(len(t) == len(lp) for t, lp in zip(merged["token_ids"], merged["logprobs"]))


def test_unsplit_job_to_dataset(tiny_model_dir, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": q} for q in QUESTIONS])
    out = tmp_path / "out"
    assert run(tiny_model_dir, path, "-o", out) == 0
    assert run_cli(["merge", str(out), "--to-dataset", "-o", str(tmp_path / "ds")]) == 0
    merged = datasets.load_from_disk(str(tmp_path / "ds"))
    assert sorted(merged["id"], key=int) == [str(i) for i in range(5)]
    assert run_cli(["merge", str(out), "--to-dataset", "-o", str(tmp_path / "ds")]) == 2  # not empty: refused
