"""Chat stages on the tiny model: listed user turns answered with the conversation so far (each reply the model's
greedy continuation, float32, as plain `model.generate` gives it), turns served from the KV cache's shared blocks, a
simulated user writing user turns from a template (opening the conversation when the row has no prompt), user_stop,
bad rows as error records beside good ones, seeded conversations the same in any batch, and the settings refused
before any model loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

import cbgen
from cbgen.cli import run_cli
from cbgen.rows import read_shards
from tests.helpers import write_jsonl

QUESTIONS = ["What is rain?", "Why is the sea salty?", "Name a bird.", "How far is the moon?", "Is tea hot?"]


def chat_stage(folder: Path, model: Path, rows: list[dict], **keys) -> Path:
    write_jsonl(folder / "in.jsonl", rows)
    stage = {"name": "talks", "kind": "chat", "input": "in.jsonl", "max_new_tokens": 8, **keys}
    path = folder / "pipeline.yaml"
    path.write_text(yaml.safe_dump({"defaults": {"model": str(model), "dtype": "float32"}, "stages": [stage]}))
    return path


def run(path: Path, out: Path, *extra: str, code: int = 0) -> dict[str, dict]:
    assert run_cli(["pipeline", str(path), "-o", str(out), "-q", *extra]) == code
    return {row["id"]: row for row in read_shards(out / "talks")}


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()
    return loaded, AutoTokenizer.from_pretrained(tiny_model_dir)


def greedy(model, ids: list[int], max_new: int) -> list[int]:
    net, tokenizer = model
    out = net.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False, top_k=None, top_p=None,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    return out[0, len(ids):].tolist()


def reference(model, users: list[str], max_new: int) -> list[dict]:
    """The conversation answered by plain `model.generate`, turn by turn: each prompt is the one before, its reply's
    own tokens (its end token left out) and the template's text that follows, up to the next generation prompt."""
    _, tokenizer = model
    messages: list[dict] = []
    ids: list[int] = []
    rendered = ""
    for user in users:
        messages.append({"role": "user", "content": user})
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = ids + tokenizer(text[len(rendered):], add_special_tokens=False)["input_ids"]
        reply = greedy(model, ids, max_new)
        body = reply[:-1] if reply and reply[-1] == tokenizer.eos_token_id else reply
        content = tokenizer.decode(reply, skip_special_tokens=True)
        assert tokenizer.decode(body) == content  # random weights draw no other special token here
        messages.append({"role": "assistant", "content": content})
        ids, rendered = ids + body, text + content
    return messages


def test_listed_turns_are_answered_as_model_generate_answers_each(tiny_model_dir, model, tmp_path):
    rows = [{"id": f"q{i}", "turns": QUESTIONS[i:i + 1 + i % 3]} for i in range(len(QUESTIONS))]
    rows.append({"id": "opened", "prompt": "Hello there.", "turns": ["And then?"]})
    out = run(chat_stage(tmp_path, tiny_model_dir, rows, user_turns_column="turns", max_turns=2, page_size=16),
              tmp_path / "out")
    assert set(out) == {row["id"] for row in rows}
    for row in rows:
        users = ([row["prompt"]] if "prompt" in row else []) + row["turns"]
        got = out[row["id"]]
        expected = reference(model, users[:2], 8)
        assert got["messages"] == expected, row["id"]
        assert got["num_turns"] == len(expected) // 2
        assert got["finish_reason"] == ("max_turns" if len(users) > 2 else "user_turns")
        assert [t["role"] for t in got["turns"]] == ["assistant"] * got["num_turns"]
        assert got["num_generated_tokens"] == sum(t["num_generated_tokens"] for t in got["turns"])
    # each later turn found the turn before in the KV cache: every block of its prompt and reply but the last
    second = [t for r in out.values() for t in r["turns"][1:]]
    assert second and all(t["num_cached_tokens"] >= 16 for t in second)
    manifest = json.loads((tmp_path / "out" / "talks" / "run.json").read_text())
    assert manifest["counts"]["cached_prompt_tokens"] == sum(r["num_cached_tokens"] for r in out.values()) > 0
    assert manifest["counts"]["turns"] == sum(r["num_turns"] for r in out.values())


USER_TEMPLATE = ("{% if messages %}Ask about {{ topic }} again, after: {{ messages[-1].content }}"
                 "{% else %}Ask a question about {{ topic }}.{% endif %}")


