"""`cbgen bench --suite`: its goals and rows read right, `--quick` runs end to end on the tiny model with the machine
named in the table, in bench.json and in every row, a busy machine is refused in one line, and a held run says it
was held."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from contextlib import nullcontext

import pytest

from cbgen.bench.load import Load, Watch
from cbgen.bench.suite import Goal, Plan, Row, Timings, ratio, summary
from cbgen.cli import run_cli

MACHINE_FIELDS = {"cpu", "kind", "runs_as", "held", "cores", "threads", "torch", "transformers", "bf16_gflops",
                  "fp32_gflops", "label"}


def test_goals_and_ratios_read_as_they_say():
    assert Goal(">=", 1.5).met(1.5) and not Goal(">=", 1.5).met(1.49)
    assert Goal("<=", 1.05).met(1.0) and not Goal("<=", 1.05).met(1.06)
    bf16 = Goal(">=", 1.3, frozenset({"avx512-bf16"}))
    assert bf16.applies("avx512-bf16") and not bf16.applies("avx2") and bf16.text() == "≥ 1.3 (avx512-bf16)"
    # the machine's load as a watch reads it: quiet, and busy for one call (tests/bench/test_load.py reads a real one)
    quiet = Load(1.0, 2, other=0.0, steal=0.0)
    loud = Load(1.0, 2, other=0.6, steal=0.0)
    readings = iter([quiet] * 5 + [loud])

    def watch():
        seen = Watch(0)
        seen.during = next(readings)
        return nullcontext(seen)

    t = Timings(watch=watch)
    for slow, fast in ((3.0, 1.0), (2.0, 1.0), (9.0, 2.0)):  # medians 3.0 and 1.0
        t.record("other", lambda s=slow: s)
        t.record("cbgen", lambda f=fast: f)
    row = ratio("s", "cbgen vs other", t, "other", "cbgen", "", Goal(">=", 2.0), note="64 x (128 + 64)")
    # the last cbgen run was timed under load: left out, and named, while both paths have quiet runs (medians of
    # 3, 2, 9 and of 1, 1); every run is still in the row
    assert row.figure == 3.0 and row.paths == {"other": [3.0, 2.0, 9.0], "cbgen": [1.0, 1.0, 2.0]}
    assert not row.busy and row.note == "64 x (128 + 64); left out, timed under load: cbgen run 3"
    row.applies = True
    assert row.met is True and row.standing == "met"
    assert not ratio("s", "other alone", t, "other", "other", "").busy
    assert [s.busy for s in t.samples["cbgen"]] == [False, False, True]
    # a path with no quiet run: the figure (medians of every run) is void
    readings = iter([quiet, loud, quiet])
    once = Timings(watch=watch)
    once.record("other", lambda: 4.0)
    once.record("cbgen", lambda: 2.0)
    once.record("cbgen", lambda: 1.0)  # the runs counted from 1: the second cbgen run is quiet, the first not
    assert ratio("s", "x", once, "other", "cbgen", "").note == "left out, timed under load: cbgen run 1"
    readings = iter([quiet, loud])
    void = Timings(watch=watch)
    void.record("other", lambda: 3.0)
    void.record("cbgen", lambda: 2.0)
    lost = ratio("s", "cbgen vs other", void, "other", "cbgen", "", Goal(">=", 2.0))
    lost.applies = True
    assert lost.figure == 1.5 and lost.busy and lost.standing == "void"
    # a void figure names its loud runs with what their watch read, so a reader can tell a neighbour's job from
    # work left over from before the run
    assert lost.note == ("timed under load: cbgen run 1 (during, busy: other processes kept 60% of the 2 cores busy "
                         "and the hypervisor stole 0% of their time over 1.0 s)")
    missed = Row("s", "m", 1.2, "x", "", Goal("<=", 1.05), applies=True)
    busy = Row("s", "b", 1.0, "x", "", Goal("<=", 1.05), applies=True, busy=True)
    elsewhere = Row("s", "e", 0.5, "x", "", Goal(">=", 1.3), applies=False)
    met = Row("s", "q", 2.5, "x", "", Goal(">=", 2.0), applies=True)
    unmeasured = Row("s", "u", None, "x", "", Goal(">=", 1.0), applies=True, note="not measured: no llama.cpp")
    assert summary([met, row, missed, busy, lost, elsewhere, unmeasured, Row("s", "n", None, "x", "")]) == {
        "met": 2, "missed": 1, "void": 2, "not_measured": 1}


def test_quick_cuts_the_long_workloads_and_names_what_it_leaves_to_the_full_run():
    from cbgen.bench.sections import section_goals
    from cbgen.bench.suite import Plan
    from cbgen.bench.workloads import BenchWorkload, warm_up

    prompts = [list(range(i, i + 128)) for i in range(64)]
    fixed, sampling, mixed = (BenchWorkload("fixed", prompts, 64), BenchWorkload("sampling", prompts, 128,
                              sampling=True), BenchWorkload("mixed", prompts, 256, [16] * 64))
    quick, full = Plan.of(True, "small"), Plan.of(False, "small")
    cut = quick.cut(fixed)
    assert (len(cut.prompts), len(cut.prompts[0]), cut.max_new_tokens) == (16, 128, 32)
    assert cut.prompts == prompts[:16] and fixed.max_new_tokens == 64  # a copy: the built workload is left as it was
    cut = quick.cut(sampling)
    assert (len(cut.prompts), cut.max_new_tokens, cut.sampling) == (16, 64, True)
    assert quick.cut(mixed) is mixed and all(full.cut(w) is w for w in (fixed, sampling, mixed))
    assert Plan.of(True, "tiny").cut(fixed) is fixed  # tiny workloads are small already
    assert (quick.scale_fixed, full.scale_fixed) == ((4, 64, 16), (16, 128, 64))
    warm = warm_up(fixed)
    assert [len(p) for p in warm.prompts] == [16, 16] and warm.prompts[1] == prompts[1][:16]
    assert warm.max_new_tokens == 2
    # what --quick leaves to the full run has no goal row in its table, rather than one never measured
    names = {plan.mode: [name for section in ("scale", "embedding") for name, _ in section_goals(section, plan)]
             for plan in (quick, full)}
    assert set(names["full"]) - set(names["quick"]) == {"invariant / stock linear layers, llama-1b",
                                                        "cbgen embed vs a sentence-transformers script, whole commands"}
    assert not set(names["quick"]) - set(names["full"])


@pytest.mark.slow
def test_quick_suite_runs_end_to_end_and_names_the_machine_everywhere(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "suite"
    started = time.perf_counter()
    code = run_cli(["bench", "--suite", "--quick", "--size", "tiny", "--model", str(tiny_model_dir), "--allow-busy",
                    "-o", str(out)])
    assert code == 0
    data = json.loads((out / "bench.json").read_text())
    machine = data["meta"]["machine"]
    assert MACHINE_FIELDS <= set(machine) and machine["bf16_gflops"] > 0 and machine["fp32_gflops"] > 0
    assert machine["cores"] >= 1 and machine["held"] is False and data["meta"]["dtype"] in ("bfloat16", "float32")
    sections = {row["section"] for row in data["rows"]}
    assert sections == {"generation", "invariance", "sampling", "embedding", "dedup", "start"}
    took = data["meta"]["suite"]["section_seconds"]  # every section's, scale's too (tiny runs none of it)
    assert set(took) == sections | {"scale"} and sum(took.values()) <= data["meta"]["suite"]["seconds"]
    for row in data["rows"]:
        assert row["machine"] == machine["label"]
        assert "busy" in row and (row["figure"] is not None or row["note"].startswith("not measured"))
        if row["section"] not in ("dedup", "start"):
            assert row["dtype"] in ("bfloat16", "float32")
        if row["goal"] is not None:  # tiny workloads: the goals are for the standard sizes
            assert row["applies"] is False and row["why_not"]
    measured = [row for row in data["rows"] if row["figure"] is not None]
    for key in ("cbgen vs generate_batch", "seeded / greedy", "invariant / stock", "sentence-transformers",
                "dedup of", "warm start"):
        assert any(key in row["name"] for row in measured), key
    assert all(all(v > 0 for v in row["paths"][p]) for row in measured for p in row["paths"])
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert machine["label"] in printed and "verdict" in printed and "goals:" in printed
    assert time.perf_counter() - started < 600


@pytest.mark.quiet
def test_a_busy_machine_is_refused_in_one_line(tmp_path):
    neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        done = subprocess.run([sys.executable, "-m", "cbgen", "bench", "--suite", "--quick", "--sections", "dedup",
                               "-o", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    finally:
        neighbour.kill()
        neighbour.wait()
    assert done.returncode == 75, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "the machine is busy: other processes kept" in done.stderr
    assert f"{neighbour.pid} python" in done.stderr and "--allow-busy" in done.stderr
    assert not (tmp_path / "out" / "bench.json").exists()


@pytest.mark.slow
def test_a_held_run_says_it_was_held(tmp_path):
    out = tmp_path / "held"
    done = subprocess.run([sys.executable, "-m", "cbgen", "bench", "--suite", "--quick", "--size", "tiny",
                           "--sections", "dedup", "--hold", "avx2", "--allow-busy", "-o", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    machine = json.loads((out / "bench.json").read_text())["meta"]["machine"]
    assert machine["held"] is True and machine["runs_as"] == "avx2" and "held to avx2" in machine["label"]
    assert [row["section"] for row in json.loads((out / "bench.json").read_text())["rows"]] == ["dedup"]


def test_the_suite_measures_the_cpu_on_a_gpu_machine_too(monkeypatch):
    """Its goals are against CPU peers: every model it loads (and every command it starts) runs on the CPU, because
    CUDA is hidden from its process before torch could start it."""
    from cbgen.bench import suite_runner
    from cbgen.errors import CbgenError

    seen: list[str | None] = []

    def stopped(*args, **kwargs):
        import os

        seen.append(os.environ.get("CUDA_VISIBLE_DEVICES"))
        raise CbgenError("stopped here")

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setattr(suite_runner, "run", stopped)
    assert run_cli(["bench", "--suite", "--quick"]) == 2
    assert seen == [""]


def test_the_matmul_rate_is_measured_where_the_model_runs(monkeypatch):
    """`cbgen bench` divides by the rate of the device the model is on: a model on a GPU, the GPU's."""
    import torch

    from cbgen.bench.machine import matmul_flops

    devices: list[torch.device] = []
    randn = torch.randn

    def recording(*shape, dtype=None, device=None):
        devices.append(torch.device(device))
        return randn(*shape, dtype=dtype)  # computed here: this machine has no GPU

    monkeypatch.setattr(torch, "randn", recording)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    assert matmul_flops(torch.float32, seconds=0.01, largest=256, device="cuda") > 0
    assert devices and {d.type for d in devices} == {"cuda"}


