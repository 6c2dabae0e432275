"""The history controls (cbgen.control.penalties): each one equal to transformers' own processor (or OpenAI's
published formula) on random scores and histories, in float32 and bfloat16; through a real job, greedy float32 tokens
equal to plain `model.generate` with that processor; per-row settings that do not leak into batch-mates; the loop
stop on a model made to loop; OpenAI lines; bad values."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import (
    LogitsProcessor,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

import cbgen
from cbgen.cli import run_cli
from cbgen.control.penalties import Controls, History, apply_history, apply_min_p, repeats_at_end
from cbgen.rows import read_shards
from tests.helpers import property_examples, write_jsonl

VOCAB = 40
DTYPES = st.sampled_from([torch.float32, torch.bfloat16])


@st.composite
def histories(draw):
    prompt = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20))
    generated = draw(st.lists(st.integers(0, VOCAB - 1), max_size=20))
    dtype = draw(DTYPES)
    seed = draw(st.integers(0, 2**31))
    scores = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(seed)).mul(4).to(dtype)
    return prompt, generated, scores


def _ours(controls: Controls, prompt, generated, scores, eos=()) -> torch.Tensor:
    history = History(controls)
    history.sync(prompt, generated, len(prompt))
    out = scores.clone()
    apply_history(out, [(0, history)], eos)
    return out


def _ids(prompt, generated) -> torch.Tensor:
    return torch.tensor([prompt + generated])


@settings(max_examples=property_examples(80), deadline=None)
@given(histories(), st.floats(0.5, 2.0))
def test_repetition_penalty_is_transformers(case, penalty):
    prompt, generated, scores = case
    ours = _ours(Controls(repetition_penalty=penalty), prompt, generated, scores)
    assert torch.equal(ours, RepetitionPenaltyLogitsProcessor(penalty)(_ids(prompt, generated), scores.clone()))


@settings(max_examples=property_examples(80), deadline=None)
@given(histories(), st.integers(1, 4))
def test_no_repeat_ngram_is_transformers(case, n):
    prompt, generated, scores = case
    ours = _ours(Controls(no_repeat_ngram_size=n), prompt, generated, scores)
    assert torch.equal(ours, NoRepeatNGramLogitsProcessor(n)(_ids(prompt, generated), scores.clone()))


@settings(max_examples=property_examples(60), deadline=None)
@given(histories(), st.integers(0, 25))
def test_min_tokens_is_transformers(case, minimum):
    prompt, generated, scores = case
    eos = (3, 7)
    ours = _ours(Controls(min_tokens=minimum), prompt, generated, scores, eos)
    theirs = MinNewTokensLengthLogitsProcessor(len(prompt), minimum, list(eos))(_ids(prompt, generated),
                                                                                scores.clone())
    assert torch.equal(ours, theirs)
    assert torch.isinf(_ours(Controls(ignore_eos=True), prompt, generated, scores, eos)[0, list(eos)]).all()


@settings(max_examples=property_examples(60), deadline=None)
@given(histories(), st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100, 100), min_size=1, max_size=6))
def test_logit_bias_is_transformers_sequence_bias(case, bias):
    prompt, generated, scores = case
    ours = _ours(Controls.of({"logit_bias": {str(k): v for k, v in bias.items()}}), prompt, generated, scores)
    theirs = SequenceBiasLogitsProcessor({(k,): v for k, v in bias.items()})(_ids(prompt, generated), scores.clone())
    assert torch.equal(ours, theirs)


def openai_penalties(logits: list[float], generated: list[int], presence: float, frequency: float) -> list[float]:
    """OpenAI's published formula, token by token: mu[j] - c[j] * frequency - float(c[j] > 0) * presence, with c[j]
    how many times token j was generated before."""
    out = []
    for j, mu in enumerate(logits):
        c = generated.count(j)
        out.append(mu - c * frequency - float(c > 0) * presence)
    return out


@settings(max_examples=property_examples(80), deadline=None)
@given(histories(), st.floats(-2, 2), st.floats(-2, 2))
def test_presence_and_frequency_penalties_are_openai_formula(case, presence, frequency):
    prompt, generated, scores = case
    scores = scores.float()  # the reference runs in float32, a token at a time
    ours = _ours(Controls(presence_penalty=presence, frequency_penalty=frequency), prompt, generated, scores)
    reference = openai_penalties(scores[0].tolist(), generated, presence, frequency)
    assert torch.allclose(ours[0], torch.tensor(reference), rtol=0, atol=1e-5)
    assert torch.equal(ours[0, [j for j in range(VOCAB) if j not in generated]],
                       scores[0, [j for j in range(VOCAB) if j not in generated]])  # the prompt is not penalised


@settings(max_examples=property_examples(80), deadline=None)
@given(st.integers(0, 2**31), st.lists(st.floats(0.0, 1.0), min_size=1, max_size=6), st.integers(1, 700),
       st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), st.booleans(), st.booleans())
def test_min_p_compiled_is_the_torch_operators_bitwise(seed, min_ps, vocab, dtype, some_rows, odd_rows):
    """The compiled filter (cbgen/kernels/sampling.cpp, on CPU) makes the torch operators' decisions: every row and
    a subset of them, vocabularies across vector widths, rows with NaN, -inf and every token masked."""
    from cbgen.control.draw import draw_kernel

    assert draw_kernel()[0] is not None, draw_kernel()[1]  # the kernel builds wherever the tests run
    generator = torch.Generator().manual_seed(seed)
    total = len(min_ps) + 2
    scores = torch.randn(total, vocab, generator=generator).mul(4).to(dtype)
    if odd_rows:
        scores[-1] = float("-inf")  # every token masked (a grammar that allows nothing)
        scores[-2, vocab // 2] = float("nan")
        scores[0, : vocab // 3] = float("-inf")
    positions = sorted(torch.randperm(total, generator=generator)[: len(min_ps)].tolist()) if some_rows \
        else list(range(len(min_ps)))
    rows = list(zip(positions, min_ps, strict=True))
    eager, compiled = scores.clone(), scores.clone()
    apply_min_p(eager, rows, compiled=False)
    apply_min_p(compiled, rows)
    assert torch.equal(eager.isnan(), compiled.isnan())
    assert torch.equal(eager.nan_to_num(0.0), compiled.nan_to_num(0.0))
    assert torch.equal(torch.isinf(eager), torch.isinf(compiled))


@settings(max_examples=property_examples(80), deadline=None)
@given(st.integers(0, 2**31), st.floats(0.0, 1.0), st.integers(1, 5), DTYPES)
def test_min_p_is_transformers(seed, min_p, rows, dtype):
    """transformers' MinPLogitsWarper's decisions (a softmax, then probability < min_p times the best's), but for
    tokens within float rounding of the threshold, which cbgen tests in logits (score < best + ln(min_p))."""
    scores = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)).mul(3).to(dtype)
    ours = scores.clone()
    apply_min_p(ours, [(i, min_p) for i in range(rows)])
    warper = MinPLogitsWarper(min_p) if min_p > 0 else None
    for i in range(rows):
        theirs = warper(None, scores[i:i + 1].clone())[0] if warper else scores[i]
        kept = torch.isfinite(ours[i])
        assert torch.equal(ours[i][kept], scores[i][kept])  # what is kept is untouched
        assert bool(kept[scores[i].argmax()])  # the best token always stays
        gap = scores[i].float() - scores[i].float().max() - (math.log(min_p) if min_p > 0 else -math.inf)
        # transformers decides in the scores' dtype: in bfloat16 each probability, the best one and min_p times it
        # are rounded (2^-8 relative at most each), so its threshold moves by up to 3 * 2^-8 in logits; cbgen's
        # float32 test by float32 rounding only
        reach = 3 * 2**-8 if dtype == torch.bfloat16 else 1e-4
        clear = gap.abs() > reach  # further from the threshold than either side's rounding reaches
        assert torch.equal(kept[clear], torch.isfinite(theirs)[clear])


def test_rows_without_a_control_are_untouched_and_rows_do_not_mix():
    scores = torch.randn(3, VOCAB)
    alone = _ours(Controls(repetition_penalty=1.7, presence_penalty=1.0), [1, 2, 3], [4, 4], scores[1:2])
    history = History(Controls(repetition_penalty=1.7, presence_penalty=1.0))
    history.sync([1, 2, 3], [4, 4], 3)
    other = History(Controls(no_repeat_ngram_size=1))
    other.sync([5, 6], [7], 2)
    batch = scores.clone()
    apply_history(batch, [(1, history), (2, other)], ())
    assert torch.equal(batch[0], scores[0]) and torch.equal(batch[1], alone[0])


def test_the_loop_detector():
    assert repeats_at_end([9, 1, 2, 1, 2, 1, 2], 3, 4)
    assert not repeats_at_end([9, 1, 2, 1, 2, 1, 2], 4, 4)
    assert repeats_at_end([5] * 4, 4, 1) and not repeats_at_end([5, 5, 5, 6], 3, 8)
    assert not repeats_at_end([1, 2, 3, 1, 2, 3], 2, 2)  # the span is longer than the longest looked for


# --------------------------------------------------------------------------------------------------------------- #
# through a real job (the tiny random model, float32, greedy)

PROMPTS = [[1, 5, 9, 14, 3, 20], [7, 7, 30, 2], [11, 4, 4, 18, 25, 40, 2], [100, 101, 102]]
NEW = 12


class OpenAIPenalties(LogitsProcessor):
    """A reference for plain generate: OpenAI's formula over the tokens generated after the prompt."""

    def __init__(self, prompt_length: int, presence: float, frequency: float) -> None:
        self.prompt_length, self.presence, self.frequency = prompt_length, presence, frequency

    def __call__(self, input_ids, scores):
        generated = input_ids[0, self.prompt_length:].tolist()
        return torch.tensor([openai_penalties(scores[0].tolist(), generated, self.presence, self.frequency)],
                            dtype=scores.dtype)


@pytest.fixture(scope="module")
def reference_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _reference(model, prompt: list[int], processors: list[LogitsProcessor]) -> list[int]:
    eos = model.config.eos_token_id
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, eos_token_id=eos,
                             pad_token_id=eos, logits_processor=LogitsProcessorList(processors))
    tokens = out[0, len(prompt):].tolist()
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def _cbgen(tiny_model_dir, rows, **settings) -> dict[str, list[int]]:
    got = cbgen.generate(rows, model=str(tiny_model_dir), dtype="float32", max_new_tokens=NEW, progress=False,
                         **settings)
    return {r.id: r.token_ids for r in got}


