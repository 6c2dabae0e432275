"""benchmarks/gpu_check.py: its criteria (a failing line makes the exit status non-zero) and the whole check on a CPU
with tiny shapes (`--device cpu --tiny`), the code paths the GPU run takes, so that it cannot fail there on a typo."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


gc_ = _load()
EOS = frozenset({2})


def _run(name, tokens, seconds=1.0, peak=None, after=None, error=None):
    run = gc_.Measured(name, seconds=seconds, rows=len(tokens), tokens=tokens, peak=peak, after=after,
                       after_gc=after, error=error)
    return run


def test_exit_status_is_one_when_any_line_fails():
    row = gc_.Row
    passing = [row("g", "a", "1", ">= 1", gc_.PASS), row("g", "b", "", "", gc_.INFO),
               row("g", "c", "", "", gc_.NA_CPU), row("g", "d", "", "", gc_.SKIP)]
    assert gc_.exit_status(passing) == 0
    assert gc_.exit_status([*passing, row("g", "e", "0.5x", ">= 0.8x", gc_.FAIL)]) == 1


def test_bounds_fail_what_was_not_measured_and_say_na_on_cpu():
    assert gc_.at_least(0.95, 0.95) == gc_.PASS
    assert gc_.at_least(0.949, 0.95) == gc_.FAIL
    assert gc_.at_least(None, 0.95) == gc_.FAIL
    assert gc_.at_most(1.05, 1.05) == gc_.PASS
    assert gc_.at_most(1.06, 1.05) == gc_.FAIL
    assert gc_.at_most(None, 1.05) == gc_.FAIL
    assert gc_.at_least(0.1, 0.95, cpu=True) == gc_.NA_CPU


def test_same_share_compares_the_first_tokens_up_to_the_end_of_sequence():
    reference = [[5, 6, 7, 8], [5, 2, 9, 9], [1, 1, 1, 1]]
    # the second row ends at its eos (2) in both: what follows it does not count; the third differs at token 4
    assert gc_.same_share([[5, 6, 7, 8], [5, 2], [1, 1, 1, 3]], reference, EOS, first=4) == pytest.approx(2 / 3)
    assert gc_.same_share([[5, 6, 7, 8], [5, 2], [1, 1, 1, 3]], reference, EOS, first=3) == 1.0
    assert gc_.same_share([[5, 6]], reference, EOS) is None  # a run that returned too few rows compares nothing


def test_greedy_lines_fail_on_other_tokens_slower_speed_more_memory():
    tokens = [[3] * 40 for _ in range(100)]
    weights = 8 * gc_.GIB
    stock = _run(gc_.STOCK, tokens, seconds=10.0, peak=20 * gc_.GIB, after=weights)
    good = _run("greedy", tokens, seconds=10.2, peak=20 * gc_.GIB, after=weights + gc_.GIB // 2)
    rows = gc_.run_rows("sdpa", good, stock, None, weights, EOS, cpu=False)
    assert gc_.exit_status(rows) == 0, rows
    other = [list(t) for t in tokens]
    other[0][5] = 4  # one row of 100 differs: 99 % still holds
    assert gc_.exit_status(gc_.run_rows("sdpa", _run("greedy", other, 10.0, 20 * gc_.GIB, weights), stock, None,
                                        weights, EOS, cpu=False)) == 0
    other[1][5] = 4  # two do not
    bad = gc_.run_rows("sdpa", _run("greedy", other, 10.0, 20 * gc_.GIB, weights), stock, None, weights, EOS,
                       cpu=False)
    assert [r.check for r in bad if r.result == gc_.FAIL] == ["greedy: tokens = generate_batch's (first 32)"]
    slow = gc_.run_rows("sdpa", _run("greedy", tokens, 11.0, 20 * gc_.GIB, weights), stock, None, weights, EOS,
                        cpu=False)
    assert [r.check for r in slow if r.result == gc_.FAIL] == ["greedy: tok/s / generate_batch's"]
    big = gc_.run_rows("sdpa", _run("greedy", tokens, 10.0, 22 * gc_.GIB, weights + 2 * gc_.GIB), stock, None,
                       weights, EOS, cpu=False)
    assert [r.check for r in big if r.result == gc_.FAIL] == ["greedy: peak memory / generate_batch's",
                                                             "greedy: memory after the run"]
    # on a CPU the speed and memory lines say n/a; the tokens are still judged
    cpu = gc_.run_rows("tiny", _run("greedy", other, 11.0), _run(gc_.STOCK, tokens), None, None, EOS, cpu=True)
    assert [r.result for r in cpu] == [gc_.PASS, gc_.FAIL, gc_.NA_CPU, gc_.NA_CPU, gc_.NA_CPU]


def test_a_control_that_failed_or_is_slow_fails_its_lines():
    tokens = [[3] * 8 for _ in range(4)]
    stock, greedy = _run(gc_.STOCK, tokens, 10.0, gc_.GIB, 0), _run("greedy", tokens, 10.0, gc_.GIB, 0)
    schema = _run("json schema", tokens, 10.0 / 0.71, gc_.GIB, 0)
    assert gc_.exit_status(gc_.run_rows("sdpa", schema, stock, greedy, 0, EOS, cpu=False)) == 0
    penalty = _run("penalty", tokens, 10.0 / 0.71, gc_.GIB, 0)  # 0.71x is enough for a schema, not for a penalty
    assert [r.check for r in gc_.run_rows("sdpa", penalty, stock, greedy, 0, EOS, cpu=False)
            if r.result == gc_.FAIL] == ["penalty: tok/s / greedy's"]
    raised = _run("logprobs", [], error="RuntimeError: flash attention and a step control")
    lines = gc_.run_rows("sdpa", raised, stock, greedy, 0, EOS, cpu=True)
    assert lines[0].result == gc_.FAIL and "RuntimeError" in lines[0].value
    assert gc_.exit_status(lines) == 1


@pytest.mark.slow
def test_the_tiny_check_runs_end_to_end_on_cpu(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert (tmp_path / "gpu_check.txt").read_text().strip()
    results = {(row["group"], row["check"]): row["result"] for row in data["rows"]}
    for run in (gc_.STOCK, *gc_.RUNS):
        assert results[("sdpa", f"{run}: runs")] == gc_.PASS, data["rows"]
    # judged on a CPU: the tokens, the choices, the embeddings; speed and memory are not
    assert results[("sdpa", "greedy: tokens = generate_batch's (first 32)")] == gc_.PASS
    assert results[("score --choices", "choice logprobs = each choice scored alone")] == gc_.PASS
    assert results[("embed", "vectors = transformers' forward, mean-pooled")] == gc_.PASS
    assert results[("sdpa", "greedy: tok/s / generate_batch's")] == gc_.NA_CPU
    assert {run["name"] for run in data["runs"]} == {gc_.STOCK, *gc_.RUNS}
    assert all(run["generated"] > 0 for run in data["runs"])