def test_a_hold_above_the_machines_own_kind_is_refused_in_one_line(monkeypatch, capsys):
    """Held to a kind whose instructions this CPU lacks, torch and oneDNN would stop on them: refused, naming both."""
    from cbgen.config import cpu

    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx", "avx2", "fma"}))  # an AVX2-only EPYC
    assert cpu.unholdable_reason("avx2") is None
    assert "is avx2, without avx512-bf16's instructions" in (cpu.unholdable_reason("avx512-bf16") or "")
    assert run_cli(["bench", "--suite", "--quick", "--hold", "avx512"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--hold avx512: this CPU (" in err and "is avx2, without avx512's" in err
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16"}))
    assert all(cpu.unholdable_reason(kind) is None for kind in cpu.HOLDS)


def test_every_goal_that_applies_is_counted_even_unmeasured(monkeypatch, tmp_path, capsys):
    """A goal stands met, missed, void or not measured: a section that crashes leaves its goals as rows not measured,
    a figure is checked against its goal unrounded, a watch that cannot read the load voids its figure, and --check
    fails on each of them but the comparisons --allow-missing names (when not measured)."""
    from cbgen.bench import load, suite_runner
    from cbgen.bench.sections import section_goals
    from cbgen.bench.suite import Plan, section

    rows: list[Row] = []
    with section("generation", rows, lambda line: None, section_goals("generation", Plan.of(True, "small"))):
        raise RuntimeError("llama.cpp crashed")
    assert [r.name for r in rows] == ["generation (failed)", "cbgen vs generate_batch",
                                      "cbgen vs llama.cpp in the model's precision", "cbgen vs llama.cpp Q8_0"]
    for r in rows[1:]:
        r.applies = True
    assert summary(rows)["not_measured"] == 3 and rows[1].standing == "not measured"
    assert "the generation section failed (llama.cpp crashed)" in rows[1].note
    # a ratio of 1.4996 shows as 1.5, and misses a goal of 1.5
    t = Timings(watch=lambda: nullcontext(_quiet_watch()))
    t.record("other", lambda: 1.4996)
    t.record("cbgen", lambda: 1.0)
    close = ratio("s", "cbgen vs other", t, "other", "cbgen", "", Goal(">=", 1.5))
    close.applies = True
    assert close.figure == 1.5 and close.standing == "missed"
    # where /proc/stat cannot be read, nothing says the machine was quiet: the figure is void
    monkeypatch.setattr(load, "snapshot", lambda: None)
    blind = Timings(watch=lambda: load.watched(0))
    blind.record("cbgen", lambda: 1.0)
    assert blind.samples["cbgen"][0].busy
    # --check: fails on what is not measured, unless allowed by name
    rows[0:1] = []
    monkeypatch.setattr(suite_runner, "run", lambda *a, **k: (rows, {"goals": summary(rows)}))
    from cbgen.bench import report

    monkeypatch.setattr(report, "write_suite", lambda *a: (tmp_path / "bench.json", tmp_path / "bench.png"))
    monkeypatch.setattr(report, "print_suite", lambda *a: None)
    base = ["bench", "--suite", "--quick", "--check", "-o", str(tmp_path)]
    assert run_cli(base) == 1
    assert "check: cbgen vs llama.cpp Q8_0: not measured" in capsys.readouterr().err
    assert run_cli([*base, "--allow-missing", "cbgen vs llama.cpp"]) == 1  # generate_batch's is still missing
    assert run_cli([*base, "--allow-missing", "cbgen vs llama.cpp", "--allow-missing", "cbgen vs generate_batch"]) == 0


def _quiet_watch():
    watch = Watch(0)
    watch.during = Load(1.0, 2, other=0.0, steal=0.0)
    return watch


def test_hold_takes_only_its_own_argument_off_the_command_line():
    from cbgen.cli.bench_cmd import without_hold

    assert without_hold(["bench", "--suite", "--hold", "avx2", "-o", "avx2"]) == ["bench", "--suite", "-o", "avx2"]
    assert without_hold(["bench", "--suite", "--hold=avx2", "--sections", "avx2"]) == \
        ["bench", "--suite", "--sections", "avx2"]


@pytest.mark.parametrize("held", [False, True])
def test_a_held_run_reads_no_goal_against_llamacpp_which_it_does_not_hold(monkeypatch, held):
    # --hold reaches torch, oneDNN and cbgen's kernels; llama.cpp runs its own build at the machine's own
    # instructions, so a held run's rows against it are not the held kind's figures: their goals do not apply
    from cbgen.bench import sections, suite_runner
    from cbgen.bench.machine import Machine

    machine = Machine("AMD EPYC", "avx512-bf16", "avx2" if held else "avx512-bf16", held, 2, 2, True, "t", "tr",
                      "c", None, 400.0, 190.0)
    goal = Goal(">=", 1.2)

    def measured(ctx):
        against = Row("scale", "cbgen float32 vs llama.cpp f32, llama-1b", 1.03, "x", "", goal,
                      paths={"llama.cpp f32, llama-1b": [2.0], "cbgen float32, llama-1b": [1.9]}, exact=1.03)
        own = Row("scale", "cbgen int8 vs cbgen float32, llama-1b", 1.08, "x", "", Goal(">=", 1.0),
                  paths={"cbgen float32, llama-1b": [1.9], "cbgen int8, llama-1b": [1.76]}, exact=1.08)
        return [against, own]

    monkeypatch.setattr(suite_runner, "check_quiet", lambda allow_busy, log: {})
    monkeypatch.setattr(suite_runner, "measure", lambda: machine)
    monkeypatch.setattr(sections, "SECTIONS", {"scale": measured})
    monkeypatch.setattr(sections, "section_goals", lambda name, plan: ())
    rows, meta = suite_runner.run(Plan.of(True, "small"), None, None, True, print)
    against, own = rows
    assert own.applies and own.standing == "met"
    if held:
        assert not against.applies and against.why_not == "n/a held to avx2 (llama.cpp is not held)"
        assert against.standing is None and meta["goals"]["missed"] == 0
    else:
        assert against.applies and against.standing == "missed"
