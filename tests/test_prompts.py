"""Rendering and the prefix-aware submission order."""

from __future__ import annotations

import random

import pytest

from cbgen.records import PromptRecord, Request
from cbgen.render.prompts import Renderer, RenderPlan, prefix_aware_order


def request(i: int, ids: list[int] | None, error: str | None = None) -> Request:
    return Request(PromptRecord(id=str(i), index=i, location=f"p.jsonl:{i + 1}"), input_ids=ids, error=error)


def test_every_request_exactly_once_and_leaders_first():
    rng = random.Random(0)
    prefixes = [[p] * 8 for p in range(4)]
    requests = [request(i, prefixes[rng.randrange(4)] + [rng.randrange(100) for _ in range(5)]) for i in range(50)]
    requests.insert(10, request(999, None, error="bad row"))
    ordered = list(prefix_aware_order(requests, key_tokens=8, lookahead=20))
    assert sorted(r.record.id for r in ordered) == sorted(r.record.id for r in requests)
    assert len(ordered) == len(requests)
    # within each window of 20 admitted requests, the first one of each prefix group precedes all the others
    windows = [r for r in ordered if r.input_ids is not None]
    for start in range(0, len(windows), 20):
        window = windows[start : start + 20]
        seen_leader: set[tuple[int, ...]] = set()
        followers_started = False
        for r in window:
            key = tuple(r.input_ids[:8])
            if key not in seen_leader:
                assert not followers_started, "a leader came after a follower"
                seen_leader.add(key)
            else:
                followers_started = True


def test_followers_are_grouped_by_prefix():
    requests = [request(i, [i % 3] * 4 + [i]) for i in range(9)]
    ordered = list(prefix_aware_order(requests, key_tokens=4, lookahead=100))
    leaders, followers = ordered[:3], ordered[3:]
    assert {r.input_ids[0] for r in leaders} == {0, 1, 2}
    keys = [r.input_ids[0] for r in followers]
    assert keys == sorted(keys)  # each group contiguous


def test_longer_generations_lead_within_a_window():
    caps = [16, None, 256, 64, 256, None]  # None: the job's default (100)
    requests = [request(i, [i, i + 1]) for i in range(6)]
    for r, cap in zip(requests, caps):
        r.max_new_tokens = cap
    ordered = list(prefix_aware_order(requests, key_tokens=8, lookahead=4, default_max_new_tokens=100))
    # windows of 4: [16, 100, 256, 64] -> 256, 100, 64, 16; then [256, 100]; equal caps keep input order
    assert [r.record.id for r in ordered] == ["2", "1", "3", "0", "4", "5"]


def test_failed_requests_pass_through_immediately():
    requests = [request(0, [1, 2]), request(1, None, error="x"), request(2, [1, 3])]
    ordered = list(prefix_aware_order(requests, key_tokens=1, lookahead=100))
    assert ordered[0].record.id == "1"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_text_is_wrapped_in_the_chat_template_unless_raw(tokenizer):
    record = PromptRecord(id="0", index=0, location="x", prompt="Hello")
    chat = Renderer(tokenizer, RenderPlan(len(tokenizer))).render(record).input_ids
    raw = Renderer(tokenizer, RenderPlan(len(tokenizer), raw_prompts=True)).render(record).input_ids
    assert "<|im_start|>user" in tokenizer.decode(chat) and tokenizer.decode(chat).rstrip().endswith("assistant")
    assert tokenizer.decode(raw).endswith("Hello") and "<|im_start|>" not in tokenizer.decode(raw)


def test_template_failures_are_row_errors(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = (
        "{% if messages|length > 1 %}{{ raise_exception('Conversation roles must alternate') }}{% endif %}"
        "{{ messages[0]['content'] }}"
    )
    renderer = Renderer(tokenizer, RenderPlan(len(tokenizer)))
    turns = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    failed = renderer.render(PromptRecord(id="0", index=0, location="x", messages=turns))
    assert failed.input_ids is None
    assert failed.error == "cannot render the prompt: Conversation roles must alternate"
    fine = renderer.render(PromptRecord(id="1", index=1, location="x", messages=turns[:1]))
    assert fine.error is None and fine.input_ids
