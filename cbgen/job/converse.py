"""The steps of a chat job in the place of a generate job's: the job planned from its conversations' first turns
(the KV cache sized for them to grow to max_turns), and the conversations grown turn by turn through the engine
(cbgen.conversations), an earlier run's finished turns taken from its journal."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from cbgen.config import JobConfig
from cbgen.conversations.builder import TurnBuilder, simulated_user, user_settings
from cbgen.conversations.driver import Conversations
from cbgen.conversations.journal import TurnJournal
from cbgen.conversations.rows import ChatRows
from cbgen.conversations.state import Conversation, Rules
from cbgen.inputs.base import IdChoice
from cbgen.records import PromptRecord, Request

if TYPE_CHECKING:
    from cbgen.engine.job_plan import JobPlan
    from cbgen.model.load import LoadedModel

TEMPLATE_TOKENS = 32  # what the chat template adds around one message, at most (a header and an end token)


@dataclass
class PlannedConversations:
    plan: JobPlan
    conversations: Conversations
    rows: ChatRows
    journal: TurnJournal | None

    def close(self, complete: bool) -> None:
        """The run is over: a complete one needs its journal no more."""
        if self.journal is not None:
            self.journal.remove() if complete else self.journal.close()


def plan_conversations(job: JobConfig, loaded: LoadedModel, head: list[PromptRecord], used: frozenset[str],
                       total: int | None, ids: IdChoice, whole: bool, stop: threading.Event,
                       directory: Path | None = None, done: frozenset[str] | set[str] = frozenset()
                       ) -> PlannedConversations:
    """The chat job's plan from the rows read ahead (`head`), its conversations' driver, and the journal in
    `directory` (None: no journal, in memory) with the turns an earlier run finished of conversations not `done`."""
    from cbgen.job.plan import InputFacts, plan_job, plan_rendering
    from cbgen.job.request_settings import RequestSettings
    from cbgen.model.source import context_tokens
    from cbgen.render.prompts import Renderer
    from cbgen.render.templates import render_limits

    rendering = plan_rendering(job, loaded)
    renderer = Renderer(loaded.tokenizer, rendering.render)
    own = user_settings(job.chat)
    limits = render_limits(job, context_tokens(loaded.source))
    builder = TurnBuilder(renderer, simulated_user(job.chat), own, limits, stop)
    rules = Rules.of(job.chat)
    first = _first_turns(builder, rules, head)
    facts = InputFacts(used | frozenset(own), tuple(first), total, whole=whole, ids=ids,
                       grows_by=_growth(job, loaded, rules, head))
    plan = plan_job(job, facts, loaded, rendering)
    journal = TurnJournal(directory) if directory is not None else None
    conversations = Conversations(builder, rules, RequestSettings(job, plan), plan.engine.eos_token_ids,
                                  window=plan.engine.settings.max_in_flight, journal=journal,
                                  resumed=journal.read(done) if journal is not None else None)
    return PlannedConversations(plan, conversations, ChatRows(plan.columns), journal)


def _first_turns(builder: TurnBuilder, rules: Rules, head: list[PromptRecord]) -> list[Request]:
    """The first turn's request of each conversation read ahead (on copies: the conversations start anew)."""
    found = []
    for record in head:
        conversation = Conversation.open(record, rules)
        role = conversation.next_role(rules)
        if role is not None:
            found.append(builder.request(conversation, role))
    return found


def _growth(job: JobConfig, loaded: LoadedModel, rules: Rules, head: list[PromptRecord]) -> int:
    """The most tokens a conversation's prompt gains after its first turn: every later reply and user turn, each
    in its template."""
    g, chat = job.generation, job.chat
    if rules.simulated:
        user = chat.user_max_new_tokens or g.max_new_tokens
    else:
        tokenizer = loaded.tokenizer
        user = max((len(tokenizer(turn, add_special_tokens=False)["input_ids"])
                    for record in head for turn in _listed(record, rules)), default=0)
    return (rules.max_turns - 1) * (g.max_new_tokens + user + 2 * TEMPLATE_TOKENS) + g.max_new_tokens


def _listed(record: PromptRecord, rules: Rules) -> list[str]:
    conversation = Conversation.open(record, rules)
    return conversation.listed or []

