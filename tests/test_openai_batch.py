"""OpenAI Batch API files in and out: a file made for OpenAI's batch service runs unchanged, and every output line
parses with the `openai` package's own response types."""

from __future__ import annotations

import json

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion
from openai.types.shared import ErrorObject

from cbgen.cli import run_cli
from cbgen.inputs import open_reader
from cbgen.inputs.openai import OpenAIBatchReader
from cbgen.rows import read_shards
from tests.helpers import read_jsonl, write_jsonl


def line(custom_id, url, body, **extra):
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body, **extra}


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
BATCH = [
    line("chat-greedy", CHAT, {"model": "gpt-4o-mini", "temperature": 0, "max_tokens": 6, "logprobs": True,
                               "messages": [{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": "Name a colour."}]}),
    line("chat-parts", CHAT, {"model": "gpt-4o-mini", "max_completion_tokens": 5, "seed": 7,
                              "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi "},
                                                                         {"type": "text", "text": "there"}]}]}),
    line("cmpl-n2", COMPLETIONS, {"model": "gpt-3.5-turbo-instruct", "prompt": "Once upon a time", "max_tokens": 4,
                                  "temperature": 0.9, "n": 2, "frequency_penalty": 0.5, "best_of": 2}),
    line("cmpl-ids", COMPLETIONS, {"model": "m", "prompt": [1, 2, 3, 4], "max_tokens": 3, "temperature": 0}),
    '{"custom_id": "broken", "method": "POST", "url": ',  # malformed JSON
    line("bad-url", "/v1/embeddings", {"model": "m", "input": "x"}),
    line("bad-temp", CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": -1}),
    line("image", CHAT, {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}),
]


def run(tiny_model_dir, *args) -> int:
    return run_cli(["run", *map(str, args), "--model", str(tiny_model_dir), "--dtype", "float32", "-q"])


@pytest.fixture(scope="module")
def batch_run(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("openai")
    path = write_jsonl(tmp / "batch.jsonl", BATCH)
    out = tmp / "out"
    code = run(tiny_model_dir, path, "-o", out, "--output-format", "openai", "--seed", 3)
    return code, out, read_jsonl(next(out.glob("part-*.jsonl")))


def test_batch_file_is_detected_and_read(tmp_path):
    path = write_jsonl(tmp_path / "batch.jsonl", BATCH)
    reader = open_reader(path)
    assert isinstance(reader, OpenAIBatchReader)
    records = {r.id: r for r in reader}
    chat = records["chat-greedy"]
    assert chat.messages[1] == {"role": "user", "content": "Name a colour."} and chat.endpoint == CHAT
    assert chat.settings == {"temperature": 0.0, "max_new_tokens": 6, "logprobs": True}
    assert records["chat-parts"].messages == [{"role": "user", "content": "Hi there"}]
    assert records["chat-parts"].settings == {"max_new_tokens": 5, "seed": 7}  # max_completion_tokens; its seed
    completion = records["cmpl-n2"]
    assert completion.prompt == "Once upon a time" and completion.raw is True
    assert completion.settings == {"temperature": 0.9, "max_new_tokens": 4, "n": 2, "frequency_penalty": 0.5}
    assert records["cmpl-ids"].input_ids == [1, 2, 3, 4]
    assert records["4"].error.startswith("invalid JSON")  # the malformed line keeps its place, by row number
    assert "'url' must be /v1/chat/completions or /v1/completions" in records["bad-url"].error
    assert records["bad-temp"].error == "'body.temperature' must be a number >= 0 (0 = greedy), got -1"
    assert "non-text content parts" in records["image"].error
    assert reader.notices == {
        "body field 'model' does not apply: cbgen answers with its --model (or the job's adapter of that name: "
                                     "--adapter NAME=PATH)": 5,  # lines rejected earlier: not seen
    }


def test_output_lines_parse_with_the_openai_types(batch_run):
    code, out, lines = batch_run
    assert code == 1  # some requests failed
    by_id = {entry["custom_id"]: entry for entry in lines}
    assert sorted(by_id) == sorted(["chat-greedy", "chat-parts", "cmpl-n2", "cmpl-ids", "4", "bad-url", "bad-temp",
                                    "image"])
    for entry in lines:
        assert set(entry) == {"id", "custom_id", "response", "error"} and entry["id"].startswith("batch_req_")
        response = entry["response"]
        assert set(response) == {"status_code", "request_id", "body"}
        if response["status_code"] == 200:
            kind = ChatCompletion if response["body"]["object"] == "chat.completion" else Completion
            kind.model_validate(response["body"], strict=False)
        else:
            assert response["status_code"] == 400
            error = ErrorObject.model_validate(response["body"]["error"])
            assert error.type == "invalid_request_error" and "batch.jsonl:" in error.message

    chat = ChatCompletion.model_validate(by_id["chat-greedy"]["response"]["body"])
    assert chat.object == "chat.completion" and len(chat.choices) == 1
    choice = chat.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert len(choice.logprobs.content) == chat.usage.completion_tokens <= 6
    assert "".join(t.token for t in choice.logprobs.content).startswith(choice.message.content)
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens

    completion = Completion.model_validate(by_id["cmpl-n2"]["response"]["body"])
    assert completion.object == "text_completion" and [c.index for c in completion.choices] == [0, 1]
    assert all(c.logprobs is None for c in completion.choices)  # not asked for
    assert by_id["bad-url"]["response"]["body"]["error"]["message"].endswith("got '/v1/embeddings'")


def test_completions_prompt_is_not_wrapped_in_the_chat_template(batch_run, tiny_model_dir):
    from transformers import AutoTokenizer

    _, _, lines = batch_run
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    body = next(e for e in lines if e["custom_id"] == "cmpl-n2")["response"]["body"]
    assert body["usage"]["prompt_tokens"] == len(tokenizer("Once upon a time")["input_ids"])


def test_greedy_request_in_a_sampling_job_gives_the_greedy_tokens(batch_run, tiny_model_dir, tmp_path):
    """cmpl-ids asks for temperature 0 while cmpl-n2 samples: it must get exactly the greedy tokens."""
    _, _, lines = batch_run
    sampled_job = next(e for e in lines if e["custom_id"] == "cmpl-ids")["response"]["body"]["choices"][0]["text"]
    alone = write_jsonl(tmp_path / "alone.jsonl", [line("cmpl-ids", COMPLETIONS,
                                                        {"prompt": [1, 2, 3, 4], "max_tokens": 3})])
    assert run(tiny_model_dir, alone, "-o", tmp_path / "o", "--output-format", "openai") == 0
    greedy = read_jsonl(next((tmp_path / "o").glob("part-*.jsonl")))[0]["response"]["body"]["choices"][0]["text"]
    assert sampled_job == greedy


def test_resume_status_and_merge_read_openai_lines(batch_run, tiny_model_dir, tmp_path, monkeypatch, capsys):
    _, out, lines = batch_run
    rows = list(read_shards(out))  # as cbgen rows: one per choice, one per failed request
    assert sorted((r["id"], r["sample_index"]) for r in rows if r["id"] == "cmpl-n2") == [("cmpl-n2", 0),
                                                                                         ("cmpl-n2", 1)]
    assert sum(r["finish_reason"] == "error" for r in rows) == 4
    # a rerun finds everything done and does not load the model
    path = write_jsonl(tmp_path / "batch.jsonl", BATCH)
    monkeypatch.setattr("cbgen.model.load.load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    assert run(tiny_model_dir, path, "-o", out, "--output-format", "openai", "--seed", 3) == 1
    assert json.loads((out / "run.json").read_text())["counts"]["requests"] == len(lines)
    # status counts the lines' requests, done and failed
    capsys.readouterr()
    assert run_cli(["status", str(out), "--json"]) == 1  # some requests failed
    status = json.loads(capsys.readouterr().out)
    assert (status["done"], status["failed"], status["remaining"]) == (len(lines), 4, 0)
    # and --to-dataset (a job that was not split) takes the lines as they are
    assert run_cli(["merge", str(out), "--to-dataset", "-o", str(tmp_path / "ds")]) == 0
    import datasets

    dataset = datasets.load_from_disk(str(tmp_path / "ds"))
    assert sorted(dataset["custom_id"]) == sorted(entry["custom_id"] for entry in lines)


@pytest.mark.slow
def test_openai_lines_split_and_merge(tiny_model_dir, tmp_path):
    path = write_jsonl(tmp_path / "batch.jsonl", [
        line(f"q{i}", CHAT, {"messages": [{"role": "user", "content": f"Count to {i}"}], "max_tokens": 3})
        for i in range(6)
    ])
    out = tmp_path / "out"
    for shard in (0, 1):
        assert run(tiny_model_dir, path, "-o", out, "--output-format", "openai", "--num-shards", 2,
                   "--shard-index", shard) == 0
    assert run_cli(["merge", str(out)]) == 0
    merged = [e for f in sorted((out / "merged").glob("part-*.jsonl")) for e in read_jsonl(f)]
    assert sorted(e["custom_id"] for e in merged) == [f"q{i}" for i in range(6)]
    assert all(ChatCompletion.model_validate(e["response"]["body"]) for e in merged)


def test_keep_columns_refused_with_openai_output(tiny_model_dir, tmp_path, capsys):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x", "tag": 1}])
    assert run(tiny_model_dir, path, "-o", tmp_path / "o", "--output-format", "openai", "--keep-columns", "tag") == 2
    assert "--keep-columns does not apply to --output-format openai" in capsys.readouterr().err


def test_lines_asking_what_cannot_be_honoured_are_refused_with_the_reason(tmp_path):
    ask = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    lines = [line("best-of", CHAT, ask | {"best_of": 3, "n": 1}),
             line("best-of-n", CHAT, ask | {"best_of": 2, "n": 2}),
             line("audio", CHAT, ask | {"modalities": ["text", "audio"]}),
             line("text-only", CHAT, ask | {"modalities": ["text"], "stream": False,
                                            "prediction": {"type": "content"}}),
             line("unknown", CHAT, ask | {"foo": 1}),
             line("unset", CHAT, ask | {"verbosity": None})]
    records = {r.id: r for r in open_reader(write_jsonl(tmp_path / "batch.jsonl", lines))}
    assert "body field 'best_of' cannot be honoured (cbgen returns every sequence" in records["best-of"].error
    assert "body field 'modalities' cannot be honoured (cbgen runs text models" in records["audio"].error
    assert "body field 'foo' cannot be honoured (cbgen does not know it)" in records["unknown"].error
    assert "remove the field" in records["unknown"].error
    for ok in ("best-of-n", "text-only", "unset"):
        assert records[ok].error is None, ok
    assert records["best-of-n"].settings == {"n": 2}