BIAS = {"5": 2.0}  # makes prompt token 5 the greedy choice, so that the history controls have repeats to act on


def _biased(processor: LogitsProcessor) -> list[LogitsProcessor]:
    return [SequenceBiasLogitsProcessor({(5,): 2.0}), processor]  # logit_bias first, as transformers orders them


CASES = {
    "repetition_penalty": ({"repetition_penalty": 10.0}, lambda p: _biased(RepetitionPenaltyLogitsProcessor(10.0))),
    "no_repeat_ngram_size": ({"no_repeat_ngram_size": 2}, lambda p: _biased(NoRepeatNGramLogitsProcessor(2))),
    "penalties": ({"presence_penalty": 1.5, "frequency_penalty": 0.7},
                  lambda p: _biased(OpenAIPenalties(len(p), 1.5, 0.7))),
}


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_tokens_equal_plain_generate_with_transformers_processor(name, tiny_model_dir, reference_model):
    values, make = CASES[name]
    rows = [{"id": str(i), "input_ids": p} for i, p in enumerate(PROMPTS)]
    ours = _cbgen(tiny_model_dir, rows, logit_bias=BIAS, **values)
    biased = _cbgen(tiny_model_dir, rows, logit_bias=BIAS)
    assert all(tokens.count(5) >= 3 for tokens in biased.values())  # the bias alone repeats token 5
    for i, prompt in enumerate(PROMPTS):
        assert ours[str(i)] == _reference(reference_model, prompt, make(prompt)), (name, i)
        assert ours[str(i)] != biased[str(i)], (name, i)  # the control changed the tokens


