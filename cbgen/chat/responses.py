"""Separating a chat reply into its parts with the model's response template (transformers' response parsing):
`reasoning_content` (a reasoning model's thinking), `tool_calls` and `content`.

The template is, in order: the one the job names (`--response-template FILE`, or `think` for `<think>...</think>`
reasoning before the answer), the tokenizer's own `response_template`, or transformers' built-in one for the
model's architecture (Qwen 2/3, Qwen 3.5, Gemma 4). A model with none gets no parsing: its replies stay whole text,
and a request that offers tools is refused (there would be no way to find the calls).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cbgen.errors import CbgenError


@dataclass(frozen=True)
class ResponseTemplate:
    """A response template (transformers' format, `spec`) and how cbgen hands it a reply. `reply_only`: parse the
    generated text alone (no prompt prefix), carrying over a `<think>` the prompt opened and dropping special
    tokens such as end-of-turn markers, for templates written for the reply rather than the whole conversation."""

    spec: dict[str, Any]
    reply_only: bool = False

    @property
    def reasons(self) -> bool:
        """It separates a reasoning model's thinking from the answer."""
        return "reasoning_content" in (self.spec.get("fields") or {})

    @property
    def calls(self) -> bool:
        """It finds tool calls in a reply."""
        return "tool_calls" in (self.spec.get("fields") or {})


THINK = ResponseTemplate(  # --response-template think: the reasoning models' common <think>...</think> first
    {
        "defaults": {"role": "assistant"},
        "start_anchor_pattern": r"\Z",  # the reply alone is parsed
        "fields": {
            "reasoning_content": {"open": "<think>", "close": "</think>", "content": "text"},
            "content": {"content": "text"},
        },
    },
    reply_only=True,
)


def load_template(value: str | None) -> ResponseTemplate | None:
    """The job's `--response-template`: None, `think`, or a JSON file (checked by transformers' own loader)."""
    if value is None:
        return None
    if value == "think":
        return THINK
    path = Path(value).expanduser()
    try:
        template = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise CbgenError(f"--response-template: cannot read '{value}': {e.strerror or e}") from None
    except ValueError as e:
        raise CbgenError(f"--response-template: '{value}' is not JSON: {e}") from None
    return ResponseTemplate(check_template(template, f"--response-template '{value}'"))


def check_template(template: Any, where: str) -> dict[str, Any]:
    from transformers.utils.chat_parsing.response_templates import load_response_template

    try:
        load_response_template(template)
    except (ValueError, TypeError) as e:
        raise CbgenError(f"{where} is not a valid response template: {e}") from None
    return template


def model_template(tokenizer: Any, model_type: str | None, chosen: ResponseTemplate | None
                   ) -> ResponseTemplate | None:
    """The response template replies are parsed with, or None (see the module's docstring)."""
    if chosen is not None:
        return chosen
    own = getattr(tokenizer, "response_template", None)
    if own is not None:
        return ResponseTemplate(own)
    try:  # transformers' table for tokenizers that ship none; a private name, so its absence is not an error
        from transformers.cli.serving.utils import _RESPONSE_TEMPLATE_FALLBACKS
    except ImportError:
        return None
    fallback = next((t for types, t in _RESPONSE_TEMPLATE_FALLBACKS.items() if model_type in types), None)
    return ResponseTemplate(fallback) if fallback is not None else None


@dataclass
class Reply:
    content: str | None
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI's {"id", "type", "function"}


class ReplyParser:
    """Parses generated tokens into a Reply. `reasons`: the template separates reasoning, so every chat reply is
    parsed; otherwise only replies to requests that offered tools are."""

    def __init__(self, tokenizer: Any, template: ResponseTemplate) -> None:
        self.tokenizer = tokenizer
        self.template = template

    def applies(self, tools: list | None) -> bool:
        return self.template.reasons or (bool(tools) and self.template.calls)

    def parse(self, prompt_ids: list[int], token_ids: list[int], tools: list | None, call_id: str) -> Reply:
        text = self.tokenizer.decode(token_ids, skip_special_tokens=False)
        prefix = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        if self.template.reply_only:
            if prefix.rfind("<think>") > prefix.rfind("</think>"):  # the prompt opened the thinking
                text = "<think>" + text
            prefix = ""
            for special in getattr(self.tokenizer, "all_special_tokens", ()):  # end-of-turn markers, not content
                text = text.replace(special, "")
        try:
            parsed = self.tokenizer.parse_response(text, self.template.spec, prefix=prefix, tools=tools or None)
        except Exception:  # noqa: BLE001 - a reply the template cannot parse (cut short, malformed call) stays text
            clean = self.tokenizer.decode(token_ids, skip_special_tokens=True)
            return Reply(clean)
        calls = []
        for i, call in enumerate(parsed.get("tool_calls") or []):
            function = call.get("function", call) if isinstance(call, dict) else {}
            arguments = function.get("arguments", {})
            calls.append({"id": f"call_{call_id}_{i}", "type": "function",
                          "function": {"name": str(function.get("name", "")),
                                       "arguments": arguments if isinstance(arguments, str)
                                       else json.dumps(arguments, ensure_ascii=False)}})
        content = parsed.get("content")
        if isinstance(content, str):
            content = content.strip() or None
        reasoning = parsed.get("reasoning_content")
        return Reply(content if content or not calls else None,
                     reasoning.strip() if isinstance(reasoning, str) else None, calls)
