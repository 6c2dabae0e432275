"""Logprobs and top logprobs are the model's own log-softmax, before temperature, top-k, top-p and any format:
what OpenAI reports, and the same whatever the request's sampling settings."""

from __future__ import annotations

import json

import pytest
import torch

from cbgen.cli import run_cli
from cbgen.rows import read_shards
from tests.helpers import write_jsonl

PROMPTS = ["Hello!", "Name three rivers.", "Write about dragons."]


def run(tiny_model_dir, path, out, *args) -> int:
    return run_cli(["run", str(path), "-o", str(out), "--model", str(tiny_model_dir), "--dtype", "float32", "-q",
                    "--raw-prompts", *map(str, args)])


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(tiny_model_dir))


def own_logprobs(model, prompt_ids: list[int], tokens: list[int]) -> torch.Tensor:
    """The model's log-softmax over the vocabulary at each generated position."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + tokens])).logits[0]
    return torch.log_softmax(logits[len(prompt_ids) - 1 : -1].float(), dim=-1)


@pytest.mark.parametrize("sampling", [[], ["--temperature", "0.3", "--top-k", "5", "--seed", "4"]])
def test_logprobs_are_the_models_own(tiny_model_dir, model, tmp_path, sampling):
    path = write_jsonl(tmp_path / "p.jsonl", [{"id": f"q{i}", "prompt": p} for i, p in enumerate(PROMPTS)])
    assert run(tiny_model_dir, path, tmp_path / "out", "--max-new-tokens", 6, "--logprobs", "--top-logprobs", 3,
               *sampling) == 0
    lm, tokenizer = model
    for i, row in enumerate(sorted(read_shards(tmp_path / "out"), key=lambda r: r["id"])):
        ids = tokenizer(PROMPTS[i])["input_ids"]
        reference = own_logprobs(lm, ids, row["token_ids"])
        chosen = reference.gather(1, torch.tensor(row["token_ids"])[:, None])[:, 0]
        assert row["logprobs"] == pytest.approx(chosen.tolist(), abs=1e-4)
        assert len(row["top_logprobs"]) == len(row["token_ids"])
        for position, (token, top) in enumerate(zip(row["token_ids"], row["top_logprobs"])):
            values, best = torch.topk(reference[position], 3)
            assert [e["token_id"] for e in top] == best.tolist()
            assert [e["logprob"] for e in top] == pytest.approx(values.tolist(), abs=1e-4)
            assert all(a["logprob"] >= b["logprob"] for a, b in zip(top, top[1:]))  # most likely first
            assert all(e["token"] == tokenizer.decode([e["token_id"]]) for e in top)
            if not sampling:
                assert top[0]["token_id"] == token  # greedy picks the most likely
        if sampling:  # the draws come from the top 5 at temperature 0.3, yet their logprobs are the raw ones
            assert all(lp < 0 for lp in row["logprobs"])


def test_a_rows_own_top_logprobs(tiny_model_dir, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "one", "top_logprobs": 2},
                                             {"id": "b", "prompt": "two"}])
    assert run(tiny_model_dir, path, tmp_path / "out", "--max-new-tokens", 3) == 0
    rows = {r["id"]: r for r in read_shards(tmp_path / "out")}
    assert [len(p) for p in rows["a"]["top_logprobs"]] == [2, 2, 2] and len(rows["a"]["logprobs"]) == 3
    assert rows["b"]["top_logprobs"] is None and rows["b"]["logprobs"] is None


def test_openai_logprobs_and_top_logprobs(tiny_model_dir, tmp_path):
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    lines = [
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions", "body": {
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "logprobs": True, "top_logprobs": 3,
            "temperature": 0}},
        {"custom_id": "cmpl", "method": "POST", "url": "/v1/completions", "body": {
            "prompt": "Once upon a time", "max_tokens": 4, "logprobs": 2, "temperature": 0}},
        {"custom_id": "warm", "method": "POST", "url": "/v1/completions", "body": {
            "prompt": "Twice", "max_tokens": 4, "temperature": 0.8}},
    ]
    path = write_jsonl(tmp_path / "batch.jsonl", lines)
    assert run(tiny_model_dir, path, tmp_path / "out", "--output-format", "openai") == 0
    bodies = {e["custom_id"]: e["response"]["body"] for e in map(json.loads,
                                                                 next((tmp_path / "out").glob("*.jsonl")).open())}
    chat = ChatCompletion.model_validate(bodies["chat"]).choices[0].logprobs
    assert len(chat.content) == 4 and all(len(c.top_logprobs) == 3 for c in chat.content)
    assert all(c.top_logprobs[0].token == c.token for c in chat.content)  # greedy
    completion = Completion.model_validate(bodies["cmpl"]).choices[0].logprobs
    assert len(completion.top_logprobs) == 4 and all(len(t) == 2 for t in completion.top_logprobs)
    # greedy lines inside a sampling job used to report 0.0 for every token (the logprob of top-k 1)
    assert all(lp < 0 for lp in completion.token_logprobs)
