"""A tiny random model whose tokenizer can offer tools: a chat template written here (tools in the system turn,
calls as <tool_call>{json}</tool_call>, tool results as their own turn, and a `<think>` opening when
enable_thinking is set) and a response template in transformers' format that parses those replies back. The
`tool_model_dir` fixture (tests/conftest.py) makes it once per session."""

from __future__ import annotations

import json
import shutil

CHAT_TEMPLATE = """
{%- if reasoning_effort %}<|im_start|>system
Reasoning effort: {{ reasoning_effort }}<|im_end|>
{% endif %}
{%- if tools %}<|im_start|>system
You may call these functions:
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
Call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{% for call in message.tool_calls %}<tool_call>{{ {"name": call.function.name,
                                                    "arguments": call.function.arguments} | tojson }}</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>tool
{{ message.content }}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking %}<think>{% endif %}
{%- endif %}
"""

RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "reasoning_content": {"open": "<think>", "close": "</think>", "content": "text"},
        "tool_calls": {"open_pattern": r"\s*<tool_call>", "close": "</tool_call>", "repeats": True,
                       "content": "json", "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"\s*(?:<\|im_end\|>)", "content": "text"},
    },
}


def make_tool_model(tiny_model_dir, folder):
    """The tiny model copied into `folder`, with the chat template and response template above."""
    from transformers import AutoTokenizer

    for item in tiny_model_dir.iterdir():
        if item.is_file():
            shutil.copy(item, folder / item.name)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 1024}))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.response_template = RESPONSE_TEMPLATE
    tokenizer.save_pretrained(folder)
    assert AutoTokenizer.from_pretrained(folder).response_template == RESPONSE_TEMPLATE
    return folder
