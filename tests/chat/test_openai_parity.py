"""OpenAI batch inputs of the kinds vLLM's run-batch tests use (tests/entrypoints/openai/test_run_batch.py there),
written here in our own words and data, with the properties that test asserts: every output line validates with the
`openai` package's types, good lines have no error, required tool calls are present and well formed, an empty input
gives an empty output and exit 0. And one vLLM fails on: a malformed line among good ones does not fail the batch."""

from __future__ import annotations

import json

import jsonschema
import pytest

from cbgen.cli import run_cli
from tests.helpers import write_jsonl

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 12},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                                       "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}
ASK = [{"role": "user", "content": "What is the weather in Lisbon?"}]


def line(custom_id, body, url="/v1/chat/completions", **extra):
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body, **extra}


def run(model_dir, path, out, *args) -> int:
    return run_cli(["run", str(path), "-o", str(out), "--model", str(model_dir), "--dtype", "float32", "-q",
                    "--output-format", "openai", *map(str, args)])


def answers(out) -> dict[str, dict]:
    from openai.types.chat import ChatCompletion
    from openai.types.shared import ErrorObject

    lines = {}
    for path in sorted(out.glob("part-*.jsonl")):
        for text in path.read_text().splitlines():
            data = json.loads(text)
            assert set(data) == {"id", "custom_id", "response", "error"}
            if data["response"]["status_code"] == 200:
                ChatCompletion.model_validate(data["response"]["body"])
            else:
                ErrorObject.model_validate(data["response"]["body"]["error"])
            lines[data["custom_id"]] = data
    return lines


@pytest.mark.slow
def test_a_bad_first_line_does_not_hide_an_openai_file(tiny_model_dir, tmp_path, capsys):
    rows = [{"method": "POST", "url": "/v1/chat/completions", "body": {"messages": ASK, "max_tokens": 4}},
            line("good", {"messages": ASK, "max_tokens": 4}),
            line("no-body", None) | {"body": None},
            {"custom_id": "no-url", "method": "POST", "body": {"messages": ASK}},
            '{"custom_id": "broken", "method": "POST", ',
            line("bad-url", {"messages": ASK}, url="/bad_url"),
            line("also-good", {"messages": ASK, "max_tokens": 4, "stream": "True", "model": "some-model"})]
    path = tmp_path / "batch.jsonl"
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    assert run(tiny_model_dir, path, tmp_path / "out", "--no-quiet") == 1  # some lines failed
    assert "read as OpenAI batch lines: 6 of the first 6 lines that parse carry OpenAI request-line keys" \
        in capsys.readouterr().err
    out = answers(tmp_path / "out")
    assert out["good"]["response"]["status_code"] == 200 and out["good"]["error"] is None
    assert out["also-good"]["response"]["status_code"] == 200
    errors = {key: out[key]["response"]["body"]["error"]["message"] for key in out
              if out[key]["response"]["status_code"] != 200}
    assert len(errors) == 5 and all(out[k]["response"]["status_code"] == 400 for k in errors)
    assert any("has no 'custom_id'" in message for message in errors.values())
    assert "'body' must be an object" in errors["no-body"] and "has no 'url'" in errors["no-url"]
    assert "'url' must be" in errors["bad-url"]


def test_an_empty_file_gives_an_empty_output(tiny_model_dir, tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    assert run(tiny_model_dir, path, tmp_path / "out", "--input-format", "openai") == 0
    assert not answers(tmp_path / "out")


@pytest.mark.slow
def test_required_and_named_tool_calls(tool_model_dir, tmp_path):
    path = write_jsonl(tmp_path / "b.jsonl", [
        line("required", {"messages": ASK, "tools": [WEATHER], "tool_choice": "required", "max_tokens": 200}),
        line("named", {"messages": ASK, "tools": [WEATHER, TIME], "max_tokens": 200,
                       "tool_choice": {"type": "function", "function": {"name": "get_time"}}}),
        line("unknown", {"messages": ASK, "tools": [WEATHER], "tool_choice": {"type": "function",
                                                                             "function": {"name": "nope"}}}),
    ])
    assert run(tool_model_dir, path, tmp_path / "out") == 1
    out = answers(tmp_path / "out")
    for key, tool in (("required", WEATHER), ("named", TIME)):
        assert out[key]["error"] is None
        choice = out[key]["response"]["body"]["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        (call,) = choice["message"]["tool_calls"]
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert call["function"]["name"] == tool["function"]["name"]
        jsonschema.validate(json.loads(call["function"]["arguments"]), tool["function"]["parameters"])
    assert "not among the request's tools" in out["unknown"]["response"]["body"]["error"]["message"]


def test_tool_choice_none_hides_the_tools_and_turns_with_calls_render(tool_model_dir, tmp_path):
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Lisbon", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees and sunny"}]
    path = write_jsonl(tmp_path / "b.jsonl", [
        line("none", {"messages": ASK, "tools": [WEATHER], "tool_choice": "none", "max_tokens": 3}),
        line("auto", {"messages": ASK, "tools": [WEATHER], "max_tokens": 3}),
        line("history", {"messages": history, "tools": [WEATHER], "max_tokens": 3}),
    ])
    assert run(tool_model_dir, path, tmp_path / "out") == 0
    out = answers(tmp_path / "out")
    usage = {key: out[key]["response"]["body"]["usage"]["prompt_tokens"] for key in out}
    # each prompt is the one the model's own chat template renders (transformers' apply_chat_template): without the
    # tools for tool_choice none; with the assistant's call and the tool's result for the history
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tool_model_dir)

    def rendered(messages, tools):
        return len(tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                                 return_dict=True)["input_ids"])

    # chat templates take a call's arguments as an object (transformers' chat-template docs), OpenAI sends a string
    as_templates_take_it = [*ASK, {**history[1], "tool_calls": [{**history[1]["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": {"city": "Lisbon", "unit": "celsius"}}}]}, history[2]]
    assert usage == {"none": rendered(ASK, None), "auto": rendered(ASK, [WEATHER]),
                     "history": rendered(as_templates_take_it, [WEATHER])}
    assert usage["none"] < usage["auto"] < usage["history"]
    without_call = [m for m in as_templates_take_it if not m.get("tool_calls")]  # what a dropped call would render
    assert usage["history"] != rendered(without_call, [WEATHER])


