"""On the embedded SmolLM2 model (its real tokenizer, chat template and weights), in float32: every scored token's
logprob through `cbgen score` equals an independent forward pass of the model over the whole sequence, within 1e-4;
and a 1-5 label judged by choice logprobs is the label the model itself ranks first."""

from __future__ import annotations

import pytest
import torch

from cbgen.cli import run_cli
from cbgen.rows import read_shards
from tests.helpers import write_jsonl

pytestmark = pytest.mark.embedded

ROWS = [
    {"id": "chat", "messages": [{"role": "user", "content": "What is the capital of France?"}],
     "completion": "The capital of France is Paris."},
    {"id": "doc", "text": "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen."},
    {"id": "judge", "prompt": "Rate from 1 to 5 how true this is: the sun is cold.", "choices": list("12345")},
]


def test_scores_equal_an_independent_forward_of_the_embedded_model(tmp_path):
    from cbgen.config import ModelSection
    from cbgen.model.load import load_model

    rows_file = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    out = tmp_path / "out"
    assert run_cli(["score", str(rows_file), "-o", str(out), "--dtype", "float32", "--logprobs", "-q"]) == 0
    rows = {row["id"]: row for row in read_shards(out)}

    loaded = load_model(ModelSection(dtype="float32"))
    model, tokenizer = loaded.model, loaded.tokenizer

    @torch.inference_mode()
    def logprobs(sequence: list[int]) -> torch.Tensor:
        return model(input_ids=torch.tensor([sequence])).logits[0].float().log_softmax(-1)

    prompt = tokenizer.apply_chat_template(ROWS[0]["messages"], add_generation_prompt=True, tokenize=True,
                                           return_dict=True)["input_ids"]
    completion = tokenizer(ROWS[0]["completion"], add_special_tokens=False)["input_ids"]
    sequence = list(prompt) + list(completion)
    table = logprobs(sequence)
    expected = [float(table[p - 1, sequence[p]]) for p in range(len(prompt), len(sequence))]
    assert rows["chat"]["token_ids"] == completion
    assert max(abs(a - b) for a, b in zip(rows["chat"]["logprobs"], expected)) <= 1e-4

    text = tokenizer(ROWS[1]["text"])["input_ids"]
    table = logprobs(text)
    expected = [float(table[p - 1, text[p]]) for p in range(1, len(text))]
    assert max(abs(a - b) for a, b in zip(rows["doc"]["logprobs"], expected)) <= 1e-4

    judge = rows["judge"]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": ROWS[2]["prompt"]}],
                                           add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    sums = []
    for label in ROWS[2]["choices"]:
        label_ids = tokenizer(label, add_special_tokens=False)["input_ids"]
        sequence = list(prompt) + list(label_ids)
        table = logprobs(sequence)
        sums.append(sum(float(table[p - 1, sequence[p]]) for p in range(len(prompt), len(sequence))))
    assert judge["choice_logprobs"] == pytest.approx(sums, abs=1e-4)
    assert judge["best_choice"] == ROWS[2]["choices"][sums.index(max(sums))]
