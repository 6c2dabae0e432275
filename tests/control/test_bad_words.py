"""Bad words (cbgen.control.bad_words): token-id sequences equal to transformers' NoBadWordsLogitsProcessor, on
random histories and through a real job against plain `model.generate`; strings banned as text, whatever tokens
would spell them (a property over the real tokenizer's vocabulary); the settings' bad values."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import NoBadWordsLogitsProcessor, SequenceBiasLogitsProcessor

from cbgen.cli import run_cli
from cbgen.control.bad_words import VocabText
from cbgen.control.penalties import Controls, History, apply_history
from cbgen.rows import read_shards
from tests.control.test_penalties import NEW, PROMPTS, _cbgen, _reference, reference_model  # noqa: F401
from tests.helpers import property_examples, write_jsonl

VOCAB = 40
EOS = (3,)


@st.composite
def sequences_case(draw):
    """A history over a few ids (so that bad sequences match) and bad sequences made of the same ids."""
    alphabet = st.integers(0, 6)
    prompt = draw(st.lists(alphabet, min_size=1, max_size=12))
    generated = draw(st.lists(alphabet, max_size=12))
    words = draw(st.lists(st.lists(alphabet, min_size=1, max_size=3), min_size=1, max_size=5))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    scores = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(draw(st.integers(0, 2**31))))
    return prompt, generated, words, scores.mul(4).to(dtype)


@settings(max_examples=property_examples(100), deadline=None)
@given(sequences_case())
def test_token_sequences_are_transformers_no_bad_words(case):
    prompt, generated, words, scores = case
    history = History(Controls.of({"bad_words": words}))
    from cbgen.control.bad_words import BadWords

    history.bad = BadWords(history.controls.bad_words, EOS)
    history.sync(prompt, generated, len(prompt))
    ours = scores.clone()
    apply_history(ours, [(0, history)], EOS)
    theirs = NoBadWordsLogitsProcessor(words, list(EOS))(torch.tensor([prompt + generated]), scores.clone())
    assert torch.equal(ours, theirs)


@pytest.fixture(scope="module")
def vocab(tiny_model_dir) -> VocabText:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    return VocabText(tokenizer, len(tokenizer))


@settings(max_examples=property_examples(40), deadline=None)
@given(st.lists(st.integers(0, 8000), min_size=1, max_size=12), st.integers(0, 8000), st.integers(1, 4),
       st.integers(1, 6), st.booleans())
def test_a_string_bans_exactly_the_tokens_that_would_complete_it(vocab, tokens, after, back, ahead, whole):
    """The word straddles the end of the text and the next token's text (or lies inside one token's text): the
    tokens banned are exactly those whose text, after the text so far, would make it appear."""
    from cbgen.control.bad_words import BadWords

    text = vocab.text(tokens)
    piece = vocab.texts[after]
    word = piece[:ahead] if whole else text[-back:] + piece[:ahead]
    assume(word.strip() and word not in text)
    bad = BadWords((word,), EOS, vocab)
    banned = set(torch.cat(bad.banned(tokens)).tolist())
    expected = {i for i, t in enumerate(vocab.texts) if t and word in text + t}
    assert banned == expected and after in banned


def test_token_sequences_through_a_job_equal_plain_generate(tiny_model_dir, reference_model):  # noqa: F811
    """Each row bans the pair (its prompt's last token, 5) and token 7: under logit_bias 5 +2 the plain job repeats
    token 5, so the bans change the tokens; they equal plain generate with transformers' processor."""
    rows, expected = [], {}
    for i, prompt in enumerate(PROMPTS):
        words = [[prompt[-1], 5], [5, 5], [7]]
        rows.append({"id": str(i), "input_ids": prompt, "bad_words": words})
        processors = [SequenceBiasLogitsProcessor({(5,): 2.0}),
                      NoBadWordsLogitsProcessor(words, reference_model.config.eos_token_id)]
        expected[str(i)] = _reference(reference_model, prompt, processors)
    ours = _cbgen(tiny_model_dir, rows, logit_bias={"5": 2.0})
    plain = _cbgen(tiny_model_dir, [{k: v for k, v in r.items() if k != "bad_words"} for r in rows],
                   logit_bias={"5": 2.0})
    assert ours == expected and ours != plain


def test_bad_strings_never_appear_in_the_text(tiny_model_dir, tmp_path):
    """Seeded sampling on the tiny model; words cut from its own texts, across token boundaries, then banned (by
    the job's --bad-word and by a row's own bad_words): the texts no longer hold them."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = [{"id": str(i), "prompt": p} for i, p in enumerate(["Once upon", "The capital of", "Write a poem"])]
    source = write_jsonl(tmp_path / "in.jsonl", prompts)
    common = ["--model", str(tiny_model_dir), "--dtype", "float32", "--max-new-tokens", "24", "--seed", "5",
              "--temperature", "1", "-q"]
    assert run_cli(["run", str(source), "-o", str(tmp_path / "free"), *common]) == 0
    free = {r["id"]: r for r in read_shards(tmp_path / "free")}
    words = {}
    for key, row in free.items():  # a word from the middle of one token to the middle of the next-but-one
        pieces = [tokenizer.decode([t]) for t in row["token_ids"][2:5]]
        assert all(len(p) >= 2 for p in pieces[:1]), pieces
        words[key] = pieces[0][1:] + pieces[1] + pieces[2][:1]
        assert words[key] in row["text"]
    job_word = words.pop("0")
    rows = [{**p, "bad_words": [words[p["id"]]]} if p["id"] in words else p for p in prompts]
    assert run_cli(["run", str(write_jsonl(tmp_path / "rows.jsonl", rows)), "-o", str(tmp_path / "banned"),
                    "--bad-word", job_word, *common]) == 0
    banned = {r["id"]: r for r in read_shards(tmp_path / "banned")}
    for key, row in banned.items():
        assert job_word not in row["text"] and words.get(key, job_word) not in row["text"], key
        assert row["text"] != free[key]["text"]


def test_bad_values(tiny_model_dir, tmp_path, capsys):
    source = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hi"}])
    code = run_cli(["run", str(source), "-o", str(tmp_path / "x"), "--model", str(tmp_path / "none"), "-q",
                    "--bad-word", ""])
    err = capsys.readouterr().err
    assert code == 2 and "--bad-word must be a list of non-empty strings" in err and "Traceback" not in err
    rows = [{"id": "ok", "input_ids": PROMPTS[0], "bad_words": ["the", [5, 6]]},
            {"id": "empty", "input_ids": PROMPTS[0], "bad_words": [""]},
            {"id": "ids", "input_ids": PROMPTS[0], "bad_words": [[99999999]]},
            {"id": "kind", "input_ids": PROMPTS[0], "bad_words": [3.5]}]
    out = tmp_path / "out"
    run_cli(["run", str(write_jsonl(tmp_path / "rows.jsonl", rows)), "-o", str(out), "--model", str(tiny_model_dir),
             "--dtype", "float32", "--max-new-tokens", "4", "-q"])
    got = {r["id"]: r for r in read_shards(out)}
    assert got["ok"]["error"] is None
    assert "'bad_words' items must be non-empty strings" in got["empty"]["error"]
    assert "bad_words names token 99999999, outside the model's vocabulary" in got["ids"]["error"]
    assert "'bad_words' items must be" in got["kind"]["error"]