def test_logit_bias_equals_plain_generate_with_sequence_bias(tiny_model_dir, reference_model):
    rows = [{"id": str(i), "input_ids": p} for i, p in enumerate(PROMPTS)]
    ours = _cbgen(tiny_model_dir, rows, logit_bias={"101": 30, "7": -100})
    processor = SequenceBiasLogitsProcessor({(101,): 30.0, (7,): -100.0})
    for i, prompt in enumerate(PROMPTS):
        assert ours[str(i)] == _reference(reference_model, prompt, [processor])


def test_min_tokens_holds_back_the_end(tiny_model_dir, reference_model):
    eos = reference_model.config.eos_token_id
    rows = [{"id": "0", "input_ids": PROMPTS[0]}]
    forced = _cbgen(tiny_model_dir, rows, logit_bias={str(eos): 100})["0"]
    assert forced == [eos]  # the control: this job ends at once
    held = _cbgen(tiny_model_dir, rows, logit_bias={str(eos): 100}, min_tokens=5)["0"]
    processors = LogitsProcessorList([SequenceBiasLogitsProcessor({(eos,): 100.0}),
                                      MinNewTokensLengthLogitsProcessor(len(PROMPTS[0]), 5, eos)])
    with torch.no_grad():
        out = reference_model.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=NEW, do_sample=False,
                                       eos_token_id=eos, pad_token_id=eos, logits_processor=processors)
    assert held == out[0, len(PROMPTS[0]):].tolist()[:6] and len(held) == 6 and held[-1] == eos
    ignored = _cbgen(tiny_model_dir, rows, logit_bias={str(eos): 100}, ignore_eos=True)["0"]
    assert len(ignored) == NEW and eos not in ignored


