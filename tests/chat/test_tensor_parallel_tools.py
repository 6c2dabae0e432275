"""A required tool call under tensor parallelism: every rank compiles the call's grammar from the model's response
template, so the ranks mask alike and rank 0 writes what one process writes."""

from __future__ import annotations

import json

import pytest

from cbgen.cli import run_cli
from tests.chat.test_openai_parity import ASK, WEATHER, line
from tests.helpers import torchrun_cbgen, write_jsonl

pytestmark = pytest.mark.slow  # torchrun


def test_required_call_under_tp_matches_one_process(tool_model_dir, tmp_path):
    path = write_jsonl(tmp_path / "b.jsonl", [
        line("call", {"messages": ASK, "tools": [WEATHER], "tool_choice": "required", "max_tokens": 120})])
    common = ["--model", str(tool_model_dir), "--dtype", "float32", "-q", "--output-format", "openai"]
    assert run_cli(["run", str(path), "-o", str(tmp_path / "one"), *common]) == 0
    done = torchrun_cbgen(path, "-o", tmp_path / "tp", *common)
    assert done.returncode == 0, done.stderr[-3000:]

    def body(out):
        return json.loads((out / "part-00000.jsonl").read_text())["response"]["body"]["choices"][0]

    one, tp = body(tmp_path / "one"), body(tmp_path / "tp")
    assert one["finish_reason"] == "tool_calls" and tp["message"]["tool_calls"] == one["message"]["tool_calls"]
