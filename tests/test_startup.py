"""The CLI holds Python's cyclic garbage collector off while it imports torch and loads the model; the job turns it
back on, with what exists frozen, once the model is loaded. Library callers keep their own setting."""

from __future__ import annotations

import gc

from cbgen.cli import run_cli
from cbgen.process.startup import hold_gc, release_gc
from tests.helpers import write_jsonl


def test_release_is_a_no_op_without_hold():
    assert gc.isenabled()
    gc.disable()  # a library caller's own choice
    try:
        release_gc()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_the_job_releases_what_the_cli_held(tiny_model_dir, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    frozen_before = gc.get_freeze_count()
    hold_gc()
    try:
        assert not gc.isenabled()
        assert run_cli(["run", str(prompts), "-o", str(tmp_path / "out"), "--model", str(tiny_model_dir),
                        "--max-new-tokens", "2", "-q"]) == 0
        assert gc.isenabled() and gc.get_freeze_count() > frozen_before
    finally:
        release_gc()
        gc.unfreeze()
        gc.enable()
