"""cbgen as lm-evaluation-harness's model `cbgen`, against lm-eval's own `hf` backend on the same weights in float32:
the same loglikelihoods and is_greedy (multiple choice, with and without a context, and texts in rolling windows),
the same greedy generations (with and without the chat template), and lm-eval's own expectations (its cache,
--limit, input order, errors that surface)."""

from __future__ import annotations

import functools
from pathlib import Path

import lm_eval  # the eval extra, which `make install` installs: a missing one fails here, never skips
import pytest
from lm_eval.api.instance import Instance

from cbgen.cli import run_cli
from cbgen.errors import CbgenError
from cbgen.evaluation import register

ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "examples" / "eval"


@pytest.fixture(autouse=True)
def at_the_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # the example tasks name their data files from the repository root


@functools.cache
def task_manager():
    """lm-eval's index of the example tasks, made once: without lm-eval's own tasks, which the tests never run (an
    index of those reads every task file lm-eval ships: 10 s on a 2-core AMD EPYC Zen 4, each time; the command's
    tests below still build it)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASKS), include_defaults=False)


def evaluate(model, args: dict | None, tasks: list[str], **options) -> dict:
    """lm-eval's simple_evaluate on `model`: a registered name built from `args`, or a model already built."""
    register()
    return lm_eval.simple_evaluate(model=model, model_args=args, tasks=tasks, device="cpu", log_samples=True,
                                   task_manager=task_manager(), **options)


def build(name: str, args: dict, batch_size: int | None = None):
    """The model lm-eval's simple_evaluate builds for `--model name --model_args args` (its registry, its harness
    arguments), built once so that several evaluations share it."""
    from lm_eval.api.registry import get_model

    register()
    return get_model(name).create_from_arg_obj(args, {"batch_size": batch_size, "max_batch_size": None,
                                                      "device": "cpu"})


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    """cbgen's model and lm-eval's hf backend on the tiny model in float32, built once for the module (each build
    loads the weights; no test changes them): the tests that need other model args (max_length) build their own
    through simple_evaluate's model_args, so that path is tested too."""
    ours = build("cbgen", {"model": str(tiny_model_dir), "dtype": "float32"})
    theirs = build("hf", {"pretrained": str(tiny_model_dir), "dtype": "float32"}, batch_size=4)
    return ours, theirs


def samples(results: dict, task: str) -> list[dict]:
    return sorted(results["samples"][task], key=lambda sample: sample["doc_id"])


def both(tiny_model_dir, tasks, *, limit=8, cbgen_args=None, hf_args=None, **options):
    """The tasks on both backends, each built from its model args by simple_evaluate."""
    ours = evaluate("cbgen", {"model": str(tiny_model_dir), "dtype": "float32", **(cbgen_args or {})}, tasks,
                    limit=limit, **options)
    theirs = evaluate("hf", {"pretrained": str(tiny_model_dir), "dtype": "float32", **(hf_args or {})}, tasks,
                      limit=limit, batch_size=4, **options)
    return ours, theirs


def both_built(models, tasks, *, limit=8, **options):
    """The tasks on the module's two built models."""
    ours, theirs = models
    return evaluate(ours, None, tasks, limit=limit, **options), evaluate(theirs, None, tasks, limit=limit, **options)


def test_multiple_choice_and_generation_match_hf(models):
    ours, theirs = both_built(models, ["cbgen_capitals", "cbgen_arithmetic"])
    mc_ours, mc_theirs = samples(ours, "cbgen_capitals"), samples(theirs, "cbgen_capitals")
    assert len(mc_ours) == 8 and all(len(s["resps"]) == 4 for s in mc_ours)  # --limit, four choices each
    for a, b in zip(mc_ours, mc_theirs, strict=True):
        for ((value, greedy),), ((reference, reference_greedy),) in zip(a["resps"], b["resps"], strict=True):
            assert value == pytest.approx(reference, abs=1e-4)
            assert greedy == reference_greedy
    assert ours["results"]["cbgen_capitals"]["acc,none"] == theirs["results"]["cbgen_capitals"]["acc,none"]
    generated = [s["resps"][0][0] for s in samples(ours, "cbgen_arithmetic")]
    assert generated == [s["resps"][0][0] for s in samples(theirs, "cbgen_arithmetic")]
    assert any(text for text in generated)  # something was generated, and compared
    assert all("\n\n" not in text and "Question:" not in text for text in generated)  # cut at the stops


def test_rolling_loglikelihoods_match_hf_across_windows(tiny_model_dir):
    # a 16-token context: each text of 25-40 tokens is scored in two or three windows, every token once
    ours, theirs = both(tiny_model_dir, ["cbgen_texts"], limit=6, cbgen_args={"max_length": 16},
                        hf_args={"max_length": 16})
    mine = [s["resps"][0][0] for s in samples(ours, "cbgen_texts")]
    reference = [s["resps"][0][0] for s in samples(theirs, "cbgen_texts")]
    assert mine == pytest.approx(reference, abs=1e-3)  # sums of up to 40 tokens' logprobs
    assert all(value < 0 for value in mine)


def test_the_chat_template_applies_as_in_hf(models):
    ours, theirs = both_built(models, ["cbgen_arithmetic"], limit=4, apply_chat_template=True)
    prompts = [s["arguments"][0][0] for s in samples(ours, "cbgen_arithmetic")]
    assert all(prompt.startswith("<|im_start|>") for prompt in prompts)  # SmolLM2's template
    assert [s["resps"][0][0] for s in samples(ours, "cbgen_arithmetic")] == \
        [s["resps"][0][0] for s in samples(theirs, "cbgen_arithmetic")]