def test_row_settings_apply_to_their_row_alone(tiny_model_dir):
    """Mixed per-row settings in one batch: each row gets what it gets alone, and what it gets with those settings
    as the job's; a row without any gets the plain job's tokens."""
    rows = [{"id": "0", "input_ids": PROMPTS[0], "repetition_penalty": 1.8},
            {"id": "1", "input_ids": PROMPTS[1]},
            {"id": "2", "input_ids": PROMPTS[2], "no_repeat_ngram_size": 2, "presence_penalty": 1.0},
            {"id": "3", "input_ids": PROMPTS[3], "logit_bias": {"101": 30}, "bad_words": ["e", [101, 101]]},
            {"id": "4", "input_ids": PROMPTS[0], "min_tokens": 3, "no_repeat_ngram_size": 1}]
    mixed = _cbgen(tiny_model_dir, rows, batch_invariant=True)
    for row in rows:
        own = {k: v for k, v in row.items() if k not in ("id", "input_ids")}
        plain = {"id": row["id"], "input_ids": row["input_ids"]}
        if all(isinstance(w, str) for w in own.get("bad_words", [])):  # the same settings as the job's
            assert mixed[row["id"]] == _cbgen(tiny_model_dir, [plain], batch_invariant=True, **own)[row["id"]], row
        assert mixed[row["id"]] == _cbgen(tiny_model_dir, [row], batch_invariant=True)[row["id"]], row  # alone


# --------------------------------------------------------------------------------------------------------------- #
# the loop stop, on a model that loops

CYCLE = [50, 60, 70]


