"""What makes a result-cache key, and when an entry is an answer: every part that decides a sequence changes its
key, the token cap and logprob settings decide which held entries serve, and only equal batch-invariant numerics
make an exact hit."""

from __future__ import annotations

import dataclasses

import pytest

from cbgen.chat.formats import ResponseFormat
from cbgen.control.processor import GRAMMAR_KWARG, SEED_KWARG
from cbgen.records import Completion, PromptRecord, Request
from cbgen.result_cache.cache import ResultCache
from cbgen.result_cache.keys import Keyer, Numerics
from cbgen.result_cache.store import ResultStore

MODEL = {"gguf": "ab" * 32}
SAMPLED = {"do_sample": True, "temperature": 0.8, "top_k": None}


def request(ids=(1, 2, 3), *, seed=7, stop=(), fmt=None, sampling=None, n=None, max_new_tokens=None, top=0):
    own = dict(sampling or {})
    if seed is not None:
        own[SEED_KWARG] = seed
    if fmt is not None:
        own[GRAMMAR_KWARG] = fmt.key
    return Request(PromptRecord("r", 0, "test"), input_ids=list(ids), sampling=own, stop=tuple(stop), n=n,
                   response_format=fmt, max_new_tokens=max_new_tokens, top_logprobs=top)


def keyer(model=MODEL, dtype="bfloat16", eos=(2,), sampling=SAMPLED) -> Keyer:
    return Keyer(model, dtype, list(eos), dict(sampling), bool(sampling.get("do_sample")))


def test_every_part_that_decides_a_sequence_changes_its_key():
    base = keyer().sequence_keys(request(), 2)
    assert base == keyer().sequence_keys(request(), 2)  # the same inputs: the same keys
    assert base[0] != base[1]  # each sample index its own
    variants = {
        "weights": keyer(model={"gguf": "cd" * 32}).sequence_keys(request(), 2),
        "dtype": keyer(dtype="float32").sequence_keys(request(), 2),
        "end-of-sequence ids": keyer(eos=(2, 5)).sequence_keys(request(), 2),
        "temperature": keyer(sampling={**SAMPLED, "temperature": 0.9}).sequence_keys(request(), 2),
        "top_k": keyer(sampling={**SAMPLED, "top_k": 40}).sequence_keys(request(), 2),
        "a row's own top_p": keyer().sequence_keys(request(sampling={"top_p": 0.5}), 2),
        "prompt ids": keyer().sequence_keys(request(ids=(1, 2, 4)), 2),
        "one more prompt id": keyer().sequence_keys(request(ids=(1, 2, 3, 3)), 2),
        "stop strings": keyer().sequence_keys(request(stop=("\n",)), 2),
        "output format": keyer().sequence_keys(request(fmt=ResponseFormat("regex", "[a-z]+")), 2),
        "another format": keyer().sequence_keys(request(fmt=ResponseFormat("regex", "[a-z]*")), 2),
        "seed": keyer().sequence_keys(request(seed=8), 2),
    }
    for part, keys in variants.items():
        assert keys is not None and not set(keys) & set(base), f"{part} does not change the key"
    assert len({k for keys in variants.values() for k in keys}) == 2 * len(variants)


def test_greedy_keys_ignore_seed_and_sample_index_and_unseeded_sampling_has_none():
    greedy = keyer(sampling={"do_sample": False})
    keys = greedy.sequence_keys(request(seed=None), 3)
    assert keys is not None and len(set(keys)) == 1  # greedy copies are one sequence
    assert keyer().sequence_keys(request(seed=None), 1) is None  # random draws: nothing to cache


def test_score_keys_hold_the_context_and_what_is_scored():
    k = keyer(sampling={})
    base = k.score_key([1, 2, 3], [[4], [5]], False)
    assert base == k.score_key([1, 2, 3], [[4], [5]], False)
    others = [k.score_key([1, 2, 4], [[4], [5]], False), k.score_key([1, 2, 3], [[4], [6]], False),
              k.score_key([1, 2, 3], [[5], [4]], False), k.score_key([1, 2, 3], [], True),
              keyer(model={"gguf": "00" * 32}, sampling={}).score_key([1, 2, 3], [[4], [5]], False)]
    assert base not in others and len(set(others)) == len(others)


NUMERICS = Numerics(batch_invariant=True, attention="per-sequence", linear="tiles", device="cpu", tp=1,
                    machine="AMD EPYC: avx512-bf16, torch AVX512", torch="2.13.0", transformers="5.23.0", cbgen="0.1")


def cache_of(tmp_path, numerics=NUMERICS, *, near=False, capture=False, max_new_tokens=8) -> ResultCache:
    return ResultCache(ResultStore(tmp_path), keyer(), numerics, near=near, max_bytes=10**9, num_return_sequences=1,
                       max_new_tokens=max_new_tokens, capture=capture)


