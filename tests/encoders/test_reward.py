"""Reward stages on tiny random sequence classifiers made here: a one-output reward model (a Llama read through
its chat template) and a three-label BERT classifier (texts), each row equal to a plain forward pass of the model
over that row alone (float32, 1e-4), probabilities that sum to one, the best label named, bad rows as error
records."""

from __future__ import annotations

import json

import pytest
import torch

import cbgen
from cbgen.rows import read_shards
from tests.encoders.test_embed import texts
from tests.helpers import write_jsonl


@pytest.fixture(scope="module")
def reward_model(tiny_model_dir, tmp_path_factory):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    folder = tmp_path_factory.mktemp("reward")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.save_pretrained(folder)
    config = LlamaConfig.from_pretrained(tiny_model_dir, num_labels=1)
    torch.manual_seed(3)
    model = LlamaForSequenceClassification(config).eval()
    model.save_pretrained(folder)
    return folder, model, tokenizer


def test_a_reward_model_rates_each_conversation_as_a_plain_forward_does(tmp_path, reward_model):
    folder, model, tokenizer = reward_model
    questions, answers = texts(12, seed=6, longest=20), texts(12, seed=7, longest=40)
    rows = [{"id": f"p{i}", "prompt": q, "completion": a} for i, (q, a) in enumerate(zip(questions, answers))]
    rows += [{"id": f"m{i}", "messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
             for i, (q, a) in enumerate(zip(questions[:4], answers[4:8]))]
    rows += [{"id": "bad", "messages": "not a list"}]
    stage = {"name": "rated", "kind": "reward", "input": str(write_jsonl(tmp_path / "in.jsonl", rows)),
             "model": str(folder), "dtype": "float32"}
    cbgen.pipeline({"stages": [stage]}, tmp_path / "out", progress=False)
    found = {row["id"]: row for row in read_shards(tmp_path / "out" / "rated")}
    assert found["bad"]["reward"] is None and found["bad"]["error"]
    for row in rows[:-1]:
        messages = row.get("messages") or [{"role": "user", "content": row["prompt"]},
                                           {"role": "assistant", "content": row["completion"]}]
        ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
        with torch.inference_mode():
            expected = float(model(input_ids=torch.tensor([ids])).logits[0, 0])
        assert found[row["id"]]["num_tokens"] == len(ids)
        assert found[row["id"]]["reward"] == pytest.approx(expected, abs=1e-4)
    run = json.loads((tmp_path / "out" / "rated" / "run.json").read_text())
    assert run["counts"]["succeeded"] == len(rows) - 1 and run["counts"]["failed"] == 1


def test_a_classifier_gives_each_label_its_probability(tmp_path):
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from cbgen.model.source import embedded_embedder_path

    folder = tmp_path / "classifier"
    tokenizer = AutoTokenizer.from_pretrained(embedded_embedder_path())
    tokenizer.save_pretrained(folder)
    labels = {0: "Negative", 1: "neutral", 2: "POSITIVE!"}
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, num_labels=3, id2label=labels, label2id={v: k for k, v in labels.items()})
    torch.manual_seed(4)
    model = BertForSequenceClassification(config).eval()
    model.save_pretrained(folder)
    sentences = texts(20, seed=8)
    rows = [{"id": f"t{i}", "text": t} for i, t in enumerate(sentences)]
    stage = {"name": "classified", "kind": "reward", "input": str(write_jsonl(tmp_path / "in.jsonl", rows)),
             "model": str(folder), "dtype": "float32", "batch_tokens": 128}
    cbgen.pipeline({"stages": [stage]}, tmp_path / "out", progress=False)
    found = {row["id"]: row for row in read_shards(tmp_path / "out" / "classified")}
    for i, text in enumerate(sentences):
        with torch.inference_mode():
            probs = model(**tokenizer(text, return_tensors="pt")).logits[0].softmax(-1).tolist()
        row = found[f"t{i}"]
        got = [row["negative"], row["neutral"], row["positive"]]
        assert got == pytest.approx(probs, abs=1e-4)
        assert sum(got) == pytest.approx(1.0, abs=1e-5)
        assert row["label"] == labels[max(range(3), key=probs.__getitem__)]
