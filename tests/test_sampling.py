"""Sampling, end to end: the tokens a real job draws follow the softmax of the model's logits after temperature, top-k
and top-p, as transformers' own warpers compute it. A chi-square test over many draws of one prompt's first token,
seeded and unseeded; and the same draws against the softmax of near misses (the unprocessed logits, and each setting
a little off: temperature by a fifth, top-k by a few tokens, top-p by 0.1), each of which the test must reject: so it
would catch a sampler that got one setting slightly wrong."""

from __future__ import annotations

import functools
import math
from collections import Counter

import pytest
import torch

from cbgen.cli import run_cli
from cbgen.rows import read_shards
from tests.helpers import write_jsonl

DRAWS = 3000
TEMPERATURE, TOP_K, TOP_P = 0.7, 12, 0.9
ALPHA_Z = 3.09  # the standard normal's upper 0.001 quantile: the test rejects a right sampler once in a thousand


@pytest.fixture(scope="module")
def sharp_model(tiny_model_dir, tmp_path_factory):
    """The tiny model with its output projection scaled up, so that its next-token distribution is far from uniform
    and temperature, top-k and top-p each change it measurably."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path_factory.mktemp("sharp")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)  # logits' spread about 1.6: top-k keeps 12 tokens, top-p 10 of them
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(folder)
    return folder


def chi_square_critical(df: int, z: float = ALPHA_Z) -> float:
    """Wilson and Hilferty's approximation of the chi-square quantile (within 2 % at df 3, 1 % from df 10)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi_square(counts: Counter[int], probabilities: dict[int, float], draws: int) -> tuple[float, int]:
    """The statistic and degrees of freedom, over the tokens expected at least 5 times and one bin for the rest."""
    bins = {t for t, p in probabilities.items() if p * draws >= 5}
    observed = [counts.get(t, 0) for t in bins] + [draws - sum(counts.get(t, 0) for t in bins)]
    expected = [probabilities[t] * draws for t in bins] + [draws * (1 - sum(probabilities[t] for t in bins))]
    kept = [(o, e) for o, e in zip(observed, expected) if e > 0]
    unexpected = sum(o for o, e in zip(observed, expected) if e <= 0)
    assert unexpected == 0, f"{unexpected} draws fell outside the tokens the processed softmax allows"
    return sum((o - e) ** 2 / e for o, e in kept), len(kept) - 1


@functools.cache
def _last_logits(model_dir: str, prompt_ids: tuple[int, ...]) -> torch.Tensor:
    """The model's logits after `prompt_ids` (loaded once for every reference of the module)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([prompt_ids])).logits[:, -1].float()


def reference(model_dir, prompt_ids: list[int], processed: bool, temperature: float = TEMPERATURE,
              top_k: int = TOP_K, top_p: float = TOP_P) -> dict[int, float]:
    """The next-token distribution of the model for `prompt_ids`: after transformers' own temperature, top-k and
    top-p warpers (in generate's order), or the plain softmax."""
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    ids = torch.tensor([prompt_ids])
    logits = _last_logits(str(model_dir), tuple(prompt_ids)).clone()
    if processed:
        warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature), TopKLogitsWarper(top_k),
                                       TopPLogitsWarper(top_p)])
        logits = warpers(ids, logits)
    probabilities = torch.softmax(logits, dim=-1)[0]
    return {int(t): float(p) for t, p in enumerate(probabilities) if p > 0}


@pytest.mark.slow
@pytest.mark.parametrize("seed", [["--seed", "20261201"], []], ids=["seeded", "unseeded"])
def test_draws_follow_the_processed_softmax(sharp_model, tmp_path, seed):
    """Seeded draws (cbgen's own, from each request's seed) and unseeded ones (the engine's sampler)."""
    rows = [{"id": f"s{i}", "prompt": "The colour of the sea is"} for i in range(DRAWS)]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    out = tmp_path / "out"
    assert run_cli(["run", str(path), "-o", str(out), "--model", str(sharp_model), "--dtype", "float32",
                    "--max-new-tokens", "1", "--temperature", str(TEMPERATURE), "--top-k", str(TOP_K),
                    "--top-p", str(TOP_P), *seed, "--max-in-flight", "256", "-q"]) == 0
    drawn = list(read_shards(out))
    assert len(drawn) == DRAWS
    prompt_ids = drawn[0]["num_prompt_tokens"]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(sharp_model)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": rows[0]["prompt"]}], add_generation_prompt=True,
                                        tokenize=True, return_dict=True)["input_ids"]
    assert len(ids) == prompt_ids  # the job rendered the prompt as this reference does
    counts = Counter(row["token_ids"][0] for row in drawn)

    processed = reference(sharp_model, ids, processed=True)
    assert 3 <= len(processed) <= TOP_K  # the warpers cut the vocabulary down: the test is about something
    statistic, df = chi_square(counts, processed, DRAWS)
    assert statistic < chi_square_critical(df), f"chi-square {statistic:.1f} over {df} degrees of freedom"

    near_misses = {
        "the plain softmax": reference(sharp_model, ids, processed=False),  # a sampler ignoring the settings
        "temperature 0.56": reference(sharp_model, ids, processed=True, temperature=TEMPERATURE * 0.8),
        "temperature 0.84": reference(sharp_model, ids, processed=True, temperature=TEMPERATURE * 1.2),
        "top-k 8": reference(sharp_model, ids, processed=True, top_k=TOP_K - 4),
        "top-p 0.8": reference(sharp_model, ids, processed=True, top_p=TOP_P - 0.1),
    }
    for name, wrong in near_misses.items():
        assert wrong != processed, f"{name} is the processed softmax itself: no near miss"
        statistic, df = chi_square(counts, wrong, DRAWS) if set(counts) <= set(wrong) else (math.inf, 1)
        assert statistic > chi_square_critical(df), f"the test cannot tell the processed softmax from {name}"


def test_the_critical_values_are_the_tables():
    """Wilson-Hilferty against the printed 0.999 quantiles: 16.27 (df 3), 29.59 (df 10), 45.31 (df 20)."""
    for df, table, within in ((3, 16.27, 0.02), (10, 29.59, 0.01), (20, 45.31, 0.01)):
        assert abs(chi_square_critical(df) - table) / table < within