def computed(cache: ResultCache, req: Request, tokens: list[int], finish: str, *, logprobs=None, top=None) -> None:
    """What the engine gives back for `req`, kept as a run keeps it."""
    cache.answer(req)
    cache.remember([Completion(req, 0, tokens, logprobs, finish, top_logprobs=top)])


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(Numerics)])
def test_other_numerics_make_a_near_hit_used_only_when_asked_for(tmp_path, field):
    computed(cache_of(tmp_path), request(), [5, 6, 7], "stop")
    changed = False if field == "batch_invariant" else 2 if field == "tp" else "other"
    other = dataclasses.replace(NUMERICS, **{field: changed})
    strict = cache_of(tmp_path, other)
    assert strict.answer(request()).answered is None
    assert strict.counts.near_hits_skipped == 1 and strict.counts.misses == 1
    lenient = cache_of(tmp_path, other, near=True)
    assert [c.token_ids for c in lenient.answer(request()).answered] == [[5, 6, 7]]
    assert lenient.counts.near_hits == 1 and lenient.counts.hits == 0
    same = cache_of(tmp_path)
    assert same.answer(request()).answered is not None and same.counts.hits == 1


def test_a_run_without_invariant_numerics_never_makes_exact_hits(tmp_path):
    loose = dataclasses.replace(NUMERICS, batch_invariant=False, linear="stock")
    computed(cache_of(tmp_path, loose), request(), [5, 6, 7], "stop")
    again = cache_of(tmp_path, loose)
    assert again.answer(request()).answered is None and again.counts.near_hits_skipped == 1


def test_a_grown_cap_takes_only_sequences_that_ended_and_a_smaller_one_cuts(tmp_path):
    computed(cache_of(tmp_path, max_new_tokens=4), request(ids=(1,)), [5, 6, 7, 8], "length")  # cut by its cap
    computed(cache_of(tmp_path, max_new_tokens=4), request(ids=(2,)), [5, 6, 2], "stop")  # ended on its own
    grown = cache_of(tmp_path, max_new_tokens=16)
    assert grown.answer(request(ids=(1,))).answered is None  # the old cap cut it: not the answer to 16
    ended = grown.answer(request(ids=(2,))).answered
    assert [(c.token_ids, c.finish_reason) for c in ended] == [([5, 6, 2], "stop")]
    smaller = cache_of(tmp_path, max_new_tokens=2)
    for ids in ((1,), (2,)):
        cut = smaller.answer(request(ids=ids)).answered
        assert [(c.token_ids, c.finish_reason, c.text) for c in cut] == [([5, 6], "length", None)]
    own_cap = cache_of(tmp_path, max_new_tokens=2).answer(request(ids=(1,), max_new_tokens=4)).answered
    assert [c.token_ids for c in own_cap] == [[5, 6, 7, 8]]  # a row's own cap counts, not the job's


def test_logprob_settings_decide_which_entries_serve(tmp_path):
    plain = cache_of(tmp_path, max_new_tokens=3)
    computed(plain, request(), [5, 6, 7], "length")
    assert cache_of(tmp_path, capture=True, max_new_tokens=3).answer(request()).answered is None  # no logprobs held
    top = [([5, 9, 4], [-0.1, -2.0, -3.0]), ([6, 1, 2], [-0.2, -2.5, -2.6]), ([7, 3, 8], [-0.3, -1.0, -4.0])]
    computed(cache_of(tmp_path, capture=True, max_new_tokens=3), request(top=3), [5, 6, 7], "length",
             logprobs=[-0.1, -0.2, -0.3], top=top)
    fewer = cache_of(tmp_path, capture=True, max_new_tokens=3).answer(request(top=2)).answered
    assert fewer[0].logprobs == [-0.1, -0.2, -0.3]
    assert fewer[0].top_logprobs == [(ids[:2], values[:2]) for ids, values in top]
    assert cache_of(tmp_path, capture=True, max_new_tokens=3).answer(request(top=4)).answered is None  # more wanted
    none = cache_of(tmp_path, max_new_tokens=3).answer(request()).answered
    assert none[0].logprobs is None and none[0].top_logprobs is None  # a job without logprobs gets none


def test_a_held_invariant_entry_is_not_written_over_by_a_loose_run(tmp_path):
    computed(cache_of(tmp_path), request(), [5, 6, 7], "stop")
    loose = cache_of(tmp_path, dataclasses.replace(NUMERICS, batch_invariant=False))
    computed(loose, request(), [5, 9, 9], "stop")
    assert loose.counts.stored == 0
    assert [c.token_ids for c in cache_of(tmp_path).answer(request()).answered] == [[5, 6, 7]]


def test_the_weights_identity_says_how_the_weights_compute():
    """int8 weights answer as the dequantized model and w8a8 ones otherwise: each names the weights apart from the
    float model's, and from each other's."""
    from types import SimpleNamespace

    from cbgen.model.source import resolve_source
    from cbgen.result_cache.keys import weights_identity

    source = resolve_source("random-weights:llama-1b")
    assert source.random_weights

    def identity(quantized):
        return weights_identity(SimpleNamespace(source=source, quantized=quantized), None)  # type: ignore[arg-type]

    names = [identity(None), identity({"quantized": "int8"}), identity({"quantized": "int8", "arithmetic": "w8a8"})]
    assert len({repr(n) for n in names}) == 3 and names[1] == names[0] | {"quantized": "int8"}
