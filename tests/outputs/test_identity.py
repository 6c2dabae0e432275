"""A resume knows the model by its weights and the input by every byte: retrained weights in the same folder, a hub
id at another commit, a hub dataset at another revision, a middle edit of an input that keeps its size are each
another job, refused before anything runs, naming what changed."""

from __future__ import annotations

import json
import shutil

import pytest

from cbgen.cli import run_cli
from cbgen.model.source import ModelSource
from cbgen.rows import read_shards
from cbgen.rows.rundir import RunDirectory
from tests.helpers import write_jsonl


def _run(model, source, out, capsys) -> tuple[int, str]:
    code = run_cli(["run", str(source), "-o", str(out), "--model", str(model), "--dtype", "float32",
                    "--max-new-tokens", "2", "-q"])
    return code, capsys.readouterr().err


def test_retrained_weights_in_the_same_folder_are_another_job(tiny_model_dir, tmp_path, capsys):
    import torch
    from transformers import AutoModelForCausalLM

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "hi"}, {"id": "b", "prompt": "yo"}])
    out = tmp_path / "out"
    assert _run(model_dir, source, out, capsys)[0] == 0
    config_before = (model_dir / "config.json").read_bytes()
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        model.lm_head.weight.mul_(1.5)  # "fine-tuned": new weights, the same config
    model.save_pretrained(model_dir)
    (model_dir / "config.json").write_bytes(config_before)
    code, err = _run(model_dir, source, out, capsys)
    assert code == 2 and "holds a run of a different job (model.weights.model.safetensors:" in err, err
    assert "--overwrite" in err and "Traceback" not in err
    assert _run(model_dir, source, tmp_path / "other", capsys)[0] == 0  # the way out: another directory


def test_a_middle_edit_that_keeps_the_size_is_another_input(tiny_model_dir, tmp_path, capsys):
    pad = "x" * (1 << 20)  # the old identity read the first and last MiB only
    rows = [{"id": "a", "prompt": "hi", "note": pad}, {"id": "b", "prompt": "yo", "note": pad},
            {"id": "c", "prompt": "so", "note": pad}]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out"
    assert _run(tiny_model_dir, source, out, capsys)[0] == 0
    data = bytearray(source.read_bytes())
    middle = data.index(b'"yo"')
    data[middle:middle + 4] = b'"ya"'
    source.write_bytes(bytes(data))
    code, err = _run(tiny_model_dir, source, out, capsys)
    assert code == 2 and "input.sha256:" in err and "sha256_head_tail" not in err, err
    assert sorted(r["id"] for r in read_shards(out)) == ["a", "b", "c"]


def _hub_cache(tmp_path, monkeypatch, repo_folder: str, fill):
    """A local hub cache (the hub off) holding one repository at two commits, each snapshot made by `fill(folder)`;
    returns `point(commit)`, which moves its main ref."""
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    repo = cache / repo_folder
    for commit in ("a" * 40, "b" * 40):
        fill(repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def point(commit: str) -> None:
        (repo / "refs" / "main").write_text(commit)

    return point


@pytest.fixture
def fake_hub(tiny_model_dir, tmp_path, monkeypatch):
    """One model at two commits (see _hub_cache)."""
    return _hub_cache(tmp_path, monkeypatch, "models--cbgen-test--tiny",
                      lambda folder: shutil.copytree(tiny_model_dir, folder))


def _resumes_only_at_the_same(directory, identity, point, key: str, what: str) -> None:
    """A run directory opened with `identity()` at commit a, a row written, refused at commit b naming `key`, and
    resumed at a again."""
    from cbgen.errors import CbgenError

    point("a" * 40)
    with RunDirectory(directory).open({what: identity()}, {}, {}):
        pass
    row = {"id": "x", "finish_reason": "stop", "error": None, "num_prompt_tokens": 2, "num_generated_tokens": 1}
    (directory / "part-00000.jsonl").write_text(json.dumps(row) + "\n")
    point("b" * 40)
    with pytest.raises(CbgenError, match=rf"different job \({what}.{key}: 'aaaa.*' -> 'bbbb.*'\)"):
        with RunDirectory(directory).open({what: identity()}, {}, {}):
            pass
    point("a" * 40)
    with RunDirectory(directory).open({what: identity()}, {}, {}) as resumed:  # the same commit: resumes
        assert resumed.done.ids == {"x"}


def test_a_hub_id_at_another_commit_is_another_model(fake_hub, tmp_path):
    source = ModelSource("cbgen-test/tiny", "cbgen-test/tiny")
    fake_hub("a" * 40)
    assert source.identity() == {"hub_id": "cbgen-test/tiny", "commit": "a" * 40}
    _resumes_only_at_the_same(tmp_path / "out", source.identity, fake_hub, "commit", "model")


def test_a_hub_dataset_at_another_revision_is_another_input(tmp_path, monkeypatch):
    from cbgen.outputs.manifest import input_identity

    def fill(folder):
        folder.mkdir(parents=True)
        write_jsonl(folder / "train.jsonl", [{"id": "x", "prompt": "hi"}])

    point = _hub_cache(tmp_path, monkeypatch, "datasets--cbgen-test--rows", fill)
    monkeypatch.chdir(tmp_path)  # no local folder of that name: the id is the hub's
    point("a" * 40)
    assert input_identity("cbgen-test/rows") == {"hub_dataset": "cbgen-test/rows", "revision": "a" * 40}
    _resumes_only_at_the_same(tmp_path / "out", lambda: input_identity("cbgen-test/rows"), point, "revision", "input")


def test_a_run_of_the_previous_format_resumes_without_the_new_identities(tiny_model_dir, tmp_path, capsys):
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "hi"}, {"id": "b", "prompt": "yo"}])
    out = tmp_path / "out"
    assert _run(tiny_model_dir, source, out, capsys)[0] == 0
    stored = json.loads((out / "fingerprint.json").read_text())
    stored["format"] = 2
    del stored["fingerprint"]["model"]["weights"], stored["fingerprint"]["input"]["sha256"]
    (out / "fingerprint.json").write_text(json.dumps(stored))
    assert _run(tiny_model_dir, source, out, capsys)[0] == 0
    upgraded = json.loads((out / "fingerprint.json").read_text())
    assert upgraded["format"] == 3 and upgraded["upgraded_from"] == 2 and "weights" in upgraded["fingerprint"]["model"]