def test_a_simulated_user_writes_the_user_turns(tiny_model_dir, model, tmp_path):
    rows = [{"id": "a", "topic": "owls"}, {"id": "b", "topic": "tea", "prompt": "Tell me about tea."}]
    out = run(chat_stage(tmp_path, tiny_model_dir, rows, user_template=USER_TEMPLATE, user_system="You ask.",
                         user_max_new_tokens=6, max_turns=2), tmp_path / "out")
    _, tokenizer = model
    opened = out["a"]  # no prompt: the simulated user opens
    assert [m["role"] for m in opened["messages"]] == ["user", "assistant", "user", "assistant"]
    assert [t["role"] for t in opened["turns"]] == ["user", "assistant", "user", "assistant"]
    prompt = tokenizer.apply_chat_template([{"role": "system", "content": "You ask."},
                                            {"role": "user", "content": "Ask a question about owls."}],
                                           add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    first = greedy(model, list(prompt), 6)
    assert opened["messages"][0]["content"] == tokenizer.decode(first, skip_special_tokens=True).strip()
    assert opened["turns"][0]["num_generated_tokens"] == len(first) <= 6
    prompted = out["b"]  # the row's prompt opens; the simulated user follows the reply
    assert prompted["messages"][0] == {"role": "user", "content": "Tell me about tea."}
    assert [t["role"] for t in prompted["turns"]] == ["assistant", "user", "assistant"]
    assert prompted["finish_reason"] == "max_turns" and prompted["num_turns"] == 2


def test_user_stop_ends_a_conversation_without_its_message(tiny_model_dir, tmp_path):
    rows = [{"id": "a", "topic": "owls", "prompt": "Hi."}]
    out = run(chat_stage(tmp_path, tiny_model_dir, rows, user_template=USER_TEMPLATE, user_stop="(?s).*",
                         max_turns=3), tmp_path / "out")
    talk = out["a"]
    assert talk["finish_reason"] == "user_stop"
    assert [m["role"] for m in talk["messages"]] == ["user", "assistant"]  # the stopping message left out
    assert [t["role"] for t in talk["turns"]] == ["assistant", "user"]


def test_bad_rows_are_error_records_and_the_good_ones_talk(tiny_model_dir, tmp_path):
    rows = [{"id": "good", "turns": ["Hi."]}, {"id": "not-a-list", "turns": "Hi."},
            {"id": "empty", "turns": []}, {"id": "blank", "turns": ["Hi.", " "]},
            {"id": "too-long", "turns": ["word " * 400]}]
    out = run(chat_stage(tmp_path, tiny_model_dir, rows, user_turns_column="turns"), tmp_path / "out", code=1)
    assert out["good"]["error"] is None and out["good"]["num_turns"] == 1
    for bad, says in (("not-a-list", "must be a list of strings"), ("empty", "nothing opens the conversation"),
                      ("blank", "item 1 is an empty string"), ("too-long", "")):
        assert out[bad]["finish_reason"] == "error" and says in out[bad]["error"], out[bad]
    assert out["not-a-list"]["turns"] == [] and out["too-long"]["messages"][0]["role"] == "user"


def test_seeded_conversations_are_the_same_in_any_batch(tiny_model_dir, tmp_path):
    rows = [{"id": f"t{i}", "topic": topic} for i, topic in enumerate(["owls", "tea", "rain", "ink", "salt", "bees"])]
    keys = {"user_template": USER_TEMPLATE, "max_turns": 2, "temperature": 0.9, "seed": 3, "user_temperature": 1.2}
    together = run(chat_stage(tmp_path, tiny_model_dir, rows, **keys), tmp_path / "together")
    (tmp_path / "shuffled").mkdir()
    apart = run(chat_stage(tmp_path / "shuffled", tiny_model_dir, rows[::-1], **keys, max_in_flight=1,
                           max_requests_per_batch=1), tmp_path / "apart")
    assert {k: v["messages"] for k, v in together.items()} == {k: v["messages"] for k, v in apart.items()}
    other = run(chat_stage(tmp_path, tiny_model_dir, rows, **(keys | {"seed": 4})), tmp_path / "other")
    assert {k: v["messages"] for k, v in other.items()} != {k: v["messages"] for k, v in together.items()}


@pytest.mark.parametrize(("keys", "says"), [
    ({}, "give user_turns_column"),
    ({"user_turns_column": "turns", "user_template": "x"}, "not both"),
    ({"user_turns_column": "turns", "user_stop": "x"}, "user_stop applies to the simulated user"),
    ({"user_template": "{% if %}"}, "user_template: template syntax error at line 1"),
    ({"user_template": "x", "user_stop": "("}, "a regular expression"),
    ({"user_turns_column": "turns", "num_return_sequences": 2}, "does not apply to a chat stage"),
    ({"user_turns_column": "turns", "max_turns": 0}, "a positive integer"),
])
def test_settings_that_cannot_work_stop_before_any_model_loads(tmp_path, capsys, keys, says):
    path = chat_stage(tmp_path, tmp_path / "no-model-here", [{"turns": ["Hi."]}], **keys)
    assert run_cli(["pipeline", str(path), "-o", str(tmp_path / "out"), "--check"]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_the_pipeline_dict_runs_a_chat_stage_and_a_later_stage_reads_its_messages(tiny_model_dir, tmp_path):
    write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "turns": ["Hi.", "More?"]}])
    spec = {"defaults": {"model": str(tiny_model_dir), "dtype": "float32", "max_new_tokens": 4},
            "stages": [{"name": "talks", "kind": "chat", "input": str(tmp_path / "in.jsonl"),
                        "user_turns_column": "turns"},
                       {"name": "rated", "kind": "score", "input": "talks", "prompt_column": "talks.messages",
                        "choices": ["1", "2"]}]}
    report = cbgen.pipeline(spec, tmp_path / "out", progress=False)
    assert report.exit_code == 0
    rated = list(read_shards(tmp_path / "out" / "rated"))
    assert len(rated) == 1 and rated[0]["error"] is None and rated[0]["num_prompt_tokens"] > 20


def test_a_rerun_takes_every_turn_from_the_result_cache(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("CBGEN_RESULT_CACHE", raising=False)  # the suite turns the cache off; this test names one
    rows = [{"id": f"t{i}", "topic": topic} for i, topic in enumerate(["owls", "tea", "rain"])]
    path = chat_stage(tmp_path, tiny_model_dir, rows, user_template=USER_TEMPLATE, max_turns=2, temperature=0.9,
                      seed=3)
    store = str(tmp_path / "results")
    first = run(path, tmp_path / "first", "--cache", store)
    again = run(path, tmp_path / "again", "--cache", store)
    assert {k: v["messages"] for k, v in again.items()} == {k: v["messages"] for k, v in first.items()}
    counts = json.loads((tmp_path / "again" / "talks" / "run.json").read_text())["counts"]
    assert counts["result_cache_hits"] == sum(len(v["turns"]) for v in first.values()) and counts["turns"] == 0