@pytest.fixture(scope="module")
def looping_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model made to loop: no attention or MLP output (the residual stream is the token's embedding), and
    an output head that maps each token of CYCLE to the next one."""
    import shutil

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.zero_()
        embed = model.model.embed_tokens.weight
        for i, token in enumerate(CYCLE):
            model.lm_head.weight[CYCLE[(i + 1) % len(CYCLE)]] = embed[token] / embed[token].norm() * 50
    folder = tmp_path_factory.mktemp("looping")
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tiny_model_dir / name).exists():
            shutil.copy(tiny_model_dir / name, folder / name)
    return folder


def test_the_loop_stop_ends_a_looping_sequence(looping_model_dir, tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "input_ids": [1, 2, CYCLE[0]]},
                                                 {"id": "b", "input_ids": [3, CYCLE[1]], "max_new_tokens": 40}])
    plain = tmp_path / "plain"
    assert run_cli(["run", str(source), "-o", str(plain), "--model", str(looping_model_dir), "--dtype", "float32",
                    "--max-new-tokens", "30", "-q"]) == 0
    rows = {r["id"]: r for r in read_shards(plain)}
    assert rows["a"]["token_ids"][:6] == [CYCLE[1], CYCLE[2], CYCLE[0]] * 2 and rows["a"]["finish_reason"] == "length"
    out = tmp_path / "stopped"
    assert run_cli(["run", str(source), "-o", str(out), "--model", str(looping_model_dir), "--dtype", "float32",
                    "--max-new-tokens", "30", "--loop-stop", "4", "--loop-stop-span", "8", "-q"]) == 0
    rows = {r["id"]: r for r in read_shards(out)}
    assert rows["a"]["token_ids"] == [CYCLE[1], CYCLE[2], CYCLE[0]] * 4
    assert rows["b"]["token_ids"] == [CYCLE[2], CYCLE[0], CYCLE[1]] * 4
    assert {r["finish_reason"] for r in rows.values()} == {"repetition"}
    counts = json.loads((out / "run.json").read_text())["counts"]
    assert counts["loop_stopped"] == 2 and counts["loop_tokens_saved"] == (30 - 12) + (40 - 12)


def test_loop_stopped_sequences_are_cached_and_counted_on_resume(looping_model_dir, tmp_path, monkeypatch):
    from cbgen.outputs.summary import RunSummary
    from cbgen.rows.shards import done_index, shard_paths

    monkeypatch.delenv("CBGEN_RESULT_CACHE", raising=False)
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "input_ids": [1, 2, CYCLE[0]]}])
    job = ["--model", str(looping_model_dir), "--dtype", "float32", "--max-new-tokens", "30", "--loop-stop", "4",
           "--loop-stop-span", "8", "--cache", str(tmp_path / "cache"), "-q"]
    for out in ("first", "again"):
        assert run_cli(["run", str(source), "-o", str(tmp_path / out), *job]) == 0
    again = json.loads((tmp_path / "again" / "run.json").read_text())
    assert again["result_cache"]["hits"] == 1, again["result_cache"]
    assert [(r["finish_reason"], r["token_ids"]) for r in read_shards(tmp_path / "again")] == \
        [("repetition", [CYCLE[1], CYCLE[2], CYCLE[0]] * 4)]
    assert again["counts"]["loop_stopped"] == 1
    done = done_index(shard_paths(tmp_path / "first"))  # what a resumed run counts of the rows written before it
    assert (done.loop_stopped, done.loop_generated_tokens) == (1, 12)
    summary = RunSummary(output_dir=tmp_path, model="m", max_new_tokens=30)
    summary.add_done(done)
    assert (summary.loop_stopped, summary.loop_tokens_saved) == (1, 30 - 12)


# --------------------------------------------------------------------------------------------------------------- #
# OpenAI batch lines and bad values


def test_openai_lines_with_penalties_logit_bias_and_bad_words_are_honoured(tiny_model_dir, tmp_path):
    body = {"presence_penalty": 1.5, "frequency_penalty": 0.7, "logit_bias": {"101": 30}, "bad_words": ["e"],
            "max_tokens": NEW}
    lines = [{"custom_id": str(i), "method": "POST", "url": "/v1/completions", "body": {"prompt": p, **body}}
             for i, p in enumerate(PROMPTS)]
    source = write_jsonl(tmp_path / "batch.jsonl", lines)
    out = tmp_path / "out"
    assert run_cli(["run", str(source), "-o", str(out), "--model", str(tiny_model_dir), "--dtype", "float32",
                    "-q"]) == 0
    manifest = json.loads((out / "run.json").read_text())
    assert not manifest.get("input_notices"), manifest.get("input_notices")
    rows = [{"id": str(i), "input_ids": p} for i, p in enumerate(PROMPTS)]
    expected = _cbgen(tiny_model_dir, rows, presence_penalty=1.5, frequency_penalty=0.7, logit_bias={"101": 30},
                      bad_words=["e"])
    got = list(read_shards(out))
    assert {r["id"]: r["token_ids"] for r in got} == expected
    assert not any("e" in r["text"] for r in got)


@pytest.mark.parametrize(("flags", "message"), [
    (["--min-tokens", "300", "--max-new-tokens", "10"], "min-tokens 300 (YAML generation.min_tokens: 300"),
    (["--presence-penalty", "3"], "--presence-penalty must be a number from -2 to 2"),
    (["--repetition-penalty", "0"], "--repetition-penalty must be a number above 0"),
    (["--logit-bias", '{"x": 1}'], "--logit-bias must be a JSON object of token id -> bias"),
    (["--logit-bias", '{"5": 300}'], "--logit-bias must be a JSON object of token id -> bias"),
    (["--loop-stop", "1"], "--loop-stop must be an integer of at least 2"),
])
def test_bad_values_stop_the_job_before_a_model_loads(flags, message, tmp_path, capsys):
    source = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hi"}])
    code = run_cli(["run", str(source), "-o", str(tmp_path / "out"), "--model", str(tmp_path / "no-such-model"),
                    "-q", *flags])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err


def test_bad_row_values_become_that_rows_error(tiny_model_dir, tmp_path):
    rows = [{"id": "ok", "input_ids": PROMPTS[0], "repetition_penalty": 1.2},
            {"id": "neg", "input_ids": PROMPTS[0], "repetition_penalty": -1},
            {"id": "bias", "input_ids": PROMPTS[0], "logit_bias": {"99999999": 5}},
            {"id": "min", "input_ids": PROMPTS[0], "min_tokens": 50},
            {"id": "pen", "input_ids": PROMPTS[0], "frequency_penalty": "high"}]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out"
    run_cli(["run", str(source), "-o", str(out), "--model", str(tiny_model_dir), "--dtype", "float32",
             "--max-new-tokens", "8", "-q"])
    got = {r["id"]: r for r in read_shards(out)}
    assert got["ok"]["error"] is None and len(got["ok"]["token_ids"]) > 0
    assert "repetition_penalty" in got["neg"]["error"]
    assert "outside the model's vocabulary" in got["bias"]["error"]
    assert "min_tokens 50 is more than the request's max_new_tokens 8" in got["min"]["error"]
    assert "frequency_penalty" in got["pen"]["error"]