def test_an_empty_context_and_input_order(models):
    from lm_eval.models.huggingface import HFLM

    from cbgen.evaluation.lm import CbgenLM

    lm, hf = models
    assert isinstance(lm, CbgenLM) and isinstance(hf, HFLM)
    pairs = [("", " Paris is a city."), ("The capital of France is", " Paris"), ("Two plus two is", " four"),
             ("", "Hello")]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    ours = lm.loglikelihood(requests)
    theirs = hf.loglikelihood(requests)
    assert [greedy for _, greedy in ours] == [greedy for _, greedy in theirs]
    assert [value for value, _ in ours] == pytest.approx([value for value, _ in theirs], abs=1e-4)


def test_lm_evals_cache_serves_a_second_run(models, tmp_path, monkeypatch):
    from cbgen.evaluation.lm import CbgenLM

    lm, _ = models
    first = evaluate(lm, None, ["cbgen_capitals"], limit=3, use_cache=str(tmp_path / "lm-cache"))
    assert list(tmp_path.glob("lm-cache_rank*.db"))

    def no_model(*args, **kwargs):
        raise AssertionError("the model was asked again")

    monkeypatch.setattr(CbgenLM, "_loglikelihood_tokens", no_model)
    second = evaluate(lm, None, ["cbgen_capitals"], limit=3, use_cache=str(tmp_path / "lm-cache"))
    assert [s["resps"] for s in samples(second, "cbgen_capitals")] == \
        [s["resps"] for s in samples(first, "cbgen_capitals")]


def test_a_request_that_cannot_run_is_an_error(models):
    lm, _ = models
    too_long = Instance("generate_until", {}, ("Hello", {"until": ["\n"], "max_gen_toks": 400}), 0)
    with pytest.raises(CbgenError, match="max_gen_toks 400 leaves no room"):
        lm.generate_until([too_long])
    unknown = Instance("generate_until", {}, ("Hello", {"until": ["\n"], "max_gen_toks": 8, "num_beams": 4}), 0)
    with pytest.raises(CbgenError, match="num_beams"):
        lm.generate_until([unknown])


def test_unknown_model_args_name_the_closest(tiny_model_dir, capsys):
    code = run_cli(["eval", "--model_args", f"model={tiny_model_dir},max_batch_tokenz=64", "--tasks",
                    "cbgen_capitals", "--include_path", str(TASKS), "--limit", "1", "--device", "cpu"])
    assert code != 0
    err = capsys.readouterr().err
    assert "max_batch_tokenz" in err and "did you mean 'max_batch_tokens'" in err
    assert "Traceback" not in err


@pytest.mark.embedded
def test_the_embedded_model_through_the_command(tmp_path):
    """`cbgen eval` (lm-eval's command line with cbgen registered) on the embedded model, then `--model hf` on the
    float32 safetensors cbgen converted it into: the same per-sample numbers and generations."""
    import json
    import os
    import subprocess
    import sys

    from cbgen.model.gguf import TOKENIZER_ENTRY, GgufCache, default_cache_dir, model_entry
    from cbgen.model.source import embedded_model_path

    def cli(model: str, args: str, out: Path) -> dict[str, list[dict]]:
        done = subprocess.run(
            [sys.executable, "-m", "cbgen", "eval", "--model", model, "--model_args", args, "--tasks",
             "cbgen_capitals,cbgen_arithmetic,cbgen_texts", "--include_path", str(TASKS), "--limit", "4",
             "--device", "cpu", "--batch_size", "4", "--log_samples", "--output_path", str(out),
             "--apply_chat_template"],  # an instruct model: bare prompts get its end token at once
            capture_output=True, text=True, cwd=ROOT, env=os.environ | {"HF_HUB_OFFLINE": "1"})
        assert done.returncode == 0, done.stderr[-3000:]
        found = {}
        for path in out.rglob("samples_*.jsonl"):
            task = path.name.removeprefix("samples_").rsplit("_", 1)[0]
            found[task] = sorted((json.loads(line) for line in path.read_text().splitlines()),
                                 key=lambda sample: sample["doc_id"])
        return found

    import torch

    ours = cli("cbgen", "dtype=float32", tmp_path / "cbgen")
    cache = GgufCache(default_cache_dir(), embedded_model_path())
    model, tokenizer = cache.find(model_entry(torch.float32)), cache.find(TOKENIZER_ENTRY)
    theirs = cli("hf", f"pretrained={model},tokenizer={tokenizer},dtype=float32", tmp_path / "hf")
    assert sorted(ours) == sorted(theirs) == ["cbgen_arithmetic", "cbgen_capitals", "cbgen_texts"]
    for a, b in zip(ours["cbgen_capitals"], theirs["cbgen_capitals"], strict=True):
        for (mine,), (reference,) in zip(a["resps"], b["resps"], strict=True):
            assert float(mine[0]) == pytest.approx(float(reference[0]), abs=1e-4)
            assert mine[1] == reference[1]
    assert [s["resps"] for s in ours["cbgen_arithmetic"]] == [s["resps"] for s in theirs["cbgen_arithmetic"]]
    assert all(s["resps"][0][0] for s in ours["cbgen_arithmetic"])  # answers, not the end token alone
    assert [float(s["resps"][0][0]) for s in ours["cbgen_texts"]] == \
        pytest.approx([float(s["resps"][0][0]) for s in theirs["cbgen_texts"]], abs=1e-3)
