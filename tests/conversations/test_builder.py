"""A turn's prompt puts the conversation's earlier replies back as the tokens the model generated: the ids spell
exactly the chat template's text of the conversation, and turn k + 1's ids start with turn k's ids and its reply,
so the KV cache's blocks of turn k serve turn k + 1 (a property over random conversations and replies)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cbgen.conversations.builder import TurnBuilder
from cbgen.conversations.state import ASSISTANT, Conversation, Rules, Turn
from cbgen.records import PromptRecord
from cbgen.render.prompts import Renderer, RenderPlan


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


WORDS = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs", "Cc", "Cn", "Co")), min_size=1,
                max_size=30)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(users=st.lists(WORDS, min_size=2, max_size=4), data=st.data())
def test_each_turn_spells_the_conversation_and_starts_with_the_turn_before(tokenizer, users, data):
    renderer = Renderer(tokenizer, RenderPlan(vocab_size=len(tokenizer)))
    builder = TurnBuilder(renderer, None, {})
    rules = Rules(max_turns=len(users), listed_column="turns", simulated=False)
    conversation = Conversation.open(PromptRecord("c", 0, "here", row={"turns": users}), rules)
    eos = tokenizer.eos_token_id
    ordinary = [i for i in range(len(tokenizer)) if i not in tokenizer.added_tokens_decoder]
    before: list[int] | None = None
    while (role := conversation.next_role(rules)) is not None:
        assert role == ASSISTANT
        ids = builder.request(conversation, role).ids
        text = tokenizer.apply_chat_template(conversation.messages, tokenize=False, add_generation_prompt=True)
        assert tokenizer.decode(ids) == text  # the very text of the conversation
        if before is not None:  # and the turn before, with its reply, as its first tokens
            assert ids[:len(before)] == before
        reply = data.draw(st.lists(st.sampled_from(ordinary), min_size=1, max_size=12)) + [eos]
        content = tokenizer.decode(reply, skip_special_tokens=True)
        spelled = reply[:-1] if tokenizer.decode(reply[:-1]) == content else None
        conversation.add(Turn(ASSISTANT, content, reply, "stop", spelled=spelled), rules)
        before = ids + (spelled or []) if spelled is not None else None


def test_a_template_that_changes_a_reply_falls_back_to_its_text(tokenizer):
    """A template that strips earlier replies cannot hold their tokens: the prompt is the text, tokenized."""
    stripping = tokenizer.chat_template.replace("message['content']", "message['content'] | trim")
    renderer = Renderer(tokenizer, RenderPlan(vocab_size=len(tokenizer)))
    rules = Rules(max_turns=2, listed_column="turns", simulated=False)
    conversation = Conversation.open(PromptRecord("c", 0, "here", row={"turns": ["one", "two"]}), rules)
    conversation.next_role(rules)
    reply = tokenizer(" padded reply  ", add_special_tokens=False)["input_ids"]
    conversation.add(Turn(ASSISTANT, " padded reply  ", reply, "length", spelled=reply), rules)
    conversation.next_role(rules)
    tokenizer.chat_template, original = stripping, tokenizer.chat_template
    try:
        ids = TurnBuilder(renderer, None, {}).request(conversation, ASSISTANT).ids
        text = tokenizer.apply_chat_template(conversation.messages, tokenize=False, add_generation_prompt=True)
    finally:
        tokenizer.chat_template = original
    assert "padded reply<|im_end|>" in text  # the template did strip it
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