def test_tools_without_a_response_template_are_a_clear_400(tiny_model_dir, tmp_path):
    path = write_jsonl(tmp_path / "b.jsonl", [line("t", {"messages": ASK, "tools": [WEATHER]}),
                                              line("plain", {"messages": ASK, "max_tokens": 2})])
    assert run(tiny_model_dir, path, tmp_path / "out") == 1
    out = answers(tmp_path / "out")
    assert out["t"]["response"]["status_code"] == 400
    assert "no response template" in out["t"]["response"]["body"]["error"]["message"]
    assert out["plain"]["response"]["status_code"] == 200


@pytest.mark.parametrize("thinking", [True, False])
def test_reasoning_is_apart_from_the_content(tool_model_dir, tmp_path, thinking):
    """The random model is held to a fixed reply by a regex, so that what it 'thinks' is known."""
    reply = "I should answer.</think>Sunny." if thinking else "Sunny."
    body = {"messages": ASK, "max_tokens": 30, "chat_template_kwargs": {"enable_thinking": thinking},
            "response_format": {"type": "regex", "pattern": reply.replace(".", r"\.")}}
    path = write_jsonl(tmp_path / "b.jsonl", [line("r", body)])
    assert run(tool_model_dir, path, tmp_path / "out") == 0
    message = answers(tmp_path / "out")["r"]["response"]["body"]["choices"][0]["message"]
    assert message["content"] == "Sunny."
    assert message.get("reasoning_content") == ("I should answer." if thinking else None)


def test_cbgen_rows_carry_reasoning_and_tool_calls(tool_model_dir, tmp_path):
    from cbgen.rows import read_shards

    path = write_jsonl(tmp_path / "b.jsonl", [
        line("call", {"messages": ASK, "tools": [WEATHER], "tool_choice": "required", "max_tokens": 200})])
    assert run_cli(["run", str(path), "-o", str(tmp_path / "out"), "--model", str(tool_model_dir), "-q",
                    "--output-format", "parquet"]) == 0
    (row,) = read_shards(tmp_path / "out")
    assert row["reasoning"] is None and row["text"] is None
    (call,) = row["tool_calls"]
    assert call["name"] == "get_weather" and json.loads(call["arguments"])["unit"] in ("celsius", "fahrenheit")


def test_a_think_response_template_for_models_without_one(tiny_model_dir, tmp_path):
    from cbgen.rows import read_shards

    path = write_jsonl(tmp_path / "p.jsonl", [{"id": "q", "prompt": "Is it sunny?"}])
    assert run_cli(["run", str(path), "-o", str(tmp_path / "out"), "--model", str(tiny_model_dir), "-q",
                    "--response-template", "think", "--regex", r"<think>Let me see\.</think>Yes\.",
                    "--max-new-tokens", 30]) == 0
    (row,) = read_shards(tmp_path / "out")
    assert (row["reasoning"], row["text"], row["tool_calls"]) == ("Let me see.", "Yes.", None)


def test_reasoning_effort_and_template_kwargs_reach_the_template(tool_model_dir, tmp_path):
    path = write_jsonl(tmp_path / "b.jsonl", [
        line("plain", {"messages": ASK, "max_tokens": 2}),
        line("effort", {"messages": ASK, "max_tokens": 2, "reasoning_effort": "high"})])
    assert run(tool_model_dir, path, tmp_path / "a") == 0
    first = {k: v["response"]["body"]["usage"]["prompt_tokens"] for k, v in answers(tmp_path / "a").items()}
    assert first["plain"] < first["effort"]
    assert run(tool_model_dir, path, tmp_path / "b", "--chat-template-kwargs", '{"reasoning_effort": "high"}') == 0
    second = {k: v["response"]["body"]["usage"]["prompt_tokens"] for k, v in answers(tmp_path / "b").items()}
    assert second["plain"] == second["effort"] == first["effort"]  # the job's variables, and the line's over them
